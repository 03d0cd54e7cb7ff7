//! Starting the roles of a lane: sidecar, primary, gateway, and all three in one process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kameo::actor::ActorRef;
use kameo::actor::Spawn;
use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::load::{engine_with_tier, resolve_map, EngineOptions};
use moelane_engine::rowmap::Rowmap;
use moelane_engine::tier::{InProcessTier, RemoteTier};
use moelane_gateway::registry::Registry;
use moelane_gateway::{AppState, GatewayConfig};
use moelane_gb300_worker::links::{open_link, Metered, NcclEnd, Relink};
use moelane_gb300_worker::scheduler::SchedulerConfig;
use moelane_gb300_worker::sidecar_client::{OnLink, RemoteSidecar};
use moelane_gb300_worker::PrimaryHandle;
use moelane_gb300_worker::PrimaryParticipant;
use moelane_proto::control::sidecar_client::SidecarClient;
use moelane_residency_actor::{Participant, Residency};
use moelane_rtx_worker::{LocalSidecar, SidecarCore, SidecarOptions};
use moelane_text::chat::ChatTemplate;
use moelane_text::tokenizer::Tokenizer;

/// How the primary reaches its cold experts.
#[derive(Clone, Debug)]
pub enum ColdLink {
    /// A sidecar thread in this process.
    InProcess,
    /// A sidecar process at this control URL, over this link kind ("tcp" or "shm").
    Remote { control: String, link: String },
}

/// Adaptive residency settings.
#[derive(Clone, Debug)]
pub struct AdaptiveOptions {
    pub policy: moelane_residency_actor::policy::Policy,
    pub dry_run: bool,
    pub interval: Duration,
}

/// The first map from a budget (`--hot-experts` / `--primary-memory`), when no map is given.
#[derive(Clone, Debug)]
pub struct PlacementSpec {
    pub budget: moelane_engine::placement::Budget,
    /// A counts file ranking the experts (None: a calibration pass).
    pub counts: Option<PathBuf>,
}

pub struct PrimaryOptions {
    pub adaptive: Option<AdaptiveOptions>,
    pub model: PathBuf,
    pub map: Option<PathBuf>,
    pub placement: Option<PlacementSpec>,
    pub kv_tokens: usize,
    /// what the host KV cache stores (bf16: a CPU primary only)
    pub kv_dtype: moelane_engine::kv::KvDtype,
    pub cold: ColdLink,
    pub link_timeout: Duration,
    /// A sidecar silent this long (heartbeats, or a step's reply past its sized deadline) is
    /// stalled: the lane turns unready and the step fails.
    pub stall_timeout: Duration,
    /// How long a starting primary waits for its sidecar process to listen.
    pub sidecar_wait: Duration,
    /// Compute the cold experts here while the sidecar is lost (the lane stays ready,
    /// degraded) instead of failing the steps.
    pub degraded: bool,
    /// Most bytes of cold experts held here while degraded.
    pub degraded_memory: u64,
    pub prepare_timeout: Duration,
    pub spare_slots: usize,
    /// Where the in-process sidecar computes: "cpu" or "cuda:N".
    pub sidecar_device: String,
    /// Where the primary computes: "cpu" or "cuda:N".
    pub primary_device: String,
    pub sched: SchedulerConfig,
}

fn incarnation() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The map file a primary serves. A file that does not exist yet (a fresh state volume) is
/// not an error: the checkpoint's own map is served and the first committed swap writes the
/// file, so a later start comes back on it. A file that exists must read.
fn read_map(p: &Option<PathBuf>) -> Result<Option<Rowmap>> {
    Ok(match p {
        Some(p) if !p.exists() => {
            println!(
                "moelane: {} does not exist yet: serving the checkpoint's map; committed swaps \
                 are written there",
                p.display()
            );
            None
        }
        Some(p) => Some(Rowmap::read(p).with_context(|| format!("reading map {}", p.display()))?),
        None => None,
    })
}

/// Loads the engine with its cold tier attached and starts the scheduler and actor.
/// A started primary: the scheduler, its link, and the residency coordinator.
pub struct Primary {
    pub handle: PrimaryHandle,
    pub link: String,
    pub residency: ActorRef<Residency>,
    pub readiness: Arc<moelane_gb300_worker::Readiness>,
}

/// Makes the first map of `dir` under `spec` (calibrating when no counts are given) for a
/// primary with `kv_tokens` in `kv_dtype` and `spare_slots` on a GPU or not; prints what it
/// takes.
pub fn plan_map(
    dir: &Path,
    spec: &PlacementSpec,
    kv_tokens: usize,
    kv_dtype: moelane_engine::kv::KvDtype,
    spare_slots: usize,
    gpu: bool,
) -> Result<moelane_engine::placement::Plan> {
    use moelane_engine::placement::{initial_map, Counts, Placement, Resident};
    let ckpt = Checkpoint::open(dir)?;
    // refused here, before a calibration pass, as the primary would refuse it at start
    if kv_dtype != moelane_engine::kv::KvDtype::F32 {
        if gpu {
            bail!(
                "--kv-dtype {}: a primary on a GPU keeps its KV cache there in f32; give \
                 --kv-dtype f32",
                kv_dtype.name()
            );
        }
        if ckpt.config.mla.is_some() {
            bail!(
                "--kv-dtype {}: {} caches multi-head latent attention's latent in f32; give \
                 --kv-dtype f32",
                kv_dtype.name(),
                ckpt.config.family.name()
            );
        }
    }
    if dir.join("rowmap.json").exists() {
        println!(
            "moelane: {} is not used: the first map is made from the budget given",
            dir.join("rowmap.json").display()
        );
    }
    if spec.counts.is_none() && !moelane_engine::tokenizer::Tokenizer::exists_in(dir) {
        println!(
            "moelane: {} has no tokenizer (tokenizer.json or tiktoken.model): the calibration pass runs on uniformly drawn \
             token ids (give --calibration-counts for a ranking from real traffic)",
            dir.display()
        );
    }
    let counts = match &spec.counts {
        Some(p) => Some(Counts::read(p, &ckpt.id)?.layers),
        None => None,
    };
    let how = match &spec.counts {
        Some(p) => format!("the counts in {}", p.display()),
        None => "a calibration pass over the built-in prompts".into(),
    };
    let t0 = std::time::Instant::now();
    let plan = initial_map(
        &ckpt,
        &Placement {
            budget: spec.budget,
            counts,
            kv_tokens,
            kv_dtype,
            spare_slots,
            resident: if gpu { Resident::Gpu } else { Resident::Stored },
            progress: true,
        },
    )
    .with_context(|| format!("making the first map of {}", dir.display()))?;
    let f = &plan.footprint;
    let h = moelane_engine::placement::human_bytes;
    let layers = plan.map.layers.len().max(1);
    println!(
        "moelane: first map: {} of {} experts hot ({:.1} per MoE layer), ranked by {how} ({:.1} s)",
        f.hot_experts,
        layers * ckpt.config.num_experts,
        f.hot_experts as f64 / layers as f64,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "moelane: primary memory: dense {} + KV {} + hot experts {} + spare slots {} = {}",
        h(f.dense),
        h(f.kv),
        h(f.expert * f.hot_experts as u64),
        h(f.spare),
        h(f.total())
    );
    Ok(plan)
}

