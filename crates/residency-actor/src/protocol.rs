//! The epoch bookkeeping of a tier under the two-phase protocol, as pure transitions: the
//! sidecar runs exactly these functions on every control message, and the model check in
//! `tests/protocol_model.rs` explores them under loss, duplication, reordering and crashes.
//!
//! Rules that make lost, duplicated and late messages harmless:
//! - every attempt gets a fresh epoch (an aborted epoch is never reused by its coordinator),
//!   and the tier refuses to stage an epoch at or below its `floor` (the highest epoch it has
//!   seen aborted or superseded), so a PREPARE that arrives after its ABORT stages nothing;
//! - PREPARE names the committed epoch it builds on (`base`): a tier still holding an older
//!   staged map learns from `base` whether that map was committed (its RELEASE was lost: it
//!   is promoted first) or abandoned (its ABORT was lost: it is dropped);
//! - messages carry the coordinator's incarnation; a REGISTER from a restarted coordinator
//!   fences off everything its dead predecessor may still have in flight;
//! - RELEASE and ABORT are idempotent, and a repeated PREPARE of the staged epoch is a no-op.

use crate::error::SwapError;

/// What a tier knows about epochs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TierEpochs {
    /// The committed map's epoch.
    pub epoch: u64,
    /// The staged map's epoch, between PREPARE and RELEASE/ABORT.
    pub next: Option<u64>,
    /// No epoch at or below this is ever staged again.
    pub floor: u64,
    /// The coordinator incarnation whose messages this tier obeys.
    pub incarnation: u64,
}

/// What a PREPARE asks the tier to do before staging the incoming map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrepareStep {
    /// Stage it (nothing else is staged).
    Stage,
    /// The staged epoch was committed but its RELEASE never came: promote it, then stage.
    PromoteThenStage,
    /// The staged epoch was abandoned but its ABORT never came: drop it, then stage.
    DropThenStage,
    /// This epoch is staged already (a duplicate PREPARE): answer PREPARED again.
    AlreadyStaged,
}

/// What a RELEASE did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseStep {
    /// The staged map became the committed one; slots only the old one used are freed.
    Promote,
    /// Already released (a duplicate): nothing to do.
    Already,
}

/// What REGISTER (a coordinator's start or restart) does with the tier's maps, decided by
/// comparing map contents, since epochs of different incarnations may collide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterStep {
    /// The committed map is the coordinator's: drop anything staged.
    KeepCommitted,
    /// The staged map is the coordinator's (it committed, then its RELEASE was lost): promote.
    PromoteStaged,
    /// Neither: rebuild the bank for the coordinator's map.
    Reload,
}

impl TierEpochs {
    pub fn new(epoch: u64) -> Self {
        TierEpochs {
            epoch,
            next: None,
            floor: epoch,
            incarnation: 0,
        }
    }

    /// Whether a data message tagged `tag` can be served (with the map of that epoch).
    pub fn serves(&self, tag: u64) -> bool {
        tag == self.epoch || self.next == Some(tag)
    }

    /// The epochs this tier holds, for an error: "3", or "3 (and 4 staged)".
    pub fn describe(&self) -> String {
        match self.next {
            Some(n) => format!("{} (and {n} staged)", self.epoch),
            None => self.epoch.to_string(),
        }
    }

    /// The highest epoch this tier has heard of: a restarted coordinator proposes above it.
    pub fn highest(&self) -> u64 {
        self.epoch.max(self.floor).max(self.next.unwrap_or(0))
    }

    fn fenced(&self, incarnation: u64) -> Result<(), SwapError> {
        if incarnation != self.incarnation {
            return Err(SwapError::epoch(format!(
                "message from coordinator incarnation {incarnation}, but this tier obeys {}",
                self.incarnation
            )));
        }
        Ok(())
    }

    /// Decides a PREPARE of `epoch` built on committed epoch `base`. Checked when it arrives
    /// and again, under the state lock, when the loaded experts are staged: a PREPARE whose
    /// load outlived its ABORT is refused then.
    pub fn check_prepare(
        &self,
        incarnation: u64,
        base: u64,
        epoch: u64,
    ) -> Result<PrepareStep, SwapError> {
        self.fenced(incarnation)?;
        if self.next == Some(epoch) {
            return Ok(PrepareStep::AlreadyStaged);
        }
        if epoch <= base {
            return Err(SwapError::epoch(format!(
                "PREPARE of epoch {epoch} on base {base}: not newer"
            )));
        }
        if epoch <= self.floor || self.next.is_some_and(|n| epoch < n) {
            return Err(SwapError::epoch(format!(
                "PREPARE of epoch {epoch}: aborted or superseded (this tier is past {})",
                self.floor
            )));
        }
        match self.next {
            None if base == self.epoch => Ok(PrepareStep::Stage),
            Some(n) if base == n => Ok(PrepareStep::PromoteThenStage),
            Some(_) if base == self.epoch => Ok(PrepareStep::DropThenStage),
            _ => Err(SwapError::epoch(format!(
                "PREPARE builds on epoch {base}, but this tier holds {}",
                self.describe()
            ))),
        }
    }

