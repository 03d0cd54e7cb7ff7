//! `moelane`: the one CLI binary of the project.
//!
//! Every flag has one meaning in every command that takes it, and every flag can also be set
//! from the environment (`MOELANE_<FLAG>`, e.g. `--kv-tokens` from `MOELANE_KV_TOKENS`; the
//! one-shot tools `gen` and `refit` as `MOELANE_GEN_<FLAG>` / `MOELANE_REFIT_<FLAG>`, since
//! their `--out` and `--map` mean their own files), for containers and Kubernetes; a flag on
//! the command line wins over the environment, which wins over a `lane --config` file.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use moelane_engine::figures;
use moelane_engine::synth::{self, Preset};

mod bench;
mod client;
mod decode_bench;
mod degraded;
mod gateway_bench;
mod grammar_bench;
mod loadgen;
mod ops_cmds;
mod roles;
mod rollout;
mod shift;
mod telemetry_bench;

use roles::{ColdLink, GatewayOptions, PrimaryOptions};

#[derive(Parser)]
#[command(
    name = "moelane",
    version,
    about = "Serve Mixture-of-Experts models on a lane: a primary (attention, dense weights, hot experts) and a sidecar (cold experts)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log lines on stderr as text or json (filter with MOELANE_LOG, e.g. "info,moelane=debug").
    /// Traces go to OTEL_EXPORTER_OTLP_ENDPOINT (OTLP over gRPC) when it is set.
    #[arg(
        long,
        global = true,
        default_value = "text",
        env = "MOELANE_LOG_FORMAT"
    )]
    log_format: moelane_telemetry::LogFormat,
    /// Threads of the async runtime that serves HTTP and gRPC (the step loop and the CPU
    /// kernels have their own). 0: from the machine, its cores up to 8 (at least 2).
    #[arg(
        long,
        global = true,
        default_value_t = 0,
        env = "MOELANE_RUNTIME_THREADS"
    )]
    runtime_threads: usize,
    /// A file holding the cluster token (MOELANE_CLUSTER_TOKEN may hold it instead): every
    /// gRPC call between moelane processes (gateway to primary, primary to sidecar, the CLI's
    /// status and swap) presents it, and the primary's and the sidecar's gRPC services
    /// refuse a call without it (the standard health service stays open for probes). Give
    /// every process of a deployment the same one.
    #[arg(long, global = true, env = "MOELANE_CLUSTER_TOKEN_FILE")]
    cluster_token_file: Option<PathBuf>,
    /// HTTPS for the gateway's API and admin listeners (`serve`, `lane --role gateway`): a PEM
    /// certificate chain, the leaf first. Needs --tls-key.
    #[arg(long, global = true, env = "MOELANE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key (PKCS#8, RSA or EC) of --tls-cert.
    #[arg(long, global = true, env = "MOELANE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS between moelane processes: this process's PEM certificate, presented by its
    /// gRPC clients and served by its gRPC servers (primary, sidecar). Needs
    /// --cluster-tls-key and --cluster-tls-ca; with them every gRPC URL is dialled over TLS
    /// (http:// included) and every gRPC server requires a client certificate the cluster CA
    /// signed. The sidecar's TCP data port is then TLS too (a client certificate of the
    /// cluster CA required; the primary checks the sidecar's for the host of --sidecar).
    #[arg(
        long,
        global = true,
        env = "MOELANE_CLUSTER_TLS_CERT",
        requires_all = ["cluster_tls_key", "cluster_tls_ca"]
    )]
    cluster_tls_cert: Option<PathBuf>,
    /// The PEM private key of --cluster-tls-cert.
    #[arg(
        long,
        global = true,
        env = "MOELANE_CLUSTER_TLS_KEY",
        requires = "cluster_tls_cert"
    )]
    cluster_tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): the only root a peer's certificate may chain to.
    #[arg(
        long,
        global = true,
        env = "MOELANE_CLUSTER_TLS_CA",
        requires = "cluster_tls_cert"
    )]
    cluster_tls_ca: Option<PathBuf>,
    /// The name peers' certificates must carry, instead of the host in each gRPC URL (for a
    /// cluster whose nodes share one certificate name).
    #[arg(
        long,
        global = true,
        env = "MOELANE_CLUSTER_TLS_NAME",
        requires = "cluster_tls_cert"
    )]
    cluster_tls_name: Option<String>,
}

/// The gateway's HTTPS (--tls-cert, --tls-key), set once at start.
static GATEWAY_TLS: std::sync::OnceLock<Option<moelane_gateway::listen::Tls>> =
    std::sync::OnceLock::new();

fn gateway_tls() -> Option<moelane_gateway::listen::Tls> {
    GATEWAY_TLS.get().cloned().flatten()
}

/// "https" when the gateway serves TLS, else "http".
fn gateway_scheme() -> &'static str {
    if gateway_tls().is_some() {
        "https"
    } else {
        "http"
    }
}

/// The HTTPS of the gateway's listeners, when --tls-cert and --tls-key are given.
fn http_tls(
    cert: Option<&std::path::Path>,
    key: Option<&std::path::Path>,
) -> Result<Option<moelane_gateway::listen::Tls>> {
    let (Some(cert), Some(key)) = (cert, key) else {
        return Ok(None);
    };
    let cfg = moelane_proto::tls::http_server_config(cert, key)
        .map_err(|e| anyhow::anyhow!("--tls-cert / --tls-key: {e}"))?;
    Ok(Some(moelane_gateway::listen::Tls(
        tokio_rustls::TlsAcceptor::from(cfg),
    )))
}

/// The async runtime's worker threads: `asked`, or from the machine's cores (2 to 8).
fn runtime_threads(asked: usize) -> usize {
    if asked > 0 {
        return asked;
    }
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// Where a tier computes: `cpu`, or `cuda:N`, the GPU of ordinal N (needs a build with
/// `--features cuda`; a build without it refuses `cuda:N` when parsing the flag).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    /// The default of `--max-step-tokens` on this primary device: a CPU step costs about its
    /// tokens (prefill there is compute-bound: ~0.5 ms a token on `mini` with 2 cores, so
    /// 128 bounds what a long prompt adds to the others' inter-token time to ~75 ms); a
    /// GPU's prefill of 512 tokens is milliseconds.
    fn step_tokens(self) -> usize {
        match self {
            Device::Cpu => 128,
            Device::Cuda(_) => 512,
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        match s.strip_prefix("cuda:") {
            Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                let n = n
                    .parse()
                    .map_err(|_| "GPU ordinal out of range".to_string())?;
                if cfg!(feature = "cuda") {
                    Ok(Device::Cuda(n))
                } else {
                    Err("this moelane was built without CUDA (build with --features cuda)".into())
                }
            }
            _ => Err("expected cpu or cuda:N (N: a GPU ordinal, 0, 1, ...)".into()),
        }
    }
}

impl TryFrom<String> for Device {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A memory size: bytes, or with a unit (`24GiB`, `80GB`, `512MiB`; `K`/`M`/`G`/`T` are
/// powers of 1024, `KB`/`MB`/`GB`/`TB` of 1000).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Size(u64);

/// In TOML: a string with a unit (`"80GiB"`) or a number of bytes.
impl<'de> serde::Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(0) => Err(D::Error::custom("a size must be positive")),
            Raw::Bytes(n) => Ok(Size(n)),
            Raw::Text(s) => s.parse().map_err(D::Error::custom),
        }
    }
}

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        moelane_engine::placement::parse_size(s).map(Size)
    }
}

/// The first map without a map file: how many experts are hot, and the counts that rank them.
#[derive(clap::Args, Default, Debug, Clone)]
struct PlacementArgs {
    /// Without --map: the first map puts this many experts of each MoE layer hot, the most
    /// picked by --calibration-counts or by a calibration pass over built-in prompts in five
    /// languages; the rest are cold (on the sidecar).
    #[arg(long, env = "MOELANE_HOT_EXPERTS", conflicts_with = "primary_memory")]
    hot_experts: Option<usize>,
    /// Without --map: as many hot experts as fit in this much of the primary device's memory
    /// after the dense weights, the KV cache (--kv-tokens) and the swap's spare slots, given
    /// to the most picked experts of the whole model (e.g. 24GiB, 80GB).
    #[arg(long, env = "MOELANE_PRIMARY_MEMORY", value_name = "SIZE")]
    primary_memory: Option<Size>,
    /// Pick counts that rank the experts for --hot-experts / --primary-memory (a file from
    /// `moelane status --counts-out`); default: the calibration pass.
    #[arg(long, env = "MOELANE_CALIBRATION_COUNTS", value_name = "FILE")]
    calibration_counts: Option<PathBuf>,
}

