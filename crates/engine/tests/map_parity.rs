//! Bitwise greedy parity across maps: 64-token greedy continuations of 25 prompts in all
//! five languages are identical under an all-hot map, the fitted initial map, random maps
//! and an all-cold map, decoded one at a time and all together in one batch.

mod common;

use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::rng::Rng;
use moelane_engine::rowmap::{LayerMap, Rowmap};
use moelane_engine::synth::{prompts, LANGS};
use moelane_engine::tokenizer::Tokenizer;

const NEW: usize = 64;

fn random_map(id: &str, layers: usize, experts: usize, hot: usize, seed: u64) -> Rowmap {
    let mut r = Rng::new(seed);
    Rowmap {
        version: 1,
        model: id.into(),
        epoch: 7,
        layers: (0..layers)
            .map(|_| {
                let mut ids: Vec<u16> = (0..experts as u16).collect();
                r.shuffle(&mut ids);
                LayerMap {
                    hot: ids[..hot].to_vec(),
                    cold: ids[hot..].to_vec(),
                }
            })
            .collect(),
    }
}

#[test]
fn greedy_is_bitwise_identical_under_any_map() {
    let dir = common::tiny();
    let ckpt = Checkpoint::open(dir).unwrap();
    let (layers, experts) = (ckpt.config.moe_layers().len(), ckpt.config.num_experts);
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let ps: Vec<Vec<u32>> = (0..LANGS.len())
        .flat_map(|l| prompts(l).into_iter().take(5))
        .map(|p| tok.encode(p).unwrap())
        .collect();
    assert!(ps.len() >= 20);

    let mut reference = common::engine(dir, Some(Rowmap::all_hot(&ckpt.id, layers, experts)));
    let want: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| reference.greedy(p, NEW).unwrap())
        .collect();
    // the answers are not degenerate
    let distinct: std::collections::BTreeSet<u32> = want.iter().flatten().copied().collect();
    assert!(
        distinct.len() > 100,
        "only {} distinct tokens",
        distinct.len()
    );

    let all_cold = Rowmap {
        epoch: 1,
        ..Rowmap::all_cold(&ckpt.id, layers, experts)
    };
    let maps: Vec<(&str, Option<Rowmap>)> = vec![
        ("initial", None),
        ("random", Some(random_map(&ckpt.id, layers, experts, 48, 1))),
        (
            "random-small-hot",
            Some(random_map(&ckpt.id, layers, experts, 5, 2)),
        ),
        ("all-cold", Some(all_cold)),
    ];
    for (name, map) in maps {
        let mut eng = common::engine(dir, map);
        let got: Vec<Vec<u32>> = ps.iter().map(|p| eng.greedy(p, NEW).unwrap()).collect();
        let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert_eq!(same, ps.len(), "map {name}: {same}/{} identical", ps.len());
        let cold: u64 = eng.counters.cold_picks.iter().sum();
        if name != "initial" {
            assert!(cold > 0, "map {name} sent nothing to the cold tier");
        }
        // all prompts decoded together in one batch give the same tokens
        let got = common::batched(&mut eng, &ps, NEW);
        let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert_eq!(
            same,
            ps.len(),
            "map {name}, batched: {same}/{} identical",
            ps.len()
        );
    }
}

#[test]
fn a_bf16_kv_cache_halves_the_bytes_and_keeps_every_parity() {
    // the KV cache in bf16 (`--kv-dtype bf16`): half the host bytes; under it, greedy tokens
    // are the same bitwise whatever the map and whatever the batch (each row's attention
    // reads the same rounded values in the same order); its prompt logits stay within bf16's
    // rounding of the f32 cache's (cosine >= 0.999 after 4 decode steps); it cannot change
    // while a sequence is live
    use moelane_engine::kv::KvDtype;
    use moelane_engine::step::SeqStep;
    let dir = common::tiny();
    let ckpt = Checkpoint::open(dir).unwrap();
    let (layers, experts) = (ckpt.config.moe_layers().len(), ckpt.config.num_experts);
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let ps: Vec<Vec<u32>> = (0..LANGS.len())
        .flat_map(|l| prompts(l).into_iter().take(3))
        .map(|p| tok.encode(p).unwrap())
        .collect();
    let bf16 = |map: Option<Rowmap>| {
        let mut e = common::engine(dir, map);
        let f32_bytes = e.kv.host_bytes();
        e.set_kv_dtype(KvDtype::Bf16).unwrap();
        assert_eq!(
            e.kv.host_bytes() * 2,
            f32_bytes,
            "bf16 holds half the bytes"
        );
        e
    };
    let mut hot = bf16(Some(Rowmap::all_hot(&ckpt.id, layers, experts)));
    let want: Vec<Vec<u32>> = ps.iter().map(|p| hot.greedy(p, NEW).unwrap()).collect();
    let mut cold = bf16(Some(random_map(&ckpt.id, layers, experts, 5, 2)));
    let got: Vec<Vec<u32>> = ps.iter().map(|p| cold.greedy(p, NEW).unwrap()).collect();
    assert!(got == want, "bf16 KV: the map changed the tokens");
    let got = common::batched(&mut cold, &ps, NEW);
    assert!(got == want, "bf16 KV: the batch changed the tokens");
    // against the f32 cache
    let mut f32e = common::engine(dir, None);
    let feed: Vec<u32> = want[0][..4].to_vec();
    let a = common::prompt_logits(&mut f32e, &ps[0], &feed);
    let b = common::prompt_logits(&mut hot, &ps[0], &feed);
    let v = ckpt.config.vocab_size;
    let worst = a
        .chunks_exact(v)
        .zip(b.chunks_exact(v))
        .map(|(x, y)| common::cos(x, y))
        .fold(1f64, f64::min);
    let same = want
        .iter()
        .zip(&ps)
        .filter(|(w, p)| f32e.greedy(p, NEW).unwrap() == **w)
        .count();
    eprintln!(
        "bf16 KV: logits cosine vs f32 KV >= {worst:.6}; {same}/{} greedy answers identical to the f32 cache's",
        ps.len()
    );
    assert!(worst >= 0.999, "bf16 KV logits vs f32: cosine {worst}");
    // no change under a live sequence
    let mut e = common::engine(dir, None);
    let mut seq = e.kv.new_seq();
    e.step(&mut [SeqStep {
        kv: &mut seq,
        tokens: &ps[0],
    }])
    .unwrap();
    let err = e.set_kv_dtype(KvDtype::Bf16).unwrap_err().to_string();
    assert!(err.contains("live"), "{err}");
}
