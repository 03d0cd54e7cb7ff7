//! The whole decode step on the GPU against the CPU backend (feature `cuda`; skips, saying
//! why, where there is no CUDA device): per-layer hidden states and logits of `tiny` and
//! `mini` agree to cosine >= 0.999 at prefill and decode; greedy continuations of 50 prompts
//! are compared across maps (all hot on the GPU, the preset's split with the cold experts on
//! a CPU tier, all cold); the `station` generator on the GPU is bit-identical to its CPU
//! mirror.
#![cfg(feature = "cuda")]

mod common;

use common::cos;

use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::cuda::Gpu;
use moelane_engine::cuda_station::load_on_gpu;
use moelane_engine::load::{engine_from, EngineOptions};
use moelane_engine::rng::Rng;
use moelane_engine::rowmap::{Rowmap, ValidMap};
use moelane_engine::step::{Engine, SeqStep};

fn gpu() -> Option<std::sync::Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIP gpu dense: {e}");
            None
        }
    }
}

/// all hot / the preset's split (first `hot` experts of a shuffled order hot) / all cold
fn maps(ckpt: &Checkpoint, hot: usize) -> Vec<(&'static str, ValidMap)> {
    let c = &ckpt.config;
    let (layers, ne) = (c.moe_layers().len(), c.num_experts);
    let all = Rowmap::all_hot(&ckpt.id, layers, ne);
    let mut split = all.clone();
    let mut rng = Rng::new(11);
    for l in &mut split.layers {
        let mut ids: Vec<u16> = (0..ne as u16).collect();
        rng.shuffle(&mut ids);
        let (h, cold) = ids.split_at(hot);
        l.hot = h.to_vec();
        l.cold = cold.to_vec();
        l.hot.sort_unstable();
        l.cold.sort_unstable();
    }
    let mut cold = all.clone();
    for l in &mut cold.layers {
        l.cold = std::mem::take(&mut l.hot);
    }
    [("all-hot", all), ("split", split), ("all-cold", cold)]
        .into_iter()
        .map(|(n, m)| (n, m.validate(&ckpt.id, layers, ne, None).unwrap()))
        .collect()
}

fn prompts(vocab: usize, n: usize) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(5);
    (0..n)
        .map(|_| {
            let len = 4 + rng.below(24);
            (0..len).map(|_| rng.below(vocab) as u32).collect()
        })
        .collect()
}

/// `mini` (seed 1) generated into a temporary directory, on the GPU under map `which` of
/// [`maps`] (0 all hot, 1 split); None (the test skips) without a GPU.
fn mini_on_gpu(which: usize) -> Option<(tempfile::TempDir, Checkpoint, Engine)> {
    let gpu = gpu()?;
    let dir = tempfile::tempdir().unwrap();
    let p = moelane_engine::synth::Preset::by_name("mini").unwrap();
    moelane_engine::synth::generate(&p, 1, dir.path()).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let opts = EngineOptions {
        kv_tokens: 8192,
        progress: false,
    };
    let (_, map) = maps(&ckpt, p.hot).remove(which);
    let e = load_on_gpu(&ckpt, map, &opts, gpu).unwrap();
    Some((dir, ckpt, e))
}

/// Prefill `prompt`, then `decode` greedy steps; the trace of every step and its logits.
fn traced(e: &mut Engine, prompt: &[u32], decode: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    e.trace = Some(Vec::new());
    let mut seq = e.kv.new_seq();
    let mut logits = Vec::new();
    let mut l = e
        .step(&mut [SeqStep {
            kv: &mut seq,
            tokens: prompt,
        }])
        .unwrap();
    for _ in 0..decode {
        let t = moelane_engine::sampling::argmax(&l) as u32;
        logits.push(l);
        l = e
            .step(&mut [SeqStep {
                kv: &mut seq,
                tokens: &[t],
            }])
            .unwrap();
    }
    logits.push(l);
    (e.trace.take().unwrap(), logits)
}

/// Prefill `prompt`, then `decode` greedy steps (no trace: a step is one run of kernels);
/// every step's logits.
fn decoded(e: &mut Engine, prompt: &[u32], decode: usize) -> Vec<Vec<f32>> {
    let mut seq = e.kv.new_seq();
    let mut toks = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..=decode {
        let l = e
            .step(&mut [SeqStep {
                kv: &mut seq,
                tokens: &toks,
            }])
            .unwrap();
        toks = vec![moelane_engine::sampling::argmax(&l) as u32];
        out.push(l);
    }
    out
}

