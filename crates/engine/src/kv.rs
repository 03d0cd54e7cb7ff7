//! Paged KV cache: fixed-size blocks of positions, a free list, and per-sequence block
//! tables that give their blocks back when dropped (RAII, as TGI's block allocator).

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::ops::Bf16;

/// Positions per block.
pub const BLOCK: usize = 16;

#[derive(Debug)]
struct FreeList {
    free: Vec<u32>,
}

/// What a host KV cache stores per element (`--kv-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// f32, as computed (the default)
    F32,
    /// bf16, rounded to nearest even as written: half the memory and half the bytes
    /// attention reads, at bf16's precision
    Bf16,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Bytes of one stored element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
}

/// The cache storage of all layers plus the shared free list.
pub struct KvCache {
    pub layers: usize,
    pub kv_dim: usize,
    pub blocks: usize,
    /// what `k`/`v` (f32) or `k16`/`v16` (bf16) hold; the other pair is empty
    pub dtype: KvDtype,
    /// per layer `[blocks * BLOCK * kv_dim]`
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub k16: Vec<Vec<Bf16>>,
    pub v16: Vec<Vec<Bf16>>,
    free: Arc<Mutex<FreeList>>,
}

/// One sequence's block table. Dropping it frees its blocks.
#[derive(Debug)]
pub struct SeqKv {
    pub blocks: Vec<u32>,
    /// Positions written so far.
    pub len: usize,
    free: Arc<Mutex<FreeList>>,
}

/// The free list, poisoned or not: its operations (push, pop, append of block ids) leave it
/// whole whatever panicked while it was held.
fn lock_free(m: &Mutex<FreeList>) -> std::sync::MutexGuard<'_, FreeList> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        // the free list is a plain list of ids, whole after any panic: a poisoned lock is
        // taken as it is, so no block is ever leaked
        lock_free(&self.free).free.append(&mut self.blocks);
    }
}

impl SeqKv {
    /// Cache offset (in floats, within a layer) of position `pos`.
    #[inline]
    pub fn offset(&self, pos: usize, kv_dim: usize) -> usize {
        (self.blocks[pos / BLOCK] as usize * BLOCK + pos % BLOCK) * kv_dim
    }
}

/// The most tokens a KV cache holds (2^32: far past any host's memory at any model's size).
pub const MAX_KV_TOKENS: usize = 1 << 32;