impl PlacementArgs {
    fn spec(&self) -> Option<roles::PlacementSpec> {
        let budget = match (self.hot_experts, self.primary_memory) {
            (Some(n), _) => moelane_engine::placement::Budget::HotExperts(n),
            (None, Some(Size(b))) => moelane_engine::placement::Budget::PrimaryMemory(b),
            (None, None) => return None,
        };
        Some(roles::PlacementSpec {
            budget,
            counts: self.calibration_counts.clone(),
        })
    }
}

/// The role a `lane` process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    /// The OpenAI-compatible HTTP API over one or many lanes (--lane).
    Gateway,
    /// Attention, dense weights, hot experts, KV cache, the scheduler and the residency
    /// coordinator; its sidecar in this process or at --sidecar.
    Primary,
    /// The cold experts, served to a primary over a data-plane link.
    Sidecar,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Primary => "primary",
            Role::Sidecar => "sidecar",
        }
    }
}

/// What the primary's host KV cache stores (`--kv-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum KvDtypeArg {
    /// f32, as computed.
    #[default]
    F32,
    /// bf16 (rounded to nearest even): half the memory per position and half the bytes
    /// decode attention reads. CPU primaries; not multi-head latent attention.
    Bf16,
}

impl KvDtypeArg {
    pub(crate) fn dtype(self) -> moelane_engine::kv::KvDtype {
        match self {
            KvDtypeArg::F32 => moelane_engine::kv::KvDtype::F32,
            KvDtypeArg::Bf16 => moelane_engine::kv::KvDtype::Bf16,
        }
    }
}

/// The data-plane link between a primary and its sidecar process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Link {
    /// TCP, between hosts or on one host.
    Tcp,
    /// Shared-memory rings, on one host.
    Shm,
    /// NCCL, GPU to GPU (the primary on one GPU, the sidecar on another).
    Nccl,
    /// A device mailbox in CUDA IPC memory: the primary and the sidecar on one GPU (under
    /// MPS to run side by side) or two GPUs that reach each other's memory; no host call
    /// per layer.
    Ipc,
}

impl Link {
    fn as_str(self) -> &'static str {
        match self {
            Link::Tcp => "tcp",
            Link::Shm => "shm",
            Link::Nccl => "nccl",
            Link::Ipc => "ipc",
        }
    }
}

/// `serve --device`, refused: it meant the primary's device there and the sidecar's in
/// `lane`, so it now names one thing only (`lane`'s sidecar device).
fn device_renamed(_: &str) -> std::result::Result<String, String> {
    Err(
        "serve's --device is now --primary-device (the primary's device); the sidecar's is \
         --sidecar-device"
            .into(),
    )
}

/// `--stream-stall-timeout` (default 60 s, at least 0.1 s).
fn stall_bound(v: Option<f64>) -> std::time::Duration {
    secs(v, 60.0).max(std::time::Duration::from_millis(100))
}

/// A gateway's HTTP bounds from its flags (None: the default; timeouts at least 0.1 s).
fn http_bounds(
    go: &mut GatewayOptions,
    max_connections: Option<usize>,
    header_timeout: Option<f64>,
    body_timeout: Option<f64>,
    max_client_requests: Option<usize>,
    responses_store_mb: Option<usize>,
) {
    go.max_client_requests = max_client_requests.unwrap_or(0);
    if let Some(mb) = responses_store_mb {
        go.responses_store_mb = mb;
    }
    let floor = std::time::Duration::from_millis(100);
    go.http.max_connections = max_connections.unwrap_or(4096).max(1);
    go.http.header_timeout = secs(header_timeout, 30.0).max(floor);
    go.body_timeout = secs(body_timeout, 30.0).max(floor);
}

