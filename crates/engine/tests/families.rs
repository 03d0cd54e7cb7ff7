//! Every family against Hugging Face transformers: a random checkpoint of each
//! (`random_ckpt`, bf16, the family's released layout), transformers' logits at every position
//! of several prompts, prefill and decode (golden files made by scripts/hf_family_golden.py),
//! cosine >= 0.9999 at every row; transformers' greedy picks reproduced; and the greedy
//! continuation bitwise the same under all-hot, split, random and all-cold maps.

mod common;

use std::path::{Path, PathBuf};

use moelane_engine::config::Family;
use moelane_engine::random_ckpt::{self, Dims};
use moelane_engine::rowmap::Rowmap;
use moelane_engine::step::SeqStep;
use serde_json::Value;
use sha2::{Digest, Sha256};

const FAMILIES: [Family; 6] = [
    Family::Mixtral,
    Family::Qwen3Moe,
    Family::Qwen2Moe,
    Family::Glm4Moe,
    Family::DeepseekV3,
    Family::GptOss,
];
const SEED: u64 = 11;
const PROMPTS: usize = 4;

/// FP8 variants tested against transformers: the families that ship FP8 checkpoints
/// (Qwen3-*-FP8, DeepSeek-V3), blocks small enough that every matrix has several.
const FP8: [Family; 2] = [Family::Qwen3Moe, Family::DeepseekV3];
const FP8_BLOCK: [usize; 2] = [4, 16];

/// The FP8 variant of `family`'s random checkpoint, in `root/<family>_fp8`.
fn fp8_checkpoint(family: Family, root: &Path) -> PathBuf {
    let dir = write_random(family, root, &format!("{}_fp8", family.name()));
    random_ckpt::to_fp8(&dir, FP8_BLOCK).unwrap();
    dir
}

/// gpt_oss as released: MXFP4 experts, in `root/gpt_oss_mxfp4`.
fn mxfp4_checkpoint(root: &Path) -> PathBuf {
    let dir = write_random(Family::GptOss, root, "gpt_oss_mxfp4");
    random_ckpt::to_mxfp4(&dir).unwrap();
    dir
}

fn checkpoint(family: Family, root: &Path) -> PathBuf {
    write_random(family, root, family.name())
}

fn write_random(family: Family, root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    let d = Dims::for_family(family);
    random_ckpt::write(family, &d, SEED, &dir).unwrap();
    let prompts = random_ckpt::prompts(d.vocab, PROMPTS, SEED);
    std::fs::write(
        dir.join("prompts.json"),
        serde_json::to_vec(&prompts).unwrap(),
    )
    .unwrap();
    dir
}

/// Writes the checkpoints for the golden script (into $MOELANE_FAMILY_CKPTS; a no-op without it).
#[test]
fn write_checkpoints() {
    if let Some(root) = std::env::var_os("MOELANE_FAMILY_CKPTS") {
        for f in FAMILIES {
            eprintln!("wrote {}", checkpoint(f, Path::new(&root)).display());
        }
        for f in FP8 {
            eprintln!("wrote {}", fp8_checkpoint(f, Path::new(&root)).display());
        }
        eprintln!("wrote {}", mxfp4_checkpoint(Path::new(&root)).display());
    }
}

/// Our logits for `prompt` then each of `feed` (one decode step each): rows * vocab.
fn logits(dir: &Path, map: Option<Rowmap>, prompt: &[u32], feed: &[u32]) -> Vec<f32> {
    common::prompt_logits(&mut common::engine(dir, map), prompt, feed)
}

