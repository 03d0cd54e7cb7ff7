//! The `ipc` link (feature `cuda`): a device mailbox between a primary and a sidecar whose
//! GPUs can reach each other's memory (the same GPU, or two joined by NVLink or PCIe peer
//! access). Each side allocates a buffer and hands the other a CUDA IPC handle to it:
//!
//! 1. the primary allocates the reply box for its [`BoxLayout`] and asks with
//!    `ipc1:<pid>:<layers>:<rows>:<k>:<hidden>:<experts>:<handle>` ([`PrimaryEnd::params`]);
//! 2. the sidecar opens it, checks the shape against its model, allocates the request box
//!    of that shape and offers a line of the same form ([`SidecarEnd::open`],
//!    [`SidecarEnd::offer`]), then serves ([`SidecarEnd::serve`]);
//! 3. the primary opens the request box, checking the shape ([`PrimaryEnd::connect`]).
//!
//! The handshake's two lines travel over whatever joins the two processes (the control
//! channel, or a child's stdin and stdout). From then on the primary's step posts each MoE
//! layer's picks and normed rows into the request box and raises the layer's flag; the
//! sidecar's kernels wait for the flag on the device, compute the picks whose experts it
//! holds, write their rows into the reply box and raise the reply word; the primary's step
//! waits for that word on the device before its combine (`kernels/link.cu`). The sidecar's
//! host looks once per step (to read the step's rows and map epoch and queue the layers'
//! kernels), the primary's once per step (the status word). Every wait is bounded: the
//! primary's by the link's reply deadline, the sidecar's by [`SIDECAR_WAIT`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use moelane_engine::cuda::Gpu;
use moelane_engine::cuda_link::{IpcMem, LinkKernels, CODE_CANCELLED, CODE_EPOCH, CODE_FAILED};
use moelane_engine::error::Fault;
use moelane_engine::tier::{BoxLayout, ColdReply, ColdRequest, MailboxPtrs, RemoteTier};
use moelane_engine::{Error, Result};

pub use crate::ipc_line::line_layout;
use crate::ipc_line::{line, parse_line};
use crate::ColdService;

/// The longest the sidecar's kernels wait for one layer's flag once a step has begun (the
/// primary posts every layer of a step; a longer gap means it failed or stopped).
pub const SIDECAR_WAIT: Duration = Duration::from_secs(30);

fn err(fault: Fault, what: impl std::fmt::Display) -> Error {
    Error::link("ipc", fault, what.to_string())
}

/// Bumped by every link opened in this process: a new link's pointers are re-read.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// The sidecar's end before and while serving: its request box and, once accepted, the
/// primary's reply box.
pub struct SidecarEnd {
    gpu: Arc<Gpu>,
    layout: BoxLayout,
    req: IpcMem,
    reply: Option<IpcMem>,
    peer_pid: Option<u32>,
}

impl SidecarEnd {
    /// Opens the primary's reply box from its `params` and allocates the request box of
    /// the same shape on `gpu` (the GPU the service computes on). The caller checks the
    /// shape against its model ([`SidecarEnd::layout`]).
    pub fn open(gpu: Arc<Gpu>, params: &str) -> Result<Self> {
        let (pid, layout, h) = parse_line(params, "parameters")?;
        let reply = IpcMem::open(&gpu, &h, layout.reply_bytes())?;
        let req = IpcMem::alloc(&gpu, layout.req_bytes())?;
        Ok(SidecarEnd {
            gpu,
            layout,
            req,
            reply: Some(reply),
            peer_pid: Some(pid),
        })
    }

    /// The mailbox's shape (the primary's).
    pub fn layout(&self) -> BoxLayout {
        self.layout
    }

    /// The line the primary connects with.
    pub fn offer(&self) -> Result<String> {
        Ok(line(&self.layout, &self.req.handle()?))
    }

