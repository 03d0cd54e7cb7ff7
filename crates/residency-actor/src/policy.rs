//! Residency decisions: which experts to move, from the lane's pick counters.
//!
//! Each tick takes the counters' deltas. An expert's score is its decayed pick rate
//! (exponential, `half_life`) plus a recency term (its rate in the last tick, weighted):
//! traffic has strong temporal locality, so what was picked a second ago predicts the next
//! second better than a long average. Per layer, the best cold experts are paired with the
//! weakest hot ones; a pair moves when the cold score beats the hot one by the margin
//! (hysteresis), within the per-tick move budget, and only when the predicted saving in wait
//! over the horizon exceeds the cost of loading the expert. Nothing moves while the wait
//! share of step time is under the threshold. The ceiling of a perfect swapper is
//! `1 / (1 - wait share)`.

use std::time::Duration;

use moelane_engine::rowmap::{Tier, ValidMap};

use crate::Move;

/// Thresholds of the policy (flags of `moelane serve --adaptive`).
#[derive(Clone, Debug)]
pub struct Policy {
    /// Decay half-life of the pick rates.
    pub half_life: Duration,
    /// Weight of the last tick's rate in the score.
    pub recency: f64,
    /// A cold expert must beat a hot one by this factor...
    pub margin: f64,
    /// ...and by at least this many picks per second.
    pub min_gain: f64,
    /// Most moves (pairs) per layer per tick.
    pub moves_per_layer: usize,
    /// Most moves per tick over all layers.
    pub moves_per_tick: usize,
    /// Do nothing while the wait share of step time is below this.
    pub min_wait_share: f64,
    /// Bytes per second of expert loading assumed when costing a move.
    pub load_bytes_per_s: f64,
    /// Bytes of one expert.
    pub expert_bytes: f64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            half_life: Duration::from_secs(10),
            recency: 1.0,
            margin: 0.25,
            min_gain: 1.0,
            moves_per_layer: 4,
            moves_per_tick: 32,
            min_wait_share: 0.0,
            load_bytes_per_s: 1e9,
            expert_bytes: 0.0,
        }
    }
}

/// Counters as sampled from the primary.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sample {
    /// `picks[layer][expert]`, cumulative.
    pub picks: Vec<Vec<u64>>,
    /// Wait ns per layer, cumulative.
    pub wait_ns: Vec<u64>,
    /// Step ns, cumulative.
    pub step_ns: u64,
}

/// The policy's memory between ticks.
#[derive(Default, Debug)]
pub struct Scores {
    last: Option<Sample>,
    /// decayed picks per second
    rate: Vec<Vec<f64>>,
    /// last tick's picks per second
    recent: Vec<Vec<f64>>,
    pub last_wait_share: f64,
    pub last_cold_share: f64,
    /// seconds waited on the sidecar in the last tick
    pub last_wait_s: f64,
}

/// What one tick decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub moves: Vec<Move>,
    /// cold share of the last tick's picks under the current map
    pub cold_share: f64,
    /// predicted cold share of the same picks after the moves
    pub predicted_cold_share: f64,
    pub wait_share: f64,
    /// why nothing moved, when nothing did
    pub skipped: Option<String>,
}

impl Scores {
    /// The decayed picks per second, `[layer][expert]` (empty before the first sample).
    pub fn rates(&self) -> &[Vec<f64>] {
        &self.rate
    }

    /// Starts from rates learnt before (a previous process's, carried over a restart); the
    /// first sample keeps them when its shape matches.
    pub fn seed(&mut self, rate: Vec<Vec<f64>>) {
        self.recent = rate.iter().map(|l| vec![0.0; l.len()]).collect();
        self.rate = rate;
    }

