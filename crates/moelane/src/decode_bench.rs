//! `moelane bench decode`: decode tokens/s of the GPU engine at several batch sizes, per
//! placement of the cold tier, with the bytes a step reads from the primary's memory against
//! the GPU's measured read bandwidth (the roofline), and the per-layer wait on the cold tier.

use std::path::PathBuf;

use anyhow::Result;

/// Options of `moelane bench decode`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct DecodeArgs {
    pub model: String,
    pub device: String,
    pub placements: Vec<String>,
    pub batch: Vec<usize>,
    pub steps: usize,
    pub reps: usize,
    pub seed: u64,
    pub json: Option<PathBuf>,
    /// also run every size with kernels launched one by one (no CUDA graphs)
    pub compare_launches: bool,
    /// also run every size with decode attention unsplit
    pub compare_split: bool,
    /// also run every size with prefill attention a block per row
    pub compare_prefill: bool,
    /// also run every size without the weight preload
    pub compare_preload: bool,
    /// also run every size with each of these kernels hollow (a diagnostic)
    pub hollow: Vec<String>,
    /// context length before the timed steps (0: the prompts as they are)
    pub context: usize,
    /// after each size, a profile: kernels launched one by one, a timing event after each
    pub profile: bool,
    /// draw every token on the GPU (temperature, top_p, top_k) instead of the argmax
    pub sample: Option<(f32, f32, u32)>,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: DecodeArgs) -> Result<()> {
    anyhow::bail!("bench decode runs the GPU engine: build with --features cuda")
}

