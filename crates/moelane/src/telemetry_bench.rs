//! `moelane bench telemetry`: what metrics and tracing cost. Two embedded lanes on one
//! checkpoint, started side by side: one with telemetry off (`MOELANE_METRICS=off`, no OTLP
//! endpoint), one with everything on (the Prometheus page scraped every second, every span
//! exported over OTLP/gRPC to a receiver in this process). They are loaded in turn, in
//! alternating order, through their gateways with streaming completions; the medians of
//! tokens/s are compared.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use serde_json::json;

#[derive(Clone, Default)]
struct Sink(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        r: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = r
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|rs| rs.scope_spans.iter().map(|s| s.spans.len()))
            .sum();
        self.0.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

const PROMPTS: [&str; 5] = [
    "The agent called the tool search_files with the query",
    "Am frühen Morgen lag dichter Nebel über dem Fluss",
    "朝早く、川の上には濃い霧が立ちこめていて",
    "이른 아침 강 위에는 짙은 안개가 끼어 있었고",
    "fn main() { let args: Vec<String> = std::env::args().collect();",
];

/// Tokens/s of `users` concurrent streaming clients, `requests` each.
async fn load(gateway: &str, users: usize, requests: usize, max_tokens: usize) -> Result<f64> {
    let t0 = Instant::now();
    let mut hs = Vec::new();
    for u in 0..users {
        let g = gateway.to_string();
        hs.push(tokio::spawn(async move {
            let mut tokens = 0u64;
            for i in 0..requests {
                let body = json!({"model": "m", "prompt": PROMPTS[(u + i) % PROMPTS.len()],
                                  "max_tokens": max_tokens, "temperature": 0, "stream": true,
                                  "ignore_eos": true})
                .to_string();
                let evs = crate::client::stream_post(&g, "/v1/completions", &body).await?;
                tokens += evs
                    .iter()
                    .filter(|(_, d)| d.contains("\"text\":\"") && !d.contains("\"text\":\"\""))
                    .count() as u64;
            }
            Ok::<u64, anyhow::Error>(tokens)
        }));
    }
    let mut total = 0;
    for h in hs {
        total += h.await??;
    }
    Ok(total as f64 / t0.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub async fn run(
    model: PathBuf,
    users: usize,
    reps: usize,
    requests: usize,
    max_tokens: usize,
) -> Result<()> {
    let sink = Sink::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let s2 = sink.clone();
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(s2))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
            .await;
    });
    let ep = format!("http://{addr}");
    let off = crate::shift::start_serve(&model, &[], &[("MOELANE_METRICS", "off")])?;
    let on = crate::shift::start_serve(
        &model,
        &[],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", ep.as_str())],
    )?;
    // a Prometheus-like scraper on the lane with telemetry on
    let scrapes = Arc::new(AtomicU64::new(0));
    let (g, sc) = (on.gateway.clone(), scrapes.clone());
    tokio::spawn(async move {
        let mut t = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            t.tick().await;
            if crate::client::stream_get(&g, "/metrics").await.is_ok() {
                sc.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    eprintln!("warming up both lanes...");
    load(&off.gateway, users, 1, 16).await.context("lane with telemetry off")?;
    load(&on.gateway, users, 1, 16).await.context("lane with telemetry on")?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for r in 0..reps {
        let order = if r % 2 == 0 { [false, true] } else { [true, false] };
        for with in order {
            let lane = if with { &on } else { &off };
            let t = load(&lane.gateway, users, requests, max_tokens).await?;
            eprintln!("  rep {r} telemetry {}: {t:.1} tok/s", if with { "on " } else { "off" });
            if with {
                b.push(t);
            } else {
                a.push(t);
            }
        }
    }
    let (ma, mb) = (median(a.clone()), median(b.clone()));
    println!(
        "telemetry off: median {ma:.1} tok/s  {a:.1?}\ntelemetry on:  median {mb:.1} tok/s  {b:.1?}\ncost: {:+.2}% ({} spans exported, {} scrapes)",
        100.0 * (ma - mb) / ma,
        sink.0.load(Ordering::Relaxed),
        scrapes.load(Ordering::Relaxed)
    );
    Ok(())
}
