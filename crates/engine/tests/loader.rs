//! Loader: every failure names the file and tensor; other layouts of the same weights
//! (sharded with an index, fused expert tensors, f32 and f16 storage, transformers 5 config
//! names) load to bitwise the same logits.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::step::SeqStep;
use moelane_engine::synth::{write_safetensors_as, StoreAs};
use moelane_engine::Error;
use serde_json::json;

type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn read_all(dir: &Path) -> Tensors {
    let c = Checkpoint::open(dir).unwrap();
    c.tensor_names()
        .into_iter()
        .map(|n| {
            let shape = c.raw(&n).unwrap().shape.to_vec();
            let data = c.tensor(&n, &shape).unwrap();
            (n, (shape, data))
        })
        .collect()
}

/// A copy of tiny's non-weight files into a new dir.
fn copy_meta(to: &Path) {
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(common::tiny().join(f), to.join(f)).unwrap();
    }
}

fn logits_of(dir: &Path) -> Vec<f32> {
    let mut e = common::engine(dir, None);
    let mut s = e.kv.new_seq();
    let mut l = e
        .step_with(
            &mut [SeqStep {
                kv: &mut s,
                tokens: &[5, 17, 300, 42, 99],
            }],
            true,
        )
        .unwrap();
    l.extend(
        e.step(&mut [SeqStep {
            kv: &mut s,
            tokens: &[7],
        }])
        .unwrap(),
    );
    l
}

/// Writes a raw safetensors file with arbitrary dtype strings.
fn write_raw(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut off = 0;
    for (name, dt, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            json!({"dtype": dt, "shape": shape, "data_offsets": [off, off + bytes.len()]}),
        );
        off += bytes.len();
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for t in tensors {
        out.extend(&t.3);
    }
    std::fs::write(path, out).unwrap();
}

