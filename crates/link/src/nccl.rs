//! NCCL link between a primary and a sidecar on two GPUs (feature `cuda`): a communicator of
//! two ranks (primary 0, sidecar 1) whose unique id travels over the gRPC control channel
//! (REGISTER's endpoint, hex), and the activations and outputs as NCCL point-to-point
//! messages between the two devices (NVLink or PCIe peer-to-peer, no host socket in the data
//! path). The frames are the byte links' frames ([`crate::frame`]), so the epoch, step and
//! layer checks are the same.
//!
//! On the wire, per exchange:
//! - primary -> sidecar: a 16-byte preamble `MLNC version:u32 frame_len:u32 reply_len:u32`,
//!   then the request frame (`frame_len` bytes); the primary posts the reply's receive right
//!   after (stream-ordered, no host round trip), so the answer lands as soon as it is sent.
//!   Each is its own NCCL call: see [`End::post`] for why they are not grouped.
//! - sidecar -> primary: exactly `reply_len` bytes: `len:u64`, the reply frame, zero padding.
//!   The primary sizes `reply_len` for one output row per pick (or room for an error), so a
//!   receive is always posted with the length the send will have.
//!
//! When the link opens, both ends exchange a 4 MiB handshake in one symmetric group (NCCL
//! connects channels on first use; see [`End::handshake`]) carrying the protocol version.
//!
//! The communicator is non-blocking: every NCCL call and every wait is polled against a
//! deadline (the link timeout) and a stop flag, so a dead peer is an error and never a hang;
//! dropping a link aborts its communicator. Here the frames are staged through host memory
//! on both ends (the engine's tiers exchange host slices); the device-to-device hop is NCCL.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::sys;
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};
use moelane_engine::{Error, Result};

use crate::frame::{self, MAX_FRAME};
use crate::ColdService;

const MAGIC: u32 = u32::from_le_bytes(*b"MLNC");
const VERSION: u32 = 1;
/// Bytes of the preamble before each request frame.
pub const PREAMBLE: usize = 16;
/// Bytes of a reply frame's fixed part (tag, step, layer, epoch, status, length).
const REPLY_HEAD: usize = 29;
/// Room the primary leaves for an error text in every reply.
const ERR_ROOM: usize = 512;
/// Bytes each end sends the other when the link opens (large enough to use every channel a
/// step's message will use, so all are connected before the first request).
const HANDSHAKE: usize = 4 << 20;

fn err(what: impl std::fmt::Display) -> Error {
    Error::Tier(format!("NCCL link: {what}"))
}

