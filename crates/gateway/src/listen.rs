//! The gateway's HTTP/1.1 listener: its own accept loop over hyper, so every connection is
//! bounded (a cap on open connections, a deadline for each request head, which is also how
//! long a kept-alive connection may sit idle) and a stop drains without dropping a request.
//!
//! A stop (or a handoff to a successor, which accepts on the same socket from then on) stops
//! accepting at once. For `drain_window` after it, the connections already open stay open and
//! every response carries `Connection: close`, so a request a client had just sent on a fresh
//! or kept-alive connection is answered rather than lost; then the connections still idle
//! are closed and those with a request in flight close after its response (the streams
//! themselves end within the gateway's grace period: [`crate::server::Shutdown`]).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

/// HTTPS: the TLS handshake every connection makes first (bounded by the head deadline).
#[derive(Clone)]
pub struct Tls(pub tokio_rustls::TlsAcceptor);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

/// Bounds on the HTTP connections, and their TLS.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// Serve HTTPS with this (none: plain HTTP).
    pub tls: Option<Tls>,
    /// Most connections open at once; past it new ones wait in the listen backlog.
    pub max_connections: usize,
    /// A request head must arrive whole within this long of the connection opening or of the
    /// previous response: a slow or silent client is closed.
    pub header_timeout: Duration,
    /// After a stop: how long the open connections are still served (each response then
    /// closes its connection) before idle ones are closed.
    pub drain_window: Duration,
    /// A connection whose client reads nothing for this long (a write waiting, or, on Linux,
    /// written bytes none of which it acknowledges) is closed, so it cannot hold its slot for
    /// ever (the gateway's stream stall bound, `--stream-stall-timeout`).
    pub write_stall: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            tls: None,
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            drain_window: Duration::from_secs(1),
            write_stall: Duration::from_secs(60),
        }
    }
}

/// The address a request's connection came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(pub std::net::IpAddr);

impl Peer {
    /// The client this address stands for: the address itself (an IPv4 one mapped into
    /// IPv6 as IPv4), or an IPv6 address's /64, which one host or site usually holds whole.
    pub fn client(&self) -> String {
        match self.0.to_canonical() {
            std::net::IpAddr::V4(a) => a.to_string(),
            std::net::IpAddr::V6(a) => {
                let s = a.segments();
                let net = std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0);
                format!("{net}/64")
            }
        }
    }
}

/// The router, with the connection's [`Peer`] put on each request.
#[derive(Clone)]
struct WithPeer {
    app: Router,
    peer: Peer,
}

impl tower::Service<hyper::Request<hyper::body::Incoming>> for WithPeer {
    type Response = Response<axum::body::Body>;
    type Error = std::convert::Infallible;
    type Future = axum::routing::future::RouteFuture<std::convert::Infallible>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        // a router is always ready
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut r: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        r.extensions_mut().insert(self.peer);
        tower::Service::call(&mut self.app, r)
    }
}

/// Serves `app` on `listener` until `stop` resolves, then drains (module docs); returns once
/// every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    stop: impl Future<Output = ()>,
) {
    let closing = Arc::new(AtomicBool::new(false));
    let app = {
        let closing = closing.clone();
        app.layer(axum::middleware::map_response(
            move |mut r: Response<axum::body::Body>| {
                let closing = closing.load(Ordering::SeqCst);
                async move {
                    if closing {
                        r.headers_mut()
                            .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    }
                    r
                }
            },
        ))
    };
    let (drain_tx, drain_rx) = watch::channel(false);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut conns = JoinSet::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let builder = Arc::new(builder);
    tokio::pin!(stop);
    loop {
        // finished connections are reaped as they go, not held until the stop
        while conns.try_join_next().is_some() {}
        let slot = tokio::select! {
            _ = &mut stop => break,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let (tcp, peer) = tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    // out of descriptors (or a connection reset before it was taken): wait a
                    // little rather than spin; the connections open are unaffected
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Nagle off: small SSE chunks must not wait for the client's delayed ACK
        let _ = tcp.set_nodelay(true);
        let tcp = WriteStall::new(tcp, limits.write_stall);
        // the peer's address on each request: whom a request is accounted to without keys
        let peer = Peer(peer.ip());
        let svc = hyper_util::service::TowerToHyperService::new(WithPeer {
            app: app.clone(),
            peer,
        });
        let (builder, drain) = (builder.clone(), drain_rx.clone());
        let (tls, handshake) = (limits.tls.clone(), limits.header_timeout);
        conns.spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_io(&builder, tcp, svc, drain).await,
                // the handshake within the head deadline: a client that opens a connection
                // and says nothing holds a slot no longer over TLS than without
                Some(Tls(acceptor)) => {
                    match tokio::time::timeout(handshake, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => serve_io(&builder, tls, svc, drain).await,
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake past the head deadline"),
                    }
                }
            }
        });
    }
    // the successor (or nobody) accepts from here on
    drop(listener);
    closing.store(true, Ordering::SeqCst);
    let open = conns.len();
    if open > 0 {
        tracing::info!(
            open,
            window_s = limits.drain_window.as_secs_f64(),
            "stopped accepting: serving the open connections, each response closing its own"
        );
        let window = tokio::time::sleep(limits.drain_window);
        tokio::pin!(window);
        loop {
            tokio::select! {
                _ = &mut window => break,
                next = conns.join_next() => if next.is_none() { break },
            }
        }
    }
    let _ = drain_tx.send(true);
    while conns.join_next().await.is_some() {}
}

