//! The `station` preset and the placements of `moelane bench decode` on the GPU: engines of
//! a hashed model whose experts are generated on the device (no file), and the GPU cold
//! tiers a benchmark runs in this process. Fixtures of the benches and the GPU tests, not
//! the serving path.

use std::sync::Arc;

use crate::bank::ExpertBank;
use crate::checkpoint::ExpertWeights;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::kv::BLOCK;
use crate::model::DenseWeights;
use crate::rowmap::{Tier, ValidMap};
use crate::step::Engine;

use crate::cuda_model::{attach_gpu, GpuModel};

/// A cold tier on a GPU in this process (the `gpu+gpu` placement of `moelane bench decode`):
/// its experts generated on that GPU, activations crossing through host memory; its map
/// never changes ([`crate::tier::fixed_epoch`]).
pub struct GpuColdServer {
    pub experts: std::sync::Mutex<crate::cuda_experts::GpuExperts>,
    pub epoch: u64,
}

impl GpuColdServer {
    fn experts(&self) -> Result<std::sync::MutexGuard<'_, crate::cuda_experts::GpuExperts>> {
        self.experts
            .lock()
            .map_err(|_| Error::Internal("the GPU cold tier's experts are poisoned".into()))
    }
}

impl crate::tier::ColdService for GpuColdServer {
    fn serve(&self, req: &crate::tier::ColdRequest, out: &mut Vec<f32>) -> Result<()> {
        crate::tier::fixed_epoch(req, self.epoch)?;
        let mut g = self.experts()?;
        out.clear();
        out.resize(req.picks.len() * g.hidden(), 0.0);
        g.compute(req.layer as usize, &req.picks, &req.activations, out)
    }
}

/// An embedded engine of `ckpt` whose steps run on `gpu`: dense weights, KV cache and the
/// hot experts there; the cold experts (if the map has any) on an in-process CPU tier.
pub fn load_on_gpu(
    ckpt: &crate::checkpoint::Checkpoint,
    map: ValidMap,
    opts: &crate::load::EngineOptions,
    gpu: Arc<Gpu>,
) -> Result<Engine> {
    let mut eng = crate::load::engine_from(ckpt, map, opts)?;
    let dense = DenseWeights::load(ckpt)?;
    let g = GpuModel::new(gpu, &ckpt.config, &dense, eng.kv.blocks)?;
    attach_gpu(&mut eng, g)?;
    Ok(eng)
}

/// Where a hashed model's cold experts are computed (`moelane bench decode --placement`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// every expert hot, on the primary's GPU (primary-only)
    OneGpu,
    /// hot experts on the primary's GPU, cold ones on an in-process CPU tier
    GpuCpu,
    /// hot experts on the primary's GPU, cold ones on a second GPU in this process
    GpuGpu(usize),
    /// hot experts on the primary's GPU (the affinity map), cold ones behind a link the
    /// caller attaches ([`hashed_engine_with_tier`])
    Remote,
}

impl Placement {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "one-gpu" => Ok(Placement::OneGpu),
            "gpu+cpu" => Ok(Placement::GpuCpu),
            _ => match s.strip_prefix("gpu+cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Placement::GpuGpu(n)),
                _ => Err(Error::Gpu(format!(
                    "unknown placement {s:?}: expected one-gpu, gpu+cpu or gpu+cuda:N"
                ))),
            },
        }
    }

    pub fn name(&self) -> String {
        match self {
            Placement::OneGpu => "one-gpu".into(),
            Placement::GpuCpu => "gpu+cpu".into(),
            Placement::GpuGpu(n) => format!("gpu+cuda:{n}"),
            Placement::Remote => "remote".into(),
        }
    }
}

/// The map of a hashed model: per MoE layer the `hot` experts with the largest router
/// affinity to the five languages (the sum over languages of exp(gate weight on that
/// language's dimension)) hot, the rest cold; ties to the lower id.
pub fn affinity_map(mem: &crate::synth::InMemory, hot: usize) -> Result<ValidMap> {
    let c = &mem.config;
    let moe = c.moe_layers();
    let mut m = crate::rowmap::Rowmap::all_hot(&mem.id, moe.len(), c.num_experts);
    for (ml, &l) in moe.iter().enumerate() {
        let r = mem.dense.layers[l]
            .router
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {l} has no router")))?;
        let mut score: Vec<(usize, f32)> = (0..c.num_experts)
            .map(|e| (e, (0..5).map(|c| r.at(e, c).exp()).sum::<f32>()))
            .collect();
        score.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut hot_ids: Vec<u16> = score[..hot.min(score.len())]
            .iter()
            .map(|x| x.0 as u16)
            .collect();
        let mut cold_ids: Vec<u16> = score[hot.min(score.len())..]
            .iter()
            .map(|x| x.0 as u16)
            .collect();
        hot_ids.sort_unstable();
        cold_ids.sort_unstable();
        m.layers[ml].hot = hot_ids;
        m.layers[ml].cold = cold_ids;
    }
    m.validate(&mem.id, moe.len(), c.num_experts, None)
}

