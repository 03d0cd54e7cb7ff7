//! TCP link (between hosts): length-prefixed frames on one connection, Nagle off. The
//! client's reads have a deadline, so a dead sidecar is an error on the step, not a hang.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use moelane_engine::error::Fault;
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};
use moelane_engine::{Error, Result};

use crate::frame::{self, MAX_FRAME};
use crate::ColdService;

fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<()> {
    read_frame_max(s, buf, MAX_FRAME)
}

/// [`read_frame`] refusing frames over `max` bytes.
fn read_frame_max(s: &mut TcpStream, buf: &mut Vec<u8>, max: usize) -> std::io::Result<()> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the limit"),
        ));
    }
    // the buffer grows with the bytes that arrive, not with the length claimed: a prefix of
    // 1 GiB followed by nothing costs nothing
    buf.clear();
    let got = s.take(n as u64).read_to_end(buf)?;
    if got < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the connection ended after {got} of a frame's {n} bytes"),
        ));
    }
    Ok(())
}

/// Most connections the sidecar's TCP data port serves at once (a lane needs one; more are
/// a restarted primary's, or someone else's): past it a new one is closed at once.
pub const MAX_CONNECTIONS: usize = 16;

fn write_frame(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    s.write_all(&(buf.len() as u32).to_le_bytes())?;
    s.write_all(buf)
}

/// The first frame of a connection when the deployment has a cluster token: these bytes,
/// then the token. The sidecar answers [`AUTH_OK`]; a connection that does not open with a
/// token it accepts, within [`AUTH_DEADLINE`], is closed unanswered.
pub const AUTH_MAGIC: &[u8] = b"moelane-link-auth-1\0";
pub const AUTH_OK: &[u8] = b"ok";
pub const AUTH_DEADLINE: Duration = Duration::from_secs(5);

/// Presents `token` on a new connection and waits for the sidecar's acceptance.
fn authenticate(s: &mut TcpStream, token: &str, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut f = AUTH_MAGIC.to_vec();
    f.extend_from_slice(token.as_bytes());
    write_frame(s, &f)?;
    read_frame_max(s, buf, 64)?;
    if buf.as_slice() != AUTH_OK {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the sidecar refused the cluster token",
        ));
    }
    Ok(())
}

/// The primary's end of a TCP link.
pub struct TcpTier {
    stream: TcpStream,
    buf: Vec<u8>,
    pending: Option<(u64, u32, u64)>,
    /// The read timeout set on the socket now.
    read_timeout: Duration,
}

impl TcpTier {
    /// Connects, presenting this process's cluster token when one is set.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        let token = moelane_proto::auth::cluster();
        Self::connect_as(addr, timeout, token.as_deref().map(|k| k.token()))
    }

    /// Connects, presenting `token` first when given.
    pub fn connect_as(addr: &str, timeout: Duration, token: Option<&str>) -> Result<Self> {
        let to_err =
            |e: std::io::Error| Error::link("tcp", crate::io_fault(&e), format!("{addr}: {e}"));
        let sa: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map_err(to_err)?
            .next()
            .ok_or_else(|| {
                Error::link(
                    "tcp",
                    Fault::Unavailable,
                    format!("{addr} resolves to nothing"),
                )
            })?;
        let stream = TcpStream::connect_timeout(&sa, timeout).map_err(to_err)?;
        stream.set_nodelay(true).map_err(to_err)?;
        stream.set_read_timeout(Some(timeout)).map_err(to_err)?;
        stream.set_write_timeout(Some(timeout)).map_err(to_err)?;
        let mut stream = stream;
        let mut buf = Vec::new();
        if let Some(t) = token {
            authenticate(&mut stream, t, &mut buf).map_err(|e| {
                Error::link(
                    "tcp",
                    Fault::Unavailable,
                    format!("{addr}: presenting the cluster token: {e}"),
                )
            })?;
        }
        Ok(TcpTier {
            stream,
            buf,
            pending: None,
            read_timeout: timeout,
        })
    }
}

impl RemoteTier for TcpTier {
    fn send(&mut self, req: ColdRequest) -> Result<()> {
        frame::encode_request(&req, &mut self.buf);
        self.pending = Some((req.step, req.layer, req.epoch));
        write_frame(&mut self.stream, &self.buf)
            .map_err(|e| Error::link("tcp", crate::io_fault(&e), format!("send: {e}")))
    }

    fn recv(&mut self) -> Result<ColdReply> {
        if self.pending.take().is_none() {
            return Err(Error::Internal(
                "tcp link: recv without a request in flight".into(),
            ));
        }
        read_frame(&mut self.stream, &mut self.buf).map_err(|e| {
            let f = crate::io_fault(&e);
            let what = if f == Fault::Timeout {
                format!(
                    "no reply from the sidecar within {:.2} s (stalled or unreachable)",
                    self.read_timeout.as_secs_f64()
                )
            } else {
                format!("receive: {e}")
            };
            Error::link("tcp", f, what)
        })?;
        crate::reply_from("tcp", &self.buf)
    }

    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn set_reply_deadline(&mut self, deadline: Duration) {
        // a system call only when it changes by more than an eighth
        let d = deadline.max(Duration::from_millis(1));
        let (a, b) = (d.as_nanos(), self.read_timeout.as_nanos());
        if a.abs_diff(b) * 8 > b && self.stream.set_read_timeout(Some(d)).is_ok() {
            self.read_timeout = d;
        }
    }
}

/// Serves every connection of `listener` on its own thread until the listener fails; with
/// this process's cluster token set, only connections that present it.
pub fn serve(listener: TcpListener, svc: Arc<dyn ColdService>) {
    serve_with(listener, svc, moelane_proto::auth::cluster())
}

