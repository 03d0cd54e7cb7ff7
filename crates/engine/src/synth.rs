//! Synthetic `qwen3_moe` checkpoints whose routing is structured by language, as a real
//! MoE model's is (e.g. the expert-specialisation analyses of Mixtral and DeepSeek-MoE).
//!
//! Construction (all deterministic from the seed):
//! - a byte-level BPE tokenizer trained on the embedded corpora (five languages); each
//!   token is labelled with the language in which it is relatively most frequent;
//! - the residual stream carries a language subspace (one dimension per language), a
//!   constant dimension, and random content dimensions;
//! - layer 0 attention has two "language" heads (query zero: uniform causal average) that
//!   write the prompt's average language into the language subspace, so every later router
//!   and the LM head see the language of the whole context;
//! - the other heads are positional: query and key read the constant dimension, and their
//!   RoPE phases make head h attend to the token h+1 positions back; their values carry
//!   content, so the next token depends on the last few tokens (no short greedy loops);
//! - each MoE layer's router gives every language a core set of experts with a skewed
//!   preference (a different random set per layer and language) plus a content term, so
//!   picks are skewed within a language and differ between languages;
//! - the LM head rewards tokens of the context's language and scores the rest by content.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;
use serde_json::json;

use crate::bpe;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::rng::Rng;

/// The embedded corpora: (name, text). Each line is one prompt.
pub const LANGS: [(&str, &str); 5] = [
    ("en", include_str!("../corpus/en.txt")),
    ("de", include_str!("../corpus/de.txt")),
    ("ja", include_str!("../corpus/ja.txt")),
    ("ko", include_str!("../corpus/ko.txt")),
    ("code", include_str!("../corpus/code.txt")),
];

/// The prompts of a language (the corpus lines).
pub fn prompts(lang: usize) -> Vec<&'static str> {
    LANGS[lang]
        .1
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect()
}

pub fn lang_index(name: &str) -> Option<usize> {
    LANGS.iter().position(|(n, _)| *n == name)
}

/// The shape of a synthetic checkpoint.
#[derive(Clone, Debug, Serialize)]
pub struct Preset {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub experts: usize,
    pub topk: usize,
    pub hot: usize,
    pub vocab_target: usize,
    /// experts in each language's core set, per layer
    pub core: usize,
    pub max_pos: usize,
}

impl Preset {
    pub fn by_name(name: &str) -> Option<Preset> {
        match name {
            "tiny" => Some(Preset {
                name: "tiny",
                hidden: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
                inter: 32,
                experts: 64,
                topk: 4,
                hot: 48,
                vocab_target: 640,
                core: 22,
                max_pos: 2048,
            }),
            "mini" => Some(Preset {
                name: "mini",
                hidden: 256,
                layers: 8,
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                inter: 64,
                experts: 384,
                topk: 6,
                hot: 295,
                vocab_target: 2048,
                core: 150,
                max_pos: 4096,
            }),
            // Sized for two H200s: hot tier (295 x 40 experts of 7.5 MiB, f32) 92.8 GB on
            // the primary, cold tier (89 x 40) 28.0 GB on the sidecar; both fit one GPU
            // (120.8 GB) for the primary-only placement. Experts are generated on the GPU
            // (`cuda_model::station_experts`), never written to a file.
            "station" => Some(Preset {
                name: "station",
                hidden: 1024,
                layers: 40,
                heads: 16,
                kv_heads: 4,
                head_dim: 64,
                inter: 640,
                experts: 384,
                topk: 6,
                hot: 295,
                vocab_target: 2048,
                core: 150,
                max_pos: 4096,
            }),
            _ => None,
        }
    }
}

const NL: usize = 5; // language dims 0..5
const CONST_DIM: usize = 5;
const C0: usize = 6; // content dims start

/// Knobs of the construction (documented where used).
struct Knobs {
    alpha: f32,
    beta: f32,
    lang_mix: f32,
    pos_gain: f32,
    router_core: f32,
    router_skew: f32,
    router_content: f32,
    expert_gain: f32,
    lm_lang: f32,
    lm_content: f32,
    router_tail: f32,
}

const KNOBS: Knobs = Knobs {
    alpha: 3.0,
    beta: 3.0,
    lang_mix: 2.0,
    pos_gain: 2.0,
    router_core: 2.0,
    router_skew: 0.35,
    router_content: 1.0,
    expert_gain: 1.0,
    lm_lang: 8.0,
    lm_content: 3.0,
    router_tail: 0.3,
};

struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

fn normal_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// Per token, its relative frequency in each language's corpus.
fn token_freqs(tok: &tokenizers::Tokenizer, vocab: usize) -> Vec<[f64; NL]> {
    let mut out = vec![[0f64; NL]; vocab];
    for (li, (_, text)) in LANGS.iter().enumerate() {
        let mut total = 0f64;
        let mut c = vec![0f64; vocab];
        for line in text.lines() {
            if let Ok(enc) = tok.encode(line, false) {
                for &id in enc.get_ids() {
                    if (id as usize) < vocab {
                        c[id as usize] += 1.0;
                        total += 1.0;
                    }
                }
            }
        }
        for (id, v) in c.iter().enumerate() {
            out[id][li] = v / total.max(1.0);
        }
    }
    out
}

/// How a token relates to the languages.
#[derive(Clone, Debug, Default)]
struct TokenLang {
    /// the language it marks (relatively 3x more frequent there than anywhere else)
    marks: Option<usize>,
    /// languages it is plausible in (at least a third of its best relative frequency)
    plausible: Vec<usize>,
}

fn token_langs(freqs: &[[f64; NL]]) -> Vec<TokenLang> {
    freqs
        .iter()
        .map(|f| {
            let mut idx: Vec<usize> = (0..NL).collect();
            idx.sort_by(|&a, &b| f[b].total_cmp(&f[a]).then(a.cmp(&b)));
            let best = f[idx[0]];
            if best <= 0.0 {
                return TokenLang::default();
            }
            TokenLang {
                marks: (best >= 3.0 * f[idx[1]]).then_some(idx[0]),
                plausible: (0..NL)
                    .filter(|&l| f[l] > 0.0 && f[l] * 3.0 >= best)
                    .collect(),
            }
        })
        .collect()
}

fn rope_gap_scale(p: &Preset, theta: f32) -> f32 {
    // score gap between the target offset and any other offset, per unit of s², as the
    // construction gives it: 2 Σ_p (1 - cos(m θ_p)) / sqrt(hd); choose s so the smallest gap
    // over all offsets in the context is 12 nats.
    let half = p.head_dim / 2;
    let th: Vec<f64> = (0..half)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / p.head_dim as f64))
        .collect();
    let mut gmin = f64::MAX;
    for m in 1..p.max_pos as i64 {
        for mm in [m, -m] {
            let g: f64 = th.iter().map(|t| 1.0 - (mm as f64 * t).cos()).sum();
            gmin = gmin.min(g);
        }
    }
    let gap_unit = 2.0 * gmin / (p.head_dim as f64).sqrt();
    ((12.0 / gap_unit).sqrt() as f32).min(60.0)
}

/// Builds all tensors of the checkpoint, one step of `pb` per layer.
fn build_tensors(
    p: &Preset,
    seed: u64,
    vocab: usize,
    lang: &[TokenLang],
    theta: f32,
    with_experts: bool,
    pb: &indicatif::ProgressBar,
) -> BTreeMap<String, Tensor> {
    let k = &KNOBS;
    let h = p.hidden;
    let hc = h - C0;
    let hd = p.head_dim;
    let half = hd / 2;
    let mut out = BTreeMap::new();
    let t = |shape: Vec<usize>, data: Vec<f32>| Tensor { shape, data };

    // embedding
    let mut r = Rng::derive(seed, "embed");
    let mut emb = vec![0f32; vocab * h];
    for id in 0..vocab {
        let row = &mut emb[id * h..(id + 1) * h];
        if let Some(l) = lang[id].marks {
            row[l] = k.alpha;
        }
        row[CONST_DIM] = k.beta;
        for v in &mut row[C0..] {
            *v = r.normal();
        }
    }
    out.insert("model.embed_tokens.weight".into(), t(vec![vocab, h], emb));

    // lm head
    let mut r = Rng::derive(seed, "lm_head");
    let mut lm = vec![0f32; vocab * h];
    let cs = k.lm_content / (hc as f32).sqrt();
    for id in 0..vocab {
        let row = &mut lm[id * h..(id + 1) * h];
        for (l, v) in row[..NL].iter_mut().enumerate() {
            *v = if lang[id].plausible.contains(&l) {
                k.lm_lang
            } else {
                -k.lm_lang
            };
        }
        for v in &mut row[C0..] {
            *v = r.normal() * cs;
        }
    }
    out.insert("lm_head.weight".into(), t(vec![vocab, h], lm));
    out.insert("model.norm.weight".into(), t(vec![h], vec![1.0; h]));

    let s_qk = rope_gap_scale(p, theta);
    let th: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / hd as f32))
        .collect();

    let layers: Vec<Vec<(String, Tensor)>> = (0..p.layers)
        .into_par_iter()
        .map(|l| {
            let mut v = attention_tensors(p, seed, l, s_qk, &th);
            v.extend(router_and_experts(p, seed, l, with_experts));
            pb.inc(1);
            v
        })
        .collect();
    for layer in layers {
        out.extend(layer);
    }
    out
}

