//! The cold tier as the primary sees it: send the cold picks of one layer, compute the hot
//! ones meanwhile, then wait for one output per pick. Every message carries the step, the
//! layer and the map epoch it was routed with. Links (in-process, shared memory, TCP, NCCL)
//! implement [`RemoteTier`]; this module has the in-process one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};

use crate::bank::{ExpertBank, Pick};
use crate::error::{Error, Fault, Result};

/// The cold request of one layer of one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColdRequest {
    pub step: u64,
    /// MoE layer index (the rowmap's layer).
    pub layer: u32,
    pub epoch: u64,
    pub picks: Vec<Pick>,
    /// `[rows, hidden]`: the distinct token rows the picks refer to.
    pub activations: Vec<f32>,
}

/// One output row per pick, in pick order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColdReply {
    pub step: u64,
    pub layer: u32,
    pub epoch: u64,
    pub outputs: Vec<f32>,
}

/// A link to the tier that holds the cold experts.
pub trait RemoteTier: Send {
    /// Sends one layer's cold picks; returns at once.
    fn send(&mut self, req: ColdRequest) -> Result<()>;
    /// Waits for the reply to the request sent last.
    fn recv(&mut self) -> Result<ColdReply>;
    /// Link kind, for metrics and logs.
    fn kind(&self) -> &'static str;

    /// The longest the next `recv` may wait for its reply (a link with a fixed deadline
    /// ignores it). The primary sizes it from the round trips it has seen, so a sidecar that
    /// stops answering fails a step in about that time rather than the link's whole timeout.
    fn set_reply_deadline(&mut self, deadline: std::time::Duration) {
        let _ = deadline;
    }

    /// The GPU whose memory this link sends from and receives into, when it can take a
    /// request's activations and give its outputs there ([`RemoteTier::send_device`]): an
    /// NCCL link. None for links through host memory.
    fn device_ordinal(&self) -> Option<usize> {
        None
    }

    /// As `send`, with the activations in device memory of [`RemoteTier::device_ordinal`]'s
    /// GPU: `acts_len` floats at `acts`, rows of the hidden size that `req.picks` index
    /// (`req.activations` is empty).
    ///
    /// # Safety
    /// `acts` addresses `acts_len` floats on that GPU, complete before the call and not
    /// written until the reply has been received.
    unsafe fn send_device(&mut self, req: ColdRequest, acts: u64, acts_len: usize) -> Result<()> {
        let _ = (req, acts, acts_len);
        Err(Error::Internal(format!(
            "the {} link sends from host memory",
            self.kind()
        )))
    }

    /// Waits for the reply to the request sent last by `send_device`: its tags (`outputs`
    /// empty) and the device address of its outputs (one row per pick) on the link's GPU,
    /// valid until the next send.
    fn recv_device(&mut self) -> Result<(ColdReply, u64, usize)> {
        Err(Error::Internal(format!(
            "the {} link receives into host memory",
            self.kind()
        )))
    }
}

/// What a cold tier does with a request: one trait for every server (the sidecar's
/// `SidecarCore`, whose map can be swapped; [`FixedBank`] and the bench's GPU tier, whose map
/// cannot) behind every link (in-process, shared memory, TCP, NCCL).
pub trait ColdService: Send + Sync {
    /// Fills `out` with one row per pick, or fails saying how (the fault travels back).
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()>;

    /// The NCCL link's device path: the request's activations (`acts_len` floats at device
    /// address `acts`; `req.activations` is empty) are read and its outputs (one row per
    /// pick, at most `out_len` floats at `out`) written in the memory of GPU `ordinal`,
    /// without a host copy; returns the floats written. `None`: this service computes
    /// elsewhere, and the link stages through host memory.
    ///
    /// # Safety
    /// `acts` and `out` address that many floats of GPU `ordinal`, 16-byte aligned, and no
    /// other work touches them until this returns.
    unsafe fn serve_device(
        &self,
        _req: &ColdRequest,
        _ordinal: usize,
        _acts: u64,
        _acts_len: usize,
        _out: u64,
        _out_len: usize,
    ) -> Option<Result<usize>> {
        None
    }
}

