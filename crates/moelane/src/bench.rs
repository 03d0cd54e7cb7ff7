//! `moelane bench`: engine decode throughput against the measured memory bandwidth.

use std::path::PathBuf;
use std::time::Instant;

use moelane_engine::hostmem::{last_level_cache, measure_read_bandwidth, read_probe_bytes};

use anyhow::{bail, Context, Result};
use clap::Subcommand;

use moelane_engine::load::{load_engine, EngineOptions};
use moelane_engine::sampling::argmax;
use moelane_engine::step::SeqStep;
use moelane_engine::synth;
use moelane_engine::tokenizer::Tokenizer;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Load an OpenAI-compatible server (moelane or a peer) with streaming completions:
    /// aggregate tokens/s, time to first token and inter-token latency p50/p99, per
    /// concurrency level. Greedy unless --temperature is set.
    Serve {
        /// Base URL of the API, e.g. http://127.0.0.1:8000/v1
        #[arg(long, default_value = "http://127.0.0.1:8000/v1")]
        url: String,
        /// Model name (default: the first of /v1/models).
        #[arg(long)]
        model: Option<String>,
        /// Concurrent users to measure, one run each.
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        users: Vec<usize>,
        /// Tokens per answer.
        #[arg(long, default_value_t = 400)]
        max_tokens: usize,
        /// Requests per user per run, at least (after one warm-up request per user).
        #[arg(long, default_value_t = 3)]
        requests: usize,
        /// Seconds per run, at least: each user goes on sending requests until then.
        #[arg(long, default_value = "5", value_parser = crate::loadgen::seconds)]
        duration: std::time::Duration,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// A JSON schema file: every request asks for an answer valid against it
        /// (`response_format` json_schema), to measure constrained decoding's cost.
        #[arg(long)]
        json_schema: Option<PathBuf>,
        /// Also report the lane's per-layer exchange cost from moelane's /v1/stats.
        #[arg(long, default_value_t = true)]
        lane_stats: bool,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Structured output's cost at a real vocabulary's size: a byte-level BPE of --vocab
    /// tokens is made, a JSON schema compiled against it and answers followed token by
    /// token; the trie's build, a compile, one mask (made off the step loop) and one mask
    /// applied to a row of logits (on it), p50/p90/p99.
    Grammar {
        /// Tokens in the vocabulary (Qwen3: 151,669; DeepSeek-V3: 129,280).
        #[arg(long, default_value_t = 151_669)]
        vocab: usize,
        /// A JSON schema file (default: an object of strings, an array, numbers, a boolean
        /// and an enum).
        #[arg(long)]
        schema: Option<PathBuf>,
        /// Tokens followed (a completed answer starts the next).
        #[arg(long, default_value_t = 400)]
        steps: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Follow the grammar of `tool_choice: auto` with a strict tool (the schema as its
        /// parameters, Hermes markup) instead: free text, a call begun every 32 tokens of
        /// it; masks in text and in calls reported apart.
        #[arg(long)]
        strict_tools: bool,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Round trip of one decode-sized exchange on each link kind (the floor a lane's
    /// per-layer exchange cost is compared with).
    Link {
        /// Hidden size of the activations sent (mini: 256).
        #[arg(long, default_value_t = 256)]
        hidden: usize,
        /// Picks per request (cold picks of one decode token).
        #[arg(long, default_value_t = 2)]
        picks: usize,
        #[arg(long, default_value_t = 20000)]
        iters: usize,
    },
    /// The domain-shift run: an embedded lane driven through English, German + Japanese,
    /// Korean (unseen by the starting map) and mixed traffic, with the fixed map, a map refit
    /// on the first two phases, and adaptive residency; tokens/s, cold share and wait share
    /// sampled over time; writes shift.json, shift.svg and shift.md to --out.
    Shift {
        /// Checkpoint directory (default: generate mini into the cache).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Concurrent users, one set of runs each.
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        users: Vec<usize>,
        /// Maps to compare, in order (refit needs fixed first).
        #[arg(long, value_delimiter = ',', default_value = "fixed,refit,adaptive")]
        modes: Vec<String>,
        /// Seconds of each phase: en, de+ja, ko, mix.
        #[arg(long, value_delimiter = ',', default_value = "30,30,60,30")]
        phase_s: Vec<f64>,
        /// Seconds between samples of the lane's counters.
        #[arg(long, default_value_t = 2.0)]
        sample_s: f64,
        /// Seconds at the start of each phase left out of its medians.
        #[arg(long, default_value_t = 6.0)]
        warmup_s: f64,
        /// Tokens per answer.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Adaptive residency: milliseconds between decisions.
        #[arg(long, default_value_t = 1000)]
        residency_interval_ms: u64,
        /// Adaptive residency: most experts moved to hot per layer per decision.
        #[arg(long, default_value_t = 8)]
        moves_per_layer: usize,
        /// Output directory.
        #[arg(long, default_value = "shift-out")]
        out: PathBuf,
    },
    /// What the gateway costs: N primaries in this process behind a gateway, closed-loop
    /// clients sending short greedy completions straight to the primaries (gRPC) and through
    /// the gateway (HTTP keep-alive), in alternating rounds: requests per second, p50/p99
    /// latency, and the latency the gateway adds; for each lane count.
    Gateway {
        /// Checkpoint directory (default: generate tiny into the cache: the engine's own time
        /// stays small beside the gateway's).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Lane counts to measure (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,100")]
        lanes: Vec<usize>,
        /// Concurrent clients.
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Seconds per measurement.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Tokens per request.
        #[arg(long, default_value_t = 1)]
        max_tokens: u32,
        /// Rounds (direct, then through the gateway, each round).
        #[arg(long, default_value_t = 2)]
        rounds: usize,
    },
    /// What metrics and tracing cost: three embedded lanes, two with telemetry off and one with
    /// it on (page scraped every second, every span exported over OTLP), loaded one at a time in
    /// rotating order; median tokens/s of each, the off-off difference as the noise floor.
    Telemetry {
        /// Checkpoint directory (default: generate mini into the cache).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Concurrent users.
        #[arg(long, default_value_t = 4)]
        users: usize,
        /// Alternating repetitions (the median is reported).
        #[arg(long, default_value_t = 7)]
        reps: usize,
        /// Requests per user per repetition.
        #[arg(long, default_value_t = 4)]
        requests: usize,
        /// Tokens per answer.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
    },
    /// Expert compute for many picks at once, CPU bank against GPU (`--device cuda:N`, a build
    /// with --features cuda) in one run: every expert resident, picks of distinct experts,
    /// median time per layer call, weight bytes read and the bandwidth that implies.
    Experts {
        /// Checkpoint directory (default: generate mini into the cache).
        #[arg(long)]
        model: Option<PathBuf>,
        /// cpu, or cuda:N to compare with the GPU.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Picks per call (each of a distinct expert, up to the layer's experts).
        #[arg(long, value_delimiter = ',', default_value = "6,24,96,384")]
        picks: Vec<usize>,
        /// Calls timed per size (the median is reported).
        #[arg(long, default_value_t = 50)]
        reps: usize,
    },
    /// Decode tokens/s of the GPU engine (a build with --features cuda) at several batch
    /// sizes, per placement of the cold experts: one-gpu (all experts hot on the primary's
    /// GPU), gpu+cpu (cold ones on an in-process CPU tier), gpu+cuda:N (cold ones on a second
    /// GPU in this process). Reports bytes read per token from the primary's memory against
    /// its measured read bandwidth, the cold share and the per-layer wait on the cold tier.
    Decode {
        /// `station` (built in memory, experts generated on the GPU: ~121 GB), another preset
        /// (tiny, mini), or a checkpoint directory.
        #[arg(long, default_value = "station")]
        model: String,
        /// The primary's GPU.
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// Placements to run, in order: one-gpu (every expert on the primary's GPU), gpu+cpu
        /// (cold experts on this host's CPU), gpu+cuda:N (cold experts on GPU N, this
        /// process), gpu+nccl:N (cold experts on GPU N in a sidecar process, over NCCL),
        /// gpu+ipc:N (the same through a device mailbox in CUDA IPC memory: N may be the
        /// primary's own GPU).
        #[arg(long, value_delimiter = ',', default_value = "one-gpu,gpu+cpu")]
        placements: Vec<String>,
        /// Concurrent sequences.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
        batch: Vec<usize>,
        /// Decode steps timed per repetition (after a prefill and 4 warm-up steps).
        #[arg(long, default_value_t = 32)]
        steps: usize,
        /// Repetitions per batch size (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Seed of a generated preset.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also run every size launching kernels one by one (no CUDA graphs), side by side.
        #[arg(long)]
        compare_launches: bool,
        /// Also run every size with decode attention in one block per (row, head) instead
        /// of split into position ranges, side by side.
        #[arg(long)]
        compare_split: bool,
        /// Also run every size with prefill attention one block per row instead of a tile of
        /// rows per block, side by side (with --context: the prefill rate is printed).
        #[arg(long)]
        compare_prefill: bool,
        /// Also run every size without loading weight rows into registers before the
        /// previous kernel ends (small-batch products, down-projection), side by side.
        #[arg(long)]
        compare_preload: bool,
        /// A diagnostic: also run every size with each of these step kernels launched hollow
        /// (its grid, no work: the results are wrong), one at a time, to time what each costs
        /// in the chain; names as in --profile, a name before ':' for all its uses, or "all";
        /// joined by '+' for one run, a name after '!' kept whole ("all+!moe_up").
        #[arg(long, value_delimiter = ',')]
        hollow: Vec<String>,
        /// Context length before the timed decode steps: each sequence's prompt repeated to
        /// this many tokens and prefilled (512 at a time) first; 0 = the prompt as it is.
        #[arg(long, default_value_t = 0)]
        context: usize,
        /// After each size, a per-kernel profile of one run (kernels launched one by one, a
        /// timing event after each: shows where a step's time goes, not its speed).
        #[arg(long)]
        profile: bool,
        /// Draw every token on the GPU instead of the argmax: TEMPERATURE,TOP_P,TOP_K (top_k
        /// 0: none), e.g. 0.7,0.95,20 (the sampling kernel's cost in the step).
        #[arg(long, value_delimiter = ',')]
        sample: Vec<f64>,
    },
    /// The sidecar process of `bench decode --placements gpu+nccl:N` (started by it).
    #[command(hide = true)]
    NcclSidecar {
        #[arg(long)]
        model: String,
        #[arg(long)]
        seed: u64,
        #[arg(long)]
        device: String,
        /// The communicator's id, hex.
        #[arg(long)]
        id: String,
    },
    /// The sidecar process of `bench decode --placements gpu+ipc:N` (started by it).
    #[command(hide = true)]
    IpcSidecar {
        #[arg(long)]
        model: String,
        #[arg(long)]
        seed: u64,
        #[arg(long)]
        device: String,
    },
    /// Decode tokens/s at several batch sizes on a checkpoint, bytes of weights read per
    /// token (the stored dtype's), and the implied bandwidth against this machine's read
    /// bandwidth, measured over four times its last-level cache (saying when the model fits
    /// in that cache: then the ratio is not a roofline). The CPU kernels run on the worker
    /// team: MOELANE_THREADS sets its size (default: one per physical core), MOELANE_PIN=1
    /// pins one thread per core.
    Engine {
        /// Checkpoint directory (default: generate mini into the cache).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Every expert in this process's bank (one device, as a plain engine runs), instead
        /// of the checkpoint's rowmap.json (its cold experts in a sidecar thread).
        #[arg(long)]
        all_hot: bool,
        /// Batch sizes (concurrent sequences).
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        batch: Vec<usize>,
        /// Decode steps measured per batch size (after 8 warm-up steps).
        #[arg(long, default_value_t = 64)]
        steps: usize,
        /// Repetitions; the median is reported.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Tokens of each sequence's prompt, prefilled before the measured steps (the
        /// sample prompt repeated; 0: the sample prompt as it is, 17 tokens): decode
        /// after that many positions, as llama-batched-bench's -npp.
        #[arg(long, default_value_t = 0)]
        context: usize,
        /// What the KV cache stores: f32 or bf16 (as serve's --kv-dtype).
        #[arg(long, value_enum, default_value_t = crate::KvDtypeArg::F32)]
        kv_dtype: crate::KvDtypeArg,
    },
}

/// The worker team as the bench headers print it: "4 (pinned)".
pub fn team_desc() -> String {
    let t = moelane_engine::team::team();
    format!(
        "{}{}",
        t.threads(),
        if t.pinned() { " (pinned)" } else { "" }
    )
}

/// Measures memory copy bandwidth (read + write bytes per second) on a buffer far larger than cache.
pub fn measure_bandwidth() -> f64 {
    let n = 64 << 20; // 256 MiB of f32 per side
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        let s = t.elapsed().as_secs_f64();
        best = best.max((2 * n * 4) as f64 / s);
    }
    std::hint::black_box(&dst);
    best
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `--model`, or the mini checkpoint in the cache (made once).
fn model_or_mini(model: Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(m) => Ok(m),
        None => default_model("mini"),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

pub fn default_model(preset: &str) -> Result<PathBuf> {
    let base = std::env::var_os("MOELANE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."))
                .join(".cache/moelane")
        });
    let dir = base.join(format!("{preset}-s1"));
    if !dir.join("rowmap.json").exists() {
        let p = synth::Preset::by_name(preset).context("unknown preset")?;
        eprintln!(
            "making the {preset} checkpoint in {} (once)...",
            dir.display()
        );
        synth::generate(&p, 1, &dir)?;
        // a spinner past a second on a terminal (generate draws its own bars)
        let pb = moelane_engine::progress::bar(
            1,
            "{spinner} measuring the routing of {msg} and fitting its map ({elapsed})",
            dir.display().to_string(),
        );
        moelane_engine::figures::measure(&dir, p.hot, 64)?;
        pb.finish_and_clear();
    }
    Ok(dir)
}

/// One batched greedy step: each sequence's `toks` in, its next token out.
fn greedy_step(
    eng: &mut moelane_engine::step::Engine,
    seqs: &mut [moelane_engine::kv::SeqKv],
    toks: &mut [Vec<u32>],
) -> Result<()> {
    let v = eng.cfg.vocab_size;
    let mut steps: Vec<SeqStep> = seqs
        .iter_mut()
        .zip(toks.iter())
        .map(|(s, t)| SeqStep { kv: s, tokens: t })
        .collect();
    let l = eng.step(&mut steps)?;
    for (i, t) in toks.iter_mut().enumerate() {
        *t = vec![argmax(&l[i * v..(i + 1) * v]) as u32];
    }
    Ok(())
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Serve {
            url,
            model,
            users,
            max_tokens,
            requests,
            duration,
            temperature,
            json_schema,
            lane_stats,
            json,
        } => {
            let json_schema = match json_schema {
                None => None,
                Some(p) => Some(
                    serde_json::from_str(
                        &std::fs::read_to_string(&p)
                            .with_context(|| format!("reading {}", p.display()))?,
                    )
                    .with_context(|| format!("{} is not JSON", p.display()))?,
                ),
            };
            let rt = runtime()?;
            rt.block_on(crate::loadgen::run(crate::loadgen::LoadOptions {
                url,
                model,
                users,
                max_tokens,
                requests,
                duration,
                temperature,
                json_schema,
                lane_stats,
                json,
            }))?;
        }
        BenchCmd::Shift {
            model,
            users,
            modes,
            phase_s,
            sample_s,
            warmup_s,
            max_tokens,
            residency_interval_ms,
            moves_per_layer,
            out,
        } => {
            let model = model_or_mini(model)?;
            let rt = runtime()?;
            rt.block_on(crate::shift::run(crate::shift::ShiftOptions {
                model,
                users,
                modes,
                phase_s,
                sample_s: sample_s.max(0.1),
                warmup_s: warmup_s.max(0.0),
                max_tokens: max_tokens.max(1),
                out,
                adaptive_args: vec![
                    "--residency-interval-ms".into(),
                    residency_interval_ms.to_string(),
                    "--moves-per-layer".into(),
                    moves_per_layer.to_string(),
                ],
            }))?;
        }
        BenchCmd::Gateway {
            model,
            lanes,
            clients,
            seconds,
            max_tokens,
            rounds,
        } => {
            let model = match model {
                Some(m) => m,
                None => default_model("tiny")?,
            };
            if lanes.contains(&0) || lanes.iter().any(|&n| n > 1000) {
                bail!("--lanes: each count must be in 1..=1000");
            }
            let rt = runtime()?;
            rt.block_on(crate::gateway_bench::run(
                crate::gateway_bench::GatewayBench {
                    model,
                    lanes,
                    clients: clients.clamp(1, 4096),
                    seconds: if seconds.is_finite() {
                        seconds.clamp(0.1, 3600.0)
                    } else {
                        3.0
                    },
                    max_tokens: max_tokens.clamp(1, 4096),
                    rounds: rounds.clamp(1, 100),
                },
            ))?;
        }
        BenchCmd::Telemetry {
            model,
            users,
            reps,
            requests,
            max_tokens,
        } => {
            let model = model_or_mini(model)?;
            let rt = runtime()?;
            rt.block_on(crate::telemetry_bench::run(
                model,
                users.max(1),
                reps.max(1),
                requests.max(1),
                max_tokens.max(1),
            ))?;
        }
        BenchCmd::Experts {
            model,
            device,
            picks,
            reps,
        } => {
            let model = model_or_mini(model)?;
            bench_experts(&model, &device, &picks, reps.max(1))?;
        }
        BenchCmd::Decode {
            model,
            device,
            placements,
            batch,
            steps,
            reps,
            seed,
            json,
            compare_launches,
            compare_split,
            compare_prefill,
            compare_preload,
            hollow,
            context,
            profile,
            sample,
        } => crate::decode_bench::run(crate::decode_bench::DecodeArgs {
            sample: match sample[..] {
                [] => None,
                [t, p, k] if t > 0.0 && p > 0.0 && p <= 1.0 && k >= 0.0 && k.fract() == 0.0 => {
                    Some((t as f32, p as f32, k as u32))
                }
                _ => anyhow::bail!(
                    "--sample {sample:?}: expected TEMPERATURE,TOP_P,TOP_K with a temperature \
                     above 0, top_p in (0, 1] and a whole top_k of 0 or more"
                ),
            },
            compare_launches,
            compare_split,
            compare_prefill,
            compare_preload,
            hollow,
            context,
            profile,
            model,
            device,
            placements,
            batch,
            steps: steps.max(1),
            reps,
            seed,
            json,
        })?,
        BenchCmd::NcclSidecar {
            model,
            seed,
            device,
            id,
        } => crate::decode_bench::nccl_sidecar(&model, seed, &device, &id)?,
        BenchCmd::IpcSidecar {
            model,
            seed,
            device,
        } => crate::decode_bench::ipc_sidecar(&model, seed, &device)?,
        BenchCmd::Link {
            hidden,
            picks,
            iters,
        } => crate::loadgen::link_floor(hidden, picks, iters)?,
        BenchCmd::Grammar {
            vocab,
            schema,
            steps,
            seed,
            strict_tools,
            json,
        } => crate::grammar_bench::run(vocab, schema, steps, seed, strict_tools, json)?,
        BenchCmd::Engine {
            model,
            all_hot,
            batch,
            steps,
            reps,
            context,
            kv_dtype,
        } => {
            let dir = match model {
                Some(m) => m,
                None => default_model("mini")?,
            };
            let map = if all_hot {
                let ckpt = moelane_engine::checkpoint::Checkpoint::open(&dir)?;
                let c = &ckpt.config;
                Some(moelane_engine::rowmap::Rowmap::all_hot(
                    &ckpt.id,
                    c.moe_layers().len(),
                    c.num_experts,
                ))
            } else {
                None
            };
            let mut eng = load_engine(
                &dir,
                map,
                &EngineOptions {
                    kv_tokens: 1 << 16,
                    progress: true,
                },
            )?;
            eng.set_kv_dtype(kv_dtype.dtype())?;
            let tok = Tokenizer::from_dir(&dir)?;
            let c = eng.cfg.clone();
            let bw = measure_bandwidth();
            let llc = last_level_cache();
            let read_bw = measure_read_bandwidth(llc);
            let dense_bytes = eng.dense_bytes_per_token();
            let ckpt = moelane_engine::checkpoint::Checkpoint::open(&dir)?;
            let expert_bytes = ckpt.expert_stored_bytes()?;
            let model_bytes = ckpt.tensor_bytes() as u64;
            println!(
                "model {} | {} layers, {} experts, {} picked | hidden {} | threads {} | KV {} | {}",
                dir.display(),
                c.num_hidden_layers,
                c.num_experts,
                c.num_experts_per_tok,
                c.hidden_size,
                team_desc(),
                eng.kv.dtype.name(),
                if all_hot {
                    "every expert in this process"
                } else {
                    "the checkpoint's map (cold experts in a sidecar thread)"
                }
            );
            if let Some(numa) = moelane_engine::numa::summary() {
                println!("{numa}");
            }
            println!(
                "measured: copy {:.1} GB/s (read+write), read {:.1} GB/s ({} threads over {:.0} MiB, \
                 best of 5); last-level cache {}",
                bw / 1e9,
                read_bw / 1e9,
                moelane_engine::team::team().threads(),
                read_probe_bytes(llc) as f64 / (1 << 20) as f64,
                llc.map_or("unknown".into(), |b| format!("{:.0} MiB", b as f64 / (1 << 20) as f64))
            );
            // a model that fits in the cache is read from it in a warm loop: no roofline then
            let fits = llc.is_some_and(|c| model_bytes <= c);
            println!(
                "model weights {:.1} MB as stored{}",
                model_bytes as f64 / 1e6,
                if fits {
                    ": they fit in the last-level cache, so the % of the read bandwidth below is \
                     not a roofline (a warm loop reads them from the cache)"
                } else {
                    ""
                }
            );
            println!(
                "{:>6} {:>12} {:>14} {:>16} {:>12} {:>8}",
                "batch", "tokens/s", "ms/step", "weight MB/token", "GB/s implied", "% read"
            );
            let mut prompt = tok.encode(synth::prompts(0)[0])?;
            if context > 0 && !prompt.is_empty() {
                // the sample prompt repeated to `context - 1` tokens (each sequence adds one)
                prompt = prompt
                    .iter()
                    .copied()
                    .cycle()
                    .take(context.saturating_sub(1).max(1))
                    .collect();
                println!("decode after a prompt of {context} tokens a sequence");
            }
            if context + steps + 9 > c.max_position_embeddings {
                anyhow::bail!(
                    "--context {context} plus {} steps passes the model's {} positions",
                    steps + 9,
                    c.max_position_embeddings
                );
            }
            for &b in &batch {
                let mut rates = Vec::new();
                let mut per_tok = 0f64;
                let mut step_ms = Vec::new();
                moelane_engine::predict::reset();
                for _ in 0..reps {
                    let mut seqs: Vec<_> = (0..b).map(|_| eng.kv.new_seq()).collect();
                    let mut toks: Vec<Vec<u32>> = (0..b)
                        .map(|i| {
                            let mut p = prompt.clone();
                            p.push(i as u32 % 50);
                            p
                        })
                        .collect();
                    greedy_step(&mut eng, &mut seqs, &mut toks)?; // the prompts' prefill
                    let mut loads0 = eng.counters.expert_loads;
                    let mut t0 = Instant::now();
                    for s in 0..steps + 8 {
                        if s == 8 {
                            t0 = Instant::now();
                            loads0 = eng.counters.expert_loads;
                        }
                        greedy_step(&mut eng, &mut seqs, &mut toks)?;
                    }
                    let dt = t0.elapsed().as_secs_f64();
                    rates.push((b * steps) as f64 / dt);
                    step_ms.push(dt * 1e3 / steps as f64);
                    // weights read per token: dense once per step, plus every distinct expert loaded
                    let loads = (eng.counters.expert_loads - loads0) as f64 * steps as f64
                        / (steps + 8) as f64;
                    per_tok = (dense_bytes as f64 * steps as f64 + loads * expert_bytes as f64)
                        / (b * steps) as f64;
                }
                let r = median(rates);
                let ms = median(step_ms);
                println!(
                    "{:>6} {:>12.1} {:>14.3} {:>16.2} {:>12.2} {:>7.1}%",
                    b,
                    r,
                    ms,
                    per_tok / 1e6,
                    per_tok * r / 1e9,
                    100.0 * per_tok * r / read_bw
                );
                // MOELANE_PREDICT_PICKS=1 (the prompts' prefill counted too)
                if let Some(s) = moelane_engine::predict::summary() {
                    println!("{:>6} {s}", "");
                }
            }
            println!(
                "implied GB/s = weight bytes per token (the stored dtype's: dense once per step, each \
                 distinct expert picked once per step) x tokens/s; % read = that against the measured \
                 read bandwidth"
            );
        }
    }
    Ok(())
}

