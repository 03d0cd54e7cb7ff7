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

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.params.temperature;
        if t.is_nan() || t <= 0.0 || !t.is_finite() {
            return argmax(logits) as u32;
        }
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.scratch.clear();
        let mut sum = 0f64;
        for (i, &l) in logits.iter().enumerate() {
            let p = ((l - m) / t).exp();
            if p > 0.0 {
                self.scratch.push((p, i as u32));
                sum += p as f64;
            }
        }
        if self.scratch.is_empty() || sum.is_nan() || sum <= 0.0 {
            return argmax(logits) as u32;
        }
        self.scratch
            .sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let top_p = self.params.top_p.clamp(f32::MIN_POSITIVE, 1.0) as f64;
        let mut keep = self.scratch.len();
        if top_p < 1.0 {
            let mut acc = 0f64;
            for (i, &(p, _)) in self.scratch.iter().enumerate() {
                acc += p as f64 / sum;
                if acc >= top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f64 = self.scratch[..keep].iter().map(|x| x.0 as f64).sum();
        let mut u = self.rng.uniform_f64() * kept;
        for &(p, i) in &self.scratch[..keep] {
            u -= p as f64;
            if u <= 0.0 {
                return i;
            }
        }
        self.scratch[keep - 1].1
    }
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