/// The epoch check of a tier whose map never changes: a request routed with any other map
/// is refused (the sidecar's swappable check is the residency protocol's `TierEpochs`).
pub fn fixed_epoch(req: &ColdRequest, serves: u64) -> Result<()> {
    if req.epoch != serves {
        return Err(Error::EpochMismatch {
            got: req.epoch,
            serves: serves.to_string(),
        });
    }
    Ok(())
}

/// A cold tier serving a single fixed bank on the CPU (no swaps).
pub struct FixedBank {
    pub bank: ExpertBank,
    pub epoch: u64,
}

impl ColdService for FixedBank {
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()> {
        fixed_epoch(req, self.epoch)?;
        out.clear();
        out.resize(req.picks.len() * self.bank.hidden, 0.0);
        self.bank
            .compute(req.layer as usize, &req.picks, &req.activations, out)
    }
}

/// A one-slot handoff between two threads: spin briefly, then park (no core burnt when idle).
struct Handoff<T> {
    slot: Mutex<Option<T>>,
    ready: AtomicBool,
    waiter: Mutex<Option<Thread>>,
    closed: AtomicBool,
}

impl<T> Handoff<T> {
    fn new() -> Self {
        Handoff {
            slot: Mutex::new(None),
            ready: AtomicBool::new(false),
            waiter: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    fn put(&self, v: T) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        if let Ok(mut s) = self.slot.lock() {
            *s = Some(v);
        }
        self.ready.store(true, Ordering::Release);
        if let Ok(w) = self.waiter.lock() {
            if let Some(t) = w.as_ref() {
                t.unpark();
            }
        }
        true
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Ok(w) = self.waiter.lock() {
            if let Some(t) = w.as_ref() {
                t.unpark();
            }
        }
    }

    fn take(&self) -> Option<T> {
        let mut spins = 0u32;
        loop {
            if self.ready.swap(false, Ordering::Acquire) {
                return self.slot.lock().ok().and_then(|mut s| s.take());
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            if spins < spin_limit() {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if let Ok(mut w) = self.waiter.lock() {
                *w = Some(std::thread::current());
            }
            if !self.ready.load(Ordering::Acquire) && !self.closed.load(Ordering::Acquire) {
                std::thread::park_timeout(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// The cold tier on its own thread in this process: messages move, nothing is copied.
/// The handoff spins for a few microseconds before parking, as the shared-memory link does,
/// so a layer's exchange costs microseconds, not a scheduler wake-up.
pub struct InProcessTier {
    req: Arc<Handoff<ColdRequest>>,
    rep: Arc<Handoff<Result<ColdReply>>>,
    thread: Option<JoinHandle<()>>,
}

impl InProcessTier {
    pub fn spawn(server: Arc<dyn ColdService>) -> Self {
        let req = Arc::new(Handoff::<ColdRequest>::new());
        let rep = Arc::new(Handoff::<Result<ColdReply>>::new());
        let (rq, rp) = (req.clone(), rep.clone());
        let thread = std::thread::Builder::new()
            .name("moelane-sidecar".into())
            .spawn(move || {
                let mut out = Vec::new();
                while let Some(req) = rq.take() {
                    let r = server.serve(&req, &mut out).map(|()| ColdReply {
                        step: req.step,
                        layer: req.layer,
                        epoch: req.epoch,
                        outputs: std::mem::take(&mut out),
                    });
                    if !rp.put(r) {
                        break;
                    }
                }
                rp.close();
            })
            .ok();
        InProcessTier { req, rep, thread }
    }
}

impl RemoteTier for InProcessTier {
    fn send(&mut self, req: ColdRequest) -> Result<()> {
        if self.req.put(req) {
            Ok(())
        } else {
            Err(Error::link(
                "inproc",
                Fault::Unavailable,
                "the sidecar stopped",
            ))
        }
    }
    fn recv(&mut self) -> Result<ColdReply> {
        self.rep
            .take()
            .ok_or_else(|| Error::link("inproc", Fault::Unavailable, "the sidecar stopped"))?
    }
    fn kind(&self) -> &'static str {
        "inproc"
    }
}

impl Drop for InProcessTier {
    fn drop(&mut self) {
        self.req.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Spins before a handoff parks: `MOELANE_SPIN` (default 2000, about 2-10 us).
fn spin_limit() -> u32 {
    static S: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *S.get_or_init(|| {
        std::env::var("MOELANE_SPIN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000)
    })
}
