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

/// Loads and verifies incoming experts, several at once (slow: reads the checkpoint; a swap
/// runs it off the step loop).
pub fn load_verified(
    ckpt: &Checkpoint,
    incoming: &[Incoming],
) -> Result<Vec<(usize, usize, Arc<ExpertWeights>)>> {
    use rayon::prelude::*;
    let moe = ckpt.config.moe_layers();
    incoming
        .par_iter()
        .map(|&(l, e, want)| {
            let dl = *moe.get(l).ok_or_else(|| {
                Error::Rowmap(format!("layer {l} is not a MoE layer of the checkpoint"))
            })?;
            // the checksum of the stored bytes, as the manifest's (Checkpoint::expert_checksum)
            // built on its node's memory where the team spans several (this runs off the
            // step loop)
            let w = crate::numa::load_expert(e, ckpt.config.num_experts, || ckpt.expert(dl, e))?;
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

/// Checksums of every expert of every MoE layer ([`Checkpoint::expert_checksum`], the
/// function [`load_verified`] checks with): the manifest a coordinator checks against. Reads
/// the stored bytes once, with a progress bar past a second on a terminal.
pub fn manifest(ckpt: &Checkpoint) -> Result<Vec<Vec<u64>>> {
    use rayon::prelude::*;
    let moe = ckpt.config.moe_layers();
    let pb = crate::progress::bar(
        (moe.len() * ckpt.config.num_experts) as u64,
        "checksumming {msg} [{bar:30}] {pos}/{len} experts ({elapsed})",
        ckpt.dir.display().to_string(),
    );
    let sums = moe
        .iter()
        .map(|&dl| {
            let layer = (0..ckpt.config.num_experts)
                .into_par_iter()
                .map(|e| ckpt.expert_checksum(dl, e))
                .collect();
            pb.inc(ckpt.config.num_experts as u64);
            layer
        })
        .collect();
    pb.finish_and_clear();
    sums
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::checksum;
    use crate::synth::{generate, Preset};

    /// Offset in the file of the first data byte of tensor `name`.
    fn data_offset(file: &std::path::Path, name: &str) -> usize {
        let b = std::fs::read(file).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        8 + n + h[name]["data_offsets"][0].as_u64().unwrap() as usize
    }

    #[test]
    fn the_checksum_is_over_the_stored_bytes_and_catches_a_flipped_byte() {
        let dir = tempfile::tempdir().unwrap();
        generate(&Preset::by_name("tiny").unwrap(), 1, dir.path()).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let moe = ckpt.config.moe_layers();
        let (l, e) = (moe.len() - 1, 5);
        let dl = moe[l];
        let sums = manifest(&ckpt).unwrap();
        assert_eq!(sums.len(), moe.len());
        // the manifest and a loaded expert checksum the same bytes: the file's, as stored
        let p = format!("model.layers.{dl}.mlp.experts.{e}");
        let raw = |n: &str| ckpt.raw(&format!("{p}.{n}.weight")).unwrap().bytes;
        let stored = checksum(&[raw("gate_proj"), raw("up_proj"), raw("down_proj")]);
        assert_eq!(sums[l][e], stored);
        assert_eq!(ckpt.expert(dl, e).unwrap().checksum, stored);
        assert_eq!(load_verified(&ckpt, &[(l, e, stored)]).unwrap().len(), 1);
        let distinct: std::collections::BTreeSet<u64> = sums.iter().flatten().copied().collect();
        assert_eq!(distinct.len(), moe.len() * ckpt.config.num_experts);
        drop(ckpt);

        // one byte of that expert's down projection changes on disk
        let file = dir.path().join("model.safetensors");
        let at = data_offset(&file, &format!("{p}.down_proj.weight")) + 17;
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[at] ^= 0x10;
        std::fs::write(&file, &bytes).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let after = manifest(&ckpt).unwrap();
        for (li, (a, b)) in sums.iter().zip(&after).enumerate() {
            for (ei, (x, y)) in a.iter().zip(b).enumerate() {
                assert_eq!(x == y, (li, ei) != (l, e), "layer {li} expert {ei}");
            }
        }
        // PREPARE's load refuses it against the manifest taken before, and loads the others
        match load_verified(&ckpt, &[(l, e, sums[l][e])]) {
            Err(Error::Checksum {
                layer,
                expert,
                expected,
                ..
            }) => assert_eq!((layer, expert, expected), (l, e, sums[l][e])),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a changed expert was loaded"),
        }
        assert!(load_verified(&ckpt, &[(l, e + 1, sums[l][e + 1])]).is_ok());
    }

    #[test]
    fn the_checksum_does_not_depend_on_how_the_bytes_are_split() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let whole = checksum(&[&data]);
        for cut in [0, 1, 111, 112, 113, 500, 999, 1000] {
            assert_eq!(
                checksum(&[&data[..cut], &data[cut..]]),
                whole,
                "cut at {cut}"
            );
        }
        assert_ne!(checksum(&[&data[1..]]), whole);
    }
}