    /// Applies a checked PREPARE: afterwards `epoch` is staged.
    pub fn apply_prepare(&mut self, step: PrepareStep, epoch: u64) {
        match step {
            PrepareStep::AlreadyStaged => return,
            PrepareStep::PromoteThenStage => {
                if let Some(n) = self.next {
                    self.epoch = n;
                }
            }
            PrepareStep::Stage | PrepareStep::DropThenStage => {}
        }
        if let Some(n) = self.next {
            self.floor = self.floor.max(n);
        }
        self.next = Some(epoch);
    }

    /// RELEASE: `epoch` (the staged one) is committed; it becomes the only map.
    pub fn release(&mut self, incarnation: u64, epoch: u64) -> Result<ReleaseStep, SwapError> {
        self.fenced(incarnation)?;
        if self.next == Some(epoch) {
            self.epoch = epoch;
            self.next = None;
            self.floor = self.floor.max(epoch);
            return Ok(ReleaseStep::Promote);
        }
        if self.epoch == epoch {
            return Ok(ReleaseStep::Already);
        }
        Err(SwapError::epoch(format!(
            "RELEASE into epoch {epoch}, but this tier holds {}",
            self.describe()
        )))
    }

    /// ABORT(epoch): drops it if staged, and it is never staged afterwards. Returns whether
    /// something was dropped.
    pub fn abort(&mut self, incarnation: u64, epoch: u64) -> Result<bool, SwapError> {
        self.fenced(incarnation)?;
        if epoch <= self.epoch {
            return Ok(false);
        }
        self.floor = self.floor.max(epoch);
        if self.next == Some(epoch) {
            self.next = None;
            return Ok(true);
        }
        Ok(false)
    }

    /// REGISTER from coordinator `incarnation` whose committed map has `epoch` (the tier has
    /// made its bank match, see [`RegisterStep`]). Everything of older incarnations is fenced
    /// off, and nothing it ever saw is staged again.
    /// Tokens only grow, and each REGISTER carries a fresh one: a REGISTER with a token not
    /// above the current one (a late copy, or from a coordinator that has since restarted or
    /// registered again) is refused.
    pub fn check_register(&self, incarnation: u64) -> Result<(), SwapError> {
        if incarnation <= self.incarnation {
            return Err(SwapError::epoch(format!(
                "REGISTER with token {incarnation}, not newer than {}: late or duplicated",
                self.incarnation
            )));
        }
        Ok(())
    }

    /// Call after [`Self::check_register`] passed.
    pub fn register(&mut self, incarnation: u64, epoch: u64) {
        let seen = self.highest();
        self.incarnation = incarnation;
        self.next = None;
        self.epoch = epoch;
        self.floor = seen.max(epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_release_is_recovered_by_the_next_prepare() {
        let mut t = TierEpochs::new(0);
        let s = t.check_prepare(0, 0, 1).unwrap();
        assert_eq!(s, PrepareStep::Stage);
        t.apply_prepare(s, 1);
        // RELEASE(1) lost; coordinator committed 1 and proposes 2 on base 1
        let s = t.check_prepare(0, 1, 2).unwrap();
        assert_eq!(s, PrepareStep::PromoteThenStage);
        t.apply_prepare(s, 2);
        assert_eq!((t.epoch, t.next), (1, Some(2)));
    }

    #[test]
    fn late_prepare_after_abort_stages_nothing() {
        let mut t = TierEpochs::new(0);
        assert!(!t.abort(0, 1).unwrap());
        assert!(t.check_prepare(0, 0, 1).is_err());
        // the next attempt uses a fresh epoch
        assert_eq!(t.check_prepare(0, 0, 2).unwrap(), PrepareStep::Stage);
    }

    #[test]
    fn duplicates_are_idempotent_and_stale_incarnations_fenced() {
        let mut t = TierEpochs::new(3);
        let s = t.check_prepare(0, 3, 4).unwrap();
        t.apply_prepare(s, 4);
        assert_eq!(
            t.check_prepare(0, 3, 4).unwrap(),
            PrepareStep::AlreadyStaged
        );
        assert_eq!(t.release(0, 4).unwrap(), ReleaseStep::Promote);
        assert_eq!(t.release(0, 4).unwrap(), ReleaseStep::Already);
        t.register(7, 4);
        assert!(t.check_prepare(0, 4, 5).is_err());
        assert!(t.abort(0, 5).is_err());
        assert_eq!(t.check_prepare(7, 4, 5).unwrap(), PrepareStep::Stage);
    }
}
