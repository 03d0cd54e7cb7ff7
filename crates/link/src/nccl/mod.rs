//! NCCL link between a primary and a sidecar on two GPUs (feature `cuda`): a communicator of
//! two ranks (primary 0, sidecar 1) whose unique id travels over the gRPC control channel
//! (REGISTER's endpoint, hex), and the activations and outputs as NCCL point-to-point
//! messages between the two devices (NVLink or PCIe peer-to-peer, no host socket in the data
//! path). The request's picks travel in the byte links' request frame ([`crate::frame`]), so
//! the epoch, step and layer checks are the same.
//!
//! On the wire, per exchange (each message its own NCCL call: see [`End::send`]):
//! - primary -> sidecar: a first message of [`SLOT`] bytes: a 32-byte preamble `MLNC
//!   version:u32 frame_len:u32 reply_len:u32 acts:u32`, the request frame without its
//!   activations (`frame_len` bytes: tags and picks), then the activations (`acts` floats)
//!   16-byte aligned, when all of it fits (a decode step's request does); otherwise the
//!   frame and the activations follow as two more messages (the sidecar posts their
//!   receives once it has read the preamble). The primary posts the reply's receive right
//!   after (stream-ordered, no host round trip).
//! - sidecar -> primary: exactly `reply_len` bytes: a 64-byte head `MLNR status:u32 step:u64
//!   layer:u32 epoch:u64 len:u64`, then `len` bytes: one output row per pick (f32) or the
//!   error's text. The primary sizes `reply_len` for one row per pick (and room for an
//!   error), so a receive is always posted with the length the send will have.
//!
//! A sidecar computing on the link's GPU (`ColdService::serve_device`) reads the activations
//! where NCCL put them and writes its outputs straight into the reply buffer: only the picks
//! and the two heads cross its host. Otherwise it stages through host memory.
//!
//! When the link opens, both ends exchange a 4 MiB handshake in one symmetric group (NCCL
//! connects channels on first use; see [`End::handshake`]) carrying the protocol version.
//!
//! Joining the communicator is bounded by a deadline, every wait for the GPU is polled
//! against a deadline (the link timeout) and a stop flag, so a dead peer is an error and
//! never a hang; NCCL calls block only to enqueue (`MOELANE_NCCL_BLOCKING=0` makes the
//! communicator non-blocking, every call polled);
//! dropping a link aborts its communicator. A primary stepping on the link's GPU sends the
//! activations from its device buffer and takes the outputs from the receive buffer
//! ([`RemoteTier::send_device`], [`RemoteTier::recv_device`]); otherwise it stages them through
//! host memory.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::sys;
use moelane_engine::error::Fault;
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};
use moelane_engine::{Error, Result};

use crate::frame::{self, MAX_FRAME};
use crate::ColdService;

mod wire;
pub use wire::*;

const MAGIC: u32 = u32::from_le_bytes(*b"MLNC");
const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"MLNR");
const VERSION: u32 = 2;
/// Bytes of the preamble before each request frame.
pub const PREAMBLE: usize = 32;
/// Bytes of a reply's head (the outputs after it stay 16-byte aligned).
pub const REPLY_HEAD: usize = 64;
/// Room the primary leaves for an error text in every reply.
const ERR_ROOM: usize = 512;
/// Bytes each end sends the other when the link opens (large enough to use every channel a
/// step's message will use, so all are connected before the first request).
const HANDSHAKE: usize = 4 << 20;

fn err(what: impl std::fmt::Display) -> Error {
    Error::link("nccl", Fault::Unavailable, what.to_string())
}

/// Whether libnccl can be loaded (cudarc would panic on first use where it cannot).
pub fn available() -> Result<()> {
    // SAFETY: only tries to open the library by its candidate names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(err(
            "the NCCL library (libnccl.so) was not found; install NCCL 2.28 or newer",
        ))
    }
}