/// Decoder layer `l`'s norms and attention: positional heads whose RoPE phases attend a few
/// tokens back, and in layer 0 a uniform "language" head.
fn attention_tensors(
    p: &Preset,
    seed: u64,
    l: usize,
    s_qk: f32,
    th: &[f32],
) -> Vec<(String, Tensor)> {
    let k = &KNOBS;
    let h = p.hidden;
    let hc = h - C0;
    let (hd, nh, nkv) = (p.head_dim, p.heads, p.kv_heads);
    let half = hd / 2;
    let t = |shape: Vec<usize>, data: Vec<f32>| Tensor { shape, data };
    let mut v: Vec<(String, Tensor)> = Vec::new();
    let pre = format!("model.layers.{l}");
    let mut r = Rng::derive(seed, &format!("layer{l}.attn"));
    v.push((
        format!("{pre}.input_layernorm.weight"),
        t(vec![h], vec![1.0; h]),
    ));
    v.push((
        format!("{pre}.post_attention_layernorm.weight"),
        t(vec![h], vec![1.0; h]),
    ));
    v.push((
        format!("{pre}.self_attn.q_norm.weight"),
        t(vec![hd], vec![s_qk; hd]),
    ));
    v.push((
        format!("{pre}.self_attn.k_norm.weight"),
        t(vec![hd], vec![s_qk; hd]),
    ));
    let group = nh / nkv;
    // kv head 0 is positional; in layer 0 the last kv head is the language head
    let lang_kv = if l == 0 && nkv > 1 {
        Some(nkv - 1)
    } else {
        None
    };
    let mut q = vec![0f32; nh * hd * h];
    let mut kk = vec![0f32; nkv * hd * h];
    let mut vv = vec![0f32; nkv * hd * h];
    let mut o = vec![0f32; h * nh * hd];
    for g in 0..nkv {
        if Some(g) == lang_kv {
            // value = language dims; query/key zero -> uniform causal average
            for d in 0..NL.min(hd) {
                vv[(g * hd + d) * h + d] = 1.0;
            }
            continue;
        }
        for i in 0..half {
            kk[(g * hd + i) * h + CONST_DIM] = 1.0 / k.beta;
        }
        for d in 0..hd {
            for c in C0..h {
                vv[(g * hd + d) * h + c] = r.normal() / (hc as f32).sqrt();
            }
        }
    }
    for hh in 0..nh {
        let g = hh / group;
        if Some(g) == lang_kv {
            let share = k.lang_mix / group as f32;
            for d in 0..NL.min(hd) {
                o[d * nh * hd + hh * hd + d] = share;
            }
            continue;
        }
        let delta = (hh % group + 1 + (g * group)) as f32;
        for i in 0..half {
            let a = delta * th[i];
            q[(hh * hd + i) * h + CONST_DIM] = a.cos() / k.beta;
            q[(hh * hd + i + half) * h + CONST_DIM] = -a.sin() / k.beta;
        }
        let gain = k.pos_gain / ((hd * nh) as f32).sqrt();
        for c in C0..h {
            for d in 0..hd {
                o[c * nh * hd + hh * hd + d] = r.normal() * gain;
            }
        }
    }
    v.push((
        format!("{pre}.self_attn.q_proj.weight"),
        t(vec![nh * hd, h], q),
    ));
    v.push((
        format!("{pre}.self_attn.k_proj.weight"),
        t(vec![nkv * hd, h], kk),
    ));
    v.push((
        format!("{pre}.self_attn.v_proj.weight"),
        t(vec![nkv * hd, h], vv),
    ));
    v.push((
        format!("{pre}.self_attn.o_proj.weight"),
        t(vec![h, nh * hd], o),
    ));
    v
}

