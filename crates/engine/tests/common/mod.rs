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