#[test]
fn every_family_matches_transformers_and_does_not_depend_on_the_map() {
    let root = common::scratch("families");
    // every family in bf16, then the FP8 variants (hf_<family>_fp8.*)
    let mut cases: Vec<(Family, String, PathBuf)> = FAMILIES
        .iter()
        .map(|&f| (f, f.name().to_string(), checkpoint(f, &root)))
        .collect();
    cases.extend(
        FP8.iter()
            .map(|&f| (f, format!("{}_fp8", f.name()), fp8_checkpoint(f, &root))),
    );
    cases.push((
        Family::GptOss,
        "gpt_oss_mxfp4".into(),
        mxfp4_checkpoint(&root),
    ));
    for (family, name, dir) in cases {
        let (meta, want) = common::golden(&name);
        let sha: String = Sha256::digest(std::fs::read(dir.join("model.safetensors")).unwrap())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            sha,
            meta["checkpoint_sha256"].as_str().unwrap(),
            "{name}: the random checkpoint changed: regenerate its golden file"
        );
        let d = Dims::for_family(family);
        let prompts = random_ckpt::prompts(d.vocab, PROMPTS, SEED);
        // gpt_oss's MXFP4 against transformers' own MXFP4 path (`Mxfp4Config(dequantize=
        // True)`): 0.9982 at worst, greedy the same; why it is not 0.9999 as the bf16 golden
        // is (its widened experts may compute in bf16) is not established
        let min_cos = if name.ends_with("mxfp4") {
            0.997
        } else {
            0.9999
        };
        for (p, pm) in prompts.iter().zip(meta["prompts"].as_array().unwrap()) {
            assert_eq!(
                &common::json_ids(&pm["ids"]),
                p,
                "{name}: the golden file's prompt"
            );
        }
        let (worst, greedy_ok, greedy_all) =
            common::against_golden(&name, &meta, &want, min_cos, |p, gen| {
                logits(&dir, None, p, gen)
            });
        eprintln!(
            "{name}: worst cosine {worst:.7}, greedy {greedy_ok}/{greedy_all} as transformers"
        );
        assert_eq!(
            greedy_ok, greedy_all,
            "{name}: greedy picks differ from transformers'"
        );

        // the map changes nothing: all hot, every other expert cold, a random half, all cold
        let ckpt = moelane_engine::checkpoint::Checkpoint::open(&dir).unwrap();
        let (layers, ne) = (ckpt.config.moe_layers().len(), ckpt.config.num_experts);
        let mut maps = vec![("all-hot", Rowmap::all_hot(&ckpt.id, layers, ne))];
        let mut split = Rowmap::all_hot(&ckpt.id, layers, ne);
        let mut random = Rowmap::all_hot(&ckpt.id, layers, ne);
        let mut cold = Rowmap::all_hot(&ckpt.id, layers, ne);
        let mut rng = moelane_engine::rng::Rng::new(5);
        for l in 0..layers {
            let all: Vec<u16> = (0..ne as u16).collect();
            split.layers[l].hot = all.iter().copied().filter(|e| e % 2 == 0).collect();
            split.layers[l].cold = all.iter().copied().filter(|e| e % 2 == 1).collect();
            let (h, c): (Vec<u16>, Vec<u16>) = all.iter().partition(|_| rng.uniform() < 0.5);
            random.layers[l].hot = h;
            random.layers[l].cold = c;
            cold.layers[l].hot = Vec::new();
            cold.layers[l].cold = all;
        }
        maps.extend([("split", split), ("random", random), ("all-cold", cold)]);
        for p in &prompts {
            let base =
                common::greedy_one(&mut common::engine(&dir, Some(maps[0].1.clone())), p, 12).0;
            for (mname, m) in &maps[1..] {
                assert_eq!(
                    common::greedy_one(&mut common::engine(&dir, Some(m.clone())), p, 12).0,
                    base,
                    "{name}: greedy continuation under the {mname} map"
                );
            }
        }
    }
}

/// With `tie_word_embeddings` the embedding is the head, as transformers and vLLM read it,
/// even where the checkpoint also stores an `lm_head.weight` (here a different one).
#[test]
fn tied_embeddings_ignore_a_stored_head() {
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::synth::{write_safetensors_as, StoreAs};
    use std::collections::BTreeMap;
    let root = common::scratch("tied-head");
    let base = checkpoint(Family::Qwen3Moe, &root);
    let ck = Checkpoint::open(&base).unwrap();
    let mut t: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for name in ck.tensor_names() {
        let shape = ck.raw(&name).unwrap().shape.to_vec();
        t.insert(
            name.clone(),
            (shape.clone(), ck.tensor(&name, &shape).unwrap()),
        );
    }
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(base.join("config.json")).unwrap()).unwrap();
    cfg["tie_word_embeddings"] = true.into();
    let write = |dir: &Path, t: &BTreeMap<String, (Vec<usize>, Vec<f32>)>| {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        write_safetensors_as(&dir.join("model.safetensors"), t, StoreAs::Bf16).unwrap();
    };
    let (with_head, without) = (root.join("tied_with_head"), root.join("tied_without"));
    let mut other = t.clone();
    if let Some((_, w)) = other.get_mut("lm_head.weight") {
        w.iter_mut().for_each(|x| *x = -*x * 0.5);
    }
    write(&with_head, &other);
    t.remove("lm_head.weight");
    write(&without, &t);
    let p = &random_ckpt::prompts(ck.config.vocab_size, 1, SEED)[0];
    assert_eq!(
        logits(&with_head, None, p, &[5, 6]),
        logits(&without, None, p, &[5, 6])
    );
}

