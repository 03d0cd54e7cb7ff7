//! Shared-memory link between two processes on one host: a mapping (a file in /dev/shm)
//! holding two single-producer single-consumer byte rings, requests one way and replies the
//! other. The reader spins briefly, then sleeps on a futex in the mapping, so an idle link
//! burns no core and a busy one answers in microseconds. Each side checks the other's pid
//! while it waits: a dead peer is an error, not a hang.
//!
//! Layout: header (magic, ring capacity, pids, closed flag) on the first cache lines, the
//! two rings' head/tail/sequence words on separate cache lines, data from offset 4096.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use moelane_engine::error::Fault;
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};
use moelane_engine::{Error, Result};

use crate::frame::{self, MAX_FRAME};
use crate::ColdService;

const MAGIC: u64 = u64::from_le_bytes(*b"MOELANE1");
const DATA: usize = 4096;
// header offsets
const O_MAGIC: usize = 0;
const O_CAP: usize = 8;
const O_PID_SIDECAR: usize = 16;
const O_PID_PRIMARY: usize = 20;
const O_CLOSED: usize = 24;
// ring control offsets: ring 0 (requests), ring 1 (replies)
const O_RING: [usize; 2] = [256, 1024];

/// One end of a mapping.
struct Mapping {
    map: MmapMut,
    cap: u64,
    path: PathBuf,
}

