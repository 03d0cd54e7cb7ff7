//! The in-memory synthetic models (the `station` preset's construction) on the CPU: the
//! counter-hash expert generator is deterministic, shaped like the file presets' experts
//! (language and constant dims zero), scaled as documented and pinned to golden bits (the
//! GPU kernel must give the same bits: tests/gpu_dense.rs); the dense part builds in memory
//! and a model made of it and generated experts decodes deterministically.

use std::sync::Arc;

use moelane_engine::bank::ExpertBank;
use moelane_engine::cpu::CpuBackend;
use moelane_engine::kv::KvCache;
use moelane_engine::rowmap::{Rowmap, Tier};
use moelane_engine::step::Engine;
use moelane_engine::synth::{self, hashed_expert, hashed_fill, Preset, HASHED_ZERO};

#[test]
fn generator_is_deterministic_structured_and_pinned() {
    let (h, i) = (64usize, 32usize);
    let a = hashed_expert(9, 2, 5, h, i);
    let b = hashed_expert(9, 2, 5, h, i);
    let f = |m: &moelane_engine::ops::Matrix| m.to_f32().into_owned();
    assert_eq!(a.gate_up.data, b.gate_up.data);
    assert_eq!(a.down.data, b.down.data);
    let c = hashed_expert(9, 2, 6, h, i);
    assert_ne!(a.gate_up.data, c.gate_up.data);
    assert_ne!(a.down.data, hashed_expert(10, 2, 5, h, i).down.data);
    // gate/up: the first HASHED_ZERO columns of every row are zero; down: the first rows
    for r in 0..2 * i {
        let gu = f(&a.gate_up);
        let row = &gu[r * h..(r + 1) * h];
        assert!(row[..HASHED_ZERO].iter().all(|&v| v == 0.0));
        assert!(row[HASHED_ZERO..].iter().any(|&v| v != 0.0));
    }
    assert!(f(&a.down)[..HASHED_ZERO * i].iter().all(|&v| v == 0.0));
    // scale: gate/up entries have variance 1/h, down entries 1/i (Irwin-Hall(4) scaled)
    let var = |v: &[f32]| {
        let nz: Vec<f64> = v.iter().filter(|&&x| x != 0.0).map(|&x| x as f64).collect();
        nz.iter().map(|x| x * x).sum::<f64>() / nz.len() as f64
    };
    let big = hashed_expert(1, 0, 0, 512, 256);
    let vg = var(&f(&big.gate_up)) * 512.0;
    let vd = var(&f(&big.down)) * 256.0;
    assert!((vg - 1.0).abs() < 0.03, "gate/up variance x h = {vg}");
    assert!((vd - 1.0).abs() < 0.03, "down variance x i = {vd}");
    // golden bits: a change here changes every generated model (and must change the GPU kernel)
    let mut w = vec![0f32; 8];
    hashed_fill(&mut w, 4, 1, 0, 0x1234_5678_9abc_def0, 1.0);
    let bits: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits[0], 0);
    assert_eq!(bits[4], 0);
    eprintln!("golden {bits:08x?}");
    assert_eq!(
        bits,
        GOLDEN.to_vec(),
        "the hashed generator changed: update GOLDEN only with the GPU kernel"
    );
}

const GOLDEN: [u32; 8] = [
    0x00000000, 0xbe979e68, 0xbf32f3de, 0xbf0e2630, 0x00000000, 0x3f325e08, 0xbede85d8, 0xbf623f20,
];

#[test]
fn in_memory_model_builds_and_decodes() {
    let p = Preset::by_name("tiny").unwrap();
    let m = synth::in_memory(&p, 3).unwrap();
    let c = &m.config;
    assert_eq!(c.num_hidden_layers, p.layers);
    assert_eq!(c.num_experts, p.experts);
    assert_eq!(m.dense.layers.len(), p.layers);
    let prompts = m.prompt_ids().unwrap();
    assert!(prompts.len() >= 5 && prompts.iter().all(|p| !p.is_empty()));
    let run = || {
        let moe = c.moe_layers();
        let mut bank = ExpertBank::empty(
            Tier::Hot,
            moe.len(),
            c.num_experts,
            c.hidden_size,
            c.moe_intermediate_size,
        );
        for ml in 0..moe.len() {
            for e in 0..c.num_experts {
                let w = hashed_expert(m.seed, ml, e, c.hidden_size, c.moe_intermediate_size);
                bank.insert(ml, e, Arc::new(w));
            }
        }
        let map = Rowmap::all_hot(&m.id, moe.len(), c.num_experts)
            .validate(&m.id, moe.len(), c.num_experts, None)
            .unwrap();
        let dense = synth::in_memory(&p, 3).unwrap().dense;
        let mut e = Engine::new(
            c.clone(),
            Box::new(CpuBackend::new(c.clone(), dense)),
            bank,
            None,
            map,
            KvCache::blocks_for(512),
        );
        e.greedy(&prompts[0], 8).unwrap()
    };
    let a = run();
    assert_eq!(a.len(), 8);
    assert_eq!(a, run());
}
