//! The sidecar (the RTX role of the reference deployment): holds the cold experts of every
//! MoE layer and computes any cold pick for any step, one output per pick. Control (register,
//! health, stats, load map) goes through a kameo actor behind a tonic server; the data plane
//! (TCP or shared memory) calls the cold bank directly from its own threads, never through
//! the actor's mailbox.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};
use kameo::Actor;
use moelane_engine::bank::ExpertBank;
use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::gpu::GpuExperts;
use moelane_engine::rowmap::{Rowmap, Tier, ValidMap};
use moelane_engine::tier::ColdRequest;
use moelane_link::ColdService;
use moelane_proto::control::sidecar_server::SidecarServer;
use moelane_proto::control::*;
use moelane_proto::Category;
use moelane_residency_actor::protocol::{PrepareStep, RegisterStep, ReleaseStep, TierEpochs};
use moelane_residency_actor::SwapError;
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};

mod control;
pub use control::*;

/// The cold experts, the committed map, and the next map while a swap is prepared.
pub struct ColdState {
    pub bank: ExpertBank,
    /// Epoch bookkeeping: the transitions of [`moelane_residency_actor::protocol`].
    pub epochs: TierEpochs,
    pub map: ValidMap,
    /// Set between PREPARE and RELEASE/ABORT: requests tagged with its epoch are served too.
    pub next: Option<ValidMap>,
}

/// Where the cold experts are computed.
pub enum Device {
    Cpu,
    /// Experts mirrored on a GPU (the CPU bank stays the record of what is resident).
    Gpu(Box<std::sync::Mutex<GpuExperts>>),
}

impl Device {
    /// "cpu" or "cuda:N".
    pub fn open(spec: &str, bank: &ExpertBank) -> moelane_engine::Result<Device> {
        if spec == "cpu" {
            return Ok(Device::Cpu);
        }
        let Some(n) = spec
            .strip_prefix("cuda:")
            .or((spec == "cuda").then_some("0"))
        else {
            return Err(moelane_engine::Error::Invalid(format!(
                "--sidecar-device {spec:?}: choose cpu or cuda:N"
            )));
        };
        let ordinal: usize = n.parse().map_err(|_| {
            moelane_engine::Error::Invalid(format!(
                "--sidecar-device {spec:?}: N in cuda:N must be a number"
            ))
        })?;
        Self::open_gpu(ordinal, bank)
    }

    fn open_gpu(ordinal: usize, bank: &ExpertBank) -> moelane_engine::Result<Device> {
        let gpu = moelane_engine::gpu::Gpu::open(ordinal)?;
        let mut g = GpuExperts::new(gpu, bank.hidden, bank.inter)?;
        g.sync(bank)?;
        Ok(Device::Gpu(Box::new(std::sync::Mutex::new(g))))
    }

    /// The GPU expert bank, when computing on a GPU.
    pub fn gpu(&self) -> Option<&std::sync::Mutex<GpuExperts>> {
        match self {
            Device::Gpu(g) => Some(g),
            Device::Cpu => None,
        }
    }

    /// The GPU's ordinal, when computing on one.
    pub fn ordinal(&self) -> Option<usize> {
        match self {
            Device::Cpu => None,
            Device::Gpu(g) => g.lock().ok().map(|g| g.ordinal()),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Gpu(g) => g
                .lock()
                .map(|g| g.describe())
                .unwrap_or_else(|_| "gpu (poisoned)".into()),
        }
    }

    /// One output row per pick, on this device.
    pub fn compute(
        &self,
        bank: &ExpertBank,
        layer: usize,
        picks: &[moelane_engine::bank::Pick],
        acts: &[f32],
        out: &mut [f32],
    ) -> moelane_engine::Result<()> {
        match self {
            Device::Cpu => bank.compute(layer, picks, acts, out),
            Device::Gpu(g) => g
                .lock()
                .map_err(|_| poisoned("the GPU experts"))?
                .compute(layer, picks, acts, out),
        }
    }

