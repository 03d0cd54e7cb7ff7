//! The lane as users run it: real processes, real sockets, real shared memory.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

const PROMPTS: [&str; 10] = [
    "The agent called the tool search_files",
    "Please create a new branch, apply the patch",
    "Am frühen Morgen lag dichter Nebel",
    "Die Geschichte der Stadt reicht bis ins Mittelalter",
    "朝早く、川の上には濃い霧が立ちこめていて",
    "この町の歴史は古く",
    "이른 아침 강 위에는 짙은 안개가",
    "가을 산을 걸으면 고요한 숲과",
    "fn main() { let args: Vec<String> =",
    "def load_config(path): with open(path) as f:",
];

#[test]
fn embedded_shm_and_tcp_lanes_give_bitwise_the_same_greedy_output() {
    let (_serve, embedded) = serve_tiny(&[]);
    let mut gateways = vec![("embedded".to_string(), embedded)];
    let mut procs = Vec::new();
    for link in ["shm", "tcp"] {
        let (p, gw, _) = two_process_lane(link, &[]);
        procs.push(p);
        gateways.push((link.to_string(), gw));
    }
    // the primary makes its first map from a budget (16 of 64 hot per layer, calibrated)
    // and the sidecar process takes it when the primary registers
    let (p, gw, _) = two_process_lane("tcp", &["--hot-experts", "16"]);
    procs.push(p);
    gateways.push(("tcp, --hot-experts 16".to_string(), gw));
    let mut distinct = std::collections::BTreeSet::new();
    for p in PROMPTS {
        let want = complete(&gateways[0].1, p, 32);
        assert!(!want.is_empty());
        distinct.insert(want.clone());
        for (name, addr) in &gateways[1..] {
            assert_eq!(complete(addr, p, 32), want, "{name} lane differs on {p:?}");
        }
    }
    assert_eq!(
        distinct.len(),
        PROMPTS.len(),
        "prompts should give different answers"
    );
    // the remote lanes really sent picks to the sidecar; the budget's map (16 hot) sends
    // a larger share than the checkpoint's fitted map (48 hot)
    let mut shares = Vec::new();
    for (name, addr) in &gateways[1..] {
        let (_, s) = get(addr, "/v1/stats");
        let layers = s["lanes"][0]["stats"]["layers"].as_array().unwrap();
        let sum = |k: &str| -> u64 { layers.iter().map(|l| l[k].as_u64().unwrap()).sum() };
        let (cold, hot) = (sum("cold_picks"), sum("hot_picks"));
        assert!(cold > 0, "{name}: no cold picks");
        shares.push(cold as f64 / (cold + hot) as f64);
    }
    assert!(shares[2] > 2.0 * shares[1], "cold shares {shares:?}");
}

/// A streaming request sent over a raw socket, read until its third event.
fn stream_started(addr: &str, path: &str, body: &serde_json::Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = String::new();
    while got.matches("data:").count() < 3 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    s
}

#[test]
fn a_client_that_disconnects_frees_its_kv() {
    let (_p, addr) = serve_tiny(&[]);
    let s = stream_started(
        &addr,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "stream": true}),
    );
    let (used, _) = kv_used(&addr);
    assert!(used > 0, "a running request holds KV blocks");
    drop(s); // the client goes away mid-stream
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (used, cancelled) = kv_used(&addr);
        if used == 0 && cancelled >= 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "KV still held after the client left: {used} blocks, {cancelled} cancelled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A streaming client that stops reading, its socket left open, holds its request only
/// for the stall bound (`--stream-stall-timeout`): then the gateway cuts the answer, and the
/// lane's in-flight count goes back to 0 while the connection is still there.
#[test]
fn a_client_that_stops_reading_is_cut_after_the_stall_bound() {
    let (_p, addr) = serve_tiny(&["--stream-stall-timeout", "1"]);
    // many large events (8 choices, 20 alternatives a token), far past what the sockets and
    // the gateway's channel hold
    let s = stream_started(
        &addr,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1500, "n": 8, "logprobs": true, "top_logprobs": 20,
                "temperature": 1.0, "stream": true}),
    );
    let inflight = |addr: &str| {
        let (_, v) = get(addr, "/v1/stats");
        v["lanes"][0]["inflight"].as_u64().unwrap_or(u64::MAX)
    };
    let now = inflight(&addr);
    assert!(
        (1..=8).contains(&now),
        "the stream's 8 choices are in flight: {now}"
    );
    // the client reads nothing more and keeps its socket
    let deadline = Instant::now() + Duration::from_secs(60);
    while inflight(&addr) != 0 {
        assert!(
            Instant::now() < deadline,
            "a client that stopped reading still holds its request after 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // and its connection is closed (its writes stalled past the bound): reading again, the
    // client drains what was queued and finds the end
    let mut s = s;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!("the stalled connection is still open: {e}")
            }
            Err(_) => break, // reset: closed too
        }
    }
}