// parsed once at start: the size of its largest variant costs nothing
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Write a synthetic qwen3_moe checkpoint (config.json, tokenizer.json,
    /// model.safetensors, rowmap.json fitted on English) and print its routing figures.
    Gen {
        /// tiny (tests: seconds to make and load) or mini (serving default: 384 experts, 6 picked, 295 hot)
        #[arg(long, default_value = "mini", value_parser = ["tiny", "mini"], env = "MOELANE_GEN_PRESET")]
        preset: String,
        /// Seed: everything written is a deterministic function of it.
        #[arg(long, default_value_t = 1, env = "MOELANE_GEN_SEED")]
        seed: u64,
        /// Output directory (created).
        #[arg(long, env = "MOELANE_GEN_OUT")]
        out: PathBuf,
        /// Length of the greedy answers used to check that generation does not collapse.
        #[arg(long, default_value_t = 400, env = "MOELANE_GEN_ANSWER_LEN")]
        answer_len: usize,
    },
    /// Serve the embedded default: gateway, primary and sidecar in one process on 127.0.0.1.
    /// Without --model, makes the `mini` synthetic checkpoint once (cached) and serves it.
    Serve {
        /// Checkpoint directory (Hugging Face: qwen3_moe, mixtral, qwen2_moe, glm4_moe,
        /// deepseek_v3 or gpt_oss).
        #[arg(long, env = "MOELANE_MODEL")]
        model: Option<PathBuf>,
        /// Rowmap JSON (default: rowmap.json in the checkpoint, else all experts hot).
        #[arg(long, env = "MOELANE_MAP")]
        map: Option<PathBuf>,
        /// Address of the OpenAI-compatible HTTP API (port 0: any free port).
        #[arg(long, env = "MOELANE_LISTEN", default_value = "127.0.0.1:8000")]
        listen: String,
        /// Model name clients use (default: the checkpoint directory's name).
        #[arg(long, env = "MOELANE_SERVED_MODEL_NAME")]
        served_model_name: Option<String>,
        /// A file of API keys, one per line (16+ characters each): the API answers 401
        /// without one. MOELANE_API_KEY may hold one key instead.
        #[arg(long, env = "MOELANE_API_KEY_FILE")]
        api_key_file: Option<PathBuf>,
        /// Where the admin endpoints listen (default 127.0.0.1:0, printed at start).
        #[arg(long, env = "MOELANE_ADMIN_LISTEN")]
        admin_listen: Option<String>,
        /// A file holding the admin token (MOELANE_ADMIN_TOKEN may hold it instead).
        #[arg(long, env = "MOELANE_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// A web page origin allowed to call the API from a browser (https://app.example.com;
        /// repeat or comma-separate; `*`: any page). Requests from other pages (a browser
        /// sends their Origin) get a 403, but pages of this host (localhost) are allowed;
        /// clients that are not browsers send none and are not affected. The allowed ones get
        /// CORS headers.
        #[arg(
            long = "allowed-origin",
            env = "MOELANE_ALLOWED_ORIGINS",
            value_delimiter = ','
        )]
        allowed_origins: Vec<String>,
        /// A host name the API answers to (repeat or comma-separate): when given, a request
        /// whose Host is neither one of these, localhost nor an IP address gets a 403 (a DNS
        /// name rebound to this host by a web page). Without it any Host is answered.
        #[arg(
            long = "allowed-host",
            env = "MOELANE_ALLOWED_HOSTS",
            value_delimiter = ','
        )]
        allowed_hosts: Vec<String>,
        /// KV cache capacity in tokens.
        #[arg(long, default_value_t = 65536, env = "MOELANE_KV_TOKENS")]
        kv_tokens: usize,
        /// What the KV cache stores: f32, or bf16 (half the memory and the bytes attention
        /// reads; a CPU primary).
        #[arg(long, value_enum, default_value_t = KvDtypeArg::F32, env = "MOELANE_KV_DTYPE")]
        kv_dtype: KvDtypeArg,
        /// Most sequences decoded together.
        #[arg(long, default_value_t = 64, env = "MOELANE_MAX_RUNNING")]
        max_running: usize,
        /// Most tokens one step feeds (default 128 on a CPU primary, 512 on a GPU one; 0: no
        /// bound): a long prompt is prefilled in chunks, so it delays the other sequences'
        /// next tokens by one chunk's step rather than its whole prefill. Larger: faster long
        /// prefills; smaller: steadier decoding beside them.
        #[arg(long, env = "MOELANE_MAX_STEP_TOKENS")]
        max_step_tokens: Option<usize>,
        /// Where the sidecar computes the cold experts: cpu or cuda:N (cuda:N needs a build
        /// with --features cuda).
        #[arg(
            long,
            default_value = "cpu",
            value_name = "cpu|cuda:N",
            env = "MOELANE_SIDECAR_DEVICE"
        )]
        sidecar_device: Device,
        /// Where the primary computes (attention, router, hot experts, KV cache): cpu or
        /// cuda:N (cuda:N needs a build with --features cuda).
        #[arg(
            long,
            default_value = "cpu",
            value_name = "cpu|cuda:N",
            env = "MOELANE_PRIMARY_DEVICE"
        )]
        primary_device: Device,
        /// Refused with the new names (was the primary's device).
        #[arg(long = "device", hide = true, value_name = "DEVICE", value_parser = device_renamed)]
        old_device: Option<String>,
        /// Seconds a stop (SIGTERM, SIGINT) waits for the requests in flight to finish before
        /// ending the rest with an error; nothing new is taken meanwhile.
        #[arg(long, default_value_t = 30.0, env = "MOELANE_GRACE")]
        grace: f64,
        /// Most HTTP connections open at once (default 4096), as `lane --role gateway`.
        #[arg(long, env = "MOELANE_MAX_CONNECTIONS")]
        max_connections: Option<usize>,
        /// Seconds a client has for a whole request head (default 30), as the gateway role.
        #[arg(long, env = "MOELANE_HEADER_TIMEOUT")]
        header_timeout: Option<f64>,
        /// Seconds a client has for a whole body once its head arrived (default 30; then 408).
        #[arg(long, env = "MOELANE_BODY_TIMEOUT")]
        body_timeout: Option<f64>,
        /// Most generations (each of a request's n choices) one client (an API key, else an
        /// address) may have in flight; past it 429 with Retry-After. Default 0: no bound
        /// (the lane still shares its batch and queue fairly among clients).
        #[arg(long, env = "MOELANE_MAX_CLIENT_REQUESTS")]
        max_client_requests: Option<usize>,
        /// MiB of responses kept for the Responses API's `previous_response_id` and
        /// GET /v1/responses/{id} (default 256; the oldest dropped past it; 0: none kept).
        #[arg(long, env = "MOELANE_RESPONSES_STORE_MB")]
        responses_store_mb: Option<usize>,
        /// Seconds a streaming client may go without reading before its answer is cut and
        /// its generation cancelled, and any connection whose writes stall that long is
        /// closed (default 60): a client that stops reading holds no slot.
        #[arg(long, env = "MOELANE_STREAM_STALL_TIMEOUT")]
        stream_stall_timeout: Option<f64>,
        #[command(flatten)]
        residency: ResidencyArgs,
        #[command(flatten)]
        placement: PlacementArgs,
    },
    /// Start one role of a lane as its own process (flags, or a TOML file with the same keys).
    Lane(Box<LaneArgs>),
    /// A lane's state: map epoch, per-layer cold share and wait share, the ceiling a perfect
    /// swapper could reach (1 / (1 - wait share)); optionally dump the raw pick counts.
    Status {
        /// The primary's gRPC URL.
        #[arg(
            long,
            default_value = "http://127.0.0.1:50051",
            env = "MOELANE_PRIMARY"
        )]
        primary: String,
        /// Write per-layer, per-expert pick counts here (input of `moelane refit`).
        #[arg(long, env = "MOELANE_COUNTS_OUT")]
        counts_out: Option<PathBuf>,
    },
    /// Upgrade the lanes behind a gateway one at a time: drain a lane, wait for its requests,
    /// run --restart (stop the old process, start the new version), wait until a new
    /// process answers healthy, send a canary generation through that lane, undrain it. A lane
    /// that does not come back or fails its canary stops the rollout (and is rolled back with
    /// --rollback).
    Rollout {
        /// The gateway's admin listener (its --admin-listen, printed at its start as
        /// "gateway admin http://...").
        #[arg(long, env = "MOELANE_GATEWAY_ADMIN")]
        admin: String,
        /// A file holding the gateway's admin token (MOELANE_ADMIN_TOKEN may hold it instead).
        #[arg(long, env = "MOELANE_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// A lane to upgrade, as the gateway names it (repeat, in order; default: every lane
        /// the gateway lists).
        #[arg(long = "lane", env = "MOELANE_LANE", value_delimiter = ',')]
        lanes: Vec<String>,
        /// Shell command that restarts one lane on the new version: `{lane}` is replaced by
        /// the lane's name, which is also in MOELANE_LANE. It may return before the lane is up.
        #[arg(long, env = "MOELANE_ROLLOUT_RESTART")]
        restart: String,
        /// Shell command that puts a lane back on the old version when it fails to come back
        /// or fails its canary.
        #[arg(long, env = "MOELANE_ROLLOUT_ROLLBACK")]
        rollback: Option<String>,
        /// Seconds to wait for a drained lane's requests to end (then the rollout stops).
        #[arg(long, default_value_t = 300.0, env = "MOELANE_ROLLOUT_DRAIN_TIMEOUT")]
        drain_timeout: f64,
        /// Seconds to wait for a restarted lane to answer healthy.
        #[arg(long, default_value_t = 300.0, env = "MOELANE_ROLLOUT_READY_TIMEOUT")]
        ready_timeout: f64,
        /// Tokens of the canary generation.
        #[arg(long, default_value_t = 1, env = "MOELANE_ROLLOUT_CANARY_TOKENS",
              value_parser = clap::value_parser!(u32).range(1..=64))]
        canary_tokens: u32,
    },
    /// Move experts between tiers on a running lane, through the two-phase epoch protocol.
    Swap {
        /// The primary's gRPC URL.
        #[arg(
            long,
            default_value = "http://127.0.0.1:50051",
            env = "MOELANE_PRIMARY"
        )]
        primary: String,
        /// A move as LAYER:EXPERT:hot|cold (repeat for one batch of moves; in the environment,
        /// comma-separated).
        #[arg(
            long = "move",
            required = true,
            env = "MOELANE_MOVE",
            value_delimiter = ','
        )]
        moves: Vec<String>,
    },
    /// Offline refit: per layer, the top --hot experts by count become hot; experts that stay
    /// hot keep their slots; ties go to the old map. Prints what moved and the cold share
    /// before and after; writes the new map (epoch + 1) atomically.
    Refit {
        /// Counts file from `moelane status --counts-out`.
        #[arg(long, env = "MOELANE_REFIT_COUNTS")]
        counts: PathBuf,
        /// The map the counts were taken under.
        #[arg(long, env = "MOELANE_REFIT_MAP")]
        map: PathBuf,
        /// Hot experts per layer in the new map.
        #[arg(long, env = "MOELANE_REFIT_HOT")]
        hot: usize,
        /// Where the new map is written.
        #[arg(long, env = "MOELANE_REFIT_OUT")]
        out: PathBuf,
    },
    /// Rowmaps: `map init` makes a checkpoint's first map from a budget.
    Map {
        #[command(subcommand)]
        what: MapCmd,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCmd,
    },
}