/// An engine of a hashed model (the `station` preset) on `gpu`, its experts generated on
/// the device(s) of `placement` (the CPU tier's on the CPU, bit-identical).
pub fn hashed_engine(
    mem: &crate::synth::InMemory,
    placement: Placement,
    gpu: Arc<Gpu>,
    kv_tokens: usize,
) -> Result<Engine> {
    let c = &mem.config;
    let moe = c.moe_layers();
    let (h, i, ne) = (c.hidden_size, c.moe_intermediate_size, c.num_experts);
    let map = match placement {
        Placement::OneGpu => crate::rowmap::Rowmap::all_hot(&mem.id, moe.len(), ne).validate(
            &mem.id,
            moe.len(),
            ne,
            None,
        )?,
        _ => affinity_map(mem, mem.hot)?,
    };
    let cold = tier_experts(&map, Tier::Cold);
    let cold_tier: Option<Box<dyn crate::tier::RemoteTier>> = match placement {
        Placement::OneGpu => None,
        Placement::Remote => {
            return Err(Error::Invalid(
                "a remote cold tier is attached by hashed_engine_with_tier".into(),
            ))
        }
        Placement::GpuCpu => {
            use rayon::prelude::*;
            let ws: Vec<((usize, usize), ExpertWeights)> = cold
                .par_iter()
                .map(|&(l, e)| ((l, e), crate::synth::hashed_expert(mem.seed, l, e, h, i)))
                .collect();
            let mut bank = ExpertBank::empty(Tier::Cold, moe.len(), ne, h, i);
            for ((l, e), w) in ws {
                bank.insert(l, e, Arc::new(w));
            }
            Some(Box::new(crate::tier::InProcessTier::spawn(Arc::new(
                crate::tier::FixedBank {
                    bank,
                    epoch: map.epoch(),
                },
            ))))
        }
        Placement::GpuGpu(n) => {
            let g2 = Gpu::open(n)?;
            let mut ge = crate::cuda_experts::GpuExperts::new(g2, h, i)?;
            ge.generate(mem.seed, &cold)?;
            Some(Box::new(crate::tier::InProcessTier::spawn(Arc::new(
                GpuColdServer {
                    experts: std::sync::Mutex::new(ge),
                    epoch: map.epoch(),
                },
            ))))
        }
    };
    hashed_engine_with_tier(mem, map, gpu, kv_tokens, cold_tier)
}

/// The experts of `map`'s `tier`, as (MoE layer, expert) pairs in order.
pub fn tier_experts(map: &ValidMap, tier: Tier) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for ml in 0..map.layers() {
        for e in 0..map.experts() {
            if map.tier(ml, e) == tier {
                v.push((ml, e));
            }
        }
    }
    v
}

/// An engine of a hashed model on `gpu` under `map`, its hot experts generated there and its
/// cold picks sent to `cold_tier` (a link to another process, say).
pub fn hashed_engine_with_tier(
    mem: &crate::synth::InMemory,
    map: ValidMap,
    gpu: Arc<Gpu>,
    kv_tokens: usize,
    cold_tier: Option<Box<dyn crate::tier::RemoteTier>>,
) -> Result<Engine> {
    let c = &mem.config;
    let moe = c.moe_layers();
    let (h, i, ne) = (c.hidden_size, c.moe_intermediate_size, c.num_experts);
    let hot = tier_experts(&map, Tier::Hot);
    crate::kv::KvCache::check_tokens(kv_tokens)?;
    let blocks = crate::kv::KvCache::blocks_for(kv_tokens.max(BLOCK));
    let mut g = GpuModel::new(gpu, c, &mem.dense, blocks)?;
    g.generate(mem.seed, &hot)?;
    let kv = crate::kv::KvCache::accounting(c.num_hidden_layers, c.cache_dims().0, g.kv_blocks());
    let mut eng = Engine::with_kv(
        c.clone(),
        Box::new(crate::cuda_model::GpuStep::new(g)),
        ExpertBank::empty(Tier::Hot, moe.len(), ne, h, i),
        cold_tier,
        map,
        kv,
    );
    // the step backend takes the map and the (empty) bank: its experts are its own
    eng.sync_backend()?;
    Ok(eng)
}
