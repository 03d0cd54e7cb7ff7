//! The rowmap: which experts of each MoE layer are hot (primary) and which are cold
//! (sidecar), in slot order, tagged with the map epoch. One JSON file used by both tiers:
//! `{"version":1, "model":<checkpoint id>, "epoch":N, "layers":[{"hot":[..], "cold":[..]}]}`.
//! Validated as a whole before anything uses it: a bad map is never half-applied.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Which tier holds an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Hot,
    Cold,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Hot => "hot",
            Tier::Cold => "cold",
        }
    }
}

/// One MoE layer's split; position in each list is the slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMap {
    pub hot: Vec<u16>,
    pub cold: Vec<u16>,
}

/// The map file, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rowmap {
    pub version: u32,
    pub model: String,
    pub epoch: u64,
    pub layers: Vec<LayerMap>,
}

/// A validated map with an O(1) lookup of (tier, slot) per expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidMap {
    pub map: Rowmap,
    /// `place[layer][expert] = (tier, slot)`
    place: Vec<Vec<(Tier, u32)>>,
}

impl Rowmap {
    /// Every expert of every layer hot, slot = expert id.
    pub fn all_hot(model: &str, layers: usize, experts: usize) -> Rowmap {
        Rowmap {
            version: 1,
            model: model.into(),
            epoch: 0,
            layers: (0..layers)
                .map(|_| LayerMap {
                    hot: (0..experts as u16).collect(),
                    cold: vec![],
                })
                .collect(),
        }
    }

    /// Every expert of every layer cold, slot = expert id.
    pub fn all_cold(model: &str, layers: usize, experts: usize) -> Rowmap {
        let mut m = Rowmap::all_hot(model, layers, experts);
        for l in &mut m.layers {
            l.cold = std::mem::take(&mut l.hot);
        }
        m
    }

    /// Parses map JSON text (call `validate`).
    pub fn from_json(text: &str) -> Result<Rowmap> {
        serde_json::from_str(text).map_err(|e| Error::Rowmap(format!("invalid JSON: {e}")))
    }

    /// The map as JSON text.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| Error::Rowmap(e.to_string()))
    }

    /// Reads a map file (parse only; call `validate`).
    pub fn read(path: &Path) -> Result<Rowmap> {
        let text = moelane_text::files::read_bounded_text(path, moelane_text::files::CONFIG_LIMIT)
            .map_err(|e| Error::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.into(),
            reason: e.to_string(),
        })
    }

    /// Writes atomically: a temporary file in the same directory, fsync, rename.
    pub fn write_atomic(&self, path: &Path) -> Result<()> {
        write_json_atomic(path, self)
    }

    /// Checks the whole map against a model: version, model id, layer count, every expert
    /// exactly once, ids in range, and (when given) hot capacity per layer.
    pub fn validate(
        self,
        model: &str,
        layers: usize,
        experts: usize,
        hot_capacity: Option<usize>,
    ) -> Result<ValidMap> {
        if self.version != 1 {
            return Err(Error::Rowmap(format!(
                "version {} is not supported (expected 1)",
                self.version
            )));
        }
        if self.model != model {
            return Err(Error::Rowmap(format!(
                "map is for model {:?}, the checkpoint is {:?}",
                self.model, model
            )));
        }
        if self.layers.len() != layers {
            return Err(Error::Rowmap(format!(
                "map has {} layers, the model has {} MoE layers",
                self.layers.len(),
                layers
            )));
        }
        let mut place = Vec::with_capacity(layers);
        for (l, lm) in self.layers.iter().enumerate() {
            let mut p: Vec<Option<(Tier, u32)>> = vec![None; experts];
            for (tier, list) in [(Tier::Hot, &lm.hot), (Tier::Cold, &lm.cold)] {
                for (slot, &e) in list.iter().enumerate() {
                    let e = e as usize;
                    if e >= experts {
                        return Err(Error::Rowmap(format!(
                            "layer {l}: expert {e} does not exist (the model has {experts})"
                        )));
                    }
                    if let Some((t, _)) = p[e] {
                        return Err(Error::Rowmap(format!(
                            "layer {l}: expert {e} is listed twice ({} and {})",
                            t.name(),
                            tier.name()
                        )));
                    }
                    p[e] = Some((tier, slot as u32));
                }
            }
            if let Some(e) = p.iter().position(|x| x.is_none()) {
                return Err(Error::Rowmap(format!(
                    "layer {l}: expert {e} is in neither hot nor cold"
                )));
            }
            if let Some(cap) = hot_capacity {
                if lm.hot.len() > cap {
                    return Err(Error::Rowmap(format!(
                        "layer {l}: {} hot experts exceed the hot tier's {cap} slots",
                        lm.hot.len()
                    )));
                }
            }
            place.push(p.into_iter().flatten().collect());
        }
        Ok(ValidMap { map: self, place })
    }
}

