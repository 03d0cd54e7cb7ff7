//! The tier side of a live swap (DESIGN.md's two-phase protocol): load incoming experts
//! off the serving thread with checksums verified, stage them into free slots, switch maps
//! at a step boundary, free the outgoing slots on release, drop staged ones on abort.
//! A slot is only ever referenced by a map once its weights are fully loaded and verified:
//! staging inserts a whole `Arc<ExpertWeights>`, and `commit` refuses a map that names an
//! expert the bank does not hold.

use std::sync::Arc;

use crate::bank::ExpertBank;
use crate::checkpoint::{Checkpoint, ExpertWeights};
use crate::error::{Error, Result};
use crate::rowmap::{Tier, ValidMap};

/// One expert to stage: (MoE layer, expert, expected checksum).
pub type Incoming = (usize, usize, u64);

/// Loads and verifies incoming experts (slow: reads the checkpoint; run it off the step loop).
pub fn load_verified(
    ckpt: &Checkpoint,
    incoming: &[Incoming],
) -> Result<Vec<(usize, usize, Arc<ExpertWeights>)>> {
    let moe = ckpt.config.moe_layers();
    incoming
        .iter()
        .map(|&(l, e, want)| {
            let dl = *moe.get(l).ok_or_else(|| {
                Error::Rowmap(format!("layer {l} is not a MoE layer of the checkpoint"))
            })?;
            let w = ckpt.expert(dl, e)?;
            if w.checksum != want {
                return Err(Error::Checksum {
                    layer: l,
                    expert: e,
                    found: w.checksum,
                    expected: want,
                });
            }
            Ok((l, e, Arc::new(w)))
        })
        .collect()
}

/// Checksums of every expert of every MoE layer, as stored (the manifest a coordinator checks against).
pub fn manifest(ckpt: &Checkpoint) -> Result<Vec<Vec<u64>>> {
    use rayon::prelude::*;
    let moe = ckpt.config.moe_layers();
    moe.iter()
        .map(|&dl| {
            (0..ckpt.config.num_experts)
                .into_par_iter()
                .map(|e| ckpt.expert(dl, e).map(|w| w.checksum))
                .collect()
        })
        .collect()
}

/// Puts staged experts into the bank (a free slot each).
pub fn stage(bank: &mut ExpertBank, loaded: Vec<(usize, usize, Arc<ExpertWeights>)>) {
    for (l, e, w) in loaded {
        if bank.get(l, e).is_none() {
            bank.insert(l, e, w);
        }
    }
}

/// Checks that every expert `map` puts in `tier` is resident in `bank`.
pub fn check_resident(bank: &ExpertBank, map: &ValidMap, tier: Tier) -> Result<()> {
    for l in 0..map.layers() {
        let list = match tier {
            Tier::Hot => &map.map.layers[l].hot,
            Tier::Cold => &map.map.layers[l].cold,
        };
        for &e in list {
            if bank.get(l, e as usize).is_none() {
                return Err(Error::NotResident {
                    layer: l,
                    expert: e as usize,
                    tier: tier.name(),
                });
            }
        }
    }
    Ok(())
}

/// Frees every resident expert that `map` does not put in `tier`.
pub fn release(bank: &mut ExpertBank, map: &ValidMap, tier: Tier) -> usize {
    let mut freed = 0;
    for l in 0..map.layers() {
        for e in 0..map.experts() {
            if map.tier(l, e) != tier && bank.get(l, e).is_some() {
                bank.remove(l, e);
                freed += 1;
            }
        }
    }
    freed
}