/// `moelane map ...`
#[derive(Subcommand)]
enum MapCmd {
    /// Write the first map of a checkpoint from a budget (--hot-experts or --primary-memory),
    /// the hot experts ranked by --calibration-counts or a calibration pass; prints the
    /// primary's memory by part and each layer's hot share of the counted picks. `refit`,
    /// `swap` and `serve --map` start from it.
    Init {
        /// Checkpoint directory.
        #[arg(long, env = "MOELANE_MODEL")]
        model: PathBuf,
        #[command(flatten)]
        placement: PlacementArgs,
        /// KV cache capacity in tokens the primary will serve with (counted in --primary-memory).
        #[arg(long, default_value_t = 65536, env = "MOELANE_KV_TOKENS")]
        kv_tokens: usize,
        /// What the primary's KV cache will store (counted in --primary-memory: bf16 is half
        /// f32's bytes; a CPU primary only, not multi-head latent attention).
        #[arg(long, value_enum, default_value_t = KvDtypeArg::F32, env = "MOELANE_KV_DTYPE")]
        kv_dtype: KvDtypeArg,
        /// Spare expert slots per layer the primary will serve with (counted in
        /// --primary-memory).
        #[arg(long, default_value_t = 8, env = "MOELANE_SPARE_SLOTS")]
        spare_slots: usize,
        /// The primary's device (cpu keeps weights in the checkpoint's dtype, cuda:N as f32).
        #[arg(
            long,
            default_value = "cpu",
            value_name = "cpu|cuda:N",
            env = "MOELANE_PRIMARY_DEVICE"
        )]
        primary_device: Device,
        /// Where the map is written (atomically).
        #[arg(long, env = "MOELANE_MAP_INIT_OUT")]
        out: PathBuf,
    },
}

/// Adaptive residency flags.
#[derive(clap::Args, serde::Deserialize, Default, Debug, Clone)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct ResidencyArgs {
    /// Move experts between tiers while serving, following the traffic (in the environment:
    /// true/false, 1/0, yes/no or on/off, as for every switch).
    #[arg(long, env = "MOELANE_ADAPTIVE", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    #[serde(default)]
    adaptive: bool,
    /// Log what adaptive residency would move, without moving.
    #[arg(long, env = "MOELANE_DRY_RUN", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    #[serde(default)]
    dry_run: bool,
    /// Milliseconds between decisions.
    #[arg(long, default_value_t = 1000, env = "MOELANE_RESIDENCY_INTERVAL_MS")]
    #[serde(default)]
    residency_interval_ms: u64,
    /// Half-life of the decayed pick rates, seconds.
    #[arg(long, default_value_t = 10.0, env = "MOELANE_HALF_LIFE_S")]
    #[serde(default)]
    half_life_s: f64,
    /// Hysteresis: a cold expert must beat a hot one by this factor.
    #[arg(long, default_value_t = 0.25, env = "MOELANE_MARGIN")]
    #[serde(default)]
    margin: f64,
    /// Skip decisions while the wait share of step time is under this fraction.
    #[arg(long, default_value_t = 0.0, env = "MOELANE_MIN_WAIT_SHARE")]
    #[serde(default)]
    min_wait_share: f64,
    /// Most experts moved to hot per layer per decision.
    #[arg(long, default_value_t = 4, env = "MOELANE_MOVES_PER_LAYER")]
    #[serde(default)]
    moves_per_layer: usize,
    /// Seconds both tiers have to PREPARE a swap (load and verify its experts) before it is
    /// aborted.
    #[arg(long, default_value_t = 30.0, env = "MOELANE_PREPARE_TIMEOUT_S")]
    #[serde(default)]
    prepare_timeout_s: f64,
    /// Spare expert slots per layer on each tier: the most experts one swap batch moves into a
    /// tier's layer (manual swaps beyond it are refused; adaptive moves are capped by it).
    #[arg(long, default_value_t = 8, env = "MOELANE_SPARE_SLOTS")]
    #[serde(default)]
    spare_slots: usize,
}

impl ResidencyArgs {
    fn prepare_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.prepare_timeout_s.clamp(0.001, 86400.0))
    }
    fn options(&self) -> Option<roles::AdaptiveOptions> {
        (self.adaptive || self.dry_run).then(|| roles::AdaptiveOptions {
            policy: moelane_residency_actor::policy::Policy {
                half_life: std::time::Duration::from_secs_f64(self.half_life_s.max(0.01)),
                margin: self.margin.max(0.0),
                min_wait_share: self.min_wait_share.clamp(0.0, 1.0),
                moves_per_layer: self.moves_per_layer.clamp(1, self.spare_slots.max(1)),
                ..Default::default()
            },
            dry_run: self.dry_run,
            interval: std::time::Duration::from_millis(self.residency_interval_ms.max(10)),
        })
    }
}