/// One connection served until it ends, or until the drain (then gracefully).
async fn serve_io<I>(
    builder: &hyper::server::conn::http1::Builder,
    io: I,
    svc: hyper_util::service::TowerToHyperService<WithPeer>,
    mut drain: watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let conn = builder.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => return log_end(r),
        _ = drain.wait_for(|d| *d) => {}
    }
    conn.as_mut().graceful_shutdown();
    log_end(conn.await)
}

/// A connection's IO whose writes fail (`TimedOut`) once the client has read nothing for
/// `limit`: hyper then closes the connection. Two ways to see it: a write waiting that long
/// (the socket's buffers full), or, on Linux, a write accepted while bytes written earlier
/// have waited that long without the peer acknowledging any (it advertises no room: the
/// kernel's send buffer, up to 4 MiB, would otherwise take a slow stream many minutes to
/// fill). Without it a client that stops reading holds its connection, and one of the
/// `max_connections` slots, until it goes away.
struct WriteStall<I> {
    io: I,
    limit: Duration,
    /// set while a write or flush is pending, cleared by any progress
    since: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// the socket, where its unacknowledged bytes can be read
    fd: i32,
    /// bytes the socket accepted, and of those the peer had acknowledged at the last look
    written: u64,
    acked: u64,
    /// whether some were unacknowledged at the last look, and since when the peer has
    /// acknowledged nothing new while some were
    waiting: bool,
    progress: std::time::Instant,
}

impl<I: std::os::fd::AsRawFd> WriteStall<I> {
    fn new(io: I, limit: Duration) -> Self {
        WriteStall {
            fd: io.as_raw_fd(),
            io,
            limit,
            since: None,
            written: 0,
            acked: 0,
            waiting: false,
            progress: std::time::Instant::now(),
        }
    }
}

impl<I> WriteStall<I> {
    /// A write's answer, after the acknowledgement check of what it wrote.
    fn accepted(
        &mut self,
        r: std::task::Poll<std::io::Result<usize>>,
    ) -> std::task::Poll<std::io::Result<usize>> {
        match r {
            std::task::Poll::Ready(Ok(n)) => std::task::Poll::Ready(self.check_acks(n).map(|()| n)),
            other => other,
        }
    }

    /// After the socket accepted `n` more bytes: an error once the peer has acknowledged
    /// nothing for the limit while bytes waited for it.
    fn check_acks(&mut self, n: usize) -> std::io::Result<()> {
        self.written += n as u64;
        let Some(unacked) = unacknowledged(self.fd) else {
            return Ok(());
        };
        let acked = self.written.saturating_sub(unacked);
        let now = std::time::Instant::now();
        // progress: the peer acknowledged more, or nothing was waiting at the last look
        // (what waits now was written just now)
        if acked > self.acked || !self.waiting {
            self.progress = now;
        }
        self.acked = self.acked.max(acked);
        self.waiting = unacked > 0;
        if self.waiting && now.duration_since(self.progress) > self.limit {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client acknowledged nothing for {:?}", self.limit),
            ));
        }
        Ok(())
    }

    /// What a write or flush answers: progress clears the clock; pending starts it, and past
    /// the limit becomes the error.
    fn watch<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::task::Poll;
        if r.is_ready() {
            self.since = None;
            return r;
        }
        let limit = self.limit;
        let t = self
            .since
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match t.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<I: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteStall<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteStall<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.io).poll_write(cx, buf);
        let r = self.watch(cx, r);
        self.accepted(r)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        let r = self.watch(cx, r);
        self.accepted(r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, r)
    }
}

/// Bytes written to socket `fd` that its peer has not acknowledged yet (Linux's SIOCOUTQ),
/// where that can be read.
#[cfg(target_os = "linux")]
fn unacknowledged(fd: i32) -> Option<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: fd is the connection's open socket (its owner outlives this call), and
    // TIOCOUTQ writes one int through the pointer given
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    (r == 0 && n >= 0).then_some(n as u64)
}