/// `moelane bench experts`.
fn bench_experts(
    model: &std::path::Path,
    device: &str,
    sizes: &[usize],
    reps: usize,
) -> Result<()> {
    use moelane_engine::bank::{ExpertBank, Pick};
    use moelane_engine::rowmap::{Rowmap, Tier};
    let ckpt = moelane_engine::checkpoint::Checkpoint::open(model)?;
    let moe = ckpt.config.moe_layers();
    let (layers, experts) = (moe.len(), ckpt.config.num_experts);
    let mut m = Rowmap::all_hot(&ckpt.id, layers, experts);
    for l in &mut m.layers {
        l.cold = std::mem::take(&mut l.hot);
    }
    let vm = m.validate(&ckpt.id, layers, experts, None)?;
    let bank = ExpertBank::load(&ckpt, &vm, Tier::Cold, &moe, None)?;
    let h = bank.hidden;
    // the CPU bank keeps the stored dtype; a GPU keeps bf16 and FP8 as stored, widens others
    let cpu_bytes = ckpt.expert_stored_bytes()?;
    let dev = moelane_rtx_worker::Device::open(device, &bank).map_err(|e| anyhow::anyhow!(e))?;
    #[allow(unused_mut)]
    let mut dev_bytes = cpu_bytes;
    #[cfg(feature = "cuda")]
    if let Some(g) = dev.gpu() {
        let g = g
            .lock()
            .map_err(|_| anyhow::anyhow!("GPU state poisoned"))?;
        dev_bytes = g.bytes() / g.resident().max(1);
    }
    println!(
        "{}: {} layers x {} experts, hidden {}, expert width {}, {:.0} KiB per expert as stored, {:.0} on the device; device {}",
        model.display(),
        layers,
        experts,
        h,
        bank.inter,
        cpu_bytes as f64 / 1024.0,
        dev_bytes as f64 / 1024.0,
        dev.name()
    );
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>10} {:>14} {:>14}",
        "picks", "cpu us", "cpu GB/s", "dev us", "dev GB/s", "4 copies us", "kernel+sync us"
    );
    let mut rng = moelane_engine::rng::Rng::new(3);
    for &n in sizes {
        let n = n.clamp(1, experts);
        let rows = n.div_ceil(6).max(1);
        let acts: Vec<f32> = (0..rows * h).map(|_| rng.normal()).collect();
        let picks: Vec<Pick> = (0..n)
            .map(|i| Pick {
                row: (i % rows) as u32,
                expert: i as u16,
            })
            .collect();
        let mut out = vec![0f32; n * h];
        let mut time =
            |f: &mut dyn FnMut(&mut [f32]) -> moelane_engine::Result<()>| -> Result<f64> {
                f(&mut out)?;
                let mut t = Vec::with_capacity(reps);
                for _ in 0..reps {
                    let t0 = Instant::now();
                    f(&mut out)?;
                    t.push(t0.elapsed().as_secs_f64());
                }
                Ok(median(t))
            };
        let cpu = time(&mut |o| bank.compute(0, &picks, &acts, o))?;
        let devt = time(&mut |o| dev.compute(&bank, 0, &picks, &acts, o))?;
        let (bytes, dbytes) = ((n * cpu_bytes) as f64, (n * dev_bytes) as f64);
        // on a GPU, in the same run: the call with one copy per input, and the kernel alone
        #[allow(unused_mut)]
        let (mut separate, mut kernel) = (f64::NAN, f64::NAN);
        #[cfg(feature = "cuda")]
        if let Some(g) = dev.gpu() {
            use moelane_engine::cuda_experts::Upload;
            let lock = || g.lock().map_err(|_| anyhow::anyhow!("GPU state poisoned"));
            lock()?.upload = Upload::Separate;
            separate = time(&mut |o| dev.compute(&bank, 0, &picks, &acts, o))?;
            lock()?.upload = Upload::Packed;
            dev.compute(&bank, 0, &picks, &acts, &mut vec![0f32; n * h])?;
            kernel = time(&mut |_| {
                lock()
                    .map_err(|e| moelane_engine::Error::Gpu(e.to_string()))?
                    .relaunch()
            })?;
        }
        println!(
            "{:>6} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>14.1} {:>14.1}",
            n,
            cpu * 1e6,
            bytes / cpu / 1e9,
            devt * 1e6,
            dbytes / devt / 1e9,
            separate * 1e6,
            kernel * 1e6
        );
    }
    Ok(())
}