/// MoE layer `l`'s router (per language a skewed core set of experts, plus content) and,
/// with `with_experts`, its experts.
fn router_and_experts(
    p: &Preset,
    seed: u64,
    l: usize,
    with_experts: bool,
) -> Vec<(String, Tensor)> {
    let k = &KNOBS;
    let h = p.hidden;
    let hc = h - C0;
    let t = |shape: Vec<usize>, data: Vec<f32>| Tensor { shape, data };
    let pre = format!("model.layers.{l}");
    let mut v: Vec<(String, Tensor)> = Vec::new();
    // router: per language a core set with skewed preference, plus content
    let mut r = Rng::derive(seed, &format!("layer{l}.router"));
    let mut gate = vec![0f32; p.experts * h];
    for li in 0..NL {
        let mut ids: Vec<usize> = (0..p.experts).collect();
        r.shuffle(&mut ids);
        for (rank, &e) in ids[..p.core].iter().enumerate() {
            // Zipf-like decay over the core plus noise
            let zipf = -(1.0 + rank as f32).ln() * k.router_skew;
            gate[e * h + li] = k.router_core + zipf * 0.5 + r.normal() * 0.1;
        }
        for &e in &ids[p.core..] {
            gate[e * h + li] = -k.router_core * k.router_tail + r.normal() * 0.1;
        }
    }
    let rs = k.router_content / (hc as f32).sqrt();
    for e in 0..p.experts {
        for c in C0..h {
            gate[e * h + c] = r.normal() * rs;
        }
    }
    v.push((
        format!("{pre}.mlp.gate.weight"),
        t(vec![p.experts, h], gate),
    ));

    // experts
    for e in (0..p.experts).filter(|_| with_experts) {
        let mut r = Rng::derive(seed, &format!("layer{l}.expert{e}"));
        let gs = 1.0 / (h as f32).sqrt();
        let mut g = normal_vec(&mut r, p.inter * h, gs);
        let mut u = normal_vec(&mut r, p.inter * h, gs);
        for row in 0..p.inter {
            for c in 0..C0 {
                g[row * h + c] = 0.0;
                u[row * h + c] = 0.0;
            }
        }
        let ds = k.expert_gain / (p.inter as f32).sqrt();
        let mut d = vec![0f32; h * p.inter];
        for row in C0..h {
            for c in 0..p.inter {
                d[row * p.inter + c] = r.normal() * ds;
            }
        }
        let ep = format!("{pre}.mlp.experts.{e}");
        v.push((format!("{ep}.gate_proj.weight"), t(vec![p.inter, h], g)));
        v.push((format!("{ep}.up_proj.weight"), t(vec![p.inter, h], u)));
        v.push((format!("{ep}.down_proj.weight"), t(vec![h, p.inter], d)));
    }
    v
}

/// Storage type of a written tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreAs {
    Bf16,
    F16,
    F32,
}

impl StoreAs {
    fn name(self) -> &'static str {
        match self {
            StoreAs::Bf16 => "BF16",
            StoreAs::F16 => "F16",
            StoreAs::F32 => "F32",
        }
    }
    fn size(self) -> usize {
        if self == StoreAs::F32 {
            4
        } else {
            2
        }
    }
}

/// Writes a safetensors file (bf16), tensors in name order, with `format: pt` metadata.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> Result<()> {
    write_safetensors_as(path, tensors, StoreAs::Bf16)
}

/// Writes a safetensors file in the given dtype.
pub fn write_safetensors_as(
    path: &Path,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    dtype: StoreAs,
) -> Result<()> {
    write_safetensors_shown(path, tensors, dtype, &indicatif::ProgressBar::hidden())
}