#[derive(clap::Args, serde::Deserialize, Default, Debug)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct LaneArgs {
    /// (adaptive residency flags; in TOML, a [residency] table with the same keys)
    #[command(flatten)]
    #[serde(default)]
    residency: ResidencyArgs,
    /// The role this process runs.
    #[arg(long, env = "MOELANE_ROLE")]
    role: Option<Role>,
    /// TOML file with any of these keys (role, model, map, listen, lane, sidecar, link, data, shm-dir, kv-tokens, max-running, max-step-tokens, primary-device, sidecar-device, hot-experts, primary-memory, ...; residency flags in a [residency] table); flags and environment variables override it.
    #[arg(long, env = "MOELANE_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Checkpoint directory (all roles: the gateway reads its tokenizer, template and config).
    #[arg(long, env = "MOELANE_MODEL")]
    model: Option<PathBuf>,
    /// Rowmap JSON (primary, sidecar).
    #[arg(long, env = "MOELANE_MAP")]
    map: Option<PathBuf>,
    /// Address to serve on: HTTP for the gateway (default 127.0.0.1:8000), gRPC for the primary
    /// (default 127.0.0.1:50051) and the sidecar's control API (default 127.0.0.1:50061).
    #[arg(long, env = "MOELANE_LISTEN")]
    listen: Option<String>,
    /// Gateway: a primary's gRPC URL (repeat for several lanes; in the environment,
    /// comma-separated).
    #[arg(long, env = "MOELANE_LANE", value_delimiter = ',')]
    #[serde(default)]
    lane: Vec<String>,
    /// Primary: the sidecar's control URL (none: the sidecar runs in this process).
    #[arg(long, env = "MOELANE_SIDECAR")]
    sidecar: Option<String>,
    /// Primary: data-plane link to the sidecar process (default tcp). nccl carries activations
    /// GPU to GPU: the primary on one (--primary-device cuda:N here), the sidecar on another
    /// (--sidecar-device cuda:M there); the communicator's id travels over the control channel.
    #[arg(long, env = "MOELANE_LINK")]
    link: Option<Link>,
    /// Sidecar: TCP data-plane listener address (default 127.0.0.1:0).
    #[arg(long, env = "MOELANE_DATA")]
    data: Option<String>,
    /// Sidecar: directory of shared-memory mappings (default /dev/shm).
    #[arg(long, env = "MOELANE_SHM_DIR")]
    shm_dir: Option<PathBuf>,
    /// Sidecar: bytes per shared-memory ring (default 64 MiB).
    #[arg(long, env = "MOELANE_SHM_BYTES")]
    shm_bytes: Option<u64>,
    /// Sidecar: measure the host's read bandwidth once at start (about a second, over four
    /// times the last-level cache) and publish it beside the expert bytes the sidecar reads
    /// (moelane_host_read_bandwidth_bytes_per_second, moelane_sidecar_weight_read_bytes_total).
    #[arg(long, env = "MOELANE_PROBE_BANDWIDTH")]
    #[serde(default)]
    probe_bandwidth: bool,
    /// Primary: KV cache capacity in tokens (default 65536).
    #[arg(long, env = "MOELANE_KV_TOKENS")]
    kv_tokens: Option<usize>,
    /// Primary: what the KV cache stores, f32 (default) or bf16 (half the memory and the
    /// bytes attention reads; a CPU primary).
    #[arg(long, value_enum, env = "MOELANE_KV_DTYPE")]
    kv_dtype: Option<KvDtypeArg>,
    /// Primary: most sequences decoded together (default 64).
    #[arg(long, env = "MOELANE_MAX_RUNNING")]
    max_running: Option<usize>,
    /// Primary: most tokens one step feeds (default 128 on a CPU primary, 512 on a GPU one;
    /// 0: no bound): a long prompt is prefilled in chunks, so it delays the other sequences'
    /// next tokens by one chunk's step rather than its whole prefill.
    #[arg(long, env = "MOELANE_MAX_STEP_TOKENS")]
    max_step_tokens: Option<usize>,
    /// Primary: seconds to wait for a sidecar reply before failing the step (default 30): the
    /// cap of the per-step deadline, which is sized from the round trips seen.
    #[arg(long, env = "MOELANE_LINK_TIMEOUT")]
    link_timeout: Option<f64>,
    /// Primary: seconds a sidecar may be silent (heartbeats, or a step's reply past its
    /// sized deadline) before the lane turns unready and the step fails (default 2).
    #[arg(long, env = "MOELANE_STALL_TIMEOUT")]
    stall_timeout: Option<f64>,
    /// Primary: when the sidecar is lost (killed, stalled, partitioned), compute the cold
    /// experts on this host from the checkpoint until it is back: the lane keeps serving,
    /// slower, with the same outputs, and says it is degraded (Health, /v1/stats,
    /// moelane_lane_degraded). The experts are read on demand from the mapped checkpoint
    /// (checksums verified) and held up to --degraded-memory.
    #[arg(long, env = "MOELANE_DEGRADED")]
    #[serde(default)]
    degraded: bool,
    /// Primary with --degraded: most memory the cold experts read while degraded may hold
    /// (default 4GiB); past it the least recently used are dropped and read again if picked.
    #[arg(long, env = "MOELANE_DEGRADED_MEMORY")]
    degraded_memory: Option<Size>,
    /// Primary: seconds to wait at start for the sidecar process to listen and answer the
    /// registration (default 600: it opens its port once its experts are loaded; a sidecar
    /// that refuses the registration ends the start at once).
    #[arg(long, env = "MOELANE_SIDECAR_WAIT")]
    sidecar_wait: Option<f64>,
    /// All roles: seconds a stop (SIGTERM, SIGINT) waits for the requests in flight to finish
    /// before ending the rest with an error (default 30). Nothing new is taken meanwhile.
    #[arg(long, env = "MOELANE_GRACE")]
    grace: Option<f64>,
    /// Gateway: a file of lanes, one per line (a primary's gRPC URL or dns://NAME:PORT),
    /// re-read every 5 s: lanes come and go without a restart.
    #[arg(long, env = "MOELANE_LANES_FILE")]
    lanes_file: Option<PathBuf>,
    /// Gateway: seconds between re-reads of --lanes-file and re-resolutions of dns:// lanes
    /// (default 5).
    #[arg(long, env = "MOELANE_DISCOVERY_INTERVAL")]
    discovery_interval: Option<f64>,
    /// Gateway: a Unix socket path. A gateway started with the path of a running one takes
    /// its listening socket (no connection is dropped) and the running one drains and exits.
    #[arg(long, env = "MOELANE_HANDOFF")]
    handoff: Option<PathBuf>,
    /// Gateway: most lanes one request is tried on before its first token (default 3).
    #[arg(long, env = "MOELANE_RETRY_ATTEMPTS")]
    retry_attempts: Option<usize>,
    /// Gateway: seconds after a request's arrival past which it is not tried on another lane
    /// (default 10).
    #[arg(long, env = "MOELANE_RETRY_DEADLINE")]
    retry_deadline: Option<f64>,
    /// Gateway: seconds between health checks of each lane (default 1; each waits at most as
    /// long).
    #[arg(long, env = "MOELANE_HEALTH_INTERVAL")]
    health_interval: Option<f64>,
    /// Gateway: failed requests in a row that eject a lane (default 2; 1 s, doubling per
    /// ejection, at most 30 s).
    #[arg(long, env = "MOELANE_EJECT_AFTER")]
    eject_after: Option<u32>,
    /// Gateway: a file of API keys, one per line (16+ characters each; `#` comments): the
    /// OpenAI API answers 401 without one (Authorization: Bearer KEY). MOELANE_API_KEY may
    /// hold one key instead.
    #[arg(long, env = "MOELANE_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
    /// Gateway: where the admin endpoints listen (drain, canary, stats, metrics; default
    /// 127.0.0.1:0, printed at start). Not a loopback address only with an admin token.
    #[arg(long, env = "MOELANE_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Gateway: a file holding the admin token the admin endpoints require (MOELANE_ADMIN_TOKEN
    /// may hold it instead); without one they answer anyone who reaches the admin listener.
    #[arg(long, env = "MOELANE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Gateway: a web page origin allowed to call the API from a browser
    /// (https://app.example.com; repeat or comma-separate; `*`: any page). Requests from
    /// other pages (a browser sends their Origin) get a 403, but pages of this host
    /// (localhost) are allowed; clients that are not browsers send none and are not affected.
    /// The allowed ones get CORS headers.
    #[arg(
        long = "allowed-origin",
        env = "MOELANE_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    #[serde(default)]
    allowed_origin: Vec<String>,
    /// Gateway: a host name the listeners answer to (repeat or comma-separate): when given, a
    /// request whose Host is neither one of these, localhost nor an IP address gets a 403 (a
    /// DNS name rebound to this host by a web page). Without it any Host is answered.
    #[arg(
        long = "allowed-host",
        env = "MOELANE_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    #[serde(default)]
    allowed_host: Vec<String>,
    /// Gateway: most HTTP connections open at once (default 4096); past it new ones wait in
    /// the listen backlog.
    #[arg(long, env = "MOELANE_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Gateway: seconds a client has to send a whole request head, from opening the
    /// connection or from the previous response (default 30): a slow or silent connection,
    /// kept-alive ones included, is closed past it.
    #[arg(long, env = "MOELANE_HEADER_TIMEOUT")]
    header_timeout: Option<f64>,
    /// Gateway: seconds a client has to send a request's whole body once its head arrived
    /// (default 30; 408 past it).
    #[arg(long, env = "MOELANE_BODY_TIMEOUT")]
    body_timeout: Option<f64>,
    /// Gateway: most generations (each of a request's n choices) one client (an API key,
    /// else an address) may have in flight; past it 429 with Retry-After. Default 0: no bound
    /// (the lanes still share their batch and queue fairly among clients).
    #[arg(long, env = "MOELANE_MAX_CLIENT_REQUESTS")]
    max_client_requests: Option<usize>,
    /// Gateway: MiB of responses kept for the Responses API's `previous_response_id` and GET
    /// /v1/responses/{id}, in this gateway's memory (default 256; the oldest dropped past it;
    /// 0: none kept).
    #[arg(long, env = "MOELANE_RESPONSES_STORE_MB")]
    responses_store_mb: Option<usize>,
    /// Gateway: seconds a streaming client may go without reading before its answer is cut
    /// and its generation cancelled, and a connection whose writes stall that long closed
    /// (default 60).
    #[arg(long, env = "MOELANE_STREAM_STALL_TIMEOUT")]
    stream_stall_timeout: Option<f64>,
    /// Gateway: the model name clients use.
    #[arg(long, env = "MOELANE_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Primary, sidecar: address of the Prometheus page (GET /metrics; the gateway serves it on
    /// its own listener). Default 127.0.0.1:0 (printed at start): set a fixed one to scrape.
    #[arg(long, env = "MOELANE_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Sidecar (and a primary's in-process sidecar): where the cold experts are computed, cpu
    /// or cuda:N (cuda:N needs a build with --features cuda; default cpu). Also spelled
    /// --device (`device` in TOML).
    #[arg(
        long,
        alias = "device",
        value_name = "cpu|cuda:N",
        env = "MOELANE_SIDECAR_DEVICE"
    )]
    #[serde(alias = "device")]
    sidecar_device: Option<Device>,
    /// Primary: where it computes (attention, router, hot experts, KV cache), cpu or cuda:N
    /// (cuda:N needs a build with --features cuda; default cpu).
    #[arg(long, value_name = "cpu|cuda:N", env = "MOELANE_PRIMARY_DEVICE")]
    primary_device: Option<Device>,
    /// Primary, without --map: hot experts per MoE layer of the first map (see `serve --help`).
    #[arg(long, env = "MOELANE_HOT_EXPERTS", conflicts_with = "primary_memory")]
    hot_experts: Option<usize>,
    /// Primary, without --map: the primary device's memory the first map fills (e.g. 24GiB).
    #[arg(long, env = "MOELANE_PRIMARY_MEMORY", value_name = "SIZE")]
    primary_memory: Option<Size>,
    /// Primary: pick counts ranking the experts for --hot-experts / --primary-memory.
    #[arg(long, env = "MOELANE_CALIBRATION_COUNTS", value_name = "FILE")]
    calibration_counts: Option<PathBuf>,
}