    /// Makes the GPU mirror hold what `bank` holds (after any change to the bank).
    fn mirror(&self, bank: &ExpertBank) -> moelane_engine::Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Gpu(g) => g
                .lock()
                .map_err(|_| poisoned("the GPU experts"))?
                .sync(bank),
        }
    }
}

/// A swap step's failure as a gRPC status: its fault, under the protocol's shared name.
pub fn swap_status(e: SwapError) -> Status {
    Category::parse(e.fault.name()).status(e.what)
}

/// An engine failure as a gRPC status, keeping its fault.
pub fn engine_status(e: moelane_engine::Error) -> Status {
    Category::parse(e.fault().name()).status(e.to_string())
}

/// A lock whose holder panicked: the state behind it may be half-changed, so the sidecar
/// refuses to serve from it (loudly, as an internal error) rather than guess.
fn poisoned(what: &str) -> moelane_engine::Error {
    moelane_engine::Error::Internal(format!(
        "{what}: a thread panicked while changing it; restart the sidecar"
    ))
}

/// The sidecar's compute, shared by every link.
pub struct SidecarCore {
    pub model: String,
    pub ckpt_dir: PathBuf,
    pub state: RwLock<ColdState>,
    pub device: Device,
    pub requests: AtomicU64,
    pub picks: AtomicU64,
    pub compute_ns: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Expert weight bytes the computations read: each distinct expert of a request once,
    /// at the bytes its bank holds (over `compute_ns`: the tier's read rate while busy).
    pub weight_bytes: AtomicU64,
    /// The host's read bandwidth (bytes/s) when measured (`--probe-bandwidth`), else 0.
    pub host_read_bw: AtomicU64,
    /// Control messages answered, whatever the answer (a refused late or duplicated message
    /// counts): what a test or an operator waits on to know a message has been dealt with.
    pub answered: Answered,
    /// Set when the process was asked to stop: Health says draining (its primary turns
    /// unready so gateways send new requests elsewhere) while the layer requests of what
    /// runs are still served.
    pub draining: std::sync::atomic::AtomicBool,
    /// Layer requests being computed now.
    pub in_flight: std::sync::atomic::AtomicUsize,
}

/// Counts of the swap protocol's messages a sidecar has answered, by kind.
#[derive(Debug, Default)]
pub struct Answered {
    pub prepare: AtomicU64,
    pub release: AtomicU64,
    pub abort: AtomicU64,
}

/// Counts `r` as answered on `counter`, then passes it on.
fn answered<T>(counter: &AtomicU64, r: T) -> T {
    counter.fetch_add(1, Ordering::Relaxed);
    r
}