/// [`write_safetensors_as`], advancing `pb` by the bytes of each tensor written.
fn write_safetensors_shown(
    path: &Path,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    dtype: StoreAs,
    pb: &indicatif::ProgressBar,
) -> Result<()> {
    // "__metadata__" sorts before every tensor name, which the BTreeMap gives in order
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut off = 0usize;
    for (name, (shape, data)) in tensors {
        let n = data.len() * dtype.size();
        header.insert(
            name.clone(),
            // keys in sorted order, whatever the JSON map keeps (insertion order where a
            // dependency turns on serde_json's preserve_order): the file's bytes, and the
            // goldens' checksums of them, stay the same
            json!({"data_offsets": [off, off + n], "dtype": dtype.name(), "shape": shape}),
        );
        off += n;
    }
    let mut hb =
        serde_json::to_vec(&serde_json::Value::Object(header)).map_err(|e| Error::Json {
            path: path.into(),
            reason: e.to_string(),
        })?;
    while hb.len() % 8 != 0 {
        hb.push(b' ');
    }
    let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, f);
    let io = |e| Error::io(path, e);
    w.write_all(&(hb.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&hb).map_err(io)?;
    let mut buf = Vec::new();
    for (_, data) in tensors.values() {
        buf.clear();
        buf.reserve(data.len() * dtype.size());
        for &x in data {
            match dtype {
                StoreAs::Bf16 => {
                    buf.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes())
                }
                StoreAs::F16 => {
                    buf.extend_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes())
                }
                StoreAs::F32 => buf.extend_from_slice(&x.to_le_bytes()),
            }
        }
        w.write_all(&buf).map_err(io)?;
        pb.inc(buf.len() as u64);
    }
    w.flush().map_err(io)?;
    Ok(())
}

/// The synthetic checkpoints' chat template: ChatML in the layout of Qwen3's own (written
/// for moelane, not copied; [`moelane_text::templates::QWEN3_MOE`]): tools declared in the
/// system turn between `<tools></tools>`, calls as `<tool_call>{"name": .., "arguments": ..}
/// </tool_call>`, tool results as `<tool_response>` in a user turn, reasoning in
/// `<think></think>`, and `enable_thinking: false` closing an empty thinking block in the
/// generation prompt. A chat without tools renders as plain ChatML.
const CHAT_TEMPLATE: &str = moelane_text::templates::QWEN3_MOE;

fn config_json(preset: &Preset, seed: u64, vocab: usize, bos: u32, eos: u32) -> serde_json::Value {
    let theta = 10000.0f32;
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": preset.hidden,
        "intermediate_size": preset.inter * 4,
        "moe_intermediate_size": preset.inter,
        "num_hidden_layers": preset.layers,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": preset.layers,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": preset.experts,
        "num_experts_per_tok": preset.topk,
        "norm_topk_prob": true,
        "output_router_logits": false,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "use_cache": true,
        "initializer_range": 0.02,
        "moelane_synthetic": {"preset": preset.name, "seed": seed, "hot": preset.hot}
    })
}

/// Generates the checkpoint of `preset` into `out` (created), with an all-hot rowmap
/// placeholder; the figures module then measures routing and writes the fitted map.
pub fn generate(preset: &Preset, seed: u64, out: &Path) -> Result<()> {
    if preset.name == "station" {
        return Err(Error::Config {
            field: "preset",
            value: "station".into(),
            reason:
                "station (121 GB of experts) is never written to a file: it is built in memory \
                     and generated on the GPU (moelane bench decode --model station)"
                    .into(),
        });
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    // a bar past a second on a terminal: the tokenizer, then one step per layer built
    let pb = crate::progress::bar(
        preset.layers as u64 + 1,
        "making {msg} [{bar:30}] {pos}/{len} (tokenizer, then layers; {elapsed})",
        format!("the {} checkpoint", preset.name),
    );
    let texts: Vec<&str> = LANGS.iter().map(|l| l.1).collect();
    let bpe = bpe::train(&texts, preset.vocab_target);
    pb.inc(1);
    let tok_json = bpe.to_json();
    let tok_path = out.join("tokenizer.json");
    std::fs::write(
        &tok_path,
        serde_json::to_vec_pretty(&tok_json).unwrap_or_default(),
    )
    .map_err(|e| Error::io(&tok_path, e))?;
    let tok = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer {
        path: tok_path.clone(),
        reason: e.to_string(),
    })?;
    let vocab = bpe.len();
    let lang = token_langs(&token_freqs(&tok, vocab));
    let theta = 10000.0f32;
    let eos = (bpe.vocab.len() + 2) as u32; // <|im_end|>
    let config = config_json(preset, seed, vocab, bpe.vocab.len() as u32, eos);
    let cfg_path = out.join("config.json");
    std::fs::write(
        &cfg_path,
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
    )
    .map_err(|e| Error::io(&cfg_path, e))?;
    let tc = json!({
        "model_max_length": preset.max_pos,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": false
    });
    let tc_path = out.join("tokenizer_config.json");
    std::fs::write(&tc_path, serde_json::to_vec_pretty(&tc).unwrap_or_default())
        .map_err(|e| Error::io(&tc_path, e))?;
    let gc = json!({"bos_token_id": bpe.vocab.len(), "eos_token_id": eos, "do_sample": false});
    let gc_path = out.join("generation_config.json");
    std::fs::write(&gc_path, serde_json::to_vec_pretty(&gc).unwrap_or_default())
        .map_err(|e| Error::io(&gc_path, e))?;

    let tensors = build_tensors(preset, seed, vocab, &lang, theta, true, &pb);
    pb.finish_and_clear();
    let tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)> = tensors
        .into_iter()
        .map(|(k, t)| (k, (t.shape, t.data)))
        .collect();
    let st = out.join("model.safetensors");
    let tmp = out.join("model.safetensors.partial");
    let bytes: usize = tensors.values().map(|(_, d)| d.len() * 2).sum();
    let pb = crate::progress::bar(
        bytes as u64,
        "writing {msg} [{bar:30}] {bytes}/{total_bytes} ({elapsed})",
        st.display().to_string(),
    );
    write_safetensors_shown(&tmp, &tensors, StoreAs::Bf16, &pb)?;
    pb.finish_and_clear();
    std::fs::rename(&tmp, &st).map_err(|e| Error::io(&st, e))?;
    let labels: Vec<Vec<&str>> = lang
        .iter()
        .map(|l| l.plausible.iter().map(|&i| LANGS[i].0).collect())
        .collect();
    let lp = out.join("moelane_token_languages.json");
    std::fs::write(&lp, serde_json::to_vec(&labels).unwrap_or_default())
        .map_err(|e| Error::io(&lp, e))?;
    Ok(())
}