fn check(what: &str, r: sys::ncclResult_t) -> Result<bool> {
    match r {
        sys::ncclResult_t::ncclSuccess => Ok(true),
        sys::ncclResult_t::ncclInProgress => Ok(false),
        e => {
            // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
            let text = unsafe {
                let p = sys::ncclGetErrorString(e);
                if p.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            Err(err(format!("{what}: {e:?} ({text})")))
        }
    }
}

/// A communicator's unique id (NCCL's 128 bytes), written as 256 hex digits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}..)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id: this process becomes the communicator's bootstrap root.
    pub fn new() -> Result<Self> {
        available()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid ncclUniqueId to write into.
        check("creating a unique id", unsafe {
            sys::ncclGetUniqueId(&mut id)
        })?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.len() != 256 {
            return Err(err(format!(
                "a communicator id is 256 hex digits, got {} characters",
                s.len()
            )));
        }
        let mut out = [0u8; 128];
        for (i, o) in out.iter_mut().enumerate() {
            let pair = s.get(2 * i..2 * i + 2).ok_or_else(|| {
                err(format!(
                    "communicator id: non-ASCII text near digit {}",
                    2 * i
                ))
            })?;
            *o = u8::from_str_radix(pair, 16).map_err(|_| {
                err(format!(
                    "communicator id: {pair:?} at digit {} is not hex",
                    2 * i
                ))
            })?;
        }
        Ok(NcclId(out))
    }
}

/// A non-blocking communicator; dropping it aborts it (in-flight operations end).
struct Comm {
    raw: sys::ncclComm_t,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time; `Comm` is owned by
// one link (behind `&mut self`), and moved between threads only as a whole.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: `raw` came from ncclCommInitRankConfig and is aborted exactly once.
            unsafe {
                let _ = sys::ncclCommAbort(self.raw);
            }
        }
    }
}

/// Waits, polling, until `done()` says yes; errors at `deadline` or when `stop` is set.
fn poll(
    what: &str,
    deadline: Option<Instant>,
    stop: Option<&AtomicBool>,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if done()? {
            return Ok(());
        }
        if stop.is_some_and(|s| s.load(Ordering::Acquire)) {
            return Err(err(format!("{what}: link closed")));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(err(format!(
                "{what}: no answer from the peer within {:.1} s",
                t0.elapsed().as_secs_f64()
            )));
        }
        // spin for the first 2 ms (a step's exchange), then sleep briefly (an idle link)
        if t0.elapsed() < Duration::from_millis(2) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// NCCL's configuration initialiser (NCCL_CONFIG_INITIALIZER of 2.28) with `blocking` set.
fn config(blocking: bool) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafebeef,
        version: 22800,
        blocking: blocking as i32,
        cgaClusterSize: i32::MIN,
        minCTAs: i32::MIN,
        maxCTAs: i32::MIN,
        netName: std::ptr::null(),
        splitShare: i32::MIN,
        trafficClass: i32::MIN,
        commName: std::ptr::null(),
        collnetEnable: i32::MIN,
        CTAPolicy: i32::MIN,
        shrinkShare: i32::MIN,
        nvlsCTAs: i32::MIN,
        nChannelsPerNetPeer: i32::MIN,
        nvlinkCentricSched: i32::MIN,
    }
}

/// Whether communicators block in NCCL calls (`MOELANE_NCCL_BLOCKING=0`: non-blocking, every
/// call polled). Either way joining is bounded by the deadline and waits for the GPU are
/// polled; blocking calls only enqueue, without the non-blocking mode's background thread.
fn blocking() -> bool {
    std::env::var("MOELANE_NCCL_BLOCKING").map_or(true, |v| v != "0")
}