#[test]
fn mixtral_in_the_fused_layout_loads_to_the_same_logits() {
    // the random mixtral rewritten the way a fused-expert writer lays it out: the sparse block
    // under `mlp` (`mlp.gate`, `mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::synth::{write_safetensors_as, StoreAs};
    use std::collections::BTreeMap;
    let root = common::scratch("mixtral-fused");
    let released = checkpoint(Family::Mixtral, &root);
    let ck = Checkpoint::open(&released).unwrap();
    let c = ck.config.clone();
    let (e, h, i) = (c.num_experts, c.hidden_size, c.moe_intermediate_size);
    let mut t: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for name in ck.tensor_names() {
        if name.contains(".block_sparse_moe.") {
            continue;
        }
        let shape = ck.raw(&name).unwrap().shape.to_vec();
        t.insert(
            name.clone(),
            (shape.clone(), ck.tensor(&name, &shape).unwrap()),
        );
    }
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}.block_sparse_moe");
        let (mut gu, mut dn) = (Vec::new(), Vec::new());
        for x in 0..e {
            let w = |n: &str, s: &[usize]| {
                ck.tensor(&format!("{p}.experts.{x}.{n}.weight"), s)
                    .unwrap()
            };
            gu.extend(w("w1", &[i, h]));
            gu.extend(w("w3", &[i, h]));
            dn.extend(w("w2", &[h, i]));
        }
        let q = format!("model.layers.{l}.mlp");
        t.insert(format!("{q}.experts.gate_up_proj"), (vec![e, 2 * i, h], gu));
        t.insert(format!("{q}.experts.down_proj"), (vec![e, h, i], dn));
        t.insert(
            format!("{q}.gate.weight"),
            (
                vec![e, h],
                ck.tensor(&format!("{p}.gate.weight"), &[e, h]).unwrap(),
            ),
        );
    }
    let fused = root.join("fused");
    std::fs::create_dir_all(&fused).unwrap();
    std::fs::copy(released.join("config.json"), fused.join("config.json")).unwrap();
    write_safetensors_as(&fused.join("model.safetensors"), &t, StoreAs::Bf16).unwrap();
    let p = &random_ckpt::prompts(c.vocab_size, 1, SEED)[0];
    assert_eq!(
        logits(&fused, None, p, &[5, 6]),
        logits(&released, None, p, &[5, 6])
    );
    // the experts' checksums are over the stored bytes, whichever the layout
    let sums = |d: &Path| moelane_engine::swap::manifest(&Checkpoint::open(d).unwrap()).unwrap();
    assert_eq!(sums(&fused), sums(&released));
}

#[test]
fn weights_in_memory_are_the_checkpoints_own_bytes() {
    // every family's random checkpoint (bf16), and the FP8 ones: the dense weights and every
    // expert as loaded take the bytes the checkpoint stores (FP8: a byte an element plus the
    // f32 block scales), plus 2 bytes for each element of the few vectors (norms, biases,
    // gates) held as f32; nothing else is widened. FP8 roughly halves what a token reads.
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::model::DenseWeights;
    let root = common::scratch("resident");
    let held = |dir: &Path| {
        let ck = Checkpoint::open(dir).unwrap();
        let dense = DenseWeights::load(&ck).unwrap();
        let (mut experts, mut vectors) = (0, dense.vector_elements());
        for l in ck.config.moe_layers() {
            for e in 0..ck.config.num_experts {
                let w = ck.expert(l, e).unwrap();
                experts += w.bytes();
                vectors += w.gate_up_bias.len() + w.down_bias.len();
            }
        }
        let (held, stored) = (dense.bytes() + experts, ck.tensor_bytes());
        assert_eq!(held, stored + 2 * vectors, "{}", dir.display());
        (
            held,
            stored,
            dense.bytes_per_token(),
            ck.expert_stored_bytes().unwrap(),
        )
    };
    for family in FAMILIES {
        let (h, s, _, _) = held(&checkpoint(family, &root));
        eprintln!(
            "{}: {h} bytes held, {s} stored ({:.4}x)",
            family.name(),
            h as f64 / s as f64
        );
    }
    for family in FP8 {
        let (h16, _, t16, e16) = held(&checkpoint(family, &root));
        let (h8, s8, t8, e8) = held(&fp8_checkpoint(family, &root));
        eprintln!(
            "{} fp8: {h8} bytes held, {s8} stored; against bf16: held {:.3}x, dense bytes per \
             token {:.3}x, an expert {:.3}x",
            family.name(),
            h8 as f64 / h16 as f64,
            t8 as f64 / t16 as f64,
            e8 as f64 / e16 as f64
        );
        // a byte an element and one f32 scale per 4 x 16 block: 1/2 + 4/(2*64) of bf16's
        assert!((e8 as f64 / e16 as f64) < 0.54, "{}", family.name());
    }
}

