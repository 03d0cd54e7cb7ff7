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
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the limit"),
        ));
    }
    buf.resize(n, 0);
    s.read_exact(buf)
}

fn write_frame(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    s.write_all(&(buf.len() as u32).to_le_bytes())?;
    s.write_all(buf)
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
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
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
        Ok(TcpTier {
            stream,
            buf: Vec::new(),
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

/// Serves every connection of `listener` on its own thread until the listener fails.
pub fn serve(listener: TcpListener, svc: Arc<dyn ColdService>) {
    std::thread::Builder::new()
        .name("moelane-tcp-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                let svc = svc.clone();
                let _ = std::thread::Builder::new()
                    .name("moelane-tcp-link".into())
                    .spawn(move || {
                        let _ = s.set_nodelay(true);
                        let (mut buf, mut out, mut req) =
                            (Vec::new(), Vec::new(), ColdRequest::default());
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