impl Comm {
    fn init(id: &NcclId, rank: usize, deadline: Instant, ctx: &Arc<CudaContext>) -> Result<Comm> {
        let uid = sys::ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        if blocking() {
            // a blocking join has no deadline of its own: it runs on a thread, and one that
            // finishes after the deadline drops (aborts) the communicator it made
            let (tx, rx) = std::sync::mpsc::channel();
            let ctx = ctx.clone();
            std::thread::Builder::new()
                .name("moelane-nccl-join".into())
                .spawn(move || {
                    let _ = ctx.bind_to_thread();
                    let mut cfg = config(true);
                    let mut raw: sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: valid out-pointer, id and config; 2 ranks, `rank` < 2.
                    let r = unsafe {
                        sys::ncclCommInitRankConfig(&mut raw, 2, uid, rank as i32, &mut cfg)
                    };
                    let _ = tx.send((r, Comm { raw }));
                })
                .map_err(|e| err(format!("starting the join thread: {e}")))?;
            let left = deadline.saturating_duration_since(Instant::now());
            let (r, comm) = rx.recv_timeout(left).map_err(|_| {
                err(format!(
                    "joining the communicator: the peer did not join within {:.1} s",
                    left.as_secs_f64()
                ))
            })?;
            check("joining the communicator", r)?;
            return Ok(comm);
        }
        let mut cfg = config(false);
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer, id and config; 2 ranks, `rank` < 2.
        let r = unsafe { sys::ncclCommInitRankConfig(&mut raw, 2, uid, rank as i32, &mut cfg) };
        let comm = Comm { raw };
        check("joining the communicator", r)?;
        poll("joining the communicator", Some(deadline), None, || {
            comm.ready("joining the communicator")
        })?;
        Ok(comm)
    }

    /// Whether the last call has finished (non-blocking mode), or its error.
    fn ready(&self, what: &str) -> Result<bool> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator; `state` a valid out-pointer.
        check(what, unsafe {
            sys::ncclCommGetAsyncError(self.raw, &mut state)
        })?;
        check(what, state)
    }
}

/// One end of the link: the communicator, a stream on this end's GPU, device buffers that
/// only grow (what this end sends, what it receives, received activations), and an event
/// marking the last posted operation.
struct End {
    comm: Comm,
    stream: Arc<CudaStream>,
    event: CudaEvent,
    send: CudaSlice<u8>,
    recv: CudaSlice<u8>,
    acts: CudaSlice<u8>,
    host: Vec<u8>,
    peer: i32,
    ordinal: usize,
    ctx: Arc<CudaContext>,
}

/// Which of an end's receive buffers: frames and replies, or a request's activations.
#[derive(Clone, Copy)]
enum Inbox {
    Recv,
    Acts,
}