/// Whether libnccl can be loaded (cudarc would panic on first use where it cannot).
pub fn available() -> Result<()> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    // SAFETY: only tries to open the library by its candidate names.
    let found = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() });
    std::panic::set_hook(hook);
    match found {
        Ok(true) => Ok(()),
        _ => Err(err(
            "the NCCL library (libnccl.so) was not found; install NCCL 2.28 or newer",
        )),
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

impl Comm {
    fn init(id: &NcclId, rank: usize, deadline: Instant) -> Result<Comm> {
        let mut cfg = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafebeef,
            version: 22800,
            blocking: 0,
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
        };
        let uid = sys::ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
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
/// only grow, and an event marking the last posted operations.
struct End {
    comm: Comm,
    stream: Arc<CudaStream>,
    event: CudaEvent,
    send: CudaSlice<u8>,
    recv: CudaSlice<u8>,
    host: Vec<u8>,
    peer: i32,
    ctx: Arc<CudaContext>,
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
        let comm = Comm::init(id, rank, deadline)?;
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<u8>(n)
                .map_err(|e| err(format!("allocating {n} bytes on cuda:{ordinal}: {e:?}")))
        };
        let mut end = End {
            comm,
            send: alloc(HANDSHAKE)?,
            recv: alloc(HANDSHAKE)?,
            stream: stream.clone(),
            event,
            host: Vec::new(),
            peer: 1 - rank as i32,
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
        hello[..8].copy_from_slice(&preamble(0, 0)[..8]);
        self.upload(&hello)?;
        self.post(&[(0, HANDSHAKE)], HANDSHAKE, true)?;
        self.wait("handshake", Some(deadline), None)?;
        check_hello("handshake", self.download(8)?)
    }

    fn grow(&mut self, send: usize, recv: usize) -> Result<()> {
        let alloc = |s: &Arc<CudaStream>, n: usize| {
            s.alloc_zeros::<u8>(n.next_power_of_two())
                .map_err(|e| err(format!("allocating {n} bytes: {e:?}")))
        };
        if self.send.len() < send {
            self.send = alloc(&self.stream, send)?;
        }
        if self.recv.len() < recv {
            self.recv = alloc(&self.stream, recv)?;
        }
        Ok(())
    }

    /// Copies `bytes` to the start of the send buffer (stream-ordered).
    fn upload(&mut self, bytes: &[u8]) -> Result<()> {
        self.grow(bytes.len(), 0)?;
        let mut dst = self.send.slice_mut(..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut dst)
            .map_err(|e| err(format!("copying {} bytes to the GPU: {e:?}", bytes.len())))
    }

    /// Posts sends of `sends` (byte ranges of the send buffer, in order) and then a receive
    /// of `recv` bytes into the receive buffer, then marks them with the event. `grouped`:
    /// all in one NCCL group (only where the peer posts the mirror image, as the handshake
    /// does); otherwise each is its own call. NCCL may spread the operations of one group to
    /// a peer over its channels, so a group of two sends does not match two receives posted
    /// one by one (it hangs); single operations always match in order.
    fn post(&mut self, sends: &[(usize, usize)], recv: usize, grouped: bool) -> Result<()> {
        self.grow(0, recv)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| err(format!("binding the device: {e:?}")))?;
        let cs = self.stream.cu_stream() as sys::cudaStream_t;
        let (sp, _s) = self.send.device_ptr(&self.stream);
        let (rp, _r) = self.recv.device_ptr(&self.stream);
        let (sp, rp) = (sp as usize, rp as usize);
        let (peer, comm) = (self.peer, self.comm.raw);
        let u8t = sys::ncclDataType_t::ncclUint8;
        let settle = |what: &str, r: sys::ncclResult_t| -> Result<()> {
            if !check(what, r)? {
                poll(
                    what,
                    Some(Instant::now() + Duration::from_secs(30)),
                    None,
                    || self.comm.ready(what),
                )?;
            }
            Ok(())
        };
        // SAFETY (every call below): the ranges lie inside the buffers (grown above or by
        // `upload`), which live as long as this link; an opened group is closed on every path.
        let send = |off: usize, len: usize| unsafe {
            sys::ncclSend((sp + off) as *const c_void, len, u8t, peer, comm, cs)
        };
        let receive = || unsafe { sys::ncclRecv(rp as *mut c_void, recv, u8t, peer, comm, cs) };
        if grouped {
            check("opening a group", unsafe { sys::ncclGroupStart() })?;
            let mut r = Ok(true);
            for &(off, len) in sends {
                if r.is_ok() {
                    r = check("send", send(off, len));
                }
            }
            if recv > 0 && r.is_ok() {
                r = check("receive", receive());
            }
            let end = unsafe { sys::ncclGroupEnd() };
            r?;
            settle("closing a group", end)?;
        } else {
            for &(off, len) in sends {
                settle("send", send(off, len))?;
            }
            if recv > 0 {
                settle("receive", receive())?;
            }
        }
        self.event
            .record(&self.stream)
            .map_err(|e| err(format!("recording an event: {e:?}")))
    }

    /// Waits for what `post` posted.
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

    /// The first `n` received bytes, copied to the host.
    fn download(&mut self, n: usize) -> Result<&[u8]> {
        self.host.resize(n, 0);
        let src = self.recv.slice(..n);
        self.stream
            .memcpy_dtoh(&src, &mut self.host[..])
            .map_err(|e| err(format!("copying {n} bytes from the GPU: {e:?}")))?;
        self.stream
            .synchronize()
            .map_err(|e| err(format!("copying {n} bytes from the GPU: {e:?}")))?;
        Ok(&self.host[..n])
    }
}