impl ValidMap {
    pub fn tier(&self, layer: usize, expert: usize) -> Tier {
        self.place[layer][expert].0
    }
    pub fn slot(&self, layer: usize, expert: usize) -> u32 {
        self.place[layer][expert].1
    }
    pub fn epoch(&self) -> u64 {
        self.map.epoch
    }
    pub fn layers(&self) -> usize {
        self.place.len()
    }
    pub fn experts(&self) -> usize {
        self.place.first().map_or(0, |p| p.len())
    }

    /// Refit: per layer, the top `hot` experts by `counts[layer][expert]` are hot; experts
    /// that stay hot keep their slots, new ones fill the freed slots in order; ties go to the
    /// old map (an expert already hot wins a tie), then to the lower id. Epoch + 1.
    pub fn refit(&self, counts: &[Vec<u64>], hot: usize) -> Result<Rowmap> {
        if counts.len() != self.layers() {
            return Err(Error::Rowmap(format!(
                "counts have {} layers, the map has {}",
                counts.len(),
                self.layers()
            )));
        }
        let experts = self.experts();
        if hot > experts {
            return Err(Error::Rowmap(format!(
                "--hot {hot} exceeds the {experts} experts per layer"
            )));
        }
        let mut layers = Vec::with_capacity(counts.len());
        for (l, c) in counts.iter().enumerate() {
            if c.len() != experts {
                return Err(Error::Rowmap(format!(
                    "layer {l}: counts for {} experts, the map has {experts}",
                    c.len()
                )));
            }
            let old = &self.map.layers[l];
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| {
                c[b].cmp(&c[a])
                    .then_with(|| {
                        let ha = self.tier(l, a) == Tier::Hot;
                        let hb = self.tier(l, b) == Tier::Hot;
                        hb.cmp(&ha)
                    })
                    .then(a.cmp(&b))
            });
            let mut is_hot = vec![false; experts];
            for &e in &order[..hot] {
                is_hot[e] = true;
            }
            // keep slots of experts that stay hot, fill freed slots with newcomers
            let mut newcomers: Vec<u16> = order[..hot]
                .iter()
                .filter(|&&e| self.tier(l, e) != Tier::Hot)
                .map(|&e| e as u16)
                .collect();
            newcomers.reverse();
            let mut new_hot: Vec<u16> = Vec::with_capacity(hot);
            for &e in &old.hot {
                if is_hot[e as usize] {
                    new_hot.push(e);
                } else if let Some(n) = newcomers.pop() {
                    new_hot.push(n);
                }
            }
            while let Some(n) = newcomers.pop() {
                new_hot.push(n);
            }
            // cold keeps the old cold order for experts that stay, leavers append
            let mut new_cold: Vec<u16> = old
                .cold
                .iter()
                .copied()
                .filter(|&e| !is_hot[e as usize])
                .collect();
            for &e in &old.hot {
                if !is_hot[e as usize] {
                    new_cold.push(e);
                }
            }
            layers.push(LayerMap {
                hot: new_hot,
                cold: new_cold,
            });
        }
        Ok(Rowmap {
            version: 1,
            model: self.map.model.clone(),
            epoch: self.map.epoch + 1,
            layers,
        })
    }

    /// (cold, all) counted picks of one layer.
    pub fn layer_cold_picks(&self, l: usize, counts: &[u64]) -> (u64, u64) {
        let (mut cold, mut all) = (0u64, 0u64);
        for (e, &n) in counts.iter().enumerate().take(self.experts()) {
            all += n;
            if self.tier(l, e) == Tier::Cold {
                cold += n;
            }
        }
        (cold, all)
    }

    /// Fraction of the counted picks (`counts[layer][expert]`) that fall on cold experts.
    pub fn cold_share(&self, counts: &[Vec<u64>]) -> f64 {
        let (cold, all) =
            counts
                .iter()
                .enumerate()
                .take(self.layers())
                .fold((0, 0), |(c, a), (l, cl)| {
                    let (c2, a2) = self.layer_cold_picks(l, cl);
                    (c + c2, a + a2)
                });
        if all == 0 {
            0.0
        } else {
            cold as f64 / all as f64
        }
    }
}