/// The process's resident memory from /proc/self/status: (anonymous, file-backed) bytes;
/// None where the file is not there (not Linux).
pub fn resident_memory() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()
    };
    Some((kb("RssAnon:")? * 1024, kb("RssFile:")? * 1024))
}

pub async fn start_primary(o: &PrimaryOptions) -> Result<Primary> {
    let loading = std::time::Instant::now();
    let ckpt = Checkpoint::open(&o.model)?;
    let map = match (&o.map, &o.placement) {
        (Some(m), Some(_)) => bail!(
            "--map {} and --hot-experts / --primary-memory both given: the map file already says \
             which experts are hot",
            m.display()
        ),
        (None, Some(spec)) => {
            let (dir, spec) = (o.model.clone(), spec.clone());
            let (kv, kv_dtype, spare) = (o.kv_tokens, o.kv_dtype, o.spare_slots);
            let gpu = o.primary_device != "cpu";
            let plan = tokio::task::spawn_blocking(move || {
                plan_map(&dir, &spec, kv, kv_dtype, spare, gpu)
            })
            .await??;
            resolve_map(&ckpt, Some(plan.map))?
        }
        (map, None) => resolve_map(&ckpt, read_map(map)?)?,
    };
    let any_cold = map.map.layers.iter().any(|l| !l.cold.is_empty());
    let readiness = Arc::new(moelane_gb300_worker::Readiness::default());
    // every expert's checksum at start: what swaps (and a degraded lane's reads) must find
    let manifest = {
        let dir = o.model.clone();
        Arc::new(
            tokio::task::spawn_blocking(move || {
                Checkpoint::open(&dir).and_then(|c| moelane_engine::swap::manifest(&c))
            })
            .await??,
        )
    };
    let mut sidecar: Option<Box<dyn Participant>> = None;
    let mut seen_epoch = 0;
    let mut relink = None;
    let mut probe = None;
    let (tier, link_name): (Option<Box<dyn RemoteTier>>, String) = match &o.cold {
        _ if !any_cold => (None, "none".into()),
        ColdLink::InProcess => {
            let core = Arc::new(
                SidecarCore::load(&ckpt, &map)?
                    .with_device(&o.sidecar_device)
                    .map_err(|e| anyhow::anyhow!(e))?,
            );
            moelane_rtx_worker::register_metrics(core.clone());
            sidecar = Some(Box::new(LocalSidecar(core.clone())));
            (
                Some(Metered::wrap(Box::new(InProcessTier::spawn(core)))),
                "inproc".into(),
            )
        }
        ColdLink::Remote { control, link } => {
            let r = connect_sidecar(o, &ckpt, &map, control, link).await?;
            sidecar = Some(r.sidecar);
            seen_epoch = r.seen_epoch;
            relink = Some(r.broken);
            probe = Some(r.probe);
            let tier = if o.degraded {
                let ckpt = Arc::new(Checkpoint::open(&o.model)?);
                Box::new(crate::degraded::Degradable::new(
                    r.tier,
                    ckpt,
                    manifest.clone(),
                    readiness.clone(),
                    o.degraded_memory,
                )) as Box<dyn RemoteTier>
            } else {
                r.tier
            };
            (Some(Metered::wrap(tier)), r.name)
        }
    };
    let eos = ckpt.config.eos_token_ids.clone();
    let (layers, experts) = (map.layers(), map.experts());
    let residency_map = map.clone();
    #[allow(unused_mut)]
    let mut engine = engine_with_tier(
        &ckpt,
        map,
        &EngineOptions {
            kv_tokens: o.kv_tokens,
            progress: true,
        },
        tier,
    )?;
    attach_primary_device(&mut engine, &ckpt, &o.primary_device)?;
    engine.set_kv_dtype(o.kv_dtype)?;
    {
        let h = moelane_engine::placement::human_bytes;
        let rss = match resident_memory() {
            Some((anon, file)) => format!(
                "; process resident {} ({} anonymous + {} file-backed, the mapped \
                 checkpoint's pages the kernel may reclaim)",
                h(anon + file),
                h(anon),
                h(file)
            ),
            None => String::new(),
        };
        let kv = match engine.kv.host_bytes() {
            0 => String::new(),
            b => format!(", the KV cache {} in host memory", h(b as u64)),
        };
        println!(
            "moelane: primary loaded in {:.1} s: the checkpoint's tensors are {}{kv}{rss}",
            loading.elapsed().as_secs_f64(),
            h(ckpt.tensor_bytes() as u64),
        );
    }
    if let Some(numa) = moelane_engine::numa::summary() {
        println!("moelane: {numa}");
    }
    let id = ckpt.id.clone();
    let first_eos = eos.first().copied();
    let mut handle = moelane_gb300_worker::start(engine, id.clone(), eos, o.sched.clone())
        .context("cannot start the step loop's thread")?;
    // structured output: grammars compile against the checkpoint's own tokenizer (its trie
    // built now, off this thread, so the first request with one does not wait for it)
    if let (true, Some(eos)) = (Tokenizer::exists_in(&o.model), first_eos) {
        let t = Tokenizer::from_dir(&o.model).context("the checkpoint's tokenizer")?;
        t.check_fits(ckpt.config.vocab_size)?;
        let g = moelane_text::grammar::Grammars::new(std::sync::Arc::new(t), eos);
        g.warm();
        handle = handle.with_grammars(std::sync::Arc::new(g));
    }
    moelane_gb300_worker::register_metrics(handle.client.clone());
    let participant = PrimaryParticipant {
        client: handle.client.clone(),
        ckpt_dir: o.model.clone(),
        model: id.clone(),
        layers,
        experts,
    };
    let mut res = Residency::new(
        residency_map,
        manifest.to_vec(),
        Box::new(participant),
        sidecar,
        o.map.clone(),
    )
    .with_limits(o.prepare_timeout, o.spare_slots)
    .with_seen_epoch(seen_epoch);
    if let Some(a) = &o.adaptive {
        let source = PrimaryParticipant {
            client: handle.client.clone(),
            ckpt_dir: o.model.clone(),
            model: id,
            layers,
            experts,
        };
        let mut policy = a.policy.clone();
        policy.expert_bytes = ckpt.expert_stored_bytes()? as f64;
        res = res.with_adaptive(moelane_residency_actor::Adaptive::new(
            Box::new(source),
            policy,
            a.dry_run,
        ));
    }
    if let Some(p) = res.rates_from() {
        println!(
            "moelane: adaptive residency goes on from the pick rates saved at {}",
            p.display()
        );
    }
    let residency = Residency::spawn(res);
    if let (Some(probe), Some(broken)) = (probe, relink) {
        supervise_link(
            &residency,
            probe,
            broken,
            readiness.clone(),
            o.stall_timeout,
            o.degraded,
        );
    }
    if let Some(a) = &o.adaptive {
        drive_adaptive(&residency, a);
    }
    Ok(Primary {
        handle,
        link: link_name,
        residency,
        readiness,
    })
}