impl SidecarCore {
    /// The cold state, for reading.
    fn read_state(&self) -> moelane_engine::Result<std::sync::RwLockReadGuard<'_, ColdState>> {
        self.state.read().map_err(|_| poisoned("the sidecar state"))
    }

    /// The cold state, for a swap step.
    fn write_state(&self) -> moelane_engine::Result<std::sync::RwLockWriteGuard<'_, ColdState>> {
        self.state
            .write()
            .map_err(|_| poisoned("the sidecar state"))
    }

    /// One request under the state lock: the epoch check, `compute` (given the bank), the
    /// counters (`acts` floats in, one row per pick out).
    fn serve_with(
        &self,
        req: &ColdRequest,
        acts: usize,
        compute: impl FnOnce(&ColdState) -> moelane_engine::Result<()>,
    ) -> moelane_engine::Result<()> {
        let t0 = Instant::now();
        // counted from arrival to answer: a drain waits while any request is inside
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        struct Leave<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _leave = Leave(&self.in_flight);
        let st = self.read_state()?;
        if !st.epochs.serves(req.epoch) {
            return Err(moelane_engine::Error::EpochMismatch {
                got: req.epoch,
                serves: st.epochs.describe(),
            });
        }
        compute(&st)?;
        let layer = req.layer as usize;
        let mut experts: Vec<u16> = req.picks.iter().map(|p| p.expert).collect();
        experts.sort_unstable();
        experts.dedup();
        let read: usize = experts
            .iter()
            .filter_map(|&e| st.bank.get(layer, e as usize))
            .map(|w| w.bytes())
            .sum();
        self.weight_bytes.fetch_add(read as u64, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.picks
            .fetch_add(req.picks.len() as u64, Ordering::Relaxed);
        self.bytes_in
            .fetch_add((acts * 4 + req.picks.len() * 8) as u64, Ordering::Relaxed);
        self.bytes_out.fetch_add(
            (req.picks.len() * st.bank.hidden * 4) as u64,
            Ordering::Relaxed,
        );
        self.compute_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl ColdService for SidecarCore {
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> moelane_engine::Result<()> {
        self.serve_with(req, req.activations.len(), |st| {
            // the picks checked before their outputs' room is made
            st.bank
                .check_picks(req.layer as usize, &req.picks, req.activations.len())?;
            out.clear();
            out.resize(req.picks.len() * st.bank.hidden, 0.0);
            self.device.compute(
                &st.bank,
                req.layer as usize,
                &req.picks,
                &req.activations,
                out,
            )
        })
    }

    unsafe fn serve_device(
        &self,
        req: &ColdRequest,
        ordinal: usize,
        acts: u64,
        acts_len: usize,
        out: u64,
        out_len: usize,
    ) -> Option<moelane_engine::Result<usize>> {
        let g = self.device.gpu()?;
        let h = g.lock().ok()?.hidden();
        if self.device.ordinal() != Some(ordinal) {
            return None;
        }
        if h == 0 || !acts_len.is_multiple_of(h) || req.picks.len() * h > out_len {
            return Some(Err(moelane_engine::Error::Invalid(format!(
                "{acts_len} activation floats and {} picks do not fit rows of {h} ({out_len} floats of room)",
                req.picks.len()
            ))));
        }
        let floats = req.picks.len() * h;
        Some(
            self.serve_with(req, acts_len, |_| {
                let mut g = g.lock().map_err(|_| poisoned("the GPU experts"))?;
                // SAFETY: the link's guarantee (see the trait): acts and out on this GPU
                unsafe { g.compute_device(req.layer as usize, &req.picks, acts, acts_len / h, out) }
            })
            .map(|()| floats),
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<Arc<moelane_engine::cuda::Gpu>> {
        let g = self.device.gpu()?;
        let g = g.lock().ok()?;
        Some(g.gpu().clone())
    }

    fn check_epoch(&self, epoch: u64) -> moelane_engine::Result<()> {
        let st = self.read_state()?;
        if !st.epochs.serves(epoch) {
            return Err(moelane_engine::Error::EpochMismatch {
                got: epoch,
                serves: st.epochs.describe(),
            });
        }
        Ok(())
    }

    unsafe fn serve_slots(
        &self,
        layer: usize,
        experts: usize,
        idx: u64,
        h: u64,
        rows: usize,
        k: usize,
        y: u64,
        pdl: bool,
    ) -> Option<moelane_engine::Result<u64>> {
        let g = self.device.gpu()?;
        let t0 = Instant::now();
        let r = match g.lock() {
            // SAFETY: the link's guarantee (see the trait): the pointers on this GPU
            Ok(mut g) => unsafe { g.compute_slots(layer, experts, idx, h, rows, k, y, pdl) },
            Err(_) => Err(poisoned("the GPU experts")),
        };
        // the picks stay on the device: a request is counted, its picks are not
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.compute_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Some(r)
    }
}

impl SidecarCore {
    /// Loads the cold experts the map assigns, from the checkpoint.
    pub fn load(ckpt: &Checkpoint, map: &ValidMap) -> moelane_engine::Result<Self> {
        let bank = moelane_engine::load::load_tier(ckpt, map, Tier::Cold, true)?;
        Ok(SidecarCore {
            model: ckpt.id.clone(),
            ckpt_dir: ckpt.dir.clone(),
            state: RwLock::new(ColdState {
                bank,
                epochs: TierEpochs::new(map.epoch()),
                map: map.clone(),
                next: None,
            }),
            device: Device::Cpu,
            requests: AtomicU64::new(0),
            picks: AtomicU64::new(0),
            compute_ns: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            weight_bytes: AtomicU64::new(0),
            host_read_bw: AtomicU64::new(0),
            answered: Answered::default(),
            draining: Default::default(),
            in_flight: Default::default(),
        })
    }

    /// A sidecar whose cold experts were generated on a GPU (the `station` preset of the
    /// benches, no file): served through the same epoch check, counters and links as a
    /// checkpoint's, with no host copy of the experts (swaps cannot move them).
    pub fn generated(model: &str, map: &ValidMap, experts: GpuExperts) -> Self {
        let bank = ExpertBank::empty(
            Tier::Cold,
            map.layers(),
            map.experts(),
            experts.hidden(),
            experts.inter(),
        );
        SidecarCore {
            model: model.to_string(),
            ckpt_dir: PathBuf::new(),
            state: RwLock::new(ColdState {
                bank,
                epochs: TierEpochs::new(map.epoch()),
                map: map.clone(),
                next: None,
            }),
            device: Device::Gpu(Box::new(std::sync::Mutex::new(experts))),
            requests: AtomicU64::new(0),
            picks: AtomicU64::new(0),
            compute_ns: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            weight_bytes: AtomicU64::new(0),
            host_read_bw: AtomicU64::new(0),
            answered: Answered::default(),
            draining: Default::default(),
            in_flight: Default::default(),
        }
    }

    /// Computes on `spec` ("cpu" or "cuda:N") instead of the CPU.
    pub fn with_device(mut self, spec: &str) -> moelane_engine::Result<Self> {
        let st = self.read_state()?;
        let d = Device::open(spec, &st.bank)?;
        drop(st);
        self.device = d;
        Ok(self)
    }

    pub fn epoch(&self) -> u64 {
        self.state.read().map(|s| s.epochs.epoch).unwrap_or(0)
    }

    /// The staged epoch, while a swap is prepared.
    pub fn staged(&self) -> Option<u64> {
        self.state.read().ok().and_then(|s| s.epochs.next)
    }

    /// PREPARE: checks the epochs, validates the next map, loads and verifies the incoming
    /// experts (without holding the lock, so serving goes on), then, checking the epochs again
    /// under the lock (an ABORT may have come meanwhile), stages them.
    pub fn prepare(
        &self,
        incarnation: u64,
        base: u64,
        next: Rowmap,
        incoming: &[moelane_engine::swap::Incoming],
    ) -> Result<u64, SwapError> {
        let r = self.prepare_inner(incarnation, base, next, incoming);
        answered(&self.answered.prepare, r)
    }

    fn prepare_inner(
        &self,
        incarnation: u64,
        base: u64,
        next: Rowmap,
        incoming: &[moelane_engine::swap::Incoming],
    ) -> Result<u64, SwapError> {
        let epoch = next.epoch;
        let (layers, experts) = {
            let st = self.read_state()?;
            if st.epochs.check_prepare(incarnation, base, epoch)? == PrepareStep::AlreadyStaged {
                return Ok(epoch);
            }
            (st.map.layers(), st.map.experts())
        };
        let next = next
            .validate(&self.model, layers, experts, None)
            .map_err(|e| SwapError::invalid(e.to_string()))?;
        let loaded = {
            let _g = tracing::info_span!("load", moelane.experts = incoming.len()).entered();
            moelane_residency_actor::failpoint::load_point("sidecar.load")
                .map_err(SwapError::unavailable)?;
            let ckpt = Checkpoint::open(&self.ckpt_dir)?;
            moelane_engine::swap::load_verified(&ckpt, incoming)?
        };
        let _g = tracing::info_span!("stage").entered();
        let mut st = self.write_state()?;
        let step = st.epochs.check_prepare(incarnation, base, epoch)?;
        match step {
            PrepareStep::AlreadyStaged => return Ok(epoch),
            PrepareStep::PromoteThenStage => {
                if let Some(n) = st.next.take() {
                    st.map = n;
                }
            }
            PrepareStep::DropThenStage => st.next = None,
            PrepareStep::Stage => {}
        }
        // free what neither the (possibly promoted) committed map nor the new one uses
        {
            let ColdState { bank, map, .. } = &mut *st;
            moelane_engine::swap::release(bank, map, Tier::Cold);
        }
        moelane_engine::swap::stage(&mut st.bank, loaded);
        moelane_engine::swap::check_resident(&st.bank, &next, Tier::Cold)?;
        self.device.mirror(&st.bank)?;
        st.epochs.apply_prepare(step, epoch);
        st.next = Some(next);
        Ok(epoch)
    }

    /// RELEASE: `epoch` (staged) is committed and becomes the only map; slots only the old one
    /// used are freed. A repeated RELEASE is a no-op.
    pub fn release(&self, incarnation: u64, epoch: u64) -> Result<u64, SwapError> {
        let r = self.release_inner(incarnation, epoch);
        answered(&self.answered.release, r)
    }

    fn release_inner(&self, incarnation: u64, epoch: u64) -> Result<u64, SwapError> {
        let mut st = self.write_state()?;
        if st.epochs.release(incarnation, epoch)? == ReleaseStep::Promote {
            if let Some(n) = st.next.take() {
                st.map = n;
            }
            let ColdState { bank, map, .. } = &mut *st;
            moelane_engine::swap::release(bank, map, Tier::Cold);
            self.device.mirror(bank)?;
        }
        Ok(st.epochs.epoch)
    }

    /// ABORT(epoch): drops what was staged for it (nothing else changes); it is never staged
    /// afterwards, even by a PREPARE still loading.
    pub fn abort(&self, incarnation: u64, epoch: u64) -> Result<(), SwapError> {
        let r = self.abort_inner(incarnation, epoch);
        answered(&self.answered.abort, r)
    }

    fn abort_inner(&self, incarnation: u64, epoch: u64) -> Result<(), SwapError> {
        let mut st = self.write_state()?;
        if st.epochs.abort(incarnation, epoch)? {
            st.next = None;
            let ColdState { bank, map, .. } = &mut *st;
            moelane_engine::swap::release(bank, map, Tier::Cold);
            self.device.mirror(bank)?;
        }
        Ok(())
    }

    /// REGISTER from coordinator `incarnation` committed on `map`: the bank is made to match it
    /// (kept, promoted from the staged map, or reloaded from the checkpoint) and everything of
    /// other incarnations is fenced off. Returns the highest epoch heard of before.
    pub fn register(&self, incarnation: u64, map: Option<ValidMap>) -> Result<u64, SwapError> {
        let (step, highest) = {
            let st = self.read_state()?;
            st.epochs.check_register(incarnation)?;
            let step = match &map {
                None => RegisterStep::KeepCommitted,
                Some(m) if m.map == st.map.map => RegisterStep::KeepCommitted,
                Some(m) if st.next.as_ref().map(|n| &n.map) == Some(&m.map) => {
                    RegisterStep::PromoteStaged
                }
                Some(_) => RegisterStep::Reload,
            };
            (step, st.epochs.highest())
        };
        let bank = match (&map, step) {
            (Some(m), RegisterStep::Reload) => {
                let ckpt = Checkpoint::open(&self.ckpt_dir)?;
                let moe = ckpt.config.moe_layers();
                let bank = ExpertBank::load(&ckpt, m, Tier::Cold, &moe, None)?;
                if let Some(numa) = moelane_engine::numa::summary() {
                    tracing::info!("{numa}");
                }
                Some(bank)
            }
            _ => None,
        };
        let mut st = self.write_state()?;
        if let Some(m) = map {
            st.map = m;
        } else if step == RegisterStep::PromoteStaged {
            if let Some(n) = st.next.take() {
                st.map = n;
            }
        }
        if let Some(b) = bank {
            st.bank = b;
        }
        st.epochs.check_register(incarnation)?;
        st.next = None;
        let epoch = st.map.epoch();
        st.epochs.register(incarnation, epoch);
        let ColdState { bank, map, .. } = &mut *st;
        moelane_engine::swap::release(bank, map, Tier::Cold);
        moelane_engine::swap::check_resident(bank, map, Tier::Cold)?;
        self.device.mirror(bank)?;
        Ok(highest)
    }
}

/// The sidecar in this process, as the coordinator drives it.
pub struct LocalSidecar(pub Arc<SidecarCore>);

impl moelane_residency_actor::Participant for LocalSidecar {
    fn name(&self) -> &'static str {
        "sidecar"
    }
    fn prepare<'a>(
        &'a self,
        base: u64,
        next: &'a Rowmap,
        incoming: Vec<moelane_engine::swap::Incoming>,
    ) -> futures::future::BoxFuture<'a, Result<(), SwapError>> {
        let core = self.0.clone();
        let next = next.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || core.prepare(0, base, next, &incoming).map(|_| ()))
                .await
                .map_err(|e| SwapError::internal(format!("the PREPARE task: {e}")))?
        })
    }
    fn release(&self, epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        Box::pin(async move { self.0.release(0, epoch).map(|_| ()) })
    }
    fn abort(&self, epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        Box::pin(async move { self.0.abort(0, epoch) })
    }
}