impl LaneArgs {
    /// Fills what neither a flag nor an environment variable gave from the `--config` file.
    /// `matches`: the `lane` subcommand's parsed flags, to tell the residency flags given from
    /// their defaults.
    fn merged(mut self, matches: Option<&clap::ArgMatches>) -> Result<LaneArgs> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let f: LaneArgs = toml::from_str(&text)
            .with_context(|| format!("{}: invalid lane config", path.display()))?;
        // [residency]: each key given in the file applies unless its flag was given
        let table: toml::Table = toml::from_str(&text)
            .with_context(|| format!("{}: invalid lane config", path.display()))?;
        if let Some(res) = table.get("residency").and_then(|v| v.as_table()) {
            use clap::parser::ValueSource;
            let given = |id: &str| {
                matches.is_some_and(|m| {
                    matches!(
                        m.value_source(id),
                        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                    )
                })
            };
            macro_rules! take { ($($k:ident),*) => { $(
                let key = stringify!($k).replace('_', "-");
                if res.contains_key(&key) && !given(stringify!($k)) {
                    self.residency.$k = f.residency.$k.clone();
                }
            )* } }
            take!(
                adaptive,
                dry_run,
                residency_interval_ms,
                half_life_s,
                margin,
                min_wait_share,
                moves_per_layer,
                prepare_timeout_s,
                spare_slots
            );
        }
        macro_rules! fill { ($($k:ident),*) => { $( if self.$k.is_none() { self.$k = f.$k; } )* } }
        fill!(
            primary_device,
            role,
            model,
            map,
            listen,
            sidecar,
            link,
            data,
            shm_dir,
            shm_bytes,
            kv_tokens,
            max_running,
            max_step_tokens,
            link_timeout,
            stall_timeout,
            sidecar_wait,
            degraded_memory,
            grace,
            lanes_file,
            discovery_interval,
            handoff,
            retry_attempts,
            retry_deadline,
            health_interval,
            eject_after,
            api_key_file,
            admin_listen,
            admin_token_file,
            max_connections,
            header_timeout,
            body_timeout,
            max_client_requests,
            responses_store_mb,
            stream_stall_timeout,
            served_model_name,
            metrics_listen,
            sidecar_device,
            hot_experts,
            primary_memory,
            calibration_counts
        );
        self.probe_bandwidth |= f.probe_bandwidth;
        self.degraded |= f.degraded;
        if self.lane.is_empty() {
            self.lane = f.lane;
        }
        if self.allowed_origin.is_empty() {
            self.allowed_origin = f.allowed_origin;
        }
        if self.allowed_host.is_empty() {
            self.allowed_host = f.allowed_host;
        }
        Ok(self)
    }
}

/// The gateway's secrets: API keys and admin token, from their files or environment.
fn gateway_auth(
    api_key_file: Option<&std::path::Path>,
    admin_token_file: Option<&std::path::Path>,
    allowed_origins: &[String],
    allowed_hosts: &[String],
) -> Result<moelane_gateway::server::Auth> {
    use moelane_proto::auth::Keys;
    let load = |f, env| {
        Keys::load(f, env)
            .map(|k| k.map(std::sync::Arc::new))
            .map_err(|e| anyhow::anyhow!(e))
    };
    Ok(moelane_gateway::server::Auth {
        api_keys: load(api_key_file, "MOELANE_API_KEY")?,
        admin: load(admin_token_file, "MOELANE_ADMIN_TOKEN")?,
        browsers: moelane_gateway::browser::Browsers::new(allowed_origins, allowed_hosts)
            .map_err(|e| anyhow::anyhow!(e))?,
    })
}

/// The stop signals (SIGTERM, SIGINT) received so far and the last one's name, counted by the
/// listener [`listen_for_signals`] starts.
static SIGNALS: std::sync::OnceLock<tokio::sync::watch::Receiver<(u32, &'static str)>> =
    std::sync::OnceLock::new();

/// Listens for SIGTERM and SIGINT for the rest of the process (the roles that serve call it
/// first): from then on no stop is lost, one that comes while a start still runs included,
/// and none kills the process with the signal's default.
fn listen_for_signals() {
    let (tx, rx) = tokio::sync::watch::channel((0u32, ""));
    if SIGNALS.set(rx).is_err() {
        return;
    }
    let count = move |name: &'static str| {
        tx.send_modify(|(n, s)| {
            *n += 1;
            *s = name;
        })
    };
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::spawn(async move {
                loop {
                    count(tokio::select! {
                        _ = term.recv() => "SIGTERM",
                        _ = int.recv() => "SIGINT",
                    });
                }
            });
            return;
        }
    }
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            count("SIGINT");
        }
    });
}

/// Waits for the `n`-th stop signal since [`listen_for_signals`]; returns its name.
async fn nth_signal(n: u32) -> &'static str {
    let Some(rx) = SIGNALS.get() else {
        // (not listening: only this wait sees the signal)
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    let mut rx = rx.clone();
    let name = match rx.wait_for(|(k, _)| *k >= n).await {
        Ok(v) => Some(v.1),
        Err(_) => None,
    };
    match name {
        Some(name) => name,
        // (the listener is gone: no signal will come)
        None => std::future::pending().await,
    }
}

/// Waits for SIGTERM or SIGINT (Ctrl-C); returns its name.
async fn wait_for_signal() -> &'static str {
    nth_signal(1).await
}

/// A stop (SIGTERM, SIGINT) that came before the role served anything: said, and exit 0 at
/// once (the loads still running on blocking threads are not waited for).
fn stopped_while_starting(sig: &str) -> Result<()> {
    println!("moelane: {sig} while starting: nothing was served yet; stopped");
    moelane_telemetry::shutdown();
    std::process::exit(0)
}

/// After the first signal started a drain: a second one ends the process at once (exit 130),
/// for an operator who will not wait for the grace period.
fn exit_on_second_signal() {
    tokio::spawn(async {
        let sig = nth_signal(2).await;
        eprintln!("moelane: {sig} again: exiting now, without waiting for the drain");
        moelane_telemetry::shutdown();
        std::process::exit(130);
    });
}

/// Seconds from a flag, within [0, a day].
fn secs(v: Option<f64>, default: f64) -> std::time::Duration {
    let v = v.unwrap_or(default);
    std::time::Duration::from_secs_f64(if v.is_finite() {
        v.clamp(0.0, 86400.0)
    } else {
        default
    })
}

/// Runs the command; a failure prints one line (the error and its causes, no backtrace).
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moelane: error: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each cause once (many errors already say their
/// cause in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !line.contains(&c) {
            line.push_str(": ");
            line.push_str(&c);
        }
    }
    line.replace('\n', " ")
}