    /// Serves `svc` until `stop` is set, the primary's process is gone, or the link fails:
    /// per step, reads the step's head, checks its map epoch, and queues every layer's
    /// wait, experts and reply.
    pub fn serve(&mut self, svc: &Arc<dyn ColdService>, stop: &AtomicBool) -> Result<()> {
        if self.reply.is_none() {
            return Err(Error::Internal(
                "serving before the primary's answer".into(),
            ));
        }
        let gpu = svc
            .cuda()
            .ok_or_else(|| err(Fault::Unavailable, "the sidecar does not compute on a GPU"))?;
        if gpu.ordinal != self.gpu.ordinal {
            return Err(err(
                Fault::Unavailable,
                format!(
                    "the sidecar computes on cuda:{} but its mailbox is on cuda:{}",
                    gpu.ordinal, self.gpu.ordinal
                ),
            ));
        }
        let lay = self.layout;
        let kern = LinkKernels::load(&gpu)?;
        let st = gpu.stream.clone();
        let alloc = |n: usize| -> Result<CudaSlice<u64>> {
            st.alloc_zeros::<u64>(n)
                .map_err(|e| err(Fault::Internal, format!("allocating: {e:?}")))
        };
        let mut smeta = alloc(4)?;
        let done = alloc(1)?;
        let y = st
            .alloc_zeros::<f32>(lay.cap_rows * lay.k * lay.hidden)
            .map_err(|e| err(Fault::Internal, format!("allocating: {e:?}")))?;
        let (sm, dn, yp) = (
            smeta.device_ptr(&st).0,
            done.device_ptr(&st).0,
            y.device_ptr(&st).0,
        );
        // the head is polled on a stream of its own, so the host sees a new step (and the
        // stop flag, and a dead primary) while a step's program still runs or waits
        let poll = gpu
            .ctx
            .new_stream()
            .map_err(|e| err(Fault::Internal, format!("creating a stream: {e:?}")))?;
        let r = self.serve_loop(svc, stop, &gpu, &kern, &poll, [sm, dn, yp], &mut smeta);
        // whatever ended the loop: the program still queued stops without touching the
        // primary's memory (which may be gone), and drains before the boxes are freed
        let cancel = [CODE_CANCELLED];
        // SAFETY: sm addresses the 4 words of smeta; the source outlives the wait below.
        let c = unsafe {
            cudarc::driver::result::memcpy_htod_async(sm + 16, &cancel, poll.cu_stream())
                .and_then(|()| cudarc::driver::result::stream::synchronize(poll.cu_stream()))
        };
        let drained = st.synchronize();
        if let Err(e) = c
            .map_err(|e| format!("{e:?}"))
            .and(drained.map_err(|e| format!("{e:?}")))
        {
            tracing::warn!("ipc link: draining the sidecar's program: {e}");
        }
        drop((smeta, done, y));
        r
    }

