//! `moelane bench telemetry`: what metrics and tracing cost. Three embedded lanes on one
//! checkpoint, started side by side: two with telemetry off (`MOELANE_METRICS=off`, no OTLP
//! endpoint) and one with everything on (the Prometheus page scraped every second, every span
//! exported over OTLP/gRPC to a receiver in this process). They are loaded one at a time, in
//! rotating order, through their gateways with streaming completions; the medians of tokens/s
//! are compared. The two identical lanes give the noise floor of the comparison (lane to lane
//! differences that have nothing to do with telemetry).

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

use crate::loadgen::PROMPTS;

/// Tokens/s of `users` concurrent streaming clients, `requests` each.
async fn load(
    gateway: &str,
    model: &str,
    users: usize,
    requests: usize,
    max_tokens: usize,
) -> Result<f64> {
    let t0 = Instant::now();
    let mut hs = Vec::new();
    for u in 0..users {
        let (g, m) = (gateway.to_string(), model.to_string());
        hs.push(tokio::spawn(async move {
            let mut tokens = 0u64;
            for i in 0..requests {
                let body = json!({"model": m, "prompt": PROMPTS[(u + i) % PROMPTS.len()],
                                  "max_tokens": max_tokens, "temperature": 0, "stream": true,
                                  "stream_options": {"include_usage": true}, "ignore_eos": true})
                .to_string();
                let evs = crate::client::stream_post(&g, "/v1/completions", &body).await?;
                // the usage chunk says how many tokens were generated
                tokens += evs
                    .iter()
                    .filter_map(|(_, d)| serde_json::from_str::<serde_json::Value>(d).ok())
                    .filter_map(|v| v["usage"]["completion_tokens"].as_u64())
                    .sum::<u64>();
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
    let name = model
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let off = crate::shift::start_serve(&model, &[], &[("MOELANE_METRICS", "off")])?;
    let off_b = crate::shift::start_serve(&model, &[], &[("MOELANE_METRICS", "off")])?;
    let on =
        crate::shift::start_serve(&model, &[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", ep.as_str())])?;
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
    load(&off.gateway, &name, users, 1, 16)
        .await
        .context("lane with telemetry off")?;
    load(&on.gateway, &name, users, 1, 16)
        .await
        .context("lane with telemetry on")?;
    load(&off_b.gateway, &name, users, 1, 16)
        .await
        .context("second lane with telemetry off")?;
    let lanes = [("off", &off), ("on", &on), ("off (2nd)", &off_b)];
    let mut got: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for r in 0..reps {
        for k in 0..3 {
            let i = (r + k) % 3;
            let t = load(&lanes[i].1.gateway, &name, users, requests, max_tokens).await?;
            eprintln!("  rep {r} telemetry {:<9}: {t:.1} tok/s", lanes[i].0);
            got[i].push(t);
        }
    }
    let m: Vec<f64> = got.iter().map(|v| median(v.clone())).collect();
    for (i, (n, _)) in lanes.iter().enumerate() {
        println!("telemetry {n:<9}: median {:.1} tok/s  {:.1?}", m[i], got[i]);
    }
    let base = (m[0] + m[2]) / 2.0;
    println!(
        "cost of telemetry: {:+.2}% of the mean of the two off lanes; noise floor (off vs off): {:.2}%; {} spans exported, {} scrapes",
        100.0 * (base - m[1]) / base,
        100.0 * (m[0] - m[2]).abs() / base,
        sink.0.load(Ordering::Relaxed),
        scrapes.load(Ordering::Relaxed)
    );
    Ok(())
}