#[cfg(not(target_os = "linux"))]
fn unacknowledged(_fd: i32) -> Option<u64> {
    None
}

fn log_end(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        // a client that went away or timed out its head: routine, not an error of ours
        tracing::debug!(error = %e, "HTTP connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn start(
        limits: HttpLimits,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let app = Router::new()
            .route("/x", axum::routing::get(|| async { "ok" }))
            // a response without end, 64 KiB a chunk
            .route(
                "/flood",
                axum::routing::get(|| async {
                    let chunk = axum::body::Bytes::from(vec![b'x'; 1 << 16]);
                    axum::body::Body::from_stream(futures::stream::repeat_with(move || {
                        Ok::<_, std::io::Error>(chunk.clone())
                    }))
                }),
            )
            // a slow response without end: 1 KiB every 10 ms (a stream of tokens)
            .route(
                "/trickle",
                axum::routing::get(|| async {
                    let chunk = axum::body::Bytes::from(vec![b'y'; 1024]);
                    let s = futures::stream::unfold((), move |()| {
                        let c = chunk.clone();
                        async move {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            Some((Ok::<_, std::io::Error>(c), ()))
                        }
                    });
                    axum::body::Body::from_stream(s)
                }),
            );
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(l, app, limits, async move {
            let _ = rx.await;
        }));
        (a, tx, task)
    }

    /// Sends one GET /x on `s`; the response head and body as text (up to the body "ok").
    async fn get(s: &mut TcpStream) -> String {
        s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"ok") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed before the response: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).to_lowercase()
    }

    /// Seconds until the server closes `s` (reads nothing but the close).
    async fn closed_after(s: &mut TcpStream, limit: Duration) -> Option<f64> {
        let t0 = Instant::now();
        let mut buf = [0u8; 64];
        match tokio::time::timeout(limit, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => Some(t0.elapsed().as_secs_f64()),
            Ok(Ok(n)) => panic!("unexpected bytes {:?}", &buf[..n]),
            Err(_) => None,
        }
    }

    /// A TLS acceptor for a fresh self-signed certificate of 127.0.0.1.
    fn acceptor() -> Tls {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (c, k) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        let cfg = moelane_proto::tls::http_server_config(&c, &k).unwrap();
        Tls(tokio_rustls::TlsAcceptor::from(cfg))
    }

    #[test]
    fn a_peer_is_its_ipv4_address_or_its_ipv6_64() {
        let c = |a: &str| Peer(a.parse().unwrap()).client();
        assert_eq!(c("192.0.2.7"), "192.0.2.7");
        assert_eq!(c("::ffff:192.0.2.7"), "192.0.2.7");
        assert_eq!(c("2001:db8:1:2:aaaa::1"), "2001:db8:1:2::/64");
        assert_eq!(c("2001:db8:1:2:bbbb::9"), c("2001:db8:1:2:aaaa::1"));
        assert_ne!(c("2001:db8:1:3::1"), c("2001:db8:1:2::1"));
    }

    #[tokio::test]
    async fn over_tls_a_silent_connection_is_closed_at_the_head_deadline() {
        let limits = HttpLimits {
            header_timeout: Duration::from_millis(400),
            tls: Some(acceptor()),
            ..Default::default()
        };
        let (a, _stop, _t) = start(limits).await;
        // no ClientHello: the handshake's deadline is the head's
        let mut s = TcpStream::connect(a).await.unwrap();
        let t = closed_after(&mut s, Duration::from_secs(5))
            .await
            .expect("a silent TLS client was not closed");
        assert!((0.3..2.0).contains(&t), "closed after {t:.2} s");
        // a plain HTTP request is not answered as HTTP
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
        assert!(!String::from_utf8_lossy(&got).contains("200"), "{got:?}");
    }

    #[tokio::test]
    async fn silent_slow_and_idle_connections_are_closed_at_the_head_deadline() {
        let limits = HttpLimits {
            header_timeout: Duration::from_millis(400),
            ..Default::default()
        };
        let (a, _stop, _t) = start(limits).await;
        // silent from the start
        let mut s = TcpStream::connect(a).await.unwrap();
        let t = closed_after(&mut s, Duration::from_secs(5))
            .await
            .expect("closed");
        assert!(
            (0.3..2.0).contains(&t),
            "silent connection closed after {t} s"
        );
        // a head sent a byte at a time, slower than the deadline
        let mut s = TcpStream::connect(a).await.unwrap();
        let t0 = Instant::now();
        let mut cut = false;
        for b in b"GET /x HTTP/1.1\r\nHost: t\r\n".iter() {
            if s.write_all(&[*b]).await.is_err() {
                cut = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(60)).await;
            if t0.elapsed() > Duration::from_secs(3) {
                break;
            }
        }
        let t = closed_after(&mut s, Duration::from_secs(1)).await;
        assert!(cut || t.is_some(), "a slow head was not closed");
        assert!(t0.elapsed() < Duration::from_secs(3));
        // kept alive after a response, then idle
        let mut s = TcpStream::connect(a).await.unwrap();
        assert!(get(&mut s).await.starts_with("http/1.1 200"));
        let t = closed_after(&mut s, Duration::from_secs(5))
            .await
            .expect("closed");
        assert!(
            (0.3..2.0).contains(&t),
            "idle kept-alive connection closed after {t} s"
        );
    }

    #[tokio::test]
    async fn a_request_sent_just_after_the_stop_on_an_open_connection_is_answered() {
        let limits = HttpLimits {
            drain_window: Duration::from_millis(800),
            ..Default::default()
        };
        let (a, stop, task) = start(limits).await;
        // one fresh connection, one kept alive after a response
        let mut fresh = TcpStream::connect(a).await.unwrap();
        let mut kept = TcpStream::connect(a).await.unwrap();
        assert!(!get(&mut kept).await.contains("connection: close"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // new connections are refused (nobody accepts: the listener is closed)
        assert!(TcpStream::connect(a).await.is_err());
        for s in [&mut fresh, &mut kept] {
            let r = get(s).await;
            assert!(
                r.starts_with("http/1.1 200") && r.contains("connection: close"),
                "{r}"
            );
            assert!(closed_after(s, Duration::from_secs(2)).await.is_some());
        }
        tokio::time::timeout(Duration::from_secs(3), task)
            .await
            .expect("the server ends once its connections are closed")
            .unwrap();
    }

    fn one_slot_stalling_at_700ms() -> HttpLimits {
        HttpLimits {
            max_connections: 1,
            write_stall: Duration::from_millis(700),
            ..Default::default()
        }
    }

    /// At a cap of one connection held by a stalled client (a 700 ms bound), the next client
    /// is served once the stalled one is closed, not before the bound.
    async fn next_served_once_the_stalled_one_is_closed(a: std::net::SocketAddr) {
        let t0 = Instant::now();
        let mut next = TcpStream::connect(a).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), get(&mut next))
            .await
            .expect("the next client is served once the stalled connection is closed");
        assert!(r.starts_with("http/1.1 200"), "{r}");
        assert!(
            t0.elapsed() >= Duration::from_millis(500),
            "{:?}",
            t0.elapsed()
        );
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_loses_its_connection_and_slot() {
        let (a, _stop, _t) = start(one_slot_stalling_at_700ms()).await;
        let mut greedy = TcpStream::connect(a).await.unwrap();
        greedy
            .write_all(b"GET /flood HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 64];
        assert!(greedy.read(&mut head).await.unwrap() > 0, "the flood began");
        // it reads nothing more: the buffers fill, the writes stall, and the connection is
        // closed after the bound, which frees the only slot for the next client
        next_served_once_the_stalled_one_is_closed(a).await;
        // and the stalled client, reading again, finds its connection closed
        let mut buf = vec![0u8; 1 << 16];
        let end = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match greedy.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(end.is_ok(), "the stalled connection is still open");
    }

    /// A slow stream fills the kernel's send buffer (up to 4 MiB) only after minutes: the
    /// client that stops reading is seen by its acknowledgements stopping, within the bound.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_client_that_stops_reading_a_slow_stream_loses_its_connection() {
        let (a, _stop, _t) = start(one_slot_stalling_at_700ms()).await;
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let mut slow = sock.connect(a).await.unwrap();
        slow.write_all(b"GET /trickle HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 64];
        assert!(slow.read(&mut head).await.unwrap() > 0, "the stream began");
        // it reads nothing more: ~100 KiB/s go out, its window closes after a few KiB
        next_served_once_the_stalled_one_is_closed(a).await;
        drop(slow);
    }

    #[tokio::test]
    async fn past_the_connection_cap_a_client_waits_for_a_free_slot() {
        let limits = HttpLimits {
            max_connections: 2,
            ..Default::default()
        };
        let (a, _stop, _t) = start(limits).await;
        let mut one = TcpStream::connect(a).await.unwrap();
        let mut two = TcpStream::connect(a).await.unwrap();
        get(&mut one).await;
        get(&mut two).await;
        // the third sits in the backlog: no answer while both slots are held
        let mut three = TcpStream::connect(a).await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(400), get(&mut three)).await;
        assert!(
            waited.is_err(),
            "a third connection was served past a cap of 2"
        );
        drop(one);
        let r = tokio::time::timeout(Duration::from_secs(3), get(&mut three))
            .await
            .expect("served once a slot is free");
        assert!(r.starts_with("http/1.1 200"));
    }
}