#[test]
fn a_budget_makes_the_first_map_of_every_family() {
    // the calibration pass streams one layer's experts at a time and counts exactly the picks
    // an all-hot engine makes on the same prefill; --hot-experts and --primary-memory give
    // maps of that size, whose greedy continuations are the all-hot map's; the footprint's
    // dense and expert bytes are what the engine holds
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::model::DenseWeights;
    use moelane_engine::placement::{self, Budget, Placement, Resident};
    let root = common::scratch("placement");
    for family in FAMILIES {
        let name = family.name();
        let dir = checkpoint(family, &root);
        let ck = Checkpoint::open(&dir).unwrap();
        let (layers, ne, k) = (
            ck.config.moe_layers().len(),
            ck.config.num_experts,
            ck.config.num_experts_per_tok,
        );
        let prompts = placement::calibration_prompts(&ck, 2, 12).unwrap();
        let counts = placement::calibrate(&dir, &prompts, false).unwrap();
        let mut eng = common::engine(&dir, Some(Rowmap::all_hot(&ck.id, layers, ne)));
        let mut seqs: Vec<_> = prompts.iter().map(|_| eng.kv.new_seq()).collect();
        let mut steps: Vec<SeqStep<'_>> = seqs
            .iter_mut()
            .zip(&prompts)
            .map(|(kv, tokens)| SeqStep { kv, tokens })
            .collect();
        eng.step(&mut steps).unwrap();
        assert_eq!(counts, eng.counters.picks, "{name}: calibration counts");
        let tokens: u64 = prompts.iter().map(|p| p.len() as u64).sum();
        assert!(counts
            .iter()
            .all(|l| l.iter().sum::<u64>() == tokens * k as u64));

        let fp = placement::footprint(
            &ck,
            1024,
            moelane_engine::kv::KvDtype::F32,
            2,
            Resident::Stored,
        )
        .unwrap();
        // the plan counts the KV cache at the bytes a cache of that dtype holds
        {
            use moelane_engine::kv::{KvCache, KvDtype};
            let blocks = KvCache::blocks_for(1024);
            assert_eq!(
                fp.kv as usize,
                KvCache::for_model(&ck.config, blocks).host_bytes(),
                "{name}"
            );
            if ck.config.mla.is_none() {
                let half =
                    placement::footprint(&ck, 1024, KvDtype::Bf16, 2, Resident::Stored).unwrap();
                let cache = KvCache::for_model_as(&ck.config, blocks, KvDtype::Bf16).unwrap();
                assert_eq!(half.kv as usize, cache.host_bytes(), "{name}");
                assert_eq!(2 * half.kv, fp.kv, "{name}");
            }
        }
        assert_eq!(
            fp.dense as usize,
            DenseWeights::load(&ck).unwrap().bytes(),
            "{name}"
        );
        assert_eq!(
            fp.expert as usize,
            ck.expert(ck.config.moe_layers()[0], 0).unwrap().bytes()
        );
        let base = |m: Option<Rowmap>| {
            let mut e = common::engine(&dir, m);
            common::greedy_one(&mut e, &prompts[0], 10).0
        };
        let want = base(Some(Rowmap::all_hot(&ck.id, layers, ne)));
        let per_layer = placement::plan(&ck, Budget::HotExperts(3), &counts, fp).unwrap();
        for (l, lm) in per_layer.map.layers.iter().enumerate() {
            assert_eq!(lm.hot.len(), 3, "{name}: layer {l}");
            let min_hot = lm.hot.iter().map(|&e| counts[l][e as usize]).min().unwrap();
            let max_cold = lm
                .cold
                .iter()
                .map(|&e| counts[l][e as usize])
                .max()
                .unwrap();
            assert!(
                min_hot >= max_cold,
                "{name}: layer {l} hot are the most picked"
            );
        }
        assert_eq!(
            base(Some(per_layer.map.clone())),
            want,
            "{name}: --hot-experts 3"
        );
        // memory for dense + KV + spare + exactly 5 experts
        let bytes = fp.dense + fp.kv + fp.spare + 5 * fp.expert + fp.expert / 2;
        let by_mem = placement::plan(&ck, Budget::PrimaryMemory(bytes), &counts, fp).unwrap();
        assert_eq!(by_mem.footprint.hot_experts, 5, "{name}");
        assert!(by_mem.footprint.total() <= bytes);
        assert_eq!(
            base(Some(by_mem.map.clone())),
            want,
            "{name}: --primary-memory"
        );
        let e = placement::plan(&ck, Budget::PrimaryMemory(fp.dense), &counts, fp).unwrap_err();
        assert!(e.to_string().contains("--primary-memory"), "{e}");
        // the whole path, counts from a calibration pass
        let plan = placement::initial_map(
            &ck,
            &Placement {
                budget: Budget::HotExperts(2),
                counts: None,
                kv_tokens: 1024,
                kv_dtype: moelane_engine::kv::KvDtype::F32,
                spare_slots: 2,
                resident: Resident::Stored,
                progress: false,
            },
        )
        .unwrap();
        plan.map.validate(&ck.id, layers, ne, Some(2)).unwrap();
    }
}