/// The rowmap that puts the top `hot` experts per layer (by counts) hot; ties to lower id.
pub use crate::placement::fit_map;

/// Opens a generated checkpoint's id (for maps).
pub fn checkpoint_id(dir: &Path) -> Result<String> {
    Ok(Checkpoint::open(dir)?.id)
}

/// A synthetic model built in memory: its config, dense weights and tokenizer, the experts
/// left to a generator ([`hashed_expert`] on the CPU, `cuda_model::station_experts` on the
/// GPU, bit-identical).
pub struct InMemory {
    pub config: crate::config::ModelConfig,
    pub dense: crate::model::DenseWeights,
    pub tokenizer_json: serde_json::Value,
    pub seed: u64,
    pub hot: usize,
    pub id: String,
}

struct MemTensors {
    config: crate::config::ModelConfig,
    t: BTreeMap<String, Tensor>,
}

impl crate::model::TensorSource for MemTensors {
    fn config(&self) -> &crate::config::ModelConfig {
        &self.config
    }
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self
            .t
            .get(name)
            .ok_or_else(|| Error::Gpu(format!("in-memory model has no tensor {name}")))?;
        if t.shape != shape {
            return Err(Error::Gpu(format!(
                "in-memory tensor {name} is {:?}, expected {shape:?}",
                t.shape
            )));
        }
        Ok(t.data.clone())
    }
    fn has(&self, name: &str) -> bool {
        self.t.contains_key(name)
    }
}

/// Builds `preset`'s dense part in memory (no file): the same language-structured
/// embedding, attention and router as [`generate`]; experts come from [`hashed_expert`].
pub fn in_memory(preset: &Preset, seed: u64) -> Result<InMemory> {
    let texts: Vec<&str> = LANGS.iter().map(|l| l.1).collect();
    let bpe = bpe::train(&texts, preset.vocab_target);
    let tok_json = bpe.to_json();
    let bytes = serde_json::to_vec(&tok_json).unwrap_or_default();
    let tok = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer {
        path: format!("<{} tokenizer>", preset.name).into(),
        reason: e.to_string(),
    })?;
    let vocab = bpe.len();
    let lang = token_langs(&token_freqs(&tok, vocab));
    let eos = (bpe.vocab.len() + 2) as u32;
    let cj = config_json(preset, seed, vocab, bpe.vocab.len() as u32, eos);
    let config = crate::config::ModelConfig::from_json_str(
        &cj.to_string(),
        Path::new(&format!("<{} config>", preset.name)),
    )?;
    let t = build_tensors(
        preset,
        seed,
        vocab,
        &lang,
        10000.0,
        false,
        &indicatif::ProgressBar::hidden(),
    );
    let dense = crate::model::DenseWeights::load(&MemTensors {
        config: config.clone(),
        t,
    })?;
    Ok(InMemory {
        config,
        dense,
        tokenizer_json: tok_json,
        seed,
        hot: preset.hot,
        id: format!("synthetic-{}-{seed}", preset.name),
    })
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of one generated tensor (`which`: 0 gate_up, 1 down) of expert `e` of MoE layer
/// `layer`.
pub fn hashed_key(seed: u64, layer: usize, e: usize, which: u64) -> u64 {
    splitmix(seed ^ splitmix(((layer as u64) << 32) ^ ((e as u64) << 2) ^ which))
}