impl KvCache {
    /// Bytes of K and V this cache holds in host memory (0 for an accounting-only cache,
    /// whose K/V live on a GPU).
    pub fn host_bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|x| x.len() * 4)
            .sum::<usize>()
            + self
                .k16
                .iter()
                .chain(&self.v16)
                .map(|x| x.len() * 2)
                .sum::<usize>()
    }

    /// Layers whose K/V this cache holds in host memory (0: accounting only).
    pub fn host_layers(&self) -> usize {
        self.k.len().max(self.k16.len())
    }

    /// A cache of `blocks` blocks for `layers` layers of `kv_dim` floats per position.
    pub fn new(layers: usize, kv_dim: usize, blocks: usize) -> Self {
        Self::with_dims(layers, kv_dim, kv_dim, blocks, KvDtype::F32)
    }

    /// As [`KvCache::new`], with `v_dim` elements of v per position (0: none), of `dtype`.
    fn with_dims(
        layers: usize,
        kv_dim: usize,
        v_dim: usize,
        blocks: usize,
        dtype: KvDtype,
    ) -> Self {
        let (pk, pv) = (blocks * BLOCK * kv_dim, blocks * BLOCK * v_dim);
        let (f, h) = match dtype {
            KvDtype::F32 => (layers, 0),
            KvDtype::Bf16 => (0, layers),
        };
        KvCache {
            layers,
            kv_dim,
            blocks,
            dtype,
            k: (0..f).map(|_| vec![0.0; pk]).collect(),
            v: (0..f).map(|_| vec![0.0; pv]).collect(),
            k16: (0..h).map(|_| vec![Bf16(0); pk]).collect(),
            v16: (0..h).map(|_| vec![Bf16(0); pv]).collect(),
            free: Arc::new(Mutex::new(FreeList {
                free: (0..blocks as u32).rev().collect(),
            })),
        }
    }

    /// The cache a model keeps ([`crate::config::ModelConfig::cache_dims`]): k and v of
    /// `kv_dim` floats per position, or MLA's latent in k alone (v empty).
    pub fn for_model(cfg: &crate::config::ModelConfig, blocks: usize) -> Self {
        let (kd, vd) = cfg.cache_dims();
        Self::with_dims(cfg.num_hidden_layers, kd, vd, blocks, KvDtype::F32)
    }

    /// As [`KvCache::for_model`], storing `dtype`; bf16 is refused for MLA's latent cache
    /// (its attention reads the latent as f32).
    pub fn for_model_as(
        cfg: &crate::config::ModelConfig,
        blocks: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        if dtype != KvDtype::F32 && cfg.mla.is_some() {
            return Err(Error::Invalid(format!(
                "a {} KV cache is not built for multi-head latent attention ({}): use f32",
                dtype.name(),
                cfg.family.name()
            )));
        }
        let (kd, vd) = cfg.cache_dims();
        Ok(Self::with_dims(
            cfg.num_hidden_layers,
            kd,
            vd,
            blocks,
            dtype,
        ))
    }

    /// Blocks needed to hold `tokens` positions.
    /// Block accounting only, no host arrays: for an engine whose K/V live on a GPU.
    pub fn accounting(layers: usize, kv_dim: usize, blocks: usize) -> Self {
        KvCache {
            layers,
            kv_dim,
            blocks,
            dtype: KvDtype::F32,
            k: Vec::new(),
            v: Vec::new(),
            k16: Vec::new(),
            v16: Vec::new(),
            free: Arc::new(Mutex::new(FreeList {
                free: (0..blocks as u32).rev().collect(),
            })),
        }
    }

    pub fn blocks_for(tokens: usize) -> usize {
        tokens.div_ceil(BLOCK)
    }

    /// Refuses, before it is allocated, a cache of `tokens` for `cfg` whose one layer's f32 K
    /// array alone is larger than this host's memory and swap (`MemTotal` + `SwapTotal` of
    /// /proc/meminfo; not checked where that cannot be read): that allocation cannot succeed
    /// and would abort the process. Larger caches whose pages are never touched (a GPU
    /// primary's host arrays, a bf16 cache built after an f32 one) are not refused.
    pub fn check_host_memory(cfg: &crate::config::ModelConfig, tokens: usize) -> crate::Result<()> {
        Self::check_tokens(tokens)?;
        let (kd, vd) = cfg.cache_dims();
        let tokens = (Self::blocks_for(tokens.max(BLOCK)) * BLOCK) as u128;
        let layer = tokens * kd.max(vd) as u128 * 4;
        let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            let kb = |key: &str| -> Option<u128> {
                m.lines()
                    .find_map(|l| l.strip_prefix(key))?
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .ok()
            };
            Some((kb("MemTotal:")? + kb("SwapTotal:").unwrap_or(0)) * 1024)
        });
        match total {
            Some(total) if layer > total => Err(crate::Error::Invalid(format!(
                "a KV cache of {tokens} tokens takes {:.1} GiB a layer (f32), more than this \
                 host's {:.1} GiB of memory and swap: lower --kv-tokens",
                layer as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a capacity past [`MAX_KV_TOKENS`] (`--kv-tokens`, a lane's config), before
    /// any size is computed from it.
    pub fn check_tokens(tokens: usize) -> crate::Result<()> {
        if tokens > MAX_KV_TOKENS {
            return Err(crate::Error::Invalid(format!(
                "a KV cache of {tokens} tokens: at most {MAX_KV_TOKENS} (--kv-tokens)"
            )));
        }
        Ok(())
    }

    pub fn new_seq(&self) -> SeqKv {
        SeqKv {
            blocks: Vec::new(),
            len: 0,
            free: self.free.clone(),
        }
    }

    pub fn free_blocks(&self) -> usize {
        lock_free(&self.free).free.len()
    }

    pub fn used_blocks(&self) -> usize {
        self.blocks - self.free_blocks()
    }

    /// Grows `seq` to hold `new_len` positions, or fails without taking anything.
    pub fn reserve(&self, seq: &mut SeqKv, new_len: usize) -> Result<()> {
        let need = Self::blocks_for(new_len).saturating_sub(seq.blocks.len());
        if need == 0 {
            return Ok(());
        }
        let mut f = lock_free(&self.free);
        if f.free.len() < need {
            return Err(Error::KvFull {
                needed: need,
                free: f.free.len(),
                total: self.blocks,
            });
        }
        for _ in 0..need {
            if let Some(b) = f.free.pop() {
                seq.blocks.push(b);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn blocks_return_on_drop_and_full_fails_cleanly() {
        let kv = KvCache::new(1, 4, 10);
        let mut rng = Rng::new(3);
        let mut live: Vec<SeqKv> = Vec::new();
        for _ in 0..500 {
            if rng.below(3) == 0 && !live.is_empty() {
                let i = rng.below(live.len());
                live.swap_remove(i);
            } else {
                let mut s = kv.new_seq();
                let want = rng.below(60) + 1;
                let before = kv.free_blocks();
                match kv.reserve(&mut s, want) {
                    Ok(()) => {
                        s.len = want;
                        live.push(s)
                    }
                    Err(Error::KvFull { .. }) => assert_eq!(kv.free_blocks(), before),
                    Err(e) => panic!("{e}"),
                }
            }
            let held: usize = live.iter().map(|s| s.blocks.len()).sum();
            assert_eq!(held + kv.free_blocks(), 10);
            let mut all: Vec<u32> = live.iter().flat_map(|s| s.blocks.clone()).collect();
            all.sort();
            all.dedup();
            assert_eq!(all.len(), held, "a block is owned twice");
        }
        live.clear();
        assert_eq!(kv.free_blocks(), 10);
    }
}
