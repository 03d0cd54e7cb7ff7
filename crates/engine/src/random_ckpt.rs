//! Small random checkpoints of each family, written in the layout the family's released
//! checkpoints use (config.json and one bf16 safetensors file): the fixtures of the parity
//! tests against Hugging Face transformers (`scripts/hf_family_golden.py` computes the
//! reference logits from the same files). Deterministic: one seed, the same bytes.
//!
//! Their shapes differ on purpose from the synthetic `tiny` (odd vocabulary, more KV groups,
//! other widths), so a test cannot pass by fitting one shape.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::Dtype;
use serde_json::json;

use crate::config::{Family, Fp8Scales};
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::synth::{write_safetensors_as, StoreAs};

/// The dimensions of a random checkpoint.
#[derive(Clone, Debug)]
pub struct Dims {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// each expert's SwiGLU width
    pub inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub max_pos: usize,
}

impl Dims {
    /// The shapes the parity test of `family` uses.
    pub fn for_family(family: Family) -> Dims {
        match family {
            Family::Mixtral => Dims {
                vocab: 397,
                hidden: 96,
                layers: 3,
                heads: 6,
                kv_heads: 2,
                head_dim: 16,
                inter: 80,
                experts: 8,
                top_k: 2,
                max_pos: 512,
            },
            Family::Qwen2Moe => Dims {
                vocab: 401,
                hidden: 80,
                layers: 3,
                heads: 5,
                kv_heads: 1,
                head_dim: 16,
                inter: 24,
                experts: 10,
                top_k: 4,
                max_pos: 512,
            },
            Family::Glm4Moe => Dims {
                vocab: 409,
                hidden: 72,
                layers: 4,
                heads: 6,
                kv_heads: 2,
                head_dim: 20,
                inter: 28,
                experts: 12,
                top_k: 3,
                max_pos: 512,
            },
            // a context of 1024 over YaRN's original 128 with a factor of 4: the factor, not
            // their ratio (8), scales the frequencies
            Family::DeepseekV3 => Dims {
                vocab: 419,
                hidden: 64,
                layers: 3,
                heads: 4,
                kv_heads: 4,
                head_dim: DS_NOPE + DS_ROPE,
                inter: 24,
                experts: 16,
                top_k: 4,
                max_pos: 1024,
            },
            // YaRN's factor 4 over an original context of 256 (not rounded to whole
            // dimensions, as gpt-oss ships it); widths multiples of 32 (MXFP4's blocks)
            Family::GptOss => Dims {
                vocab: 421,
                hidden: 64,
                layers: 4,
                heads: 8,
                kv_heads: 2,
                head_dim: 16,
                inter: 32,
                experts: 8,
                top_k: 3,
                max_pos: 1024,
            },
            Family::Qwen3Moe => Dims {
                vocab: 389,
                hidden: 64,
                layers: 3,
                heads: 4,
                kv_heads: 2,
                head_dim: 24,
                inter: 40,
                experts: 12,
                top_k: 3,
                max_pos: 512,
            },
        }
    }
}

/// A random deepseek_v3's latent attention: q's low rank, the kv latent, the nope and rope
/// parts of a q/k head, a v head (narrower than the nope part, as in the released models'
/// proportions it need not match).
const DS_Q_LORA: usize = 40;
const DS_KV_LORA: usize = 32;
const DS_NOPE: usize = 16;
const DS_ROPE: usize = 8;
const DS_V: usize = 12;

/// A random gpt_oss's sliding window: narrower than the test prompts, so that it slides.
pub const OSS_WINDOW: usize = 4;

/// The dense layers' width in a random glm4_moe.
const GLM_DENSE: usize = 56;

/// The shared expert's width in a random qwen2_moe (three routed experts' worth).
fn shared_width(d: &Dims) -> usize {
    3 * d.inter
}

