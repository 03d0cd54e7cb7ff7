//! Observability end to end: the Prometheus page of a running lane after real traffic and a
//! swap (counters moved by exactly what the clients saw; validated by Prometheus's own
//! `promtool`), the Grafana dashboard against the page, and the OpenTelemetry span trees of
//! one request and one swap across three processes, received by an OTLP server in the test.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::{Move, SwapRequest};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use serde_json::{json, Value};

/// (name, labels) -> value, from a Prometheus text page.
fn parse(page: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in page.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => {
                let mut m = BTreeMap::new();
                for kv in rest.trim_end_matches('}').split("\",") {
                    if let Some((k, v)) = kv.split_once('=') {
                        m.insert(k.to_string(), v.trim_matches('"').to_string());
                    }
                }
                (n.to_string(), m)
            }
            None => (series.to_string(), BTreeMap::new()),
        };
        out.push((name, labels, value.parse().expect("sample value")));
    }
    out
}

fn sum(s: &[(String, BTreeMap<String, String>, f64)], name: &str, want: &[(&str, &str)]) -> f64 {
    s.iter()
        .filter(|(n, l, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|x| x.2)
        .sum()
}

fn config_value(key: &str) -> u64 {
    let c: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap())
            .unwrap();
    c[key].as_u64().unwrap()
}

