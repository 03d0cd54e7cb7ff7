//! The `ipc` link (feature `cuda`): a device mailbox between a primary and a sidecar whose
//! GPUs can reach each other's memory (the same GPU, or two joined by NVLink or PCIe peer
//! access). Each side allocates a buffer and hands the other a CUDA IPC handle to it:
//!
//! 1. the sidecar allocates the request box for a [`BoxLayout`] and offers
//!    `ipc1:<layers>:<rows>:<k>:<hidden>:<experts>:<pid>:<handle>` ([`SidecarEnd::offer`]);
//! 2. the primary opens it, allocates the reply box, and answers
//!    `ipc1:<pid>:<handle>` ([`IpcTier::connect`]);
//! 3. the sidecar opens the reply box ([`SidecarEnd::accept`]) and serves
//!    ([`SidecarEnd::serve`]).
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

use cudarc::driver::{CudaSlice, DevicePtr};
use moelane_engine::cuda::Gpu;
use moelane_engine::cuda_link::{
    handle_from_hex, handle_hex, IpcMem, LinkKernels, CODE_EPOCH, CODE_FAILED,
};
use moelane_engine::error::Fault;
use moelane_engine::tier::{BoxLayout, ColdReply, ColdRequest, MailboxPtrs, RemoteTier};
use moelane_engine::{Error, Result};

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
    /// Allocates the request box of `layout` on `gpu` (the GPU the service computes on).
    pub fn new(gpu: Arc<Gpu>, layout: BoxLayout) -> Result<Self> {
        layout.check()?;
        let req = IpcMem::alloc(&gpu, layout.req_bytes())?;
        Ok(SidecarEnd {
            gpu,
            layout,
            req,
            reply: None,
            peer_pid: None,
        })
    }

    /// The line the primary connects with.
    pub fn offer(&self) -> Result<String> {
        let l = &self.layout;
        Ok(format!(
            "ipc1:{}:{}:{}:{}:{}:{}:{}",
            l.layers,
            l.cap_rows,
            l.k,
            l.hidden,
            l.experts,
            std::process::id(),
            handle_hex(&self.req.handle()?)
        ))
    }

    /// Opens the primary's reply box from its answer line.
    pub fn accept(&mut self, answer: &str) -> Result<()> {
        let parts: Vec<&str> = answer.trim().split(':').collect();
        let [tag, pid, handle] = parts[..] else {
            return Err(Error::Invalid(format!(
                "ipc answer {:?}: expected ipc1:<pid>:<handle>",
                short(answer)
            )));
        };
        if tag != "ipc1" {
            return Err(Error::Invalid(format!(
                "ipc answer version {tag:?}: this sidecar speaks ipc1"
            )));
        }
        let pid: u32 = pid
            .parse()
            .map_err(|_| Error::Invalid(format!("ipc answer: pid {pid:?} is not a number")))?;
        let h = handle_from_hex(handle)?;
        self.reply = Some(IpcMem::open(&self.gpu, &h, self.layout.reply_bytes())?);
        self.peer_pid = Some(pid);
        Ok(())
    }

    /// Serves `svc` until `stop` is set, the primary's process is gone, or the link fails:
    /// per step, reads the step's head, checks its map epoch, and queues every layer's
    /// wait, experts and reply.
    pub fn serve(&mut self, svc: &Arc<dyn ColdService>, stop: &AtomicBool) -> Result<()> {
        let reply = self
            .reply
            .as_ref()
            .ok_or_else(|| Error::Internal("serving before the primary's answer".into()))?;
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
        let (req, rep) = (self.req.ptr, reply.ptr);
        let mut head = [0u8; 32];
        let mut last = 0u64;
        let limit = SIDECAR_WAIT.as_nanos() as u64;
        let mut idle_since = Instant::now();
        let mut last_alive = Instant::now();
        loop {
            // the step's head: polled from the host (a small copy on its own stream)
            self.req.read(0, &mut head)?;
            let w =
                |i: usize| u64::from_le_bytes(head[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
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
            if rows == 0 || rows > lay.cap_rows {
                eprintln!(
                    "moelane sidecar: ipc step {seq} has {rows} rows (the box holds {})",
                    lay.cap_rows
                );
                code = CODE_FAILED;
            } else if let Err(e) = svc.check_epoch(epoch) {
                eprintln!("moelane sidecar: ipc step {seq}: {e}");
                code = CODE_EPOCH;
            }
            st.memcpy_htod(&[seq, limit, code, 0], &mut smeta)
                .map_err(|e| err(Fault::Internal, format!("copying to the GPU: {e:?}")))?;
            let rows = rows.clamp(1, lay.cap_rows);
            let nk = rows * lay.k;
            let (idx, h) = (req + lay.idx_off() as u64, req + lay.h_off() as u64);
            for ml in 0..lay.layers {
                // SAFETY: the box and the meta have the layout's sizes; smeta holds 4 words.
                unsafe { kern.wait(&gpu, req, ml, sm) }?;
                let mut table = 0u64;
                if code == 0 {
                    // SAFETY: idx holds rows*k ids (< experts, written by the primary's
                    // router), h rows rows of H, y nk rows of H, all on this GPU.
                    match unsafe { svc.serve_slots(ml, lay.experts, idx, h, rows, lay.k, yp) } {
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
                        st.memcpy_htod(&[seq, limit, code, 0], &mut smeta)
                            .map_err(|e| {
                                err(Fault::Internal, format!("copying to the GPU: {e:?}"))
                            })?;
                    }
                }
                // SAFETY: the reply box has the layout's sizes; y nk rows; table null or E
                // entries; done a counter at 0.
                unsafe { kern.reply(&gpu, &lay, rep, ml, sm, yp, idx, table, nk, dn) }?;
            }
        }
    }
}

fn short(s: &str) -> String {
    s.chars().take(48).collect()
}

/// The primary's end: a [`RemoteTier`] whose exchanges run on the device
/// ([`RemoteTier::device_mailbox`]).
pub struct IpcTier {
    gpu: Arc<Gpu>,
    _req: IpcMem,
    reply: IpcMem,
    layout: BoxLayout,
    generation: u64,
    deadline: Option<Duration>,
    peer_pid: u32,
}

impl IpcTier {
    /// Opens the sidecar's request box from its `offer` on `gpu` and allocates the reply
    /// box; returns the tier and the answer line for the sidecar. The offer's shape must
    /// be `expect`'s except for its rows (the sidecar's box may hold more).
    pub fn connect(gpu: Arc<Gpu>, offer: &str, expect: BoxLayout) -> Result<(Self, String)> {
        let parts: Vec<&str> = offer.trim().split(':').collect();
        let [tag, layers, rows, k, hidden, experts, pid, handle] = parts[..] else {
            return Err(Error::Invalid(format!(
                "ipc offer {:?}: expected ipc1:<layers>:<rows>:<k>:<hidden>:<experts>:<pid>:<handle>",
                short(offer)
            )));
        };
        if tag != "ipc1" {
            return Err(Error::Invalid(format!(
                "ipc offer version {tag:?}: this primary speaks ipc1"
            )));
        }
        let num = |what: &str, v: &str| -> Result<usize> {
            v.parse()
                .map_err(|_| Error::Invalid(format!("ipc offer: {what} {v:?} is not a number")))
        };
        let layout = BoxLayout {
            layers: num("layers", layers)?,
            cap_rows: num("rows", rows)?,
            k: num("k", k)?,
            hidden: num("hidden", hidden)?,
            experts: num("experts", experts)?,
        };
        layout.check()?;
        let same_shape = BoxLayout {
            cap_rows: expect.cap_rows,
            ..layout
        } == expect;
        if !same_shape {
            return Err(Error::Invalid(format!(
                "the sidecar's mailbox is {layout:?}; this model needs {expect:?}"
            )));
        }
        let peer_pid = num("pid", pid)? as u32;
        let h = handle_from_hex(handle)?;
        let req = IpcMem::open(&gpu, &h, layout.req_bytes())?;
        let reply = IpcMem::alloc(&gpu, layout.reply_bytes())?;
        let answer = format!(
            "ipc1:{}:{}",
            std::process::id(),
            handle_hex(&reply.handle()?)
        );
        Ok((
            IpcTier {
                gpu,
                _req: req,
                reply,
                layout,
                generation: GENERATION.fetch_add(1, Ordering::Relaxed),
                deadline: None,
                peer_pid,
            },
            answer,
        ))
    }

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
    fn device_mailbox(&self) -> Option<MailboxPtrs> {
        Some(MailboxPtrs {
            ordinal: self.gpu.ordinal,
            req_box: self._req.ptr,
            reply_box: self.reply.ptr,
            layout: self.layout,
            generation: self.generation,
        })
    }
}
