//! `moelane bench serve` and `moelane bench link`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moelane_engine::bank::Pick;
use moelane_engine::tier::{ColdRequest, RemoteTier};
use moelane_link::ColdService;
use serde_json::{json, Value};

use crate::client::{split_url, stream_post};

pub struct LoadOptions {
    pub url: String,
    pub model: Option<String>,
    pub users: Vec<usize>,
    pub max_tokens: usize,
    pub requests: usize,
    pub temperature: f32,
    pub lane_stats: bool,
    pub json: Option<PathBuf>,
}

/// One prompt per language of the synthetic checkpoints.
pub(crate) const PROMPTS: [&str; 5] = [
    "The agent called the tool search_files with the query",
    "Am frühen Morgen lag dichter Nebel über dem Fluss",
    "朝早く、川の上には濃い霧が立ちこめていて",
    "이른 아침 강 위에는 짙은 안개가 끼어 있었고",
    "fn main() { let args: Vec<String> = std::env::args().collect();",
];

fn pct(v: &mut [f64], p: f64) -> f64 {
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
    let body = json!({"model": model, "prompt": prompt, "max_tokens": o.max_tokens, "temperature": o.temperature, "stream": true,
                      "stream_options": {"include_usage": true}, "ignore_eos": true}).to_string();
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

pub async fn run(o: LoadOptions) -> Result<()> {
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
        "server {} model {model:?}, {} tokens per answer, {} requests per user",
        o.url, o.max_tokens, o.requests
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "users", "tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "exch us/lyr"
    );
    let mut rows = Vec::new();
    for &u in &o.users {
        // warm-up
        let mut warm = Vec::new();
        for i in 0..u {
            let (h, p, m) = (host.clone(), path.clone(), model.clone());
            let oo = LoadOptions {
                max_tokens: 8,
                users: vec![],
                json: None,
                model: None,
                url: String::new(),
                ..o_clone(&o)
            };
            warm.push(tokio::spawn(async move {
                one(&h, &p, &m, PROMPTS[i % PROMPTS.len()], &oo).await
            }));
        }
        for w in warm {
            w.await??;
        }
        let before = if o.lane_stats {
            lane_wait(&host).await
        } else {
            None
        };
        let t0 = Instant::now();
        let o2 = Arc::new(o_clone(&o));
        let mut tasks = Vec::new();
        for i in 0..u {
            let (h, p, m, oo) = (host.clone(), path.clone(), model.clone(), o2.clone());
            tasks.push(tokio::spawn(async move {
                let mut res = Vec::new();
                for r in 0..oo.requests {
                    res.push(one(&h, &p, &m, PROMPTS[(i + r) % PROMPTS.len()], &oo).await?);
                }
                Ok::<_, anyhow::Error>(res)
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
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
            (Some(b), Some(a)) if a.1 > b.1 => {
                Some((a.0 - b.0) as f64 / 1e3 / ((a.1 - b.1) as f64 * a.3 as f64))
            }
            _ => None,
        };
        let row = json!({"users": u, "tokens_per_s": tokens as f64 / wall, "ttft_ms_p50": pct(&mut ttft, 0.5), "ttft_ms_p99": pct(&mut ttft, 0.99),
                         "itl_ms_p50": pct(&mut itl, 0.5), "itl_ms_p99": pct(&mut itl, 0.99), "exchange_us_per_layer_step": exch, "tokens": tokens, "wall_s": wall});
        println!(
            "{:>5} {:>10.1} {:>9.1}ms {:>9.1}ms {:>9.2}ms {:>9.2}ms {:>12}",
            u,
            tokens as f64 / wall,
            row["ttft_ms_p50"].as_f64().unwrap_or(f64::NAN),
            row["ttft_ms_p99"].as_f64().unwrap_or(f64::NAN),
            row["itl_ms_p50"].as_f64().unwrap_or(f64::NAN),
            row["itl_ms_p99"].as_f64().unwrap_or(f64::NAN),
            exch.map(|e| format!("{e:.1}"))
                .unwrap_or_else(|| "-".into())
        );
        rows.push(row);
    }
    if let Some(p) = &o.json {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(
                &json!({"url": o.url, "model": model, "max_tokens": o.max_tokens, "runs": rows}),
            )?,
        )?;
    }
    Ok(())
}

fn o_clone(o: &LoadOptions) -> LoadOptions {
    LoadOptions {
        url: o.url.clone(),
        model: o.model.clone(),
        users: o.users.clone(),
        max_tokens: o.max_tokens,
        requests: o.requests,
        temperature: o.temperature,
        lane_stats: o.lane_stats,
        json: None,
    }
}

struct Echo(usize);

impl ColdService for Echo {
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> std::result::Result<(), String> {
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
    struct InProc(Arc<dyn ColdService>);
    impl moelane_engine::tier::ColdServer for InProc {
        fn serve(&mut self, req: &ColdRequest, out: &mut Vec<f32>) -> moelane_engine::Result<()> {
            self.0.serve(req, out).map_err(moelane_engine::Error::Tier)
        }
    }
    tiers.push((
        "inproc",
        Box::new(moelane_engine::tier::InProcessTier::spawn(Box::new(
            InProc(svc.clone()),
        ))),
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
    let addr = l.local_addr()?;
    moelane_link::tcp::serve(l, svc);
    tiers.push((
        "tcp",
        Box::new(moelane_link::tcp::TcpTier::connect(
            &addr.to_string(),
            Duration::from_secs(10),
        )?),
    ));
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