#[test]
fn gpu_step_matches_the_cpu_backend() {
    let Some(gpu) = gpu() else { return };
    eprintln!("device cuda:0 {} sm_{}{}", gpu.name, gpu.cc.0, gpu.cc.1);
    for preset in ["tiny", "mini"] {
        let dir = tempfile::tempdir().unwrap();
        let p = moelane_engine::synth::Preset::by_name(preset).unwrap();
        moelane_engine::synth::generate(&p, 1, dir.path()).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let opts = EngineOptions {
            kv_tokens: 4096,
            progress: false,
        };
        let vocab = ckpt.config.vocab_size;
        let ps = prompts(vocab, 50);
        for (name, map) in maps(&ckpt, p.hot) {
            let mut cpu = engine_from(&ckpt, map.clone(), &opts).unwrap();
            let mut gpu_e = load_on_gpu(&ckpt, map, &opts, gpu.clone()).unwrap();
            // per-layer hidden states and logits: prefill of a long prompt, then 8 decodes
            let (ta, la) = traced(&mut cpu, &ps[0], 8);
            let (tb, lb) = traced(&mut gpu_e, &ps[0], 8);
            assert_eq!(ta.len(), tb.len());
            let mut worst_h = 1f64;
            for (a, b) in ta.iter().zip(&tb) {
                assert_eq!(a.len(), b.len());
                let h = ckpt.config.hidden_size;
                for (ra, rb) in a.chunks_exact(h).zip(b.chunks_exact(h)) {
                    worst_h = worst_h.min(cos(ra, rb));
                }
            }
            let worst_l = la
                .iter()
                .zip(&lb)
                .map(|(a, b)| cos(a, b))
                .fold(1f64, f64::min);
            // greedy parity over 50 prompts, 16 tokens each
            let mut same = 0;
            for p in &ps {
                let a = cpu.greedy(p, 16).unwrap();
                let b = gpu_e.greedy(p, 16).unwrap();
                same += (a == b) as usize;
            }
            // the GPU step's counters match the CPU's (same picks, same split)
            let (ca, cb) = (&cpu.counters, &gpu_e.counters);
            let picks_a: u64 = ca.picks.iter().flatten().sum();
            let picks_b: u64 = cb.picks.iter().flatten().sum();
            eprintln!(
                "{preset} {name}: worst per-layer hidden cosine {worst_h:.7}, worst logits cosine {worst_l:.7}, greedy {same}/50 identical, picks {picks_a} cpu / {picks_b} gpu, cold {} / {}",
                ca.cold_picks.iter().sum::<u64>(),
                cb.cold_picks.iter().sum::<u64>()
            );
            assert!(worst_h >= 0.999, "{preset} {name}: hidden cosine {worst_h}");
            assert!(worst_l >= 0.999, "{preset} {name}: logits cosine {worst_l}");
            assert!(
                same >= 45,
                "{preset} {name}: only {same}/50 greedy identical"
            );
            assert_eq!(picks_a, picks_b);
            assert_eq!(ca.tokens, cb.tokens);
        }
    }
}

#[test]
fn gpu_batched_steps_and_argmax_match_single() {
    // several sequences in one step (mixed prefill and decode rows) give each sequence the
    // same greedy tokens as running it alone; step_argmax equals argmax of step's logits
    let Some((_dir, ckpt, mut e)) = mini_on_gpu(1) else {
        return;
    };
    let ps = prompts(ckpt.config.vocab_size, 8);
    let alone: Vec<Vec<u32>> = ps.iter().map(|p| e.greedy(p, 12).unwrap()).collect();
    let mut seqs: Vec<_> = ps.iter().map(|_| e.kv.new_seq()).collect();
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); ps.len()];
    let mut next: Vec<Vec<u32>> = ps.clone();
    for _ in 0..12 {
        let mut steps: Vec<SeqStep> = seqs
            .iter_mut()
            .zip(&next)
            .map(|(kv, t)| SeqStep { kv, tokens: t })
            .collect();
        let ids = e.step_argmax(&mut steps).unwrap();
        for (i, &t) in ids.iter().enumerate() {
            outs[i].push(t);
            next[i] = vec![t];
        }
    }
    let same = outs.iter().zip(&alone).filter(|(a, b)| a == b).count();
    eprintln!("batched vs alone: {same}/{} identical", ps.len());
    assert!(same >= ps.len() - 1, "{same}/{}", ps.len());
}

#[test]
fn station_generator_is_bit_identical_on_gpu_and_cpu() {
    let Some(gpu) = gpu() else { return };
    let (h, i) = (256usize, 64usize);
    let mut ge = moelane_engine::cuda_experts::GpuExperts::new(gpu, h, i).unwrap();
    let which = [(0usize, 0usize), (3, 17), (39, 383)];
    ge.generate(42, &which).unwrap();
    let mut rng = Rng::new(3);
    let acts: Vec<f32> = (0..h).map(|_| rng.normal()).collect();
    for &(l, e) in &which {
        let w = moelane_engine::synth::hashed_expert(42, l, e, h, i);
        let (gu, dn) = ge.download(l, e).unwrap().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert!(
            bits(&gu) == bits(&w.gate_up.to_f32()) && bits(&dn) == bits(&w.down.to_f32()),
            "expert ({l},{e}): GPU-generated weights differ from the CPU mirror's bits"
        );
        let mut bank = moelane_engine::bank::ExpertBank::empty(
            moelane_engine::rowmap::Tier::Cold,
            40,
            384,
            h,
            i,
        );
        bank.insert(l, e, std::sync::Arc::new(w));
        let pick = [moelane_engine::bank::Pick {
            row: 0,
            expert: e as u16,
        }];
        let (mut a, mut b) = (vec![0f32; h], vec![0f32; h]);
        bank.compute(l, &pick, &acts, &mut a).unwrap();
        ge.compute(l, &pick, &acts, &mut b).unwrap();
        let c = cos(&a, &b);
        eprintln!("generated expert ({l},{e}): weights bit-identical, output cosine {c:.9}");
        assert!(c > 0.999999, "expert ({l},{e}) differs: {c}");
    }
}

#[test]
fn kernels_compile_with_nvrtc_for_each_supported_architecture() {
    // needs only the NVRTC library, not a GPU: CI fetches it (.ci/run), so a kernel that
    // does not compile fails there, not on the first device call
    for arch in ["sm_80", "sm_90"] {
        for (name, src) in [
            ("dense", moelane_engine::cuda_model::DENSE_CU),
            ("experts", moelane_engine::cuda::EXPERTS_CU),
        ] {
            match moelane_engine::cuda::nvrtc_compile(name, src, arch) {
                Ok(ptx) => eprintln!("{name} for {arch}: {} bytes of PTX", ptx.to_src().len()),
                Err(e) if e.to_string().contains("was not found") => {
                    eprintln!("SKIP kernel compile: {e}");
                    return;
                }
                Err(e) => panic!("{name} for {arch}: {e}"),
            }
        }
    }
}