impl End {
    fn open(ordinal: usize, id: &NcclId, rank: usize, deadline: Instant) -> Result<End> {
        available()?;
        let gpu = moelane_engine::cuda::Gpu::open(ordinal)?;
        let ctx = gpu.ctx.clone();
        // buffers are used on this link's stream only: no cross-stream event bookkeeping
        // SAFETY: every buffer of this context here is used on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| err(format!("creating a stream on cuda:{ordinal}: {e:?}")))?;
        let event = ctx
            .new_event(None)
            .map_err(|e| err(format!("creating an event: {e:?}")))?;
        ctx.bind_to_thread()
            .map_err(|e| err(format!("binding cuda:{ordinal}: {e:?}")))?;
        let comm = Comm::init(id, rank, deadline, &ctx)?;
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<u8>(n)
                .map_err(|e| err(format!("allocating {n} bytes on cuda:{ordinal}: {e:?}")))
        };
        let mut end = End {
            comm,
            send: alloc(HANDSHAKE)?,
            recv: alloc(HANDSHAKE)?,
            acts: alloc(1 << 16)?,
            stream: stream.clone(),
            event,
            host: Vec::new(),
            peer: 1 - rank as i32,
            ordinal,
            ctx,
        };
        end.handshake(deadline)?;
        Ok(end)
    }

    /// Both ends send each other [`HANDSHAKE`] bytes in one group, at once: NCCL connects
    /// its point-to-point channels on first use, and only a symmetric first exchange connects
    /// both directions the same way on both ends (an asymmetric one, a receive here against
    /// a send and a receive there, fails in NCCL's bootstrap with "message truncated"). The
    /// first bytes carry the protocol version, checked on both ends.
    fn handshake(&mut self, deadline: Instant) -> Result<()> {
        let mut hello = vec![0u8; HANDSHAKE];
        hello[..8].copy_from_slice(&preamble(0, 0, 0)[..8]);
        self.upload(&hello)?;
        self.bind()?;
        let cs = self.stream.cu_stream() as sys::cudaStream_t;
        // event tracking is off: the guards record nothing
        let sp = self.send.device_ptr(&self.stream).0;
        let rp = self.recv.device_ptr(&self.stream).0;
        let u8t = sys::ncclDataType_t::ncclUint8;
        // SAFETY: both buffers hold HANDSHAKE bytes; the group is closed on every path.
        unsafe {
            check("opening a group", sys::ncclGroupStart())?;
            let a = check(
                "handshake send",
                sys::ncclSend(
                    sp as *const c_void,
                    HANDSHAKE,
                    u8t,
                    self.peer,
                    self.comm.raw,
                    cs,
                ),
            );
            let b = check(
                "handshake receive",
                sys::ncclRecv(
                    rp as *mut c_void,
                    HANDSHAKE,
                    u8t,
                    self.peer,
                    self.comm.raw,
                    cs,
                ),
            );
            let end = sys::ncclGroupEnd();
            a?;
            b?;
            self.settle("handshake", end)?;
        }
        self.mark()?;
        self.wait("handshake", Some(deadline), None)?;
        check_hello("handshake", self.download(Inbox::Recv, 8)?)
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| err(format!("binding cuda:{}: {e:?}", self.ordinal)))
    }

    /// Waits out a non-blocking call that returned "in progress".
    fn settle(&self, what: &str, r: sys::ncclResult_t) -> Result<()> {
        if !check(what, r)? {
            poll(
                what,
                Some(Instant::now() + Duration::from_secs(30)),
                None,
                || self.comm.ready(what),
            )?;
        }
        Ok(())
    }

    fn grow(buf: &mut CudaSlice<u8>, stream: &Arc<CudaStream>, n: usize) -> Result<()> {
        if buf.len() < n {
            *buf = stream
                .alloc_zeros::<u8>(n.next_power_of_two())
                .map_err(|e| err(format!("allocating {n} bytes: {e:?}")))?;
        }
        Ok(())
    }

    /// Copies `bytes` to the start of the send buffer (stream-ordered).
    fn upload(&mut self, bytes: &[u8]) -> Result<()> {
        Self::grow(&mut self.send, &self.stream, bytes.len())?;
        let mut dst = self.send.slice_mut(..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut dst)
            .map_err(|e| err(format!("copying {} bytes to the GPU: {e:?}", bytes.len())))
    }

    /// Sends `len` bytes of the send buffer from `off`: one NCCL call. NCCL may spread the
    /// operations of one group to a peer over its channels, so a group of two sends does not
    /// match two receives posted one by one (it hangs); single operations match in order.
    fn send(&mut self, off: usize, len: usize) -> Result<()> {
        if off + len > self.send.len() {
            return Err(err(format!(
                "send of bytes {off}..{} from a {}-byte buffer",
                off + len,
                self.send.len()
            )));
        }
        let sp = self.send.device_ptr(&self.stream).0;
        // SAFETY: [off, off + len) lies in the send buffer (checked), which lives as long as
        // this link and is only written on this stream.
        unsafe { self.send_from(sp + off as u64, len) }
    }

    /// Sends `len` bytes at device address `ptr` of this link's GPU: one NCCL call.
    ///
    /// # Safety
    /// `ptr` addresses `len` bytes on this GPU, complete, unchanged until the send is done.
    unsafe fn send_from(&mut self, ptr: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        let cs = self.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: the caller's guarantee
        let r = unsafe {
            sys::ncclSend(
                ptr as *const c_void,
                len,
                sys::ncclDataType_t::ncclUint8,
                self.peer,
                self.comm.raw,
                cs,
            )
        };
        self.settle("send", r)
    }

    /// Receives `len` bytes into the start of buffer `into` (grown first): one NCCL call.
    fn recv(&mut self, into: Inbox, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let buf = match into {
            Inbox::Recv => &mut self.recv,
            Inbox::Acts => &mut self.acts,
        };
        Self::grow(buf, &self.stream, len)?;
        let rp = buf.device_ptr(&self.stream).0;
        self.bind()?;
        let cs = self.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: the buffer holds at least `len` bytes (grown above) and lives as long as
        // this link.
        let r = unsafe {
            sys::ncclRecv(
                rp as *mut c_void,
                len,
                sys::ncclDataType_t::ncclUint8,
                self.peer,
                self.comm.raw,
                cs,
            )
        };
        self.settle("receive", r)
    }

    /// Marks what was posted so far with the event.
    fn mark(&self) -> Result<()> {
        self.event
            .record(&self.stream)
            .map_err(|e| err(format!("recording an event: {e:?}")))
    }

    /// Waits for what was posted before the last `mark`.
    fn wait(&self, what: &str, deadline: Option<Instant>, stop: Option<&AtomicBool>) -> Result<()> {
        poll(what, deadline, stop, || {
            let done = self
                .event
                .try_is_complete()
                .map_err(|e| err(format!("{what}: {e:?}")))?;
            if !done {
                // a failed peer shows as an asynchronous error of the communicator
                self.comm.ready(what)?;
            }
            Ok(done)
        })
    }

    fn inbox(&self, which: Inbox) -> &CudaSlice<u8> {
        match which {
            Inbox::Recv => &self.recv,
            Inbox::Acts => &self.acts,
        }
    }

    /// The first `n` bytes of buffer `from`, copied to the host.
    fn download(&mut self, from: Inbox, n: usize) -> Result<&[u8]> {
        self.download_at(from, 0, n)
    }

    /// Bytes `[off, off + n)` of buffer `from`, copied to the host.
    fn download_at(&mut self, from: Inbox, off: usize, n: usize) -> Result<&[u8]> {
        self.host.resize(n, 0);
        // disjoint fields: `host` is written while the buffer is read
        let buf = match from {
            Inbox::Recv => &self.recv,
            Inbox::Acts => &self.acts,
        };
        if off + n > buf.len() {
            return Err(err(format!(
                "bytes {off}..{} of a {}-byte buffer",
                off + n,
                buf.len()
            )));
        }
        let src = buf.slice(off..off + n);
        self.stream
            .memcpy_dtoh(&src, &mut self.host[..])
            .map_err(|e| err(format!("copying {n} bytes from the GPU: {e:?}")))?;
        self.stream
            .synchronize()
            .map_err(|e| err(format!("copying {n} bytes from the GPU: {e:?}")))?;
        Ok(&self.host[..n])
    }
}