/// The reply length a primary expects for `picks` output rows of `hidden` floats.
pub fn reply_len(picks: usize, hidden: usize) -> usize {
    8 + REPLY_HEAD + (4 * picks * hidden).max(ERR_ROOM)
}

/// Encodes a preamble.
pub fn preamble(frame_len: usize, reply_len: usize) -> [u8; PREAMBLE] {
    let mut p = [0u8; PREAMBLE];
    p[..4].copy_from_slice(&MAGIC.to_le_bytes());
    p[4..8].copy_from_slice(&VERSION.to_le_bytes());
    p[8..12].copy_from_slice(&(frame_len as u32).to_le_bytes());
    p[12..16].copy_from_slice(&(reply_len as u32).to_le_bytes());
    p
}

/// Checks the magic and version words that open a preamble or the handshake.
fn check_hello(what: &str, b: &[u8]) -> Result<()> {
    let w = |i: usize| {
        b.get(i..i + 4)
            .map(|x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]))
    };
    if w(0) != Some(MAGIC) {
        return Err(err(format!(
            "{what}: the peer is not a moelane NCCL link (bad magic)"
        )));
    }
    match w(4) {
        Some(VERSION) => Ok(()),
        v => Err(err(format!(
            "{what}: the peer speaks NCCL link version {}, this side {VERSION}",
            v.unwrap_or(0)
        ))),
    }
}

/// Decodes a preamble: (frame_len, reply_len), each checked against the frame limit.
pub fn parse_preamble(b: &[u8]) -> Result<(usize, usize)> {
    if b.len() != PREAMBLE {
        return Err(err(format!(
            "preamble of {} bytes, expected {PREAMBLE}",
            b.len()
        )));
    }
    check_hello("preamble", b)?;
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (f, r) = (w(8) as usize, w(12) as usize);
    if f == 0 || f > MAX_FRAME {
        return Err(err(format!("request frame of {f} bytes")));
    }
    if !(8 + REPLY_HEAD + ERR_ROOM..=MAX_FRAME).contains(&r) {
        return Err(err(format!("reply length {r} out of range")));
    }
    Ok((f, r))
}

/// Writes `frame` as a reply message of exactly `reply_len` bytes into `out`: its length, the
/// frame, zeros. A frame that does not fit becomes an error frame that does.
pub fn pack_reply(
    frame: &[u8],
    reply_len: usize,
    step: u64,
    layer: u32,
    epoch: u64,
    out: &mut Vec<u8>,
) {
    out.clear();
    if 8 + frame.len() <= reply_len {
        out.extend_from_slice(&(frame.len() as u64).to_le_bytes());
        out.extend_from_slice(frame);
    } else {
        let mut text = format!(
            "reply of {} bytes exceeds the {reply_len} the primary expects",
            frame.len()
        );
        text.truncate(reply_len.saturating_sub(8 + REPLY_HEAD));
        let mut f = Vec::new();
        frame::encode_reply(&Err(text), step, layer, epoch, &mut f);
        out.extend_from_slice(&(f.len() as u64).to_le_bytes());
        out.extend_from_slice(&f);
    }
    out.resize(reply_len, 0);
}

/// Reads a reply message (see [`pack_reply`]).
pub fn unpack_reply(b: &[u8]) -> Result<ColdReply> {
    if b.len() < 8 {
        return Err(err("reply shorter than its length word"));
    }
    let mut l = [0u8; 8];
    l.copy_from_slice(&b[..8]);
    let n = u64::from_le_bytes(l);
    if n > (b.len() - 8) as u64 {
        return Err(err(format!(
            "reply frame of {n} bytes in a {}-byte message",
            b.len()
        )));
    }
    crate::reply_from(&b[8..8 + n as usize])
}

/// The primary's end: a [`RemoteTier`] over NCCL.
pub struct NcclTier {
    end: End,
    hidden: usize,
    timeout: Duration,
    frame: Vec<u8>,
    req_frame: Vec<u8>,
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
            req_frame: Vec::new(),
            pending: None,
        })
    }
}

