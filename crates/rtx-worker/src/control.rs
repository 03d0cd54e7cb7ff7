//! The sidecar's control plane: one kameo actor owns the control state (REGISTER, health,
//! stats, map loads) and a tonic service answers the control API (proto/control.proto),
//! PREPARE, RELEASE and ABORT included, with the failure's category in every status.

use super::*;
use moelane_proto::control::sidecar_server::Sidecar;

/// The sidecar actor: owns the control state.
#[derive(Actor)]
pub struct SidecarActor {
    pub(crate) core: Arc<SidecarCore>,
    pub(crate) ckpt_dir: PathBuf,
    /// Address of the TCP data listener, when one was started.
    pub(crate) tcp_data: Option<SocketAddr>,
    pub(crate) shm_dir: PathBuf,
    pub(crate) shm_cap: u64,
    pub(crate) shm_count: u64,
    /// Stops the NCCL link's thread of the last registration (a new one replaces it).
    pub(crate) nccl_stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The last Health answer, given again while a swap holds the state for writing (a
    /// heartbeat must not stall behind a GPU upload).
    pub(crate) last_health: Option<SidecarHealthReply>,
    /// When the recent Register calls came (the last second's), for the rate limit.
    pub(crate) registers: std::collections::VecDeque<std::time::Instant>,
    /// The primary this sidecar serves ([`Owner`]).
    pub(crate) owner: Owner,
}

/// A sidecar serves one primary. A primary that registers while another is registered
/// replaces it (a restarted or replacement primary must get the sidecar); the replaced one
/// is refused for as long as the one that replaced it is heard from, so two primaries
/// pointed at one sidecar do not take it from each other forever.
#[derive(Default)]
pub(crate) struct Owner {
    /// The registered primary's id and when it was last heard from (its Register or heartbeat).
    current: Option<(String, std::time::Instant)>,
    /// Primaries replaced, each with the one that replaced it.
    replaced: std::collections::HashMap<String, String>,
}

/// How long the primary that replaced another must have been silent before the replaced one
/// may register again (its heartbeats come every 0.5 s).
const OWNER_SILENT: std::time::Duration = std::time::Duration::from_secs(5);

impl Owner {
    /// A heartbeat of primary `id`.
    fn heard(&mut self, id: &str) {
        if let Some((cur, seen)) = &mut self.current {
            if !id.is_empty() && cur == id {
                *seen = std::time::Instant::now();
            }
        }
    }

    /// Whether primary `id` may register now: not while the primary that replaced it is
    /// heard from (an error naming why).
    fn check(&self, id: &str) -> Result<(), Status> {
        let Some((cur, seen)) = &self.current else {
            return Ok(());
        };
        let by_live = !id.is_empty()
            && cur != id
            && self.replaced.get(id).is_some_and(|by| by == cur)
            && seen.elapsed() < OWNER_SILENT;
        if by_live {
            return Err(Category::BadRequest.status(format!(
                "this sidecar serves another primary ({}), which replaced this one: a sidecar \
                 serves one primary; stop one of them or give each its own sidecar",
                short_id(cur)
            )));
        }
        Ok(())
    }

