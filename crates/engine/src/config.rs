//! `config.json` of a Hugging Face `qwen3_moe` checkpoint, validated once.
//!
//! Accepts both the hub's names (`num_experts`, `rope_theta`) and the names recent
//! `transformers` (5.x) writes (`num_local_experts`, `rope_parameters.rope_theta`).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// The model shape, as the engine uses it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The model family (config.json `model_type` / `architectures`).
    pub family: Family,
    /// RMSNorm of each q and k head before RoPE (qwen3_moe); none in mixtral and qwen2_moe.
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (qwen2_moe).
    pub qkv_bias: bool,
    /// Width of the shared expert every token of a MoE layer also goes through (qwen2_moe's
    /// `shared_expert`; glm4_moe's `shared_experts`, `n_shared_experts` experts' width); 0: none.
    pub shared_expert_intermediate_size: usize,
    /// Whether the shared expert's output is scaled by a sigmoid gate (qwen2_moe) or added as
    /// it is (glm4_moe).
    pub shared_expert_gated: bool,
    /// How the router turns logits into the top-k and its weights.
    pub routing: Routing,
    /// The routed experts' weights are multiplied by this (glm4_moe, deepseek_v3); 1 elsewhere.
    pub routed_scaling_factor: f32,
    /// Dimensions of each q/k head that RoPE rotates (the first ones, rotate-half layout);
    /// `head_dim` unless the family rotates part of the head (glm4_moe's
    /// `partial_rotary_factor`; deepseek_v3's `qk_rope_head_dim`).
    pub rotary_dim: usize,
    /// RoPE rotates interleaved pairs `(x0, x1), (x2, x3), ...` (deepseek_v3's
    /// `rope_interleave`) instead of the halves.
    pub rope_interleave: bool,
    /// YaRN's context extension of RoPE (`rope_parameters.rope_type: "yarn"`).
    pub yarn: Option<Yarn>,
    /// The softmax scale of the attention scores: 1/sqrt(q/k head width), times deepseek_v3's
    /// YaRN `mscale_all_dim` correction squared.
    pub attention_scale: f32,
    /// Multi-head latent attention (deepseek_v3): its shapes; the q/k/v fields above then
    /// describe the heads it expands to (`head_dim` = nope + rope).
    pub mla: Option<Mla>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Width of each expert's SwiGLU (gate/up rows, down columns).
    pub moe_intermediate_size: usize,
    /// Width of dense MLP layers (layers listed in `mlp_only_layers` or off the sparse step).
    pub intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// FP8 block-scaled weights: the block each held scale covers (rows x columns); None
    /// for unquantised ones. `quant_method: "fp8"` (DeepSeek's, Qwen's): its
    /// `weight_block_size`; compressed-tensors' `float-quantized` with a scale per output row
    /// or per tensor: 1 x 128 (each scale repeated over its row's blocks on load, so every
    /// FP8 matrix has one block shape, as the GPU's expert kernels need).
    pub fp8_block: Option<[usize; 2]>,
    /// Where the FP8 weights' scales are and what each covers as stored.
    pub fp8_scales: Fp8Scales,
    /// A bias on the o projection too (gpt_oss, whose `attention_bias` covers q, k, v and o).
    pub o_bias: bool,
    /// A learned logit per head (`self_attn.sinks`, gpt_oss) joins each softmax of the
    /// attention, takes its share of the weight and is dropped.
    pub attention_sinks: bool,
    /// Per decoder layer, the sliding window of its attention (`layer_types`
    /// `"sliding_attention"` with `sliding_window`): a query attends to the last `w` positions,
    /// itself included. None: to every earlier position.
    pub windows: Vec<Option<usize>>,
    /// The router's logits have a bias (`mlp.router.bias`, gpt_oss).
    pub router_logit_bias: bool,
    /// The routed experts' activation.
    pub expert_glu: Glu,
    /// The routed experts' gate/up and down projections have biases (gpt_oss).
    pub expert_bias: bool,
}

/// The gated activation between an expert's gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// `silu(gate) * up`.
    Silu,
    /// gpt_oss: `(up + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)` and `up`
    /// clamped to `[-limit, limit]`.
    Clamped { alpha: f32, limit: f32 },
}

impl Glu {
    /// The activation of one gate and up value.
    #[inline]
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        match self {
            Glu::Silu => crate::ops::silu(gate) * up,
            Glu::Clamped { alpha, limit } => {
                let g = gate.min(limit);
                let u = up.clamp(-limit, limit);
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }
        }
    }
}

/// YaRN (arXiv 2309.00071) as transformers computes it: the RoPE frequencies blended between
/// interpolated (divided by `factor`) and extrapolated over the dimensions whose wavelength
/// falls between the `beta_fast` and `beta_slow` rotations of the original context, and the
/// cos/sin tables scaled by `attention_factor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub attention_factor: f32,
    /// Whether the correction range is rounded to whole dimensions (`truncate`, default true).
    pub truncate: bool,
}

/// Multi-head latent attention (DeepSeek-V2/V3): q through an optional low-rank `q_lora_rank`
/// bottleneck; k and v from one `kv_lora_rank` latent per position (plus a rotary key of
/// `qk_rope_head_dim` shared by the heads), which is what the KV cache stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mla {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// How a router picks: every family ranks by its scores, they differ in the scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// Softmax over the logits, the top-k of the probabilities (renormalised when
    /// `norm_topk_prob`).
    Softmax,
    /// Sigmoid of the logits; the choice ranks sigmoid + the layer's correction bias
    /// (`e_score_correction_bias`), only among the `topk_group` best of `n_group` expert groups
    /// (a group scored by the sum of its two best); the weights are the picked sigmoids
    /// (renormalised when `norm_topk_prob`), times `routed_scaling_factor` (glm4_moe,
    /// deepseek_v3).
    SigmoidGrouped { n_group: usize, topk_group: usize },
}

/// The MoE families this engine computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3MoeForCausalLM: q/k norm, softmax top-k (renormalised when norm_topk_prob).
    Qwen3Moe,
    /// MixtralForCausalLM: no q/k norm, softmax top-k always renormalised, no dense layers.
    Mixtral,
    /// Qwen2MoeForCausalLM: q/k/v biases, no q/k norm, a gated shared expert beside the
    /// routed ones, softmax top-k (renormalised when norm_topk_prob).
    Qwen2Moe,
    /// Glm4MoeForCausalLM (GLM-4.5 / 4.6): partial rotary, optional q/k norm, q/k/v biases,
    /// an ungated shared expert, sigmoid routing with a correction bias, dense first layers.
    Glm4Moe,
    /// DeepseekV3ForCausalLM (DeepSeek-V3 / R1 / V3.x, Kimi K2): multi-head latent attention
    /// with interleaved RoPE and YaRN, the sigmoid group-limited router, an ungated shared
    /// expert, dense first layers.
    DeepseekV3,
    /// GptOssForCausalLM (gpt-oss-20b / 120b): attention sinks, sliding-window layers
    /// alternating with full ones, biases on q/k/v/o, the router and the experts, a softmax
    /// over the top-k logits, the clamped SwiGLU with interleaved gate/up columns, YaRN.
    GptOss,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Glm4Moe => "glm4_moe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::GptOss => "gpt_oss",
        }
    }

    /// The family a config.json names (`model_type`, else its `architectures`).
    fn of(model_type: Option<&str>, architectures: Option<&[String]>) -> Option<Family> {
        let by_type = |t: &str| match t {
            "qwen3_moe" => Some(Family::Qwen3Moe),
            "mixtral" => Some(Family::Mixtral),
            "qwen2_moe" => Some(Family::Qwen2Moe),
            "glm4_moe" => Some(Family::Glm4Moe),
            "deepseek_v3" => Some(Family::DeepseekV3),
            "gpt_oss" => Some(Family::GptOss),
            _ => None,
        };
        let by_arch = |a: &str| match a {
            "Qwen3MoeForCausalLM" => Some(Family::Qwen3Moe),
            "MixtralForCausalLM" => Some(Family::Mixtral),
            "Qwen2MoeForCausalLM" => Some(Family::Qwen2Moe),
            "Glm4MoeForCausalLM" => Some(Family::Glm4Moe),
            "DeepseekV3ForCausalLM" => Some(Family::DeepseekV3),
            "GptOssForCausalLM" => Some(Family::GptOss),
            _ => None,
        };
        model_type
            .and_then(by_type)
            .or_else(|| architectures?.iter().find_map(|a| by_arch(a)))
    }
}