/// The primary's end: a [`RemoteTier`] over NCCL.
pub struct NcclTier {
    end: End,
    hidden: usize,
    timeout: Duration,
    frame: Vec<u8>,
    msg: Vec<u8>,
    /// the reply length of the request in flight
    pending: Option<usize>,
}

impl NcclTier {
    /// Joins communicator `id` as rank 0 on GPU `ordinal` (the sidecar joins as rank 1);
    /// `hidden` is the model's hidden size (a reply has one such row per pick).
    pub fn connect(ordinal: usize, id: &NcclId, hidden: usize, timeout: Duration) -> Result<Self> {
        let end = End::open(
            ordinal,
            id,
            0,
            Instant::now() + timeout.max(Duration::from_secs(60)),
        )?;
        Ok(NcclTier {
            end,
            hidden,
            timeout,
            frame: Vec::new(),
            msg: Vec::new(),
            pending: None,
        })
    }
}

impl NcclTier {
    /// Stages the preamble and the frame of `req` (its activations taken out) in `msg`:
    /// returns (frame bytes, reply length, where inline activations start).
    fn stage(&mut self, req: &ColdRequest, acts: usize) -> Result<(usize, usize, Option<usize>)> {
        if self.pending.is_some() {
            return Err(err("a request is already in flight"));
        }
        frame::encode_request(req, &mut self.frame);
        let flen = self.frame.len();
        if flen > MAX_FRAME || acts > MAX_FRAME / 4 {
            return Err(err(format!(
                "request of {flen} bytes and {acts} activations is too large"
            )));
        }
        let rl = reply_len(req.picks.len(), self.hidden);
        let inline = inline_offset(flen, acts);
        self.msg.clear();
        self.msg.extend_from_slice(&preamble(flen, rl, acts));
        self.msg.extend_from_slice(&self.frame);
        if let Some(off) = inline {
            self.msg.resize(off, 0);
        }
        // the first message is always SLOT bytes (past what was written: whatever the buffer
        // held, ignored by the sidecar)
        let need = SLOT.max(self.msg.len() + 4 * acts);
        End::grow(&mut self.end.send, &self.end.stream, need)?;
        Ok((flen, rl, inline))
    }

