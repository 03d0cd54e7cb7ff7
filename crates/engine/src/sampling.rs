//! Token sampling: greedy, and seeded temperature / top-k / top-p (nucleus, Holtzman et al.
//! 2019), top-k before top-p as transformers and vLLM apply them.

use crate::rng::Rng;

/// Index of the largest logit; ties go to the lowest index.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best
}

/// Sampling parameters of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 disables nucleus filtering.
    pub top_p: f32,
    /// Only the k most probable tokens are drawn from; 0 disables it.
    pub top_k: u32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// How one row of a step picks its token: greedy, or a draw with a temperature, a nucleus
/// and the request's next uniform number `u` in [0, 1). The same rule runs on the host
/// ([`pick_token`]) and on the GPU (`sample_rows` in kernels/sampling.cu).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TokenPick {
    Greedy,
    Sample {
        temperature: f32,
        top_p: f32,
        /// 0: off.
        top_k: u32,
        u: f64,
    },
}

/// A per-request sampler: deterministic from its seed.
pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    /// What this request's next token takes: greedy, or a draw (which advances its stream
    /// by one number, whatever the logits turn out to be).
    pub fn next_pick(&mut self) -> TokenPick {
        let t = self.params.temperature;
        if t.is_nan() || t <= 0.0 || !t.is_finite() {
            return TokenPick::Greedy;
        }
        TokenPick::Sample {
            temperature: t,
            top_p: self.params.top_p,
            top_k: self.params.top_k,
            u: self.rng.uniform_f64(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let pick = self.next_pick();
        pick_token(logits, pick, &mut self.scratch)
    }
}

/// What a request asks of its logits beyond the draw: OpenAI's presence and frequency
/// penalties (over the tokens it generated so far), a bias per token id, and the
/// log-probabilities of the picked token and of the `top_logprobs` most likely ones.
/// A request that asks none of these keeps its logits where they are computed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitRules {
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// (token id, added to its logit); ids inside the vocabulary, checked by the caller.
    pub logit_bias: Vec<(u32, f32)>,
    /// `Some(k)`: the picked token's log-probability and the k most likely tokens'.
    pub logprobs: Option<u32>,
}

impl LogitRules {
    /// Whether the logits must come to the host for this request.
    pub fn on_host(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.logprobs.is_some()
    }

    /// Applies the bias, then the penalties: `l -= frequency * count + presence` for every
    /// token generated `count > 0` times (`counts` as (id, count)).
    pub fn apply(&self, logits: &mut [f32], counts: &[(u32, u32)]) {
        for &(t, b) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if self.presence_penalty == 0.0 && self.frequency_penalty == 0.0 {
            return;
        }
        for &(t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.frequency_penalty * c as f32 + self.presence_penalty;
            }
        }
    }
}

/// The picked token's log-probability under `logits` (log-softmax, in f64) and the `k`
/// most likely tokens' (ties by id), most likely first.
pub fn logprobs(logits: &[f32], picked: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !m.is_finite() {
        return (f32::NEG_INFINITY, Vec::new());
    }
    let sum: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    let lse = m + sum.ln();
    let lp = |t: u32| {
        logits
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32)
    };
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            let worse = |x: &(u32, f32)| l > x.1 || (l == x.1 && (i as u32) < x.0);
            if top.len() < k || top.last().is_some_and(worse) {
                let at = top.iter().position(worse).unwrap_or(top.len());
                top.insert(at, (i as u32, l));
                top.truncate(k);
            }
        }
    }
    for x in &mut top {
        x.1 = lp(x.0);
    }
    (lp(picked), top)
}

