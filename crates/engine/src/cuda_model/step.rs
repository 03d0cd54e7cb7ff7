//! The GPU step backend: [`GpuModel`]'s ops queued as the engine's step calls them and run
//! when the host must look (a layer whose map has cold experts, the trace, the head), so a
//! step is a few runs, each captured once as a CUDA graph per batch shape and replayed.

use std::any::Any;

use crate::bank::ExpertBank;
use crate::error::{Error, Result};
use crate::kv::{KvCache, SeqKv};
use crate::rowmap::ValidMap;
use crate::sampling::TokenPick;
use crate::step::{DeviceRows, Engine, HeadOut, RowPos, Split, StepBackend, StepOut};
use crate::tier::MailboxPtrs;

use super::{GpuModel, Op};

/// A [`GpuModel`] as the engine's step backend.
pub struct GpuStep {
    pub model: GpuModel,
    ops: Vec<Op>,
    /// normed rows on the host, for a link through host memory
    h: Vec<f32>,
    /// the step's picks `[moe layers, rows, k]`, downloaded with the head
    picks: Vec<i32>,
    ids: Vec<u32>,
    slots: Vec<i32>,
    bytes_per_token: usize,
}

impl GpuStep {
    pub fn new(model: GpuModel) -> Self {
        let bytes_per_token = model.dense_bytes_per_token();
        GpuStep {
            model,
            ops: Vec::new(),
            h: Vec::new(),
            picks: Vec::new(),
            ids: Vec::new(),
            slots: Vec::new(),
            bytes_per_token,
        }
    }

    /// Runs the queued ops.
    fn flush(&mut self) -> Result<()> {
        let r = self.model.run(&self.ops);
        self.ops.clear();
        r
    }

    fn slots_of(&mut self, slots: &[u32]) -> Result<()> {
        self.slots.clear();
        for &s in slots {
            let s = i32::try_from(s).map_err(|_| {
                Error::Internal(format!("pick slot {s} does not fit the GPU's ints"))
            })?;
            self.slots.push(s);
        }
        Ok(())
    }
}

/// Moves `eng`'s steps onto `g`: its hot experts from the bank (unless `g` generated its
/// own), its map, and the KV cache on the GPU. The engine must hold no live sequence; its
/// CPU backend and K/V arrays are dropped.
pub fn attach_gpu(eng: &mut Engine, g: GpuModel) -> Result<()> {
    let kv = KvCache::accounting(
        eng.cfg.num_hidden_layers,
        eng.cfg.cache_dims().0,
        g.kv_blocks(),
    );
    eng.set_backend(Box::new(GpuStep::new(g)), kv)
}

impl StepBackend for GpuStep {
    fn describe(&self) -> String {
        self.model.describe()
    }

    fn begin(
        &mut self,
        tokens: &[u32],
        rows: &[RowPos],
        seqs: &[&SeqKv],
        logit_rows: &[usize],
    ) -> Result<()> {
        self.ops.clear();
        self.model.begin(tokens, rows, seqs, logit_rows)
    }

    fn embed(&mut self) -> Result<()> {
        self.ops.push(Op::Embed);
        Ok(())
    }

    fn attention(&mut self, layer: usize, _seqs: &[&SeqKv], _kv: &mut KvCache) -> Result<()> {
        self.ops.push(Op::Attention(layer));
        Ok(())
    }

    fn route(&mut self, layer: usize, ml: usize) -> Result<()> {
        self.ops.push(Op::Route(layer, ml));
        Ok(())
    }

    fn host_routes(&self) -> bool {
        false
    }

    fn picks(&mut self, ml: usize, rows: bool, out: &mut Vec<i32>) -> Result<()> {
        self.flush()?;
        if rows {
            self.model.fetch_route(ml, out, &mut self.h)
        } else {
            self.model.fetch_picks(ml, out)
        }
    }

    fn normed_rows(&self) -> &[f32] {
        &self.h
    }

    fn device_rows(&self) -> Option<DeviceRows> {
        let (ordinal, ptr, len) = self.model.normed_rows();
        Some(DeviceRows { ordinal, ptr, len })
    }

    fn experts(&mut self, ml: usize, _bank: &ExpertBank, split: Option<&Split>) -> Result<()> {
        // the device's map decides which picks are hot; a cold pick's slot is filled by
        // the scatter that follows
        self.ops.push(Op::Moe(ml));
        if split.is_some() {
            // run now: the cold tier is computing meanwhile
            self.flush()?;
        }
        Ok(())
    }

