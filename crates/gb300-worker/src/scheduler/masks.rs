//! The grammars' token masks, made on worker threads while the step that yields the logits
//! runs: a constrained request's next mask depends only on the tokens it has already
//! followed, so it is off the step loop's critical path (the loop then only applies it and
//! follows the picked token). A constraint travels to a worker and back with its mask
//! (moving a constraint moves a box).
//!
//! Two workers: a request whose last mask took longer than [`SLOW`] has its masks made on
//! the slow one. The step waits for the fast worker's masks (microseconds to a few
//! milliseconds: a token's worth of a JSON schema); a row whose mask is on the slow worker
//! and not ready when the step ends sits out the next steps, its logits held, until the mask
//! comes (the scheduler). A grammar whose masks are costly (a regex of 100,000 repetitions:
//! tens of milliseconds a mask) then slows its own request only. A panic in the grammar
//! engine is caught on the worker and ends that request with an error.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use moelane_text::grammar::{Constraint, Mask};

/// A mask that took longer than this (seconds) sends its request's next ones to the slow
/// worker; one at most this sends them back.
pub(super) const SLOW: f64 = 0.004;

/// A request's constraint, out to have its next mask made (the key names the request).
type Job = (u64, Constraint);

/// A mask made: the request's key, its constraint back, the mask, the seconds it took.
pub(super) struct Done {
    pub key: u64,
    pub constraint: Constraint,
    pub mask: Result<Mask, String>,
    pub secs: f64,
}

/// One worker thread and its queue.
struct Worker {
    jobs: Sender<Job>,
    thread: JoinHandle<()>,
}

/// The two workers (fast, slow), started on first use (`MOELANE_MASK_WORKER=0`: none, the
/// step loop makes the masks itself after the step, for comparison).
pub(super) struct MaskWorker {
    workers: [Option<Worker>; 2],
    tx: Sender<Done>,
    rx: Receiver<Done>,
    off: bool,
}

impl Default for MaskWorker {
    fn default() -> Self {
        let (tx, rx) = channel();
        MaskWorker {
            workers: [None, None],
            tx,
            rx,
            off: std::env::var("MOELANE_MASK_WORKER").is_ok_and(|v| v == "0"),
        }
    }
}

impl MaskWorker {
    /// Worker `w` (0 fast, 1 slow), started if it is not running.
    fn worker(&mut self, w: usize) -> Option<&Worker> {
        if self.workers[w]
            .as_ref()
            .is_none_or(|k| k.thread.is_finished())
        {
            let (jobs, rx) = channel::<Job>();
            let tx = self.tx.clone();
            let thread = std::thread::Builder::new()
                .name(["moelane-masks", "moelane-masks-slow"][w].into())
                .spawn(move || {
                    while let Ok((key, mut c)) = rx.recv() {
                        let t0 = Instant::now();
                        let mask =
                            catch_unwind(AssertUnwindSafe(|| c.next_mask())).unwrap_or_else(|_| {
                                Err("the grammar engine failed making a mask".to_string())
                            });
                        let secs = t0.elapsed().as_secs_f64();
                        let done = Done {
                            key,
                            constraint: c,
                            mask,
                            secs,
                        };
                        if tx.send(done).is_err() {
                            return;
                        }
                    }
                })
                .ok()?;
            self.workers[w] = Some(Worker { jobs, thread });
        }
        self.workers[w].as_ref()
    }

    /// Sends `c` out to have its next mask made, on the slow worker when `slow`; gives it
    /// back where no worker runs (then the loop makes the mask itself).
    pub(super) fn send(&mut self, key: u64, c: Constraint, slow: bool) -> Result<(), Constraint> {
        if self.off {
            return Err(c);
        }
        let w = slow as usize;
        match self.worker(w) {
            Some(k) => k.jobs.send((key, c)).map_err(|back| {
                self.workers[w] = None;
                back.0 .1
            }),
            None => Err(c),
        }
    }

    /// Whether the worker (`slow` or the fast one) runs, or has not been needed yet.
    pub(super) fn alive(&self, slow: bool) -> bool {
        self.workers[slow as usize]
            .as_ref()
            .is_none_or(|k| !k.thread.is_finished())
    }

    /// The masks made so far, without waiting.
    pub(super) fn ready(&self) -> Vec<Done> {
        self.rx.try_iter().collect()
    }

    /// Waits at most `limit` for the next mask made.
    pub(super) fn wait(&self, limit: Duration) -> Option<Done> {
        self.rx.recv_timeout(limit).ok()
    }
}
