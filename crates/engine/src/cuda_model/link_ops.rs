//! The primary's side of the `ipc` link's device mailbox ([`crate::cuda_link`]): per step
//! a head posted to the sidecar's box, per MoE layer the picks and normed rows posted after
//! the router and the reply joined before the combine, all inside the step's CUDA graph;
//! the host looks once per step, after the head, at the status word and the wait counters.

use crate::cuda_link::{
    LinkKernels, MailboxPtrs, CODE_EPOCH, CODE_FAILED, CODE_NOT_COMPUTED, CODE_PEER_FAILED,
    CODE_TIMED_OUT, META_HEAD_WORDS,
};
use crate::error::{Error, Fault, Result};

use super::{Buf, GpuModel, Op};

/// An attached mailbox: its pointers, the kernels, the meta words and the step's number.
pub(super) struct LinkState {
    k: LinkKernels,
    pub(super) ptrs: MailboxPtrs,
    meta: Buf<u64>,
    done: Buf<u32>,
    seq: u64,
    host: Vec<u64>,
    /// the step's epoch (named in an epoch error)
    epoch: u64,
    /// set after a failure: the link must be opened again
    broken: Option<String>,
}

impl GpuModel {
    /// Steps exchange through `ptrs`'s mailbox from now on (None: through the host again).
    /// The layout must match this model: its MoE layers, picks per row and hidden size.
    pub fn attach_link(&mut self, ptrs: Option<MailboxPtrs>) -> Result<()> {
        self.drop_graphs();
        let Some(p) = ptrs else {
            self.link = None;
            return Ok(());
        };
        let c = &self.cfg;
        let l = p.layout;
        l.check()?;
        if l.layers != self.moe || l.k != c.num_experts_per_tok || l.hidden != c.hidden_size {
            return Err(Error::Invalid(format!(
                "the ipc link's mailbox is for {} MoE layers x {} picks of {} floats; this model has {} x {} of {}",
                l.layers, l.k, l.hidden, self.moe, c.num_experts_per_tok, c.hidden_size
            )));
        }
        let st = self.st.clone();
        let seq = self.link.as_ref().map_or(0, |s| s.seq);
        self.link = Some(LinkState {
            k: LinkKernels::load(&self.gpu)?,
            ptrs: p,
            meta: Buf::zeros(&st, META_HEAD_WORDS + l.layers)?,
            done: Buf::zeros(&st, 1)?,
            seq,
            host: Vec::new(),
            epoch: 0,
            broken: None,
        });
        Ok(())
    }

    /// Whether a mailbox is attached (its generation).
    pub fn link_generation(&self) -> Option<u64> {
        self.link.as_ref().map(|s| s.ptrs.generation)
    }

    /// Starts the step begun last on the link: its sequence number, rows, map epoch,
    /// engine step and the longest a layer's wait may spin. Fails when the link failed
    /// before.
    pub fn link_begin(&mut self, epoch: u64, step: u64, limit_ns: u64) -> Result<()> {
        let n = self.n;
        let st = self.st.clone();
        let s = self
            .link
            .as_mut()
            .ok_or_else(|| Error::Internal("no ipc mailbox attached".into()))?;
        if let Some(why) = &s.broken {
            return Err(Error::link(
                "ipc",
                Fault::Unavailable,
                format!("the link failed ({why}); it must be opened again"),
            ));
        }
        s.seq += 1;
        s.epoch = epoch;
        s.host.clear();
        s.host
            .extend_from_slice(&[s.seq, n as u64, epoch, step, limit_ns, 0, 0, 0]);
        s.host.resize(META_HEAD_WORDS + s.ptrs.layout.layers, 0);
        s.meta.write(&st, &s.host)
    }