    /// Waits for the reply to the request in flight; its length.
    fn reply_in(&mut self) -> Result<usize> {
        let rl = self
            .pending
            .take()
            .ok_or_else(|| err("no request in flight"))?;
        self.end.wait(
            "waiting for the reply",
            Some(Instant::now() + self.timeout),
            None,
        )?;
        Ok(rl)
    }

    /// Posts the reply's receive and marks the request sent.
    fn posted(&mut self, rl: usize) -> Result<()> {
        self.end.recv(Inbox::Recv, rl)?;
        self.end.mark()?;
        self.pending = Some(rl);
        Ok(())
    }
}

impl RemoteTier for NcclTier {
    fn send(&mut self, mut req: ColdRequest) -> Result<()> {
        // the frame carries tags and picks; the activations follow it
        let acts = std::mem::take(&mut req.activations);
        let (flen, rl, inline) = self.stage(&req, acts.len())?;
        for x in &acts {
            self.msg.extend_from_slice(&x.to_le_bytes());
        }
        self.end.upload(&self.msg)?;
        self.end.send(0, SLOT)?;
        if inline.is_none() {
            self.end.send(PREAMBLE, flen)?;
            self.end.send(PREAMBLE + flen, 4 * acts.len())?;
        }
        self.posted(rl)
    }

    fn device_ordinal(&self) -> Option<usize> {
        Some(self.end.ordinal)
    }

    unsafe fn send_device(&mut self, req: ColdRequest, acts: u64, acts_len: usize) -> Result<()> {
        let (flen, rl, inline) = self.stage(&req, acts_len)?;
        self.end.upload(&self.msg)?;
        match inline {
            Some(off) => {
                // the activations join the first message on the device
                let dst = self.end.send.device_ptr(&self.end.stream).0 + off as u64;
                // SAFETY: the send buffer holds off + 4 acts_len bytes (grown by `stage`);
                // `acts` is the caller's; the copy is ordered before the send on this stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        dst,
                        acts,
                        4 * acts_len,
                        self.end.stream.cu_stream(),
                    )
                }
                .map_err(|e| err(format!("copying the activations on the GPU: {e:?}")))?;
                self.end.send(0, SLOT)?;
            }
            None => {
                self.end.send(0, SLOT)?;
                self.end.send(PREAMBLE, flen)?;
                // SAFETY: the caller's guarantee
                unsafe { self.end.send_from(acts, 4 * acts_len) }?;
            }
        }
        self.posted(rl)
    }

    fn recv_device(&mut self) -> Result<(ColdReply, u64, usize)> {
        let rl = self.reply_in()?;
        let (failed, tags, len) = parse_head(self.end.download(Inbox::Recv, REPLY_HEAD)?, rl)?;
        if let Some(fault) = failed {
            let text = self.end.download_at(Inbox::Recv, REPLY_HEAD, len)?;
            return Err(sidecar_error(fault, text));
        }
        let out = self.end.recv.device_ptr(&self.end.stream).0 + REPLY_HEAD as u64;
        Ok((tags, out, len / 4))
    }

    fn recv(&mut self) -> Result<ColdReply> {
        let rl = self.reply_in()?;
        unpack_reply(self.end.download(Inbox::Recv, rl)?)
    }

    fn kind(&self) -> &'static str {
        "nccl"
    }
}