impl Mapping {
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the fixed 8-aligned header offsets, far inside the mapping
        // (which is at least DATA bytes and page-aligned); AtomicU64 has the layout of u64,
        // and all accesses to these words, from both processes, are atomic.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as `u64_at`, for a 4-aligned fixed offset.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU32) }
    }
    fn head(&self, r: usize) -> &AtomicU64 {
        self.u64_at(O_RING[r])
    }
    fn tail(&self, r: usize) -> &AtomicU64 {
        self.u64_at(O_RING[r] + 128)
    }
    fn seq(&self, r: usize) -> &AtomicU32 {
        self.u32_at(O_RING[r] + 256)
    }
    fn data(&self, r: usize) -> *mut u8 {
        // SAFETY: ring r's data lies at DATA + r * cap, inside the mapping of DATA + 2 cap bytes.
        unsafe { (self.map.as_ptr() as *mut u8).add(DATA + r * self.cap as usize) }
    }
    fn closed(&self) -> bool {
        self.u32_at(O_CLOSED).load(Ordering::Acquire) != 0
    }
    fn close(&self) {
        self.u32_at(O_CLOSED).store(1, Ordering::Release);
        for r in 0..2 {
            self.seq(r).fetch_add(1, Ordering::Release);
            futex_wake(self.seq(r));
        }
    }

    /// Copies `src` into ring r at logical position `pos` (wrapping).
    fn copy_in(&self, r: usize, pos: u64, src: &[u8]) {
        let cap = self.cap as usize;
        let at = (pos % self.cap) as usize;
        let first = src.len().min(cap - at);
        // SAFETY: at + first <= cap and the rest (< cap) goes to the start of the ring; the
        // producer owns [head, tail + cap) by the ring protocol, so the consumer is not reading it.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data(r).add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(r), src.len() - first);
        }
    }

    fn copy_out(&self, r: usize, pos: u64, dst: &mut [u8]) {
        let cap = self.cap as usize;
        let at = (pos % self.cap) as usize;
        let first = dst.len().min(cap - at);
        // SAFETY: as copy_in; the consumer owns [tail, head), published with Release.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data(r).add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.data(r),
                dst.as_mut_ptr().add(first),
                dst.len() - first,
            );
        }
    }

    /// Writes one frame into ring r, waiting (with a deadline) for room.
    fn write(&self, r: usize, frame: &[u8], timeout: Duration, peer: Option<u32>) -> Result<()> {
        let need = 4 + frame.len() as u64;
        if need > self.cap {
            return Err(Error::link(
                "shm",
                Fault::Internal,
                format!(
                    "frame of {} bytes exceeds the ring of {} bytes",
                    frame.len(),
                    self.cap
                ),
            ));
        }
        let head = self.head(r).load(Ordering::Relaxed);
        let start = Instant::now();
        while self.cap - (head - self.tail(r).load(Ordering::Acquire)) < need {
            if self.closed() {
                return Err(Error::link("shm", Fault::Unavailable, "link closed"));
            }
            check_peer(peer)?;
            if start.elapsed() > timeout {
                return Err(Error::link(
                    "shm",
                    Fault::Timeout,
                    format!("no room in the ring for {timeout:?}"),
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.copy_in(r, head, &(frame.len() as u32).to_le_bytes());
        self.copy_in(r, head + 4, frame);
        self.head(r).store(head + need, Ordering::Release);
        self.seq(r).fetch_add(1, Ordering::Release);
        futex_wake(self.seq(r));
        Ok(())
    }

    /// Reads one frame from ring r into `buf`; `timeout` None waits as long as the peer lives.
    fn read(
        &self,
        r: usize,
        buf: &mut Vec<u8>,
        timeout: Option<Duration>,
        peer: &dyn Fn() -> Option<u32>,
    ) -> Result<()> {
        let tail = self.tail(r).load(Ordering::Relaxed);
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let seq = self.seq(r).load(Ordering::Acquire);
            if self.head(r).load(Ordering::Acquire) != tail {
                break;
            }
            if self.closed() {
                return Err(Error::link(
                    "shm",
                    Fault::Unavailable,
                    "link closed by the peer",
                ));
            }
            if spins < 2000 {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            check_peer(peer())?;
            if let Some(t) = timeout {
                if start.elapsed() > t {
                    return Err(Error::link(
                        "shm",
                        Fault::Timeout,
                        format!("no reply within {t:?}"),
                    ));
                }
            }
            futex_wait(self.seq(r), seq, Duration::from_millis(50));
        }
        let mut len = [0u8; 4];
        self.copy_out(r, tail, &mut len);
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_FRAME || n as u64 + 4 > self.cap {
            return Err(Error::link(
                "shm",
                Fault::Internal,
                format!("corrupt ring: frame length {n}"),
            ));
        }
        buf.resize(n, 0);
        self.copy_out(r, tail + 4, buf);
        self.tail(r).store(tail + 4 + n as u64, Ordering::Release);
        Ok(())
    }
}

fn check_peer(pid: Option<u32>) -> Result<()> {
    if let Some(pid) = pid {
        if pid != 0 && !pid_alive(pid) {
            return Err(Error::link(
                "shm",
                Fault::Unavailable,
                format!("peer process {pid} exited"),
            ));
        }
    }
    Ok(())
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the futex word lives in the shared mapping for the life of `word`; FUTEX_WAIT
    // (shared, not PRIVATE) sleeps only while the word still equals `expected`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: waking waiters on a valid futex word has no memory effects.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wait(_: &AtomicU32, _: u32, timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_micros(200)));
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_: &AtomicU32) {}

fn map_file(path: &Path, create: Option<u64>) -> Result<Mapping> {
    let io = |e: std::io::Error| {
        Error::link(
            "shm",
            crate::io_fault(&e),
            format!("{}: {e}", path.display()),
        )
    };
    let f = {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(create.is_some())
            .truncate(create.is_some())
            // only this user's processes may map the activations, from the first instant
            .mode(0o600)
            .open(path)
            .map_err(io)?
    };
    if let Some(cap) = create {
        f.set_len(DATA as u64 + 2 * cap).map_err(io)?;
    }
    let len = f.metadata().map_err(io)?.len() as usize;
    if len < DATA {
        return Err(Error::link(
            "shm",
            Fault::Unavailable,
            format!("{}: mapping of {len} bytes is too small", path.display()),
        ));
    }
    // SAFETY: the file is shared only between the two ends of this link, which access the
    // header words atomically and the ring data under the ring protocol.
    let map = unsafe { MmapMut::map_mut(&f) }.map_err(io)?;
    let mut m = Mapping {
        map,
        cap: 0,
        path: path.into(),
    };
    if let Some(cap) = create {
        m.cap = cap;
        m.u64_at(O_CAP).store(cap, Ordering::Relaxed);
        m.u32_at(O_PID_SIDECAR)
            .store(std::process::id(), Ordering::Relaxed);
        m.u64_at(O_MAGIC).store(MAGIC, Ordering::Release);
    } else {
        if m.u64_at(O_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(Error::link(
                "shm",
                Fault::Unavailable,
                format!("{}: not a moelane link", path.display()),
            ));
        }
        m.cap = m.u64_at(O_CAP).load(Ordering::Relaxed);
        if DATA as u64 + 2 * m.cap > len as u64 {
            return Err(Error::link(
                "shm",
                Fault::Unavailable,
                format!(
                    "{}: header says {} byte rings, file is {len}",
                    path.display(),
                    m.cap
                ),
            ));
        }
    }
    Ok(m)
}

/// The primary's end of a shared-memory link.
pub struct ShmTier {
    m: Mapping,
    buf: Vec<u8>,
    timeout: Duration,
    sidecar: u32,
}

impl ShmTier {
    /// Attaches to a mapping the sidecar created.
    pub fn open(path: &Path, timeout: Duration) -> Result<Self> {
        let m = map_file(path, None)?;
        m.u32_at(O_PID_PRIMARY)
            .store(std::process::id(), Ordering::Release);
        let sidecar = m.u32_at(O_PID_SIDECAR).load(Ordering::Acquire);
        Ok(ShmTier {
            m,
            buf: Vec::new(),
            timeout,
            sidecar,
        })
    }
}

impl RemoteTier for ShmTier {
    fn send(&mut self, req: ColdRequest) -> Result<()> {
        frame::encode_request(&req, &mut self.buf);
        self.m.write(0, &self.buf, self.timeout, Some(self.sidecar))
    }

    fn recv(&mut self) -> Result<ColdReply> {
        let sidecar = self.sidecar;
        self.m
            .read(1, &mut self.buf, Some(self.timeout), &|| Some(sidecar))?;
        crate::reply_from("shm", &self.buf)
    }

    fn kind(&self) -> &'static str {
        "shm"
    }

    fn set_reply_deadline(&mut self, deadline: Duration) {
        self.timeout = deadline.max(Duration::from_millis(1));
    }
}

impl Drop for ShmTier {
    fn drop(&mut self) {
        self.m.close();
    }
}

/// Creates a mapping at `path` with rings of `cap` bytes and serves it on a thread until the
/// primary closes it or exits. The file is removed once the primary has attached (both
/// processes keep their mappings) or when serving ends.
/// How long a new segment waits for its primary to attach before it is removed (the primary
/// attaches right after REGISTER answers; a registration nobody follows leaves nothing).
pub const ATTACH_DEADLINE: Duration = Duration::from_secs(30);

/// Segments this process serves now (waiting for their primary or attached): a sidecar
/// bounds them so that registrations cannot pile up threads and files.
static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many segments this process serves now.
pub fn live_segments() -> usize {
    LIVE.load(Ordering::Acquire)
}

/// Counts a serving thread in [`LIVE`] while it lives.
struct Live;

impl Live {
    fn new() -> Live {
        LIVE.fetch_add(1, Ordering::AcqRel);
        Live
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

pub fn serve(path: &Path, cap: u64, svc: Arc<dyn ColdService>) -> Result<()> {
    serve_within(path, cap, svc, ATTACH_DEADLINE)
}

/// [`serve`] with the attach deadline given.
pub fn serve_within(
    path: &Path,
    cap: u64,
    svc: Arc<dyn ColdService>,
    attach: Duration,
) -> Result<()> {
    let m = map_file(path, Some(cap.max(1 << 16)))?;
    let made = Instant::now();
    let live = Live::new();
    std::thread::Builder::new()
        .name("moelane-shm-link".into())
        .spawn(move || {
            let _live = live;
            let (mut buf, mut out, mut req) = (Vec::new(), Vec::new(), ColdRequest::default());
            let mut unlinked = false;
            loop {
                let peer = || {
                    let p = m.u32_at(O_PID_PRIMARY).load(Ordering::Acquire);
                    (p != 0).then_some(p)
                };
                if !unlinked && peer().is_some() {
                    let _ = std::fs::remove_file(&m.path);
                    unlinked = true;
                }
                // until a primary attaches, wait in short reads no longer than the attach
                // deadline in all; once attached, as long as the link lives
                let attached = peer().is_some();
                let r = if attached {
                    m.read(0, &mut buf, None, &peer)
                } else {
                    let left = attach.saturating_sub(made.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    m.read(
                        0,
                        &mut buf,
                        Some(left.min(Duration::from_millis(200))),
                        &peer,
                    )
                };
                match r {
                    Ok(()) => {}
                    Err(e) if !attached && e.fault() == Fault::Timeout => continue,
                    Err(_) => break,
                }
                if !unlinked {
                    let _ = std::fs::remove_file(&m.path);
                    unlinked = true;
                }
                crate::handle_frame(&svc, &mut buf, &mut req, &mut out);
                if m.write(1, &buf, Duration::from_secs(30), peer()).is_err() {
                    break;
                }
            }
            let _ = std::fs::remove_file(&m.path);
        })
        .map_err(|e| {
            Error::link(
                "shm",
                Fault::Unavailable,
                format!("starting its thread: {e}"),
            )
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use moelane_engine::bank::Pick;

    #[test]
    fn a_segment_is_private_from_creation_and_removed_when_nobody_attaches() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        serve_within(&path, 1 << 16, Arc::new(Echo), Duration::from_millis(300)).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "mode {mode:o}");
        let t0 = Instant::now();
        while path.exists() {
            assert!(t0.elapsed() < Duration::from_secs(5), "the segment stayed");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    struct Echo;
    impl ColdService for Echo {
        fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()> {
            if req.layer == 99 {
                return Err(Error::NotResident {
                    layer: 99,
                    expert: 0,
                    tier: "cold",
                });
            }
            out.clear();
            out.extend(
                req.picks
                    .iter()
                    .map(|p| p.expert as f32 + req.activations[p.row as usize]),
            );
            Ok(())
        }
    }

    #[test]
    fn shm_round_trips_with_wrapping_and_errors() {
        let path = std::env::temp_dir().join(format!("moelane-shm-test-{}", std::process::id()));
        serve(&path, 1 << 16, Arc::new(Echo)).unwrap();
        let mut t = ShmTier::open(&path, Duration::from_secs(5)).unwrap();
        for step in 0..3000u64 {
            // sizes vary so the ring wraps at many offsets
            let n = (step % 700) as usize + 1;
            let req = ColdRequest {
                step,
                layer: 1,
                epoch: 4,
                picks: (0..n as u32)
                    .map(|i| Pick {
                        row: i,
                        expert: (i % 300) as u16,
                    })
                    .collect(),
                activations: (0..n).map(|i| i as f32).collect(),
            };
            t.send(req).unwrap();
            let r = t.recv().unwrap();
            assert_eq!((r.step, r.layer, r.epoch), (step, 1, 4));
            assert_eq!(r.outputs.len(), n);
            assert!(r
                .outputs
                .iter()
                .enumerate()
                .all(|(i, &v)| v == (i % 300) as f32 + i as f32));
        }
        t.send(ColdRequest {
            step: 1,
            layer: 99,
            epoch: 0,
            picks: vec![],
            activations: vec![],
        })
        .unwrap();
        // the sidecar's fault crosses the link with its error
        let e = t.recv().unwrap_err();
        assert_eq!(e.fault(), Fault::NotResident, "{e}");
        assert!(e.to_string().contains("layer 99"), "{e}");
        assert!(
            !path.exists(),
            "the mapping file is removed once both ends hold it"
        );
    }
}