#[test]
fn bad_requests_get_openai_errors_with_the_right_status() {
    let (_p, addr) = serve_tiny(&[]);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/completions",
            b"{\"model\": \"tiny\", \"prompt\": ".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "/v1/completions",
            json!({"model": "gpt-4", "prompt": "hi"})
                .to_string()
                .into_bytes(),
            404,
            "model_not_found",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi ".repeat(3000)})
                .to_string()
                .into_bytes(),
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 5000})
                .to_string()
                .into_bytes(),
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi", "n": 17})
                .to_string()
                .into_bytes(),
            400,
            "n must be an integer in 1..=16",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi", "temperature": "hot"})
                .to_string()
                .into_bytes(),
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": [1, 2, 999999]})
                .to_string()
                .into_bytes(),
            400,
            "vocabulary",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny"}).to_string().into_bytes(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user"}]})
                .to_string()
                .into_bytes(),
            400,
            "content",
        ),
        ("/v1/completions", vec![b'x'; 9 << 20], 413, "exceeds"),
        ("/v1/nothing", b"{}".to_vec(), 404, "no route"),
    ];
    for (path, body, status, needle) in cases {
        let r = request(&addr, "POST", path, &body);
        assert_eq!(r.status, status, "{path} {needle}: {}", r.body);
        let v: serde_json::Value =
            serde_json::from_str(&r.body).unwrap_or_else(|_| panic!("not JSON: {}", r.body));
        assert!(
            v["error"]["message"].is_string() && v["error"]["type"].is_string(),
            "{v}"
        );
        assert!(r.body.contains(needle), "{needle} not in {}", r.body);
    }
    // the server still serves after all that
    assert!(!complete(&addr, "hello", 4).is_empty());
}

/// The interpreter with the `openai` client: `MOELANE_PYTHON` (scripts/test.sh sets it to the
/// virtual environment it makes), else `python3`. With the variable set, a missing client fails
/// the test; without it the test skips, saying why.
fn openai_python() -> Option<String> {
    let set = std::env::var("MOELANE_PYTHON")
        .ok()
        .filter(|p| !p.is_empty());
    let python = set.clone().unwrap_or_else(|| "python3".into());
    let ok = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    match (ok, set) {
        (true, _) => Some(python),
        (false, Some(p)) => {
            panic!("MOELANE_PYTHON={p} cannot import the `openai` package (scripts/test.sh installs it)")
        }
        (false, None) => {
            eprintln!("SKIP openai_python_client: python3 with the `openai` package is not installed and MOELANE_PYTHON is not set (scripts/test.sh sets both up)");
            None
        }
    }
}

/// Runs `script` (tests/) with the Python that has the clients, against `serve` on tiny at
/// `url` (`{addr}` replaced by the gateway's host:port); the script prints ALL OK.
fn python_client(script: &str, url: &str) {
    let Some(python) = openai_python() else {
        return;
    };
    let (_p, addr) = serve_tiny(&[]);
    run_python(&python, script, &[&url.replace("{addr}", &addr)]);
}

/// Runs `script` (tests/) with `python` and `args`; it must print ALL OK.
fn run_python(python: &str, script: &str, args: &[&str]) {
    let script = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "{script} failed:\n{text}");
    assert!(text.contains("ALL OK"));
}

#[test]
fn openai_python_client() {
    python_client("openai_client.py", "http://{addr}/v1");
}

#[test]
fn anthropic_python_client() {
    python_client("anthropic_client.py", "http://{addr}");
}

