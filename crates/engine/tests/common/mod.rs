//! Shared fixtures: the `tiny` checkpoint, generated once per test binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::load::{engine_from, EngineOptions};
use moelane_engine::rowmap::Rowmap;
use moelane_engine::step::{Engine, SeqStep};
use moelane_engine::synth::{generate, Preset};

/// A fresh directory under the system temp dir (removed by the OS, not by us: tests share it).
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "moelane-test-{}-{}-{}",
        name,
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// The tiny checkpoint (seed 1) with its fitted rowmap.json.
pub fn tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = scratch("tiny");
        let p = Preset::by_name("tiny").unwrap();
        generate(&p, 1, &d).unwrap();
        moelane_engine::figures::measure(&d, p.hot, 64).unwrap();
        d
    })
}

pub fn engine(dir: &Path, map: Option<Rowmap>) -> Engine {
    let ckpt = Checkpoint::open(dir).unwrap();
    let map = moelane_engine::load::resolve_map(&ckpt, map).unwrap();
    engine_from(
        &ckpt,
        map,
        &EngineOptions {
            kv_tokens: 8192,
            progress: false,
        },
    )
    .unwrap()
}

/// Cosine similarity of two vectors, in f64.
pub fn cos(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += (*x as f64) * (*y as f64);
        aa += (*x as f64).powi(2);
        bb += (*y as f64).powi(2);
    }
    ab / (aa.sqrt() * bb.sqrt()).max(1e-30)
}

/// Greedy continuation of `p` on `e`, `n` tokens, and the logits of the prompt's last row.
pub fn greedy_one(e: &mut Engine, p: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let v = e.cfg.vocab_size;
    let mut seq = e.kv.new_seq();
    let mut l = e
        .step(&mut [SeqStep {
            kv: &mut seq,
            tokens: p,
        }])
        .unwrap();
    let first = l[l.len() - v..].to_vec();
    let mut got = Vec::new();
    for _ in 0..n {
        let t = moelane_engine::sampling::argmax(&l[l.len() - v..]) as u32;
        got.push(t);
        l = e
            .step(&mut [SeqStep {
                kv: &mut seq,
                tokens: &[t],
            }])
            .unwrap();
    }
    (got, first)
}

/// The logits of `prompt` (every row, one prefill step) then of each token of `feed` (one
/// decode step each): rows * vocab, on a fresh sequence of `e`.
pub fn prompt_logits(e: &mut Engine, prompt: &[u32], feed: &[u32]) -> Vec<f32> {
    let mut seq = e.kv.new_seq();
    let mut out = e
        .step_with(
            &mut [SeqStep {
                kv: &mut seq,
                tokens: prompt,
            }],
            true,
        )
        .unwrap();
    for &t in feed {
        out.extend(
            e.step(&mut [SeqStep {
                kv: &mut seq,
                tokens: &[t],
            }])
            .unwrap(),
        );
    }
    out
}

/// Token ids of a JSON array.
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The golden file `hf_<name>` of tests/golden (scripts/hf_family_golden.py): its metadata
/// and its logits (f16, widened).
pub fn golden(name: &str) -> (serde_json::Value, Vec<f32>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let meta = serde_json::from_slice(
        &std::fs::read(dir.join(format!("hf_{name}.json")))
            .unwrap_or_else(|e| panic!("golden file of {name}: {e} (scripts/hf_family_golden.py)")),
    )
    .unwrap();
    let want = std::fs::read(dir.join(format!("hf_{name}.f16")))
        .unwrap()
        .chunks_exact(2)
        .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect();
    (meta, want)
}

/// Holds `ours(prompt, generated)` (the logits of each golden prompt and its generated
/// tokens, rows * vocab) to the golden logits: cosine >= `min_cos` at every row (asserted);
/// returns the worst cosine and transformers' greedy picks reproduced, of all.
pub fn against_golden(
    name: &str,
    meta: &serde_json::Value,
    want: &[f32],
    min_cos: f64,
    mut ours: impl FnMut(&[u32], &[u32]) -> Vec<f32>,
) -> (f64, usize, usize) {
    let vocab = meta["vocab"].as_u64().unwrap() as usize;
    let (mut row0, mut worst, mut ok, mut all) = (0usize, 1f64, 0, 0);
    for pm in meta["prompts"].as_array().unwrap() {
        let (p, gen) = (json_ids(&pm["ids"]), json_ids(&pm["generated"]));
        let got = ours(&p, &gen);
        let rows = pm["rows"].as_u64().unwrap() as usize;
        assert_eq!(got.len(), rows * vocab, "{name}: rows of logits");
        for r in 0..rows {
            let c = cos(
                &got[r * vocab..(r + 1) * vocab],
                &want[(row0 + r) * vocab..(row0 + r + 1) * vocab],
            );
            assert!(
                c >= min_cos,
                "{name}: prompt of {} row {r}: cosine {c}",
                p.len()
            );
            worst = worst.min(c);
        }
        for (i, &t) in gen.iter().enumerate() {
            let r = p.len() - 1 + i;
            all += 1;
            ok += (moelane_engine::sampling::argmax(&got[r * vocab..(r + 1) * vocab]) as u32 == t)
                as usize;
        }
        row0 += rows;
    }
    (worst, ok, all)
}

/// Greedy continuations of `n` tokens of every prompt, decoded together in one batch.
pub fn batched(eng: &mut Engine, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let mut seqs: Vec<_> = prompts.iter().map(|_| eng.kv.new_seq()).collect();
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let mut out = vec![Vec::new(); prompts.len()];
    let v = eng.cfg.vocab_size;
    for _ in 0..n {
        let mut steps: Vec<SeqStep> = seqs
            .iter_mut()
            .zip(&inputs)
            .map(|(s, t)| SeqStep { kv: s, tokens: t })
            .collect();
        let logits = eng.step(&mut steps).unwrap();
        for (i, o) in out.iter_mut().enumerate() {
            let t = moelane_engine::sampling::argmax(&logits[i * v..(i + 1) * v]) as u32;
            o.push(t);
            inputs[i] = vec![t];
        }
    }
    out
}
