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

/// Words of the request box before the layer flags.
pub const REQ_HEAD_WORDS: usize = 8;

fn round256(n: usize) -> usize {
    n.div_ceil(256) * 256
}

/// The shape both ends agree on when the link opens: MoE layers, the most rows one step
/// may carry, picks per row and the hidden size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoxLayout {
    pub layers: usize,
    pub cap_rows: usize,
    pub k: usize,
    pub hidden: usize,
    /// experts per MoE layer (the picks index them)
    pub experts: usize,
}

impl BoxLayout {
    /// Checks the shape's numbers are usable (they arrive from the other process).
    pub fn check(&self) -> Result<()> {
        let ok = self.layers > 0
            && self.layers <= 4096
            && self.cap_rows > 0
            && self.k > 0
            && self.k <= 64
            && self.hidden > 0
            && self.hidden <= 1 << 16
            && self.experts > 0
            && self.experts <= 1 << 16
            && self.cap_rows.saturating_mul(self.k) <= 1 << 20;
        if !ok {
            return Err(Error::Invalid(format!(
                "ipc link shape {self:?}: layers 1..=4096, k 1..=64, hidden and experts 1..=65536, rows x k at most 2^20"
            )));
        }
        Ok(())
    }
    /// Byte offset of the picks in the request box.
    pub fn idx_off(&self) -> usize {
        round256(8 * (REQ_HEAD_WORDS + self.layers))
    }
    /// Byte offset of the normed rows in the request box.
    pub fn h_off(&self) -> usize {
        self.idx_off() + round256(4 * self.cap_rows * self.k)
    }
    /// Bytes of the request box.
    pub fn req_bytes(&self) -> usize {
        self.h_off() + round256(4 * self.cap_rows * self.hidden)
    }
    /// Byte offset of the per-slot marks in the reply box (the sequence number of the step
    /// whose row the sidecar wrote in that slot).
    pub fn mark_off(&self) -> usize {
        round256(8 * self.layers)
    }
    /// Byte offset of the output rows in the reply box.
    pub fn y_off(&self) -> usize {
        self.mark_off() + round256(8 * self.cap_rows * self.k)
    }
    /// Bytes of the reply box.
    pub fn reply_bytes(&self) -> usize {
        self.y_off() + round256(4 * self.cap_rows * self.k * self.hidden)
    }
}

/// What the primary's step backend needs of an open link: the two boxes' addresses on its
/// GPU and their layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MailboxPtrs {
    /// the GPU both boxes are addressed on
    pub ordinal: usize,
    /// the sidecar's request box, opened here
    pub req_box: u64,
    /// this process's reply box
    pub reply_box: u64,
    pub layout: BoxLayout,
    /// changes whenever the link is opened again (the backend re-reads the pointers)
    pub generation: u64,
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

    /// The bound last given to `set_reply_deadline`, for a link whose waits run on the
    /// device (the step's kernels read it); None: the link keeps its own.
    fn reply_deadline(&self) -> Option<std::time::Duration> {
        None
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

    /// The device mailbox of an `ipc` link, on [`RemoteTier::device_ordinal`]'s GPU: the
    /// primary's step then posts every MoE layer's picks and rows and waits for the reply
    /// on the device, with no host call per layer (`send`/`recv` are not used).
    fn device_mailbox(&mut self) -> Option<MailboxPtrs> {
        None
    }

    /// A step through [`RemoteTier::device_mailbox`] failed (the device saw a timeout, the
    /// sidecar's error or an epoch refusal): a supervised link drops this one and opens a
    /// new one.
    fn device_failed(&mut self) {}
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

    /// The GPU this service computes on, for the `ipc` link's device path (its kernels run
    /// on the same stream as the service's).
    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<Arc<crate::cuda::Gpu>> {
        None
    }

    /// Fails unless this tier serves map `epoch` now (the `ipc` link checks once per step).
    fn check_epoch(&self, epoch: u64) -> Result<()> {
        let _ = epoch;
        Ok(())
    }

    /// The `ipc` link's device path: MoE layer `layer`'s picks `[rows, k]` (ids below
    /// `experts`) at `idx` and normed rows at `h`, in memory of [`ColdService::cuda`]'s GPU;
    /// the picks whose experts this tier holds computed into `y` (one row of H per slot),
    /// queued on the GPU's stream. Returns the layer's gate_up table (`experts` entries,
    /// null where not held); `pdl`: launched as programmatic dependents of the kernel
    /// before them. None: this service does not compute on a GPU.
    ///
    /// # Safety
    /// `idx`, `h` and `y` address that many values on that GPU, unchanged until the
    /// stream's work is done.
    #[allow(clippy::too_many_arguments)]
    unsafe fn serve_slots(
        &self,
        _layer: usize,
        _experts: usize,
        _idx: u64,
        _h: u64,
        _rows: usize,
        _k: usize,
        _y: u64,
        _pdl: bool,
    ) -> Option<Result<u64>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_offsets_are_aligned_and_disjoint() {
        let l = BoxLayout {
            layers: 48,
            cap_rows: 64,
            k: 8,
            hidden: 2048,
            experts: 128,
        };
        l.check().unwrap();
        assert_eq!(l.idx_off() % 256, 0);
        assert!(l.idx_off() >= 8 * (8 + 48));
        assert!(l.h_off() >= l.idx_off() + 4 * 64 * 8);
        assert!(l.req_bytes() >= l.h_off() + 4 * 64 * 2048);
        assert!(l.y_off() >= l.mark_off() + 8 * 64 * 8);
        assert!(l.reply_bytes() >= l.y_off() + 4 * 64 * 8 * 2048);
        assert!(BoxLayout { k: 0, ..l }.check().is_err());
        assert!(BoxLayout {
            cap_rows: 1 << 20,
            ..l
        }
        .check()
        .is_err());
    }
}