#[test]
fn gpu_sampling_follows_the_host_rule() {
    // the same prompt prefilled twice: once returning logits (sampled on the host by
    // sampling::pick_token), once sampled on the GPU with the same (temperature, top_p,
    // top_k, u)
    use moelane_engine::sampling::{pick_token, TokenPick};
    let Some((_dir, ckpt, mut e)) = mini_on_gpu(0) else {
        return;
    };
    let ps = prompts(ckpt.config.vocab_size, 40);
    let mut rng = Rng::new(9);
    let (mut same, mut total, mut scratch) = (0, 0, Vec::new());
    for (i, prompt) in ps.iter().enumerate() {
        for (t, top_p, top_k) in [
            (0.0f32, 1.0f32, 0u32),
            (0.7, 0.9, 0),
            (1.0, 1.0, 0),
            (1.5, 0.5, 0),
            (1.0, 0.95, 0),
            // top-k alone, under a nucleus, at 1 (greedy), past the vocabulary
            (1.0, 1.0, 20),
            (1.5, 1.0, 3),
            (0.8, 0.9, 50),
            (2.0, 0.3, 200),
            (1.0, 1.0, 1),
            (1.0, 0.95, 1 << 20),
        ] {
            let pick = if t == 0.0 {
                TokenPick::Greedy
            } else {
                TokenPick::Sample {
                    temperature: t,
                    top_p,
                    top_k,
                    u: rng.uniform_f64(),
                }
            };
            let mut a = e.kv.new_seq();
            let logits = e
                .step(&mut [SeqStep {
                    kv: &mut a,
                    tokens: prompt,
                }])
                .unwrap();
            let want = pick_token(&logits, pick, &mut scratch);
            let mut b = e.kv.new_seq();
            let got = e
                .step_pick(
                    &mut [SeqStep {
                        kv: &mut b,
                        tokens: prompt,
                    }],
                    &[pick],
                )
                .unwrap()[0];
            drop((a, b)); // their KV blocks go back
            same += (got == want) as usize;
            total += 1;
            if pick == TokenPick::Greedy || top_k == 1 {
                assert_eq!(got, want, "prompt {i}: greedy (or top_k 1)");
            }
        }
    }
    eprintln!("GPU sampling: {same}/{total} tokens identical to the host rule on the same logits");
    assert!(same * 100 >= total * 98, "only {same}/{total}");
}