/// The sidecar's end: joins communicator `id` as rank 1 on GPU `ordinal` and serves `svc` on
/// a thread until `stop` is set or the link fails. `join_timeout` bounds the wait for the
/// primary to join.
pub fn serve(
    ordinal: usize,
    id: NcclId,
    svc: Arc<dyn ColdService>,
    stop: Arc<AtomicBool>,
    join_timeout: Duration,
) -> Result<std::thread::JoinHandle<Result<()>>> {
    available()?;
    std::thread::Builder::new()
        .name("moelane-nccl-link".into())
        .spawn(move || {
            let r = serve_blocking(ordinal, &id, &svc, &stop, join_timeout);
            if let Err(e) = &r {
                if !stop.load(Ordering::Acquire) {
                    eprintln!("moelane sidecar: {e}");
                }
            }
            r
        })
        .map_err(|e| err(format!("starting the link thread: {e}")))
}

/// As [`serve`], on the calling thread.
pub fn serve_blocking(
    ordinal: usize,
    id: &NcclId,
    svc: &Arc<dyn ColdService>,
    stop: &AtomicBool,
    join_timeout: Duration,
) -> Result<()> {
    let mut end = End::open(ordinal, id, 1, Instant::now() + join_timeout)?;
    let mut req = ColdRequest::default();
    let (mut out, mut msg) = (Vec::new(), Vec::new());
    let mut first = Vec::new();
    loop {
        end.recv(Inbox::Recv, SLOT)?;
        end.mark()?;
        end.wait("waiting for a request", None, Some(stop))?;
        // the preamble and, for a small request, its frame, in one copy
        first.clear();
        first.extend_from_slice(end.download(Inbox::Recv, SLOT.min(PREAMBLE + 4096))?);
        let (flen, rl, na) = parse_preamble(&first[..PREAMBLE])?;
        let (acts_in, acts_off) = match inline_offset(flen, na) {
            Some(off) => {
                if PREAMBLE + flen > first.len() {
                    first.clear();
                    first.extend_from_slice(end.download(Inbox::Recv, PREAMBLE + flen)?);
                }
                first.drain(..PREAMBLE);
                first.truncate(flen);
                (Inbox::Recv, off)
            }
            None => {
                end.recv(Inbox::Recv, flen)?;
                end.recv(Inbox::Acts, 4 * na)?;
                end.mark()?;
                end.wait(
                    "receiving a request",
                    Some(Instant::now() + Duration::from_secs(30)),
                    Some(stop),
                )?;
                first.clear();
                first.extend_from_slice(end.download(Inbox::Recv, flen)?);
                (Inbox::Acts, 0)
            }
        };
        let decoded = frame::decode_request(&first, &mut req)
            .map_err(|e| Error::Invalid(format!("request frame: {e}")));
        // the reply buffer holds the head and the outputs (written on the GPU or uploaded)
        End::grow(&mut end.send, &end.stream, rl)?;
        let room = (rl - REPLY_HEAD) / 4;
        let acts_buf = end.inbox(acts_in);
        let (acts, outs) = (
            acts_buf.device_ptr(&end.stream).0 + acts_off as u64,
            end.send.device_ptr(&end.stream).0 + REPLY_HEAD as u64,
        );
        let on_device = match &decoded {
            // SAFETY: `acts` holds the na floats just received and `outs` room floats of the
            // reply buffer (grown above; 16-byte aligned: allocations are 256-byte aligned,
            // the head 64 bytes), both on this link's GPU and idle until the reply is sent.
            Ok(()) => unsafe { svc.serve_device(&req, ordinal, acts, na, outs, room) },
            Err(_) => None,
        };
        match on_device {
            Some(Ok(floats)) => {
                end.upload(&reply_head(
                    true,
                    req.step,
                    req.layer,
                    req.epoch,
                    4 * floats,
                ))?;
            }
            Some(Err(e)) => {
                pack_reply(&Err(e), rl, req.step, req.layer, req.epoch, &mut msg);
                end.upload(&msg)?;
            }
            None => {
                let rep: Result<&[f32]> = match decoded {
                    Err(e) => Err(e),
                    Ok(()) => match end.download_at(acts_in, acts_off, 4 * na) {
                        Err(e) => Err(e),
                        Ok(a) => {
                            req.activations.clear();
                            req.activations.extend(
                                a.chunks_exact(4)
                                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                            );
                            svc.serve(&req, &mut out).map(|()| &out[..])
                        }
                    },
                };
                pack_reply(&rep, rl, req.step, req.layer, req.epoch, &mut msg);
                end.upload(&msg)?;
            }
        }
        end.send(0, rl)?;
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_hex_round_trip_and_errors_name_the_fault() {
        let mut a = [0u8; 128];
        for (i, b) in a.iter_mut().enumerate() {
            *b = (i * 37 + 5) as u8;
        }
        let id = NcclId(a);
        assert_eq!(NcclId::from_hex(&id.to_hex()).unwrap(), id);
        let e = NcclId::from_hex("abc").unwrap_err().to_string();
        assert!(e.contains("256 hex digits"), "{e}");
        let mut bad = id.to_hex();
        bad.replace_range(10..12, "zz");
        let e = NcclId::from_hex(&bad).unwrap_err().to_string();
        assert!(e.contains("\"zz\" at digit 10"), "{e}");
        let multibyte = "é".repeat(128);
        assert!(NcclId::from_hex(&multibyte).is_err());
    }

    #[test]
    fn preamble_and_reply_framing() {
        let p = preamble(100, reply_len(3, 64), 128);
        assert_eq!(parse_preamble(&p).unwrap(), (100, reply_len(3, 64), 128));
        let mut bad = p;
        bad[0] ^= 1;
        assert!(parse_preamble(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut v9 = p;
        v9[4] = 9;
        assert!(parse_preamble(&v9)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
        assert!(parse_preamble(&preamble(0, 4096, 0)).is_err());
        assert!(parse_preamble(&preamble(10, 20, 0)).is_err());
        assert!(parse_preamble(&preamble(10, 4096, usize::MAX >> 1)).is_err());
        assert!(parse_preamble(&p[..8]).is_err());
        // small requests travel whole in the first message, activations 16-byte aligned
        assert_eq!(inline_offset(100, 10), Some(144));
        assert_eq!(inline_offset(0, 0), Some(32));
        assert_eq!(inline_offset(100, 16 * 1024), None);
        let big = SLOT / 4 - 40;
        assert_eq!(
            inline_offset(8, big).map(|o| o + 4 * big <= SLOT),
            Some(true)
        );

        // an ok reply fits exactly the length the primary expects, outputs 16-byte aligned
        let outs = vec![0.25f32; 3 * 64];
        let rl = reply_len(3, 64);
        let mut m = Vec::new();
        pack_reply(&Ok(&outs[..]), rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        assert_eq!(REPLY_HEAD % 16, 0);
        let r = unpack_reply(&m).unwrap();
        assert_eq!((r.step, r.layer, r.epoch), (4, 1, 2));
        assert_eq!(r.outputs, outs);
        // an error reply is padded to the same length and comes back as the error
        let mismatch = Error::EpochMismatch {
            got: 2,
            serves: "1".into(),
        };
        pack_reply(&Err(mismatch), rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        let e = unpack_reply(&m).unwrap_err();
        // the sidecar's fault comes back with its text
        assert_eq!(e.fault(), Fault::EpochMismatch, "{e}");
        assert!(e.to_string().contains("epoch 2"), "{e}");
        // outputs larger than expected become an error that fits
        let big = vec![1.0f32; 10 * 64];
        pack_reply(&Ok(&big[..]), rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        let e = unpack_reply(&m).unwrap_err().to_string();
        assert!(e.contains("exceeds"), "{e}");
        // a long error is cut to fit, never past the message
        let long = "x".repeat(10 * rl);
        pack_reply(&Err(Error::Internal(long)), rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        assert!(unpack_reply(&m).is_err());
        // a length past the message, a bad magic or status, a short message: errors
        let mut lie = m.clone();
        lie[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(unpack_reply(&lie).is_err());
        let mut st = m.clone();
        st[4] = 7;
        assert!(unpack_reply(&st)
            .unwrap_err()
            .to_string()
            .contains("status 7"));
        let mut mg = m.clone();
        mg[0] ^= 1;
        assert!(unpack_reply(&mg).is_err());
        assert!(unpack_reply(&m[..40]).is_err());
    }
}
