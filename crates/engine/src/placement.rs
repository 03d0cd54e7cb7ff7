//! The first map of a checkpoint that comes without one, made from a budget: `--hot-experts
//! N` (the N most picked experts of every MoE layer hot) or `--primary-memory SIZE` (as many
//! hot experts as fit in SIZE beside the dense weights, the KV cache and the swap's spare
//! slots, given to the layers where they take the most picks). Which experts are picked most
//! comes from counts: given ones (`moelane status --counts-out`), or a calibration pass over
//! the built-in prompts of five languages (English, German, Japanese, Korean, code).
//!
//! The calibration pass streams the experts: one prefill step over every prompt at once,
//! with every expert cold and the cold tier loading, per MoE layer, only the experts that
//! layer's picks name (dropping the previous layer's). It holds the dense weights and one
//! layer's picked experts, never the whole checkpoint, so it runs for a model that does not
//! fit in memory; it reads each picked expert from disk once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::bank::ExpertBank;
use crate::checkpoint::{Checkpoint, ExpertWeights};
use crate::config::held_scale_count;
use crate::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::kv::{KvCache, KvDtype, BLOCK};
use crate::model::DenseWeights;
use crate::rowmap::{LayerMap, Rowmap, Tier};
use crate::step::{Engine, SeqStep};
use crate::tier::{ColdRequest, ColdService, InProcessTier};
use safetensors::tensor::Dtype;

/// Raw pick counts per MoE layer and expert, as `moelane status --counts-out` writes them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counts {
    pub version: u32,
    pub model: String,
    pub map_epoch: u64,
    pub layers: Vec<Vec<u64>>,
}

impl Counts {
    /// Reads a counts file; its model must be `model` (a checkpoint id).
    pub fn read(path: &std::path::Path, model: &str) -> Result<Counts> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let c: Counts = serde_json::from_slice(&bytes).map_err(|e| Error::Json {
            path: path.into(),
            reason: format!("not a counts file: {e}"),
        })?;
        if c.version != 1 {
            return Err(Error::Json {
                path: path.into(),
                reason: format!("counts version {} is not supported (expected 1)", c.version),
            });
        }
        if c.model != model {
            return Err(Error::Json {
                path: path.into(),
                reason: format!(
                    "counts are for model {:?}, the checkpoint is {model:?}",
                    c.model
                ),
            });
        }
        Ok(c)
    }
}

/// How large the hot set may be.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// Hot experts per MoE layer (more than the layer has: all hot).
    HotExperts(usize),
    /// Bytes of the primary device's memory the model may take.
    PrimaryMemory(u64),
}

/// What one element of a weight takes on the primary's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resident {
    /// The checkpoint's own bytes (the CPU backend; 1-D weights kept as f32).
    Stored,
    /// The CUDA backend's: bf16 matrices and FP8 experts (with their scales) as stored,
    /// every other matrix widened to four bytes an element (f16, FP8 dense weights without
    /// their scales, f32), vectors as f32.
    Gpu,
}

/// The primary's memory by part, in bytes on its device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Every weight that is not a routed expert (attention, norms, router, dense and shared
    /// MLPs, embedding, head).
    pub dense: u64,
    /// The KV cache at the asked capacity.
    pub kv: u64,
    /// One routed expert.
    pub expert: u64,
    /// The spare slots a swap stages into (spare slots per layer x MoE layers x one expert).
    pub spare: u64,
    /// Hot experts the map holds.
    pub hot_experts: usize,
}

impl Footprint {
    /// The primary's total at this map: dense + KV + hot experts + spare slots.
    pub fn total(&self) -> u64 {
        self.dense + self.kv + self.spare + self.expert * self.hot_experts as u64
    }
}

/// A budget's map and what it takes.
#[derive(Clone, Debug)]
pub struct Plan {
    pub map: Rowmap,
    pub footprint: Footprint,
    /// The pick counts that ranked the experts (`[moe layer][expert]`).
    pub counts: Vec<Vec<u64>>,
}

/// Parses a memory size: a number of bytes, or with a unit (`KB`/`MB`/`GB`/`TB`: powers of
/// 1000; `KiB`/`MiB`/`GiB`/`TiB` or `K`/`M`/`G`/`T`: powers of 1024), fractions allowed
/// (`1.5GiB`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (use bytes, KB/MB/GB/TB or KiB/MiB/GiB/TiB)"
            ))
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: not a size (e.g. 24GiB, 80GB, 512MiB)"))?;
    let bytes = n * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 / 2.0 {
        return Err(format!("{s:?}: out of range"));
    }
    Ok(bytes as u64)
}