#[derive(Deserialize)]
struct Raw {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    moe_intermediate_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    experts_per_token: Option<usize>,
    norm_topk_prob: Option<bool>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    attention_bias: Option<bool>,
    shared_expert_intermediate_size: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    first_k_dense_replace: Option<usize>,
    routed_scaling_factor: Option<f64>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    use_qk_norm: Option<bool>,
    partial_rotary_factor: Option<f64>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
    scoring_func: Option<String>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<Value>,
    layer_types: Option<Vec<String>>,
    swiglu_limit: Option<f64>,
    swiglu_alpha: Option<f64>,
    /// qwen2_moe in transformers 5: whether q, k and v have biases (true when absent)
    qkv_bias: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    quantization_config: Option<Value>,
}

impl Raw {
    /// Every size at most what any model has by far, before any of them is multiplied or
    /// allocated for: a config.json of absurd numbers is refused by field, not an overflow
    /// or an allocation that fails.
    fn check_sizes(&self) -> Result<()> {
        const DIM: usize = 1 << 20;
        let sizes = [
            ("vocab_size", self.vocab_size, 1 << 24),
            ("hidden_size", self.hidden_size, DIM),
            ("num_hidden_layers", self.num_hidden_layers, 4096),
            ("num_attention_heads", self.num_attention_heads, 1 << 14),
            ("num_key_value_heads", self.num_key_value_heads, 1 << 14),
            ("head_dim", self.head_dim, 1 << 14),
            ("moe_intermediate_size", self.moe_intermediate_size, DIM),
            ("intermediate_size", self.intermediate_size, DIM),
            ("num_experts", self.num_experts, 1 << 16),
            ("num_local_experts", self.num_local_experts, 1 << 16),
            ("n_routed_experts", self.n_routed_experts, 1 << 16),
            ("num_experts_per_tok", self.num_experts_per_tok, 1 << 16),
            ("experts_per_token", self.experts_per_token, 1 << 16),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1 << 30,
            ),
            ("decoder_sparse_step", self.decoder_sparse_step, 1 << 16),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
                DIM,
            ),
            ("n_shared_experts", self.n_shared_experts, 1 << 10),
            ("first_k_dense_replace", self.first_k_dense_replace, 1 << 16),
            ("n_group", self.n_group, 1 << 16),
            ("topk_group", self.topk_group, 1 << 16),
            ("q_lora_rank", self.q_lora_rank, DIM),
            ("kv_lora_rank", self.kv_lora_rank, DIM),
            ("qk_nope_head_dim", self.qk_nope_head_dim, 1 << 14),
            ("qk_rope_head_dim", self.qk_rope_head_dim, 1 << 14),
            ("v_head_dim", self.v_head_dim, 1 << 14),
        ];
        for (field, v, max) in sizes {
            if let Some(v) = v.filter(|&v| v > max) {
                return Err(Error::Config {
                    field,
                    value: v.to_string(),
                    reason: format!("larger than any model's (at most {max})"),
                });
            }
        }
        if let Some(l) = self.mlp_only_layers.as_ref().filter(|l| l.len() > 4096) {
            return Err(Error::Config {
                field: "mlp_only_layers",
                value: format!("{} entries", l.len()),
                reason: "more than any model's layers".into(),
            });
        }
        Ok(())
    }
}

/// Each decoder layer's attention window: `layer_types` where config.json lists them (a
/// `sliding_attention` layer sees the last `sliding_window` positions), else gpt_oss's
/// alternation (even layers slide, 128 positions unless `sliding_window` says), else none.
fn layer_windows(
    types: Option<&[String]>,
    window: Option<usize>,
    oss: bool,
    layers: usize,
) -> Result<Vec<Option<usize>>> {
    let bad = |field: &'static str, value: String, reason: &str| Error::Config {
        field,
        value,
        reason: reason.into(),
    };
    let Some(types) = types else {
        return Ok((0..layers)
            .map(|l| (oss && l % 2 == 0).then(|| window.unwrap_or(128)))
            .collect());
    };
    if types.len() != layers {
        return Err(bad(
            "layer_types",
            format!("{} entries", types.len()),
            &format!("must name each of the {layers} layers"),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => Ok(None),
            "sliding_attention" => match window {
                Some(w) if w > 0 => Ok(Some(w)),
                _ => Err(bad(
                    "sliding_window",
                    format!("{window:?}"),
                    "layer_types lists sliding_attention layers: a positive window is needed",
                )),
            },
            other => Err(bad(
                "layer_types",
                other.into(),
                "only full_attention and sliding_attention layers are supported",
            )),
        })
        .collect()
}

fn need(family: Family, field: &'static str, v: Option<usize>) -> Result<usize> {
    v.ok_or(Error::Config {
        field,
        value: "missing".into(),
        reason: format!("required by {}", family.name()),
    })
}

/// The token ids of `field` (an id, a list of ids, or null): each a whole number that fits a
/// token id, else refused naming the field (an id of 2^32 + 329 must not become 329).
fn token_ids(field: &'static str, v: &Option<Value>) -> Result<Vec<u32>> {
    let one = |x: &Value| {
        x.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| Error::Config {
                field,
                value: x.to_string(),
                reason: "a token id is a whole number from 0 to 4294967295".into(),
            })
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(x) => one(x).map(|t| vec![t]),
    }
}

/// How an FP8 checkpoint stores the scales of its weights: the tensor beside each FP8
/// `*.weight` and the part of it each scale covers. Dequantised, an element is its e4m3 value
/// times its scale, in every scheme.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Scales {
    /// `*.weight_scale_inv`, one per block of `fp8_block` (`quant_method: "fp8"`: DeepSeek-V3,
    /// Qwen3-*-FP8).
    #[default]
    BlockInv,
    /// compressed-tensors (llm-compressor's FP8 output, `format: "float-quantized"`):
    /// `*.weight_scale`, one per output row (`strategy: "channel"`, `[rows, 1]`).
    Channel,
    /// compressed-tensors, one `*.weight_scale` for the whole tensor (`strategy: "tensor"`).
    Tensor,
    /// compressed-tensors, one `*.weight_scale` per block of `fp8_block` (`strategy:
    /// "block"`, its `block_structure`).
    Block,
}