/// Prometheus's own validator on a page: `MOELANE_PROMTOOL` (scripts/test.sh sets it, and
/// then a promtool that cannot run fails the test), else `promtool` from PATH (skips, saying
/// why, without it).
fn promtool_check(page: &str) {
    let set = std::env::var("MOELANE_PROMTOOL")
        .ok()
        .filter(|p| !p.is_empty());
    match std::process::Command::new(set.as_deref().unwrap_or("promtool"))
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Err(e) if set.is_some() => panic!(
            "MOELANE_PROMTOOL={} is not runnable ({e})",
            set.unwrap_or_default()
        ),
        Err(e) => eprintln!(
            "SKIP promtool check: promtool not runnable here ({e}) and MOELANE_PROMTOOL is not set; ./scripts/test.sh installs it"
        ),
        Ok(mut child) => {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(page.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool check metrics:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn a_request_of_several_choices_is_one_request_in_the_metrics() {
    let (_p, _purl, gw) = serve_lane(tiny(), &[]);
    // n = 3 whole, then n = 2 streamed: usage counts each prompt once and every choice's
    // tokens; so must the counters, and each request is one duration and one first token
    let (st, r) = post(
        &gw,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 5, "n": 3,
                "temperature": 1.0, "seed": 3}),
    );
    assert_eq!(st, 200, "{r}");
    let (mut pt, mut ct) = (
        r["usage"]["prompt_tokens"].as_u64().unwrap(),
        r["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    let body = json!({"model": "tiny", "prompt": "Der Zug", "max_tokens": 4, "n": 2,
                      "temperature": 1.0, "seed": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = request(&gw, "POST", "/v1/completions", body.to_string().as_bytes());
    assert_eq!(r.status, 200);
    let usage: Value = r
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .unwrap()["usage"]
        .clone();
    pt += usage["prompt_tokens"].as_u64().unwrap();
    ct += usage["completion_tokens"].as_u64().unwrap();
    let s = parse(&request(&gw, "GET", "/metrics", b"").body);
    assert_eq!(sum(&s, "moelane_prompt_tokens_total", &[]), pt as f64);
    assert_eq!(sum(&s, "moelane_generated_tokens_total", &[]), ct as f64);
    assert_eq!(sum(&s, "moelane_request_duration_seconds_count", &[]), 2.0);
    assert_eq!(
        sum(&s, "moelane_time_to_first_token_seconds_count", &[]),
        2.0
    );
    // each of the five choices' tokens after its first
    assert_eq!(
        sum(&s, "moelane_inter_token_latency_seconds_count", &[]),
        (ct - 5) as f64
    );
}

#[test]
fn metrics_count_what_clients_saw_and_pass_promtool() {
    let (_p, purl, gw) = serve_lane(tiny(), &[]);
    // traffic: whole and streamed completions; usage as the clients saw it
    let prompts = [
        "The agent called",
        "Am frühen Morgen",
        "朝早く、川の上には",
        "이른 아침 강 위에는",
        "fn main() {",
    ];
    let (mut p_sum, mut c_sum, mut fed) = (0u64, 0u64, 0u64);
    let mut n = 0;
    for (i, p) in prompts.iter().enumerate() {
        let max_tokens = 6 + 3 * i;
        let (st, r) = post(
            &gw,
            "/v1/completions",
            &json!({"model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0}),
        );
        assert_eq!(st, 200, "{r}");
        let (pt, ct) = (
            r["usage"]["prompt_tokens"].as_u64().unwrap(),
            r["usage"]["completion_tokens"].as_u64().unwrap(),
        );
        // the last token is not fed back when the answer ended by length
        let length = r["choices"][0]["finish_reason"] == "length";
        p_sum += pt;
        c_sum += ct;
        fed += pt + ct - length as u64;
        n += 1;
    }
    let body = json!({"model": "tiny", "prompt": "Der Zug hatte Verspätung", "max_tokens": 10,
                      "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let r = request(&gw, "POST", "/v1/completions", body.to_string().as_bytes());
    assert_eq!(r.status, 200);
    let chunks: Vec<Value> = r
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let usage = chunks
        .iter()
        .rev()
        .find(|c| c["usage"].is_object())
        .unwrap()["usage"]
        .clone();
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(String::from))
        .unwrap();
    let (pt, ct) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    p_sum += pt;
    c_sum += ct;
    fed += pt + ct - (finish == "length") as u64;
    n += 1;
    // a bad request and a 404 are counted by code too
    assert_eq!(
        post(&gw, "/v1/completions", &json!({"model": "tiny"})).0,
        400
    );
    assert_eq!(get(&gw, "/nope").0, 404);
    // one swap
    let sw = swap_pair(&purl, 0);
    assert!(sw.committed, "{}", sw.abort_reason);

    let page = request(&gw, "GET", "/metrics", b"");
    assert_eq!(page.status, 200);
    let s = parse(&page.body);
    let (layers, k) = (
        config_value("num_hidden_layers"),
        config_value("num_experts_per_tok"),
    );
    assert_eq!(sum(&s, "moelane_generated_tokens_total", &[]), c_sum as f64);
    assert_eq!(
        sum(&s, "moelane_lane_generated_tokens_total", &[]),
        c_sum as f64
    );
    assert_eq!(sum(&s, "moelane_prompt_tokens_total", &[]), p_sum as f64);
    let picks = sum(&s, "moelane_expert_hot_picks_total", &[])
        + sum(&s, "moelane_expert_cold_picks_total", &[]);
    assert_eq!(
        picks,
        (fed * layers * k) as f64,
        "picks != tokens x layers x k"
    );
    assert!(sum(&s, "moelane_expert_cold_picks_total", &[]) > 0.0);
    assert_eq!(
        sum(&s, "moelane_expert_cold_picks_total", &[]),
        sum(&s, "moelane_sidecar_picks_total", &[]),
        "the sidecar computed other picks than the primary sent"
    );
    assert_eq!(
        sum(
            &s,
            "moelane_http_requests_total",
            &[("route", "/v1/completions"), ("code", "200")]
        ),
        n as f64
    );
    assert_eq!(
        sum(
            &s,
            "moelane_http_requests_total",
            &[("route", "/v1/completions"), ("code", "400")]
        ),
        1.0
    );
    assert_eq!(
        sum(
            &s,
            "moelane_http_requests_total",
            &[("route", "unmatched"), ("code", "404")]
        ),
        1.0
    );
    assert_eq!(
        sum(&s, "moelane_time_to_first_token_seconds_count", &[]),
        n as f64
    );
    assert_eq!(
        sum(&s, "moelane_request_duration_seconds_count", &[]),
        n as f64
    );
    assert_eq!(
        sum(&s, "moelane_inter_token_latency_seconds_count", &[]),
        (c_sum - n as u64) as f64
    );
    assert_eq!(
        sum(
            &s,
            "moelane_lane_requests_total",
            &[("outcome", "finished")]
        ),
        n as f64
    );
    assert!(sum(&s, "moelane_step_duration_seconds_count", &[]) > 0.0);
    assert!(
        sum(
            &s,
            "moelane_link_round_trip_seconds_count",
            &[("link", "inproc")]
        ) > 0.0
    );
    assert!(
        sum(
            &s,
            "moelane_link_bytes_total",
            &[("side", "primary"), ("direction", "sent")]
        ) > 0.0
    );
    assert_eq!(
        sum(&s, "moelane_swaps_total", &[("outcome", "committed")]),
        1.0
    );
    for ph in ["prepare", "commit", "release"] {
        assert_eq!(
            sum(
                &s,
                "moelane_swap_phases_total",
                &[("phase", ph), ("outcome", "ok")]
            ),
            1.0,
            "{ph}"
        );
    }
    assert_eq!(
        sum(&s, "moelane_experts_moved_total", &[("to", "hot")]),
        1.0
    );
    assert_eq!(
        sum(&s, "moelane_map_epoch", &[("tier", "primary")]),
        sw.map_epoch as f64
    );
    assert_eq!(
        sum(&s, "moelane_map_epoch", &[("tier", "sidecar")]),
        sw.map_epoch as f64
    );
    assert_eq!(sum(&s, "moelane_lane_up", &[]), 1.0);
    assert_eq!(sum(&s, "moelane_kv_cache_used_blocks", &[]), 0.0);
    assert_eq!(
        sum(
            &s,
            "moelane_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    let shares: Vec<f64> = s
        .iter()
        .filter(|x| x.0 == "moelane_cold_share_ratio")
        .map(|x| x.2)
        .collect();
    assert_eq!(shares.len() as u64, layers);
    assert!(shares.iter().all(|x| (0.0..=1.0).contains(x)));

    promtool_check(&page.body);

    // the dashboard: Grafana's shape, and every query names a metric this page serves
    let served: BTreeSet<String> = s
        .iter()
        .map(|x| {
            let n = x.0.as_str();
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suf| n.strip_suffix(suf))
                .unwrap_or(n)
                .to_string()
        })
        .collect();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/grafana/moelane-dashboard.json");
    let d: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(d["uid"].is_string() && d["title"].is_string());
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        let g = &p["gridPos"];
        assert!(
            g["w"].as_u64().unwrap() <= 24
                && g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24
        );
        if p["type"] == "row" {
            continue;
        }
        assert!(["timeseries", "stat", "gauge", "table"].contains(&p["type"].as_str().unwrap()));
        for t in p["targets"].as_array().unwrap() {
            assert!(t["refId"].is_string());
            let expr = t["expr"].as_str().unwrap();
            let names: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("moelane_"))
                .collect();
            assert!(!names.is_empty(), "{expr}: names no moelane metric");
            for m in names {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suf| m.strip_suffix(suf))
                    .unwrap_or(m);
                assert!(
                    served.contains(base),
                    "panel {:?}: {m} is not served",
                    p["title"]
                );
                queries += 1;
            }
        }
    }
    assert!(queries >= 20, "only {queries} metric references");
}

/// One hot expert of `layer` to cold and one cold to hot, through the primary's Swap RPC.
fn swap_pair(purl: &str, layer: u32) -> moelane_proto::lane::SwapReply {
    let map = moelane_engine::rowmap::Rowmap::read(&tiny().join("rowmap.json")).unwrap();
    let lm = &map.layers[layer as usize];
    let (h, c) = (lm.hot[0] as u32, lm.cold[0] as u32);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut cl = PrimaryClient::connect(purl.to_string()).await.unwrap();
        let mv = |expert, to_hot| Move {
            layer,
            expert,
            to_hot,
        };
        cl.swap(SwapRequest {
            moves: vec![mv(h, false), mv(c, true)],
        })
        .await
        .unwrap()
        .into_inner()
    })
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        r: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(r.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[derive(Clone, Debug)]
struct SpanRec {
    service: String,
    name: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    attrs: BTreeMap<String, String>,
}

fn spans(sink: &Sink) -> Vec<SpanRec> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value as V;
    let mut out = Vec::new();
    for req in sink.0.lock().unwrap().iter() {
        for rs in &req.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .and_then(|a| a.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(V::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                for sp in &ss.spans {
                    let attrs = sp
                        .attributes
                        .iter()
                        .map(|a| {
                            let v = match a.value.as_ref().and_then(|v| v.value.clone()) {
                                Some(V::StringValue(s)) => s,
                                Some(V::IntValue(i)) => i.to_string(),
                                Some(V::BoolValue(b)) => b.to_string(),
                                Some(V::DoubleValue(d)) => d.to_string(),
                                _ => String::new(),
                            };
                            (a.key.clone(), v)
                        })
                        .collect();
                    out.push(SpanRec {
                        service: service.clone(),
                        name: sp.name.clone(),
                        trace: sp.trace_id.clone(),
                        id: sp.span_id.clone(),
                        parent: sp.parent_span_id.clone(),
                        attrs,
                    });
                }
            }
        }
    }
    out
}

fn child<'a>(all: &'a [SpanRec], parent: &SpanRec, name: &str) -> &'a SpanRec {
    all.iter()
        .find(|s| s.parent == parent.id && s.trace == parent.trace && s.name == name)
        .unwrap_or_else(|| {
            let kids: Vec<_> = all
                .iter()
                .filter(|s| s.parent == parent.id)
                .map(|s| (&s.service, &s.name))
                .collect();
            panic!(
                "no child {name:?} under {:?} ({}); its children: {kids:?}",
                parent.name, parent.service
            )
        })
}

#[test]
fn one_trace_per_request_and_per_swap_across_processes() {
    let sink = Sink::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let l = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = l.local_addr().unwrap();
    let s2 = sink.clone();
    rt.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(s2))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
            .await
            .unwrap();
    });
    let endpoint = format!("http://{addr}");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        // the sidecar measures the host's read bandwidth and reports its weight reads
        ("MOELANE_PROBE_BANDWIDTH", "true"),
    ];
    let (procs, gw, purl) = two_process_lane_env("shm", &[], &env);
    let (st, r) = post(
        &gw,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "The agent called the tool", "max_tokens": 7, "temperature": 0}),
    );
    assert_eq!(st, 200, "{r}");
    let completion = r["usage"]["completion_tokens"].as_u64().unwrap();
    let sw = swap_pair(&purl, 1);
    assert!(sw.committed, "{}", sw.abort_reason);
    // wait for the batches to arrive
    let deadline = Instant::now() + Duration::from_secs(20);
    let all = loop {
        let all = spans(&sink);
        let done = all.iter().any(|s| s.name == "sidecar RELEASE")
            && all.iter().any(|s| s.name == "decode")
            && all.iter().any(|s| s.name == "POST /v1/completions");
        if done || Instant::now() > deadline {
            break all;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // the request: gateway root -> primary generate -> queue, prefill, decode
    let root = all
        .iter()
        .find(|s| s.name == "POST /v1/completions")
        .unwrap_or_else(|| {
            panic!(
                "no request span in {:?}",
                all.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert!(root.parent.is_empty(), "the request span is a root");
    assert_eq!(root.service, "moelane-gateway");
    assert_eq!(
        root.attrs.get("http.route").map(String::as_str),
        Some("/v1/completions")
    );
    assert_eq!(
        root.attrs.get("gen_ai.usage.output_tokens"),
        Some(&completion.to_string())
    );
    let gen = child(&all, root, "generate");
    assert_eq!(
        gen.service, "moelane-primary",
        "context crossed the gRPC hop"
    );
    assert_eq!(
        gen.attrs.get("moelane.request_id"),
        root.attrs.get("moelane.request_id")
    );
    for name in ["queue", "prefill", "decode"] {
        let sp = child(&all, gen, name);
        assert_eq!(sp.service, "moelane-primary");
    }
    assert_eq!(
        child(&all, gen, "decode")
            .attrs
            .get("gen_ai.usage.output_tokens"),
        Some(&completion.to_string())
    );
    // the swap: coordinator root -> a span per phase -> both tiers, the sidecar in its process
    let swap = all
        .iter()
        .find(|s| {
            s.name == "swap"
                && s.attrs.get("moelane.outcome").map(String::as_str) == Some("committed")
        })
        .expect("swap span");
    assert!(swap.parent.is_empty());
    assert_eq!(
        swap.attrs.get("moelane.epoch"),
        Some(&sw.map_epoch.to_string())
    );
    assert_eq!(
        swap.attrs.get("moelane.moves").map(String::as_str),
        Some("2")
    );
    let prep = child(&all, swap, "prepare");
    child(&all, prep, "primary.prepare");
    let sp = child(&all, prep, "sidecar.prepare");
    let remote = child(&all, sp, "sidecar PREPARE");
    assert_eq!(remote.service, "moelane-sidecar");
    child(&all, remote, "load");
    child(&all, remote, "stage");
    child(&all, swap, "commit");
    let rel = child(&all, swap, "release");
    let srel = child(&all, rel, "sidecar.release");
    assert_eq!(
        child(&all, srel, "sidecar RELEASE").service,
        "moelane-sidecar"
    );
    child(&all, rel, "primary.release");

    // every process serves its own page: the sidecar's and the primary's, each valid; a
    // Korean prompt first, so that the English-fitted map sends picks to the sidecar
    let (st, r) = post(
        &gw,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "이른 아침 강 위에는 짙은 안개가", "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(st, 200, "{r}");
    let completion = completion + r["usage"]["completion_tokens"].as_u64().unwrap();
    let side = parse(&request(&metrics_addr(&procs[0]), "GET", "/metrics", b"").body);
    let prim_page = request(&metrics_addr(&procs[1]), "GET", "/metrics", b"").body;
    let prim = parse(&prim_page);
    assert_eq!(
        sum(&side, "moelane_build_info", &[("role", "sidecar")]),
        1.0
    );
    assert_eq!(
        sum(&prim, "moelane_build_info", &[("role", "primary")]),
        1.0
    );
    assert_eq!(
        sum(&side, "moelane_sidecar_picks_total", &[]),
        sum(&prim, "moelane_expert_cold_picks_total", &[]),
        "the sidecar process computed other picks than the primary process sent"
    );
    assert!(sum(&side, "moelane_sidecar_picks_total", &[]) > 0.0);
    // the expert bytes the sidecar read: at least one expert's (tiny: 3 x 64 x 32, bf16),
    // at most one per pick (even in f32); the host bandwidth it is read against
    let read = sum(&side, "moelane_sidecar_weight_read_bytes_total", &[]);
    let picks = sum(&side, "moelane_sidecar_picks_total", &[]);
    assert!(
        read >= 3.0 * 64.0 * 32.0 * 2.0 && read <= picks * 3.0 * 64.0 * 32.0 * 4.0,
        "{read} bytes read for {picks} picks"
    );
    // measured once on a thread of its own at start (about a second): published when done
    let t0 = std::time::Instant::now();
    let bw = loop {
        let page = parse(&request(&metrics_addr(&procs[0]), "GET", "/metrics", b"").body);
        let bw = sum(&page, "moelane_host_read_bandwidth_bytes_per_second", &[]);
        if bw > 0.0 || t0.elapsed() > std::time::Duration::from_secs(60) {
            break bw;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(bw > 1e8, "host read bandwidth {bw}");
    assert!(
        sum(
            &prim,
            "moelane_link_round_trip_seconds_count",
            &[("link", "shm")]
        ) > 0.0,
        "{}",
        prim_page
            .lines()
            .filter(|l| l.contains("link"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        sum(&side, "moelane_map_epoch", &[("tier", "sidecar")]),
        sw.map_epoch as f64
    );
    assert_eq!(
        sum(&prim, "moelane_map_epoch", &[("tier", "primary")]),
        sw.map_epoch as f64
    );
    assert_eq!(
        sum(&prim, "moelane_lane_generated_tokens_total", &[]),
        completion as f64
    );
    promtool_check(&prim_page);
}