/// A byte count for people: `512 B`, `3.2 KiB`, `14.6 MiB`, `2.31 GiB`.
pub fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{b} B"),
        _ if v < 10.0 => format!("{v:.2} {}", units[u]),
        _ => format!("{v:.1} {}", units[u]),
    }
}

/// Whether a tensor name is a routed expert's weight (every layout: `experts.E.w1`,
/// `experts.E.gate_proj`, fused `experts.gate_up_proj`; not `shared_expert(s)`).
fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// Whether a tensor belongs to a decoder layer the model does not run (the multi-token
/// prediction layers DeepSeek-V3 and GLM-4.5 ship after their last layer: never loaded).
fn beyond_layers(name: &str, layers: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l >= layers)
}

/// The primary's footprint for a checkpoint: `kv_tokens` of KV cache in `kv_dtype`,
/// `spare_slots` per MoE layer, weights resident as `resident` says; `hot_experts` 0 (set by
/// the plan).
pub fn footprint(
    ckpt: &Checkpoint,
    kv_tokens: usize,
    kv_dtype: KvDtype,
    spare_slots: usize,
    resident: Resident,
) -> Result<Footprint> {
    let c = &ckpt.config;
    let mut dense = 0u64;
    // a GPU widens its largest kept FP8 dense matrix into one f32 scratch for prefill
    let mut widest_f8 = 0u64;
    for name in ckpt.tensor_names() {
        if is_routed_expert(&name) || beyond_layers(&name, c.num_hidden_layers) {
            continue;
        }
        let raw = ckpt.raw(&name)?;
        let elems = raw.shape.iter().product::<usize>() as u64;
        let matrix = raw.shape.iter().filter(|&&d| d > 1).count() > 1;
        // a GPU keeps FP8 dense matrices as stored where four weights share a scale, but
        // widens MLA's kv_b_proj (read per head) and the embedding
        let gpu_f8 = c.fp8_block.is_some_and(|[b0, b1]| b0 > 0 && b1 % 4 == 0)
            && !name.contains("kv_b_proj")
            && !name.contains("embed_tokens")
            && !name.starts_with("lm_head");
        let scales_of = c
            .fp8_block
            .and_then(|block| Some((block, c.fp8_scales.weight_of(&name)?)));
        dense += if let Some((block, weight)) = scales_of {
            // FP8 scales are held as f32 whatever they are stored as, one per block of the
            // config's (a row's or tensor's repeated); a GPU keeps those of the matrices it
            // keeps FP8
            let held = match ckpt.raw(weight).map(|w| w.shape.to_vec()) {
                Ok(sh) if sh.len() == 2 => held_scale_count(block, sh[0], sh[1]) as u64,
                _ => elems,
            };
            match resident {
                Resident::Stored => 4 * held,
                Resident::Gpu if gpu_f8 => 4 * held,
                Resident::Gpu => 0,
            }
        } else {
            match resident {
                // vectors (norms, biases, a [1, H] gate) are held as f32
                Resident::Stored if matrix => raw.bytes.len() as u64,
                Resident::Gpu if matrix && raw.dtype == Dtype::BF16 => raw.bytes.len() as u64,
                Resident::Gpu if matrix && raw.dtype == Dtype::F8_E4M3 && gpu_f8 => {
                    widest_f8 = widest_f8.max(elems);
                    raw.bytes.len() as u64
                }
                _ => 4 * elems,
            }
        };
    }
    dense += 4 * widest_f8;
    let expert = match resident {
        Resident::Stored => ckpt.expert_stored_bytes()? as u64,
        Resident::Gpu => {
            let l = c.moe_layers().first().copied().unwrap_or(0);
            let b = ckpt.expert_bytes(l, 0)?;
            let all = |want: Dtype| b.gate_up.iter().chain([&b.down]).all(|(d, _)| *d == want);
            // FP8 experts keep their bytes and scales where the kernels can read four
            // weights under one scale
            // (and gate|up stack on block rows: stack_f8)
            let fp8_kept = c.fp8_block.is_some_and(|[b0, b1]| {
                b0 > 0 && b1 % 4 == 0 && c.moe_intermediate_size.is_multiple_of(b0)
            });
            if all(Dtype::BF16) || (all(Dtype::F8_E4M3) && fp8_kept) {
                b.stored() as u64
            } else {
                4 * c.expert_params() as u64
            }
        }
    };
    KvCache::check_tokens(kv_tokens)?;
    let tokens = KvCache::blocks_for(kv_tokens.max(BLOCK)) * BLOCK;
    let (kd, vd) = c.cache_dims();
    // (saturating: a config's sizes are bounded one by one, not their products)
    let kv = (tokens as u64)
        .saturating_mul(c.num_hidden_layers as u64)
        .saturating_mul((kd + vd) as u64)
        .saturating_mul(kv_dtype.bytes() as u64);
    let layers = c.moe_layers().len();
    let spare = ((spare_slots.min(c.num_experts) * layers) as u64).saturating_mul(expert);
    Ok(Footprint {
        dense,
        kv,
        expert,
        spare,
        hot_experts: 0,
    })
}