    fn scatter(&mut self, slots: &[u32], outputs: &[f32]) -> Result<()> {
        self.slots_of(slots)?;
        self.model.scatter(&self.slots, outputs)
    }

    unsafe fn scatter_device(&mut self, slots: &[u32], src: u64, len: usize) -> Result<()> {
        self.slots_of(slots)?;
        // SAFETY: the caller's guarantee, as scatter_from asks
        unsafe { self.model.scatter_from(&self.slots, src, len) }
    }

    fn shared_expert(&mut self, layer: usize) -> Result<()> {
        if self.model.has_shared(layer) {
            self.ops.push(Op::Shared(layer));
        }
        Ok(())
    }

    fn attach_mailbox(&mut self, mb: Option<MailboxPtrs>) -> Result<bool> {
        if mb.is_some_and(|m| m.ordinal != self.model.gpu.ordinal) {
            return Ok(false);
        }
        let on = mb.is_some();
        self.model.attach_link(mb)?;
        Ok(on)
    }

    fn link_begin(&mut self, epoch: u64, step: u64, limit_ns: u64) -> Result<()> {
        self.model.link_begin(epoch, step, limit_ns)?;
        self.ops.push(Op::LinkStep);
        Ok(())
    }

    fn link_layer(&mut self, ml: usize, join: bool) -> Result<()> {
        if !join {
            self.ops.push(Op::LinkPost(ml, 0));
            return Ok(());
        }
        // the first round's exchange overlaps the hot experts; the rest follow it
        self.ops.push(Op::LinkJoin(ml, 0));
        for r in 1..self.model.link_rounds() {
            self.ops.push(Op::LinkPost(ml, r));
            self.ops.push(Op::LinkJoin(ml, r));
        }
        Ok(())
    }

    fn link_end(&mut self, wait_ns: &mut [u64]) -> Result<()> {
        self.model.link_end(wait_ns)
    }

    fn combine(&mut self) -> Result<()> {
        // a layer whose experts ran in this run with nothing after them (no cold outputs
        // scattered, no shared expert) combines in its down-projection's kernel when the
        // model can
        if let Some(&Op::Moe(ml)) = self.ops.last() {
            if self.model.fuses_combine(ml) {
                self.ops.pop();
                self.ops.push(Op::MoeOne(ml));
                return Ok(());
            }
        }
        let at = self.ops.iter().rev().find_map(|op| match *op {
            Op::Route(l, ml) => Some((l, ml)),
            _ => None,
        });
        self.ops.push(Op::Combine(at));
        Ok(())
    }

    fn dense_mlp(&mut self, layer: usize) -> Result<()> {
        self.ops.push(Op::DenseMlp(layer));
        Ok(())
    }

    fn hidden(&mut self, out: &mut Vec<f32>) -> Result<()> {
        self.flush()?;
        self.model.read_x(out)
    }

    fn head(&mut self, out: HeadOut, picks: &[TokenPick]) -> Result<StepOut> {
        if out == HeadOut::Sample {
            self.model.set_picks(picks)?;
        }
        self.ops.push(Op::Head(out));
        self.flush()?;
        if out == HeadOut::Logits {
            let mut logits = vec![0f32; self.model.logit_rows() * self.model.vocab()];
            self.model
                .download(Some(&mut logits), None, &mut self.picks)?;
            Ok(StepOut::Logits(logits))
        } else {
            self.model
                .download(None, Some(&mut self.ids), &mut self.picks)?;
            Ok(StepOut::Ids(self.ids.clone()))
        }
    }

    fn step_picks(&self) -> &[i32] {
        &self.picks
    }

    fn sync_hot(&mut self, bank: &ExpertBank) -> Result<()> {
        self.model.sync_hot(bank)
    }

    fn set_map(&mut self, map: &ValidMap) -> Result<()> {
        self.model.set_map(map)
    }

    fn swappable(&self) -> Result<()> {
        if self.model.generated {
            return Err(Error::Invalid(
                "this engine's experts were generated on the GPU: swaps cannot move them".into(),
            ));
        }
        Ok(())
    }

    fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Engine {
    /// The GPU model this engine steps on, when its backend is one.
    pub fn gpu_mut(&mut self) -> Option<&mut GpuModel> {
        self.backend_as::<GpuStep>().map(|s| &mut s.model)
    }
}