#[test]
fn long_context_attention_matches_the_cpu() {
    // a 1500-token prompt prefilled in one step (attention a tile of 16 rows per block), then
    // decode attention as position ranges in many blocks plus a merge (attention_splits):
    // against the CPU backend, against one block per head, and against a block per prefill row;
    // then gpt_oss's random checkpoint (a sliding window of 4 on half its layers, a sink logit
    // per head) at 900 positions: most ranges of a windowed layer see no position
    use moelane_engine::config::Family;
    use moelane_engine::random_ckpt::{self, Dims};
    let Some((_dir, ckpt, g)) = mini_on_gpu(0) else {
        return;
    };
    let opts = EngineOptions {
        kv_tokens: 8192,
        progress: false,
    };
    let p = moelane_engine::synth::Preset::by_name("mini").unwrap();
    let (_, map) = maps(&ckpt, p.hot).remove(0);
    let cpu = engine_from(&ckpt, map, &opts).unwrap();
    long_context(&ckpt, g, cpu, 1500, "mini", 16);
    let Some(gpu) = gpu() else { return };
    // (family, positions, the fewest decode ranges expected): deepseek_v3's latent attention
    // has one path (no ranges) and prefills 600 rows in chunks of 256 over one scratch
    for (family, len, min_splits) in [(Family::GptOss, 900, 16), (Family::DeepseekV3, 600, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let d = Dims::for_family(family);
        random_ckpt::write(family, &d, 11, dir.path()).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let map = maps(&ckpt, 1).remove(0).1;
        let cpu = engine_from(&ckpt, map.clone(), &opts).unwrap();
        let g = load_on_gpu(&ckpt, map, &opts, gpu.clone()).unwrap();
        long_context(&ckpt, g, cpu, len, family.name(), min_splits);
    }
}

/// Prefill `len` positions, then 5 greedy decode steps, on the CPU engine and the GPU one
/// (split decode attention, one block per head, a block per prefill row): see the caller.
fn long_context(
    ckpt: &Checkpoint,
    mut g: Engine,
    mut cpu: Engine,
    len: usize,
    label: &str,
    min_splits: usize,
) {
    let base = &prompts(ckpt.config.vocab_size, 1)[0];
    let prompt: Vec<u32> = base.iter().copied().cycle().take(len).collect();
    let run = |e: &mut Engine, split: Option<bool>| -> (Vec<Vec<f32>>, usize) {
        if let Some(on) = split {
            e.gpu_mut().unwrap().set_split_attention(on);
        }
        let mut seq = e.kv.new_seq();
        let mut out = Vec::new();
        let mut splits = 0;
        let mut next = prompt.clone();
        for _ in 0..6 {
            let l = e
                .step(&mut [SeqStep {
                    kv: &mut seq,
                    tokens: &next,
                }])
                .unwrap();
            if let Some(gm) = e.gpu_mut() {
                splits = splits.max(gm.splits());
            }
            next = vec![moelane_engine::sampling::argmax(&l) as u32];
            out.push(l);
        }
        (out, splits)
    };
    let (want, _) = run(&mut cpu, None);
    let (split, s) = run(&mut g, Some(true));
    let (one, s1) = run(&mut g, Some(false));
    g.gpu_mut().unwrap().set_tiled_prefill(false);
    let (rows, _) = run(&mut g, Some(true));
    g.gpu_mut().unwrap().set_tiled_prefill(true);
    let w_rows = cos(&rows[0], &split[0]);
    let am = moelane_engine::sampling::argmax;
    for (i, (a, b)) in rows.iter().zip(&split).enumerate() {
        assert_eq!(
            am(a),
            am(b),
            "step {i}: greedy token, tiled vs row-per-block prefill"
        );
    }
    assert!(
        w_rows >= 0.99999,
        "prefill logits, tiled vs a block per row: {w_rows}"
    );
    assert!(
        s >= min_splits,
        "{label}: decode at {len} positions ran {s} ranges"
    );
    assert_eq!(s1, 1);
    let (mut w_cpu, mut w_one) = (1f64, 1f64);
    for (i, ((a, b), c)) in want.iter().zip(&split).zip(&one).enumerate() {
        w_cpu = w_cpu.min(cos(a, b));
        w_one = w_one.min(cos(b, c));
        assert_eq!(am(a), am(b), "step {i}: greedy token, CPU vs split");
        assert_eq!(am(b), am(c), "step {i}: greedy token, split vs one block");
    }
    eprintln!(
        "{label}, {len} positions: logits cosine vs CPU {w_cpu:.7}; decode split in {s} ranges vs one block per head {w_one:.9}; tiled prefill vs a block per row {w_rows:.9}"
    );
    assert!(w_cpu >= 0.999, "{label}: vs CPU {w_cpu}");
    assert!(w_one >= 0.99999, "{label}: vs one block {w_one}");
}

/// For each batch size b: the first b prompts prefilled together, then greedy decode steps
/// (`steps` in all); every step's logits, in order.
fn greedy_batches(e: &mut Engine, ps: &[Vec<u32>], sizes: &[usize], steps: usize) -> Vec<Vec<f32>> {
    let v = e.cfg.vocab_size;
    let mut out = Vec::new();
    for &b in sizes {
        let mut seqs: Vec<_> = (0..b).map(|_| e.kv.new_seq()).collect();
        let mut next: Vec<Vec<u32>> = ps[..b].to_vec();
        for _ in 0..steps {
            let mut st: Vec<SeqStep> = seqs
                .iter_mut()
                .zip(&next)
                .map(|(kv, t)| SeqStep { kv, tokens: t })
                .collect();
            let l = e.step(&mut st).unwrap();
            next = l
                .chunks_exact(v)
                .map(|r| vec![moelane_engine::sampling::argmax(r) as u32])
                .collect();
            out.push(l);
        }
    }
    out
}

#[test]
fn rows_longer_than_one_round_of_loads_match_the_cpu() {
    // a model 1280 wide: every small-batch product's rows are longer than the 1024 floats a
    // warp loads in one round, so they run in rounds with a remainder (and without the
    // preload into registers); logits against the CPU backend at 1 and 3 rows, greedy tokens
    // equal, and the same bit for bit with the preload switch off
    let Some(gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let p = moelane_engine::synth::Preset {
        name: "wide",
        hidden: 1280,
        layers: 2,
        heads: 20,
        kv_heads: 4,
        head_dim: 64,
        inter: 96,
        experts: 16,
        topk: 2,
        hot: 12,
        vocab_target: 640,
        core: 6,
        max_pos: 512,
    };
    moelane_engine::synth::generate(&p, 1, dir.path()).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let opts = EngineOptions {
        kv_tokens: 1024,
        progress: false,
    };
    let (_, map) = maps(&ckpt, p.hot).remove(0);
    let mut cpu = engine_from(&ckpt, map.clone(), &opts).unwrap();
    let mut g = load_on_gpu(&ckpt, map, &opts, gpu).unwrap();
    let ps = prompts(ckpt.config.vocab_size, 3);
    let want = greedy_batches(&mut cpu, &ps, &[1, 3], 5);
    let got = greedy_batches(&mut g, &ps, &[1, 3], 5);
    let am = moelane_engine::sampling::argmax;
    let v = ckpt.config.vocab_size;
    let mut worst = 1f64;
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        for (ra, rb) in a.chunks_exact(v).zip(b.chunks_exact(v)) {
            worst = worst.min(cos(ra, rb));
            assert_eq!(am(ra), am(rb), "step {i}: greedy token, CPU vs GPU");
        }
    }
    g.gpu_mut().unwrap().set_preload(false);
    let off = greedy_batches(&mut g, &ps, &[1, 3], 5);
    eprintln!(
        "1280 wide: logits cosine vs CPU {worst:.7}; preload off identical: {}",
        off == got
    );
    assert!(worst >= 0.999, "vs CPU {worst}");
    assert!(off == got, "the preload switch changed the logits");
}

#[test]
fn preloaded_weights_leave_the_logits_unchanged() {
    // weight rows loaded into registers before the previous kernel ends (the small-batch
    // products and the down-projection) give the same logits, bit for bit, as loading them
    // after (with one row: no check that a block leads its expert), the router's top-k
    // in registers the same as in shared memory (the path past 512 experts), the router's
    // product and top-k in one kernel and one row's down-projection and combine in one (the
    // fused kernels) the same as in two, at 1, 3 and 8
    // rows (prefill and decode, graphs captured and replayed), under the
    // all-hot map and the split one; the hollow diagnostic does change them, and turning it
    // off restores them
    for which in [0, 1] {
        let Some((_dir, ckpt, mut e)) = mini_on_gpu(which) else {
            return;
        };
        let ps = prompts(ckpt.config.vocab_size, 8);
        let run = |e: &mut Engine, preload: bool, hollow: &[&str]| -> Vec<Vec<f32>> {
            let g = e.gpu_mut().unwrap();
            g.set_preload(preload);
            g.set_register_topk(preload);
            g.set_fuse(preload);
            g.set_hollow(hollow.iter().map(|s| s.to_string()).collect());
            greedy_batches(e, &ps, &[1, 3, 8], 5)
        };
        let base = run(&mut e, false, &[]);
        let pre = run(&mut e, true, &[]);
        assert!(
            pre == base,
            "map {which}: preloaded weights changed the logits"
        );
        let hollow = run(&mut e, true, &["moe_down", "norm_gemv_rows"]);
        assert!(
            hollow != base,
            "map {which}: hollow kernels left the logits as they were"
        );
        assert!(run(&mut e, true, &[]) == base, "map {which}: not restored");
        eprintln!(
            "map {which}: {} steps' logits identical with the weights preloaded and the top-k in registers",
            base.len()
        );
    }
}

#[test]
fn attention_splits_follow_the_context_and_the_wave() {
    // no GPU needed: the rule that sizes split decode attention
    use moelane_engine::cuda_model::attention_splits as s;
    // short contexts: one block per (row, head)
    assert_eq!(s(1, 1, 16, 528), 1);
    assert_eq!(s(64, 1, 16, 528), 1);
    // ranges of 32..=64 positions, powers of two
    assert_eq!(s(65, 1, 16, 528), 2);
    assert_eq!(s(1025, 1, 16, 528), 32);
    assert_eq!(s(1024, 1, 16, 528), 16);
    // at most 64 ranges
    assert_eq!(s(100_000, 1, 4, 100_000), 64);
    // no more blocks than one wave of the device: 16 rows of 16 heads fill 528 twice over
    assert_eq!(s(1024, 4, 16, 528), 8);
    assert_eq!(s(1024, 16, 16, 528), 2);
    assert_eq!(s(1024, 64, 16, 528), 1);
    // degenerate inputs do not panic
    assert_eq!(s(0, 0, 0, 0), 1);
}

#[test]
fn prefill_tiles_never_mix_sequences() {
    // no GPU needed: the host's tiling of a step's rows for attention_tiled
    use moelane_engine::cuda_model::prefill_tiles as t;
    assert!(t([]).is_empty());
    assert_eq!(t([0]), vec![(0, 1)]);
    // a 40-row prompt: 16 + 16 + 8
    assert_eq!(t([3; 40]), vec![(0, 16), (16, 16), (32, 8)]);
    // mixed decode and prefill rows: a tile per run of one sequence
    assert_eq!(t([0, 1, 1, 1, 2, 0]), vec![(0, 1), (1, 3), (4, 1), (5, 1)]);
    // every row covered once, in order, at most 16 per tile, one sequence per tile
    let seqs: Vec<usize> = (0..500).map(|i| (i / 37) % 5).collect();
    let tiles = t(seqs.iter().copied());
    let mut next = 0;
    for &(first, count) in &tiles {
        assert_eq!(first, next);
        assert!((1..=16).contains(&count));
        assert!(seqs[first..first + count].iter().all(|&s| s == seqs[first]));
        next += count;
    }
    assert_eq!(next, seqs.len());
}

#[test]
fn every_family_on_the_gpu_matches_the_cpu() {
    // the random checkpoints of the transformers parity test (families.rs), bf16 on disk:
    // on the GPU under all-hot, split and all-cold maps, 50 prompts x 8 greedy tokens; the
    // map changes nothing on one device (50/50 bitwise the same tokens); against the CPU
    // backend the logits agree to cosine >= 0.999 and the greedy tokens are counted (the two
    // backends sum in different orders, so a near-tie may break either way)
    use moelane_engine::config::Family;
    use moelane_engine::random_ckpt::{self, Dims};
    let Some(gpu) = gpu() else { return };
    let opts = EngineOptions {
        kv_tokens: 8192,
        progress: false,
    };
    // (family, FP8 weights): FP8 experts stay FP8 on the GPU, FP8 dense matrices are widened
    // (blocks of 2 x 6 do not give the kernels four weights under one scale: those experts
    // are widened to f32, the fallback)
    // (the last: compressed-tensors FP8 with a scale per row, held as blocks of 1 x 128)
    for (family, blocks, per_row) in [
        (Family::Mixtral, None, false),
        (Family::Qwen3Moe, None, false),
        (Family::Qwen2Moe, None, false),
        (Family::Glm4Moe, None, false),
        (Family::DeepseekV3, None, false),
        (Family::GptOss, None, false),
        (Family::Qwen3Moe, Some([4, 16]), false),
        (Family::DeepseekV3, Some([4, 16]), false),
        (Family::Glm4Moe, Some([4, 16]), false),
        (Family::Qwen3Moe, Some([2, 6]), false),
        (Family::Qwen3Moe, Some([1, 128]), true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let d = Dims::for_family(family);
        random_ckpt::write(family, &d, 11, dir.path()).unwrap();
        let fp8 = blocks.is_some();
        match blocks {
            Some(_) if per_row => random_ckpt::to_fp8_compressed(
                dir.path(),
                moelane_engine::config::Fp8Scales::Channel,
                [1, 128],
            )
            .unwrap(),
            Some(b) => random_ckpt::to_fp8(dir.path(), b).unwrap(),
            None => {}
        }
        let label = match blocks {
            Some(_) if per_row => format!("{}_compressed_fp8_per_row", family.name()),
            Some([b0, b1]) => format!("{}_fp8_{b0}x{b1}", family.name()),
            None => family.name().to_string(),
        };
        let widened = blocks.is_some_and(|b| !b[1].is_multiple_of(4));
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let ps = prompts(d.vocab, 50);
        let ms = maps(&ckpt, d.experts / 2);
        let mut cpu = engine_from(&ckpt, ms[0].1.clone(), &opts).unwrap();
        let on_cpu: Vec<_> = ps
            .iter()
            .map(|p| common::greedy_one(&mut cpu, p, 8))
            .collect();
        let mut base: Option<Vec<Vec<u32>>> = None;
        for (name, map) in ms {
            let all_hot = name == "all-hot";
            let mut g = load_on_gpu(&ckpt, map, &opts, gpu.clone()).unwrap();
            if all_hot {
                // every weight on the GPU: bf16 checkpoints keep their bytes there (plus 2
                // bytes per element of the vectors held as f32, as on the CPU)
                let dense = moelane_engine::model::DenseWeights::load(&ckpt).unwrap();
                let gm = g.gpu_mut().unwrap();
                let held = gm.dense_bytes() + gm.expert_bytes();
                let stored = ckpt.tensor_bytes();
                eprintln!(
                    "{label}: {held} bytes of weights on the GPU ({}), {stored} stored \
                     ({:.4}x), {} bytes of KV cache",
                    gm.weight_dtype(),
                    held as f64 / stored as f64,
                    gm.kv_bytes()
                );
                if fp8 {
                    // the experts keep their FP8 bytes and f32 block scales, as stored; the
                    // FP8 dense matrices are widened to f32 (those left bf16 stay bf16)
                    let c = &ckpt.config;
                    let experts = c.moe_layers().len() * c.num_experts;
                    if widened {
                        assert!(gm.weight_dtype().ends_with("f32 experts"), "{label}");
                        assert_eq!(gm.expert_bytes(), experts * 4 * c.expert_params());
                    } else {
                        // the FP8 dense matrices stay FP8 too (MLA's per-head stacks widened)
                        assert!(gm.weight_dtype().ends_with("fp8 experts"), "{label}");
                        assert!(gm.weight_dtype().contains("fp8 dense"), "{label}");
                        assert_eq!(
                            gm.expert_bytes(),
                            experts * ckpt.expert_stored_bytes().unwrap(),
                            "{label}"
                        );
                    }
                } else {
                    // the vectors: norms, biases (gpt_oss's experts' too), gates, sinks
                    let mut vectors = dense.vector_elements();
                    for l in ckpt.config.moe_layers() {
                        for x in 0..ckpt.config.num_experts {
                            let w = ckpt.expert(l, x).unwrap();
                            vectors += w.gate_up_bias.len() + w.down_bias.len();
                        }
                    }
                    assert_eq!(gm.weight_dtype(), "bf16", "{label}");
                    assert_eq!(held, stored + 2 * vectors, "{label}");
                }
            }
            let got: Vec<_> = ps
                .iter()
                .map(|p| common::greedy_one(&mut g, p, 8))
                .collect();
            let same_cpu = got.iter().zip(&on_cpu).filter(|(a, b)| a.0 == b.0).count();
            let worst = got
                .iter()
                .zip(&on_cpu)
                .map(|(a, b)| cos(&a.1, &b.1))
                .fold(1f64, f64::min);
            eprintln!(
                "{} {name}: GPU greedy as the CPU's {same_cpu}/50, worst first-step cosine {worst:.7}",
                label
            );
            assert!(worst >= 0.999, "{} {name}: cosine {worst}", label);
            assert!(same_cpu >= 45, "{} {name}: {same_cpu}/50 as the CPU", label);
            let tokens: Vec<Vec<u32>> = got.into_iter().map(|x| x.0).collect();
            match &base {
                None => base = Some(tokens),
                Some(b) => {
                    let same = tokens.iter().zip(b).filter(|(x, y)| x == y).count();
                    eprintln!(
                        "{} {name}: identical to all-hot on the GPU {same}/50",
                        label
                    );
                    assert_eq!(same, 50, "{} {name}: the map changed GPU tokens", label);
                }
            }
        }
    }
}

#[test]
fn families_on_the_gpu_match_transformers() {
    // the golden logits of families.rs (transformers 5.17, scripts/hf_family_golden.py) against
    // the GPU: every row of 4 prompts, prefill (every prompt row's logits) and decode (one step
    // per generated token), cosine >= 0.9999 and transformers' greedy picks, all experts hot.
    // bf16 on disk; the FP8 variants (blocks 4 x 16) with their experts FP8 on the device
    use moelane_engine::config::Family;
    use moelane_engine::random_ckpt::{self, Dims};
    let Some(gpu) = gpu() else { return };
    let opts = EngineOptions {
        kv_tokens: 4096,
        progress: false,
    };
    // (family, the golden's suffix): bf16; FP8 experts kept FP8; gpt_oss's MXFP4 experts
    // (widened to bf16 at load), held to the CPU test's bound for MXFP4 (0.997: see families.rs)
    for (family, variant) in [
        (Family::Mixtral, ""),
        (Family::Qwen3Moe, ""),
        (Family::Qwen2Moe, ""),
        (Family::Glm4Moe, ""),
        (Family::DeepseekV3, ""),
        (Family::GptOss, ""),
        (Family::Qwen3Moe, "_fp8"),
        (Family::DeepseekV3, "_fp8"),
        (Family::GptOss, "_mxfp4"),
    ] {
        let name = format!("{}{variant}", family.name());
        let dir = tempfile::tempdir().unwrap();
        let d = Dims::for_family(family);
        random_ckpt::write(family, &d, 11, dir.path()).unwrap();
        match variant {
            "_fp8" => random_ckpt::to_fp8(dir.path(), [4, 16]).unwrap(),
            "_mxfp4" => random_ckpt::to_mxfp4(dir.path()).unwrap(),
            _ => {}
        }
        let min_cos = if variant == "_mxfp4" { 0.997 } else { 0.9999 };
        let (meta, want) = common::golden(&name);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let map = maps(&ckpt, 1).remove(0).1;
        let mut e = load_on_gpu(&ckpt, map, &opts, gpu.clone()).unwrap();
        let (worst, ok, all) = common::against_golden(&name, &meta, &want, min_cos, |p, gen| {
            common::prompt_logits(&mut e, p, gen)
        });
        eprintln!("{name} on the GPU: worst cosine vs transformers {worst:.7}, greedy {ok}/{all}");
        assert_eq!(
            ok, all,
            "{name}: GPU greedy picks differ from transformers'"
        );
    }
}

/// How many rows of `a` equal `b`'s bit for bit.
fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(a, b)| {
            a.iter()
                .map(|x| x.to_bits())
                .eq(b.iter().map(|x| x.to_bits()))
        })
        .count()
}