/// Counts in the map's shape: one row of `experts` per MoE layer.
fn check_counts(counts: &[Vec<u64>], layers: usize, experts: usize) -> Result<()> {
    if counts.len() != layers {
        return Err(Error::Invalid(format!(
            "pick counts for {} MoE layers, the model has {layers}",
            counts.len()
        )));
    }
    if let Some((l, c)) = counts.iter().enumerate().find(|(_, c)| c.len() != experts) {
        return Err(Error::Invalid(format!(
            "pick counts of MoE layer {l} name {} experts, the model has {experts}",
            c.len()
        )));
    }
    Ok(())
}

/// The map with `hot[l]` experts of layer `l` hot: the most picked ones, ties to the lower
/// id; each list in id order.
fn map_of(model: &str, counts: &[Vec<u64>], hot: &[usize]) -> Rowmap {
    let layers = counts
        .iter()
        .zip(hot)
        .map(|(c, &h)| {
            let mut ids: Vec<u16> = (0..c.len() as u16).collect();
            ids.sort_by(|&a, &b| c[b as usize].cmp(&c[a as usize]).then(a.cmp(&b)));
            let h = h.min(ids.len());
            let mut hot_ids = ids[..h].to_vec();
            let mut cold = ids[h..].to_vec();
            hot_ids.sort_unstable();
            cold.sort_unstable();
            LayerMap { hot: hot_ids, cold }
        })
        .collect();
    Rowmap {
        version: 1,
        model: model.into(),
        epoch: 0,
        layers,
    }
}

/// The top `hot` experts per layer by `counts` hot (ties to the lower id).
pub fn fit_map(model: &str, counts: &[Vec<u64>], hot: usize) -> Rowmap {
    map_of(model, counts, &vec![hot; counts.len()])
}

/// Hot experts per layer when `slots` go, one at a time, to the most picked (layer, expert)
/// of the whole model (ties to the lower layer, then the lower expert).
fn spread(counts: &[Vec<u64>], slots: usize) -> Vec<usize> {
    let mut all: Vec<(u64, usize, usize)> = counts
        .iter()
        .enumerate()
        .flat_map(|(l, row)| row.iter().enumerate().map(move |(e, &n)| (n, l, e)))
        .collect();
    all.sort_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    let mut hot = vec![0usize; counts.len()];
    for &(_, l, _) in all.iter().take(slots) {
        hot[l] += 1;
    }
    hot
}

/// The map a budget gives, from pick counts (`[moe layer][expert]`), with what it takes.
/// `--primary-memory`: hot slots are `(SIZE - dense - KV - spare) / expert`, given one at a
/// time to the most picked (layer, expert) of the whole model, so a layer whose routing is
/// concentrated gets more of them. Refused when the dense weights, KV and spare slots alone
/// exceed SIZE.
pub fn plan(
    ckpt: &Checkpoint,
    budget: Budget,
    counts: &[Vec<u64>],
    mut fp: Footprint,
) -> Result<Plan> {
    let c = &ckpt.config;
    let (layers, experts) = (c.moe_layers().len(), c.num_experts);
    check_counts(counts, layers, experts)?;
    let hot = match budget {
        Budget::HotExperts(n) => vec![n.min(experts); layers],
        Budget::PrimaryMemory(bytes) => {
            let fixed = fp.dense + fp.kv + fp.spare;
            let h = human_bytes;
            if fixed > bytes {
                return Err(Error::Invalid(format!(
                    "--primary-memory {} is less than the dense weights ({}), the KV cache ({}) \
                     and the swap's spare slots ({}) need together ({}); give more memory, \
                     fewer --kv-tokens or fewer --spare-slots",
                    h(bytes),
                    h(fp.dense),
                    h(fp.kv),
                    h(fp.spare),
                    h(fixed)
                )));
            }
            let slots = ((bytes - fixed) / fp.expert.max(1)).min((layers * experts) as u64);
            spread(counts, slots as usize)
        }
    };
    fp.hot_experts = hot.iter().sum();
    if fp.hot_experts == layers * experts {
        // every expert hot: no swap ever stages on the primary
        fp.spare = 0;
    }
    Ok(Plan {
        map: map_of(&ckpt.id, counts, &hot),
        footprint: fp,
        counts: counts.to_vec(),
    })
}