    /// After the step's head: the status word (a failure named) and each layer's spin (ns)
    /// added to `wait_ns`.
    pub fn link_end(&mut self, wait_ns: &mut [u64]) -> Result<()> {
        let st = self.st.clone();
        let s = self
            .link
            .as_mut()
            .ok_or_else(|| Error::Internal("no ipc mailbox attached".into()))?;
        let len = s.host.len();
        s.meta.read(&st, &mut s.host[..len])?;
        st.synchronize()
            .map_err(|e| super::gerr("reading the link's status", e))?;
        for (w, &x) in wait_ns.iter_mut().zip(&s.host[META_HEAD_WORDS..]) {
            *w += x;
        }
        let status = s.host[5];
        if status == 0 {
            return Ok(());
        }
        let layer = (status >> 16).saturating_sub(1);
        let limit_ms = s.host[4] as f64 / 1e6;
        let e = match status & 0xff {
            CODE_TIMED_OUT => Error::link(
                "ipc",
                Fault::Timeout,
                format!("the sidecar did not answer MoE layer {layer} within {limit_ms:.1} ms"),
            ),
            CODE_PEER_FAILED => Error::link(
                "ipc",
                Fault::Unavailable,
                format!("the sidecar stopped waiting for MoE layer {layer}"),
            ),
            CODE_NOT_COMPUTED => Error::link(
                "ipc",
                Fault::NotResident,
                format!(
                    "MoE layer {layer}: picks this GPU leaves cold were not computed by the sidecar (the maps disagree)"
                ),
            ),
            CODE_EPOCH => Error::EpochMismatch {
                got: s.epoch,
                serves: "another map (the sidecar's)".into(),
            },
            CODE_FAILED => Error::link(
                "ipc",
                Fault::Internal,
                format!("the sidecar failed MoE layer {layer} (its log says how)"),
            ),
            c => Error::link(
                "ipc",
                Fault::Internal,
                format!("MoE layer {layer}: unknown link code {c:#x}"),
            ),
        };
        // a late reply may still land in the box: nothing more goes through this mailbox
        s.broken = Some(e.to_string());
        Err(e)
    }

    /// Rounds of each layer's exchange in the step begun last: a step of more rows than the
    /// mailbox holds exchanges them a box at a time.
    pub fn link_rounds(&self) -> usize {
        self.link
            .as_ref()
            .map_or(1, |s| self.n.div_ceil(s.ptrs.layout.cap_rows).max(1))
    }

    /// Runs one of the link's ops (see [`Op::LinkStep`]).
    pub(super) fn link_op(&mut self, op: &Op) -> Result<()> {
        let s = self
            .link
            .as_ref()
            .ok_or_else(|| Error::Internal("no ipc mailbox attached".into()))?;
        let lay = s.ptrs.layout;
        let (n, k, hs, ne) = (
            self.n,
            self.cfg.num_experts_per_tok,
            self.cfg.hidden_size,
            self.cfg.num_experts,
        );
        let nk = n * k;
        let cap = lay.cap_rows;
        // round r carries rows [r cap, min(n, (r + 1) cap))
        let part = |r: usize| {
            let first = (r * cap).min(n);
            (first, (n - first).min(cap))
        };
        match *op {
            // SAFETY: the request box is the sidecar's, opened with the layout checked at
            // attach; the meta holds the head words.
            Op::LinkStep => unsafe { s.k.post_step(&self.st, s.ptrs.req_box, s.meta.p) },
            Op::LinkPost(ml, r) => {
                let (first, rows) = part(r);
                let idx = self.idx.p + (4 * (ml * nk + first * k)) as u64;
                // SAFETY: idx holds layer ml's n*k picks, h the n normed rows; the round's
                // rows <= the box's; done is at 0 between launches.
                unsafe {
                    s.k.post(
                        &self.st,
                        &lay,
                        s.ptrs.req_box,
                        ml,
                        idx,
                        rows * k,
                        self.h.p + (4 * first * hs) as u64,
                        rows * hs,
                        s.meta.p,
                        s.done.p,
                        r,
                        self.pdl && crate::cuda_link::ipc_pdl(),
                    )
                }
            }
            Op::LinkJoin(ml, r) => {
                let (first, rows) = part(r);
                let idx = self.idx.p + (4 * (ml * nk + first * k)) as u64;
                let gu = self.tab_gu.p + (8 * ml * ne) as u64;
                // SAFETY: y holds n*k slots of H; idx the layer's picks (< E); gu the
                // layer's table of E entries; the round's slots fit the reply box.
                unsafe {
                    s.k.join(
                        &self.st,
                        &lay,
                        s.ptrs.reply_box,
                        ml,
                        s.meta.p,
                        self.y.p + (4 * first * k * hs) as u64,
                        idx,
                        gu,
                        rows * k,
                        r,
                    )
                }
            }
            _ => Err(Error::Internal(format!("{op:?} is not a link op"))),
        }
    }
}
