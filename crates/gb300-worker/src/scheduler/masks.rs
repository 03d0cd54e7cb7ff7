//! The grammars' token masks, computed on a worker thread while the step that yields the
//! logits runs: a constrained request's next mask depends only on the tokens it has already
//! followed, so it is off the step loop's critical path (the loop then only applies it and
//! follows the picked token). The constraints travel to the worker and back with their
//! masks each step (moving a constraint moves a box); a worker that fails (a panic in the
//! grammar engine) loses the constraints it held: their requests end with an error, and the
//! next step starts a new worker.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Instant;

use moelane_text::grammar::{Constraint, Mask};

/// (running index, the constraint) out; (index, the constraint, its mask, seconds taken) back.
type Job = Vec<(usize, Constraint)>;
type Done = Vec<(usize, Constraint, Result<Mask, String>, f64)>;

/// A worker thread computing masks, started on first use (`MOELANE_MASK_WORKER=0`: none, the
/// step loop makes the masks itself after the step, for comparison).
pub(super) struct MaskWorker {
    link: Option<(Sender<Job>, Receiver<Done>)>,
    off: bool,
}

impl Default for MaskWorker {
    fn default() -> Self {
        MaskWorker {
            link: None,
            off: std::env::var("MOELANE_MASK_WORKER").is_ok_and(|v| v == "0"),
        }
    }
}

/// Masks in flight for one step: [`MaskWorker::start`], then [`MaskWorker::finish`].
pub(super) struct Pending {
    /// the running indices whose constraints went out (empty: nothing was sent)
    sent: Vec<usize>,
}

impl MaskWorker {
    fn link(&mut self) -> Option<&(Sender<Job>, Receiver<Done>)> {
        if self.link.is_none() {
            let (jobs, rx) = channel::<Job>();
            let (tx, done) = channel::<Done>();
            let spawned = std::thread::Builder::new()
                .name("moelane-masks".into())
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        let out: Done = job
                            .into_iter()
                            .map(|(i, mut c)| {
                                let t0 = Instant::now();
                                let m = c.next_mask();
                                (i, c, m, t0.elapsed().as_secs_f64())
                            })
                            .collect();
                        if tx.send(out).is_err() {
                            return;
                        }
                    }
                });
            if spawned.is_ok() {
                self.link = Some((jobs, done));
            }
        }
        self.link.as_ref()
    }

    /// Sends the constraints out of `constraints` (taken: `None` left in their place) to
    /// have their next masks made. Where no worker can run, they stay and nothing is sent
    /// ([`Self::finish`] then makes the masks on this thread).
    pub(super) fn start(&mut self, constraints: &mut [&mut Option<Constraint>]) -> Pending {
        if self.off {
            return Pending { sent: Vec::new() };
        }
        let job: Job = constraints
            .iter_mut()
            .enumerate()
            .filter_map(|(i, c)| c.take().map(|c| (i, c)))
            .collect();
        if job.is_empty() {
            return Pending { sent: Vec::new() };
        }

        let sent: Vec<usize> = job.iter().map(|(i, _)| *i).collect();
        match self.link() {
            Some((jobs, _)) => match jobs.send(job) {
                Ok(()) => Pending { sent },
                Err(back) => {
                    // the worker is gone: put them back, and make a new one next time
                    self.link = None;
                    for (i, c) in back.0 {
                        *constraints[i] = Some(c);
                    }
                    Pending { sent: Vec::new() }
                }
            },
            None => {
                for (i, c) in job {
                    *constraints[i] = Some(c);
                }
                Pending { sent: Vec::new() }
            }
        }
    }

    /// Waits for the masks of `p`, puts the constraints back into `constraints` and returns
    /// each one's mask (None: unconstrained) with the seconds it took. Constraints that were
    /// not sent get their masks here. A lost worker gives its requests an error (their
    /// constraints are gone).
    pub(super) fn finish(
        &mut self,
        p: Pending,
        constraints: &mut [&mut Option<Constraint>],
    ) -> Vec<Option<(Result<Mask, String>, f64)>> {
        let mut out: Vec<Option<(Result<Mask, String>, f64)>> =
            constraints.iter().map(|_| None).collect();
        if !p.sent.is_empty() {
            match self.link.as_ref().map(|(_, done)| done.recv()) {
                Some(Ok(done)) => {
                    for (i, c, m, secs) in done {
                        if let (Some(slot), Some(o)) = (constraints.get_mut(i), out.get_mut(i)) {
                            **slot = Some(c);
                            *o = Some((m, secs));
                        }
                    }
                }
                _ => {
                    self.link = None;
                    for &i in &p.sent {
                        if let Some(o) = out.get_mut(i) {
                            *o = Some((
                                Err("the grammar worker failed; the grammar's state is lost"
                                    .to_string()),
                                0.0,
                            ));
                        }
                    }
                }
            }
        }
        for (c, o) in constraints.iter_mut().zip(out.iter_mut()) {
            if let (Some(c), None) = (c.as_mut(), o.as_ref()) {
                let t0 = Instant::now();
                let m = c.next_mask();
                *o = Some((m, t0.elapsed().as_secs_f64()));
            }
        }
        out
    }
}