#[test]
fn other_layouts_load_to_identical_logits() {
    let tiny = common::tiny();
    let want = logits_of(tiny);
    let all = read_all(tiny);

    // f32 storage with transformers-5 config names (num_local_experts, rope_parameters)
    let d = common::scratch("f32");
    copy_meta(&d);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("config.json")).unwrap()).unwrap();
    let o = cfg.as_object_mut().unwrap();
    let ne = o.remove("num_experts").unwrap();
    o.insert("num_local_experts".into(), ne);
    let th = o.remove("rope_theta").unwrap();
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": th}),
    );
    std::fs::write(d.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    write_safetensors_as(&d.join("model.safetensors"), &all, StoreAs::F32).unwrap();
    assert_eq!(logits_of(&d), want, "f32 + transformers-5 names");

    // f16 storage: values differ by rounding, the model still loads and runs
    let d = common::scratch("f16");
    copy_meta(&d);
    write_safetensors_as(&d.join("model.safetensors"), &all, StoreAs::F16).unwrap();
    let l = logits_of(&d);
    let cos = l.iter().zip(&want).map(|(a, b)| a * b).sum::<f32>()
        / (l.iter().map(|a| a * a).sum::<f32>().sqrt()
            * want.iter().map(|a| a * a).sum::<f32>().sqrt());
    assert!(cos > 0.999, "f16 cosine {cos}");

    // sharded in three files with an index
    let d = common::scratch("sharded");
    copy_meta(&d);
    let mut shards: Vec<Tensors> = vec![BTreeMap::new(), BTreeMap::new(), BTreeMap::new()];
    let mut weight_map = serde_json::Map::new();
    for (i, (k, v)) in all.iter().enumerate() {
        shards[i % 3].insert(k.clone(), v.clone());
        weight_map.insert(
            k.clone(),
            json!(format!("model-0000{}-of-00003.safetensors", i % 3 + 1)),
        );
    }
    for (i, s) in shards.iter().enumerate() {
        write_safetensors_as(
            &d.join(format!("model-0000{}-of-00003.safetensors", i + 1)),
            s,
            StoreAs::Bf16,
        )
        .unwrap();
    }
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::to_vec(&json!({"metadata": {}, "weight_map": weight_map})).unwrap(),
    )
    .unwrap();
    assert_eq!(logits_of(&d), want, "sharded");

    // fused expert tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    let d = common::scratch("fused");
    copy_meta(&d);
    let cfg = Checkpoint::open(tiny).unwrap().config;
    let (e, h, i) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
    let mut fused: Tensors = all
        .iter()
        .filter(|(k, _)| !k.contains(".mlp.experts."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for l in 0..cfg.num_hidden_layers {
        let mut gu = Vec::new();
        let mut dn = Vec::new();
        for x in 0..e {
            let p = format!("model.layers.{l}.mlp.experts.{x}");
            gu.extend(&all[&format!("{p}.gate_proj.weight")].1);
            gu.extend(&all[&format!("{p}.up_proj.weight")].1);
            dn.extend(&all[&format!("{p}.down_proj.weight")].1);
        }
        fused.insert(
            format!("model.layers.{l}.mlp.experts.gate_up_proj"),
            (vec![e, 2 * i, h], gu),
        );
        fused.insert(
            format!("model.layers.{l}.mlp.experts.down_proj"),
            (vec![e, h, i], dn),
        );
    }
    write_safetensors_as(&d.join("model.safetensors"), &fused, StoreAs::Bf16).unwrap();
    assert_eq!(logits_of(&d), want, "fused experts");
    // expert checksums cover the bytes as stored, in whichever layout they are
    let sums = |d: &Path| moelane_engine::swap::manifest(&Checkpoint::open(d).unwrap()).unwrap();
    assert_eq!(sums(&d), sums(tiny), "fused experts' checksums");
}

fn expect_err(dir: &Path) -> Error {
    match Checkpoint::open(dir).and_then(|c| {
        moelane_engine::model::DenseWeights::load(&c)?;
        for l in 0..c.config.num_hidden_layers {
            for e in 0..c.config.num_experts {
                c.expert(l, e)?;
            }
        }
        Ok(())
    }) {
        Ok(()) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn failures_name_file_and_tensor() {
    let all = read_all(common::tiny());

    // missing tensor
    let d = common::scratch("missing");
    copy_meta(&d);
    let mut t = all.clone();
    t.remove("model.layers.1.self_attn.k_proj.weight");
    write_safetensors_as(&d.join("model.safetensors"), &t, StoreAs::Bf16).unwrap();
    let e = expect_err(&d);
    assert!(
        matches!(&e, Error::MissingTensor { tensor, .. } if tensor == "model.layers.1.self_attn.k_proj.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("model.safetensors"), "{e}");

    // missing expert
    let mut t = all.clone();
    t.remove("model.layers.0.mlp.experts.17.up_proj.weight");
    write_safetensors_as(&d.join("model.safetensors"), &t, StoreAs::Bf16).unwrap();
    let e = expect_err(&d);
    assert!(
        e.to_string()
            .contains("model.layers.0.mlp.experts.17.up_proj.weight"),
        "{e}"
    );

    // wrong shape
    let mut t = all.clone();
    let (shape, data) = t["model.layers.0.self_attn.o_proj.weight"].clone();
    t.insert(
        "model.layers.0.self_attn.o_proj.weight".into(),
        (vec![shape[1], shape[0]], data),
    );
    write_safetensors_as(&d.join("model.safetensors"), &t, StoreAs::Bf16).unwrap();
    let e = expect_err(&d);
    assert!(
        matches!(&e, Error::WrongShape { tensor, found, expected, .. } if tensor == "model.layers.0.self_attn.o_proj.weight" && found == &vec![shape[1], shape[0]] && expected == &shape),
        "{e}"
    );

    // wrong dtype: an I32 tensor
    let d2 = common::scratch("dtype");
    copy_meta(&d2);
    let mut raw: Vec<(String, String, Vec<usize>, Vec<u8>)> = all
        .iter()
        .map(|(k, (s, v))| {
            (
                k.clone(),
                "F32".to_string(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    for r in raw.iter_mut() {
        if r.0 == "model.norm.weight" {
            r.1 = "I32".into();
        }
    }
    let refs: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = raw
        .iter()
        .map(|r| (r.0.as_str(), r.1.as_str(), r.2.clone(), r.3.clone()))
        .collect();
    write_raw(&d2.join("model.safetensors"), &refs);
    let e = expect_err(&d2);
    assert!(
        matches!(&e, Error::WrongDtype { tensor, found, .. } if tensor == "model.norm.weight" && found.contains("I32")),
        "{e}"
    );

    // truncated file
    let d3 = common::scratch("trunc");
    copy_meta(&d3);
    let bytes = std::fs::read(common::tiny().join("model.safetensors")).unwrap();
    for cut in [bytes.len() - 1, bytes.len() / 2, 100, 7] {
        std::fs::write(d3.join("model.safetensors"), &bytes[..cut]).unwrap();
        let e = expect_err(&d3);
        assert!(
            matches!(&e, Error::BadSafetensors { file, reason } if file.ends_with("model.safetensors") && reason.contains("truncated")),
            "cut {cut}: {e}"
        );
    }

    // unsupported architecture
    let d4 = common::scratch("arch");
    copy_meta(&d4);
    std::fs::copy(
        common::tiny().join("model.safetensors"),
        d4.join("model.safetensors"),
    )
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d4.join("config.json")).unwrap()).unwrap();
    cfg["model_type"] = json!("llama");
    cfg["architectures"] = json!(["LlamaForCausalLM"]);
    std::fs::write(d4.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = expect_err(&d4);
    assert!(
        matches!(&e, Error::UnsupportedArchitecture { found, .. } if found == "llama"),
        "{e}"
    );

    // an index that names a file that is not there
    let d5 = common::scratch("index");
    copy_meta(&d5);
    std::fs::copy(
        common::tiny().join("model.safetensors"),
        d5.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        d5.join("model.safetensors.index.json"),
        serde_json::to_vec(
            &json!({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}),
        )
        .unwrap(),
    )
    .unwrap();
    let e = expect_err(&d5);
    assert!(
        e.to_string().contains("model-00002-of-00002.safetensors"),
        "{e}"
    );

    // no config at all
    let d6 = common::scratch("empty");
    let e = expect_err(&d6);
    assert!(e.to_string().contains("config.json"), "{e}");

    // a second file holding a tensor the first holds, no index to say which: refused by
    // name (the last file read would win silently); with an index, the file it names wins
    let d7 = common::scratch("dup");
    copy_meta(&d7);
    std::fs::copy(
        common::tiny().join("model.safetensors"),
        d7.join("model.safetensors"),
    )
    .unwrap();
    let (shape, data) = all["model.norm.weight"].clone();
    let zeros = vec![0.0; data.len()];
    let mut t = Tensors::new();
    t.insert("model.norm.weight".into(), (shape, zeros));
    write_safetensors_as(&d7.join("zz-extra.safetensors"), &t, StoreAs::F32).unwrap();
    let e = expect_err(&d7);
    assert!(
        matches!(&e, Error::BadSafetensors { file, reason } if file.ends_with("zz-extra.safetensors") && reason.contains("model.norm.weight") && reason.contains("model.safetensors")),
        "{e}"
    );
    // both files are read (the index names both); each tensor from the file it names
    let ln = "model.layers.0.input_layernorm.weight";
    t.insert(ln.into(), all[ln].clone());
    write_safetensors_as(&d7.join("zz-extra.safetensors"), &t, StoreAs::F32).unwrap();
    let names = Checkpoint::open(common::tiny()).unwrap().tensor_names();
    let weight_map: serde_json::Map<String, serde_json::Value> = names
        .iter()
        .map(|n| {
            let f = if n == ln {
                "zz-extra.safetensors"
            } else {
                "model.safetensors"
            };
            (n.clone(), json!(f))
        })
        .collect();
    std::fs::write(
        d7.join("model.safetensors.index.json"),
        serde_json::to_vec(&json!({ "weight_map": weight_map })).unwrap(),
    )
    .unwrap();
    let c = Checkpoint::open(&d7).unwrap();
    assert_eq!(
        c.tensor("model.norm.weight", &all["model.norm.weight"].0)
            .unwrap(),
        all["model.norm.weight"].1,
        "the index's file wins"
    );

    // a KV cache past any host's memory is refused before it is allocated
    let e = moelane_engine::kv::KvCache::check_host_memory(
        &Checkpoint::open(common::tiny()).unwrap().config,
        moelane_engine::kv::MAX_KV_TOKENS,
    )
    .unwrap_err();
    assert!(e.to_string().contains("--kv-tokens"), "{e}");
    let e = moelane_engine::kv::KvCache::check_tokens(usize::MAX).unwrap_err();
    assert!(e.to_string().contains("--kv-tokens"), "{e}");
}
