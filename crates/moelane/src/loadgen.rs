//! `moelane bench serve` and `moelane bench link`.
//!
//! `bench serve` is a closed-loop load generator: each of N users sends streaming completions
//! one after another, for at least `--requests` requests and `--duration` seconds; a failed
//! request (by HTTP status, a failed connection or a broken stream) is counted and reported,
//! and never ends the run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moelane_engine::bank::Pick;
use moelane_engine::tier::{ColdRequest, RemoteTier};
use moelane_link::ColdService;
use serde_json::{json, Value};

use crate::client::{split_url, stream_post, HttpStatus};

#[derive(Clone)]
pub struct LoadOptions {
    pub url: String,
    pub model: Option<String>,
    pub users: Vec<usize>,
    pub max_tokens: usize,
    /// Each user sends at least this many measured requests per run...
    pub requests: usize,
    /// ...and keeps sending until this long has passed since the run's start.
    pub duration: Duration,
    pub temperature: f32,
    /// Every request asks for an answer valid against this JSON schema (structured output).
    pub json_schema: Option<Value>,
    pub lane_stats: bool,
    pub json: Option<PathBuf>,
}

/// `--duration`: seconds, a non-negative number.
pub fn seconds(s: &str) -> std::result::Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    Duration::try_from_secs_f64(v).map_err(|e| format!("{s:?} is not a usable duration: {e}"))
}

/// One prompt per language of the synthetic checkpoints.
pub(crate) const PROMPTS: [&str; 5] = [
    "The agent called the tool search_files with the query",
    "Am frühen Morgen lag dichter Nebel über dem Fluss",
    "朝早く、川の上には濃い霧が立ちこめていて",
    "이른 아침 강 위에는 짙은 안개가 끼어 있었고",
    "fn main() { let args: Vec<String> = std::env::args().collect();",
];

/// The `p` quantile of `v` (sorted here), the nearest rank; NaN when empty.
pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

struct One {
    ttft: f64,
    gaps: Vec<f64>,
    tokens: u64,
}

async fn one(host: &str, path: &str, model: &str, prompt: &str, o: &LoadOptions) -> Result<One> {
    let mut body = json!({"model": model, "prompt": prompt, "max_tokens": o.max_tokens, "temperature": o.temperature, "stream": true,
                      "stream_options": {"include_usage": true}, "ignore_eos": true});
    if let Some(schema) = &o.json_schema {
        body["response_format"] =
            json!({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}});
    }
    let body = body.to_string();
    let t0 = Instant::now();
    let evs = stream_post(host, &format!("{path}/completions"), &body).await?;
    let mut times = Vec::new();
    let mut tokens = 0u64;
    for (t, d) in &evs {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(d).with_context(|| format!("bad chunk {d}"))?;
        if v.get("error").is_some() {
            bail!("server error: {d}");
        }
        if let Some(u) = v
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(|c| c.as_u64())
        {
            tokens = u;
        }
        if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
        {
            times.push(*t);
        }
    }
    let Some(first) = times.first() else {
        bail!("no text streamed")
    };
    let ttft = (*first - t0).as_secs_f64();
    let gaps = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    Ok(One {
        ttft,
        gaps,
        tokens: tokens.max(times.len() as u64),
    })
}

async fn lane_wait(host: &str) -> Option<(u64, u64, u64, usize)> {
    let evs = crate::client::stream_get(host, "/v1/stats").await.ok()?;
    let v: Value = serde_json::from_str(&evs).ok()?;
    let s = &v["lanes"][0]["stats"];
    let layers = s["layers"].as_array()?;
    let wait: u64 = layers.iter().filter_map(|l| l["wait_ns"].as_u64()).sum();
    let cold: u64 = layers.iter().filter_map(|l| l["cold_picks"].as_u64()).sum();
    Some((wait, s["steps"].as_u64()?, cold, layers.len()))
}

/// Why a request failed: the status it was answered with, a connection that failed (refused,
/// reset, closed before the answer ended), or a 200 stream that was not a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Failure {
    Http(u16),
    Connection,
    Stream,
}

impl Failure {
    fn of(e: &anyhow::Error) -> Failure {
        if let Some(h) = e.downcast_ref::<HttpStatus>() {
            Failure::Http(h.status)
        } else if e.chain().any(|c| c.is::<std::io::Error>()) {
            Failure::Connection
        } else {
            Failure::Stream
        }
    }

    fn label(self) -> String {
        match self {
            Failure::Http(s) => format!("http_{s}"),
            Failure::Connection => "connection".into(),
            Failure::Stream => "stream".into(),
        }
    }
}

