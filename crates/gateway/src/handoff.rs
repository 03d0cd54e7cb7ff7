//! Handing the gateway's listening socket to a successor on the same host, so a gateway
//! binary upgrade drops no connection: the kernel's accept queue belongs to the socket, and
//! the socket lives while either process holds it (as HAProxy's and Envoy's hot restarts do).
//!
//! The running gateway listens on a Unix socket (`--handoff PATH`, mode 0600). A successor
//! started with the same path connects and asks; the running one sends a duplicate of its
//! listening descriptor (SCM_RIGHTS); the successor starts serving on it and says so; only
//! then does the running one stop accepting and drain. A successor that fails before saying
//! so changes nothing: the running gateway keeps serving and keeps offering.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

const ASK: &[u8] = b"moelane-handoff-v1 take\n";
const SERVING: &[u8] = b"serving\n";

fn io_err(what: &str, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A one-byte message with room for one descriptor: the byte, the control buffer (u64
/// storage: aligned for cmsghdr) and its length.
struct OneFd {
    byte: [u8; 1],
    control: Vec<u64>,
    space: usize,
}

impl OneFd {
    fn new() -> Self {
        // SAFETY: CMSG_SPACE is a pure size computation
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        OneFd {
            byte: [b'L'],
            control: vec![0u64; space.div_ceil(8)],
            space,
        }
    }

    /// The msghdr over these buffers and `iov` (which must point at `self.byte`).
    ///
    /// # Safety
    /// The returned header points into `self` and `iov`: use it while both live, unmoved.
    unsafe fn header(&mut self, iov: &mut libc::iovec) -> libc::msghdr {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_control = self.control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = self.space as _;
        msg
    }
}

/// Sends `fd` over `sock` with one data byte.
fn send_fd(sock: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    let mut m = OneFd::new();
    let mut iov = libc::iovec {
        iov_base: m.byte.as_mut_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: the header points at `m` and `iov`, alive and unmoved until sendmsg returns;
    // the control buffer holds one descriptor (CMSG_SPACE), aligned for cmsghdr
    unsafe {
        let msg = m.header(&mut iov);
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Err(std::io::Error::other("no room for the descriptor"));
        }
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
        if libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Receives one descriptor sent by [`send_fd`] (close-on-exec).
fn recv_fd(sock: &UnixStream) -> std::io::Result<OwnedFd> {
    let mut m = OneFd::new();
    let mut iov = libc::iovec {
        iov_base: m.byte.as_mut_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: the header points at live buffers of the sizes given; a descriptor is read
    // only from a control message of type SCM_RIGHTS long enough to hold one, and the kernel
    // installed it in this process (so this process owns it)
    unsafe {
        let mut msg = m.header(&mut iov);
        let n = libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the running gateway closed the handoff connection",
            ));
        }
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
            || ((*cmsg).cmsg_len as usize)
                < libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the handoff reply carried no socket",
            ));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const RawFd);
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// A listening socket taken from a running gateway; say [`Taken::serving`] once it accepts.
pub struct Taken {
    pub listener: std::net::TcpListener,
    conn: UnixStream,
}

impl Taken {
    /// Tells the previous gateway that this one accepts now: it stops accepting and drains.
    pub fn serving(mut self) -> std::io::Result<()> {
        self.conn
            .write_all(SERVING)
            .map_err(|e| io_err("telling the previous gateway", e))
    }
}

/// Takes the listening socket of the gateway serving handoffs at `path`. `Ok(None)`: no
/// gateway answers there (no file, or a stale one), bind a new socket.
pub fn take(path: &Path) -> std::io::Result<Option<Taken>> {
    let mut conn = match UnixStream::connect(path) {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(io_err(&format!("connecting to {}", path.display()), e)),
    };
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    conn.write_all(ASK)
        .map_err(|e| io_err("asking the running gateway", e))?;
    let fd = recv_fd(&conn).map_err(|e| io_err("receiving the listening socket", e))?;
    let listener = std::net::TcpListener::from(fd);
    // it must be a listening TCP socket: local_addr fails on anything else
    listener
        .local_addr()
        .map_err(|e| io_err("the socket received", e))?;
    Ok(Some(Taken { listener, conn }))
}

/// A listening socket offered to successors.
pub struct Offer {
    /// Resolves once a successor took the socket and serves on it.
    pub taken: tokio::sync::oneshot::Receiver<()>,
    fd: std::sync::Arc<std::sync::Mutex<Option<OwnedFd>>>,
}

impl Offer {
    /// Stops offering and closes this process's extra copy of the socket (a drain without a
    /// successor: once the server drops its own, new connections are refused at once rather
    /// than left waiting in the queue of a socket nobody accepts on).
    pub fn withdraw(&self) {
        self.fd.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// Offers `listener` to successors at `path` (replacing a stale socket file; mode 0600).
pub fn offer(path: &Path, listener: &std::net::TcpListener) -> std::io::Result<Offer> {
    let fd: OwnedFd = listener
        .try_clone()
        .map_err(|e| io_err("duplicating the listening socket", e))?
        .into();
    let fd = std::sync::Arc::new(std::sync::Mutex::new(Some(fd)));
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&format!("removing {}", path.display()), e)),
    }
    let ul =
        UnixListener::bind(path).map_err(|e| io_err(&format!("binding {}", path.display()), e))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let owned: PathBuf = path.to_path_buf();
    let held = fd.clone();
    std::thread::Builder::new()
        .name("moelane-handoff".into())
        .spawn(move || {
            for conn in ul.incoming() {
                let Ok(mut c) = conn else { continue };
                let g = held.lock().unwrap_or_else(|p| p.into_inner());
                let Some(raw) = g.as_ref().map(|f| f.as_raw_fd()) else {
                    // draining without a successor: nothing to hand over any more
                    return;
                };
                let r = hand_over(&mut c, raw);
                drop(g);
                match r {
                    Ok(()) => {
                        tracing::info!(path = %owned.display(), "a successor took the listening socket; draining");
                        let _ = tx.send(());
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "a handoff did not complete; still serving")
                    }
                }
            }
        })?;
    Ok(Offer { taken: rx, fd })
}

