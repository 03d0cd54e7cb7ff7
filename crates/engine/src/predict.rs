//! A diagnostic (`MOELANE_PREDICT_PICKS=1`, the CPU backend): how often an MoE layer's picks
//! could be known before its router runs, the material of a speculative expert prefetch (on
//! the GPU at batch 1 the experts' bytes could then move while the small kernels before the
//! router run, with HBM otherwise idle: docs/PERFORMANCE.md). Two guesses of each row's k
//! picks, each scored as the share of the picks it names (any order):
//! - `pre-attention`: the layer's own router on the hidden state before the layer's
//!   attention (normed with the layer's post-attention norm), known one attention block
//!   ahead;
//! - `previous step`: the same layer's picks for the same sequence one step earlier, known
//!   a whole step ahead.
//!
//! Off, nothing is computed; on, the CPU step does one more router product a MoE layer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The guesses scored, in this order.
pub const GUESSES: [&str; 2] = ["pre-attention router", "previous step"];

static HITS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];
static TOTAL: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Whether `MOELANE_PREDICT_PICKS=1` (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOELANE_PREDICT_PICKS").is_ok_and(|v| v == "1"))
}

/// Counts guess `g`'s row: `guess` named `hits` of the row's `picks`.
pub fn score(g: usize, guess: &[i32], picks: &[i32]) {
    let hits = picks.iter().filter(|p| guess.contains(p)).count() as u64;
    HITS[g].fetch_add(hits, Ordering::Relaxed);
    TOTAL[g].fetch_add(picks.len() as u64, Ordering::Relaxed);
}

/// Each guess's (picks named, picks scored) so far.
pub fn counts() -> [(u64, u64); 2] {
    [0, 1].map(|g| {
        (
            HITS[g].load(Ordering::Relaxed),
            TOTAL[g].load(Ordering::Relaxed),
        )
    })
}

/// Starts the counts again.
pub fn reset() {
    for g in 0..2 {
        HITS[g].store(0, Ordering::Relaxed);
        TOTAL[g].store(0, Ordering::Relaxed);
    }
}

/// One line of the counts since the last reset, or None when nothing was scored.
pub fn summary() -> Option<String> {
    let c = counts();
    if c.iter().all(|&(_, t)| t == 0) {
        return None;
    }
    let parts: Vec<String> = GUESSES
        .iter()
        .zip(c)
        .map(|(name, (h, t))| {
            format!(
                "{name} {:.1}% ({h} of {t})",
                100.0 * h as f64 / t.max(1) as f64
            )
        })
        .collect();
    Some(format!("picks guessed ahead: {}", parts.join(", ")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_guess_scores_the_share_of_the_picks_it_names() {
        super::reset();
        super::score(0, &[3, 1, 9], &[1, 2, 3]);
        super::score(1, &[7, 8, 9], &[1, 2, 3]);
        assert_eq!(super::counts(), [(2, 3), (0, 3)]);
        let s = super::summary().unwrap();
        assert!(s.contains("pre-attention router 66.7% (2 of 3)"), "{s}");
        super::reset();
        assert_eq!(super::summary(), None);
    }
}