/// Every failed request of a run by kind, with the first message of each kind.
#[derive(Default)]
struct Failures(BTreeMap<Failure, (u64, String)>);

impl Failures {
    fn add(&mut self, e: &anyhow::Error) {
        let k = self
            .0
            .entry(Failure::of(e))
            .or_insert((0, format!("{e:#}")));
        k.0 += 1;
    }

    fn merge(&mut self, other: Failures) {
        for (f, (n, msg)) in other.0 {
            self.0.entry(f).or_insert((0, msg)).0 += n;
        }
    }

    fn total(&self) -> u64 {
        self.0.values().map(|v| v.0).sum()
    }

    fn counts(&self) -> Value {
        Value::Object(
            self.0
                .iter()
                .map(|(f, (n, _))| (f.label(), json!(n)))
                .collect(),
        )
    }
}

/// What one user saw in one run: its completed requests and its failures.
struct UserRun {
    done: Vec<One>,
    failed: Failures,
}

/// One user's loop: at least `o.requests` requests, and on until `deadline`. A failed request
/// is counted, then the user pauses 10 ms (a server failing at once is not hammered in a
/// tight loop) and goes on.
async fn user(
    host: String,
    path: String,
    model: String,
    first: usize,
    o: Arc<LoadOptions>,
    deadline: Instant,
) -> UserRun {
    let mut run = UserRun {
        done: Vec::new(),
        failed: Failures::default(),
    };
    let mut r = 0;
    while r < o.requests || Instant::now() < deadline {
        match one(
            &host,
            &path,
            &model,
            PROMPTS[(first + r) % PROMPTS.len()],
            &o,
        )
        .await
        {
            Ok(x) => run.done.push(x),
            Err(e) => {
                run.failed.add(&e);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        r += 1;
    }
    run
}

pub async fn run(o: LoadOptions) -> Result<()> {
    let rows = measure(&o).await?;
    if !rows.is_empty() && rows.iter().all(|r| r["ok"].as_u64() == Some(0)) {
        bail!("every measured request failed (the failures are listed above)");
    }
    Ok(())
}

/// Runs each concurrency level in turn; returns one JSON row per level (as written to `--json`).
async fn measure(o: &LoadOptions) -> Result<Vec<Value>> {
    let (host, path) = split_url(&o.url)?;
    let model = match &o.model {
        Some(m) => m.clone(),
        None => {
            let t = crate::client::stream_get(&host, &format!("{path}/models")).await?;
            let v: Value = serde_json::from_str(&t).context("parsing /v1/models")?;
            v["data"][0]["id"]
                .as_str()
                .context("/v1/models lists no model")?
                .to_string()
        }
    };
    println!(
        "server {} model {model:?}, {} tokens per answer, per user and run at least {} requests and {:.1} s",
        o.url,
        o.max_tokens,
        o.requests,
        o.duration.as_secs_f64()
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>8} {:>7}",
        "users",
        "tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "exch us/lyr",
        "requests",
        "failed"
    );
    let mut rows = Vec::new();
    for &u in &o.users {
        // warm-up: one short request per user; its failures are reported, not measured
        let warm_o = Arc::new(LoadOptions {
            max_tokens: 8,
            requests: 1,
            duration: Duration::ZERO,
            ..o.clone()
        });
        let mut warm = Vec::new();
        for i in 0..u {
            let (h, p, m, oo) = (host.clone(), path.clone(), model.clone(), warm_o.clone());
            warm.push(tokio::spawn(user(h, p, m, i, oo, Instant::now())));
        }
        let mut warm_failed = Failures::default();
        for w in warm {
            warm_failed.merge(w.await.context("a warm-up task panicked")?.failed);
        }
        let before = if o.lane_stats {
            lane_wait(&host).await
        } else {
            None
        };
        let t0 = Instant::now();
        let deadline = t0 + o.duration;
        let o2 = Arc::new(o.clone());
        let mut tasks = Vec::new();
        for i in 0..u {
            let (h, p, m, oo) = (host.clone(), path.clone(), model.clone(), o2.clone());
            tasks.push(tokio::spawn(user(h, p, m, i, oo, deadline)));
        }
        let mut all = Vec::new();
        let mut failed = Failures::default();
        for t in tasks {
            let r = t.await.context("a load task panicked")?;
            all.extend(r.done);
            failed.merge(r.failed);
        }
        let wall = t0.elapsed().as_secs_f64();
        let after = if o.lane_stats {
            lane_wait(&host).await
        } else {
            None
        };
        let tokens: u64 = all.iter().map(|r| r.tokens).sum();
        let mut ttft: Vec<f64> = all.iter().map(|r| r.ttft * 1e3).collect();
        let mut itl: Vec<f64> = all
            .iter()
            .flat_map(|r| r.gaps.iter().map(|g| g * 1e3))
            .collect();
        let exch = match (before, after) {
            (Some(b), Some(a)) if a.1 > b.1 && a.0 >= b.0 && a.3 > 0 => {
                Some((a.0 - b.0) as f64 / 1e3 / ((a.1 - b.1) as f64 * a.3 as f64))
            }
            _ => None,
        };
        let n_failed = failed.total();
        let n_requests = all.len() as u64 + n_failed;
        let row = json!({"users": u, "tokens_per_s": tokens as f64 / wall, "ttft_ms_p50": pct(&mut ttft, 0.5), "ttft_ms_p99": pct(&mut ttft, 0.99),
                         "itl_ms_p50": pct(&mut itl, 0.5), "itl_ms_p99": pct(&mut itl, 0.99), "exchange_us_per_layer_step": exch, "tokens": tokens, "wall_s": wall,
                         "requests": n_requests, "ok": all.len(), "failed": n_failed, "failures": failed.counts(),
                         "warmup_failed": warm_failed.total()});
        // the failures' kinds first, on stderr, so the table's last line stays the row
        for (f, (n, msg)) in &warm_failed.0 {
            eprintln!(
                "  users {u}: warm-up failed {n} x {}, first: {msg}",
                f.label()
            );
        }
        for (f, (n, msg)) in &failed.0 {
            eprintln!("  users {u}: failed {n} x {}, first: {msg}", f.label());
        }
        println!(
            "{:>5} {:>10.1} {:>9.1}ms {:>9.1}ms {:>9.2}ms {:>9.2}ms {:>12} {:>8} {:>7}",
            u,
            tokens as f64 / wall,
            row["ttft_ms_p50"].as_f64().unwrap_or(f64::NAN),
            row["ttft_ms_p99"].as_f64().unwrap_or(f64::NAN),
            row["itl_ms_p50"].as_f64().unwrap_or(f64::NAN),
            row["itl_ms_p99"].as_f64().unwrap_or(f64::NAN),
            exch.map(|e| format!("{e:.1}"))
                .unwrap_or_else(|| "-".into()),
            n_requests,
            n_failed
        );
        rows.push(row);
    }
    if let Some(p) = &o.json {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(
                &json!({"url": o.url, "model": model, "max_tokens": o.max_tokens, "requests_per_user": o.requests,
                        "duration_s": o.duration.as_secs_f64(), "runs": rows}),
            )?,
        )
        .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(rows)
}

struct Echo(usize);

impl ColdService for Echo {
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> moelane_engine::Result<()> {
        out.clear();
        out.resize(req.picks.len() * self.0, 1.0);
        Ok(())
    }
}

/// Round-trip floor of each link kind: a decode-sized request, a zero-work sidecar.
pub fn link_floor(hidden: usize, picks: usize, iters: usize) -> Result<()> {
    let svc: Arc<dyn ColdService> = Arc::new(Echo(hidden));
    let req = ColdRequest {
        step: 0,
        layer: 0,
        epoch: 0,
        picks: (0..picks as u32)
            .map(|i| Pick {
                row: 0,
                expert: i as u16,
            })
            .collect(),
        activations: vec![0.5; hidden],
    };
    let mut tiers: Vec<(&str, Box<dyn RemoteTier>)> = Vec::new();
    tiers.push((
        "inproc",
        Box::new(moelane_engine::tier::InProcessTier::spawn(svc.clone())),
    ));
    let shm = std::env::temp_dir().join(format!("moelane-bench-link-{}", std::process::id()));
    moelane_link::shm::serve(&shm, 1 << 22, svc.clone())?;
    tiers.push((
        "shm",
        Box::new(moelane_link::shm::ShmTier::open(
            &shm,
            Duration::from_secs(10),
        )?),
    ));
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?.to_string();
    moelane_link::tcp::serve_with(l, svc.clone(), None, None);
    tiers.push((
        "tcp",
        Box::new(moelane_link::tcp::TcpTier::connect_with(
            &addr,
            Duration::from_secs(10),
            Default::default(),
        )?),
    ));
    // with cluster TLS set (--cluster-tls-*), the same port over TLS as a lane runs it
    if moelane_proto::tls::cluster_tls().is_some() {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?.to_string();
        moelane_link::tcp::serve(l, svc);
        let t = moelane_link::tcp::TcpTier::connect(&addr, Duration::from_secs(10))?;
        anyhow::ensure!(t.encrypted(), "the TLS link opened in the clear");
        tiers.push(("tcp+tls", Box::new(t)));
    }
    println!(
        "round trip of {} bytes out / {} bytes back, {iters} iterations, zero-work sidecar",
        hidden * 4 + picks * 8,
        picks * hidden * 4
    );
    println!(
        "{:>7} {:>10} {:>10} {:>10}",
        "link", "p50 us", "p99 us", "min us"
    );
    for (name, t) in tiers.iter_mut() {
        let mut v = Vec::with_capacity(iters);
        for i in 0..iters + 1000 {
            let t0 = Instant::now();
            t.send(req.clone())?;
            t.recv()?;
            if i >= 1000 {
                v.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        let min = v.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "{:>7} {:>10.1} {:>10.1} {:>10.1}",
            name,
            pct(&mut v, 0.5),
            pct(&mut v, 0.99),
            min
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// Reads one request (head and Content-Length body) and answers by its prompt: German
    /// gets a 500, Japanese a closed connection, the rest a four-token SSE stream.
    async fn answer(mut s: TcpStream) -> std::io::Result<()> {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        let body = loop {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            raw.extend_from_slice(&buf[..n]);
            let Some(p) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let head = String::from_utf8_lossy(&raw[..p]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if raw.len() >= p + 4 + len {
                break String::from_utf8_lossy(&raw[p + 4..p + 4 + len]).into_owned();
            }
        };
        if body.contains(PROMPTS[1]) {
            let err = r#"{"error":{"message":"injected","type":"server_error"}}"#;
            let resp = format!("HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{err}", err.len());
            return s.write_all(resp.as_bytes()).await;
        }
        if body.contains(PROMPTS[2]) {
            return Ok(()); // dropped: no response at all
        }
        let mut out = String::from("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
        let mut events: Vec<String> = (0..4)
            .map(|_| r#"{"choices":[{"index":0,"text":"a"}]}"#.to_string())
            .collect();
        events.push(r#"{"choices":[],"usage":{"completion_tokens":4}}"#.into());
        events.push("[DONE]".into());
        for e in events {
            let ev = format!("data: {e}\n\n");
            out.push_str(&format!("{:x}\r\n{ev}\r\n", ev.len()));
        }
        out.push_str("0\r\n\r\n");
        s.write_all(out.as_bytes()).await
    }

    async fn server() -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("local addr");
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(answer(s));
            }
        });
        format!("http://{addr}/v1")
    }

    fn options(url: String, users: Vec<usize>, requests: usize, duration: Duration) -> LoadOptions {
        LoadOptions {
            url,
            model: Some("m".into()),
            users,
            max_tokens: 4,
            requests,
            duration,
            temperature: 0.0,
            json_schema: None,
            lane_stats: false,
            json: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failed_requests_are_counted_by_kind_and_the_run_goes_on() {
        // 5 requests per user cycle through the five prompts once: per user one 500, one
        // dropped connection, three answers of 4 tokens
        let o = options(server().await, vec![1, 2], 5, Duration::ZERO);
        let rows = measure(&o)
            .await
            .expect("the run completes despite failures");
        for (row, u) in rows.iter().zip([1u64, 2]) {
            assert_eq!(row["users"], json!(u));
            assert_eq!(row["requests"], json!(5 * u), "{row}");
            assert_eq!(row["ok"], json!(3 * u), "{row}");
            assert_eq!(row["failed"], json!(2 * u), "{row}");
            assert_eq!(
                row["failures"],
                json!({"http_500": u, "connection": u}),
                "{row}"
            );
            assert_eq!(row["tokens"], json!(12 * u), "{row}");
        }
        // the second user's warm-up prompt is the German one
        assert_eq!(rows[0]["warmup_failed"], json!(0));
        assert_eq!(rows[1]["warmup_failed"], json!(1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_lasts_its_duration() {
        let o = options(server().await, vec![2], 1, Duration::from_millis(300));
        let rows = measure(&o).await.expect("run");
        assert!(
            rows[0]["wall_s"].as_f64().unwrap_or(0.0) >= 0.3,
            "{}",
            rows[0]
        );
        assert!(rows[0]["requests"].as_u64().unwrap_or(0) > 2, "{}", rows[0]);
    }

    #[test]
    fn durations_parse_or_say_why() {
        assert_eq!(seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert!(seconds("-1").is_err());
        assert!(seconds("soon").is_err());
    }
}