#[cfg(feature = "cuda")]
pub fn run(a: DecodeArgs) -> Result<()> {
    use moelane_engine::cuda::Gpu;
    use moelane_engine::cuda_model;
    use moelane_engine::cuda_station::{self, Placement};
    use moelane_engine::sampling::TokenPick;
    use moelane_engine::step::{Engine, SeqStep};
    use serde_json::json;
    use std::time::Instant;

    let ordinal = a
        .device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse::<usize>().ok())
        .ok_or_else(|| anyhow::anyhow!("--device {:?}: expected cuda:N", a.device))?;
    let gpu = Gpu::open(ordinal)?;
    // gpu+nccl:N / gpu+ipc:N: the cold tier in a sidecar process on cuda:N, over NCCL or
    // the device mailbox
    let placements: Vec<(Placement, Option<(&'static str, usize)>)> = a
        .placements
        .iter()
        .map(|p| {
            for link in ["nccl", "ipc"] {
                if let Some(n) = p.strip_prefix(&format!("gpu+{link}:")) {
                    return n
                        .parse::<usize>()
                        .map(|n| (Placement::Remote, Some((link, n))))
                        .map_err(|_| anyhow::anyhow!("placement {p:?}: expected gpu+{link}:N"));
                }
            }
            Ok((Placement::parse(p)?, None))
        })
        .collect::<Result<_>>()?;
    let (copy_bw, read_bw) = cuda_model::bandwidth(&gpu, 4 << 30, 9)?;
    println!(
        "device cuda:{ordinal} {} sm_{}{} | measured: copy {:.0} GB/s (read+write), read {:.0} GB/s",
        gpu.name,
        gpu.cc.0,
        gpu.cc.1,
        copy_bw / 1e9,
        read_bw / 1e9
    );
    let max_b = a.batch.iter().copied().max().unwrap_or(1);
    // the model: station generated in memory and on the GPU, or a checkpoint directory
    let station = match moelane_engine::synth::Preset::by_name(&a.model) {
        Some(p) => {
            let t0 = Instant::now();
            let m = moelane_engine::synth::in_memory(&p, a.seed)?;
            println!(
                "model {} (seed {}): dense part built in memory in {:.1} s",
                a.model,
                a.seed,
                t0.elapsed().as_secs_f64()
            );
            Some(m)
        }
        None => None,
    };
    let prompts: Vec<Vec<u32>> = match &station {
        Some(m) => m.prompt_ids()?,
        None => {
            let tok = moelane_engine::tokenizer::Tokenizer::from_dir(&PathBuf::from(&a.model))?;
            (0..moelane_engine::synth::LANGS.len())
                .flat_map(moelane_engine::synth::prompts)
                .map(|t| tok.encode(t))
                .collect::<std::result::Result<_, _>>()?
        }
    };
    if prompts.is_empty() {
        anyhow::bail!("no prompts");
    }
    let longest = prompts
        .iter()
        .map(Vec::len)
        .max()
        .unwrap_or(1)
        .max(a.context);
    let kv_tokens = max_b * (longest + a.steps + 16 + 16);
    let mut results = Vec::new();
    println!(
        "{:>13} {:>6} {:>10} {:>9} {:>11} {:>10} {:>9} {:>8} {:>9} {:>13}",
        "placement",
        "batch",
        "tok/s",
        "ms/step",
        "MB/token",
        "GB/s read",
        "% of read",
        "cold %",
        "wait us",
        "wait us/layer"
    );
    for (pl, nccl) in &placements {
        let t0 = Instant::now();
        let mut sidecar = None;
        let mut eng: Engine = match (&station, nccl) {
            (Some(m), Some(("nccl", n))) => {
                let (eng, child) = nccl_engine(m, &a, *n, ordinal, gpu.clone(), kv_tokens)?;
                sidecar = Some(child);
                eng
            }
            (Some(m), Some((_, n))) => {
                let rows = max_b * longest.min(PREFILL_CHUNK);
                let (eng, child) = ipc_engine(m, &a, *n, rows, gpu.clone(), kv_tokens)?;
                sidecar = Some(child);
                eng
            }
            (None, Some((link, _))) => anyhow::bail!(
                "gpu+{link}:N generates its experts: it takes a preset (station), not a checkpoint"
            ),
            (Some(m), None) => cuda_station::hashed_engine(m, *pl, gpu.clone(), kv_tokens)?,
            (None, None) => {
                let dir = PathBuf::from(&a.model);
                let ckpt = moelane_engine::checkpoint::Checkpoint::open(&dir)?;
                let c = &ckpt.config;
                let (layers, ne) = (c.moe_layers().len(), c.num_experts);
                let map = match pl {
                    Placement::OneGpu => moelane_engine::rowmap::Rowmap::all_hot(&ckpt.id, layers, ne)
                        .validate(&ckpt.id, layers, ne, None)?,
                    Placement::GpuCpu => moelane_engine::load::resolve_map(&ckpt, None)?,
                    Placement::GpuGpu(_) | Placement::Remote => anyhow::bail!(
                        "gpu+cuda:N generates its experts: it takes a preset (station), not a checkpoint"
                    ),
                };
                let opts = moelane_engine::load::EngineOptions {
                    kv_tokens,
                    progress: false,
                };
                cuda_station::load_on_gpu(&ckpt, map, &opts, gpu.clone())?
            }
        };
        let name = match nccl {
            Some((link, n)) => format!("gpu+{link}:{n}"),
            None => pl.name(),
        };
        let c = eng.cfg.clone();
        let dense_bytes = eng.dense_bytes_per_token() as f64;
        let moe_layers = c.moe_layers().len();
        let resident = eng.gpu_mut().map(|g| g.expert_bytes()).unwrap_or(0);
        // the bytes a hot expert's load reads: its weights in the dtype the GPU keeps
        let expert_bytes = match eng.gpu_mut().map(|g| g.bytes_per_expert()) {
            Some(b) if b > 0 => b as f64,
            _ => (3 * c.hidden_size * c.moe_intermediate_size * 4) as f64,
        };
        println!(
            "-- {}: built in {:.1} s, {:.1} GB of experts on {}",
            name,
            t0.elapsed().as_secs_f64(),
            resident as f64 / 1e9,
            a.device
        );
        let draws = std::cell::Cell::new(a.seed);
        let step = |eng: &mut Engine,
                    seqs: &mut Vec<moelane_engine::kv::SeqKv>,
                    next: &mut Vec<Vec<u32>>|
         -> Result<()> {
            let mut st: Vec<SeqStep> = seqs
                .iter_mut()
                .zip(next.iter())
                .map(|(kv, t)| SeqStep { kv, tokens: t })
                .collect();
            let ids = match a.sample {
                None => eng.step_argmax(&mut st)?,
                Some((temperature, top_p, top_k)) => {
                    // a fixed sequence of uniform numbers (a Weyl sequence): the draws vary
                    // from step to step, the same in every run
                    let picks: Vec<TokenPick> = (0..st.len())
                        .map(|_| {
                            let n = draws.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
                            draws.set(n);
                            TokenPick::Sample {
                                temperature,
                                top_p,
                                top_k,
                                u: (n >> 11) as f64 / (1u64 << 53) as f64,
                            }
                        })
                        .collect();
                    eng.step_pick(&mut st, &picks)?
                }
            };
            for (n, t) in next.iter_mut().zip(ids) {
                *n = vec![t];
            }
            Ok(())
        };
        let mut modes = vec![Mode::default()];
        let one = |suffix: &'static str, f: fn(&mut Mode)| {
            let mut m = Mode {
                suffix: suffix.to_string(),
                ..Mode::default()
            };
            f(&mut m);
            m
        };
        if a.compare_launches {
            modes.push(one(" -g", |m| m.graphs = false));
        }
        if a.compare_split {
            modes.push(one(" -1", |m| m.split = false));
        }
        if a.compare_prefill {
            modes.push(one(" -t", |m| m.tiled = false));
        }
        if a.compare_preload {
            modes.push(one(" -p", |m| m.preload = false));
        }
        for h in &a.hollow {
            modes.push(Mode {
                suffix: format!(" -h {h}"),
                hollow: cuda_model::hollow_list(h),
                ..Mode::default()
            });
        }
        for (&b, mode) in a
            .batch
            .iter()
            .flat_map(|b| modes.iter().map(move |m| (b, m)))
        {
            if let Some(g) = eng.gpu_mut() {
                g.graphs = mode.graphs;
                g.set_split_attention(mode.split);
                g.set_tiled_prefill(mode.tiled);
                g.set_preload(mode.preload);
                g.set_hollow(mode.hollow.clone());
            }
            let label = format!("{name}{}", mode.suffix);
            let mut reps = Vec::new();
            // the next-layer guesses' hits (MOELANE_CUDA_GUESS=1): the last step of each rep
            let mut guessed = (0usize, 0usize);
            for _ in 0..a.reps.max(1) {
                let mut seqs: Vec<_> = (0..b).map(|_| eng.kv.new_seq()).collect();
                let mut next: Vec<Vec<u32>> = (0..b)
                    .map(|i| context_prompt(&prompts[i % prompts.len()], a.context))
                    .collect();
                let prompt_tokens: usize = next.iter().map(Vec::len).sum();
                let tp = Instant::now();
                if a.context > PREFILL_CHUNK {
                    // long prompts prefilled alone, a chunk at a time (bounded scratch); the
                    // last chunk goes with the batch's first step
                    for (kv, t) in seqs.iter_mut().zip(next.iter_mut()) {
                        while t.len() > PREFILL_CHUNK {
                            let rest = t.split_off(PREFILL_CHUNK);
                            eng.step_argmax(&mut [SeqStep { kv, tokens: t }])?;
                            *t = rest;
                        }
                    }
                }
                step(&mut eng, &mut seqs, &mut next)?; // prefill
                let prefill_tps = prompt_tokens as f64 / tp.elapsed().as_secs_f64();
                for _ in 0..4 {
                    step(&mut eng, &mut seqs, &mut next)?; // warm-up decode
                }
                let c0 = eng.counters.clone();
                let ctx0: usize = seqs.iter().map(|s| s.len).sum();
                let t0 = Instant::now();
                for _ in 0..a.steps {
                    step(&mut eng, &mut seqs, &mut next)?;
                }
                let dt = t0.elapsed().as_secs_f64();
                if let Some(g) = eng.gpu_mut().filter(|g| b == 1 && g.guesses()) {
                    let (hits, of) = g.guess_hits()?;
                    guessed = (guessed.0 + hits, guessed.1 + of);
                }
                let c1 = &eng.counters;
                let steps = a.steps as f64;
                let hot_loads = (c1.hot_expert_loads - c0.hot_expert_loads) as f64;
                // the cache of every position each row attends to, every layer (K and V, or
                // MLA's latent; a sliding window is not subtracted)
                let ctx1: usize = seqs.iter().map(|s| s.len).sum();
                let (kd, vd) = c.cache_dims();
                let kv_bytes = (ctx0 + ctx1) as f64 / 2.0
                    * steps
                    * ((kd + vd) * 4 * c.num_hidden_layers) as f64;
                let bytes = dense_bytes * steps + hot_loads * expert_bytes + kv_bytes;
                let cold: u64 =
                    c1.cold_picks.iter().sum::<u64>() - c0.cold_picks.iter().sum::<u64>();
                let hot: u64 = c1.hot_picks.iter().sum::<u64>() - c0.hot_picks.iter().sum::<u64>();
                let wait: u64 = c1.wait_ns.iter().sum::<u64>() - c0.wait_ns.iter().sum::<u64>();
                reps.push((
                    (b as f64 * steps) / dt,
                    dt / steps,
                    bytes / steps,
                    cold as f64 / (cold + hot).max(1) as f64,
                    wait as f64 / steps / 1e3,
                    prefill_tps,
                ));
            }
            let mut pre: Vec<f64> = reps.iter().map(|r| r.5).collect();
            pre.sort_by(f64::total_cmp);
            let prefill_tps = pre[pre.len() / 2];
            reps.sort_by(|x, y| x.0.total_cmp(&y.0));
            let (tps, step_s, step_bytes, cold, wait_us, _) = reps[reps.len() / 2];
            let gbs = step_bytes / step_s;
            println!(
                "{:>13} {:>6} {:>10.1} {:>9.3} {:>11.1} {:>10.0} {:>8.1}% {:>7.2}% {:>9.1} {:>13.2}",
                label,
                b,
                tps,
                step_s * 1e3,
                step_bytes / b as f64 / 1e6,
                gbs / 1e9,
                100.0 * gbs / read_bw,
                100.0 * cold,
                wait_us,
                wait_us / moe_layers as f64
            );
            if a.context > 0 {
                println!("{label:>13} {b:>6} prefill {prefill_tps:.0} tok/s (median)");
            }
            if guessed.1 > 0 {
                println!(
                    "{label:>13} {b:>6} next-layer guesses named {} of {} picks ({:.1}%)",
                    guessed.0,
                    guessed.1,
                    100.0 * guessed.0 as f64 / guessed.1 as f64
                );
            }
            if a.profile && mode.suffix.is_empty() {
                if let Some(g) = eng.gpu_mut() {
                    g.set_profile(true);
                }
                let mut seqs: Vec<_> = (0..b).map(|_| eng.kv.new_seq()).collect();
                let mut next: Vec<Vec<u32>> =
                    (0..b).map(|i| prompts[i % prompts.len()].clone()).collect();
                step(&mut eng, &mut seqs, &mut next)?;
                if let Some(g) = eng.gpu_mut() {
                    g.set_profile(true); // drop the prefill's share
                }
                for _ in 0..a.steps {
                    step(&mut eng, &mut seqs, &mut next)?;
                }
                let prof = eng
                    .gpu_mut()
                    .map(|g| g.set_profile(false))
                    .unwrap_or_default();
                let total: u64 = prof.iter().map(|p| p.1).sum();
                let line: Vec<String> = prof
                    .iter()
                    .map(|(k, ns, n)| {
                        format!(
                            "{k} {:.1} us ({:.0}%, {:.1} us x {})",
                            *ns as f64 / a.steps as f64 / 1e3,
                            100.0 * *ns as f64 / total.max(1) as f64,
                            *ns as f64 / (*n).max(1) as f64 / 1e3,
                            n / a.steps as u64
                        )
                    })
                    .collect();
                println!(
                    "  profile (kernels launched one by one, GPU-timed; {:.3} ms/step): {}",
                    total as f64 / a.steps as f64 / 1e6,
                    line.join(", ")
                );
            }
            results.push(json!({
                "placement": name, "graphs": mode.graphs, "split_attention": mode.split,
                "tiled_prefill": mode.tiled, "preload": mode.preload,
                "hollow": mode.hollow, "prefill_tokens_per_s": prefill_tps, "batch": b,
                "context": a.context, "tokens_per_s": tps,
                "ms_per_step": step_s * 1e3, "bytes_per_step": step_bytes,
                "bytes_per_token": step_bytes / b as f64, "read_gbs": gbs / 1e9,
                "fraction_of_read_bw": gbs / read_bw, "cold_share": cold,
                "wait_us_per_step": wait_us, "wait_us_per_layer": wait_us / moe_layers as f64,
            }));
        }
        if let Some(g) = eng.gpu_mut() {
            match g.persist_status() {
                Ok(()) => {
                    println!(
                        "-- {name}: the persistent one-row step ran {} times ({} blocks)",
                        g.persist_runs(),
                        g.persist_grid()
                    );
                    // its phases' cycles where the kernels were built with ONE_TRACE
                    let t = g.persist_trace().unwrap_or_else(|e| {
                        eprintln!("moelane: the persistent step's trace was not read: {e}");
                        Default::default()
                    });
                    if t.iter().any(|p| p.1 > 0) {
                        let names = ["qkv", "attention", "merge", "o", "router", "up", "down"];
                        let parts: Vec<String> = names
                            .iter()
                            .zip(t.iter())
                            .map(|(n, (c, k))| format!("{n} {c:.0} cycles x{k}"))
                            .collect();
                        println!("-- {name}: phases (block 0): {}", parts.join(", "));
                    }
                }
                Err(why) => println!("-- {name}: the persistent one-row step is off: {why}"),
            }
        }
        drop(eng); // aborts an NCCL link: the sidecar process then exits
        if let Some(mut child) = sidecar {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    println!(
        "bytes = dense weights once per step + each distinct hot expert once per step + the K/V \
         read; the cold tier's reads are not counted (another device); tok/s medians of {} reps of {} steps; \
         \"-g\": kernels launched one by one instead of replaying CUDA graphs; \"-1\": decode \
         attention unsplit (one block per row and head); \"-t\": prefill attention a block per \
         row instead of a tile of rows; \"-p\": weights not loaded before the previous kernel \
         ends; \"-h K\": kernel K launched hollow (no work: a diagnostic)",
        a.reps.max(1),
        a.steps
    );
    if let Some(p) = a.json {
        let doc = json!({
            "device": gpu.name, "model": a.model, "seed": a.seed,
            "copy_gbs": copy_bw / 1e9, "read_gbs": read_bw / 1e9, "results": results,
        });
        std::fs::write(&p, serde_json::to_vec_pretty(&doc)?)?;
    }
    Ok(())
}

/// One side-by-side variant of the step: the engine's switches and the row label's suffix.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Debug)]
struct Mode {
    suffix: String,
    graphs: bool,
    split: bool,
    tiled: bool,
    preload: bool,
    hollow: Vec<String>,
}

impl Default for Mode {
    fn default() -> Self {
        Mode {
            suffix: String::new(),
            graphs: true,
            split: true,
            tiled: true,
            preload: true,
            hollow: Vec::new(),
        }
    }
}

/// Tokens per prefill step of a long `--context` prompt.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const PREFILL_CHUNK: usize = 512;

/// `prompt` repeated (cut) to `len` tokens; the prompt itself when `len` is 0 or shorter.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn context_prompt(prompt: &[u32], len: usize) -> Vec<u32> {
    if len <= prompt.len() || prompt.is_empty() {
        return prompt.to_vec();
    }
    prompt.iter().copied().cycle().take(len).collect()
}

/// A sidecar process of the bench (`moelane bench <cmd>`) generating `a`'s preset on
/// cuda:`gpu`, its stdin and stdout piped (the ipc link's handshake goes through them).
#[cfg(feature = "cuda")]
fn spawn_sidecar(
    cmd: &str,
    a: &DecodeArgs,
    gpu: usize,
    extra: &[&str],
) -> Result<std::process::Child> {
    let (seed, device) = (a.seed.to_string(), format!("cuda:{gpu}"));
    let mut args = vec![
        "bench", cmd, "--model", &a.model, "--seed", &seed, "--device", &device,
    ];
    args.extend_from_slice(extra);
    Ok(std::process::Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?)
}

/// The sidecar service of the bench's sidecar processes: `model`'s preset generated from
/// `seed`, the cold experts of its affinity map on `device` (cuda:N), served by the
/// production `SidecarCore` (epoch check, counters).
#[cfg(feature = "cuda")]
fn bench_sidecar(
    model: &str,
    seed: u64,
    device: &str,
) -> Result<(
    moelane_engine::synth::InMemory,
    std::sync::Arc<moelane_engine::cuda::Gpu>,
    std::sync::Arc<dyn moelane_link::ColdService>,
)> {
    use moelane_engine::cuda_station::{affinity_map, tier_experts};
    use moelane_engine::rowmap::Tier;
    let ordinal: usize = device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("--device {device:?}: expected cuda:N"))?;
    let p = moelane_engine::synth::Preset::by_name(model)
        .ok_or_else(|| anyhow::anyhow!("--model {model:?}: the sidecar generates a preset"))?;
    let m = moelane_engine::synth::in_memory(&p, seed)?;
    let map = affinity_map(&m, m.hot)?;
    let c = &m.config;
    let gpu = moelane_engine::cuda::Gpu::open(ordinal)?;
    let mut ge = moelane_engine::cuda_experts::GpuExperts::new(
        gpu.clone(),
        c.hidden_size,
        c.moe_intermediate_size,
    )?;
    ge.generate(seed, &tier_experts(&map, Tier::Cold))?;
    let svc: std::sync::Arc<dyn moelane_link::ColdService> =
        std::sync::Arc::new(moelane_rtx_worker::SidecarCore::generated(&m.id, &map, ge));
    Ok((m, gpu, svc))
}