/// The calibration prompts: up to `per_lang` lines of each built-in language, as token ids
/// of the checkpoint's tokenizer (`tokenizer.json`), each cut at `max_len` tokens; ids the
/// model's vocabulary does not have are dropped. Without a tokenizer: the same number of
/// sequences of token ids drawn uniformly from the vocabulary (deterministic).
pub fn calibration_prompts(
    ckpt: &Checkpoint,
    per_lang: usize,
    max_len: usize,
) -> Result<Vec<Vec<u32>>> {
    let vocab = ckpt.config.vocab_size;
    let mut out = Vec::new();
    if crate::tokenizer::Tokenizer::exists_in(&ckpt.dir) {
        let tok = crate::tokenizer::Tokenizer::from_dir(&ckpt.dir)?;
        for li in 0..crate::synth::LANGS.len() {
            for p in crate::synth::prompts(li).into_iter().take(per_lang) {
                let mut ids: Vec<u32> = tok
                    .encode(p)?
                    .into_iter()
                    .filter(|&t| (t as usize) < vocab)
                    .collect();
                ids.truncate(max_len);
                if !ids.is_empty() {
                    out.push(ids);
                }
            }
        }
    } else {
        let mut rng = crate::rng::Rng::new(0x6d6f_656c);
        for _ in 0..crate::synth::LANGS.len() * per_lang {
            out.push((0..max_len).map(|_| rng.below(vocab) as u32).collect());
        }
    }
    Ok(out)
}

/// A cold tier that loads each layer's picked experts when asked, holding one layer at a
/// time (the calibration pass's).
struct Streaming {
    ckpt: Checkpoint,
    moe_layers: Vec<usize>,
    /// (MoE layer, its loaded experts)
    held: Mutex<(usize, HashMap<u16, Arc<ExpertWeights>>)>,
    progress: Option<indicatif::ProgressBar>,
}

impl ColdService for Streaming {
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()> {
        let c = &self.ckpt.config;
        let ml = req.layer as usize;
        let dl = *self
            .moe_layers
            .get(ml)
            .ok_or_else(|| Error::Internal(format!("calibration: MoE layer {ml}")))?;
        let mut held = self
            .held
            .lock()
            .map_err(|_| Error::Internal("calibration state poisoned".into()))?;
        if held.0 != ml {
            held.1.clear();
            held.0 = ml;
            if let Some(p) = &self.progress {
                p.inc(1);
            }
        }
        let mut want: Vec<u16> = req
            .picks
            .iter()
            .map(|p| p.expert)
            .filter(|e| !held.1.contains_key(e))
            .collect();
        want.sort_unstable();
        want.dedup();
        let loaded: Vec<(u16, Result<ExpertWeights>)> = want
            .par_iter()
            .map(|&e| (e, self.ckpt.expert(dl, e as usize)))
            .collect();
        for (e, w) in loaded {
            held.1.insert(e, Arc::new(w?));
        }
        let mut bank = ExpertBank::empty(
            Tier::Cold,
            self.moe_layers.len(),
            c.num_experts,
            c.hidden_size,
            c.moe_intermediate_size,
        );
        for (&e, w) in &held.1 {
            bank.insert(ml, e as usize, w.clone());
        }
        out.clear();
        out.resize(req.picks.len() * c.hidden_size, 0.0);
        bank.compute(ml, &req.picks, &req.activations, out)
    }
}