/// Says once (`said`) what the primary waits for, then waits half a second before the next
/// try.
async fn waiting(said: &mut bool, what: impl FnOnce() -> String) {
    if !*said {
        println!("moelane: waiting for {}", what());
        *said = true;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// A sidecar process reached: its data link (supervised), its participant in the swap
/// protocol, the highest epoch it has seen, and what the supervisors watch.
struct RemoteLink {
    tier: Box<dyn RemoteTier>,
    name: String,
    sidecar: Box<dyn Participant>,
    seen_epoch: u64,
    broken: Arc<tokio::sync::Notify>,
    probe: (
        SidecarClient<moelane_proto::auth::AuthChannel>,
        Arc<std::sync::atomic::AtomicU64>,
    ),
}

/// Connects to the sidecar process at `control`, registers under a fresh fencing token and
/// opens the data link of kind `link` that the REGISTER answers with.
async fn connect_sidecar(
    o: &PrimaryOptions,
    ckpt: &Checkpoint,
    map: &moelane_engine::rowmap::ValidMap,
    control: &str,
    link: &str,
) -> Result<RemoteLink> {
    let kind: &'static str = match link {
        "tcp" => "tcp",
        "shm" => "shm",
        "nccl" if cfg!(feature = "cuda") => "nccl",
        "ipc" if cfg!(feature = "cuda") => "ipc",
        "nccl" | "ipc" => {
            bail!("--link {link}: this moelane was built without CUDA (build with --features cuda)")
        }
        other => bail!("--link {other:?}: choose tcp, shm, nccl or ipc"),
    };
    let nccl = o
        .primary_device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .map(|ordinal| NcclEnd {
            ordinal,
            hidden: ckpt.config.hidden_size,
        });
    if kind == "nccl" && nccl.is_none() {
        bail!(
            "--link nccl carries activations between two GPUs: put the primary on one \
             (--primary-device cuda:N) and the sidecar on another (--sidecar-device cuda:M)"
        );
    }
    if kind == "ipc" && nccl.is_none() {
        bail!(
            "--link ipc shares device memory with the sidecar: put the primary on a GPU \
             (--primary-device cuda:N) and the sidecar on the same GPU or one that GPU reaches \
             (--sidecar-device cuda:M)"
        );
    }
    // the ipc link's reply box, made before each REGISTER and opened on its answer
    let ipc = std::sync::Arc::new(ipc_lane::Pending::new(ckpt, nccl.map(|n| n.ordinal)));
    // HTTP/2 pings find a connection a partition left dead (its TCP would wait minutes): the
    // channel then dials again, resolving the name again
    let endpoint = moelane_proto::tls::endpoint(control)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("--sidecar {control:?}"))?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    // the sidecar opens its control port once its experts are loaded: a primary started
    // first (a pod, a unit, a host) waits for it, up to --sidecar-wait
    let t0 = std::time::Instant::now();
    let mut said = false;
    let channel = loop {
        match endpoint.connect().await {
            Ok(ch) => break ch,
            Err(e) if t0.elapsed() < o.sidecar_wait => {
                waiting(&mut said, || {
                    format!(
                        "the sidecar at {control} ({e}; up to {:.0} s)",
                        o.sidecar_wait.as_secs_f64()
                    )
                })
                .await
            }
            Err(e) => {
                return Err(anyhow::anyhow!(e)).with_context(|| {
                    format!(
                        "connecting to the sidecar at {control} (waited {:.0} s)",
                        t0.elapsed().as_secs_f64()
                    )
                })
            }
        }
    };
    let client = SidecarClient::new(moelane_proto::auth::attach(channel));
    let slot = Arc::new(std::sync::Mutex::new(None));
    let (slot2, timeout) = (slot.clone(), o.link_timeout);
    let control_host = control_host(control);
    let deadline = moelane_gb300_worker::links::StallDeadline::new(o.stall_timeout, o.link_timeout);
    let link_gen = deadline.link_gen.clone();
    let ipc2 = ipc.clone();
    let on_link: OnLink = Arc::new(move |rep| {
        let endpoint = if kind == "tcp" {
            reachable(&rep.endpoint, control_host.as_deref())
        } else {
            rep.endpoint.clone()
        };
        let t = if kind == "ipc" {
            ipc2.connect(&endpoint)?
        } else {
            open_link(kind, &endpoint, control_host.as_deref(), timeout, nccl)?
        };
        // a poisoned slot held a link in an unknown state: it is replaced either way
        *slot2.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        link_gen.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    });
    let inc = Arc::new(std::sync::atomic::AtomicU64::new(incarnation()));
    let (probe_client, probe_inc) = (client.clone(), inc.clone());
    let remote = RemoteSidecar {
        client,
        model: ckpt.id.clone(),
        incarnation: inc,
        link: link.to_string(),
        on_link: Some(on_link.clone()),
        link_params: (kind == "ipc").then(|| ipc_lane::params(ipc.clone())),
    };
    // a sidecar that answers its port but not the call (stopped, overloaded, restarting) is
    // asked again, up to --sidecar-wait; one that refuses (another model, a bad token) is not
    let rep = loop {
        match remote.register(&map.map).await {
            Ok(rep) => break rep,
            Err(s) if registration_transient(s.code()) => {
                if t0.elapsed() >= o.sidecar_wait {
                    return Err(anyhow::anyhow!(
                        "the sidecar at {control} did not answer its registration within {:.0} s \
                         ({}: {})",
                        t0.elapsed().as_secs_f64(),
                        s.code(),
                        s.message()
                    ));
                }
                waiting(&mut said, || {
                    format!(
                        "the sidecar at {control} to answer its registration ({}: {}; up to {:.0} s)",
                        s.code(),
                        s.message(),
                        o.sidecar_wait.as_secs_f64()
                    )
                })
                .await;
            }
            Err(s) => {
                return Err(anyhow::anyhow!(
                    "the sidecar at {control} refused the registration ({}: {})",
                    s.code(),
                    s.message()
                ))
            }
        }
    };
    // a data link cut or refused for now (the port busy, the sidecar restarting) is tried
    // again up to --sidecar-wait; a setting to fix (a certificate refused) fails at once
    let t1 = std::time::Instant::now();
    let mut said = false;
    loop {
        let on = on_link.clone();
        let r = {
            let rep = rep.clone();
            tokio::task::spawn_blocking(move || on(&rep))
                .await
                .map_err(|e| anyhow::anyhow!("opening the data link: {e}"))?
        };
        match r {
            Ok(()) => break,
            Err(e)
                if matches!(
                    e.fault,
                    moelane_engine::error::Fault::Unavailable
                        | moelane_engine::error::Fault::Timeout
                ) && t1.elapsed() < o.sidecar_wait =>
            {
                waiting(&mut said, || {
                    format!(
                        "the sidecar's data link ({e}; up to {:.0} s)",
                        o.sidecar_wait.as_secs_f64()
                    )
                })
                .await
            }
            Err(e) => return Err(anyhow::anyhow!("opening the data link: {e}")),
        }
    }
    let broken = Arc::new(tokio::sync::Notify::new());
    let t = Relink {
        slot,
        broken: broken.clone(),
        kind,
        deadline: moelane_gb300_worker::links::StallDeadline::new(o.stall_timeout, o.link_timeout),
    };
    Ok(RemoteLink {
        tier: Box::new(t),
        sidecar: Box::new(moelane_residency_actor::Faulty(Arc::new(remote))),
        seen_epoch: rep.highest_epoch,
        broken,
        probe: (probe_client, probe_inc),
        name: if kind == "nccl" {
            format!(
                "nccl (communicator {}..)",
                rep.endpoint.get(..16).unwrap_or("")
            )
        } else if kind == "ipc" {
            format!(
                "ipc (sidecar pid {})",
                rep.endpoint.split(':').nth(1).unwrap_or("?")
            )
        } else {
            format!("{link} {}", rep.endpoint)
        },
    })
}

