//! Token sampling: greedy, and seeded temperature / top-p (nucleus, Holtzman et al. 2019).

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
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
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
            u: self.rng.uniform_f64(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let pick = self.next_pick();
        pick_token(logits, pick, &mut self.scratch)
    }
}

/// The token `pick` takes from `logits`: the argmax (ties to the lower id) when greedy;
/// else probabilities exp((l - max) / t), the most probable tokens (ties by id) until their
/// share reaches top_p, and the token where their running mass, in that order, reaches u
/// times their total.
pub fn pick_token(logits: &[f32], pick: TokenPick, scratch: &mut Vec<(f32, u32)>) -> u32 {
    let TokenPick::Sample {
        temperature: t,
        top_p,
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
    scratch.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
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
    fn greedy_and_seeded_sampling() {
        let logits = vec![0.1, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits), 1);
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                seed,
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
        });
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }
}