/// compressed-tensors FP8, as llm-compressor writes it (a `weight_scale` per output row, per
/// tensor or per block): each loads as the model it stands for, the same checkpoint widened
/// to f32 by the format's own rule (`random_ckpt::dequantise_compressed`, which reads the
/// scales by their shape, not through the loader): cosine >= 0.99999 at every row, the
/// same greedy picks, held in FP8 (a byte a weight).
#[test]
fn compressed_tensors_fp8_loads_as_the_model_it_stands_for() {
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::config::Fp8Scales;
    let root = common::scratch("compressed-fp8");
    for (scheme, tag) in [
        (Fp8Scales::Channel, "channel"),
        (Fp8Scales::Tensor, "tensor"),
        (Fp8Scales::Block, "block"),
    ] {
        let dir = write_random(Family::Qwen3Moe, &root, &format!("ct_{tag}"));
        random_ckpt::to_fp8_compressed(&dir, scheme, FP8_BLOCK).unwrap();
        let wide = write_random(Family::Qwen3Moe, &root, &format!("ct_{tag}_f32"));
        random_ckpt::to_fp8_compressed(&wide, scheme, FP8_BLOCK).unwrap();
        random_ckpt::dequantise_compressed(&wide).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.config.fp8_scales, scheme);
        let l = ck.config.moe_layers()[0];
        let e = ck.expert(l, 0).unwrap();
        assert!(
            matches!(e.gate_up.data, moelane_engine::ops::Elems::F8(_)),
            "{tag}: experts held as FP8"
        );
        let d = Dims::for_family(Family::Qwen3Moe);
        for p in random_ckpt::prompts(d.vocab, 2, SEED) {
            let (a, b) = (
                logits(&dir, None, &p, &[3, 4]),
                logits(&wide, None, &p, &[3, 4]),
            );
            for (ra, rb) in a.chunks(d.vocab).zip(b.chunks(d.vocab)) {
                let c = common::cos(ra, rb);
                assert!(c >= 0.99999, "{tag}: cosine {c} against the f32 model");
            }
            let greedy = |dir: &Path| common::greedy_one(&mut common::engine(dir, None), &p, 8).0;
            assert_eq!(greedy(&dir), greedy(&wide), "{tag}: greedy picks");
        }
    }
    // what it does not support is refused when the checkpoint is opened, naming the field
    let dir = root.join("ct_channel");
    let cp = dir.join("config.json");
    let good: Value = serde_json::from_slice(&std::fs::read(&cp).unwrap()).unwrap();
    for (edit, field) in [
        (
            serde_json::json!({"format": "pack-quantized"}),
            "quantization_config.format",
        ),
        (
            serde_json::json!({"config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}),
            "weights.type",
        ),
        (
            serde_json::json!({"config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "group"}}}}),
            "weights.strategy",
        ),
        (serde_json::json!({"config_groups": {}}), "config_groups"),
    ] {
        let mut c = good.clone();
        for (k, v) in edit.as_object().unwrap() {
            c["quantization_config"][k] = v.clone();
        }
        std::fs::write(&cp, c.to_string()).unwrap();
        let e = Checkpoint::open(&dir).err().unwrap().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    // the scales of a row scheme in the wrong shape: named with both shapes
    let mut c = good;
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] =
        serde_json::json!("tensor");
    std::fs::write(&cp, c.to_string()).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let l = ck.config.moe_layers()[0];
    let e = ck.expert(l, 0).err().unwrap().to_string();
    assert!(e.contains("experts.0.gate_proj.weight_scale"), "{e}");
}

/// AutoFP8's checkpoints (neuralmagic's FP8 Mixtral): `quant_method: "fp8"` with no block
/// size and one `weight_scale` per tensor; told by their tensors, they load as the same bytes
/// under compressed-tensors' per-tensor scheme do, logit for logit.
#[test]
fn autofp8_per_tensor_checkpoints_load() {
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::config::Fp8Scales;
    let root = common::scratch("autofp8");
    let ct = write_random(Family::Mixtral, &root, "ct_tensor");
    random_ckpt::to_fp8_compressed(&ct, Fp8Scales::Tensor, FP8_BLOCK).unwrap();
    let auto = write_random(Family::Mixtral, &root, "autofp8");
    random_ckpt::to_fp8_compressed(&auto, Fp8Scales::Tensor, FP8_BLOCK).unwrap();
    let cp = auto.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&cp).unwrap()).unwrap();
    c["quantization_config"] = serde_json::json!({"quant_method": "fp8",
        "activation_scheme": "static", "ignored_layers": ["lm_head"]});
    std::fs::write(&cp, c.to_string()).unwrap();
    let ck = Checkpoint::open(&auto).unwrap();
    assert_eq!(ck.config.fp8_scales, Fp8Scales::Tensor);
    let l = ck.config.moe_layers()[0];
    assert!(matches!(
        ck.expert(l, 0).unwrap().gate_up.data,
        moelane_engine::ops::Elems::F8(_)
    ));
    let p = &random_ckpt::prompts(Dims::for_family(Family::Mixtral).vocab, 1, SEED)[0];
    assert_eq!(
        logits(&auto, None, p, &[5, 6]),
        logits(&ct, None, p, &[5, 6])
    );
}

#[test]
fn fp8_checkpoints_that_do_not_add_up_are_refused_naming_the_tensor() {
    use moelane_engine::checkpoint::Checkpoint;
    use moelane_engine::model::DenseWeights;
    let root = common::scratch("fp8-bad");
    let dir = fp8_checkpoint(Family::Qwen3Moe, &root);
    let cp = dir.join("config.json");
    let good: Value = serde_json::from_slice(&std::fs::read(&cp).unwrap()).unwrap();
    // FP8 tensors, but config.json does not say the checkpoint is quantised
    let mut c = good.clone();
    c.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&cp, c.to_string()).unwrap();
    let e = DenseWeights::load(&Checkpoint::open(&dir).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("q_proj.weight") && e.contains("quantization_config"),
        "{e}"
    );
    // a block size the scales do not fit: the scale tensor named, with both shapes
    let mut c = good.clone();
    c["quantization_config"]["weight_block_size"] = serde_json::json!([8, 16]);
    std::fs::write(&cp, c.to_string()).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let e = DenseWeights::load(&ck).err().unwrap().to_string();
    assert!(e.contains("weight_scale_inv"), "{e}");
    let l = ck.config.moe_layers()[0];
    let e = ck.expert(l, 0).err().unwrap().to_string();
    assert!(e.contains("experts.0.gate_proj.weight_scale_inv"), "{e}");
    // another quantisation method: refused when the checkpoint is opened
    let mut c = good;
    c["quantization_config"] = serde_json::json!({"quant_method": "awq", "bits": 4});
    std::fs::write(&cp, c.to_string()).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert!(e.contains("awq") && e.contains("quant_method"), "{e}");
}