/// Whether a failed REGISTER may pass on its own (the sidecar did not answer, or the
/// connection broke): asked again while --sidecar-wait lasts. Anything else is a refusal.
fn registration_transient(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Unknown
            | tonic::Code::ResourceExhausted
            | tonic::Code::Aborted
    )
}

/// The primary's end of the `ipc` link in a lane: a reply box made before each REGISTER
/// (sent as its `link_params`) and opened into a link with the sidecar's answer.
mod ipc_lane {
    use moelane_engine::tier::{BoxLayout, RemoteTier};
    use std::sync::{Arc, Mutex};

    /// Rows the mailbox holds: a step of more goes in rounds (a long prefill).
    pub const ROWS: usize = 512;

    pub struct Pending {
        ordinal: Option<usize>,
        layout: BoxLayout,
        #[cfg(feature = "cuda")]
        end: Mutex<Option<moelane_link::ipc::PrimaryEnd>>,
        #[cfg(not(feature = "cuda"))]
        end: Mutex<Option<()>>,
    }

    impl Pending {
        pub fn new(ckpt: &moelane_engine::checkpoint::Checkpoint, ordinal: Option<usize>) -> Self {
            let c = &ckpt.config;
            Pending {
                ordinal,
                layout: BoxLayout {
                    layers: c.moe_layers().len(),
                    cap_rows: ROWS,
                    k: c.num_experts_per_tok,
                    hidden: c.hidden_size,
                    experts: c.num_experts,
                },
                end: Mutex::new(None),
            }
        }

        /// A fresh reply box; its parameters for REGISTER.
        #[cfg(feature = "cuda")]
        fn make(&self) -> moelane_engine::Result<String> {
            let ordinal = self.ordinal.ok_or_else(|| {
                moelane_engine::Error::Invalid("the ipc link needs the primary on a GPU".into())
            })?;
            let gpu = moelane_engine::cuda::Gpu::open(ordinal)?;
            let end = moelane_link::ipc::PrimaryEnd::new(gpu, self.layout)?;
            let params = end.params()?;
            *self.end.lock().unwrap_or_else(|p| p.into_inner()) = Some(end);
            Ok(params)
        }

        #[cfg(not(feature = "cuda"))]
        fn make(&self) -> moelane_engine::Result<String> {
            let _ = (self.ordinal, self.layout, &self.end);
            Err(moelane_engine::Error::NotCompiledWithCuda)
        }

        /// The link from the sidecar's answer to the last REGISTER.
        #[cfg(feature = "cuda")]
        pub fn connect(&self, offer: &str) -> moelane_engine::Result<Box<dyn RemoteTier>> {
            let end = self
                .end
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .ok_or_else(|| {
                    moelane_engine::Error::Internal("an ipc answer without a request".into())
                })?;
            Ok(Box::new(end.connect(offer)?))
        }

        #[cfg(not(feature = "cuda"))]
        pub fn connect(&self, offer: &str) -> moelane_engine::Result<Box<dyn RemoteTier>> {
            let _ = offer;
            Err(moelane_engine::Error::NotCompiledWithCuda)
        }
    }

    /// REGISTER's `link_params` for the ipc link.
    pub fn params(p: Arc<Pending>) -> moelane_gb300_worker::sidecar_client::LinkParams {
        Arc::new(move || p.make().map_err(|e| e.to_string()))
    }
}

