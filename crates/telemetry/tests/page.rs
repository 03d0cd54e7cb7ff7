//! The Prometheus page as a scraper sees it: after `init`, recorded series, float counters
//! and collectors all appear with their help and type lines, over HTTP on `/metrics`.
//! One test in its own binary: `init` installs the process-wide recorder.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moelane_telemetry::names as n;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_series_float_counters_and_collectors() {
    assert!(
        std::env::var("MOELANE_METRICS").map_or(true, |v| v != "off"),
        "this test needs metrics on"
    );
    moelane_telemetry::init("pagetest", moelane_telemetry::LogFormat::Text);
    metrics::counter!(n::HTTP_REQUESTS, "route" => "/v1/completions", "code" => "200").increment(3);
    moelane_telemetry::set_seconds_total(n::STEP_TIME, &[], 1.5);
    moelane_telemetry::set_seconds_total(n::SIDECAR_WAIT, &[("layer", "a\"b")], 0.25);
    let runs = Arc::new(AtomicU64::new(0));
    let r = runs.clone();
    moelane_telemetry::add_collector(Box::new(move || {
        let r = r.clone();
        Box::pin(async move {
            let k = r.fetch_add(1, Ordering::SeqCst) + 1;
            metrics::gauge!(n::LANE_INFLIGHT, "lane" => "l0").set(k as f64 * 10.0);
        })
    }));

    let page = moelane_telemetry::render().await.expect("metrics are on");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the collector runs before rendering"
    );
    for want in [
        "moelane_build_info{version=\"",
        "role=\"pagetest\"} 1",
        "# TYPE moelane_http_requests_total counter",
        "# HELP moelane_http_requests_total HTTP requests by route and status code",
        "moelane_http_requests_total{route=\"/v1/completions\",code=\"200\"} 3",
        "# TYPE moelane_step_time_seconds_total counter",
        "# HELP moelane_step_time_seconds_total Seconds spent inside engine steps",
        "moelane_step_time_seconds_total 1.5",
        // a label value's quote escaped as the text format wants
        "moelane_sidecar_wait_seconds_total{layer=\"a\\\"b\"} 0.25",
        "# TYPE moelane_lane_inflight_requests gauge",
        "moelane_lane_inflight_requests{lane=\"l0\"} 10",
    ] {
        assert!(page.contains(want), "page lacks {want:?}:\n{page}");
    }

    // the same page over HTTP, the collector run again
    let addr = moelane_telemetry::serve("127.0.0.1:0")
        .await
        .expect("serve /metrics");
    let body = tokio::time::timeout(Duration::from_secs(10), async {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.expect("read");
        raw
    })
    .await
    .expect("the page within 10 s");
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(
        body.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{body}"
    );
    assert!(
        body.contains("moelane_lane_inflight_requests{lane=\"l0\"} 20"),
        "{body}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // a collector that answers slowly (a step loop in a long step) does not hold the page:
    // it is served within the wait, the value landing for the next scrape; a second
    // scrape meanwhile starts no second run of it
    let slow_runs = Arc::new(AtomicU64::new(0));
    let s = slow_runs.clone();
    moelane_telemetry::add_collector(Box::new(move || {
        let s = s.clone();
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let k = s.fetch_add(1, Ordering::SeqCst) + 1;
            metrics::gauge!(n::LANE_INFLIGHT, "lane" => "slow").set(k as f64);
        })
    }));
    let t0 = std::time::Instant::now();
    let page = moelane_telemetry::render().await.expect("metrics are on");
    let waited = t0.elapsed();
    assert!(
        waited < Duration::from_millis(1000),
        "the page waited {waited:?} for a slow collector"
    );
    assert!(!page.contains("lane=\"slow\""), "{page}");
    moelane_telemetry::render().await.expect("metrics are on");
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(slow_runs.load(Ordering::SeqCst), 1, "one run at a time");
    let page = moelane_telemetry::render().await.expect("metrics are on");
    assert!(
        page.contains("moelane_lane_inflight_requests{lane=\"slow\"} 1"),
        "{page}"
    );
}