/// The GPU and `mini` (seed 1) in a temporary directory, with what the one-row tests
/// decode: the preset's hot experts per layer, engine options and 3 prompts.
struct Mini {
    gpu: std::sync::Arc<Gpu>,
    _dir: tempfile::TempDir,
    hot: usize,
    ckpt: Checkpoint,
    opts: EngineOptions,
    ps: Vec<Vec<u32>>,
}

/// [`Mini`]; None (the test skips) without a GPU.
fn mini_files() -> Option<Mini> {
    let gpu = gpu()?;
    let dir = tempfile::tempdir().unwrap();
    let p = moelane_engine::synth::Preset::by_name("mini").unwrap();
    moelane_engine::synth::generate(&p, 1, dir.path()).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let ps = prompts(ckpt.config.vocab_size, 3);
    Some(Mini {
        gpu,
        _dir: dir,
        hot: p.hot,
        ckpt,
        opts: EngineOptions {
            kv_tokens: 4096,
            progress: false,
        },
        ps,
    })
}

#[test]
fn one_row_persistent_step_matches_the_chain() {
    // a single decode row's MoE layers as the persistent kernel (step_one.cu) against the
    // chain of kernels: `mini` in bf16 as stored and widened to f32, 3 prompts decoded one
    // at a time for 72 greedy steps (past 64 positions, where decode attention splits into
    // ranges and the kernel merges them), all hot; the logits of every step the same bit
    // for bit, and the persistent kernel did run
    use moelane_engine::cuda_model::{attach_gpu, GpuModel, GpuOptions, WeightMode};
    let Some(Mini {
        gpu,
        _dir,
        hot,
        ckpt,
        opts,
        ps,
    }) = mini_files()
    else {
        return;
    };
    for weights in [WeightMode::Stored, WeightMode::F32] {
        let (_, map) = maps(&ckpt, hot).remove(0);
        let mut e = engine_from(&ckpt, map, &opts).unwrap();
        let dense = moelane_engine::model::DenseWeights::load(&ckpt).unwrap();
        let g = GpuModel::with_options(
            gpu.clone(),
            &ckpt.config,
            &dense,
            e.kv.blocks,
            GpuOptions {
                weights,
                persist: true,
                ..GpuOptions::default()
            },
        )
        .unwrap();
        if let Err(why) = g.persist_status() {
            panic!("{weights:?}: mini cannot take the persistent step: {why}");
        }
        attach_gpu(&mut e, g).unwrap();
        // every step's logits, and the picks the engine counted (the residency counters
        // read them from the kernels' pick buffer)
        let run = |e: &mut Engine, on: bool| -> (Vec<Vec<f32>>, Vec<Vec<u64>>) {
            e.gpu_mut().unwrap().set_persist(on);
            let before = e.counters.picks.clone();
            let l = ps.iter().flat_map(|p| decoded(e, p, 72)).collect();
            let picks = e
                .counters
                .picks
                .iter()
                .zip(&before)
                .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x - y).collect())
                .collect();
            (l, picks)
        };
        let (chain, chain_picks) = run(&mut e, false);
        let before = e.gpu_mut().unwrap().persist_runs();
        let (one, one_picks) = run(&mut e, true);
        let runs = e.gpu_mut().unwrap().persist_runs() - before;
        assert!(
            chain_picks == one_picks,
            "{weights:?}: the persistent step's picks differ from the chain's"
        );
        let same = same_bits(&chain, &one);
        eprintln!(
            "{weights:?}: {runs} runs took the persistent step; {same}/{} steps' logits bit-identical to the chain's",
            chain.len()
        );
        assert!(
            runs >= 3 * 72,
            "{weights:?}: the persistent step ran {runs} times"
        );
        assert_eq!(
            same,
            chain.len(),
            "{weights:?}: logits differ from the chain's"
        );
    }
}