    /// Primary `id` registered (the sidecar obeys it now): it is the owner, the one before
    /// it (if another) replaced.
    fn took(&mut self, id: &str) {
        if id.is_empty() {
            // a build from before primaries said who they are: nothing to tell apart
            self.current = None;
            return;
        }
        if let Some((cur, _)) = &self.current {
            if cur != id {
                tracing::warn!(
                    primary = %short_id(id),
                    replaced = %short_id(cur),
                    "a primary registered while another was registered: it replaces it (the \
                     replaced one is refused while this one is alive)"
                );
                // (bounded: the replaced of long ago are forgotten)
                if self.replaced.len() >= 64 {
                    self.replaced.clear();
                }
                self.replaced.insert(cur.clone(), id.to_string());
            }
        }
        self.replaced.remove(id);
        self.current = Some((id.to_string(), std::time::Instant::now()));
    }
}

/// A primary's id as logs and errors show it.
fn short_id(id: &str) -> String {
    id.chars().take(16).collect()
}

/// Most Register calls a sidecar answers in one second (a primary registers at start and
/// after a lost link, a few times a second at most).
pub const REGISTER_PER_SECOND: usize = 20;

/// Most shared-memory segments a sidecar serves at once (attached or waiting for their
/// primary): a primary that restarts leaves its old one for the moments until it is seen gone.
pub const MAX_SHM_SEGMENTS: usize = 8;

pub struct RegisterMsg(pub RegisterRequest);
/// A Health call; the primary whose heartbeat it is (empty: another caller).
pub struct HealthMsg(pub String);
pub struct StatsMsg;
pub struct LoadMapMsg(pub String);

impl Message<RegisterMsg> for SidecarActor {
    type Reply = Result<RegisterReply, Status>;
    async fn handle(
        &mut self,
        RegisterMsg(r): RegisterMsg,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let now = std::time::Instant::now();
        while self
            .registers
            .front()
            .is_some_and(|t| now.duration_since(*t) >= std::time::Duration::from_secs(1))
        {
            self.registers.pop_front();
        }
        if self.registers.len() >= REGISTER_PER_SECOND {
            return Err(Category::Overloaded.status(format!(
                "more than {REGISTER_PER_SECOND} Register calls in the last second: refused; \
                 try again in a second"
            )));
        }
        self.registers.push_back(now);
        moelane_proto::check_protocol("primary", r.protocol, &r.build)
            .map_err(|e| Category::BadRequest.status(e))?;
        if r.model != self.core.model {
            return Err(Category::BadRequest.status(format!(
                "primary serves model {:?}, this sidecar holds {:?}",
                r.model, self.core.model
            )));
        }
        let map = if r.rowmap_json.is_empty() {
            None
        } else {
            let m = Rowmap::from_json(&r.rowmap_json)
                .map_err(|e| Category::BadRequest.status(e.to_string()))?;
            let st = self
                .core
                .state
                .read()
                .map_err(|_| Category::Internal.status("state poisoned"))?;
            let (layers, experts) = (st.map.layers(), st.map.experts());
            drop(st);
            Some(
                m.validate(&self.core.model, layers, experts, None)
                    .map_err(|e| Category::BadRequest.status(e.to_string()))?,
            )
        };
        // one primary at a time
        self.owner.check(&r.primary)?;
        if map.is_none() && r.map_epoch != self.core.epoch() {
            return Err(Category::EpochMismatch.status(format!(
                "primary is on map epoch {}, this sidecar on {}",
                r.map_epoch,
                self.core.epoch()
            )));
        }
        let core = self.core.clone();
        let inc = r.incarnation;
        let highest_epoch = tokio::task::spawn_blocking(move || core.register(inc, map))
            .await
            .map_err(|e| Category::Internal.status(e.to_string()))?
            .map_err(swap_status)?;
        self.owner.took(&r.primary);
        let epoch = self.core.epoch();
        let cold = {
            let st = self
                .core
                .state
                .read()
                .map_err(|_| Category::Internal.status("state poisoned"))?;
            (0..st.bank.layers())
                .map(|l| st.bank.resident(l))
                .sum::<usize>() as u32
        };
        let endpoint = match r.link.as_str() {
            "tcp" => self.tcp_data.map(|a| a.to_string()).ok_or_else(|| {
                Category::BadRequest
                    .status("this sidecar has no TCP data listener (start it with --data ADDR)")
            })?,
            "shm" => {
                // a repeated Register of one incarnation never gets here (the protocol refuses
                // it as late or duplicated, changing nothing); new ones are bounded
                let live = moelane_link::shm::live_segments();
                if live >= MAX_SHM_SEGMENTS {
                    return Err(Category::Overloaded.status(format!(
                        "{live} shared-memory links are open or waiting for their primary (at \
                         most {MAX_SHM_SEGMENTS}); one nobody attaches is removed 30 s after it \
                         was made"
                    )));
                }
                self.shm_count += 1;
                let path =
                    self.shm_dir
                        .join(format!("moelane-{}-{}", std::process::id(), self.shm_count));
                moelane_link::shm::serve(&path, self.shm_cap, self.core.clone())
                    .map_err(|e| Category::Unavailable.status(e.to_string()))?;
                path.display().to_string()
            }
            "nccl" => self.open_nccl()?,
            "ipc" => self.open_ipc(&r.link_params)?,
            "" => String::new(),
            other => {
                return Err(Category::BadRequest.status(format!(
                    "unknown link kind {other:?} (tcp, shm, nccl or ipc)"
                )))
            }
        };
        Ok(RegisterReply {
            link: r.link,
            endpoint,
            map_epoch: epoch,
            cold_experts: cold,
            highest_epoch,
            protocol: moelane_proto::PROTOCOL,
            build: moelane_proto::BUILD.into(),
        })
    }
}

impl SidecarActor {
    /// A new NCCL communicator for a registering primary: its id (the REGISTER reply's
    /// endpoint) and a thread that joins it as rank 1 and serves requests; the link of an
    /// earlier registration is closed.
    fn open_nccl(&mut self) -> Result<String, Status> {
        if !moelane_engine::gpu::COMPILED {
            return Err(engine_status(moelane_engine::Error::NotCompiledWithCuda));
        }
        let ordinal = self.core.device.ordinal().ok_or_else(|| {
            Category::BadRequest.status(
                "the nccl link needs the sidecar on a GPU (start it with --sidecar-device cuda:N)",
            )
        })?;
        if let Some(s) = self.nccl_stop.take() {
            s.store(true, Ordering::Release);
        }
        let id = moelane_link::nccl::NcclId::new().map_err(engine_status)?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        moelane_link::nccl::serve(
            ordinal,
            id,
            self.core.clone(),
            stop.clone(),
            std::time::Duration::from_secs(60),
        )
        .map_err(|e| Category::Unavailable.status(e.to_string()))?;
        self.nccl_stop = Some(stop);
        Ok(id.to_hex())
    }
}

impl SidecarActor {
    /// The ipc link for a registering primary: its reply box opened from `params`, a
    /// request box of the same shape (checked against this sidecar's model) offered back,
    /// and a thread that serves the device mailbox; the link of an earlier registration is
    /// closed.
    #[cfg(feature = "cuda")]
    fn open_ipc(&mut self, params: &str) -> Result<String, Status> {
        use moelane_engine::tier::ColdService as _;
        let gpu = self.core.cuda().ok_or_else(|| {
            Category::BadRequest.status(
                "the ipc link needs the sidecar on a GPU (start it with --sidecar-device cuda:N)",
            )
        })?;
        let (layers, experts, hidden) = {
            let st = self
                .core
                .state
                .read()
                .map_err(|_| Category::Internal.status("state poisoned"))?;
            (st.map.layers(), st.map.experts(), st.bank.hidden)
        };
        // the shape is checked before anything is opened or allocated
        let l = moelane_link::ipc::line_layout(params)
            .map_err(|e| Category::BadRequest.status(e.to_string()))?;
        if (l.layers, l.experts, l.hidden) != (layers, experts, hidden) {
            return Err(Category::BadRequest.status(format!(
                "the primary's ipc mailbox is for {} MoE layers x {} experts of hidden size {}; \
                 this sidecar's model has {layers} x {experts} of {hidden}",
                l.layers, l.experts, l.hidden
            )));
        }
        let mut end = moelane_link::ipc::SidecarEnd::open(gpu, params)
            .map_err(|e| Category::BadRequest.status(e.to_string()))?;
        let offer = end
            .offer()
            .map_err(|e| Category::Unavailable.status(e.to_string()))?;
        if let Some(s) = self.nccl_stop.take() {
            s.store(true, Ordering::Release);
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (svc, stop2): (Arc<dyn ColdService>, _) = (self.core.clone(), stop.clone());
        std::thread::Builder::new()
            .name("moelane-ipc-link".into())
            .spawn(move || {
                if let Err(e) = end.serve(&svc, &stop2) {
                    if !stop2.load(Ordering::Acquire) {
                        tracing::warn!("the ipc link ended: {e}");
                    }
                }
            })
            .map_err(|e| Category::Unavailable.status(format!("starting the link thread: {e}")))?;
        self.nccl_stop = Some(stop);
        Ok(offer)
    }

    #[cfg(not(feature = "cuda"))]
    fn open_ipc(&mut self, params: &str) -> Result<String, Status> {
        let _ = params;
        Err(engine_status(moelane_engine::Error::NotCompiledWithCuda))
    }
}

impl Message<HealthMsg> for SidecarActor {
    type Reply = Result<SidecarHealthReply, Status>;
    async fn handle(
        &mut self,
        HealthMsg(primary): HealthMsg,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.owner.heard(&primary);
        let draining = self.core.draining.load(std::sync::atomic::Ordering::SeqCst);
        let fresh = match self.core.state.try_read() {
            Ok(st) => Some(SidecarHealthReply {
                ok: !draining,
                draining,
                model: self.core.model.clone(),
                map_epoch: st.epochs.epoch,
                staged: st.epochs.next.is_some(),
                staged_epoch: st.epochs.next.unwrap_or(0),
                incarnation: st.epochs.incarnation,
            }),
            Err(std::sync::TryLockError::WouldBlock) => None,
            Err(std::sync::TryLockError::Poisoned(_)) => {
                return Err(Category::Internal.status("the sidecar's state is poisoned"))
            }
        };
        let reply = match (fresh, &self.last_health) {
            (Some(r), _) => r,
            // busy swapping: what it said last, with the drain as it is now
            (None, Some(last)) => SidecarHealthReply {
                ok: !draining,
                draining,
                ..last.clone()
            },
            (None, None) => SidecarHealthReply {
                ok: !draining,
                draining,
                model: self.core.model.clone(),
                ..Default::default()
            },
        };
        self.last_health = Some(reply.clone());
        Ok(reply)
    }
}

impl Message<StatsMsg> for SidecarActor {
    type Reply = Result<SidecarStatsReply, Status>;
    async fn handle(&mut self, _: StatsMsg, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let c = &self.core;
        Ok(SidecarStatsReply {
            requests: c.requests.load(Ordering::Relaxed),
            picks: c.picks.load(Ordering::Relaxed),
            compute_ns: c.compute_ns.load(Ordering::Relaxed),
            bytes_in: c.bytes_in.load(Ordering::Relaxed),
            bytes_out: c.bytes_out.load(Ordering::Relaxed),
            weight_bytes: c.weight_bytes.load(Ordering::Relaxed),
            host_read_bytes_per_second: c.host_read_bw.load(Ordering::Relaxed),
            prepares_answered: c.answered.prepare.load(Ordering::Relaxed),
            releases_answered: c.answered.release.load(Ordering::Relaxed),
            aborts_answered: c.answered.abort.load(Ordering::Relaxed),
        })
    }
}

impl Message<LoadMapMsg> for SidecarActor {
    type Reply = Result<LoadMapReply, Status>;
    async fn handle(
        &mut self,
        LoadMapMsg(json): LoadMapMsg,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let bad = |e: String| Category::BadRequest.status(e);
        let map: Rowmap = serde_json_from(&json).map_err(bad)?;
        let ckpt = Checkpoint::open(&self.ckpt_dir)
            .map_err(|e| Category::Internal.status(e.to_string()))?;
        let c = &ckpt.config;
        let valid = map
            .validate(&ckpt.id, c.moe_layers().len(), c.num_experts, None)
            .map_err(|e| bad(e.to_string()))?;
        {
            // an epoch never goes backwards, and a prepared swap is finished or aborted first
            let st = self
                .core
                .state
                .read()
                .map_err(|_| Category::Internal.status("state poisoned"))?;
            if valid.map == st.map.map {
                // the map it serves already: nothing to load
                return Ok(LoadMapReply {
                    map_epoch: valid.epoch(),
                });
            }
            if valid.epoch() <= st.epochs.highest() {
                return Err(Category::EpochMismatch.status(format!(
                    "a new map must carry an epoch above {}, the highest this sidecar has heard of \
                     (this one has {}): epochs never go backwards or name two maps",
                    st.epochs.highest(),
                    valid.epoch()
                )));
            }
            if st.next.is_some() {
                return Err(Category::Unavailable
                    .status("a swap is prepared: LoadMap waits until it is released or aborted"));
            }
        }
        let bank = ExpertBank::load(&ckpt, &valid, Tier::Cold, &c.moe_layers(), None)
            .map_err(|e| Category::Internal.status(e.to_string()))?;
        let mut st = self
            .core
            .state
            .write()
            .map_err(|_| Category::Internal.status("state poisoned"))?;
        let mut epochs = TierEpochs::new(valid.epoch());
        epochs.incarnation = st.epochs.incarnation;
        epochs.floor = st.epochs.highest().max(valid.epoch());
        *st = ColdState {
            bank,
            epochs,
            map: valid.clone(),
            next: None,
        };
        self.core.device.mirror(&st.bank).map_err(engine_status)?;
        Ok(LoadMapReply {
            map_epoch: valid.epoch(),
        })
    }
}

fn serde_json_from(s: &str) -> Result<Rowmap, String> {
    moelane_engine::rowmap::Rowmap::from_json(s).map_err(|e| e.to_string())
}

/// The tonic face of the actor.
pub struct SidecarService {
    pub(crate) actor: ActorRef<SidecarActor>,
    pub(crate) core: Arc<SidecarCore>,
}

/// Flattens an ask: the handler's own status, or the actor's failure as Unavailable.
fn flat<T, M>(r: Result<T, kameo::error::SendError<M, Status>>) -> Result<Response<T>, Status> {
    match r {
        Ok(v) => Ok(Response::new(v)),
        Err(kameo::error::SendError::HandlerError(s)) => Err(s),
        Err(e) => Err(Category::Unavailable.status(format!("sidecar actor: {e}"))),
    }
}

#[tonic::async_trait]
impl Sidecar for SidecarService {
    async fn register(
        &self,
        r: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        flat(self.actor.ask(RegisterMsg(r.into_inner())).await)
    }
    async fn health(
        &self,
        r: Request<SidecarHealthRequest>,
    ) -> Result<Response<SidecarHealthReply>, Status> {
        flat(self.actor.ask(HealthMsg(r.into_inner().primary)).await)
    }
    async fn stats(
        &self,
        _: Request<SidecarStatsRequest>,
    ) -> Result<Response<SidecarStatsReply>, Status> {
        flat(self.actor.ask(StatsMsg).await)
    }
    async fn load_map(&self, r: Request<LoadMapRequest>) -> Result<Response<LoadMapReply>, Status> {
        flat(self.actor.ask(LoadMapMsg(r.into_inner().rowmap_json)).await)
    }
    async fn prepare(&self, r: Request<PrepareRequest>) -> Result<Response<PrepareReply>, Status> {
        let span = tracing::info_span!(
            "sidecar PREPARE",
            otel.kind = "server",
            moelane.epoch = r.get_ref().epoch,
            moelane.experts_in = r.get_ref().incoming.len()
        );
        moelane_telemetry::adopt(&span, r.metadata());
        let r = r.into_inner();
        let next = Rowmap::from_json(&r.rowmap_json)
            .map_err(|e| Category::BadRequest.status(e.to_string()))?;
        if next.epoch != r.epoch {
            return Err(Category::BadRequest.status(format!(
                "PREPARE epoch {} but the map says {}",
                r.epoch, next.epoch
            )));
        }
        let incoming: Vec<_> = r
            .incoming
            .iter()
            .map(|s| (s.layer as usize, s.expert as usize, s.checksum))
            .collect();
        let core = self.core.clone();
        let (inc, base) = (r.incarnation, r.base_epoch);
        let epoch = tokio::task::spawn_blocking(move || {
            let _g = span.entered();
            core.prepare(inc, base, next, &incoming)
        })
        .await
        .map_err(|e| Category::Internal.status(e.to_string()))?
        .map_err(swap_status)?;
        moelane_residency_actor::failpoint::hit("sidecar.on-prepare");
        Ok(Response::new(PrepareReply { epoch }))
    }
    async fn release(&self, r: Request<ReleaseRequest>) -> Result<Response<ReleaseReply>, Status> {
        moelane_residency_actor::failpoint::hit("sidecar.on-release");
        let span = tracing::info_span!(
            "sidecar RELEASE",
            otel.kind = "server",
            moelane.epoch = r.get_ref().epoch
        );
        moelane_telemetry::adopt(&span, r.metadata());
        let _g = span.enter();
        let r = r.into_inner();
        let epoch = self
            .core
            .release(r.incarnation, r.epoch)
            .map_err(swap_status)?;
        Ok(Response::new(ReleaseReply { epoch }))
    }
    async fn abort(&self, r: Request<AbortRequest>) -> Result<Response<AbortReply>, Status> {
        let span = tracing::info_span!(
            "sidecar ABORT",
            otel.kind = "server",
            moelane.epoch = r.get_ref().epoch
        );
        moelane_telemetry::adopt(&span, r.metadata());
        let _g = span.enter();
        let r = r.into_inner();
        self.core
            .abort(r.incarnation, r.epoch)
            .map_err(swap_status)?;
        Ok(Response::new(AbortReply {}))
    }
}