fn config_json(family: Family, d: &Dims) -> serde_json::Value {
    let mut c = json!({
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "num_experts_per_tok": d.top_k,
        "hidden_act": "silu",
        "max_position_embeddings": d.max_pos,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    });
    let o = c.as_object_mut().expect("an object");
    match family {
        Family::Mixtral => {
            o.insert("architectures".into(), json!(["MixtralForCausalLM"]));
            o.insert("model_type".into(), json!("mixtral"));
            o.insert("intermediate_size".into(), json!(d.inter));
            o.insert("num_local_experts".into(), json!(d.experts));
            o.insert("rope_theta".into(), json!(1_000_000.0));
            o.insert("sliding_window".into(), serde_json::Value::Null);
            o.insert("router_aux_loss_coef".into(), json!(0.0));
        }
        Family::Qwen2Moe => {
            o.insert("architectures".into(), json!(["Qwen2MoeForCausalLM"]));
            o.insert("model_type".into(), json!("qwen2_moe"));
            o.insert("moe_intermediate_size".into(), json!(d.inter));
            o.insert(
                "shared_expert_intermediate_size".into(),
                json!(shared_width(d)),
            );
            o.insert("intermediate_size".into(), json!(d.inter * 2));
            o.insert("num_experts".into(), json!(d.experts));
            o.insert("norm_topk_prob".into(), json!(false));
            o.insert("rope_theta".into(), json!(10_000.0));
            o.insert("decoder_sparse_step".into(), json!(1));
            o.insert("mlp_only_layers".into(), json!([]));
            o.insert("use_sliding_window".into(), json!(false));
            o.insert("qkv_bias".into(), json!(true));
        }
        Family::Glm4Moe => {
            // one dense layer first, 2 groups of 6 experts of which the best 1 is searched,
            // half of each head rotated, q/k norm and q/k/v biases on
            o.insert("architectures".into(), json!(["Glm4MoeForCausalLM"]));
            o.insert("model_type".into(), json!("glm4_moe"));
            o.insert("moe_intermediate_size".into(), json!(d.inter));
            o.insert("intermediate_size".into(), json!(GLM_DENSE));
            o.insert("n_routed_experts".into(), json!(d.experts));
            o.insert("n_shared_experts".into(), json!(1));
            o.insert("first_k_dense_replace".into(), json!(1));
            o.insert("n_group".into(), json!(2));
            o.insert("topk_group".into(), json!(1));
            o.insert("routed_scaling_factor".into(), json!(2.5));
            o.insert("norm_topk_prob".into(), json!(true));
            o.insert("use_qk_norm".into(), json!(true));
            o.insert("attention_bias".into(), json!(true));
            o.insert("partial_rotary_factor".into(), json!(0.5));
            o.insert("rope_theta".into(), json!(10_000.0));
            o.insert("num_nextn_predict_layers".into(), json!(0));
        }
        Family::DeepseekV3 => {
            // one dense layer first, 4 groups of 4 experts of which the best 2 are searched,
            // latent attention with a q bottleneck, interleaved RoPE with YaRN (factor 4 over
            // an original context of 128, mscale_all_dim changing the softmax scale)
            o.insert("architectures".into(), json!(["DeepseekV3ForCausalLM"]));
            o.insert("model_type".into(), json!("deepseek_v3"));
            o.insert("moe_intermediate_size".into(), json!(d.inter));
            o.insert("intermediate_size".into(), json!(GLM_DENSE));
            o.insert("n_routed_experts".into(), json!(d.experts));
            o.insert("n_shared_experts".into(), json!(1));
            o.insert("first_k_dense_replace".into(), json!(1));
            o.insert("n_group".into(), json!(4));
            o.insert("topk_group".into(), json!(2));
            o.insert("routed_scaling_factor".into(), json!(2.5));
            o.insert("norm_topk_prob".into(), json!(true));
            o.insert("scoring_func".into(), json!("sigmoid"));
            o.insert("topk_method".into(), json!("noaux_tc"));
            o.insert("q_lora_rank".into(), json!(DS_Q_LORA));
            o.insert("kv_lora_rank".into(), json!(DS_KV_LORA));
            o.insert("qk_nope_head_dim".into(), json!(DS_NOPE));
            o.insert("qk_rope_head_dim".into(), json!(DS_ROPE));
            o.insert("v_head_dim".into(), json!(DS_V));
            o.insert("rope_interleave".into(), json!(true));
            o.insert("attention_bias".into(), json!(false));
            o.insert("rms_norm_eps".into(), json!(1e-6));
            o.remove("head_dim");
            o.insert(
                "rope_parameters".into(),
                json!({"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                       "original_max_position_embeddings": 128, "beta_fast": 32.0,
                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
            );
            o.insert("num_nextn_predict_layers".into(), json!(0));
        }
        Family::GptOss => {
            // sliding layers first and third, as the released ones alternate
            o.insert("architectures".into(), json!(["GptOssForCausalLM"]));
            o.insert("model_type".into(), json!("gpt_oss"));
            o.insert("intermediate_size".into(), json!(d.inter));
            o.insert("num_local_experts".into(), json!(d.experts));
            o.insert("experts_per_token".into(), json!(d.top_k));
            o.insert("sliding_window".into(), json!(OSS_WINDOW));
            let types: Vec<&str> = (0..d.layers)
                .map(|l| {
                    if l % 2 == 0 {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            o.insert("layer_types".into(), json!(types));
            o.insert("attention_bias".into(), json!(true));
            o.insert("swiglu_limit".into(), json!(7.0));
            o.insert("rope_theta".into(), json!(150_000.0));
            o.insert(
                "rope_scaling".into(),
                json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                       "beta_slow": 1.0, "truncate": false,
                       "original_max_position_embeddings": 256}),
            );
            o.insert("router_aux_loss_coef".into(), json!(0.9));
            o.insert("output_router_logits".into(), json!(false));
            o.insert("initializer_range".into(), json!(0.02));
        }
        Family::Qwen3Moe => {
            o.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
            o.insert("model_type".into(), json!("qwen3_moe"));
            o.insert("moe_intermediate_size".into(), json!(d.inter));
            o.insert("intermediate_size".into(), json!(d.inter * 2));
            o.insert("num_experts".into(), json!(d.experts));
            o.insert("norm_topk_prob".into(), json!(true));
            o.insert("rope_theta".into(), json!(10_000.0));
            o.insert("decoder_sparse_step".into(), json!(1));
            o.insert("mlp_only_layers".into(), json!([]));
            o.insert("attention_bias".into(), json!(false));
        }
    }
    c
}

/// The tensors of a gpt_oss decoder layer `p` but its norms and q/k/v/o weights: the
/// attention's biases and sinks, the router with its bias, and the experts fused as released
/// in bf16 (`gate_up_proj [E, H, 2I]` with the gate and up columns interleaved,
/// `down_proj [E, I, H]`, their biases). The gate/up biases are wide enough that the
/// activation's clamp at 7 is reached.
fn gpt_oss_layer(put: &mut impl FnMut(String, Vec<usize>, f32, f32), d: &Dims, p: &str) {
    let (h, hd) = (d.hidden, d.head_dim);
    let (qd, kvd) = (d.heads * hd, d.kv_heads * hd);
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let a = format!("{p}.self_attn");
    for (n, rows) in [
        ("q_proj", qd),
        ("k_proj", kvd),
        ("v_proj", kvd),
        ("o_proj", h),
    ] {
        put(format!("{a}.{n}.bias"), vec![rows], 0.5, 0.0);
    }
    put(format!("{a}.sinks"), vec![d.heads], 1.0, 0.0);
    let m = format!("{p}.mlp");
    put(
        format!("{m}.router.weight"),
        vec![d.experts, h],
        2.0 * lin(h),
        0.0,
    );
    put(format!("{m}.router.bias"), vec![d.experts], 0.5, 0.0);
    let (e, i) = (d.experts, d.inter);
    let x = format!("{m}.experts");
    put(format!("{x}.gate_up_proj"), vec![e, h, 2 * i], lin(h), 0.0);
    put(format!("{x}.gate_up_proj_bias"), vec![e, 2 * i], 3.0, 0.0);
    put(format!("{x}.down_proj"), vec![e, i, h], 0.25 * lin(i), 0.0);
    put(format!("{x}.down_proj_bias"), vec![e, h], 0.5, 0.0);
}

/// Writes a random `family` checkpoint of dimensions `d` into `out` (created if missing).
pub fn write(family: Family, d: &Dims, seed: u64, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut t: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let mut r = Rng::derive(seed, &name);
        let n = shape.iter().product();
        let v = (0..n).map(|_| offset + scale * r.normal()).collect();
        t.insert(name, (shape, v));
    };
    let (h, hd) = (d.hidden, d.head_dim);
    let (qd, kvd) = (d.heads * hd, d.kv_heads * hd);
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    put(
        "model.embed_tokens.weight".into(),
        vec![d.vocab, h],
        1.0,
        0.0,
    );
    put("lm_head.weight".into(), vec![d.vocab, h], lin(h), 0.0);
    put("model.norm.weight".into(), vec![h], 0.1, 1.0);
    for l in 0..d.layers {
        let p = format!("model.layers.{l}");
        put(format!("{p}.input_layernorm.weight"), vec![h], 0.1, 1.0);
        put(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            0.1,
            1.0,
        );
        let a = format!("{p}.self_attn");
        if family == Family::DeepseekV3 {
            let (ql, kl, qk) = (DS_Q_LORA, DS_KV_LORA, DS_NOPE + DS_ROPE);
            put(format!("{a}.q_a_proj.weight"), vec![ql, h], lin(h), 0.0);
            put(format!("{a}.q_a_layernorm.weight"), vec![ql], 0.1, 1.0);
            put(
                format!("{a}.q_b_proj.weight"),
                vec![d.heads * qk, ql],
                lin(ql),
                0.0,
            );
            put(
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![kl + DS_ROPE, h],
                lin(h),
                0.0,
            );
            put(format!("{a}.kv_a_layernorm.weight"), vec![kl], 0.1, 1.0);
            put(
                format!("{a}.kv_b_proj.weight"),
                vec![d.heads * (DS_NOPE + DS_V), kl],
                lin(kl),
                0.0,
            );
            let od = d.heads * DS_V;
            put(format!("{a}.o_proj.weight"), vec![h, od], lin(od), 0.0);
        } else {
            for (n, rows) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
                put(format!("{a}.{n}.weight"), vec![rows, h], lin(h), 0.0);
            }
            put(format!("{a}.o_proj.weight"), vec![h, qd], lin(qd), 0.0);
        }
        if family == Family::GptOss {
            gpt_oss_layer(&mut put, d, &p);
            continue;
        }
        let (moe, names) = match family {
            Family::GptOss => unreachable!("written above"),
            Family::Mixtral => (format!("{p}.block_sparse_moe"), ["w1", "w3", "w2"]),
            Family::Qwen2Moe => {
                for (n, rows) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
                    put(format!("{p}.self_attn.{n}.bias"), vec![rows], 0.5, 0.0);
                }
                let (x, si) = (format!("{p}.mlp.shared_expert"), shared_width(d));
                put(format!("{x}.gate_proj.weight"), vec![si, h], lin(h), 0.0);
                put(format!("{x}.up_proj.weight"), vec![si, h], lin(h), 0.0);
                put(format!("{x}.down_proj.weight"), vec![h, si], lin(si), 0.0);
                put(
                    format!("{p}.mlp.shared_expert_gate.weight"),
                    vec![1, h],
                    lin(h),
                    0.0,
                );
                (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"])
            }
            Family::Qwen3Moe => {
                put(format!("{p}.self_attn.q_norm.weight"), vec![hd], 0.1, 1.0);
                put(format!("{p}.self_attn.k_norm.weight"), vec![hd], 0.1, 1.0);
                (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"])
            }
            Family::Glm4Moe | Family::DeepseekV3 => {
                if family == Family::Glm4Moe {
                    put(format!("{p}.self_attn.q_norm.weight"), vec![hd], 0.1, 1.0);
                    put(format!("{p}.self_attn.k_norm.weight"), vec![hd], 0.1, 1.0);
                    for (n, rows) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
                        put(format!("{p}.self_attn.{n}.bias"), vec![rows], 0.5, 0.0);
                    }
                }
                let x = format!("{p}.mlp");
                if l == 0 {
                    // the dense first layer
                    let i = GLM_DENSE;
                    put(format!("{x}.gate_proj.weight"), vec![i, h], lin(h), 0.0);
                    put(format!("{x}.up_proj.weight"), vec![i, h], lin(h), 0.0);
                    put(format!("{x}.down_proj.weight"), vec![h, i], lin(i), 0.0);
                    continue;
                }
                let (s, si) = (format!("{x}.shared_experts"), d.inter);
                put(format!("{s}.gate_proj.weight"), vec![si, h], lin(h), 0.0);
                put(format!("{s}.up_proj.weight"), vec![si, h], lin(h), 0.0);
                put(format!("{s}.down_proj.weight"), vec![h, si], lin(si), 0.0);
                // a correction bias large enough to change some choices
                put(
                    format!("{x}.gate.e_score_correction_bias"),
                    vec![d.experts],
                    0.05,
                    0.0,
                );
                (x, ["gate_proj", "up_proj", "down_proj"])
            }
        };
        // a router with some spread, so the top-k is not a coin toss between near-equal logits
        put(
            format!("{moe}.gate.weight"),
            vec![d.experts, h],
            2.0 * lin(h),
            0.0,
        );
        for e in 0..d.experts {
            let x = format!("{moe}.experts.{e}");
            put(
                format!("{x}.{}.weight", names[0]),
                vec![d.inter, h],
                lin(h),
                0.0,
            );
            put(
                format!("{x}.{}.weight", names[1]),
                vec![d.inter, h],
                lin(h),
                0.0,
            );
            put(
                format!("{x}.{}.weight", names[2]),
                vec![h, d.inter],
                lin(d.inter),
                0.0,
            );
        }
    }
    let cfg = config_json(family, d);
    let path = out.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap_or_default())
        .map_err(|e| Error::io(&path, e))?;
    let gc = json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": false});
    let path = out.join("generation_config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&gc).unwrap_or_default())
        .map_err(|e| Error::io(&path, e))?;
    write_safetensors_as(&out.join("model.safetensors"), &t, StoreAs::Bf16)
}

/// Prompts of the parity tests: `count` prompts of random token ids (below `vocab`, 3 and
/// up: no special ids), of lengths 5, 9, 13, ...
pub fn prompts(vocab: usize, count: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut r = Rng::derive(seed, "prompts");
    (0..count)
        .map(|i| {
            (0..5 + 4 * i)
                .map(|_| 3 + (r.next_u64() % (vocab as u64 - 3)) as u32)
                .collect()
        })
        .collect()
}

/// Whether tensor `name` of shape `shape` is quantised in an FP8 checkpoint of the kind
/// DeepSeek and Qwen release: the linear layers' weights, not the embedding, the head, the
/// router, the norms, the biases or a one-row gate.
fn fp8_quantised(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2
        && shape[0] > 1
        && name.ends_with(".weight")
        && !name.contains("embed_tokens")
        && !name.starts_with("lm_head")
        && !name.ends_with(".gate.weight")
        && !name.contains("shared_expert_gate")
}

/// `w` (`c` columns) in e4m3 under one scale per block of `block`: the block's largest
/// magnitude / 448 (1 for an all-zero block), passed through `stored` (the dtype the scales
/// are written in) before the weights are divided by it; the scales and the codes.
fn quantise_e4m3(
    w: &[f32],
    c: usize,
    block: [usize; 2],
    stored: impl Fn(f32) -> f32,
) -> (Vec<f32>, Vec<u8>) {
    use crate::ops::F8;
    let r = w.len() / c.max(1);
    let cb = c.div_ceil(block[1]);
    let at = |i: usize| (i / c / block[0]) * cb + (i % c) / block[1];
    let mut scales = vec![0f32; r.div_ceil(block[0]) * cb];
    for (i, &x) in w.iter().enumerate() {
        scales[at(i)] = scales[at(i)].max(x.abs());
    }
    for s in &mut scales {
        *s = stored(if *s > 0.0 { *s / 448.0 } else { 1.0 });
    }
    let q = w
        .iter()
        .enumerate()
        .map(|(i, &x)| F8::from_f32(x / scales[at(i)]).0)
        .collect();
    (scales, q)
}

/// Rewrites the random checkpoint in `dir` (written by [`write`]) with FP8 e4m3 weights, as
/// FP8 checkpoints ship: every linear layer's weight quantised per `block` (rows x columns)
/// with its f32 `weight_scale_inv` (the block's largest magnitude / 448), the rest kept as
/// stored, and config.json's `quantization_config` saying so.
pub fn to_fp8(dir: &Path, block: [usize; 2]) -> Result<()> {
    let quant = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": block});
    quantise_linear(dir, quant, |name, r, c, w| {
        let (scales, q) = quantise_e4m3(w, c, block, |s| s);
        let sb: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let shape = vec![r.div_ceil(block[0]), c.div_ceil(block[1])];
        (q, format!("{name}_scale_inv"), (Dtype::F32, shape, sb))
    })
}

/// A tensor to write: its dtype, shape and bytes.
type Entry = (Dtype, Vec<usize>, Vec<u8>);

/// Rewrites the checkpoint in `dir` with each linear layer's weight ([`fp8_quantised`]) as
/// the e4m3 codes `quantise(name, rows, cols, weights)` gives, beside the scale tensor it
/// names; the rest as stored; `quant` as config.json's `quantization_config`.
fn quantise_linear(
    dir: &Path,
    quant: serde_json::Value,
    mut quantise: impl FnMut(&str, usize, usize, &[f32]) -> (Vec<u8>, String, Entry),
) -> Result<()> {
    use crate::checkpoint::Checkpoint;
    let ck = Checkpoint::open(dir)?;
    let mut out: BTreeMap<String, Entry> = BTreeMap::new();
    for name in ck.tensor_names() {
        let raw = ck.raw(&name)?;
        let shape = raw.shape.to_vec();
        if !fp8_quantised(&name, &shape) {
            out.insert(name, (raw.dtype, shape, raw.bytes.to_vec()));
            continue;
        }
        let w = ck.tensor(&name, &shape)?;
        let (q, sname, scales) = quantise(&name, shape[0], shape[1], &w);
        out.insert(sname, scales);
        out.insert(name, (Dtype::F8_E4M3, shape, q));
    }
    drop(ck);
    rewrite(dir, &out, quant)
}

/// Rewrites the random checkpoint in `dir` (written by [`write`]) as llm-compressor writes
/// compressed-tensors FP8 (`format: "float-quantized"`): the same linear layers as
/// [`to_fp8`] in e4m3, each with its `weight_scale`: one per output row (`[rows, 1]`, bf16,
/// `Fp8Scales::Channel`), one per tensor (`[1]`, f32, `Tensor`) or one per block of
/// `block` (f32, `Block`); dynamic per-token activations and the router gate and head left
/// out (`ignore`), as its FP8_DYNAMIC recipe does.
pub fn to_fp8_compressed(dir: &Path, scheme: Fp8Scales, block: [usize; 2]) -> Result<()> {
    let strategy = match scheme {
        Fp8Scales::Channel => "channel",
        Fp8Scales::Tensor => "tensor",
        _ => "block",
    };
    let block_structure = if strategy == "block" {
        json!(block)
    } else {
        json!(null)
    };
    let quant = json!({
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": strategy,
                        "symmetric": true, "dynamic": false, "observer": "minmax",
                        "block_structure": block_structure, "group_size": null},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                  "symmetric": true, "dynamic": true},
            "output_activations": null
        }},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": null,
        "sparsity_config": {}
    });
    quantise_linear(dir, quant, |name, r, c, w| {
        // each element's scale block (rows x columns) under the scheme
        let b = match scheme {
            Fp8Scales::Channel => [1, c],
            Fp8Scales::Tensor => [r, c],
            _ => block,
        };
        // bf16 scales are quantised with the scale as stored
        let (scales, q) = quantise_e4m3(w, c, b, |s| match scheme {
            Fp8Scales::Channel => half::bf16::from_f32(s).to_f32(),
            _ => s,
        });
        let f32s = |v: &[f32]| v.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>();
        let entry = match scheme {
            Fp8Scales::Channel => (
                Dtype::BF16,
                vec![r, 1],
                scales
                    .iter()
                    .flat_map(|s| half::bf16::from_f32(*s).to_bits().to_le_bytes())
                    .collect(),
            ),
            Fp8Scales::Tensor => (Dtype::F32, vec![1], f32s(&scales[..1])),
            _ => (
                Dtype::F32,
                vec![r.div_ceil(b[0]), c.div_ceil(b[1])],
                f32s(&scales),
            ),
        };
        (q, format!("{name}_scale"), entry)
    })
}