#[test]
fn next_layer_guesses_change_no_result() {
    // a single row's router guessing the next MoE layer's picks, the combine asking the L2
    // for them (MOELANE_CUDA_GUESS): `mini` in bf16 as stored and widened to f32, all hot
    // and the preset's split, 3 prompts decoded for 40 greedy steps; every step's logits
    // and picks bit for bit those without guesses, and the guesses ran (named some picks)
    use moelane_engine::cuda_model::{attach_gpu, GpuModel, GpuOptions, WeightMode};
    let Some(Mini {
        gpu,
        _dir,
        hot,
        ckpt,
        opts,
        ps,
    }) = mini_files()
    else {
        return;
    };
    let dense = moelane_engine::model::DenseWeights::load(&ckpt).unwrap();
    for weights in [WeightMode::Stored, WeightMode::F32] {
        for (which, map) in maps(&ckpt, hot).into_iter().take(2) {
            // every step's logits, the picks counted, and the guesses' (hits, of)
            type Run = (Vec<Vec<f32>>, Vec<Vec<u64>>, (usize, usize));
            let run = |guess: bool| -> Run {
                let mut e = engine_from(&ckpt, map.clone(), &opts).unwrap();
                let g = GpuModel::with_options(
                    gpu.clone(),
                    &ckpt.config,
                    &dense,
                    e.kv.blocks,
                    GpuOptions {
                        weights,
                        guess,
                        ..GpuOptions::default()
                    },
                )
                .unwrap();
                assert_eq!(g.guesses(), guess, "{weights:?}: the stacked routers");
                attach_gpu(&mut e, g).unwrap();
                let mut logits = Vec::new();
                let mut hits = (0, 0);
                for prompt in &ps {
                    let mut seq = e.kv.new_seq();
                    let mut toks = prompt.clone();
                    for _ in 0..=40 {
                        let l = e
                            .step(&mut [SeqStep {
                                kv: &mut seq,
                                tokens: &toks,
                            }])
                            .unwrap();
                        toks = vec![moelane_engine::sampling::argmax(&l) as u32];
                        logits.push(l);
                        let (h, of) = e.gpu_mut().unwrap().guess_hits().unwrap();
                        hits = (hits.0 + h, hits.1 + of);
                    }
                }
                (logits, e.counters.picks.clone(), hits)
            };
            let (plain, plain_picks, none) = run(false);
            let (guessed, guessed_picks, hits) = run(true);
            assert_eq!(none, (0, 0), "guesses counted with guesses off");
            assert!(
                plain_picks == guessed_picks,
                "{weights:?} {which}: the picks differ with guesses"
            );
            let same = same_bits(&plain, &guessed);
            assert_eq!(
                same,
                plain.len(),
                "{weights:?} {which}: logits differ with guesses"
            );
            eprintln!(
                "{weights:?} {which}: the next-layer guesses named {} of {} picks",
                hits.0, hits.1
            );
            // every decode step guesses layers 1.. (the prefills, of several rows, do not)
            assert!(
                hits.1
                    >= 3 * 40
                        * (ckpt.config.moe_layers().len() - 1)
                        * ckpt.config.num_experts_per_tok
                    && hits.0 > 0,
                "{weights:?} {which}: the guesses did not run ({hits:?})"
            );
        }
    }
}