fn run() -> Result<()> {
    use clap::{CommandFactory, FromArgMatches};
    // NCCL's NVLink multicast (NVLS) is never needed by the point-to-point link, and on
    // shared hosts it can take the GPUs out of service: off unless set explicitly. Set before
    // any thread starts.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let lane_matches = matches.subcommand_matches("lane").cloned();
    match moelane_proto::auth::Keys::load(
        cli.cluster_token_file.as_deref(),
        "MOELANE_CLUSTER_TOKEN",
    ) {
        Ok(k) => {
            moelane_proto::auth::set_cluster(k);
        }
        Err(e) => bail!("the cluster token: {e}"),
    }
    if let (Some(cert), Some(key), Some(ca)) = (
        cli.cluster_tls_cert.clone(),
        cli.cluster_tls_key.clone(),
        cli.cluster_tls_ca.clone(),
    ) {
        let files = moelane_proto::tls::ClusterTlsFiles {
            cert,
            key,
            ca,
            name: cli.cluster_tls_name.clone(),
        };
        let tls = moelane_proto::tls::ClusterTls::load(&files)
            .map_err(|e| anyhow::anyhow!("the cluster TLS: {e}"))?;
        moelane_proto::tls::set_cluster_tls(Some(tls));
    }
    let _ = GATEWAY_TLS.set(http_tls(cli.tls_cert.as_deref(), cli.tls_key.as_deref())?);
    if matches!(
        cli.cmd,
        Cmd::Serve { .. }
            | Cmd::Lane(_)
            | Cmd::Status { .. }
            | Cmd::Swap { .. }
            | Cmd::Rollout { .. }
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(runtime_threads(cli.runtime_threads))
            .enable_all()
            .build()?;
        let fmt = cli.log_format;
        return rt.block_on(run_async(cli.cmd, fmt, lane_matches));
    }
    match cli.cmd {
        Cmd::Gen {
            preset,
            seed,
            out,
            answer_len,
        } => {
            let Some(p) = Preset::by_name(&preset) else {
                bail!("--preset {preset:?}: unknown preset (choose tiny or mini; station is generated on the GPU by `moelane bench decode`)");
            };
            let t0 = Instant::now();
            synth::generate(&p, seed, &out)
                .with_context(|| format!("generating {} into {}", p.name, out.display()))?;
            eprintln!(
                "wrote {} checkpoint (seed {seed}) to {} in {:.1} s; measuring routing...",
                p.name,
                out.display(),
                t0.elapsed().as_secs_f64()
            );
            let t1 = Instant::now();
            let pb = moelane_engine::progress::bar(
                1,
                "{spinner} measuring the routing of {msg} ({elapsed})",
                out.display().to_string(),
            );
            let report = figures::measure(&out, p.hot, answer_len)?;
            pb.finish_and_clear();
            print!("{}", report.table());
            let rp = out.join("moelane_gen_report.json");
            std::fs::write(&rp, serde_json::to_vec_pretty(&report)?)?;
            eprintln!(
                "measured in {:.1} s; figures in {}, initial map (fitted on en) in {}",
                t1.elapsed().as_secs_f64(),
                rp.display(),
                out.join("rowmap.json").display()
            );
            for l in &report.langs {
                eprintln!("  {:<4} {}", l.lang, l.answer_preview.replace('\n', " "));
            }
        }
        Cmd::Bench { what } => bench::run(what)?,
        Cmd::Map {
            what:
                MapCmd::Init {
                    model,
                    placement,
                    kv_tokens,
                    kv_dtype,
                    spare_slots,
                    primary_device,
                    out,
                },
        } => {
            let spec = placement
                .spec()
                .context("give --hot-experts N or --primary-memory SIZE")?;
            ops_cmds::map_init(
                &model,
                &spec,
                kv_tokens,
                kv_dtype.dtype(),
                spare_slots,
                primary_device != Device::Cpu,
                &out,
            )?
        }
        Cmd::Refit {
            counts,
            map,
            hot,
            out,
        } => ops_cmds::refit(&counts, &map, hot, &out)?,
        Cmd::Serve { .. }
        | Cmd::Lane(_)
        | Cmd::Status { .. }
        | Cmd::Swap { .. }
        | Cmd::Rollout { .. } => unreachable_cmd()?,
    }
    Ok(())
}

fn unreachable_cmd() -> Result<()> {
    bail!("internal: async command dispatched synchronously")
}

async fn metrics_on(listen: Option<&str>) -> Result<()> {
    if std::env::var("MOELANE_METRICS").is_ok_and(|v| v == "off") {
        return Ok(());
    }
    let a = moelane_telemetry::serve(listen.unwrap_or("127.0.0.1:0"))
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    println!("moelane: metrics http://{a}/metrics");
    Ok(())
}

async fn run_async(
    cmd: Cmd,
    log_format: moelane_telemetry::LogFormat,
    lane_matches: Option<clap::ArgMatches>,
) -> Result<()> {
    match &cmd {
        Cmd::Serve { .. } => moelane_telemetry::init("lane", log_format),
        Cmd::Lane(a) => moelane_telemetry::init(a.role.map_or("lane", Role::as_str), log_format),
        _ => {}
    }
    if matches!(cmd, Cmd::Serve { .. } | Cmd::Lane(_)) {
        listen_for_signals();
    }
    moelane_residency_actor::failpoint::init();
    let r = run_cmd(cmd, lane_matches.as_ref()).await;
    moelane_telemetry::shutdown();
    r
}

