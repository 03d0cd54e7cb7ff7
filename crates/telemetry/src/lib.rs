//! Telemetry for every moelane process: the Prometheus page (`metrics` + its Prometheus
//! exporter; names in [`names`]), OpenTelemetry traces over OTLP/gRPC (`tracing` +
//! `tracing-opentelemetry`; on only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set), trace context
//! carried in gRPC metadata (W3C `traceparent`), and structured log lines (text or JSON).
//!
//! Counters kept by the engine and the sidecar as plain atomics are published at scrape time
//! by collectors ([`add_collector`]): the hot path pays nothing for them.

pub mod names;

use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

use futures::future::BoxFuture;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Publishes values (gauges, absolute counters) right before the page is rendered.
pub type Collector = Box<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// Float counters: name -> (labels as rendered) -> value.
type Floats = std::collections::BTreeMap<&'static str, std::collections::BTreeMap<String, f64>>;

struct Telemetry {
    prom: Option<PrometheusHandle>,
    floats: Mutex<Floats>,
    collectors: Mutex<Vec<std::sync::Arc<Gathering>>>,
    tracer: Mutex<Option<opentelemetry_sdk::trace::SdkTracerProvider>>,
}

static T: OnceLock<Telemetry> = OnceLock::new();

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            o => Err(format!("log format {o:?}: choose text or json")),
        }
    }
}

const SECONDS_LATENCY: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const SECONDS_STEP: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
];
const SECONDS_LINK: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.02, 0.1,
];
const SECONDS_SWAP: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

fn recorder() -> Result<PrometheusHandle, String> {
    let mut b = PrometheusBuilder::new();
    for (names, buckets) in [
        (
            &[names::REQUEST_DURATION, names::TIME_TO_FIRST_TOKEN][..],
            SECONDS_LATENCY,
        ),
        (
            &[names::INTER_TOKEN_LATENCY, names::STEP_DURATION][..],
            SECONDS_STEP,
        ),
        (&[names::LINK_ROUND_TRIP][..], SECONDS_LINK),
        (&[names::SWAP_DURATION][..], SECONDS_SWAP),
    ] {
        for n in names {
            b = b
                .set_buckets_for_metric(Matcher::Full(n.to_string()), buckets)
                .map_err(|e| e.to_string())?;
        }
    }
    b.install_recorder().map_err(|e| e.to_string())
}

