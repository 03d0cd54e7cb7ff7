//! Assembles an embedded engine from a checkpoint directory: dense weights on the CPU
//! backend, hot experts in this process's bank, cold experts on an in-process sidecar
//! thread, as the rowmap says. Shows a progress bar on loads that take more than a moment.

use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

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
    /// Show a progress bar (only drawn on a terminal, and only for large loads).
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
        let moe = ckpt.config.moe_layers();
        let bank = ExpertBank::load(ckpt, &map, Tier::Cold, &moe, None)?;
        Some(Box::new(InProcessTier::spawn(Box::new(FixedBank {
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
/// Shows a progress bar (on a terminal) when asked and the checkpoint is large.
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
    let c = ckpt.config.clone();
    let moe = c.moe_layers();
    let pb = (opts.progress && ckpt.total_bytes() > (64 << 20)).then(|| {
        let total: usize = map.map.layers.iter().map(|l| l.hot.len()).sum();
        let pb = ProgressBar::new(total as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "loading {msg} [{bar:30}] {pos}/{len} hot experts ({elapsed})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb.set_message(ckpt.dir.display().to_string());
        pb.enable_steady_tick(Duration::from_millis(200));
        pb
    });
    let dense = DenseWeights::load(ckpt)?;
    let hot = ExpertBank::load(ckpt, &map, Tier::Hot, &moe, pb.as_ref())?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
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