/// Rewrites the compressed-tensors FP8 checkpoint in `dir` (written by
/// [`to_fp8_compressed`]) with every FP8 weight widened to f32 by its own reading of the
/// format (each e4m3 value times the `weight_scale` of its row, tensor or block), with no
/// quantisation config: the model an FP8 checkpoint stands for, to test a loader against.
pub fn dequantise_compressed(dir: &Path) -> Result<()> {
    use crate::checkpoint::{elems, Checkpoint};
    use crate::ops::E4M3;
    let ck = Checkpoint::open(dir)?;
    let mut out: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for name in ck.tensor_names() {
        let raw = ck.raw(&name)?;
        if name.ends_with(".weight_scale") {
            continue;
        }
        let shape = raw.shape.to_vec();
        if raw.dtype != Dtype::F8_E4M3 {
            out.insert(name, (raw.dtype, shape, raw.bytes.to_vec()));
            continue;
        }
        let s = ck.raw(&format!("{name}_scale"))?;
        let scales = elems(s.dtype, s.bytes).into_f32();
        let (r, c) = (shape[0], shape[1]);
        // the block one scale covers: the config's block_structure, else (a scale per row
        // or per tensor) from the scales' own shape
        let (sr, sc) = match s.shape {
            [] => (1, 1),
            [n] => (*n, 1),
            [a, b, ..] => (*a, *b),
        };
        let [br, bc] = match ck.config.fp8_block {
            Some(b) if ck.config.fp8_scales == Fp8Scales::Block => b,
            _ => [r.div_ceil(sr.max(1)), c.div_ceil(sc.max(1))],
        };
        let v: Vec<u8> = raw
            .bytes
            .iter()
            .enumerate()
            .flat_map(|(i, &b)| {
                let (row, col) = (i / c, i % c);
                (E4M3[b as usize] * scales[(row / br) * sc + col / bc]).to_le_bytes()
            })
            .collect();
        out.insert(name, (Dtype::F32, shape, v));
    }
    drop(ck);
    rewrite(dir, &out, json!(null))
}