/// Whether a new connection opens with a token `keys` accepts (nothing to check without keys).
fn admitted(
    s: &mut TcpStream,
    keys: Option<&moelane_proto::auth::Keys>,
    buf: &mut Vec<u8>,
) -> bool {
    let Some(k) = keys else { return true };
    let _ = s.set_read_timeout(Some(AUTH_DEADLINE));
    let ok = read_frame_max(s, buf, AUTH_MAGIC.len() + 1024).is_ok()
        && buf.starts_with(AUTH_MAGIC)
        && k.accepts(&buf[AUTH_MAGIC.len()..])
        && write_frame(s, AUTH_OK).is_ok();
    let _ = s.set_read_timeout(None);
    if !ok {
        tracing::warn!(
            peer = ?s.peer_addr().ok(),
            "a connection to the TCP data port did not present the cluster token: closed"
        );
    }
    ok
}

/// [`serve`] with the keys given (None: every connection is served).
pub fn serve_with(
    listener: TcpListener,
    svc: Arc<dyn ColdService>,
    keys: Option<Arc<moelane_proto::auth::Keys>>,
) {
    std::thread::Builder::new()
        .name("moelane-tcp-accept".into())
        .spawn(move || {
            let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                if open.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= MAX_CONNECTIONS {
                    open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    tracing::warn!(
                        peer = ?s.peer_addr().ok(),
                        "the TCP data port already serves {MAX_CONNECTIONS} connections: closing a new one"
                    );
                    continue;
                }
                struct Leave(Arc<std::sync::atomic::AtomicUsize>);
                impl Drop for Leave {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                let leave = Leave(open.clone());
                let (svc, keys) = (svc.clone(), keys.clone());
                let _ = std::thread::Builder::new()
                    .name("moelane-tcp-link".into())
                    .spawn(move || {
                        let _leave = leave;
                        let _ = s.set_nodelay(true);
                        let (mut buf, mut out, mut req) =
                            (Vec::new(), Vec::new(), ColdRequest::default());
                        if !admitted(&mut s, keys.as_deref(), &mut buf) {
                            return;
                        }
                        while read_frame(&mut s, &mut buf).is_ok() {
                            crate::handle_frame(&svc, &mut buf, &mut req, &mut out);
                            if write_frame(&mut s, &buf).is_err() {
                                break;
                            }
                        }
                    });
            }
        })
        .ok();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_length_prefix_allocates_only_what_arrives() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = TcpStream::connect(a).unwrap();
            c.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
            c.write_all(&[7u8; 10]).unwrap();
            // then the connection ends
        });
        let (mut s, _) = l.accept().unwrap();
        let mut buf = Vec::new();
        let e = read_frame(&mut s, &mut buf).unwrap_err();
        t.join().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
        assert!(e.to_string().contains("10 of"), "{e}");
        assert!(
            buf.capacity() < 1 << 20,
            "{} bytes reserved",
            buf.capacity()
        );
        // a frame over the limit is refused before anything is read
        let t = std::thread::spawn(move || {
            let mut c = TcpStream::connect(a).unwrap();
            c.write_all(&u32::MAX.to_le_bytes()).unwrap();
        });
        let (mut s, _) = l.accept().unwrap();
        t.join().unwrap();
        let e = read_frame(&mut s, &mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    }

    struct Nothing;
    impl ColdService for Nothing {
        fn serve(&self, _: &ColdRequest, out: &mut Vec<f32>) -> Result<()> {
            out.clear();
            Ok(())
        }
    }

    #[test]
    fn with_a_cluster_token_only_connections_that_present_it_are_served() {
        let keys = moelane_proto::auth::Keys::parse("link-token-0123456789abcdef", "t").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        serve_with(l, Arc::new(Nothing), Some(Arc::new(keys)));
        let to = Duration::from_secs(5);
        // the right token: served
        let mut t = TcpTier::connect_as(&a, to, Some("link-token-0123456789abcdef")).unwrap();
        t.send(ColdRequest::default()).unwrap();
        let r = t.recv();
        assert!(r.is_ok(), "{:?}", r.err());
        // a wrong token: refused at connect
        let e = TcpTier::connect_as(&a, to, Some("wrong-token-0123456789abcdef")).err();
        assert!(e.is_some_and(|e| e.to_string().contains("cluster token")));
        // no token: the first frame is not one, the connection is closed unanswered
        let mut c = TcpStream::connect(&a).unwrap();
        c.set_read_timeout(Some(to)).unwrap();
        write_frame(&mut c, &[1, 2, 3]).unwrap();
        let mut buf = Vec::new();
        assert!(read_frame(&mut c, &mut buf).is_err());
    }

    #[test]
    fn past_the_connection_cap_a_new_connection_is_closed_and_a_freed_slot_serves_again() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        serve(l, Arc::new(Nothing));
        let held: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(a).unwrap())
            .collect();
        // the one past the cap is closed without an answer
        let mut extra = TcpStream::connect(a).unwrap();
        extra
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(extra.read(&mut b), Ok(0) | Err(_)));
        drop(held);
        // once the held ones are gone, a client is served: a malformed frame gets an answer
        // (an error reply) rather than a closed connection
        let until = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let mut c = TcpStream::connect(a).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            write_frame(&mut c, &[1, 2, 3]).unwrap();
            let mut buf = Vec::new();
            if read_frame(&mut c, &mut buf).is_ok() {
                break;
            }
            assert!(std::time::Instant::now() < until, "no slot freed");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