impl RemoteTier for NcclTier {
    fn send(&mut self, req: ColdRequest) -> Result<()> {
        if self.pending.is_some() {
            return Err(err("a request is already in flight"));
        }
        frame::encode_request(&req, &mut self.req_frame);
        let flen = self.req_frame.len();
        if flen > MAX_FRAME {
            return Err(err(format!("request frame of {flen} bytes is too large")));
        }
        let rl = reply_len(req.picks.len(), self.hidden);
        self.frame.clear();
        self.frame.extend_from_slice(&preamble(flen, rl));
        self.frame.extend_from_slice(&self.req_frame);
        self.end.upload(&self.frame)?;
        self.end
            .post(&[(0, PREAMBLE), (PREAMBLE, flen)], rl, false)?;
        self.pending = Some(rl);
        Ok(())
    }

    fn recv(&mut self) -> Result<ColdReply> {
        let rl = self
            .pending
            .take()
            .ok_or_else(|| err("no request in flight"))?;
        self.end.wait(
            "waiting for the reply",
            Some(Instant::now() + self.timeout),
            None,
        )?;
        unpack_reply(self.end.download(rl)?)
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
    let (mut buf, mut out, mut req) = (Vec::new(), Vec::new(), ColdRequest::default());
    let mut msg = Vec::new();
    loop {
        end.post(&[], PREAMBLE, false)?;
        end.wait("waiting for a request", None, Some(stop))?;
        let (flen, rl) = parse_preamble(end.download(PREAMBLE)?)?;
        end.post(&[], flen, false)?;
        end.wait(
            "receiving a request",
            Some(Instant::now() + Duration::from_secs(30)),
            Some(stop),
        )?;
        buf.clear();
        buf.extend_from_slice(end.download(flen)?);
        crate::handle_frame(svc, &mut buf, &mut req, &mut out);
        pack_reply(&buf, rl, req.step, req.layer, req.epoch, &mut msg);
        end.upload(&msg)?;
        end.post(&[(0, rl)], 0, false)?;
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
        let p = preamble(100, reply_len(3, 64));
        assert_eq!(parse_preamble(&p).unwrap(), (100, reply_len(3, 64)));
        let mut bad = p;
        bad[0] ^= 1;
        assert!(parse_preamble(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut v2 = p;
        v2[4] = 9;
        assert!(parse_preamble(&v2)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
        assert!(parse_preamble(&preamble(0, 4096)).is_err());
        assert!(parse_preamble(&preamble(10, 20)).is_err());
        assert!(parse_preamble(&p[..8]).is_err());

        // an ok reply fits exactly the length the primary expects
        let rep = ColdReply {
            step: 4,
            layer: 1,
            epoch: 2,
            outputs: vec![0.25; 3 * 64],
        };
        let mut f = Vec::new();
        frame::encode_reply(&Ok(rep.clone()), 4, 1, 2, &mut f);
        let rl = reply_len(3, 64);
        let mut m = Vec::new();
        pack_reply(&f, rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        assert_eq!(unpack_reply(&m).unwrap(), rep);
        // an error reply is padded to the same length and comes back as the error
        frame::encode_reply(&Err("epoch mismatch".into()), 4, 1, 2, &mut f);
        pack_reply(&f, rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        let e = unpack_reply(&m).unwrap_err().to_string();
        assert!(e.contains("epoch mismatch"), "{e}");
        // a reply larger than expected becomes an error that fits
        let big = ColdReply {
            outputs: vec![1.0; 10 * 64],
            ..rep
        };
        frame::encode_reply(&Ok(big), 4, 1, 2, &mut f);
        pack_reply(&f, rl, 4, 1, 2, &mut m);
        assert_eq!(m.len(), rl);
        let e = unpack_reply(&m).unwrap_err().to_string();
        assert!(e.contains("exceeds"), "{e}");
        // a length word past the message is an error, not a panic
        let mut lie = m.clone();
        lie[..8].copy_from_slice(&(u64::MAX).to_le_bytes());
        assert!(unpack_reply(&lie).is_err());
        assert!(unpack_reply(&m[..4]).is_err());
    }
}