#[test]
fn a_prompt_prefilled_in_chunks_matches_one_prefill() {
    // a prompt's log-probabilities prefill it in chunks after earlier positions, every row's
    // logits taken (`step_whole`): each row as one whole prefill's, and the same next token
    let Some((_dir, ckpt, mut g)) = mini_on_gpu(1) else {
        return;
    };
    let v = ckpt.config.vocab_size;
    let base = &prompts(v, 1)[0];
    let prompt: Vec<u32> = base.iter().copied().cycle().take(700).collect();
    let mut seq = g.kv.new_seq();
    let whole = g
        .step_whole(
            &mut [SeqStep {
                kv: &mut seq,
                tokens: &prompt,
            }],
            &[true],
        )
        .unwrap();
    let mut seq2 = g.kv.new_seq();
    let mut chunked = Vec::new();
    for c in prompt.chunks(256) {
        chunked.extend(
            g.step_whole(
                &mut [SeqStep {
                    kv: &mut seq2,
                    tokens: c,
                }],
                &[true],
            )
            .unwrap(),
        );
    }
    assert_eq!(whole.len(), prompt.len() * v);
    assert_eq!(chunked.len(), whole.len());
    let (mut worst, mut same) = (1f64, 0);
    for (i, (a, b)) in whole.chunks(v).zip(chunked.chunks(v)).enumerate() {
        let c = cos(a, b);
        worst = worst.min(c);
        same += (a == b) as usize;
        assert_eq!(
            moelane_engine::sampling::argmax(a),
            moelane_engine::sampling::argmax(b),
            "row {i}: the next token, chunked vs whole"
        );
    }
    eprintln!(
        "700 positions in chunks of 256 against one prefill: {same} of 700 rows bit-identical, worst cosine {worst:.9}"
    );
    assert!(worst >= 0.99999, "worst cosine {worst}");
}