/// Writes `value` as JSON atomically: a temporary file in the same directory, fsync, rename
/// (a reader sees the old file or the new one, never a part).
pub fn write_json_atomic<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Json {
        path: path.into(),
        reason: e.to_string(),
    })?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        path.file_name()
            .map(|s| s.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.write_all(text.as_bytes())
            .map_err(|e| Error::io(&tmp, e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn map(layers: usize, experts: usize, hot: usize, seed: u64) -> Rowmap {
        let mut r = Rng::new(seed);
        Rowmap {
            version: 1,
            model: "m".into(),
            epoch: 3,
            layers: (0..layers)
                .map(|_| {
                    let mut ids: Vec<u16> = (0..experts as u16).collect();
                    r.shuffle(&mut ids);
                    LayerMap {
                        hot: ids[..hot].to_vec(),
                        cold: ids[hot..].to_vec(),
                    }
                })
                .collect(),
        }
    }

    #[test]
    fn validation_names_layer_and_expert() {
        let ok = map(2, 8, 5, 1);
        assert!(ok.clone().validate("m", 2, 8, Some(5)).is_ok());
        let err = |m: Rowmap| m.validate("m", 2, 8, Some(6)).unwrap_err().to_string();

        let mut m = ok.clone();
        m.layers[1].cold[0] = 9;
        assert!(err(m).contains("layer 1: expert 9 does not exist"));

        let mut m = ok.clone();
        let dup = m.layers[0].hot[0];
        m.layers[0].cold[0] = dup;
        let e = err(m);
        assert!(
            e.contains("layer 0") && e.contains(&format!("expert {dup} is listed twice")),
            "{e}"
        );

        let mut m = ok.clone();
        m.layers[0].cold.pop();
        assert!(err(m).contains("layer 0: expert"));

        let mut m = ok.clone();
        m.layers.pop();
        assert!(err(m).contains("1 layers"));

        let m = ok.clone();
        assert!(m
            .validate("other", 2, 8, None)
            .unwrap_err()
            .to_string()
            .contains("model"));

        let m = ok.clone();
        assert!(m
            .validate("m", 2, 8, Some(4))
            .unwrap_err()
            .to_string()
            .contains("exceed"));

        let mut m = ok;
        m.version = 2;
        assert!(err(m).contains("version"));
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn refit_keeps_slots_and_prefers_old_map_on_ties() {
        let mut rng = Rng::new(9);
        for seed in 0..50 {
            let old = map(3, 16, 10, seed).validate("m", 3, 16, None).unwrap();
            let counts: Vec<Vec<u64>> = (0..3)
                .map(|_| (0..16).map(|_| rng.below(4) as u64).collect())
                .collect();
            let new = old.refit(&counts, 10).unwrap();
            let v = new.clone().validate("m", 3, 16, Some(10)).unwrap();
            assert_eq!(v.epoch(), 4);
            for l in 0..3 {
                // experts that stay hot keep their slot
                for (slot, &e) in old.map.layers[l].hot.iter().enumerate() {
                    if v.tier(l, e as usize) == Tier::Hot {
                        assert_eq!(v.slot(l, e as usize), slot as u32);
                    }
                }
                // every hot count >= every cold count, and on equal counts old-hot stays hot
                for h in &new.layers[l].hot {
                    for c in &new.layers[l].cold {
                        let (ch, cc) = (counts[l][*h as usize], counts[l][*c as usize]);
                        assert!(ch >= cc);
                        if ch == cc && old.tier(l, *c as usize) == Tier::Hot {
                            assert_eq!(old.tier(l, *h as usize), Tier::Hot);
                        }
                    }
                }
            }
            // the refit map leaves the least cold share possible for these counts
            assert!(v.cold_share(&counts) <= old.cold_share(&counts) + 1e-12);
        }
    }

    #[test]
    fn atomic_write_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("map.json");
        let m = map(2, 8, 4, 2);
        m.write_atomic(&p).unwrap();
        assert_eq!(Rowmap::read(&p).unwrap(), m);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