    /// Folds a new sample in; `None` on the first sample (nothing to compare yet).
    pub fn update(&mut self, s: Sample, dt: Duration, p: &Policy) -> Option<Vec<Vec<u64>>> {
        let Some(last) = self.last.replace(s.clone()) else {
            let shape = |r: &[Vec<f64>]| r.iter().map(|l| l.len()).collect::<Vec<_>>();
            let want: Vec<usize> = s.picks.iter().map(|l| l.len()).collect();
            if shape(&self.rate) != want {
                self.rate = s.picks.iter().map(|l| vec![0.0; l.len()]).collect();
            }
            self.recent = s.picks.iter().map(|l| vec![0.0; l.len()]).collect();
            return None;
        };
        let secs = dt.as_secs_f64().max(1e-3);
        let decay = 0.5f64.powf(secs / p.half_life.as_secs_f64().max(1e-3));
        let delta: Vec<Vec<u64>> = s
            .picks
            .iter()
            .zip(&last.picks)
            .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x.saturating_sub(*y)).collect())
            .collect();
        for (l, d) in delta.iter().enumerate() {
            for (e, &n) in d.iter().enumerate() {
                let r = n as f64 / secs;
                self.rate[l][e] = self.rate[l][e] * decay + r * (1.0 - decay);
                self.recent[l][e] = r;
            }
        }
        let wait: u64 = s
            .wait_ns
            .iter()
            .zip(&last.wait_ns)
            .map(|(a, b)| a.saturating_sub(*b))
            .sum();
        let step = s.step_ns.saturating_sub(last.step_ns);
        self.last_wait_share = if step > 0 {
            wait as f64 / step as f64
        } else {
            0.0
        };
        self.last_wait_s = wait as f64 / 1e9;
        Some(delta)
    }

    fn score(&self, l: usize, e: usize, p: &Policy) -> f64 {
        self.rate[l][e] + p.recency * self.recent[l][e]
    }

    /// Decides the moves of this tick.
    pub fn decide(&mut self, map: &ValidMap, delta: &[Vec<u64>], p: &Policy) -> Decision {
        let cold_share = map.cold_share(delta);
        self.last_cold_share = cold_share;
        let wait_share = self.last_wait_share;
        let mut d = Decision {
            moves: vec![],
            cold_share,
            predicted_cold_share: cold_share,
            wait_share,
            skipped: None,
        };
        let total: u64 = delta.iter().flatten().sum();
        if total == 0 {
            d.skipped = Some("no traffic".into());
            return d;
        }
        if wait_share < p.min_wait_share {
            d.skipped = Some(format!(
                "wait share {:.2}% is under the threshold {:.2}%",
                100.0 * wait_share,
                100.0 * p.min_wait_share
            ));
            return d;
        }
        let cold_picks: u64 = (0..map.layers())
            .map(|l| {
                (0..map.experts())
                    .filter(|&e| map.tier(l, e) == Tier::Cold)
                    .map(|e| delta[l][e])
                    .sum::<u64>()
            })
            .sum();
        // seconds of waiting each cold pick cost in the last tick
        let wait_per_cold_pick_s = if cold_picks > 0 {
            self.last_wait_s / cold_picks as f64
        } else {
            0.0
        };
        let cost_s = p.expert_bytes / p.load_bytes_per_s.max(1.0);
        let mut moved_picks: i64 = 0;
        for (l, dl) in delta.iter().enumerate().take(map.layers()) {
            let mut cold: Vec<(f64, usize)> = (0..map.experts())
                .filter(|&e| map.tier(l, e) == Tier::Cold)
                .map(|e| (self.score(l, e, p), e))
                .collect();
            let mut hot: Vec<(f64, usize)> = (0..map.experts())
                .filter(|&e| map.tier(l, e) == Tier::Hot)
                .map(|e| (self.score(l, e, p), e))
                .collect();
            cold.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            hot.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for (&(cs, ce), &(hs, he)) in cold.iter().zip(hot.iter()).take(p.moves_per_layer) {
                if d.moves.len() / 2 >= p.moves_per_tick {
                    break;
                }
                let gain = cs - hs;
                if cs <= hs * (1.0 + p.margin) || gain < p.min_gain {
                    break;
                }
                // predicted wait saved over one half-life (picks/s x s/pick x s) must exceed
                // the time the load costs
                let saving_s = gain * wait_per_cold_pick_s * p.half_life.as_secs_f64();
                if saving_s < cost_s {
                    break;
                }
                d.moves.push(Move {
                    layer: l,
                    expert: ce,
                    to: Tier::Hot,
                });
                d.moves.push(Move {
                    layer: l,
                    expert: he,
                    to: Tier::Cold,
                });
                moved_picks += dl[ce] as i64 - dl[he] as i64;
            }
        }
        if d.moves.is_empty() {
            d.skipped = Some("no cold expert beats a hot one by the margin".into());
        }
        let cold_after = cold_picks as i64 - moved_picks;
        d.predicted_cold_share = cold_after.max(0) as f64 / total.max(1) as f64;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moelane_engine::rowmap::{LayerMap, Rowmap};

    fn map() -> ValidMap {
        Rowmap {
            version: 1,
            model: "m".into(),
            epoch: 0,
            layers: vec![LayerMap {
                hot: (0..6).collect(),
                cold: (6..10).collect(),
            }],
        }
        .validate("m", 1, 10, None)
        .unwrap()
    }

    fn sample(picks: Vec<u64>, wait: u64, step: u64) -> Sample {
        Sample {
            picks: vec![picks],
            wait_ns: vec![wait],
            step_ns: step,
        }
    }

    #[test]
    fn moves_hot_cold_experts_in_and_respects_margin_and_threshold() {
        let p = Policy {
            min_wait_share: 0.05,
            ..Default::default()
        };
        let mut s = Scores::default();
        let m = map();
        assert!(s
            .update(sample(vec![0; 10], 0, 0), Duration::from_secs(1), &p)
            .is_none());
        // traffic moves to experts 8 and 9 (cold); 0 and 1 go quiet; waits are 20% of steps
        let d = s
            .update(
                sample(vec![0, 0, 50, 50, 50, 50, 0, 0, 100, 90], 200, 1000),
                Duration::from_secs(1),
                &p,
            )
            .unwrap();
        let dec = s.decide(&m, &d, &p);
        assert_eq!(dec.moves.len(), 4, "{dec:?}");
        assert!(dec.moves.contains(&Move {
            layer: 0,
            expert: 8,
            to: Tier::Hot
        }));
        assert!(dec.moves.contains(&Move {
            layer: 0,
            expert: 9,
            to: Tier::Hot
        }));
        assert!(dec.predicted_cold_share < dec.cold_share);
        // below the wait-share threshold nothing moves
        let d = s
            .update(
                sample(vec![0, 0, 100, 100, 100, 100, 0, 0, 200, 180], 201, 2000),
                Duration::from_secs(1),
                &p,
            )
            .unwrap();
        let dec = s.decide(&m, &d, &p);
        assert!(dec.moves.is_empty() && dec.skipped.unwrap().contains("threshold"));
        // equal scores never swap (hysteresis)
        let mut s = Scores::default();
        s.update(sample(vec![0; 10], 0, 0), Duration::from_secs(1), &p);
        let d = s
            .update(sample(vec![10; 10], 500, 1000), Duration::from_secs(1), &p)
            .unwrap();
        assert!(s.decide(&m, &d, &p).moves.is_empty());
    }
}