/// Options of a sidecar process.
#[derive(Clone, Debug)]
pub struct SidecarOptions {
    pub model: PathBuf,
    pub map: Option<PathBuf>,
    /// Data-plane TCP listener address (None: shm only).
    pub data: Option<String>,
    pub shm_dir: PathBuf,
    /// Bytes per ring of a shared-memory link.
    pub shm_cap: u64,
    /// Where cold experts are computed: "cpu" or "cuda:N".
    pub device: String,
    /// Measure the host's read bandwidth once at start ([`probe_bandwidth`]).
    pub probe_bandwidth: bool,
}

/// A started sidecar: its actor and the addresses it serves.
pub struct Sidecar0 {
    pub core: Arc<SidecarCore>,
    pub actor: ActorRef<SidecarActor>,
    pub data_addr: Option<SocketAddr>,
}

/// Loads the cold bank, starts the data-plane listener and the actor.
pub fn start(opts: &SidecarOptions) -> moelane_engine::Result<Sidecar0> {
    let ckpt = Checkpoint::open(&opts.model)?;
    let map = match &opts.map {
        Some(p) => Some(Rowmap::read(p)?),
        None => None,
    };
    let map = moelane_engine::load::resolve_map(&ckpt, map)?;
    let core = Arc::new(SidecarCore::load(&ckpt, &map)?.with_device(&opts.device)?);
    let data_addr = match &opts.data {
        Some(a) => {
            let listen = |e: std::io::Error| {
                moelane_engine::Error::link(
                    "tcp",
                    moelane_engine::error::Fault::Unavailable,
                    format!("data listener {a}: {e}"),
                )
            };
            let l = std::net::TcpListener::bind(a).map_err(listen)?;
            let addr = l.local_addr().map_err(listen)?;
            moelane_link::tcp::serve(l, core.clone());
            Some(addr)
        }
        None => None,
    };
    let actor = SidecarActor::spawn(SidecarActor {
        core: core.clone(),
        ckpt_dir: opts.model.clone(),
        tcp_data: data_addr,
        shm_dir: opts.shm_dir.clone(),
        shm_cap: opts.shm_cap,
        shm_count: 0,
        nccl_stop: None,
        last_health: None,
        registers: Default::default(),
        owner: Default::default(),
    });
    Ok(Sidecar0 {
        core,
        actor,
        data_addr,
    })
}