/// Pick counts `[moe layer][expert]` of one prefill step over `prompts`, computed with the
/// experts streamed from the checkpoint (see the module's notes). `progress`: a bar over
/// the MoE layers.
pub fn calibrate(
    dir: &std::path::Path,
    prompts: &[Vec<u32>],
    progress: bool,
) -> Result<Vec<Vec<u64>>> {
    let ckpt = Checkpoint::open(dir)?;
    let c = ckpt.config.clone();
    let moe_layers = c.moe_layers();
    let layers = moe_layers.len();
    let all_cold = Rowmap::all_cold(&ckpt.id, layers, c.num_experts).validate(
        &ckpt.id,
        layers,
        c.num_experts,
        None,
    )?;
    let dense = DenseWeights::load(&ckpt)?;
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let per_seq: usize = prompts
        .iter()
        .map(|p| KvCache::blocks_for(p.len().max(1)))
        .sum();
    let pb = progress.then(|| {
        crate::progress::bar(
            layers as u64,
            "calibrating {msg} [{bar:30}] {pos}/{len} MoE layers ({elapsed})",
            format!("{} on {tokens} tokens", dir.display()),
        )
    });
    let streaming = Streaming {
        ckpt,
        moe_layers,
        held: Mutex::new((usize::MAX, HashMap::new())),
        progress: pb.clone(),
    };
    let hot = ExpertBank::empty(
        Tier::Hot,
        layers,
        c.num_experts,
        c.hidden_size,
        c.moe_intermediate_size,
    );
    let tier = InProcessTier::spawn(Arc::new(streaming));
    let mut eng = Engine::new(
        c.clone(),
        Box::new(CpuBackend::new(c.clone(), dense)),
        hot,
        Some(Box::new(tier)),
        all_cold,
        per_seq.max(1),
    );
    let mut seqs: Vec<_> = prompts.iter().map(|_| eng.kv.new_seq()).collect();
    let mut steps: Vec<SeqStep<'_>> = seqs
        .iter_mut()
        .zip(prompts)
        .map(|(kv, p)| SeqStep { kv, tokens: p })
        .collect();
    eng.step(&mut steps)?;
    if let Some(p) = pb {
        p.finish_and_clear();
    }
    Ok(eng.counters.picks.clone())
}

/// What [`initial_map`] needs besides the checkpoint.
#[derive(Clone, Debug)]
pub struct Placement {
    pub budget: Budget,
    /// Pick counts to rank experts by (None: a calibration pass).
    pub counts: Option<Vec<Vec<u64>>>,
    pub kv_tokens: usize,
    /// What the KV cache stores (its bytes per element).
    pub kv_dtype: KvDtype,
    pub spare_slots: usize,
    pub resident: Resident,
    /// A progress bar over the calibration pass.
    pub progress: bool,
}

/// Prompts per language of the calibration pass, and their longest.
pub const CALIBRATION_PER_LANG: usize = 8;
pub const CALIBRATION_MAX_LEN: usize = 48;

/// The first map of `ckpt` under a budget: counts as given, else from a calibration pass
/// over the built-in prompts; then [`plan`].
pub fn initial_map(ckpt: &Checkpoint, p: &Placement) -> Result<Plan> {
    let counts = match &p.counts {
        Some(c) => c.clone(),
        None => {
            let prompts = calibration_prompts(ckpt, CALIBRATION_PER_LANG, CALIBRATION_MAX_LEN)?;
            calibrate(&ckpt.dir, &prompts, p.progress)?
        }
    };
    let fp = footprint(ckpt, p.kv_tokens, p.kv_dtype, p.spare_slots, p.resident)?;
    plan(ckpt, p.budget, &counts, fp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_past_the_last_are_not_counted() {
        assert!(beyond_layers(
            "model.layers.61.self_attn.q_a_proj.weight",
            61
        ));
        assert!(!beyond_layers(
            "model.layers.60.self_attn.q_a_proj.weight",
            61
        ));
        assert!(!beyond_layers("model.embed_tokens.weight", 61));
        assert!(!beyond_layers("lm_head.weight", 61));
    }

    #[test]
    fn sizes_parse_with_their_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("24G"), Ok(24 << 30));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5 MiB"), Ok(3 << 19));
        assert_eq!(parse_size("2tb"), Ok(2_000_000_000_000));
        for bad in ["", "GiB", "12XB", "-3G", "0", "1e999", "1.2.3G"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }

    #[test]
    fn memory_goes_to_the_most_picked_experts_of_the_whole_model() {
        let counts = vec![vec![9, 0, 0, 8], vec![1, 7, 6, 0]];
        assert_eq!(spread(&counts, 0), vec![0, 0]);
        assert_eq!(spread(&counts, 3), vec![2, 1]);
        assert_eq!(spread(&counts, 4), vec![2, 2]);
        // ties (the zeros): the lower layer first
        assert_eq!(spread(&counts, 6), vec![3, 3]);
        assert_eq!(spread(&counts, 99), vec![4, 4]);
        let m = map_of("m", &counts, &spread(&counts, 3));
        assert_eq!(m.layers[0].hot, vec![0, 3]);
        assert_eq!(m.layers[1].hot, vec![1]);
        assert_eq!(m.layers[1].cold, vec![0, 2, 3]);
        assert!(check_counts(&counts, 2, 4).is_ok());
        assert!(check_counts(&counts, 3, 4).is_err());
        assert!(check_counts(&counts, 2, 5).is_err());
    }
}