/// The gpu+nccl:N placement: a sidecar process (`moelane bench nccl-sidecar`) generates the
/// cold experts of the affinity map on cuda:N and serves them over NCCL; this process's
/// engine holds the hot ones and sends its cold picks over the link.
#[cfg(feature = "cuda")]
fn nccl_engine(
    m: &moelane_engine::synth::InMemory,
    a: &DecodeArgs,
    sidecar_gpu: usize,
    ordinal: usize,
    gpu: std::sync::Arc<moelane_engine::cuda::Gpu>,
    kv_tokens: usize,
) -> Result<(moelane_engine::step::Engine, std::process::Child)> {
    use moelane_link::nccl::{NcclId, NcclTier};
    if sidecar_gpu == ordinal {
        anyhow::bail!("gpu+nccl:{sidecar_gpu}: the sidecar needs another GPU than the primary's");
    }
    let id = NcclId::new()?;
    let mut child = spawn_sidecar("nccl-sidecar", a, sidecar_gpu, &["--id", &id.to_hex()])?;
    let map = moelane_engine::cuda_station::affinity_map(m, m.hot)?;
    let tier = match NcclTier::connect(
        ordinal,
        &id,
        m.config.hidden_size,
        std::time::Duration::from_secs(30),
    ) {
        Ok(t) => t,
        Err(e) => {
            let _ = child.kill();
            return Err(e.into());
        }
    };
    let eng = moelane_engine::cuda_station::hashed_engine_with_tier(
        m,
        map,
        gpu,
        kv_tokens,
        Some(Box::new(tier)),
    )?;
    Ok((eng, child))
}