/// Serves the control API (and `grpc.health.v1.Health`: SERVING unless draining, for
/// Kubernetes gRPC probes) on `listener` until the future is dropped.
pub async fn serve_control(
    listener: tokio::net::TcpListener,
    actor: ActorRef<SidecarActor>,
    core: Arc<SidecarCore>,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    {
        let core = core.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let serving = !core.draining.load(Ordering::SeqCst);
                if last != Some(serving) {
                    let status = if serving {
                        tonic_health::ServingStatus::Serving
                    } else {
                        tonic_health::ServingStatus::NotServing
                    };
                    for name in ["", "moelane.control.v1.Sidecar"] {
                        reporter.set_service_status(name, status).await;
                    }
                    last = Some(serving);
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        });
    }
    let mut server = match moelane_proto::tls::cluster_tls() {
        Some(t) => tonic::transport::Server::builder().tls_config(t.server())?,
        None => tonic::transport::Server::builder(),
    };
    server
        .add_service(health)
        .add_service(SidecarServer::with_interceptor(
            SidecarService { actor, core },
            moelane_proto::auth::Check::cluster(),
        ))
        .serve_with_incoming(
            tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
                if let Ok(s) = &s {
                    let _ = s.set_nodelay(true);
                }
                s
            }),
        )
        .await
}