/// Sets up metrics, logs and (when `OTEL_EXPORTER_OTLP_ENDPOINT` is set) trace export for
/// this process; `role` names it (`service.name` is `moelane-<role>`). Metrics are off when
/// `MOELANE_METRICS=off`. Call once, inside a tokio runtime, before anything records.
pub fn init(role: &str, log_format: LogFormat) {
    let metrics_on = std::env::var("MOELANE_METRICS").map_or(true, |v| v != "off");
    let prom = if metrics_on {
        match recorder() {
            Ok(h) => {
                names::describe();
                metrics::gauge!(names::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "role" => role.to_string())
                    .set(1.0);
                Some(h)
            }
            Err(e) => {
                eprintln!("moelane: metrics recorder not installed: {e}");
                None
            }
        }
    } else {
        None
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("MOELANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = match log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|s| !s.trim().is_empty());
    let mut provider = None;
    let otel = match endpoint {
        None => None,
        Some(ep) => match otlp_provider(role) {
            Ok(p) => {
                let tracer = p.tracer("moelane");
                provider = Some(p);
                opentelemetry::global::set_text_map_propagator(
                    opentelemetry_sdk::propagation::TraceContextPropagator::new(),
                );
                let targets = tracing_subscriber::filter::Targets::new()
                    .with_target("moelane", tracing::Level::INFO)
                    .with_target("moelane_gateway", tracing::Level::INFO)
                    .with_target("moelane_gb300_worker", tracing::Level::INFO)
                    .with_target("moelane_rtx_worker", tracing::Level::INFO)
                    .with_target("moelane_residency_actor", tracing::Level::INFO);
                Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_filter(targets),
                )
            }
            Err(e) => {
                eprintln!("moelane: OTLP export to {ep} not started: {e}");
                None
            }
        },
    };
    TRACING.store(provider.is_some(), std::sync::atomic::Ordering::Relaxed);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init();
    let _ = T.set(Telemetry {
        prom: prom.clone(),
        floats: Mutex::new(Floats::new()),
        collectors: Mutex::new(Vec::new()),
        tracer: Mutex::new(provider),
    });
    if let Some(h) = prom {
        // drains histogram buckets into the page's state now and then
        tokio::spawn(async move {
            let mut t = tokio::time::interval(std::time::Duration::from_secs(5));
            loop {
                t.tick().await;
                h.run_upkeep();
            }
        });
    }
}

fn otlp_provider(role: &str) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_timeout(std::time::Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(format!("moelane-{role}"))
        .build();
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Set once at [`init`] when traces are exported (read on every request: no lock).
static TRACING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether traces are being exported.
pub fn tracing_on() -> bool {
    TRACING.load(std::sync::atomic::Ordering::Relaxed)
}

/// Flushes spans not yet exported (call before exiting).
pub fn shutdown() {
    if let Some(t) = T.get() {
        TRACING.store(false, std::sync::atomic::Ordering::Relaxed);
        if let Some(p) = t.tracer.lock().ok().and_then(|mut g| g.take()) {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

/// Sets a counter measured in seconds (a float) to `value`, as a collector publishes an
/// absolute total; rendered with the page.
pub fn set_seconds_total(name: &'static str, labels: &[(&str, &str)], value: f64) {
    let Some(t) = T.get() else {
        return;
    };
    if t.prom.is_none() {
        return;
    }
    let l = if labels.is_empty() {
        String::new()
    } else {
        let inner: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        format!("{{{}}}", inner.join(","))
    };
    if let Ok(mut f) = t.floats.lock() {
        f.entry(name).or_default().insert(l, value);
    }
}

/// A collector and whether a run of it is still going.
struct Gathering {
    collect: Collector,
    running: std::sync::atomic::AtomicBool,
}

/// How long a render waits for its collectors: a step loop in the middle of a long step
/// answers only once the step ends (seconds, in a long prefill), and a scrape must not wait
/// for it (Prometheus gives up at its scrape timeout, 10 s by default, just when the lane is
/// busiest). Past this the page shows the values of the last collection that finished; the
/// one under way still lands, for the next scrape.
pub const COLLECT_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// Registers a collector run before each render of the page.
pub fn add_collector(c: Collector) {
    if let Some(t) = T.get() {
        if let Ok(mut v) = t.collectors.lock() {
            v.push(std::sync::Arc::new(Gathering {
                collect: c,
                running: std::sync::atomic::AtomicBool::new(false),
            }));
        }
    }
}

/// The longest one collection may run before it is given up (a step loop that never answers
/// again): the next scrape then asks anew.
pub const COLLECT_CAP: std::time::Duration = std::time::Duration::from_secs(30);

/// Marks its collector not running however its run ends: finished, panicked, given up, or
/// dropped before it ran.
struct Done(std::sync::Arc<Gathering>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0
            .running
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

/// Runs every collector not already running, each as its own task, and waits for them up to
/// [`COLLECT_WAIT`] (outside a tokio runtime: in turn, to the end).
async fn collect(cs: Vec<std::sync::Arc<Gathering>>) {
    use std::sync::atomic::Ordering;
    let free: Vec<Done> = cs
        .into_iter()
        .filter(|g| !g.running.swap(true, Ordering::AcqRel))
        .map(Done)
        .collect();
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        for done in free {
            (done.0.collect)().await;
        }
        return;
    };
    let runs: Vec<_> = free
        .into_iter()
        .map(|done| {
            rt.spawn(async move {
                let _ = tokio::time::timeout(COLLECT_CAP, (done.0.collect)()).await;
                drop(done);
            })
        })
        .collect();
    let _ = tokio::time::timeout(COLLECT_WAIT, futures::future::join_all(runs)).await;
}

/// The Prometheus text page (None: metrics are off).
pub async fn render() -> Option<String> {
    let t = T.get()?;
    let prom = t.prom.as_ref()?;
    let cs: Vec<_> = t.collectors.lock().map(|v| v.clone()).unwrap_or_default();
    collect(cs).await;
    let mut page = prom.render();
    if let Ok(f) = t.floats.lock() {
        for (name, series) in f.iter() {
            page.push_str(&format!(
                "# HELP {name} {}\n# TYPE {name} counter\n",
                names::float_help(name)
            ));
            for (labels, v) in series {
                page.push_str(&format!("{name}{labels} {v}\n"));
            }
            page.push('\n');
        }
    }
    Some(page)
}

pub async fn metrics_page() -> axum::response::Response {
    use axum::response::IntoResponse;
    match render().await {
        Some(page) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            page,
        )
            .into_response(),
        None => (
            axum::http::StatusCode::NOT_FOUND,
            "metrics are off (MOELANE_METRICS=off)\n",
        )
            .into_response(),
    }
}

/// A router serving `GET /metrics`.
pub fn router() -> axum::Router {
    axum::Router::new().route("/metrics", axum::routing::get(metrics_page))
}

/// Serves `/metrics` on `addr` (the primary and the sidecar processes); returns the address.
pub async fn serve(addr: &str) -> Result<SocketAddr, String> {
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("metrics listener {addr}: {e}"))?;
    let a = l.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(l, router()).await {
            tracing::warn!("metrics server stopped: {e}");
        }
    });
    Ok(a)
}

struct MetaInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetaInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetaExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetaExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// Puts the current span's trace context into outgoing gRPC metadata.
pub fn inject(meta: &mut tonic::metadata::MetadataMap) {
    if !tracing_on() {
        return;
    }
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetaInjector(meta))
    });
}

/// Makes `span` a child of the trace context carried in incoming gRPC metadata, if any.
pub fn adopt(span: &tracing::Span, meta: &tonic::metadata::MetadataMap) {
    if !tracing_on() {
        return;
    }
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetaExtractor(meta)));
    let _ = span.set_parent(cx);
}

/// A gRPC request carrying the current trace context.
pub fn request<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    inject(r.metadata_mut());
    r
}