    /// The serving loop of [`Self::serve`]: `p` is the sidecar meta's, the done counter's
    /// and the local rows' addresses.
    #[allow(clippy::too_many_arguments)]
    fn serve_loop(
        &mut self,
        svc: &Arc<dyn ColdService>,
        stop: &AtomicBool,
        gpu: &Arc<Gpu>,
        kern: &LinkKernels,
        poll: &Arc<CudaStream>,
        p: [u64; 3],
        smeta: &mut CudaSlice<u64>,
    ) -> Result<()> {
        let [sm, dn, yp] = p;
        let lay = self.layout;
        let st = gpu.stream.clone();
        let (req, rep) = (self.req.ptr, self.reply.as_ref().map_or(0, |r| r.ptr));
        let mut head = [0u64; 4];
        // the experts and the reply launched as programmatic dependents (the wait before
        // them is not: it is the step's gate)
        let pdl = gpu.cc.0 >= 9 && moelane_engine::cuda_link::ipc_pdl();
        let mut last = 0u64;
        let limit = SIDECAR_WAIT.as_nanos() as u64;
        let mut idle_since = Instant::now();
        let mut last_alive = Instant::now();
        loop {
            // the step's head: polled from the host (a small copy on its own stream)
            // SAFETY: the request box holds at least the 4 head words; `head` is host memory
            // waited for before it is read.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(&mut head, req, poll.cu_stream())
                    .and_then(|()| cudarc::driver::result::stream::synchronize(poll.cu_stream()))
            }
            .map_err(|e| err(Fault::Internal, format!("reading the step's head: {e:?}")))?;
            let w = |i: usize| head[i];
            let seq = w(0);
            if seq == last {
                if stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                if last_alive.elapsed() > Duration::from_secs(1) {
                    last_alive = Instant::now();
                    if let Some(pid) = self.peer_pid {
                        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                            return Err(err(
                                Fault::Unavailable,
                                format!("the primary (pid {pid}) is gone"),
                            ));
                        }
                    }
                }
                if idle_since.elapsed() > Duration::from_millis(20) {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            last = seq;
            idle_since = Instant::now();
            let (rows, epoch) = (w(1) as usize, w(2));
            let mut code = 0u64;
            if rows == 0 || rows > 1 << 24 {
                eprintln!("moelane sidecar: ipc step {seq} has {rows} rows");
                code = CODE_FAILED;
            } else if let Err(e) = svc.check_epoch(epoch) {
                eprintln!("moelane sidecar: ipc step {seq}: {e}");
                code = CODE_EPOCH;
            }
            st.memcpy_htod(&[seq, limit, code, 0], smeta)
                .map_err(|e| err(Fault::Internal, format!("copying to the GPU: {e:?}")))?;
            // a step of more rows than the box holds comes in rounds of at most that many
            let rows = rows.clamp(1, 1 << 24);
            let rounds = rows.div_ceil(lay.cap_rows);
            let (idx, h) = (req + lay.idx_off() as u64, req + lay.h_off() as u64);
            for ml in 0..lay.layers {
                for r in 0..rounds {
                    let part = (rows - r * lay.cap_rows).min(lay.cap_rows);
                    // SAFETY: the box and the meta have the layout's sizes; smeta 4 words.
                    unsafe { kern.wait(&st, req, ml, sm, r) }?;
                    let mut table = 0u64;
                    if code == 0 {
                        // SAFETY: idx holds the round's part*k ids (< experts, from the
                        // primary's router), h its rows of H, y room for them, all here.
                        let got = unsafe {
                            svc.serve_slots(ml, lay.experts, idx, h, part, lay.k, yp, pdl)
                        };
                        match got {
                            Some(Ok(t)) => table = t,
                            Some(Err(e)) => {
                                eprintln!("moelane sidecar: ipc step {seq} layer {ml}: {e}");
                                code = CODE_FAILED;
                            }
                            None => {
                                eprintln!("moelane sidecar: the service has no GPU path");
                                code = CODE_FAILED;
                            }
                        }
                        if code != 0 {
                            st.memcpy_htod(&[seq, limit, code, 0], smeta).map_err(|e| {
                                err(Fault::Internal, format!("copying to the GPU: {e:?}"))
                            })?;
                        }
                    }
                    // SAFETY: the reply box has the layout's sizes; y the round's slots;
                    // table null or E entries; done a counter at 0.
                    unsafe {
                        kern.reply(
                            &st,
                            &lay,
                            rep,
                            ml,
                            sm,
                            yp,
                            idx,
                            table,
                            part * lay.k,
                            dn,
                            r,
                            pdl,
                        )
                    }?;
                }
            }
        }
    }
}

/// The primary's end: a [`RemoteTier`] whose exchanges run on the device
/// ([`RemoteTier::device_mailbox`]).
pub struct IpcTier {
    gpu: Arc<Gpu>,
    /// the sidecar's request box, opened here
    req: IpcMem,
    reply: ReplyBox,
    layout: BoxLayout,
    generation: u64,
    deadline: Option<Duration>,
    peer_pid: u32,
}

/// The primary's reply box: when the link is dropped it is kept for [`GRACE`] before it is
/// freed, since a sidecar's program may still write a late reply into it.
struct ReplyBox(Option<IpcMem>);