/// Fills `w` (a matrix of `cols` columns) as the GPU kernel `gen_weights` does, bit for bit.
pub fn hashed_fill(
    w: &mut [f32],
    cols: usize,
    zero_cols: usize,
    zero_rows: usize,
    key: u64,
    scale: f32,
) {
    let k = 5.960_464_5e-8f32; // 2^-24
    for (i, v) in w.iter_mut().enumerate() {
        let (row, col) = (i / cols, i % cols);
        *v = if col >= zero_cols && row >= zero_rows {
            let i = i as u64;
            let a = splitmix(key.wrapping_add(2 * i));
            let b = splitmix(key.wrapping_add(2 * i + 1));
            let u1 = (a >> 40) as u32 as f32 * k;
            let u2 = ((a >> 8) & 0xff_ffff) as u32 as f32 * k;
            let u3 = (b >> 40) as u32 as f32 * k;
            let u4 = ((b >> 8) & 0xff_ffff) as u32 as f32 * k;
            ((u1 + u2) + (u3 + u4) - 2.0) * scale
        } else {
            0.0
        };
    }
}

/// The generator's scales for a model of `hidden` x `inter` experts: (gate_up, down), each
/// already times sqrt(3) (the Irwin-Hall sum's unit variance), as [`build_tensors`] scales
/// its normal draws.
pub fn hashed_scales(hidden: usize, inter: usize) -> (f32, f32) {
    let s3 = 3f32.sqrt();
    (
        s3 / (hidden as f32).sqrt(),
        s3 * KNOBS.expert_gain / (inter as f32).sqrt(),
    )
}

/// Expert `e` of MoE layer `layer` of a hashed (in-memory) model, on the CPU.
pub fn hashed_expert(
    seed: u64,
    layer: usize,
    e: usize,
    hidden: usize,
    inter: usize,
) -> crate::checkpoint::ExpertWeights {
    let (gs, ds) = hashed_scales(hidden, inter);
    let mut gu = vec![0f32; 2 * inter * hidden];
    hashed_fill(&mut gu, hidden, C0, 0, hashed_key(seed, layer, e, 0), gs);
    let mut dn = vec![0f32; hidden * inter];
    hashed_fill(&mut dn, inter, 0, C0, hashed_key(seed, layer, e, 1), ds);
    crate::checkpoint::ExpertWeights::new(
        crate::ops::Matrix::new(2 * inter, hidden, gu),
        crate::ops::Matrix::new(hidden, inter, dn),
        hashed_key(seed, layer, e, 2),
    )
}

/// Columns (gate/up) and rows (down) the generator leaves zero: the language and constant
/// dims, as in [`build_tensors`].
pub const HASHED_ZERO: usize = C0;

impl InMemory {
    /// Every language's prompts ([`prompts`]), tokenized, languages interleaved.
    pub fn prompt_ids(&self) -> Result<Vec<Vec<u32>>> {
        let bytes = serde_json::to_vec(&self.tokenizer_json).unwrap_or_default();
        let tok = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer {
            path: "<in-memory tokenizer>".into(),
            reason: e.to_string(),
        })?;
        let per: Vec<Vec<&str>> = (0..LANGS.len()).map(prompts).collect();
        let most = per.iter().map(Vec::len).max().unwrap_or(0);
        let mut out = Vec::new();
        for i in 0..most {
            for p in &per {
                if let Some(text) = p.get(i) {
                    let enc = tok.encode(*text, false).map_err(|e| Error::Tokenizer {
                        path: "<in-memory tokenizer>".into(),
                        reason: e.to_string(),
                    })?;
                    out.push(enc.get_ids().to_vec());
                }
            }
        }
        Ok(out)
    }
}
