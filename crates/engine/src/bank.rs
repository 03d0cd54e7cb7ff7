//! The expert bank of one tier: per MoE layer, experts live in slots; the tier computes a
//! list of picks and returns one output row per pick (never a pre-summed partial), so the
//! layer can combine every token's k outputs in router-rank order whatever the map.

use std::cell::RefCell;
use std::sync::Arc;

use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, ExpertWeights};
use crate::error::{Error, Result};
use crate::ops::matmul;
use crate::rowmap::{Tier, ValidMap};

/// One pick to compute: `row` indexes the activations sent with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    pub row: u32,
    pub expert: u16,
}

/// Refuses an output buffer too small for one row of `hidden` per pick.
pub fn check_out(out_len: usize, picks: usize, hidden: usize) -> Result<()> {
    if out_len < picks * hidden {
        return Err(Error::Internal(format!(
            "output buffer holds {out_len} floats, {picks} picks need {}",
            picks * hidden
        )));
    }
    Ok(())
}

/// Per layer: the experts resident in this tier, by slot.
pub struct ExpertBank {
    pub tier: Tier,
    pub hidden: usize,
    pub inter: usize,
    /// `slots[layer][slot]`
    slots: Vec<Vec<Option<Arc<ExpertWeights>>>>,
    /// `slot_of[layer][expert]`
    slot_of: Vec<Vec<Option<u32>>>,
}

/// Per-thread buffers of an expert's forward: gathered rows, gate|up, activation, output.
type Scratch = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