/// How long a dropped link's reply box outlives it: past the sidecar's longest wait, so its
/// program has ended (or been cancelled) before the memory is freed.
pub const GRACE: Duration = Duration::from_secs(2 * SIDECAR_WAIT.as_secs());

static GRAVE: std::sync::Mutex<Vec<(Instant, IpcMem)>> = std::sync::Mutex::new(Vec::new());

impl ReplyBox {
    fn ptr(&self) -> u64 {
        self.0.as_ref().map_or(0, |m| m.ptr)
    }
}

impl Drop for ReplyBox {
    fn drop(&mut self) {
        let mut g = GRAVE.lock().unwrap_or_else(|p| p.into_inner());
        // freed here: those kept past their grace
        g.retain(|(t, _)| t.elapsed() < GRACE);
        if let Some(m) = self.0.take() {
            g.push((Instant::now(), m));
        }
    }
}

/// The primary's end before the sidecar's offer: its reply box.
pub struct PrimaryEnd {
    gpu: Arc<Gpu>,
    layout: BoxLayout,
    reply: ReplyBox,
}

impl PrimaryEnd {
    /// Allocates the reply box of `layout` on `gpu` (the GPU the step runs on).
    pub fn new(gpu: Arc<Gpu>, layout: BoxLayout) -> Result<Self> {
        layout.check()?;
        let reply = ReplyBox(Some(IpcMem::alloc(&gpu, layout.reply_bytes())?));
        Ok(PrimaryEnd { gpu, layout, reply })
    }

    /// The line the sidecar opens its end with.
    pub fn params(&self) -> Result<String> {
        let m = self
            .reply
            .0
            .as_ref()
            .ok_or_else(|| Error::Internal("a reply box already given away".into()))?;
        Ok(line(&self.layout, &m.handle()?))
    }

    /// Opens the sidecar's request box from its `offer`, whose shape must be this end's.
    pub fn connect(self, offer: &str) -> Result<IpcTier> {
        let (peer_pid, layout, h) = parse_line(offer, "offer")?;
        if layout != self.layout {
            return Err(Error::Invalid(format!(
                "the sidecar's mailbox is {layout:?}; this primary's model needs {:?} (do both serve the same checkpoint?)",
                self.layout
            )));
        }
        let req = IpcMem::open(&self.gpu, &h, layout.req_bytes())?;
        Ok(IpcTier {
            gpu: self.gpu,
            req,
            reply: self.reply,
            layout,
            generation: GENERATION.fetch_add(1, Ordering::Relaxed),
            deadline: None,
            peer_pid,
        })
    }
}

impl IpcTier {
    /// The sidecar's process id (from its offer).
    pub fn peer_pid(&self) -> u32 {
        self.peer_pid
    }

    /// The mailbox's shape.
    pub fn layout(&self) -> BoxLayout {
        self.layout
    }
}

impl RemoteTier for IpcTier {
    fn send(&mut self, _req: ColdRequest) -> Result<()> {
        Err(err(
            Fault::Internal,
            "the ipc link exchanges on the device: the step's backend must take its mailbox",
        ))
    }
    fn recv(&mut self) -> Result<ColdReply> {
        Err(err(
            Fault::Internal,
            "the ipc link exchanges on the device: the step's backend must take its mailbox",
        ))
    }
    fn kind(&self) -> &'static str {
        "ipc"
    }
    fn set_reply_deadline(&mut self, deadline: Duration) {
        self.deadline = Some(deadline);
    }
    fn reply_deadline(&self) -> Option<Duration> {
        self.deadline
    }
    fn device_ordinal(&self) -> Option<usize> {
        Some(self.gpu.ordinal)
    }
    fn device_mailbox(&mut self) -> Option<MailboxPtrs> {
        Some(MailboxPtrs {
            ordinal: self.gpu.ordinal,
            req_box: self.req.ptr,
            reply_box: self.reply.ptr(),
            layout: self.layout,
            generation: self.generation,
        })
    }
}
