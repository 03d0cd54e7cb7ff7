//! Logits agreement with Hugging Face transformers on the `tiny` checkpoint, at every
//! position of five prompts (one per language), prefill and decode. The golden file was
//! produced by scripts/hf_golden.py (see its header for the command).

mod common;

use moelane_engine::step::SeqStep;
use moelane_engine::tokenizer::Tokenizer;
use serde_json::Value;
use sha2::{Digest, Sha256};

fn f16s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

#[test]
fn logits_match_transformers_prefill_and_decode() {
    let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/");
    let meta: Value =
        serde_json::from_slice(&std::fs::read(format!("{golden}hf_tiny.json")).unwrap()).unwrap();
    let logits = f16s(&std::fs::read(format!("{golden}hf_tiny.f16")).unwrap());
    let dir = common::tiny();
    let sha = Sha256::digest(std::fs::read(dir.join("model.safetensors")).unwrap());
    let sha: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        sha,
        meta["checkpoint_sha256"].as_str().unwrap(),
        "the tiny checkpoint changed: regenerate the golden file with scripts/hf_golden.py"
    );
    let vocab = meta["vocab"].as_u64().unwrap() as usize;
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    // under the fitted map (some experts cold) and all hot: both must match
    for map in [
        None,
        Some(moelane_engine::rowmap::Rowmap::all_hot(
            &moelane_engine::checkpoint::Checkpoint::open(dir)
                .unwrap()
                .id,
            2,
            64,
        )),
    ] {
        let mut eng = common::engine(dir, map);
        let mut row0 = 0usize;
        let (mut worst_cos, mut worst_abs) = (1f64, 0f32);
        for p in meta["prompts"].as_array().unwrap() {
            let ids: Vec<u32> = p["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let gen: Vec<u32> = p["generated"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                tok.encode(p["prompt"].as_str().unwrap()).unwrap(),
                ids,
                "tokenizer disagrees with the tokenizers library"
            );
            let mut seq = eng.kv.new_seq();
            let mut ours = eng
                .step_with(
                    &mut [SeqStep {
                        kv: &mut seq,
                        tokens: &ids,
                    }],
                    true,
                )
                .unwrap();
            for &t in &gen {
                ours.extend(
                    eng.step(&mut [SeqStep {
                        kv: &mut seq,
                        tokens: &[t],
                    }])
                    .unwrap(),
                );
            }
            let rows = p["rows"].as_u64().unwrap() as usize;
            assert_eq!(ours.len(), rows * vocab);
            for r in 0..rows {
                let a = &ours[r * vocab..(r + 1) * vocab];
                let b = &logits[(row0 + r) * vocab..(row0 + r + 1) * vocab];
                let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
                let mut max_abs = 0f32;
                for (x, y) in a.iter().zip(b) {
                    dot += (*x as f64) * (*y as f64);
                    na += (*x as f64).powi(2);
                    nb += (*y as f64).powi(2);
                    // the golden values are float16: allow their rounding
                    let tol = 2e-2 + y.abs() * 1e-3;
                    assert!(
                        (x - y).abs() <= tol,
                        "prompt {:?} row {r}: logit {x} vs transformers {y}",
                        p["prompt"]
                    );
                    max_abs = max_abs.max((x - y).abs());
                }
                let cos = dot / (na.sqrt() * nb.sqrt());
                assert!(
                    cos >= 0.9999,
                    "prompt {:?} row {r}: cosine {cos}",
                    p["prompt"]
                );
                worst_cos = worst_cos.min(cos);
                worst_abs = worst_abs.max(max_abs);
            }
            // greedy picks agree with transformers' at every decode step
            for (i, &t) in gen.iter().enumerate() {
                let r = ids.len() - 1 + i;
                let a = &ours[r * vocab..(r + 1) * vocab];
                assert_eq!(
                    moelane_engine::sampling::argmax(a) as u32,
                    t,
                    "decode step {i} of {:?}",
                    p["prompt"]
                );
            }
            row0 += rows;
        }
        eprintln!("worst cosine {worst_cos:.7}, worst max-abs {worst_abs:.5}");
    }
}