/// The e2m1 (FP4) code nearest `x` (`|x| <= 6` after scaling; larger saturates at 6).
fn e2m1_code(x: f32) -> u8 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let a = x.abs();
    let mut best = 0;
    for (c, &m) in MAG.iter().enumerate() {
        if (a - m).abs() < (a - MAG[best]).abs() {
            best = c;
        }
    }
    best as u8
        | if x.is_sign_negative() && best > 0 {
            8
        } else {
            0
        }
}

/// A matrix's rows (of a multiple of 32 columns) as MXFP4: blocks `[rows, cols/32, 16]`
/// (two codes a byte, the low nibble first) and one e8m0 exponent per 32 values (the
/// smallest power of two that brings the block's largest magnitude to 6 or below).
fn mxfp4(w: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let (mut blocks, mut scales) = (Vec::new(), Vec::new());
    for b in w.chunks(32) {
        let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let e = if amax > 0.0 {
            (amax / 6.0).log2().ceil().clamp(-127.0, 127.0) as i32
        } else {
            -127
        };
        scales.push((e + 127) as u8);
        let inv = 2f32.powi(-e);
        for pair in b.chunks(2) {
            blocks.push(e2m1_code(pair[0] * inv) | (e2m1_code(pair[1] * inv) << 4));
        }
    }
    (blocks, scales)
}