impl Fp8Scales {
    /// What the name of an FP8 weight's scales adds to the weight's name.
    fn suffix(self) -> &'static str {
        match self {
            Fp8Scales::BlockInv => "_scale_inv",
            _ => "_scale",
        }
    }

    /// The name of the scales of FP8 weight `name`.
    pub fn tensor_of(self, name: &str) -> String {
        format!("{name}{}", self.suffix())
    }

    /// The weight whose scales tensor `name` is, if it is one ([`Fp8Scales::tensor_of`]'s
    /// inverse).
    pub fn weight_of(self, name: &str) -> Option<&str> {
        name.strip_suffix(self.suffix())
            .filter(|w| w.ends_with(".weight"))
    }

    /// The shape the scales of a `rows x cols` FP8 weight are stored in (`block`: the
    /// config's `fp8_block`); a tensor's single scale may also be stored as `[]` or `[1, 1]`.
    pub fn stored_shape(self, block: [usize; 2], rows: usize, cols: usize) -> Vec<usize> {
        match self {
            Fp8Scales::BlockInv | Fp8Scales::Block => {
                vec![
                    rows.div_ceil(block[0].max(1)),
                    cols.div_ceil(block[1].max(1)),
                ]
            }
            Fp8Scales::Channel => vec![rows, 1],
            Fp8Scales::Tensor => vec![1],
        }
    }
}

/// The block every compressed-tensors scale per row or per tensor is held as (1 x 128).
pub const FP8_ROW_BLOCK: [usize; 2] = [1, 128];

/// How many f32 scales a `rows x cols` FP8 matrix is held with, one per block of `block`.
pub fn held_scale_count(block: [usize; 2], rows: usize, cols: usize) -> usize {
    rows.div_ceil(block[0].max(1)) * cols.div_ceil(block[1].max(1))
}

/// The FP8 block size and scale scheme a `quantization_config` names (None without one);
/// any other quantisation is refused, naming its method.
fn fp8_block(q: Option<&Value>, family: Family) -> Result<Option<([usize; 2], Fp8Scales)>> {
    let Some(q) = q.filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let bad = |field: &'static str, value: String, reason: &str| Error::Config {
        field,
        value,
        reason: reason.into(),
    };
    let method = q
        .get("quant_method")
        .and_then(|m| m.as_str())
        .unwrap_or("none");
    // gpt_oss's MXFP4 experts are told by their tensors (`*_blocks`, `*_scales`)
    if method == "mxfp4" && family == Family::GptOss {
        return Ok(None);
    }
    if method == "compressed-tensors" {
        return compressed_fp8(q).map(Some);
    }
    if method != "fp8" {
        return Err(bad(
            "quantization_config.quant_method",
            method.into(),
            "only fp8 (e4m3 with block scales), compressed-tensors' float-quantized FP8 and \
             mxfp4 for gpt_oss are supported",
        ));
    }
    if let Some(f) = q.get("fmt").and_then(|f| f.as_str()) {
        if f != "e4m3" {
            return Err(bad(
                "quantization_config.fmt",
                f.into(),
                "only e4m3 is supported",
            ));
        }
    }
    let block = match q.get("weight_block_size") {
        None | Some(Value::Null) => [128, 128],
        Some(Value::Array(a)) if a.len() == 2 => {
            let d = |v: &Value| v.as_u64().filter(|&x| x > 0 && x <= 1 << 16);
            match (d(&a[0]), d(&a[1])) {
                (Some(r), Some(c)) => [r as usize, c as usize],
                _ => {
                    return Err(bad(
                        "quantization_config.weight_block_size",
                        Value::Array(a.clone()).to_string(),
                        "must be two positive block sizes",
                    ))
                }
            }
        }
        Some(v) => {
            return Err(bad(
                "quantization_config.weight_block_size",
                v.to_string(),
                "must be [rows, columns]",
            ))
        }
    };
    Ok(Some((block, Fp8Scales::BlockInv)))
}

/// compressed-tensors' FP8 weights (llm-compressor's `FP8`, `FP8_DYNAMIC` and `FP8_BLOCK`
/// schemes): `format: "float-quantized"`, every config group's weights 8-bit floats, one
/// symmetric scale per output row, per tensor or per block. The activations' quantisation
/// (dynamic per token, or static `input_scale`s) is not applied: they stay in f32, which
/// only removes rounding the model was calibrated to tolerate. Anything else (int4/int8
/// `pack-quantized` or `int-quantized`, group scales, zero points, sparsity) is refused.
fn compressed_fp8(q: &Value) -> Result<([usize; 2], Fp8Scales)> {
    let bad = |field: &'static str, value: String, reason: &str| Error::Config {
        field,
        value,
        reason: reason.into(),
    };
    let text = |v: Option<&Value>| v.map_or("null".to_string(), |v| v.to_string());
    let format = q.get("format").and_then(|f| f.as_str()).unwrap_or("none");
    if format != "float-quantized" {
        return Err(bad(
            "quantization_config.format",
            text(q.get("format")),
            "of compressed-tensors, only float-quantized (FP8 e4m3 weights) is supported",
        ));
    }
    // a sparsity config stored `dense` (or saying nothing) keeps every weight in place
    if let Some(f) = q
        .get("sparsity_config")
        .and_then(|s| s.get("format"))
        .filter(|f| f.as_str() != Some("dense") && !f.is_null())
    {
        return Err(bad(
            "quantization_config.sparsity_config.format",
            f.to_string(),
            "sparse compressed-tensors checkpoints are not supported (only dense)",
        ));
    }
    let groups = match q.get("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        other => {
            return Err(bad(
                "quantization_config.config_groups",
                text(other),
                "must name at least one group of quantised weights",
            ))
        }
    };
    let mut found: Option<([usize; 2], Fp8Scales)> = None;
    for (name, g) in groups {
        // the group is named in the value: `group_0: "int"`
        let val = |v: Option<&Value>| format!("{name}: {}", text(v));
        let Some(w) = g.get("weights").filter(|w| w.is_object()) else {
            return Err(bad(
                "quantization_config.config_groups.*.weights",
                val(g.get("weights")),
                "must describe the group's weights",
            ));
        };
        if w.get("type").and_then(|t| t.as_str()) != Some("float") {
            return Err(bad(
                "quantization_config.config_groups.*.weights.type",
                val(w.get("type")),
                "only float (FP8) weights are supported",
            ));
        }
        if w.get("num_bits").and_then(|n| n.as_u64()) != Some(8) {
            return Err(bad(
                "quantization_config.config_groups.*.weights.num_bits",
                val(w.get("num_bits")),
                "only 8-bit (e4m3) weights are supported",
            ));
        }
        if w.get("symmetric").and_then(|s| s.as_bool()) == Some(false) {
            return Err(bad(
                "quantization_config.config_groups.*.weights.symmetric",
                val(w.get("symmetric")),
                "zero points are not supported: only symmetric scales",
            ));
        }
        if w.get("dynamic").and_then(|d| d.as_bool()) == Some(true) {
            return Err(bad(
                "quantization_config.config_groups.*.weights.dynamic",
                val(w.get("dynamic")),
                "weights quantised on the fly carry no scales to load",
            ));
        }
        let scheme = match w.get("strategy").and_then(|s| s.as_str()) {
            Some("channel") => (FP8_ROW_BLOCK, Fp8Scales::Channel),
            Some("tensor") => (FP8_ROW_BLOCK, Fp8Scales::Tensor),
            Some("block") => {
                let d = |v: &Value| v.as_u64().filter(|&x| x > 0 && x <= 1 << 16);
                match w.get("block_structure") {
                    Some(Value::Array(a)) if a.len() == 2 => match (d(&a[0]), d(&a[1])) {
                        (Some(r), Some(c)) => ([r as usize, c as usize], Fp8Scales::Block),
                        _ => {
                            return Err(bad(
                                "quantization_config.config_groups.*.weights.block_structure",
                                val(w.get("block_structure")),
                                "must be two positive block sizes",
                            ))
                        }
                    },
                    other => {
                        return Err(bad(
                            "quantization_config.config_groups.*.weights.block_structure",
                            val(other),
                            "must be [rows, columns]",
                        ))
                    }
                }
            }
            _ => {
                return Err(bad(
                    "quantization_config.config_groups.*.weights.strategy",
                    val(w.get("strategy")),
                    "only channel, tensor and block scales are supported",
                ))
            }
        };
        if found.is_some_and(|f| f != scheme) {
            return Err(bad(
                "quantization_config.config_groups.*.weights.strategy",
                val(w.get("strategy")),
                "every config group must scale its weights the same way",
            ));
        }
        found = Some(scheme);
    }
    found.ok_or_else(|| {
        bad(
            "quantization_config.config_groups",
            "{}".into(),
            "must name at least one group of quantised weights",
        )
    })
}