/// Agent traffic with the real `openai` client on three non-Qwen families, each a random
/// checkpoint served with its family's own template (moelane_text::templates) and so its own
/// tool-call markup: GLM-4.5's `<arg_key>` pairs, DeepSeek V3's fenced calls and gpt-oss's
/// harmony messages (calls on the commentary channel). Single,
/// parallel, named and streamed forced calls validate against the tools' schemas; none and
/// auto answer; a result goes back in; DeepSeek's `thinking` opens the block, so the answer
/// is `reasoning_content`, whole and streamed; json_schema answers validate.
#[test]
fn openai_python_client_on_glm_deepseek_and_gpt_oss_templates() {
    use moelane_engine::config::Family;
    let Some(python) = openai_python() else {
        return;
    };
    for (family, think) in [
        (Family::Glm4Moe, ""),
        (Family::DeepseekV3, r#"{"thinking": true}"#),
        (Family::GptOss, ""),
    ] {
        let name = family.name();
        let template = moelane_text::templates::for_family(name).expect("a template");
        let (dir, _) = family_checkpoint(family, "agent", Some(template));
        let (_p, _purl, addr) = serve_lane(&dir, &[]);
        run_python(
            &python,
            "openai_agent_client.py",
            &[&format!("http://{addr}/v1"), name, think],
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_dead_sidecar_is_an_error_not_a_hang() {
    for link in ["shm", "tcp"] {
        let (mut procs, addr, _) = two_process_lane(link, &["--link-timeout", "5"]);
        assert!(!complete(&addr, PROMPTS[2], 8).is_empty());
        drop(procs.remove(0)); // kill the sidecar
        let t0 = Instant::now();
        let (st, v) = post(
            &addr,
            "/v1/completions",
            &json!({"model": "tiny", "prompt": PROMPTS[4], "max_tokens": 8, "temperature": 0}),
        );
        assert_eq!(st, 503, "{link}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("link"),
            "{link}: {v}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{link}: took {:?}",
            t0.elapsed()
        );
        // the lane's KV is not leaked by the failed request
        assert_eq!(kv_used(&addr).0, 0, "{link}");
        // the lane is down, and says why its relinks fail (here: nothing listens)
        until(
            Duration::from_secs(15),
            "the relink's failure named",
            || {
                let (_, v) = get(&addr, "/v1/stats");
                v["lanes"][0]["down_reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("reconnecting (last try: "))
            },
        );
    }
}

/// The residency line of `moelane status`.
fn residency_line(purl: &str) -> String {
    let out = std::process::Command::new(bin())
        .args(["status", "--primary", purl])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find(|l| l.starts_with("residency "))
        .unwrap_or_else(|| panic!("no residency line in {text}"))
        .to_string()
}

#[test]
fn toml_config_carries_residency_settings_and_flags_override_them() {
    let dir = std::env::temp_dir().join(format!("moelane-toml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("lane.toml");
    std::fs::write(
        &cfg,
        format!(
            "role = \"primary\"\nmodel = {:?}\nlisten = \"127.0.0.1:0\"\n\n[residency]\nadaptive = true\ndry-run = false\nresidency-interval-ms = 200\nmoves-per-layer = 8\n",
            tiny().display().to_string()
        ),
    )
    .unwrap();
    let c = cfg.to_str().unwrap();
    let purl = |v: &[String]| v[0].split(',').next().unwrap().to_string();
    let (_p, v) = start(&["lane", "--config", c], &["primary grpc "]);
    let line = residency_line(&purl(&v));
    assert!(line.starts_with("residency adaptive:"), "{line}");
    // a flag on the command line wins over the file
    let (_p2, v2) = start(&["lane", "--config", c, "--dry-run"], &["primary grpc "]);
    let line = residency_line(&purl(&v2));
    assert!(line.contains("adaptive (dry run)"), "{line}");
    // an unknown key is an error that names it
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "role = \"primary\"\n[residency]\nadaptve = true\n").unwrap();
    let out = std::process::Command::new(bin())
        .args(["lane", "--config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("adaptve"), "{err}");
}

#[test]
fn bad_primary_device_is_refused_by_name() {
    // a device that is not cpu or cuda:N, and (in a build without CUDA) a GPU, are refused
    // at start with the flag's value in the error; nothing is served
    let mut cases = vec![(vec!["--primary-device", "gpu0"], "gpu0")];
    if !cfg!(feature = "cuda") {
        cases.push((vec!["--primary-device", "cuda:0"], "without CUDA"));
    }
    for (args, want) in cases {
        let mut a = vec!["serve", "--model"];
        let t = tiny();
        a.push(t.to_str().unwrap());
        a.extend(args);
        a.extend(["--listen", "127.0.0.1:0"]);
        let out = std::process::Command::new(bin()).args(&a).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{a:?}: {err}");
    }
}

/// A random checkpoint of `family` in its released layout with tiny's tokenizer (deepseek_v3's
/// as a tiktoken vocabulary, as Kimi K2 ships it) and tiny's tokenizer_config.json, its chat
/// template replaced by `template` when given (and then 4096 positions); its directory (named
/// by `tag`) and dimensions.
fn family_checkpoint(
    family: moelane_engine::config::Family,
    tag: &str,
    template: Option<&str>,
) -> (std::path::PathBuf, moelane_engine::random_ckpt::Dims) {
    use moelane_engine::config::Family;
    use moelane_engine::random_ckpt::{self, Dims};
    let tiny_cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tiny().join("config.json")).unwrap()).unwrap();
    let name = family.name();
    let dir =
        std::env::temp_dir().join(format!("moelane-test-{name}-{tag}-{}", std::process::id()));
    let mut d = Dims {
        vocab: tiny_cfg["vocab_size"].as_u64().unwrap() as usize,
        ..Dims::for_family(family)
    };
    if template.is_some() {
        // agent prompts (tools declared in the family's words) are longer than 512 tokens
        d.max_pos = 4096;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let mut tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tiny().join("tokenizer_config.json")).unwrap())
            .unwrap();
    if let Some(t) = template {
        tc["chat_template"] = json!(t);
    }
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    use moelane_engine::tokenizer::{tiktoken, Tokenizer};
    if family == Family::DeepseekV3 {
        // as Kimi K2 ships it: a tiktoken vocabulary (tiny's, rewritten), no tokenizer.json
        let tok = Tokenizer::from_file(&tiny().join("tokenizer.json")).unwrap();
        tiktoken::write(&tok, &dir, &tiktoken::GPT2_PATTERN).unwrap();
    } else {
        std::fs::copy(tiny().join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    }
    // the embedding covers every id the tokenizer can give (a tiktoken vocabulary adds
    // Kimi's 256 reserved special tokens past its ranks, as Kimi K2's vocab_size counts them)
    let bound = Tokenizer::from_dir(&dir).unwrap().id_bound() as usize;
    d.vocab = d.vocab.max(bound);
    random_ckpt::write(family, &d, 3, &dir).unwrap();
    (dir, d)
}

#[test]
fn checkpoints_of_every_family_are_served_through_the_openai_api() {
    // a random checkpoint of each family in its released layout (bf16; mixtral's
    // block_sparse_moe.experts.E.w1, glm4_moe's dense first layer and sigmoid router,
    // deepseek_v3's latent attention), with
    // tiny's tokenizer and chat template (deepseek_v3's as a tiktoken vocabulary, as Kimi K2
    // ships it): served by the embedded lane, completions and chat
    // completions answer, greedy twice the same; then with --hot-experts (the first map from
    // a calibration pass, the rest of the experts on the sidecar) the same greedy answer
    use moelane_engine::config::Family;
    for family in [
        Family::Mixtral,
        Family::Qwen2Moe,
        Family::Glm4Moe,
        Family::DeepseekV3,
    ] {
        let name = family.name();
        let (dir, d) = family_checkpoint(family, "serve", None);
        let (p, _purl, addr) = serve_lane(&dir, &[]);
        let (st, models) = get(&addr, "/v1/models");
        assert_eq!(st, 200, "{name}: {models}");
        let model = models["data"][0]["id"].as_str().unwrap().to_string();
        let ask = json!({"model": model, "prompt": "The agent called", "max_tokens": 8,
                         "temperature": 0});
        let (st, a) = post(&addr, "/v1/completions", &ask);
        assert_eq!(st, 200, "{name}: {a}");
        let (_, b) = post(&addr, "/v1/completions", &ask);
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "{name}");
        let n = a["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(n <= 8, "{name}: {a}");
        assert!(a["choices"][0]["finish_reason"].is_string(), "{name}: {a}");
        let chat = json!({"model": model, "messages": [{"role": "user", "content": "Guten Morgen"}],
                          "max_tokens": 6, "temperature": 0});
        let (st, c) = post(&addr, "/v1/chat/completions", &chat);
        assert_eq!(st, 200, "{name}: {c}");
        assert_eq!(c["object"], "chat.completion", "{name}: {c}");
        drop(p);
        let hot = (d.experts / 3).to_string();
        let (_p, purl, addr) = serve_lane(&dir, &["--hot-experts", &hot]);
        let (st, h) = post(&addr, "/v1/completions", &ask);
        assert_eq!(st, 200, "{name}: {h}");
        assert_eq!(
            h["choices"][0]["text"], a["choices"][0]["text"],
            "{name}: --hot-experts {hot}"
        );
        let out = std::process::Command::new(bin())
            .args(["status", "--primary", &purl])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let cold: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("total cold share "))
            .and_then(|l| l.split('%').next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no cold share in {text}"));
        assert!(cold > 0.0, "{name}: {text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// One HTTP/1.0 exchange with the whole head given (`head_lines`: every header line, each
/// ending in CRLF, Host included or not): the status, the response head and its body.
fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    head_lines: &str,
    body: &[u8],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let head = format!(
        "{method} {path} HTTP/1.0\r\n{head_lines}Content-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    s.write_all(body).expect("write body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("end of head");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

#[test]
fn pages_of_other_sites_and_rebound_names_are_refused_unless_allowed() {
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2})
    .to_string();
    let chat = chat.as_bytes();
    // the default: an open gateway on loopback
    let (_p, addr) = serve_tiny(&[]);
    let port = addr.rsplit(':').next().expect("port");
    // a page of another site posting text/plain (no preflight in a browser): refused
    let (st, _, body) = exchange(
        &addr,
        "POST",
        "/v1/chat/completions",
        &format!("Host: {addr}\r\nOrigin: http://evil.example\r\nContent-Type: text/plain\r\n"),
        chat,
    );
    assert_eq!(st, 403, "{body}");
    assert!(
        body.contains("origin_not_allowed") && body.contains("evil.example"),
        "{body}"
    );
    // a page whose name was rebound to 127.0.0.1 posts as its own origin: refused too
    let (st, _, body) = exchange(
        &addr,
        "POST",
        "/v1/chat/completions",
        &format!("Host: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\n"),
        chat,
    );
    assert_eq!(st, 403, "{body}");
    // a local web UI's page is answered, with CORS headers
    let (st, head, body) = exchange(
        &addr,
        "POST",
        "/v1/chat/completions",
        &format!(
            "Host: {addr}\r\nOrigin: http://localhost:3000\r\nContent-Type: application/json\r\n"
        ),
        chat,
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        head.contains("access-control-allow-origin: http://localhost:3000"),
        "{head}"
    );
    // clients that are not browsers, whatever Host they send (none, too): answered
    for host in [
        format!("Host: localhost:{port}\r\n"),
        format!("Host: {addr}\r\n"),
        "Host: x\r\n".into(),
        String::new(),
    ] {
        let (st, head, body) = exchange(
            &addr,
            "POST",
            "/v1/chat/completions",
            &format!("{host}Content-Type: application/json\r\n"),
            chat,
        );
        assert_eq!(st, 200, "{host}: {body}");
        assert!(!head.contains("access-control-allow-origin"), "{head}");
    }

    // a page and a proxy's name allowed
    let (_p2, addr2) = serve_tiny(&[
        "--allowed-origin",
        "https://app.example.com/",
        "--allowed-host",
        "api.example.com",
    ]);
    let app = "Origin: https://app.example.com\r\n";
    let (st, head, body) = exchange(
        &addr2,
        "OPTIONS",
        "/v1/chat/completions",
        &format!(
            "Host: api.example.com\r\n{app}Access-Control-Request-Method: POST\r\n\
             Access-Control-Request-Headers: authorization, content-type\r\n"
        ),
        b"",
    );
    assert_eq!(st, 204, "{head} {body}");
    assert!(
        head.contains("access-control-allow-origin: https://app.example.com"),
        "{head}"
    );
    assert!(
        head.contains("access-control-allow-headers: authorization, content-type"),
        "{head}"
    );
    let (st, head, body) = exchange(
        &addr2,
        "POST",
        "/v1/chat/completions",
        &format!("Host: api.example.com\r\n{app}Content-Type: application/json\r\n"),
        chat,
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        head.contains("access-control-allow-origin: https://app.example.com"),
        "{head}"
    );
    let (st, _, body) = exchange(
        &addr2,
        "POST",
        "/v1/chat/completions",
        "Host: api.example.com\r\nOrigin: https://evil.example\r\n",
        chat,
    );
    assert_eq!(st, 403, "{body}");
    // names given: any other is refused, reads included (a rebound page's GETs)
    for path in ["/v1/models", "/metrics", "/v1/stats"] {
        let (st, _, body) = exchange(&addr2, "GET", path, "Host: evil.example\r\n", b"");
        assert_eq!(st, 403, "{path}: {body}");
        assert!(
            body.contains("host_not_allowed") && body.contains("--allowed-host"),
            "{body}"
        );
    }
    for host in ["api.example.com:443", "localhost", "127.0.0.1"] {
        let (st, _, body) = exchange(
            &addr2,
            "GET",
            "/v1/models",
            &format!("Host: {host}\r\n"),
            b"",
        );
        assert_eq!(st, 200, "{host}: {body}");
    }
    // a flag that is not an origin stops the start, naming it
    let out = std::process::Command::new(bin())
        .args([
            "serve",
            "--model",
            tiny().to_str().expect("path"),
            "--listen",
            "127.0.0.1:0",
            "--allowed-origin",
            "app.example.com",
        ])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`app.example.com` is not an origin"),
        "{err}"
    );
}