/// Default directory for shared-memory mappings.
pub fn default_shm_dir() -> PathBuf {
    let p = Path::new("/dev/shm");
    if p.is_dir() {
        p.into()
    } else {
        std::env::temp_dir()
    }
}

/// Measures the host's read bandwidth once, on a thread of its own (it reads a buffer of
/// four times the last-level cache, about a second), into `core.host_read_bw`.
pub fn probe_bandwidth(core: Arc<SidecarCore>) {
    let _ = std::thread::Builder::new()
        .name("moelane-bw-probe".into())
        .spawn(move || {
            let bw = moelane_engine::hostmem::measure_read_bandwidth(
                moelane_engine::hostmem::last_level_cache(),
            );
            core.host_read_bw.store(bw as u64, Ordering::Relaxed);
            tracing::info!(
                "host read bandwidth {:.1} GB/s (the sidecar's weight reads are reported against it)",
                bw / 1e9
            );
        });
}

/// Publishes the sidecar's counters on each scrape of the Prometheus page.
pub fn register_metrics(core: Arc<SidecarCore>) {
    use moelane_telemetry::names as n;
    moelane_telemetry::add_collector(Box::new(move || {
        let c = core.clone();
        Box::pin(async move {
            metrics::counter!(n::SIDECAR_REQUESTS).absolute(c.requests.load(Ordering::Relaxed));
            metrics::counter!(n::SIDECAR_PICKS).absolute(c.picks.load(Ordering::Relaxed));
            moelane_telemetry::set_seconds_total(
                n::SIDECAR_COMPUTE,
                &[],
                c.compute_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            );
            metrics::counter!(n::LINK_BYTES, "link" => "all", "side" => "sidecar", "direction" => "received")
                .absolute(c.bytes_in.load(Ordering::Relaxed));
            metrics::counter!(n::LINK_BYTES, "link" => "all", "side" => "sidecar", "direction" => "sent")
                .absolute(c.bytes_out.load(Ordering::Relaxed));
            metrics::counter!(n::SIDECAR_WEIGHT_BYTES)
                .absolute(c.weight_bytes.load(Ordering::Relaxed));
            let bw = c.host_read_bw.load(Ordering::Relaxed);
            if bw > 0 {
                metrics::gauge!(n::HOST_READ_BANDWIDTH).set(bw as f64);
            }
            if let Ok(st) = c.state.read() {
                let resident: usize = (0..st.bank.layers()).map(|l| st.bank.resident(l)).sum();
                metrics::gauge!(n::SIDECAR_EXPERTS).set(resident as f64);
                metrics::gauge!(n::MAP_EPOCH, "tier" => "sidecar").set(st.epochs.epoch as f64);
            }
        })
    }));
}