#[test]
fn a_prompt_prefilled_in_chunks_beside_a_decoding_row_matches_each_alone() {
    // what the scheduler's chunked prefill does: a long prompt goes 200 tokens a step while
    // another sequence decodes in the same steps (`step`, the last row's logits each); the
    // prompt's last logits are one whole prefill's, the decoding row's tokens its own alone
    let Some((_dir, ckpt, mut g)) = mini_on_gpu(1) else {
        return;
    };
    let v = ckpt.config.vocab_size;
    let ps = prompts(v, 2);
    let long: Vec<u32> = ps[0].iter().copied().cycle().take(900).collect();
    let alone_long = decoded(&mut g, &long, 0).remove(0);
    let chunks: Vec<&[u32]> = long.chunks(200).collect();
    let alone_short = decoded(&mut g, &ps[1], chunks.len());
    let (mut a, mut b) = (g.kv.new_seq(), g.kv.new_seq());
    // the short one's prefill first, alone
    let l = g
        .step(&mut [SeqStep {
            kv: &mut b,
            tokens: &ps[1],
        }])
        .unwrap();
    let mut tok = moelane_engine::sampling::argmax(&l) as u32;
    let mut last = Vec::new();
    for (s, c) in chunks.iter().enumerate() {
        let l = g
            .step(&mut [
                SeqStep {
                    kv: &mut a,
                    tokens: c,
                },
                SeqStep {
                    kv: &mut b,
                    tokens: &[tok],
                },
            ])
            .unwrap();
        assert_eq!(l.len(), 2 * v);
        let c = cos(&l[v..], &alone_short[s + 1]);
        assert!(c >= 0.99999, "decode step {s} beside a chunk: cosine {c}");
        tok = moelane_engine::sampling::argmax(&l[v..]) as u32;
        assert_eq!(
            tok,
            moelane_engine::sampling::argmax(&alone_short[s + 1]) as u32,
            "decode step {s}: the token beside a chunk"
        );
        last = l[..v].to_vec();
    }
    let c = cos(&last, &alone_long);
    eprintln!(
        "900 positions in chunks of 200 beside a decoding row: last row cosine {c:.9}, bit-identical {}",
        last == alone_long
    );
    assert!(c >= 0.99999, "the chunked prompt's last logits: cosine {c}");
    assert_eq!(
        moelane_engine::sampling::argmax(&last),
        moelane_engine::sampling::argmax(&alone_long)
    );
}