/// The token `pick` takes from `logits`: the argmax (ties to the lower id) when greedy;
/// else probabilities exp((l - max) / t), the top_k most probable (ties by id; all when 0),
/// of those the most probable until their share of the kept ones reaches top_p, and the token
/// where their running mass, in that order, reaches u times their total.
pub fn pick_token(logits: &[f32], pick: TokenPick, scratch: &mut Vec<(f32, u32)>) -> u32 {
    let TokenPick::Sample {
        temperature: t,
        top_p,
        top_k,
        u,
    } = pick
    else {
        return argmax(logits) as u32;
    };
    if t.is_nan() || t <= 0.0 || !t.is_finite() {
        return argmax(logits) as u32;
    }
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    scratch.clear();
    let mut sum = 0f64;
    for (i, &l) in logits.iter().enumerate() {
        let p = ((l - m) / t).exp();
        if p > 0.0 {
            scratch.push((p, i as u32));
            sum += p as f64;
        }
    }
    if scratch.is_empty() || sum.is_nan() || sum <= 0.0 {
        return argmax(logits) as u32;
    }
    let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let cut = top_k > 0 && (top_k as usize) < scratch.len();
    if cut {
        // the k first in that (total) order, found without sorting the vocabulary: the same
        // k tokens a sort would keep
        scratch.select_nth_unstable_by(top_k as usize - 1, order);
        scratch.truncate(top_k as usize);
    }
    scratch.sort_by(order);
    if cut {
        sum = scratch.iter().map(|x| x.0 as f64).sum();
    }
    let top_p = top_p.clamp(f32::MIN_POSITIVE, 1.0) as f64;
    let mut keep = scratch.len();
    if top_p < 1.0 {
        let mut acc = 0f64;
        for (i, &(p, _)) in scratch.iter().enumerate() {
            acc += p as f64 / sum;
            if acc >= top_p {
                keep = i + 1;
                break;
            }
        }
    }
    let kept: f64 = scratch[..keep].iter().map(|x| x.0 as f64).sum();
    let mut u = u * kept;
    for &(p, i) in &scratch[..keep] {
        u -= p as f64;
        if u <= 0.0 {
            return i;
        }
    }
    scratch[keep - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_and_top_k_is_ordered() {
        let l = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let (lp, top) = logprobs(&l, 2, 3);
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        let total: f64 = (0..5).map(|t| (logprobs(&l, t, 0).0 as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(logprobs(&l, 9, 0).0.is_infinite(), "an id outside the row");
    }

    #[test]
    fn bias_and_penalties_move_the_right_logits() {
        let rules = LogitRules {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(0, 10.0), (99, 1.0)],
            logprobs: None,
        };
        assert!(rules.on_host());
        assert!(!LogitRules::default().on_host());
        let mut l = vec![0.0f32; 4];
        rules.apply(&mut l, &[(1, 4), (3, 1)]);
        assert_eq!(l, vec![10.0, -1.5, 0.0, -0.75]);
    }

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = vec![0.1, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits), 1);
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                seed,
                ..Default::default()
            });
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        let d = draw(5);
        assert!(d.contains(&1) && d.contains(&2) && d.contains(&0));
        // top_p small keeps only the best token
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.1,
            seed: 1,
            ..Default::default()
        });
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn top_k_draws_among_the_k_most_probable_then_top_p_among_those() {
        let logits = vec![0.1, 2.0, 1.9, -3.0, 1.0];
        let draw = |top_k, top_p| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_p,
                top_k,
                seed: 9,
            });
            (0..400).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let two = draw(2, 1.0);
        assert!(two.contains(&1) && two.contains(&2), "{two:?}");
        assert!(two.iter().all(|&t| t == 1 || t == 2), "only the two best");
        assert!(draw(1, 1.0).iter().all(|&t| t == 1), "k = 1 is greedy");
        // k at or past the vocabulary is off: the same draws, bit for bit
        assert_eq!(draw(5, 1.0), draw(0, 1.0));
        assert_eq!(draw(99, 0.9), draw(0, 0.9));
        // top_p applies to the k kept, renormalised: of {1, 2, 4} token 1 holds 0.44 and
        // 1 and 2 together 0.84, so 0.5 keeps two; over all five (1 and 2: 0.78 of it),
        // 0.8 would keep three
        let p = draw(3, 0.5);
        assert!(
            p.iter().all(|&t| t == 1 || t == 2) && p.contains(&2),
            "{p:?}"
        );
        let kept3 = draw(3, 0.8);
        assert!(kept3.iter().all(|&t| t == 1 || t == 2), "{kept3:?}");
        assert!(draw(0, 0.8).contains(&4), "without k, 0.8 reaches token 4");
        // ties go to the lower ids, as the sort orders them
        let flat = vec![0.5f32; 64];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 3,
            seed: 3,
            ..Default::default()
        });
        let d: Vec<u32> = (0..300).map(|_| s.sample(&flat)).collect();
        assert!(
            d.iter().all(|&t| t < 3) && (0..3).all(|t| d.contains(&t)),
            "{d:?}"
        );
    }
}