/// The host of a control URL (`http://HOST:PORT/...`), brackets kept for IPv6.
fn control_host(url: &str) -> Option<String> {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let hostport = rest.split('/').next()?;
    let host = match hostport.rfind(':') {
        Some(i) if !hostport.ends_with(']') => &hostport[..i],
        _ => hostport,
    };
    (!host.is_empty()).then(|| host.to_string())
}

/// A sidecar's TCP data address as the primary can reach it: a sidecar listening on every
/// address (0.0.0.0 or [::]) advertises that, so the host it was reached at for control is
/// used with the advertised port (two hosts, containers).
fn reachable(endpoint: &str, control_host: Option<&str>) -> String {
    let Ok(sa) = endpoint.parse::<SocketAddr>() else {
        return endpoint.to_string();
    };
    match control_host {
        Some(h) if sa.ip().is_unspecified() => format!("{h}:{}", sa.port()),
        _ => endpoint.to_string(),
    }
}

/// Moves the engine's steps onto the primary's device (`cpu` leaves them on the host).
fn attach_primary_device(
    engine: &mut moelane_engine::step::Engine,
    ckpt: &Checkpoint,
    device: &str,
) -> Result<()> {
    match device {
        "cpu" => {}
        d if d.starts_with("cuda:") => {
            let n: usize = d[5..]
                .parse()
                .map_err(|_| anyhow::anyhow!("--primary-device {d:?}: expected cpu or cuda:N"))?;
            let desc = moelane_engine::gpu::attach_primary(engine, ckpt, n)
                .with_context(|| format!("--primary-device {d}"))?;
            println!("moelane: primary computes on {desc}");
        }
        d => anyhow::bail!("--primary-device {d:?}: expected cpu or cuda:N"),
    }
    Ok(())
}

