//! Assembles an embedded engine from a checkpoint directory: dense weights on the CPU
//! backend, hot experts in this process's bank, cold experts on an in-process sidecar
//! thread, as the rowmap says. Shows a progress bar on loads that take more than a second.

use std::path::Path;
use std::sync::Arc;

use crate::bank::ExpertBank;
use crate::checkpoint::Checkpoint;
use crate::cpu::CpuBackend;
use crate::error::Result;
use crate::kv::{KvCache, BLOCK};
use crate::model::DenseWeights;
use crate::rowmap::{Rowmap, Tier, ValidMap};
use crate::step::Engine;
use crate::tier::{FixedBank, InProcessTier};

/// Options of an embedded engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// KV cache capacity in tokens (rounded up to whole blocks).
    pub kv_tokens: usize,
    /// Show a progress bar ([`progress`]: only on a terminal, only past a second).
    pub progress: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            kv_tokens: 16384,
            progress: false,
        }
    }
}

/// Loads the experts `map` puts in `tier` ([`ExpertBank::load`]) with a progress bar
/// ([`progress`]; when `shown`).
pub fn load_tier(ckpt: &Checkpoint, map: &ValidMap, tier: Tier, shown: bool) -> Result<ExpertBank> {
    let total: usize = map
        .map
        .layers
        .iter()
        .map(|l| match tier {
            Tier::Hot => l.hot.len(),
            Tier::Cold => l.cold.len(),
        })
        .sum();
    let pb = shown.then(|| {
        crate::progress::bar(
            total as u64,
            &format!(
                "loading {{msg}} [{{bar:30}}] {{pos}}/{{len}} {} experts ({{elapsed}})",
                tier.name()
            ),
            ckpt.dir.display().to_string(),
        )
    });
    let bank = ExpertBank::load(ckpt, map, tier, &ckpt.config.moe_layers(), pb.as_ref())?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    Ok(bank)
}

/// The map to use: the given one, else `rowmap.json` in the checkpoint, else all hot.
pub fn resolve_map(ckpt: &Checkpoint, map: Option<Rowmap>) -> Result<ValidMap> {
    let c = &ckpt.config;
    let layers = c.moe_layers().len();
    let map = match map {
        Some(m) => m,
        None => {
            let p = ckpt.dir.join("rowmap.json");
            if p.exists() {
                Rowmap::read(&p)?
            } else {
                Rowmap::all_hot(&ckpt.id, layers, c.num_experts)
            }
        }
    };
    map.validate(&ckpt.id, layers, c.num_experts, None)
}

/// Loads the whole lane into this process.
pub fn load_engine(dir: &Path, map: Option<Rowmap>, opts: &EngineOptions) -> Result<Engine> {
    let ckpt = Checkpoint::open(dir)?;
    let map = resolve_map(&ckpt, map)?;
    engine_from(&ckpt, map, opts)
}

pub fn engine_from(ckpt: &Checkpoint, map: ValidMap, opts: &EngineOptions) -> Result<Engine> {
    let any_cold = map.map.layers.iter().any(|l| !l.cold.is_empty());
    let cold: Option<Box<dyn crate::tier::RemoteTier>> = if any_cold {
        let bank = load_tier(ckpt, &map, Tier::Cold, opts.progress)?;
        Some(Box::new(InProcessTier::spawn(Arc::new(FixedBank {
            bank,
            epoch: map.epoch(),
        }))))
    } else {
        None
    };
    engine_with_tier(ckpt, map, opts, cold)
}

/// Loads the dense weights and the hot experts only; the cold tier is the given link
/// (a sidecar in another thread or process). `None` when the map has no cold experts.
/// Shows a progress bar when asked ([`progress`]).
pub fn engine_with_tier(
    ckpt: &Checkpoint,
    map: ValidMap,
    opts: &EngineOptions,
    cold: Option<Box<dyn crate::tier::RemoteTier>>,
) -> Result<Engine> {
    if cold.is_none() && map.map.layers.iter().any(|l| !l.cold.is_empty()) {
        return Err(crate::Error::Invalid(
            "the map has cold experts but no cold tier is attached".into(),
        ));
    }
    KvCache::check_host_memory(&ckpt.config, opts.kv_tokens)?;
    let c = ckpt.config.clone();
    let dense = DenseWeights::load(ckpt)?;
    let hot = load_tier(ckpt, &map, Tier::Hot, opts.progress)?;
    let blocks = KvCache::blocks_for(opts.kv_tokens.max(BLOCK));
    Ok(Engine::new(
        c.clone(),
        Box::new(CpuBackend::new(c, dense)),
        hot,
        cold,
        map,
        blocks,
    ))
}