/// What `generation_config.json` says a request that does not say otherwise gets: the
/// end-of-sequence ids, and the sampling defaults. `do_sample: false` is greedy (the model's
/// authors said so); otherwise its `temperature`, `top_p` and `top_k` where it gives them (as
/// vLLM reads them), and nothing where it does not (the server's own defaults apply).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub eos_token_ids: Vec<u32>,
    /// `Some(0.0)` when the file asks for greedy decoding; None when it says nothing.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// A positive k; None where the file gives none, or 0 or less (no top-k, as transformers
    /// reads 0).
    pub top_k: Option<u32>,
}

#[derive(Deserialize)]
struct RawGeneration {
    eos_token_id: Option<Value>,
    do_sample: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<f64>,
}

impl Generation {
    /// Reads `dir/generation_config.json`; a checkpoint without one has the defaults.
    pub fn read(dir: &Path) -> Result<Generation> {
        let path = dir.join("generation_config.json");
        let text = match moelane_text::files::read_bounded_text(
            &path,
            moelane_text::files::CONFIG_LIMIT,
        ) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Generation::default()),
            Err(e) => return Err(Error::io(&path, e)),
        };
        let raw: RawGeneration = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let finite = |field: &'static str, v: Option<f64>, ok: fn(f64) -> bool| match v {
            Some(x) if !x.is_finite() || !ok(x) => Err(Error::Config {
                field,
                value: x.to_string(),
                reason: format!("out of range in {}", path.display()),
            }),
            v => Ok(v.map(|x| x as f32)),
        };
        let temperature = finite("temperature", raw.temperature, |t| t >= 0.0)?;
        let top_p = finite("top_p", raw.top_p, |p| p > 0.0 && p <= 1.0)?;
        let top_k = finite("top_k", raw.top_k, |k| {
            k.fract() == 0.0 && k <= u32::MAX as f64
        })?
        .filter(|&k| k > 0.0 && raw.do_sample != Some(false))
        .map(|k| k as u32);
        Ok(Generation {
            top_k,
            eos_token_ids: token_ids("eos_token_id", &raw.eos_token_id)?,
            temperature: if raw.do_sample == Some(false) {
                Some(0.0)
            } else {
                temperature
            },
            top_p: if raw.do_sample == Some(false) {
                None
            } else {
                top_p
            },
        })
    }
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = moelane_text::files::read_bounded_text(path, moelane_text::files::CONFIG_LIMIT)
            .map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: Raw = serde_json::from_str(text).map_err(|e| Error::Json {
            path: path.into(),
            reason: e.to_string(),
        })?;
        raw.check_sizes()?;
        let Some(family) = Family::of(raw.model_type.as_deref(), raw.architectures.as_deref())
        else {
            let found = raw
                .model_type
                .clone()
                .or_else(|| raw.architectures.as_ref().and_then(|a| a.first().cloned()))
                .unwrap_or_else(|| "none".into());
            return Err(Error::UnsupportedArchitecture {
                path: path.into(),
                found,
            });
        };
        let bad = |field: &'static str, value: String, reason: &str| Error::Config {
            field,
            value,
            reason: reason.into(),
        };
        let glm = family == Family::Glm4Moe;
        let ds = family == Family::DeepseekV3;
        if ds && raw.scoring_func.as_deref().is_some_and(|f| f != "sigmoid") {
            return Err(bad(
                "scoring_func",
                raw.scoring_func.clone().unwrap_or_default(),
                "deepseek_v3 routes by sigmoid",
            ));
        }
        let oss = family == Family::GptOss;
        if raw.attention_bias == Some(true)
            && !matches!(family, Family::Qwen2Moe | Family::Glm4Moe | Family::GptOss)
        {
            return Err(bad(
                "attention_bias",
                "true".into(),
                "attention biases are not supported",
            ));
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(bad("hidden_act", act.clone(), "only silu is supported"));
            }
        }
        if raw.use_sliding_window == Some(true) {
            return Err(bad(
                "use_sliding_window",
                "true".into(),
                "sliding-window attention is not supported",
            ));
        }
        // rope_scaling / rope_parameters: default RoPE or YaRN; other types are refused
        let rope_params = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        let mut rope_theta = raw.rope_theta;
        let mut partial = raw.partial_rotary_factor;
        let mut yarn = None;
        // deepseek_v3's softmax-scale correction, mscale(factor, mscale_all_dim)^2
        let mut mscale_all = 1.0f64;
        let rope_field = if raw.rope_parameters.is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        match rope_params {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(v) => {
                return Err(bad(
                    rope_field,
                    v.to_string(),
                    "must be an object (with rope_type, factor, ...) or null",
                ))
            }
        }
        if let Some(Value::Object(p)) = rope_params {
            // a field that is there must have its type: a string factor is not left out
            for (k, number) in [
                ("rope_type", false),
                ("type", false),
                ("factor", true),
                ("original_max_position_embeddings", true),
                ("attention_factor", true),
                ("beta_fast", true),
                ("beta_slow", true),
                ("mscale", true),
                ("mscale_all_dim", true),
                ("rope_theta", true),
                ("partial_rotary_factor", true),
            ] {
                match p.get(k) {
                    None | Some(Value::Null) => {}
                    Some(Value::Number(_)) if number => {}
                    Some(Value::String(_)) if !number => {}
                    Some(v) => {
                        return Err(bad(
                            if number {
                                "rope_parameters (a number field)"
                            } else {
                                "rope_parameters.rope_type"
                            },
                            format!("{k}: {v}"),
                            if number {
                                "must be a number"
                            } else {
                                "must be a string"
                            },
                        ))
                    }
                }
            }
            match p
                .get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(|t| t.as_str())
            {
                None | Some("default") => {}
                Some("yarn") => {
                    let num = |k: &str| p.get(k).and_then(|v| v.as_f64());
                    let orig = num("original_max_position_embeddings").ok_or_else(|| {
                        bad(
                            "rope_parameters.original_max_position_embeddings",
                            "missing".into(),
                            "YaRN needs the original context length",
                        )
                    })?;
                    if orig.is_nan() || orig < 1.0 {
                        return Err(bad(
                            "rope_parameters.original_max_position_embeddings",
                            orig.to_string(),
                            "YaRN's original context must be at least one position",
                        ));
                    }
                    let factor = num("factor")
                        .unwrap_or(raw.max_position_embeddings.unwrap_or(0) as f64 / orig);
                    if !(factor.is_finite() && factor > 0.0) {
                        return Err(bad(
                            "rope_parameters.factor",
                            factor.to_string(),
                            "YaRN's factor must be finite and positive",
                        ));
                    }
                    let m = |scale: f64, ms: f64| {
                        if scale <= 1.0 {
                            1.0
                        } else {
                            0.1 * ms * scale.ln() + 1.0
                        }
                    };
                    let (ms, all) = (
                        num("mscale").filter(|x| *x != 0.0),
                        num("mscale_all_dim").filter(|x| *x != 0.0),
                    );
                    let attention_factor = match (num("attention_factor"), ms, all) {
                        (Some(a), _, _) => a,
                        (None, Some(ms), Some(all)) => m(factor, ms) / m(factor, all),
                        _ => m(factor, 1.0),
                    };
                    if let Some(all) = all {
                        mscale_all = m(factor, all) * m(factor, all);
                    }
                    let beta = |k: &str, d: f64| num(k).filter(|x| *x != 0.0).unwrap_or(d);
                    let y = Yarn {
                        factor: factor as f32,
                        original_max_position_embeddings: orig as usize,
                        beta_fast: beta("beta_fast", 32.0) as f32,
                        beta_slow: beta("beta_slow", 1.0) as f32,
                        attention_factor: attention_factor as f32,
                        truncate: p.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true),
                    };
                    // each as the tables use it (f32): 1e300 is finite as f64, not as f32
                    for (k, x) in [
                        ("rope_parameters.factor", y.factor),
                        ("rope_parameters.attention_factor", y.attention_factor),
                        ("rope_parameters.beta_fast", y.beta_fast),
                        ("rope_parameters.beta_slow", y.beta_slow),
                        ("rope_parameters.mscale_all_dim", mscale_all as f32),
                    ] {
                        if !(x.is_finite() && x > 0.0) {
                            return Err(bad(
                                k,
                                x.to_string(),
                                "must be finite and positive as an f32",
                            ));
                        }
                    }
                    // equal is allowed (Kimi K2 ships 1 and 1: the ramp's ends then meet,
                    // as transformers handles it)
                    if y.beta_fast < y.beta_slow {
                        return Err(bad(
                            "rope_parameters.beta_fast",
                            y.beta_fast.to_string(),
                            &format!(
                                "must not be below beta_slow ({}): the dimensions YaRN leaves \
                                 unscaled rotate faster than those it interpolates",
                                y.beta_slow
                            ),
                        ));
                    }
                    if orig > u32::MAX as f64 {
                        return Err(bad(
                            "rope_parameters.original_max_position_embeddings",
                            orig.to_string(),
                            "is larger than any context",
                        ));
                    }
                    yarn = Some(y);
                }
                Some(t) => {
                    return Err(bad(
                        "rope_parameters.rope_type",
                        t.into(),
                        "only default RoPE and yarn are supported",
                    ))
                }
            }
            if rope_theta.is_none() {
                rope_theta = p.get("rope_theta").and_then(|t| t.as_f64());
            }
            if partial.is_none() {
                partial = p.get("partial_rotary_factor").and_then(|t| t.as_f64());
            }
        }
        let need = |field, v| need(family, field, v);
        let hidden_size = need("hidden_size", raw.hidden_size)?;
        let num_attention_heads = need("num_attention_heads", raw.num_attention_heads)?;
        // Mixtral: every layer sparse, the experts' width is `intermediate_size`, the top-k
        // weights always renormalised; a sliding window wider than the context never slides
        // (the context is capped at the window, so attention stays exact)
        let mixtral = family == Family::Mixtral;
        let moe_intermediate_size = if mixtral || oss {
            need("intermediate_size", raw.intermediate_size)?
        } else {
            need("moe_intermediate_size", raw.moe_intermediate_size)?
        };
        let window = match &raw.sliding_window {
            Some(Value::Number(n)) => n.as_u64().map(|w| w as usize),
            _ => None,
        };
        let num_hidden_layers = need("num_hidden_layers", raw.num_hidden_layers)?;
        let windows = layer_windows(raw.layer_types.as_deref(), window, oss, num_hidden_layers)?;
        let fp8 = fp8_block(raw.quantization_config.as_ref(), family)?;
        let max_pos = raw.max_position_embeddings.unwrap_or(32768);
        let max_position_embeddings = match window {
            Some(w) if mixtral && w > 0 => max_pos.min(w),
            _ => max_pos,
        };
        let qwen2 = family == Family::Qwen2Moe;
        let mla = if ds {
            Some(Mla {
                q_lora_rank: raw.q_lora_rank,
                kv_lora_rank: need("kv_lora_rank", raw.kv_lora_rank)?,
                qk_nope_head_dim: need("qk_nope_head_dim", raw.qk_nope_head_dim)?,
                qk_rope_head_dim: need("qk_rope_head_dim", raw.qk_rope_head_dim)?,
                v_head_dim: need("v_head_dim", raw.v_head_dim)?,
            })
        } else {
            None
        };
        // an MLA head is its nope and rope parts
        let head_dim = match &mla {
            Some(m) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            None => raw
                .head_dim
                .unwrap_or(hidden_size / num_attention_heads.max(1)),
        };
        // glm4_moe rotates the first partial_rotary_factor of each head (0.5 unless it says)
        let factor = if glm { partial.unwrap_or(0.5) } else { 1.0 };
        if !(factor > 0.0 && factor <= 1.0) {
            return Err(bad(
                "partial_rotary_factor",
                factor.to_string(),
                "must be in (0, 1]",
            ));
        }
        let shared_expert_intermediate_size = match family {
            // required: without it the shared expert's weights would be skipped unseen
            Family::Qwen2Moe => need(
                "shared_expert_intermediate_size",
                raw.shared_expert_intermediate_size,
            )?,
            Family::Glm4Moe | Family::DeepseekV3 => {
                raw.n_shared_experts.unwrap_or(1) * moe_intermediate_size
            }
            _ => 0,
        };
        let sigmoid = glm || ds;
        let cfg = ModelConfig {
            family,
            qk_norm: match family {
                Family::Qwen3Moe => true,
                Family::Glm4Moe => raw.use_qk_norm.unwrap_or(false),
                _ => false,
            },
            // transformers 5 writes qwen2_moe's `qkv_bias` (true before it existed)
            qkv_bias: (qwen2 && raw.qkv_bias.unwrap_or(true))
                || (glm && raw.attention_bias.unwrap_or(false))
                || (oss && raw.attention_bias.unwrap_or(true)),
            shared_expert_intermediate_size,
            shared_expert_gated: qwen2,
            routing: if sigmoid {
                Routing::SigmoidGrouped {
                    n_group: raw.n_group.unwrap_or(if ds { 8 } else { 1 }),
                    topk_group: raw.topk_group.unwrap_or(if ds { 4 } else { 1 }),
                }
            } else {
                Routing::Softmax
            },
            routed_scaling_factor: if sigmoid {
                raw.routed_scaling_factor
                    .unwrap_or(if ds { 2.5 } else { 1.0 }) as f32
            } else {
                1.0
            },
            rotary_dim: match &mla {
                Some(m) => m.qk_rope_head_dim,
                None => (head_dim as f64 * factor) as usize,
            },
            rope_interleave: ds && raw.rope_interleave.unwrap_or(true),
            yarn,
            attention_scale: ((1.0 / (head_dim as f64).sqrt()) * if ds { mscale_all } else { 1.0 })
                as f32,
            mla,
            vocab_size: need("vocab_size", raw.vocab_size)?,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim,
            moe_intermediate_size,
            intermediate_size: if mixtral || oss {
                0
            } else {
                raw.intermediate_size.unwrap_or(0)
            },
            num_experts: need(
                "num_experts",
                raw.num_experts
                    .or(raw.num_local_experts)
                    .or(raw.n_routed_experts),
            )?,
            num_experts_per_tok: need(
                "num_experts_per_tok",
                raw.num_experts_per_tok.or(raw.experts_per_token),
            )?,
            // gpt_oss: a softmax over the top-k logits, which is the renormalised top-k of
            // the softmax over all of them
            norm_topk_prob: mixtral || oss || raw.norm_topk_prob.unwrap_or(sigmoid),
            rms_norm_eps: raw
                .rms_norm_eps
                .unwrap_or(if mixtral || oss { 1e-5 } else { 1e-6 })
                as f32,
            rope_theta: rope_theta.unwrap_or(if mixtral {
                1e6
            } else if oss {
                150_000.0
            } else {
                10000.0
            }) as f32,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            decoder_sparse_step: if mixtral || oss {
                1
            } else {
                raw.decoder_sparse_step.unwrap_or(1)
            },
            mlp_only_layers: if mixtral || oss {
                Vec::new()
            } else if sigmoid {
                // the first `first_k_dense_replace` layers are dense
                (0..raw.first_k_dense_replace.unwrap_or(if ds { 3 } else { 1 })).collect()
            } else {
                raw.mlp_only_layers.unwrap_or_default()
            },
            bos_token_id: token_ids("bos_token_id", &raw.bos_token_id)?
                .first()
                .copied(),
            eos_token_ids: token_ids("eos_token_id", &raw.eos_token_id)?,
            fp8_block: fp8.map(|f| f.0),
            fp8_scales: fp8.map_or(Fp8Scales::BlockInv, |f| f.1),
            o_bias: oss && raw.attention_bias.unwrap_or(true),
            attention_sinks: oss,
            windows,
            router_logit_bias: oss,
            expert_glu: if oss {
                Glu::Clamped {
                    alpha: raw.swiglu_alpha.unwrap_or(1.702) as f32,
                    limit: raw.swiglu_limit.unwrap_or(7.0) as f32,
                }
            } else {
                Glu::Silu
            },
            expert_bias: oss,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every relation the engine relies on; names the field, the value and the reason.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: usize, reason: &str| {
            Err(Error::Config {
                field,
                value: value.to_string(),
                reason: reason.into(),
            })
        };
        for (field, ids) in [
            ("bos_token_id", self.bos_token_id.as_slice()),
            ("eos_token_id", self.eos_token_ids.as_slice()),
        ] {
            if let Some(&t) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
                return bad(
                    field,
                    t as usize,
                    "is not a token of the vocabulary (vocab_size)",
                );
            }
        }
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("decoder_sparse_step", self.decoder_sparse_step),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(field, v, "must be positive");
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                "must divide num_attention_heads",
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad("head_dim", self.head_dim, "must be even for RoPE");
        }
        if self.num_experts_per_tok > self.num_experts {
            return bad(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                "exceeds num_experts",
            );
        }
        if self.num_experts > u16::MAX as usize {
            return bad("num_experts", self.num_experts, "at most 65535 experts");
        }
        if self.vocab_size > u32::MAX as usize / 2 {
            return bad("vocab_size", self.vocab_size, "too large");
        }
        if (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l)) && self.intermediate_size == 0
        {
            return bad(
                "intermediate_size",
                0,
                "dense MLP layers exist (mlp_only_layers / decoder_sparse_step) but have no width",
            );
        }
        if let Routing::SigmoidGrouped {
            n_group,
            topk_group,
        } = self.routing
        {
            if n_group == 0 || !self.num_experts.is_multiple_of(n_group) {
                return bad("n_group", n_group, "must divide the routed experts");
            }
            if self.num_experts / n_group < 2 {
                return bad("n_group", n_group, "each group needs at least 2 experts");
            }
            if topk_group == 0 || topk_group > n_group {
                return bad("topk_group", topk_group, "must be in 1..=n_group");
            }
            if self.num_experts_per_tok > topk_group * (self.num_experts / n_group) {
                return bad(
                    "num_experts_per_tok",
                    self.num_experts_per_tok,
                    "exceeds the experts of the topk_group groups",
                );
            }
        }
        if self.rotary_dim == 0 || self.rotary_dim > self.head_dim {
            return bad(
                "partial_rotary_factor",
                self.rotary_dim,
                "rotates no dimension",
            );
        }
        if !self.rotary_dim.is_multiple_of(2) {
            let field = if self.mla.is_some() {
                "qk_rope_head_dim"
            } else {
                "partial_rotary_factor"
            };
            return bad(
                field,
                self.rotary_dim,
                "RoPE rotates an even number of dimensions",
            );
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(Error::Config {
                field: "routed_scaling_factor",
                value: self.routed_scaling_factor.to_string(),
                reason: "must be finite and positive".into(),
            });
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(Error::Config {
                field: "rms_norm_eps",
                value: self.rms_norm_eps.to_string(),
                reason: "must be finite and non-negative".into(),
            });
        }
        if self.windows.len() != self.num_hidden_layers {
            return bad(
                "layer_types",
                self.windows.len(),
                "must name each decoder layer",
            );
        }
        if let Glu::Clamped { alpha, limit } = self.expert_glu {
            if !(limit.is_finite() && limit > 0.0) {
                return Err(Error::Config {
                    field: "swiglu_limit",
                    value: limit.to_string(),
                    reason: "must be finite and positive".into(),
                });
            }
            if !alpha.is_finite() {
                return Err(Error::Config {
                    field: "swiglu_alpha",
                    value: alpha.to_string(),
                    reason: "must be finite".into(),
                });
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(Error::Config {
                field: "rope_theta",
                value: self.rope_theta.to_string(),
                reason: "must be finite and greater than 1".into(),
            });
        }
        Ok(())
    }

    /// Whether decoder layer `l` is a sparse MoE layer (as Hugging Face decides it).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        !self.mlp_only_layers.contains(&l) && (l + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Indices of the MoE layers, in order; the rowmap's layer `i` is `moe_layers()[i]`.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers)
            .filter(|&l| self.is_moe_layer(l))
            .collect()
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    /// Floats the KV cache keeps per position and layer, in its k and its v parts: the k and
    /// v heads, or MLA's latent and rotary key (in k; v none).
    pub fn cache_dims(&self) -> (usize, usize) {
        match &self.mla {
            Some(m) => (m.kv_lora_rank + m.qk_rope_head_dim, 0),
            None => (self.kv_dim(), self.kv_dim()),
        }
    }
    /// Width of the attention's output, the o projection's input (MLA: heads x v_head_dim).
    pub fn o_dim(&self) -> usize {
        match &self.mla {
            Some(m) => self.num_attention_heads * m.v_head_dim,
            None => self.q_dim(),
        }
    }

    /// Bytes of one expert's weights at `bytes_per_param`.
    pub fn expert_params(&self) -> usize {
        3 * self.hidden_size * self.moe_intermediate_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": true, "rope_theta": 10000.0
        })
    }

    #[test]
    fn gpt_oss_windows_biases_and_mxfp4() {
        let p = Path::new("config.json");
        let cfg = serde_json::json!({
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 32, "num_local_experts": 8, "experts_per_token": 2,
            "quantization_config": {"quant_method": "mxfp4"}
        });
        let c = ModelConfig::from_json_str(&cfg.to_string(), p).unwrap();
        // without layer_types: even layers slide over 128 positions
        assert_eq!(c.windows, vec![Some(128), None, Some(128)]);
        assert!(c.attention_sinks && c.o_bias && c.qkv_bias && c.expert_bias);
        assert_eq!((c.num_experts_per_tok, c.moe_intermediate_size), (2, 32));
        assert_eq!(
            c.expert_glu,
            Glu::Clamped {
                alpha: 1.702,
                limit: 7.0
            }
        );
        // transformers reads the activation's alpha from config.json (1.702 when absent)
        let mut a = cfg.clone();
        a["swiglu_alpha"] = 1.0.into();
        let c = ModelConfig::from_json_str(&a.to_string(), p).unwrap();
        assert_eq!(
            c.expert_glu,
            Glu::Clamped {
                alpha: 1.0,
                limit: 7.0
            }
        );
        let mut bad = cfg.clone();
        bad["layer_types"] = serde_json::json!(["sliding_attention", "full_attention"]);
        let e = ModelConfig::from_json_str(&bad.to_string(), p).unwrap_err();
        assert!(e.to_string().contains("layer_types"), "{e}");
        bad["layer_types"] = serde_json::json!(["full_attention", "chunked", "full_attention"]);
        let e = ModelConfig::from_json_str(&bad.to_string(), p).unwrap_err();
        assert!(e.to_string().contains("chunked"), "{e}");
        // MXFP4 is gpt_oss's only
        let mut q = base();
        q["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
        let e = ModelConfig::from_json_str(&q.to_string(), p).unwrap_err();
        assert!(e.to_string().contains("mxfp4"), "{e}");
    }

    #[test]
    fn accepts_both_names() {
        let p = Path::new("config.json");
        let a = ModelConfig::from_json_str(&base().to_string(), p).unwrap();
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.remove("num_experts");
        o.remove("rope_theta");
        o.insert("num_local_experts".into(), 8.into());
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 10000.0}),
        );
        let b = ModelConfig::from_json_str(&v.to_string(), p).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn refuses_other_architectures_and_bad_fields() {
        let p = Path::new("config.json");
        let mut v = base();
        v["model_type"] = "llama".into();
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::UnsupportedArchitecture { .. })
        ));
        let mut v = base();
        v["num_experts_per_tok"] = 9.into();
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::Config {
                field: "num_experts_per_tok",
                ..
            })
        ));
        let mut v = base();
        v["num_key_value_heads"] = 3.into();
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::Config {
                field: "num_key_value_heads",
                ..
            })
        ));
        assert!(matches!(
            ModelConfig::from_json_str("{not json", p),
            Err(Error::Json { .. })
        ));
        // absurd sizes are refused by name before anything is multiplied or allocated
        for (field, value) in [
            ("head_dim", serde_json::json!(1u64 << 62)),
            ("num_attention_heads", serde_json::json!(1u64 << 62)),
            (
                "num_hidden_layers",
                serde_json::json!(1_000_000_000_000_000u64),
            ),
            ("n_shared_experts", serde_json::json!(1u64 << 62)),
            ("kv_lora_rank", serde_json::json!(u64::MAX)),
            ("vocab_size", serde_json::json!(1u64 << 40)),
        ] {
            let mut v = base();
            v[field] = value.clone();
            let e = ModelConfig::from_json_str(&v.to_string(), p).unwrap_err();
            assert!(
                matches!(&e, Error::Config { field: f, .. } if *f == field),
                "{field} = {value}: {e}"
            );
        }
    }

    #[test]
    fn generation_config_sets_eos_and_sampling_defaults() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(Generation::read(d.path()).unwrap(), Generation::default());
        let w = |text: &str| std::fs::write(d.path().join("generation_config.json"), text).unwrap();
        w(r#"{"eos_token_id": [7, 9], "do_sample": true, "temperature": 0.6, "top_p": 0.95}"#);
        let g = Generation::read(d.path()).unwrap();
        assert_eq!(g.eos_token_ids, vec![7, 9]);
        assert_eq!(
            (g.temperature, g.top_p, g.top_k),
            (Some(0.6), Some(0.95), None)
        );
        // Qwen3's: top_k 20; 0 and -1 are no top-k; a fraction names the field
        w(r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95}"#);
        assert_eq!(Generation::read(d.path()).unwrap().top_k, Some(20));
        for off in ["0", "-1"] {
            w(&format!(r#"{{"top_k": {off}}}"#));
            assert_eq!(Generation::read(d.path()).unwrap().top_k, None, "{off}");
        }
        w(r#"{"top_k": 2.5}"#);
        let e = Generation::read(d.path()).unwrap_err().to_string();
        assert!(e.contains("top_k"), "{e}");
        w(r#"{"eos_token_id": 4, "do_sample": false, "temperature": 0.6, "top_k": 5}"#);
        assert_eq!(Generation::read(d.path()).unwrap().top_k, None, "greedy");
        w(r#"{"eos_token_id": 4, "do_sample": false, "temperature": 0.6}"#);
        let g = Generation::read(d.path()).unwrap();
        assert_eq!(
            (g.eos_token_ids, g.temperature, g.top_p),
            (vec![4], Some(0.0), None)
        );
        w(r#"{"temperature": -1}"#);
        assert!(matches!(
            Generation::read(d.path()),
            Err(Error::Config {
                field: "temperature",
                ..
            })
        ));
        w("{oops");
        let e = Generation::read(d.path()).unwrap_err();
        assert!(e.to_string().contains("generation_config.json"), "{e}");
    }

    #[test]
    fn mixtral_configs_are_read_with_their_own_defaults() {
        let p = Path::new("config.json");
        let v = serde_json::json!({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 32768, "sliding_window": 4096
        });
        let c = ModelConfig::from_json_str(&v.to_string(), p).unwrap();
        assert_eq!(c.family, Family::Mixtral);
        assert!(!c.qk_norm && c.norm_topk_prob);
        assert_eq!((c.moe_intermediate_size, c.intermediate_size), (96, 0));
        assert_eq!((c.head_dim, c.num_experts), (16, 8));
        assert_eq!(c.rope_theta, 1e6);
        // a window narrower than the context caps the context: attention never slides
        assert_eq!(c.max_position_embeddings, 4096);
        assert_eq!(c.moe_layers(), vec![0, 1]);
        let mut v = v;
        v["sliding_window"] = serde_json::Value::Null;
        let c = ModelConfig::from_json_str(&v.to_string(), p).unwrap();
        assert_eq!(c.max_position_embeddings, 32768);
    }

    #[test]
    fn qwen2_moe_needs_its_shared_expert_width() {
        let p = Path::new("config.json");
        let mut v = serde_json::json!({
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2
        });
        let c = ModelConfig::from_json_str(&v.to_string(), p).unwrap();
        assert_eq!(c.family, Family::Qwen2Moe);
        assert!(c.qkv_bias && !c.qk_norm && !c.norm_topk_prob);
        assert_eq!(c.shared_expert_intermediate_size, 48);
        // transformers 5's `qkv_bias` (true when absent)
        let mut nb = v.clone();
        nb["qkv_bias"] = false.into();
        assert!(
            !ModelConfig::from_json_str(&nb.to_string(), p)
                .unwrap()
                .qkv_bias
        );
        v.as_object_mut()
            .unwrap()
            .remove("shared_expert_intermediate_size");
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::Config {
                field: "shared_expert_intermediate_size",
                ..
            })
        ));
    }

    #[test]
    fn glm4_moe_configs_are_read_and_checked() {
        let p = Path::new("config.json");
        let mut v = serde_json::json!({
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "moe_intermediate_size": 16, "intermediate_size": 48, "n_routed_experts": 16,
            "n_shared_experts": 2, "first_k_dense_replace": 2, "num_experts_per_tok": 4,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "use_qk_norm": true,
            "attention_bias": true, "partial_rotary_factor": 0.5
        });
        let c = ModelConfig::from_json_str(&v.to_string(), p).unwrap();
        assert_eq!(c.family, Family::Glm4Moe);
        assert!(c.qk_norm && c.qkv_bias && c.norm_topk_prob && !c.shared_expert_gated);
        assert_eq!((c.num_experts, c.shared_expert_intermediate_size), (16, 32));
        assert_eq!((c.rotary_dim, c.routed_scaling_factor), (16, 2.5));
        assert_eq!(
            c.routing,
            Routing::SigmoidGrouped {
                n_group: 4,
                topk_group: 2
            }
        );
        assert_eq!(c.moe_layers(), vec![2, 3]);
        for (field, value) in [
            ("n_group", serde_json::json!(3)),
            ("topk_group", serde_json::json!(5)),
            ("num_experts_per_tok", serde_json::json!(9)),
            ("partial_rotary_factor", serde_json::json!(0.0)),
            // 32 x 0.3 = 9 dimensions: RoPE rotates pairs
            ("partial_rotary_factor", serde_json::json!(0.3)),
            ("routed_scaling_factor", serde_json::json!(-1.0)),
        ] {
            let mut w = v.clone();
            w[field] = value;
            let e = ModelConfig::from_json_str(&w.to_string(), p).unwrap_err();
            assert!(
                matches!(&e, Error::Config { field: f, .. } if *f == field),
                "{field}: {e}"
            );
        }
        v["n_group"] = 8.into();
        v["topk_group"] = 8.into();
        // 2 experts a group is the least the group score (its two best) needs
        assert!(ModelConfig::from_json_str(&v.to_string(), p).is_ok());
        v["n_group"] = 16.into();
        v["topk_group"] = 16.into();
        assert!(ModelConfig::from_json_str(&v.to_string(), p).is_err());
    }

    #[test]
    fn deepseek_v3_configs_read_mla_and_yarn() {
        let p = Path::new("config.json");
        let mut v = serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
            "moe_intermediate_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 4,
            "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 12, "max_position_embeddings": 1024,
            "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        });
        let c = ModelConfig::from_json_str(&v.to_string(), p).unwrap();
        // Kimi K2 names its own model_type; the architecture decides
        assert_eq!(c.family, Family::DeepseekV3);
        let m = c.mla.unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim),
            (Some(24), 32, 12)
        );
        assert_eq!((c.head_dim, c.rotary_dim, c.o_dim()), (24, 8, 48));
        assert_eq!(c.cache_dims(), (40, 0));
        assert!(c.rope_interleave && c.norm_topk_prob && !c.shared_expert_gated);
        // transformers' defaults: 8 groups, the best 4, 3 dense layers, x2.5
        assert_eq!(
            c.routing,
            Routing::SigmoidGrouped {
                n_group: 8,
                topk_group: 4
            }
        );
        assert_eq!((c.moe_layers(), c.routed_scaling_factor), (vec![3], 2.5));
        assert_eq!(c.rope_theta, 50000.0);
        let y = c.yarn.unwrap();
        assert_eq!((y.factor, y.original_max_position_embeddings), (32.0, 4096));
        // mscale == mscale_all_dim: the tables unscaled, the softmax by mscale(32, 1)^2
        assert_eq!(y.attention_factor, 1.0);
        let ms = 0.1 * 32f64.ln() + 1.0;
        let want = (ms * ms / 24f64.sqrt()) as f32;
        assert!(
            (c.attention_scale - want).abs() < 1e-6,
            "{}",
            c.attention_scale
        );
        // finite as f64, not as the f32 the tables use
        for (k, x) in [
            ("factor", 1e300),
            ("beta_fast", 1e39),
            ("mscale_all_dim", 1e300),
        ] {
            let mut w = v.clone();
            w["rope_scaling"][k] = x.into();
            let e = ModelConfig::from_json_str(&w.to_string(), p).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{k}: {e}");
        }
        // malformed settings are refused naming what is wrong, not read as default RoPE
        let field_of = |w: &serde_json::Value| match ModelConfig::from_json_str(&w.to_string(), p) {
            Err(Error::Config { field, value, .. }) => format!("{field} {value}"),
            other => format!("accepted: {:?}", other.map(|c| c.yarn)),
        };
        for (edit, says) in [
            (serde_json::json!({"rope_scaling": "yarn"}), "rope_scaling"),
            (
                serde_json::json!({"rope_scaling": ["yarn"]}),
                "rope_scaling",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": 5}}),
                "rope_type",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": "4", "original_max_position_embeddings": 4096}}),
                "factor",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 32.0}}),
                "beta_fast",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}}),
                "original_max_position_embeddings",
            ),
            (
                serde_json::json!({"eos_token_id": 4294967625u64}),
                "eos_token_id",
            ),
            // Kimi K2's own rope_scaling (equal betas) is accepted: nothing is refused
            (
                serde_json::json!({"rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                    "type": "yarn"}}),
                "accepted",
            ),
            (serde_json::json!({"eos_token_id": [1, -2]}), "eos_token_id"),
            (serde_json::json!({"bos_token_id": "0"}), "bos_token_id"),
            (serde_json::json!({"eos_token_id": 1 << 20}), "eos_token_id"),
        ] {
            let mut w = v.clone();
            for (k, x) in edit.as_object().unwrap() {
                w[k] = x.clone();
            }
            let got = field_of(&w);
            assert!(got.contains(says), "{edit}: {got}");
        }
        v["rope_scaling"]["type"] = "longrope".into();
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::Config {
                field: "rope_parameters.rope_type",
                ..
            })
        ));
        v["rope_scaling"] = serde_json::Value::Null;
        v["scoring_func"] = "softmax".into();
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::Config {
                field: "scoring_func",
                ..
            })
        ));
        v["scoring_func"] = "sigmoid".into();
        v.as_object_mut().unwrap().remove("kv_lora_rank");
        assert!(matches!(
            ModelConfig::from_json_str(&v.to_string(), p),
            Err(Error::Config {
                field: "kv_lora_rank",
                ..
            })
        ));
    }
}