/// The data link's supervisors. Heartbeats: the sidecar's Health every 500 ms (each bounded
/// by a second); a sidecar that restarted (another incarnation) or whose link failed wakes a
/// loop that re-registers through the residency coordinator, with a bounded backoff, until
/// the link is back. A sidecar silent for `stall` (stopped, partitioned) or draining makes
/// the primary unready, so gateways send new requests elsewhere, until it answers again.
fn supervise_link(
    residency: &ActorRef<Residency>,
    probe: (
        SidecarClient<moelane_proto::auth::AuthChannel>,
        Arc<std::sync::atomic::AtomicU64>,
    ),
    broken: Arc<tokio::sync::Notify>,
    readiness: Arc<moelane_gb300_worker::Readiness>,
    stall: Duration,
    degraded: bool,
) {
    // with --degraded a lost sidecar does not make the lane unready: it computes the cold
    // experts itself and says degraded instead
    let problem =
        move |r: &moelane_gb300_worker::Readiness, key: &'static str, why: Option<String>| {
            if degraded {
                match (key, why) {
                    ("sidecar-draining", _) => {}
                    // the link is back (re-registered): no longer degraded
                    ("link", None) => {
                        r.set_degraded(None);
                    }
                    (_, Some(w)) => {
                        r.set_degraded(Some(w));
                    }
                    _ => {}
                }
                false
            } else {
                r.set_problem(key, why)
            }
        };
    let (mut client, inc) = probe;
    // the link is being re-registered (the resync loop below): heartbeats answered meanwhile
    // do not say the lane is whole again
    let relinking = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let (broken, readiness, relinking) = (broken.clone(), readiness.clone(), relinking.clone());
        tokio::spawn(async move {
            let mut t = tokio::time::interval(Duration::from_millis(500));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_answer = std::time::Instant::now();
            loop {
                t.tick().await;
                let answer = tokio::time::timeout(
                    Duration::from_secs(1),
                    client.health(moelane_proto::control::SidecarHealthRequest {
                        primary: moelane_gb300_worker::sidecar_client::process_id().into(),
                    }),
                )
                .await;
                match answer {
                    Ok(Ok(h)) => {
                        let h = h.into_inner();
                        last_answer = std::time::Instant::now();
                        if problem(&readiness, "heartbeat", None) {
                            tracing::info!("the sidecar answers heartbeats again");
                        }
                        problem(
                            &readiness,
                            "sidecar-draining",
                            h.draining
                                .then(|| "the sidecar is draining (stopping)".to_string()),
                        );
                        let relinking_now = relinking.load(std::sync::atomic::Ordering::SeqCst);
                        if h.incarnation != inc.load(std::sync::atomic::Ordering::SeqCst) {
                            // (not while the link is being re-registered: a permit left then
                            // would start a second registration right after it)
                            if !relinking_now {
                                broken.notify_one();
                            }
                        } else if degraded
                            && !h.draining
                            && !relinking_now
                            && readiness.set_degraded(None)
                        {
                            // the same sidecar answers again (it was stopped, or slow): the
                            // lane is whole even if no step has crossed the link since (an
                            // idle lane would otherwise stay degraded, and unpicked); a step
                            // that still finds the link broken says degraded again
                            tracing::info!(
                                "the sidecar answers heartbeats again: the lane is no longer \
                                 degraded"
                            );
                        }
                    }
                    _ if last_answer.elapsed() >= stall => {
                        let why = format!(
                            "the sidecar has not answered heartbeats for {:.1} s",
                            last_answer.elapsed().as_secs_f64()
                        );
                        if !problem(&readiness, "heartbeat", Some(why.clone())) && !degraded {
                            tracing::warn!("{why}: the lane is unready");
                        }
                    }
                    _ => {}
                }
            }
        });
    }
    {
        let r = residency.clone();
        tokio::spawn(async move {
            loop {
                broken.notified().await;
                relinking.store(true, std::sync::atomic::Ordering::SeqCst);
                tracing::warn!("sidecar link lost; re-registering");
                problem(
                    &readiness,
                    "link",
                    Some("the sidecar link is down; reconnecting".into()),
                );
                let mut backoff = Duration::from_millis(100);
                let mut last = String::new();
                loop {
                    match r.ask(moelane_residency_actor::Resync).await {
                        Ok(epoch) => {
                            tracing::info!(epoch, "sidecar link restored");
                            problem(&readiness, "link", None);
                            relinking.store(false, std::sync::atomic::Ordering::SeqCst);
                            break;
                        }
                        Err(kameo::error::SendError::HandlerError(e)) => {
                            // why, where /ready shows it (a refused certificate or token
                            // does not mend by waiting); logged when it changes
                            let why = e.to_string();
                            if why != last {
                                tracing::warn!(error = %why, "sidecar not back yet");
                                problem(
                                    &readiness,
                                    "link",
                                    Some(format!(
                                        "the sidecar link is down; reconnecting (last try: {why})"
                                    )),
                                );
                                last = why;
                            }
                        }
                        Err(_) => return,
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        });
    }
}

/// Asks the residency coordinator for a decision every `a.interval` and logs what it did.
fn drive_adaptive(residency: &ActorRef<Residency>, a: &AdaptiveOptions) {
    {
        let (r, iv, dry) = (residency.clone(), a.interval, a.dry_run);
        tokio::spawn(async move {
            let mut t = tokio::time::interval(iv);
            loop {
                t.tick().await;
                let Ok(rep) = r.ask(moelane_residency_actor::Tick).await else {
                    break;
                };
                if let Some(d) = rep.decision.filter(|d| !d.moves.is_empty()) {
                    match rep.outcome {
                        Some(o) if o.committed => tracing::info!(
                            epoch = o.epoch,
                            moves = d.moves.len(),
                            cold_share = d.cold_share,
                            predicted_cold_share = d.predicted_cold_share,
                            wait_share = d.wait_share,
                            "residency swap committed"
                        ),
                        Some(o) => {
                            tracing::warn!(reason = %o.abort_reason, "residency swap aborted")
                        }
                        None if dry => tracing::info!(
                            moves = d.moves.len(),
                            cold_share = d.cold_share,
                            predicted_cold_share = d.predicted_cold_share,
                            "residency dry run: would swap"
                        ),
                        None => {}
                    }
                }
            }
        });
    }
}

pub async fn bind(addr: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// The primary's gRPC server, running: its address, and how to stop it.
pub struct PrimaryServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl PrimaryServer {
    /// Stops accepting and waits (at most `wait`) for the calls in progress to end.
    pub async fn stop(mut self, wait: Duration) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if tokio::time::timeout(wait, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

/// Serves the primary's gRPC API (and the gRPC health service).
pub async fn serve_primary(p: &Primary, addr: &str) -> Result<PrimaryServer> {
    let l = bind(addr).await?;
    let a = l.local_addr()?;
    let client = p.handle.client.clone();
    let residency = Some(p.residency.clone());
    let readiness = p.readiness.clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let stop = async move {
            let _ = rx.await;
        };
        if let Err(e) = moelane_gb300_worker::serve(l, client, residency, readiness, stop).await {
            tracing::error!(error = %e, "primary gRPC server stopped");
        }
    });
    Ok(PrimaryServer {
        addr: a,
        stop: Some(tx),
        task,
    })
}

/// A primary's drain: no new requests (Health says draining, Generate refuses: gateways
/// send them elsewhere), those running finish within `grace`, what remains after it ends
/// with an error naming the cause. Returns (requests running when it began, requests cut).
pub async fn drain_primary(p: &Primary, grace: Duration) -> (usize, usize) {
    p.readiness.start_drain();
    let before = p
        .handle
        .client
        .snapshot()
        .await
        .map(|s| s.running + s.waiting)
        .unwrap_or(0);
    let left = p.handle.client.wait_idle(grace).await;
    let cut = if left > 0 {
        p.handle
            .client
            .end_all(&format!(
                "the primary is shutting down: its grace period of {:.1} s ended before this request finished",
                grace.as_secs_f64()
            ))
            .await
    } else {
        0
    };
    // the process that replaces this one goes on from the adaptive policy's pick rates
    match p.residency.ask(moelane_residency_actor::SaveRates).await {
        Ok(Some(path)) => println!("moelane: adaptive pick rates saved to {}", path.display()),
        Ok(None) => {}
        Err(e) => tracing::warn!("saving the adaptive pick rates: {e}"),
    }
    (before, cut)
}

/// A started sidecar process: its control and data addresses, and its core (for the drain).
pub struct StartedSidecar {
    pub control: SocketAddr,
    pub data: Option<SocketAddr>,
    pub core: Arc<SidecarCore>,
}

pub async fn start_sidecar(o: &SidecarOptions, control: &str) -> Result<StartedSidecar> {
    let s = moelane_rtx_worker::start(o)?;
    moelane_rtx_worker::register_metrics(s.core.clone());
    if o.probe_bandwidth {
        moelane_rtx_worker::probe_bandwidth(s.core.clone());
    }
    let l = bind(control).await?;
    let a = l.local_addr()?;
    let actor = s.actor.clone();
    let core = s.core.clone();
    tokio::spawn(async move {
        if let Err(e) = moelane_rtx_worker::serve_control(l, actor, core).await {
            tracing::error!(error = %e, "sidecar control server stopped");
        }
    });
    Ok(StartedSidecar {
        control: a,
        data: s.data_addr,
        core: s.core,
    })
}

/// A sidecar's drain: Health says draining (its primary turns unready, gateways send new
/// requests elsewhere) while it keeps serving layer requests; it ends once none came for
/// `quiet` (longer than the primary's heartbeat plus a gateway's health check, so what was
/// sent before they noticed is served) or at `grace`. Returns whether it went quiet.
pub async fn drain_sidecar(core: &SidecarCore, grace: Duration, quiet: Duration) -> bool {
    use std::sync::atomic::Ordering;
    core.draining.store(true, Ordering::SeqCst);
    metrics::gauge!(moelane_telemetry::names::DRAINING).set(1.0);
    let until = std::time::Instant::now() + grace;
    let mut seen = core.requests.load(Ordering::Relaxed);
    let mut since = std::time::Instant::now();
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = core.requests.load(Ordering::Relaxed);
        // a request inside (a long prefill's layer) is activity too
        if now != seen || core.in_flight.load(Ordering::SeqCst) > 0 {
            seen = now;
            since = std::time::Instant::now();
        } else if since.elapsed() >= quiet {
            return true;
        }
    }
    false
}

pub struct GatewayOptions {
    pub model: PathBuf,
    /// Lane specs: a primary's gRPC URL, or dns://NAME:PORT (every address a lane).
    pub lanes: Vec<String>,
    /// A file of lane specs, one per line, re-read every `discovery_interval`.
    pub lanes_file: Option<PathBuf>,
    pub listen: String,
    pub name: Option<String>,
    pub max_body: usize,
    pub discovery_interval: Duration,
    pub health_interval: Duration,
    pub health_timeout: Duration,
    pub breaker: moelane_gateway::registry::Breaker,
    pub max_attempts: usize,
    pub retry_deadline: Duration,
    /// Unix socket to hand the listening socket to a successor over (and to take it from a
    /// running gateway at start).
    pub handoff: Option<PathBuf>,
    /// Connection cap, request-head deadline, drain window.
    pub http: moelane_gateway::listen::HttpLimits,
    /// Where the admin endpoints listen (loopback unless an admin token is set).
    pub admin_listen: String,
    /// A request's whole body must arrive within this.
    pub body_timeout: Duration,
    /// Most generations one client may have in flight (0: no bound).
    pub max_client_requests: usize,
    /// MiB of kept responses (`previous_response_id`); 0: none kept.
    pub responses_store_mb: usize,
    /// How long a streaming client may go without reading before its answer is cut.
    pub stream_stall: Duration,
    /// API keys and the admin token.
    pub auth: moelane_gateway::server::Auth,
}

impl GatewayOptions {
    /// The defaults for `model` over `lanes`, listening on `listen`.
    pub fn new(model: PathBuf, lanes: Vec<String>, listen: String) -> Self {
        GatewayOptions {
            model,
            lanes,
            lanes_file: None,
            listen,
            name: None,
            max_body: 8 << 20,
            discovery_interval: Duration::from_secs(5),
            health_interval: Duration::from_secs(1),
            health_timeout: Duration::from_secs(1),
            breaker: Default::default(),
            max_attempts: 3,
            retry_deadline: Duration::from_secs(10),
            handoff: None,
            http: Default::default(),
            admin_listen: "127.0.0.1:0".into(),
            body_timeout: Duration::from_secs(30),
            max_client_requests: 0,
            responses_store_mb: 256,
            stream_stall: Duration::from_secs(60),
            auth: Default::default(),
        }
    }
}

/// A running gateway: its address, its state, and how to stop it.
pub struct Gateway {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    admin_task: tokio::task::JoinHandle<()>,
    offer: Option<moelane_gateway::handoff::Offer>,
}

impl Gateway {
    /// Resolves once a successor took the listening socket (never without a handoff path).
    pub async fn taken_over(&mut self) {
        match &mut self.offer {
            Some(o) => {
                if (&mut o.taken).await.is_err() {
                    // the offering thread ended without a handoff: none will come
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }

    /// Stops accepting (connections already open are served) and turns /ready to 503.
    pub fn begin_drain(&mut self) {
        self.state.shutdown.start_drain();
        if let Some(o) = &self.offer {
            o.withdraw();
        }
        self.stop.send_replace(true);
    }

    /// Drains: stops accepting, lets the requests being answered finish within `grace`,
    /// then ends what remains with an error event (never a finish). Returns (requests being
    /// answered when it began, requests cut).
    pub async fn finish(mut self, grace: Duration) -> (usize, usize) {
        self.begin_drain();
        let sd = self.state.shutdown.clone();
        let at_start = sd.active();
        let until = std::time::Instant::now() + grace;
        while sd.active() > 0 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cut = sd.active();
        if cut > 0 {
            sd.abort();
        }
        // the server returns once every connection closed
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
        if tokio::time::timeout(Duration::from_secs(2), &mut self.admin_task)
            .await
            .is_err()
        {
            self.admin_task.abort();
        }
        (at_start, cut)
    }
}

/// Whether a listen address is a loopback one (127.0.0.0/8, ::1, localhost).
pub fn is_loopback(addr: &str) -> bool {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return a.ip().is_loopback();
    }
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.eq_ignore_ascii_case("localhost")
}

/// The served model name: the flag, else the checkpoint directory's name.
pub fn model_name(model: &Path, name: &Option<String>) -> String {
    name.clone().unwrap_or_else(|| {
        model
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "moelane".into())
    })
}

/// Starts the gateway: finds its lanes (a first discovery round before it listens), starts
/// health checks, takes the listening socket from a running gateway at the handoff path or
/// binds one, and serves.
pub async fn start_gateway(o: &GatewayOptions) -> Result<Gateway> {
    use moelane_gateway::discovery::{spawn_health_checks, Discovery, Spec};
    let tokenizer = Tokenizer::from_dir(&o.model)?;
    let template = ChatTemplate::from_dir(&o.model)?;
    let cfg = moelane_engine::config::ModelConfig::from_file(&o.model.join("config.json"))?;
    tokenizer.check_fits(cfg.vocab_size)?;
    let generation = moelane_engine::config::Generation::read(&o.model)?;
    if o.lanes.is_empty() && o.lanes_file.is_none() {
        bail!("the gateway needs at least one --lane (a primary's gRPC URL or dns://NAME:PORT) or a --lanes-file");
    }
    let specs = o
        .lanes
        .iter()
        .map(|l| Spec::parse(l).map_err(|e| anyhow::anyhow!(e)))
        .collect::<Result<Vec<_>>>()?;
    if let Some(f) = &o.lanes_file {
        // a file that is wrong at start is refused; later a bad read keeps the lanes it gave
        moelane_gateway::discovery::read_file(f).map_err(|e| anyhow::anyhow!(e))?;
    }
    // lanes of another checkpoint are down (its id from config.json: the gateway may hold no
    // weights)
    let model_id = moelane_engine::checkpoint::Checkpoint::id_in(&o.model)?;
    let registry = Registry::spawn(Registry::new(o.breaker.clone()).expecting(model_id));
    let discovery = Discovery {
        specs: specs.clone(),
        file: o.lanes_file.clone(),
        interval: o.discovery_interval,
    };
    for e in discovery.round(&registry).await {
        println!("moelane: warning: {e}");
    }
    if specs.iter().any(|s| matches!(s, Spec::Dns { .. })) || o.lanes_file.is_some() {
        discovery.spawn(registry.clone());
    }
    spawn_health_checks(registry.clone(), o.health_interval, o.health_timeout);
    if o.auth.admin.is_none() && !is_loopback(&o.admin_listen) {
        bail!(
            "--admin-listen {} is not a loopback address: set an admin token \
             (--admin-token-file or MOELANE_ADMIN_TOKEN) so that only operators can drain lanes",
            o.admin_listen
        );
    }
    if o.auth.api_keys.is_none() && !is_loopback(&o.listen) && o.handoff.is_none() {
        println!(
            "moelane: warning: the API listens on {} without API keys: anyone who reaches it \
             can generate (set --api-key-file or MOELANE_API_KEY, or keep it behind a proxy \
             that authenticates)",
            o.listen
        );
    }
    if o.http.tls.is_none() && !is_loopback(&o.listen) && o.handoff.is_none() {
        println!(
            "moelane: warning: the API listens on {} over plain HTTP: prompts, answers and API              keys cross the network in clear (set --tls-cert and --tls-key, or terminate TLS              in a proxy in front)",
            o.listen
        );
    }
    let state = Arc::new(
        AppState::new(
            GatewayConfig {
                model_name: model_name(&o.model, &o.name),
                max_context: cfg.max_position_embeddings,
                max_body: o.max_body,
                default_completion_tokens: 16,
                // the API takes temperatures in [0, 2]: a file's larger value is capped there
                default_temperature: generation.temperature.unwrap_or(1.0).min(2.0),
                default_top_p: generation.top_p.unwrap_or(1.0),
                default_top_k: generation.top_k.unwrap_or(0),
                max_attempts: o.max_attempts.max(1),
                retry_deadline: o.retry_deadline,
                body_timeout: o.body_timeout,
                max_client_requests: o.max_client_requests,
                responses_store_bytes: o.responses_store_mb.saturating_mul(1 << 20),
                stream_stall: o.stream_stall,
            },
            tokenizer,
            template,
            registry,
        )
        .with_auth(o.auth.clone()),
    );
    // the listening socket: a running gateway's, or a new one
    let taken = match &o.handoff {
        Some(p) => {
            let p = p.clone();
            tokio::task::spawn_blocking(move || moelane_gateway::handoff::take(&p))
                .await?
                .context("taking the listening socket from the running gateway")?
        }
        None => None,
    };
    let (std_listener, taken) = match taken {
        Some(t) => {
            let l = t.listener.try_clone()?;
            println!(
                "moelane: took the listening socket {} from the running gateway",
                l.local_addr()?
            );
            (l, Some(t))
        }
        None => (bind(&o.listen).await?.into_std()?, None),
    };
    // a copy to offer successors once this gateway serves (offering before would take the
    // handoff path from a predecessor this one may yet fail to replace)
    let to_offer = match &o.handoff {
        Some(_) => Some(std_listener.try_clone()?),
        None => None,
    };
    std_listener.set_nonblocking(true)?;
    let l = tokio::net::TcpListener::from_std(std_listener)?;
    let a = l.local_addr()?;
    moelane_gateway::server::register_metrics(state.clone());
    let app = moelane_gateway::router(state.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut limits = o.http.clone();
    // a connection whose client stops reading closes on the streams' stall bound
    limits.write_stall = o.stream_stall;
    let task = tokio::spawn(moelane_gateway::listen::serve(
        l,
        app,
        limits.clone(),
        stopped(stop_rx.clone()),
    ));
    // the admin listener: bound now, or, taking over from a running gateway (which holds
    // the same address until it drains), as soon as that one releases it
    let admin_app = moelane_gateway::admin_router(state.clone());
    let admin_addr = o.admin_listen.clone();
    let admin_scheme = if o.http.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let wait_for_it = o.handoff.is_some();
    let admin_task = tokio::spawn(async move {
        let until = std::time::Instant::now() + Duration::from_secs(120);
        let l = loop {
            match tokio::net::TcpListener::bind(&admin_addr).await {
                Ok(l) => break l,
                Err(e)
                    if wait_for_it
                        && e.kind() == std::io::ErrorKind::AddrInUse
                        && std::time::Instant::now() < until =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::error!(addr = %admin_addr, "the admin listener cannot bind: {e}");
                    return;
                }
            }
        };
        if let Ok(a) = l.local_addr() {
            println!("moelane: gateway admin {admin_scheme}://{a}");
        }
        moelane_gateway::listen::serve(l, admin_app, limits, stopped(stop_rx)).await;
    });
    if let Some(t) = taken {
        // the previous gateway stops accepting once told: this one accepts already
        tokio::task::spawn_blocking(move || t.serving())
            .await?
            .context("telling the previous gateway")?;
    }
    let offer = match (&o.handoff, to_offer) {
        (Some(p), Some(l)) => Some(
            moelane_gateway::handoff::offer(p, &l)
                .with_context(|| format!("serving handoffs at {}", p.display()))?,
        ),
        _ => None,
    };
    Ok(Gateway {
        addr: a,
        state,
        stop: stop_tx,
        task,
        admin_task,
        offer,
    })
}

#[cfg(test)]
mod plan_tests {
    use moelane_engine::config::Family;
    use moelane_engine::kv::KvDtype;
    use moelane_engine::placement::Budget;
    use moelane_engine::random_ckpt::{self, Dims};

    #[test]
    fn a_bf16_kv_cache_the_primary_would_refuse_is_refused_before_calibrating() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = super::PlacementSpec {
            budget: Budget::HotExperts(2),
            counts: None,
        };
        for family in [Family::Qwen3Moe, Family::DeepseekV3] {
            let dir = tmp.path().join(family.name());
            random_ckpt::write(family, &Dims::for_family(family), 7, &dir).unwrap();
            let mla = family == Family::DeepseekV3;
            for gpu in [false, true] {
                let r = super::plan_map(&dir, &spec, 256, KvDtype::Bf16, 0, gpu);
                match r {
                    Ok(_) => assert!(!gpu && !mla, "{family:?} gpu {gpu}: accepted"),
                    Err(e) => {
                        let e = format!("{e:#}");
                        assert!(gpu || mla, "{family:?} gpu {gpu}: {e}");
                        assert!(e.contains("--kv-dtype bf16"), "{e}");
                        assert!(e.contains(if gpu { "GPU" } else { "latent" }), "{e}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod endpoint_tests {
    #[test]
    fn a_wildcard_data_address_takes_the_control_host() {
        use super::{control_host, reachable};
        let h = control_host("http://sidecar1:50061");
        assert_eq!(h.as_deref(), Some("sidecar1"));
        assert_eq!(reachable("0.0.0.0:50062", h.as_deref()), "sidecar1:50062");
        assert_eq!(reachable("[::]:7", Some("[fd00::1]")), "[fd00::1]:7");
        assert_eq!(reachable("10.0.0.2:50062", h.as_deref()), "10.0.0.2:50062");
        assert_eq!(
            control_host("http://[fd00::1]:50061/").as_deref(),
            Some("[fd00::1]")
        );
        assert_eq!(reachable("0.0.0.0:1", None), "0.0.0.0:1");
    }
}
