//! `moelane bench gateway`: what the gateway costs. N primaries in this process (real gRPC
//! servers on loopback, each its own step loop on the checkpoint), a gateway over them, and
//! closed-loop clients sending short greedy completions for a fixed time: straight to the
//! primaries over gRPC (round robin), then through the gateway over HTTP/1.1 keep-alive, in
//! alternating rounds. The gateway's added latency is the difference of the percentiles; its
//! throughput is requests per second through it. Everything shares this machine's cores.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::GenerateRequest;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::loadgen::pct;

pub struct GatewayBench {
    pub model: PathBuf,
    pub lanes: Vec<usize>,
    pub clients: usize,
    pub seconds: f64,
    pub max_tokens: u32,
    pub rounds: usize,
}

/// Requests per second, p50 and p99 latency in ms, failed requests.
#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    rps: f64,
    p50: f64,
    p99: f64,
    failed: usize,
}

/// Runs `clients` closed loops of `one` for `secs`.
async fn measure<F, Fut>(clients: usize, secs: f64, one: F) -> Figures
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    let one = Arc::new(one);
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let one = one.clone();
            tokio::spawn(async move {
                let (mut lat, mut failed, mut i) = (Vec::new(), 0usize, c);
                while Instant::now() < until {
                    let t = Instant::now();
                    match one(i).await {
                        Ok(()) => lat.push(t.elapsed().as_secs_f64() * 1e3),
                        Err(_) => failed += 1,
                    }
                    i += clients;
                }
                (lat, failed)
            })
        })
        .collect();
    let (mut all, mut failed) = (Vec::new(), 0);
    for t in tasks {
        if let Ok((l, f)) = t.await {
            all.extend(l);
            failed += f;
        }
    }
    Figures {
        rps: all.len() as f64 / secs,
        p50: pct(&mut all, 0.5),
        p99: pct(&mut all, 0.99),
        failed,
    }
}

/// One keep-alive HTTP/1.1 connection to the gateway.
struct Conn {
    rd: tokio::io::BufReader<tokio::net::TcpStream>,
}

impl Conn {
    async fn open(host: &str) -> Result<Conn> {
        let s = tokio::net::TcpStream::connect(host).await?;
        s.set_nodelay(true)?;
        Ok(Conn {
            rd: tokio::io::BufReader::new(s),
        })
    }

    /// POSTs `body`; the status (the body is read and dropped).
    async fn post(&mut self, host: &str, path: &str, body: &str) -> Result<u16> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let s = self.rd.get_mut();
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let (mut status, mut len) = (0u16, 0usize);
        loop {
            let mut l = String::new();
            if self.rd.read_line(&mut l).await? == 0 {
                bail!("the gateway closed the connection");
            }
            let t = l.trim_end();
            if status == 0 {
                status = t
                    .split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0);
            } else if t.is_empty() {
                break;
            } else if let Some(v) = t.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut b = vec![0u8; len];
        self.rd.read_exact(&mut b).await?;
        Ok(status)
    }
}

pub async fn run(o: GatewayBench) -> Result<()> {
    use moelane_engine::load::{load_engine, EngineOptions};
    let ckpt = moelane_engine::checkpoint::Checkpoint::open(&o.model)?;
    let served = crate::roles::model_name(&o.model, &None);
    println!(
        "bench gateway: {} ({}), {} clients, {} s per measurement, {} token(s) per request, {} rounds",
        o.model.display(),
        ckpt.id,
        o.clients,
        o.seconds,
        o.max_tokens,
        o.rounds
    );
    println!("| lanes | round | direct gRPC req/s | p50 ms | p99 ms | through the gateway req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | failed |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &n in &o.lanes {
        let mut handles = Vec::new();
        let mut urls = Vec::new();
        for _ in 0..n.max(1) {
            let engine = load_engine(
                &o.model,
                None,
                &EngineOptions {
                    kv_tokens: 2048,
                    progress: false,
                },
            )?;
            let eos = engine.cfg.eos_token_ids.clone();
            let h = moelane_gb300_worker::start(engine, ckpt.id.clone(), eos, Default::default())
                .context("starting a step loop")?;
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            urls.push(format!("http://{}", l.local_addr()?));
            tokio::spawn(moelane_gb300_worker::serve(
                l,
                h.client.clone(),
                None,
                Default::default(),
                std::future::pending(),
            ));
            handles.push(h);
        }
        let gw = crate::roles::start_gateway(&crate::roles::GatewayOptions::new(
            o.model.clone(),
            urls.clone(),
            "127.0.0.1:0".into(),
        ))
        .await?;
        let host = gw.addr.to_string();
        let mut clients = Vec::new();
        for u in &urls {
            clients.push(PrimaryClient::connect(u.clone()).await?);
        }
        let clients = Arc::new(clients);
        let prompt = moelane_text::tokenizer::Tokenizer::from_dir(&o.model)?
            .encode("The quick brown fox")?;
        let body = serde_json::json!({"model": served, "prompt": "The quick brown fox",
                                      "max_tokens": o.max_tokens, "temperature": 0})
        .to_string();
        for round in 0..o.rounds.max(1) {
            let (cs, p, mt) = (clients.clone(), prompt.clone(), o.max_tokens);
            let direct = measure(o.clients, o.seconds, move |i| {
                let mut c = cs[i % cs.len()].clone();
                let req = GenerateRequest {
                    request_id: format!("bench-{i}"),
                    prompt: p.clone(),
                    max_tokens: mt,
                    temperature: 0.0,
                    top_p: 1.0,
                    ..Default::default()
                };
                async move {
                    let mut s = c.generate(req).await?.into_inner();
                    while let Some(ev) = s.message().await? {
                        if !ev.finish_reason.is_empty() {
                            return Ok(());
                        }
                    }
                    bail!("the stream ended without a finish")
                }
            })
            .await;
            // one keep-alive connection per client, opened before the clock starts
            let mut conns = Vec::new();
            for _ in 0..o.clients {
                conns.push(Arc::new(tokio::sync::Mutex::new(Conn::open(&host).await?)));
            }
            let (conns, h2, b2) = (Arc::new(conns), host.clone(), body.clone());
            let through = measure(o.clients, o.seconds, move |i| {
                let (c, h, b) = (conns[i % conns.len()].clone(), h2.clone(), b2.clone());
                async move {
                    let mut c = c.lock().await;
                    match c.post(&h, "/v1/completions", &b).await? {
                        200 => Ok(()),
                        s => bail!("status {s}"),
                    }
                }
            })
            .await;
            println!(
                "| {n} | {} | {:.0} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
                round + 1,
                direct.rps,
                direct.p50,
                direct.p99,
                through.rps,
                through.p50,
                through.p99,
                through.p50 - direct.p50,
                through.p99 - direct.p99,
                direct.failed + through.failed
            );
        }
        gw.finish(Duration::from_secs(1)).await;
        drop(handles);
    }
    Ok(())
}