/// The gpu+ipc:N placement: a sidecar process (`moelane bench ipc-sidecar`) generates the
/// cold experts of the affinity map on cuda:N (this process's GPU too, or a peer) and
/// serves them through the device mailbox; the handshake's two lines go through its stdout
/// and stdin. `rows`: the most rows a step carries.
#[cfg(feature = "cuda")]
fn ipc_engine(
    m: &moelane_engine::synth::InMemory,
    a: &DecodeArgs,
    sidecar_gpu: usize,
    rows: usize,
    gpu: std::sync::Arc<moelane_engine::cuda::Gpu>,
    kv_tokens: usize,
) -> Result<(moelane_engine::step::Engine, std::process::Child)> {
    use std::io::{BufRead, Write};
    let mut child = spawn_sidecar("ipc-sidecar", a, sidecar_gpu, &[])?;
    let r = (|| -> Result<moelane_engine::step::Engine> {
        let end = moelane_link::ipc::PrimaryEnd::new(gpu.clone(), box_layout(&m.config, rows))?;
        let mut inp = child
            .stdin
            .take()
            .ok_or_else(|| anyhow::anyhow!("the sidecar's stdin"))?;
        writeln!(inp, "{}", end.params()?)?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("the sidecar's stdout"))?;
        let mut offer = String::new();
        std::io::BufReader::new(out).read_line(&mut offer)?;
        if offer.is_empty() {
            anyhow::bail!("the ipc sidecar exited before offering its mailbox");
        }
        let tier = end.connect(&offer)?;
        let map = moelane_engine::cuda_station::affinity_map(m, m.hot)?;
        Ok(moelane_engine::cuda_station::hashed_engine_with_tier(
            m,
            map,
            gpu,
            kv_tokens,
            Some(Box::new(tier)),
        )?)
    })();
    match r {
        Ok(eng) => Ok((eng, child)),
        Err(e) => {
            let _ = child.kill();
            Err(e)
        }
    }
}

