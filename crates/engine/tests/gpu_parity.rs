//! GPU expert compute against the CPU bank (feature `cuda`; skips, saying why, where there is
//! no CUDA device): every expert of `tiny` and `mini` resident on the GPU, random picks at
//! decode and prefill sizes, outputs compared row by row.
#![cfg(feature = "cuda")]

mod common;

use common::cos;

use moelane_engine::bank::{ExpertBank, Pick};
use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::cuda::Gpu;
use moelane_engine::cuda_experts::GpuExperts;
use moelane_engine::rng::Rng;
use moelane_engine::rowmap::{Rowmap, Tier};

#[test]
fn gpu_experts_match_the_cpu_bank() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIP gpu parity: {e}");
            return;
        }
    };
    eprintln!("device cuda:0 {} sm_{}{}", gpu.name, gpu.cc.0, gpu.cc.1);
    for preset in ["tiny", "mini"] {
        let dir = tempfile::tempdir().unwrap();
        let p = moelane_engine::synth::Preset::by_name(preset).unwrap();
        moelane_engine::synth::generate(&p, 1, dir.path()).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let moe = ckpt.config.moe_layers();
        let (layers, experts) = (moe.len(), ckpt.config.num_experts);
        // every expert on the tier under test
        let mut m = Rowmap::all_hot(&ckpt.id, layers, experts);
        for l in &mut m.layers {
            l.cold = std::mem::take(&mut l.hot);
        }
        let vm = m.validate(&ckpt.id, layers, experts, None).unwrap();
        let bank = ExpertBank::load(&ckpt, &vm, Tier::Cold, &moe, None).unwrap();
        let mut ge = GpuExperts::new(gpu.clone(), bank.hidden, bank.inter).unwrap();
        ge.sync(&bank).unwrap();
        assert_eq!(ge.resident(), layers * experts);
        let h = bank.hidden;
        let mut rng = Rng::new(7);
        let mut worst = 1.0f64;
        let mut worst_abs = 0f32;
        for layer in 0..layers {
            for (rows, picks) in [(1usize, 6usize), (4, 24), (64, 384)] {
                let acts: Vec<f32> = (0..rows * h).map(|_| rng.normal()).collect();
                let picks: Vec<Pick> = (0..picks)
                    .map(|_| Pick {
                        row: rng.below(rows) as u32,
                        expert: rng.below(experts) as u16,
                    })
                    .collect();
                let mut a = vec![0f32; picks.len() * h];
                let mut b = vec![0f32; picks.len() * h];
                bank.compute(layer, &picks, &acts, &mut a).unwrap();
                ge.compute(layer, &picks, &acts, &mut b).unwrap();
                for i in 0..picks.len() {
                    let (ra, rb) = (&a[i * h..(i + 1) * h], &b[i * h..(i + 1) * h]);
                    worst = worst.min(cos(ra, rb));
                    for (x, y) in ra.iter().zip(rb) {
                        worst_abs = worst_abs.max((x - y).abs());
                    }
                }
            }
        }
        eprintln!("{preset}: worst row cosine {worst:.7}, worst abs difference {worst_abs:.2e}");
        assert!(
            worst >= 0.99999,
            "{preset}: GPU experts disagree (cos {worst})"
        );
        // a pick of an expert that is not resident is refused, naming it
        let mut one = Rowmap::all_hot(&ckpt.id, layers, experts);
        one.layers[0].hot.retain(|&e| e != 3);
        one.layers[0].cold.push(3);
        let vm = one.validate(&ckpt.id, layers, experts, None).unwrap();
        let small = ExpertBank::load(&ckpt, &vm, Tier::Cold, &moe, None).unwrap();
        ge.sync(&small).unwrap();
        assert_eq!(ge.resident(), 1);
        let mut out = vec![0f32; h];
        let e = ge
            .compute(0, &[Pick { row: 0, expert: 4 }], &vec![0.5; h], &mut out)
            .unwrap_err();
        assert!(e.to_string().contains("4"), "{e}");
        ge.compute(0, &[Pick { row: 0, expert: 3 }], &vec![0.5; h], &mut out)
            .unwrap();
    }
}