/// One successor's handoff: its ask, our descriptor, its word that it serves.
fn hand_over(c: &mut UnixStream, fd: RawFd) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(30)))?;
    c.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut ask = [0u8; ASK.len()];
    c.read_exact(&mut ask)?;
    if ask != ASK {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a moelane handoff request",
        ));
    }
    send_fd(c, fd)?;
    let mut said = [0u8; SERVING.len()];
    c.read_exact(&mut said)?;
    if said != SERVING {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the successor did not say it serves",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_successor_takes_the_socket_and_the_queue_survives() {
        let dir = std::env::temp_dir().join(format!("moelane-handoff-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("gw.sock");
        assert!(take(&path).expect("nobody there").is_none());
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let o = offer(&path, &l).expect("offer");
        let mut taken_rx = o.taken;
        // a client connects before the handoff: it waits in the accept queue
        let mut early = std::net::TcpStream::connect(addr).expect("connect");
        // a successor that hangs up before serving changes nothing
        {
            let mut c = UnixStream::connect(&path).expect("connect");
            c.write_all(ASK).expect("ask");
            let fd = recv_fd(&c).expect("fd");
            drop(fd);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(taken_rx.try_recv().is_err(), "not taken yet");
        let t = tokio::task::spawn_blocking({
            let p = path.clone();
            move || take(&p)
        })
        .await
        .expect("join")
        .expect("take")
        .expect("a gateway answers");
        assert_eq!(t.listener.local_addr().expect("addr"), addr);
        let l2 = t.listener.try_clone().expect("clone");
        t.serving().expect("serving");
        tokio::time::timeout(Duration::from_secs(5), taken_rx)
            .await
            .expect("handed over in time")
            .expect("sender");
        // the old process closes its socket: the connection queued before is still there
        drop(l);
        let (mut s, _) = l2.accept().expect("accept the early connection");
        early.write_all(b"x").expect("write");
        let mut b = [0u8; 1];
        s.read_exact(&mut b).expect("read");
        assert_eq!(&b, b"x");
        // a stranger's bytes are refused without a descriptor
        let p = dir.join("other.sock");
        let l3 = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let _o = offer(&p, &l3).expect("offer");
        let mut c = UnixStream::connect(&p).expect("connect");
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("write");
        c.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut sink = Vec::new();
        let _ = c.read_to_end(&mut sink);
        assert!(sink.is_empty(), "nothing sent to a stranger");
    }
}