thread_local! {
    static SCRATCH: RefCell<Scratch> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: used only to write disjoint rows (one pick's row is written by one task).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` must be inside the buffer the pointer came from.
    unsafe fn at(self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}

/// A gated expert on `g` gathered rows: y = down(glu(x·gateᵀ + b_gate, x·upᵀ + b_up)) + b_down
/// (SwiGLU, `glu(a, b) = silu(a) b`, without biases but in gpt_oss).
pub fn expert_forward(
    w: &ExpertWeights,
    x: &[f32],
    g: usize,
    gu: &mut Vec<f32>,
    act: &mut Vec<f32>,
    y: &mut [f32],
) {
    let inter = w.down.cols;
    let hidden = w.down.rows;
    gu.resize(g * 2 * inter, 0.0);
    act.resize(g * inter, 0.0);
    matmul(x, g, &w.gate_up, gu);
    for r in 0..g {
        let row = &mut gu[r * 2 * inter..(r + 1) * 2 * inter];
        if !w.gate_up_bias.is_empty() {
            for (v, b) in row.iter_mut().zip(&w.gate_up_bias) {
                *v += b;
            }
        }
        let (gate, up) = row.split_at(inter);
        for j in 0..inter {
            act[r * inter + j] = w.glu.apply(gate[j], up[j]);
        }
    }
    matmul(act, g, &w.down, y);
    if !w.down_bias.is_empty() {
        for row in y[..g * hidden].chunks_exact_mut(hidden) {
            for (v, b) in row.iter_mut().zip(&w.down_bias) {
                *v += b;
            }
        }
    }
}

impl ExpertBank {
    /// An empty bank for `layers` MoE layers.
    pub fn empty(tier: Tier, layers: usize, experts: usize, hidden: usize, inter: usize) -> Self {
        ExpertBank {
            tier,
            hidden,
            inter,
            slots: vec![Vec::new(); layers],
            slot_of: vec![vec![None; experts]; layers],
        }
    }

    /// Loads the experts the map puts in `tier`, from the checkpoint, in slot order.
    /// `moe_layers[i]` is the decoder layer of the map's layer `i`.
    pub fn load(
        ckpt: &Checkpoint,
        map: &ValidMap,
        tier: Tier,
        moe_layers: &[usize],
        progress: Option<&indicatif::ProgressBar>,
    ) -> Result<Self> {
        let c = &ckpt.config;
        let mut bank = Self::empty(
            tier,
            map.layers(),
            c.num_experts,
            c.hidden_size,
            c.moe_intermediate_size,
        );
        for (l, &dl) in moe_layers.iter().enumerate() {
            let list = match tier {
                Tier::Hot => &map.map.layers[l].hot,
                Tier::Cold => &map.map.layers[l].cold,
            };
            let loaded: Vec<Result<ExpertWeights>> = list
                .par_iter()
                .map(|&e| {
                    // built on its node's memory where the team spans several
                    crate::numa::load_expert(e as usize, c.num_experts, || {
                        ckpt.expert(dl, e as usize)
                    })
                })
                .collect();
            for (slot, (w, &e)) in loaded.into_iter().zip(list).enumerate() {
                bank.slots[l].push(Some(Arc::new(w?)));
                bank.slot_of[l][e as usize] = Some(slot as u32);
            }
            if let Some(p) = progress {
                p.inc(list.len() as u64);
            }
        }
        Ok(bank)
    }

    /// Puts `w` for `expert` into a free slot (or a new one) of `layer`.
    pub fn insert(&mut self, layer: usize, expert: usize, w: Arc<ExpertWeights>) -> u32 {
        let slot = match self.slots[layer].iter().position(|s| s.is_none()) {
            Some(s) => s,
            None => {
                self.slots[layer].push(None);
                self.slots[layer].len() - 1
            }
        };
        self.slots[layer][slot] = Some(w);
        self.slot_of[layer][expert] = Some(slot as u32);
        slot as u32
    }

    /// Frees the slot of `expert` in `layer`; returns its weights.
    pub fn remove(&mut self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        let slot = self.slot_of[layer][expert].take()?;
        self.slots[layer][slot as usize].take()
    }

    /// Whether every pick names an expert of `layer` held here and a row among the
    /// `acts_len / hidden` activation rows given: checked before any room is made for the
    /// picks' outputs (a frame of many bogus picks must not cost picks x hidden floats).
    pub fn check_picks(&self, layer: usize, picks: &[Pick], acts_len: usize) -> Result<()> {
        let rows = acts_len / self.hidden.max(1);
        for p in picks {
            if self.get(layer, p.expert as usize).is_none() {
                return Err(Error::NotResident {
                    layer,
                    expert: p.expert as usize,
                    tier: self.tier.name(),
                });
            }
            if p.row as usize >= rows {
                return Err(Error::Invalid(format!(
                    "pick refers to row {} of {} activation rows",
                    p.row, rows
                )));
            }
        }
        Ok(())
    }

    pub fn get(&self, layer: usize, expert: usize) -> Option<&Arc<ExpertWeights>> {
        let s = (*self.slot_of.get(layer)?.get(expert)?)?;
        self.slots[layer][s as usize].as_ref()
    }

    /// The experts resident in `layer`, with their weights.
    pub fn experts_of(&self, layer: usize) -> impl Iterator<Item = (usize, &Arc<ExpertWeights>)> {
        self.slot_of[layer]
            .iter()
            .enumerate()
            .filter_map(move |(e, s)| {
                s.and_then(|s| self.slots[layer][s as usize].as_ref().map(|w| (e, w)))
            })
    }

    pub fn resident(&self, layer: usize) -> usize {
        self.slot_of[layer].iter().filter(|s| s.is_some()).count()
    }

    pub fn layers(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of expert weights held.
    pub fn bytes(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .flatten()
            .map(|w| w.bytes())
            .sum()
    }

    /// Computes every pick of `layer`: `acts` holds the rows picks refer to (`[rows, hidden]`),
    /// `out` receives one `hidden`-wide row per pick, in pick order.
    pub fn compute(
        &self,
        layer: usize,
        picks: &[Pick],
        acts: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let h = self.hidden;
        check_out(out.len(), picks.len(), h)?;
        // group picks by expert (stable: pick order within a group)
        let mut order: Vec<u32> = (0..picks.len() as u32).collect();
        order.sort_by_key(|&i| (picks[i as usize].expert, i));
        let mut groups: Vec<(usize, usize)> = Vec::new();
        let mut s = 0;
        while s < order.len() {
            let e = picks[order[s] as usize].expert;
            let mut t = s;
            while t < order.len() && picks[order[t] as usize].expert == e {
                t += 1;
            }
            groups.push((s, t));
            s = t;
        }
        self.check_picks(layer, picks, acts.len())?;
        let optr = OutPtr(out.as_mut_ptr());
        let team = crate::team::team();
        let run_group = |gi: usize| {
            let (s, t) = groups[gi];
            let idx = &order[s..t];
            let e = picks[idx[0] as usize].expert as usize;
            let Some(w) = self.get(layer, e) else { return };
            // Take the buffers out (not a borrow held across the matmuls, which may run
            // another task on this thread) and put them back after.
            let mut sc = SCRATCH.with(|sc| std::mem::take(&mut *sc.borrow_mut()));
            {
                let (x, gu, act, y) = &mut sc;
                let g = idx.len();
                x.resize(g * h, 0.0);
                for (j, &pi) in idx.iter().enumerate() {
                    let r = picks[pi as usize].row as usize;
                    x[j * h..(j + 1) * h].copy_from_slice(&acts[r * h..(r + 1) * h]);
                }
                y.resize(g * h, 0.0);
                expert_forward(w, x, g, gu, act, y);
                for (j, &pi) in idx.iter().enumerate() {
                    // SAFETY: pick index pi < picks.len() and out.len() >= picks.len() * h
                    // (checked above); each pick belongs to exactly one group, so rows are disjoint.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            y.as_ptr().add(j * h),
                            optr.at(pi as usize * h),
                            h,
                        );
                    }
                }
            }
            SCRATCH.with(|s| *s.borrow_mut() = sc);
        };
        // Fewer groups than threads, each big enough to split: the groups one after
        // another, each expert's products across the team. Else the groups across the
        // team, each on one thread (the products inside a task run on its thread).
        let per_group = picks.len().div_ceil(groups.len().max(1)) * 3 * h * self.inter;
        // On several nodes, each node's workers take the groups of the experts on their
        // node first (the groups are in expert order, and so in node order).
        if groups.len() < team.threads() && per_group >= 2 * crate::ops::PAR_MIN_WORK {
            (0..groups.len()).for_each(run_group);
        } else if team.nodes() > 1 {
            let experts = self.slot_of[layer].len();
            let node = |g: usize| {
                let e = picks[order[groups[g].0] as usize].expert as usize;
                crate::numa::expert_node(e, experts, team.nodes())
            };
            match crate::numa::node_ranges(groups.len(), team.nodes(), node) {
                Some(r) => team.run_placed(&r, &run_group),
                None => team.run(groups.len(), &run_group),
            }
        } else {
            team.run(groups.len(), &run_group);
        }
        Ok(())
    }
}