/// Rewrites the random gpt_oss checkpoint in `dir` (written by [`write`]) with MXFP4 experts,
/// as gpt-oss is released: each layer's `gate_up_proj` / `down_proj` replaced by
/// `*_blocks` and `*_scales` over the transposed matrices (one row per output), the biases
/// and everything else kept, and config.json's `quantization_config` saying mxfp4.
pub fn to_mxfp4(dir: &Path) -> Result<()> {
    use crate::checkpoint::Checkpoint;
    let ck = Checkpoint::open(dir)?;
    let c = ck.config.clone();
    let (h, i, ne) = (c.hidden_size, c.moe_intermediate_size, c.num_experts);
    let mut out: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for name in ck.tensor_names() {
        let raw = ck.raw(&name)?;
        let shape = raw.shape.to_vec();
        let (rows, cols, base) = if let Some(b) = name.strip_suffix(".gate_up_proj") {
            (2 * i, h, b.to_string() + ".gate_up_proj")
        } else if let Some(b) = name.strip_suffix(".down_proj") {
            (h, i, b.to_string() + ".down_proj")
        } else {
            out.insert(name, (raw.dtype, shape, raw.bytes.to_vec()));
            continue;
        };
        // stored [E, cols, rows] (one column per output): transpose each expert
        let w = ck.tensor(&name, &shape)?;
        let (mut blocks, mut scales) = (Vec::new(), Vec::new());
        for e in 0..ne {
            let m = &w[e * rows * cols..(e + 1) * rows * cols];
            let t: Vec<f32> = (0..rows)
                .flat_map(|r| (0..cols).map(move |k| m[k * rows + r]))
                .collect();
            let (b, s) = mxfp4(&t);
            blocks.extend(b);
            scales.extend(s);
        }
        out.insert(
            format!("{base}_blocks"),
            (Dtype::U8, vec![ne, rows, cols / 32, 16], blocks),
        );
        out.insert(
            format!("{base}_scales"),
            (Dtype::U8, vec![ne, rows, cols / 32], scales),
        );
    }
    drop(ck);
    rewrite(
        dir,
        &out,
        json!({"quant_method": "mxfp4",
               "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"]}),
    )
}

/// Replaces the checkpoint in `dir` by `out`'s tensors (name: dtype, shape, bytes) and sets
/// config.json's `quantization_config` to `quant`.
fn rewrite(
    dir: &Path,
    out: &BTreeMap<String, (safetensors::tensor::Dtype, Vec<usize>, Vec<u8>)>,
    quant: serde_json::Value,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    let st = dir.join("model.safetensors");
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, (d, s, b))| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Internal(format!("tensor {n}: {e}")))
        })
        .collect::<Result<_>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let tmp = dir.join("model.safetensors.tmp");
    safetensors::tensor::serialize_to_file(views, Some(meta), &tmp)
        .map_err(|e| Error::Internal(format!("writing {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, &st).map_err(|e| Error::io(&st, e))?;
    let cp = dir.join("config.json");
    let text = std::fs::read_to_string(&cp).map_err(|e| Error::io(&cp, e))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
        path: cp.clone(),
        reason: e.to_string(),
    })?;
    cfg["quantization_config"] = quant;
    std::fs::write(&cp, serde_json::to_vec_pretty(&cfg).unwrap_or_default())
        .map_err(|e| Error::io(&cp, e))
}