/// The ipc link's mailbox shape for model `c` with `rows` rows a step.
#[cfg(feature = "cuda")]
fn box_layout(
    c: &moelane_engine::config::ModelConfig,
    rows: usize,
) -> moelane_engine::tier::BoxLayout {
    moelane_engine::tier::BoxLayout {
        layers: c.moe_layers().len(),
        cap_rows: rows,
        k: c.num_experts_per_tok,
        hidden: c.hidden_size,
        experts: c.num_experts,
    }
}

/// `moelane bench ipc-sidecar`: the sidecar process of the gpu+ipc:N placement. Reads the
/// primary's parameters on stdin, prints its offer on stdout, serves until the primary is
/// gone.
#[cfg(feature = "cuda")]
pub fn ipc_sidecar(model: &str, seed: u64, device: &str) -> Result<()> {
    use std::io::BufRead;
    let (m, gpu, svc) = bench_sidecar(model, seed, device)?;
    let c = &m.config;
    let mut params = String::new();
    std::io::stdin().lock().read_line(&mut params)?;
    let mut end = moelane_link::ipc::SidecarEnd::open(gpu, &params)?;
    let got = end.layout();
    if got != box_layout(c, got.cap_rows) {
        anyhow::bail!("the primary's mailbox {got:?} is not {model}'s shape");
    }
    println!("{}", end.offer()?);
    let stop = std::sync::atomic::AtomicBool::new(false);
    if let Err(e) = end.serve(&svc, &stop) {
        eprintln!("ipc-sidecar: link ended: {e}");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn ipc_sidecar(_model: &str, _seed: u64, _device: &str) -> Result<()> {
    anyhow::bail!("bench ipc-sidecar needs the GPU build: --features cuda")
}

/// `moelane bench nccl-sidecar`: the sidecar process of the gpu+nccl:N placement.
#[cfg(feature = "cuda")]
pub fn nccl_sidecar(model: &str, seed: u64, device: &str, id: &str) -> Result<()> {
    let id = moelane_link::nccl::NcclId::from_hex(id)?;
    let (_m, gpu, svc) = bench_sidecar(model, seed, device)?;
    let ordinal = gpu.ordinal;
    let stop = std::sync::atomic::AtomicBool::new(false);
    // ends when the primary aborts the link (its engine dropped) or dies
    let r = moelane_link::nccl::serve_blocking(
        ordinal,
        &id,
        &svc,
        &stop,
        std::time::Duration::from_secs(300),
    );
    if let Err(e) = r {
        eprintln!("nccl-sidecar: link ended: {e}");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn nccl_sidecar(_model: &str, _seed: u64, _device: &str, _id: &str) -> Result<()> {
    anyhow::bail!("bench nccl-sidecar needs the GPU build: --features cuda")
}