async fn run_cmd(cmd: Cmd, lane_matches: Option<&clap::ArgMatches>) -> Result<()> {
    match cmd {
        Cmd::Serve {
            model,
            map,
            listen,
            served_model_name,
            api_key_file,
            admin_listen,
            admin_token_file,
            allowed_origins,
            allowed_hosts,
            kv_tokens,
            kv_dtype,
            max_running,
            max_step_tokens,
            sidecar_device,
            primary_device,
            old_device: _,
            grace,
            max_connections,
            header_timeout,
            body_timeout,
            max_client_requests,
            responses_store_mb,
            stream_stall_timeout,
            residency,
            placement,
        } => {
            let grace = secs(Some(grace), 30.0);
            let model = match model {
                Some(m) => m,
                None => bench::default_model("mini")?,
            };
            let opts = PrimaryOptions {
                model: model.clone(),
                map,
                placement: placement.spec(),
                kv_tokens,
                kv_dtype: kv_dtype.dtype(),
                cold: ColdLink::InProcess,
                link_timeout: std::time::Duration::from_secs(30),
                stall_timeout: std::time::Duration::from_secs(2),
                sidecar_wait: std::time::Duration::ZERO,
                degraded: false,
                degraded_memory: 0,
                adaptive: residency.options(),
                prepare_timeout: residency.prepare_timeout(),
                spare_slots: residency.spare_slots.max(1),
                sidecar_device: sidecar_device.to_string(),
                primary_device: primary_device.to_string(),
                sched: moelane_gb300_worker::scheduler::SchedulerConfig {
                    max_running,
                    step_tokens: max_step_tokens.unwrap_or(primary_device.step_tokens()),
                    ..Default::default()
                },
            };
            let primary = roles::start_primary(&opts).await?;
            let link = primary.link.clone();
            let server = roles::serve_primary(&primary, "127.0.0.1:0").await?;
            let paddr = server.addr;
            let mut go =
                GatewayOptions::new(model.clone(), vec![format!("http://{paddr}")], listen);
            go.name = served_model_name.clone();
            go.auth = gateway_auth(
                api_key_file.as_deref(),
                admin_token_file.as_deref(),
                &allowed_origins,
                &allowed_hosts,
            )?;
            go.http.tls = gateway_tls();
            http_bounds(
                &mut go,
                max_connections,
                header_timeout,
                body_timeout,
                max_client_requests,
                responses_store_mb,
            );
            go.stream_stall = stall_bound(stream_stall_timeout);
            if let Some(l) = admin_listen {
                go.admin_listen = l;
            }
            let mut gateway = roles::start_gateway(&go).await?;
            println!(
                "moelane: serving {} as model {:?}",
                model.display(),
                roles::model_name(&model, &served_model_name)
            );
            println!("moelane: primary grpc://{paddr}, sidecar {link}");
            println!(
                "moelane: gateway listening on {}://{}/v1",
                gateway_scheme(),
                gateway.addr
            );
            let sig = wait_for_signal().await;
            exit_on_second_signal();
            // stop taking connections, let the primary finish (or cut, with an error) what
            // it runs, then let the gateway send the last events
            let t0 = std::time::Instant::now();
            gateway.begin_drain();
            let (running, cut) = roles::drain_primary(&primary, grace).await;
            let (_, gw_cut) = gateway.finish(std::time::Duration::from_secs(5)).await;
            server.stop(std::time::Duration::from_secs(5)).await;
            drop(primary);
            println!(
                "moelane: {sig}: drained in {:.2} s ({running} requests in flight, {} cut at the grace period's end)",
                t0.elapsed().as_secs_f64(),
                cut + gw_cut
            );
        }
        Cmd::Lane(args) => {
            let a = (*args).merged(lane_matches)?;
            let role = a
                .role
                .context("--role is required (gateway, primary or sidecar)")?;
            let model = a.model.clone().context("--model is required")?;
            let sidecar_device = a.sidecar_device.unwrap_or(Device::Cpu).to_string();
            match role {
                Role::Sidecar => {
                    if a.hot_experts.is_some() || a.primary_memory.is_some() {
                        bail!(
                            "--hot-experts / --primary-memory belong to the primary: it makes \
                             the first map and the sidecar takes it when the primary registers"
                        );
                    }
                    let o = moelane_rtx_worker::SidecarOptions {
                        model,
                        map: a.map.clone(),
                        data: Some(a.data.clone().unwrap_or_else(|| "127.0.0.1:0".into())),
                        shm_dir: a
                            .shm_dir
                            .clone()
                            .unwrap_or_else(moelane_rtx_worker::default_shm_dir),
                        shm_cap: a.shm_bytes.unwrap_or(64 << 20),
                        device: sidecar_device,
                        probe_bandwidth: a.probe_bandwidth,
                    };
                    let sc = tokio::select! {
                        sc = roles::start_sidecar(&o, a.listen.as_deref().unwrap_or("127.0.0.1:50061")) => sc?,
                        sig = wait_for_signal() => return stopped_while_starting(sig),
                    };
                    println!("moelane: sidecar control http://{}", sc.control);
                    metrics_on(a.metrics_listen.as_deref()).await?;
                    if let Some(d) = sc.data {
                        println!("moelane: sidecar data tcp {d}");
                    }
                    let sig = wait_for_signal().await;
                    exit_on_second_signal();
                    let t0 = std::time::Instant::now();
                    // quiet: longer than the primary's heartbeat plus a gateway's health
                    // check, so what was sent before they noticed the drain is served
                    let quiet = roles::drain_sidecar(
                        &sc.core,
                        secs(a.grace, 30.0),
                        std::time::Duration::from_secs(3),
                    )
                    .await;
                    println!(
                        "moelane: {sig}: sidecar drained in {:.2} s ({})",
                        t0.elapsed().as_secs_f64(),
                        if quiet {
                            "no layer request for 3 s"
                        } else {
                            "the grace period ended while its primary still sent work"
                        }
                    );
                }
                Role::Primary => {
                    if a.hot_experts.is_some() && a.primary_memory.is_some() {
                        bail!("give hot-experts or primary-memory, not both");
                    }
                    let cold = match &a.sidecar {
                        Some(url) => ColdLink::Remote {
                            control: url.clone(),
                            link: a.link.unwrap_or(Link::Tcp).as_str().into(),
                        },
                        None => ColdLink::InProcess,
                    };
                    let opts = PrimaryOptions {
                        model,
                        map: a.map.clone(),
                        placement: PlacementArgs {
                            hot_experts: a.hot_experts,
                            primary_memory: a.primary_memory,
                            calibration_counts: a.calibration_counts.clone(),
                        }
                        .spec(),
                        kv_tokens: a.kv_tokens.unwrap_or(65536),
                        kv_dtype: a.kv_dtype.unwrap_or_default().dtype(),
                        cold,
                        link_timeout: std::time::Duration::from_secs_f64(
                            a.link_timeout.unwrap_or(30.0).max(0.001),
                        ),
                        stall_timeout: secs(a.stall_timeout, 2.0)
                            .max(std::time::Duration::from_millis(100)),
                        sidecar_wait: secs(a.sidecar_wait, 600.0),
                        degraded: a.degraded,
                        degraded_memory: a.degraded_memory.map_or(4 << 30, |Size(b)| b),
                        adaptive: a.residency.options(),
                        prepare_timeout: a.residency.prepare_timeout(),
                        spare_slots: a.residency.spare_slots.max(1),
                        sidecar_device,
                        primary_device: a.primary_device.unwrap_or(Device::Cpu).to_string(),
                        sched: moelane_gb300_worker::scheduler::SchedulerConfig {
                            max_running: a.max_running.unwrap_or(64),
                            step_tokens: a
                                .max_step_tokens
                                .unwrap_or(a.primary_device.unwrap_or(Device::Cpu).step_tokens()),
                            ..Default::default()
                        },
                    };
                    // a stop while it loads or waits for its sidecar ends it as a stop (exit
                    // 0), not as the signal's default (143)
                    let primary = tokio::select! {
                        p = roles::start_primary(&opts) => p?,
                        sig = wait_for_signal() => return stopped_while_starting(sig),
                    };
                    let link = primary.link.clone();
                    let server = roles::serve_primary(
                        &primary,
                        a.listen.as_deref().unwrap_or("127.0.0.1:50051"),
                    )
                    .await?;
                    println!(
                        "moelane: primary grpc http://{}, sidecar {link}",
                        server.addr
                    );
                    metrics_on(a.metrics_listen.as_deref()).await?;
                    let sig = wait_for_signal().await;
                    exit_on_second_signal();
                    let t0 = std::time::Instant::now();
                    let (running, cut) = roles::drain_primary(&primary, secs(a.grace, 30.0)).await;
                    server.stop(std::time::Duration::from_secs(5)).await;
                    drop(primary);
                    println!(
                        "moelane: {sig}: primary drained in {:.2} s ({running} requests in flight, {cut} cut at the grace period's end)",
                        t0.elapsed().as_secs_f64()
                    );
                }
                Role::Gateway => {
                    let mut go = GatewayOptions::new(
                        model,
                        a.lane.clone(),
                        a.listen.clone().unwrap_or_else(|| "127.0.0.1:8000".into()),
                    );
                    go.name = a.served_model_name.clone();
                    go.lanes_file = a.lanes_file.clone();
                    go.discovery_interval =
                        secs(a.discovery_interval, 5.0).max(std::time::Duration::from_millis(50));
                    go.handoff = a.handoff.clone();
                    go.max_attempts = a.retry_attempts.unwrap_or(3).max(1);
                    go.retry_deadline = secs(a.retry_deadline, 10.0);
                    go.health_interval =
                        secs(a.health_interval, 1.0).max(std::time::Duration::from_millis(50));
                    go.health_timeout = go.health_interval;
                    go.breaker.eject_after = a.eject_after.unwrap_or(2).max(1);
                    go.auth = gateway_auth(
                        a.api_key_file.as_deref(),
                        a.admin_token_file.as_deref(),
                        &a.allowed_origin,
                        &a.allowed_host,
                    )?;
                    if let Some(l) = &a.admin_listen {
                        go.admin_listen = l.clone();
                    }
                    go.http.tls = gateway_tls();
                    http_bounds(
                        &mut go,
                        a.max_connections,
                        a.header_timeout,
                        a.body_timeout,
                        a.max_client_requests,
                        a.responses_store_mb,
                    );
                    go.stream_stall = stall_bound(a.stream_stall_timeout);
                    let mut g = roles::start_gateway(&go).await?;
                    println!(
                        "moelane: gateway listening on {}://{}/v1",
                        gateway_scheme(),
                        g.addr
                    );
                    let why = tokio::select! {
                        s = wait_for_signal() => s,
                        _ = g.taken_over() => "handoff",
                    };
                    exit_on_second_signal();
                    let t0 = std::time::Instant::now();
                    let (active, cut) = g.finish(secs(a.grace, 30.0)).await;
                    println!(
                        "moelane: {why}: gateway drained in {:.2} s ({active} requests being answered, {cut} cut at the grace period's end)",
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
        }
        Cmd::Status {
            primary,
            counts_out,
        } => ops_cmds::status(&primary, counts_out.as_deref()).await?,
        Cmd::Swap { primary, moves } => ops_cmds::swap(&primary, &moves).await?,
        Cmd::Rollout {
            admin,
            admin_token_file,
            lanes,
            restart,
            rollback,
            drain_timeout,
            ready_timeout,
            canary_tokens,
        } => {
            let token =
                moelane_proto::auth::Keys::load(admin_token_file.as_deref(), "MOELANE_ADMIN_TOKEN")
                    .map_err(|e| anyhow::anyhow!(e))?
                    .map(|k| k.token().to_string());
            rollout::rollout(&rollout::RolloutOptions {
                gateway: rollout::Admin { url: admin, token },
                lanes,
                restart,
                rollback,
                drain_timeout: secs(Some(drain_timeout), 300.0),
                ready_timeout: secs(Some(ready_timeout), 300.0),
                canary_tokens,
            })
            .await?
        }
        _ => bail!("internal: synchronous command dispatched asynchronously"),
    }
    Ok(())
}

#[cfg(test)]
mod cli_tests;
