//! `moelane status` and `moelane refit`: what the residency actor will automate, by hand.

use std::path::Path;

use anyhow::{bail, Context, Result};
use moelane_engine::rowmap::{Rowmap, Tier};
use moelane_proto::lane::{ResidencyRequest, StatsRequest};

pub use moelane_engine::placement::Counts;

pub async fn status(primary: &str, counts_out: Option<&Path>) -> Result<()> {
    let mut c = crate::client::primary(primary).await?;
    let s = c
        .stats(StatsRequest {})
        .await
        .map_err(|e| anyhow::anyhow!("stats: {}", e.message()))?
        .into_inner();
    let load = s.load.unwrap_or_default();
    println!(
        "model {}  map epoch {}  steps {}  tokens {}  running {}  waiting {}  KV {}/{} blocks",
        s.model,
        s.map_epoch,
        s.steps,
        s.tokens_generated,
        load.running,
        load.waiting,
        load.kv_blocks_used,
        load.kv_blocks_total
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>11}",
        "layer", "hot", "cold", "cold %", "wait share"
    );
    let wall = s.step_ns.max(1) as f64;
    let (mut th, mut tc, mut tw) = (0u64, 0u64, 0u64);
    for (l, ls) in s.layers.iter().enumerate() {
        let all = (ls.hot_picks + ls.cold_picks).max(1) as f64;
        println!(
            "{:>5} {:>10} {:>10} {:>9.2}% {:>10.2}%",
            l,
            ls.hot_picks,
            ls.cold_picks,
            100.0 * ls.cold_picks as f64 / all,
            100.0 * ls.wait_ns as f64 / wall
        );
        th += ls.hot_picks;
        tc += ls.cold_picks;
        tw += ls.wait_ns;
    }
    let wait_share = tw as f64 / wall;
    println!("total cold share {:.2}%, wait share of step time {:.2}%, ceiling of a perfect swapper {:.3}x", 100.0 * tc as f64 / (th + tc).max(1) as f64, 100.0 * wait_share, 1.0 / (1.0 - wait_share.min(0.999)));
    println!(
        "longest step {:.2} ms, mean step {:.2} ms",
        s.max_step_ns as f64 / 1e6,
        s.step_ns as f64 / 1e6 / s.steps.max(1) as f64
    );
    match c.residency(ResidencyRequest {}).await {
        Ok(r) => {
            let r = r.into_inner();
            let mode = match (r.adaptive, r.dry_run) {
                (true, true) => "adaptive (dry run)",
                (true, false) => "adaptive",
                _ => "manual",
            };
            println!(
                "residency {mode}: swaps done {}, aborted {}",
                r.swaps_done, r.swaps_aborted
            );
            let show = r.ledger.len().saturating_sub(10);
            if !r.ledger.is_empty() {
                println!(
                    "{:>7} {:>6} {:>9} {:>11} {:>11} {:>11} {:>10} {:>10}",
                    "epoch",
                    "moves",
                    "committed",
                    "cold before",
                    "predicted",
                    "realised",
                    "wait bef.",
                    "wait real."
                );
            }
            let pct = |x: f64| {
                if x < 0.0 {
                    "-".to_string()
                } else {
                    format!("{:.2}%", 100.0 * x)
                }
            };
            for e in &r.ledger[show..] {
                println!(
                    "{:>7} {:>6} {:>9} {:>11} {:>11} {:>11} {:>10} {:>10}",
                    e.epoch,
                    e.moves,
                    e.committed,
                    pct(e.cold_share_before),
                    pct(e.cold_share_predicted),
                    pct(e.cold_share_realised),
                    pct(e.wait_share_before),
                    pct(e.wait_share_realised)
                );
            }
        }
        Err(e) => println!("residency: {}", e.message()),
    }
    if let Some(p) = counts_out {
        let counts = Counts {
            version: 1,
            model: s.model.clone(),
            map_epoch: s.map_epoch,
            layers: s.layers.iter().map(|l| l.expert_picks.clone()).collect(),
        };
        std::fs::write(p, serde_json::to_vec(&counts)?)
            .with_context(|| format!("writing {}", p.display()))?;
        println!("counts written to {}", p.display());
    }
    Ok(())
}

pub fn refit(counts: &Path, map: &Path, hot: usize, out: &Path) -> Result<()> {
    let counts: Counts = serde_json::from_slice(
        &std::fs::read(counts).with_context(|| format!("reading {}", counts.display()))?,
    )
    .with_context(|| format!("{}: not a counts file", counts.display()))?;
    let old = Rowmap::read(map)?;
    if counts.model != old.model {
        bail!(
            "counts are for model {:?}, the map is for {:?}",
            counts.model,
            old.model
        );
    }
    let experts = old
        .layers
        .first()
        .map(|l| l.hot.len() + l.cold.len())
        .unwrap_or(0);
    let layers = old.layers.len();
    let old = old.validate(&counts.model, layers, experts, None)?;
    let new = old.refit(&counts.layers, hot)?;
    let newv = new
        .clone()
        .validate(&counts.model, layers, experts, Some(hot))?;
    println!(
        "{:>5} {:>8} {:>8} {:>12} {:>12}",
        "layer", "to hot", "to cold", "cold before", "cold after"
    );
    let (mut up, mut down) = (0, 0);
    for l in 0..layers {
        let u = (0..experts)
            .filter(|&e| old.tier(l, e) == Tier::Cold && newv.tier(l, e) == Tier::Hot)
            .count();
        let d = (0..experts)
            .filter(|&e| old.tier(l, e) == Tier::Hot && newv.tier(l, e) == Tier::Cold)
            .count();
        let one = std::slice::from_ref(&counts.layers[l]);
        let before = single_layer_share(&old, l, one);
        let after = single_layer_share(&newv, l, one);
        println!(
            "{:>5} {:>8} {:>8} {:>11.2}% {:>11.2}%",
            l,
            u,
            d,
            100.0 * before,
            100.0 * after
        );
        up += u;
        down += d;
    }
    println!("total: {up} experts to hot, {down} to cold; cold share {:.2}% -> {:.2}% of the counted picks; epoch {} -> {}", 100.0 * old.cold_share(&counts.layers), 100.0 * newv.cold_share(&counts.layers), old.epoch(), newv.epoch());
    new.write_atomic(out)?;
    println!("wrote {}", out.display());
    Ok(())
}

fn single_layer_share(m: &moelane_engine::rowmap::ValidMap, l: usize, c: &[Vec<u64>]) -> f64 {
    let (cold, all) = m.layer_cold_picks(l, &c[0]);
    cold as f64 / all.max(1) as f64
}

/// Parses LAYER:EXPERT:hot|cold.
pub fn parse_move(s: &str) -> Result<moelane_proto::lane::Move> {
    let parts: Vec<&str> = s.split(':').collect();
    let [l, e, t] = parts.as_slice() else {
        bail!("--move {s:?}: expected LAYER:EXPERT:hot|cold")
    };
    let layer = l
        .parse()
        .with_context(|| format!("--move {s:?}: bad layer"))?;
    let expert = e
        .parse()
        .with_context(|| format!("--move {s:?}: bad expert"))?;
    let to_hot = match *t {
        "hot" => true,
        "cold" => false,
        other => bail!("--move {s:?}: tier {other:?} is not hot or cold"),
    };
    Ok(moelane_proto::lane::Move {
        layer,
        expert,
        to_hot,
    })
}

pub async fn swap(primary: &str, moves: &[String]) -> Result<()> {
    let moves = moves
        .iter()
        .map(|m| parse_move(m))
        .collect::<Result<Vec<_>>>()?;
    let mut c = crate::client::primary(primary).await?;
    let r = c
        .swap(moelane_proto::lane::SwapRequest { moves })
        .await
        .map_err(|e| anyhow::anyhow!("swap: {}", e.message()))?
        .into_inner();
    if r.committed {
        println!(
            "committed: map epoch {} (prepare {:.1} ms, total {:.1} ms)",
            r.map_epoch,
            r.prepare_ns as f64 / 1e6,
            r.total_ns as f64 / 1e6
        );
        Ok(())
    } else {
        bail!(
            "aborted, still on epoch {}: {}",
            r.map_epoch,
            r.abort_reason
        )
    }
}

/// `moelane map init`: the first map of a checkpoint from a budget, written atomically,
/// with each layer's share of the counted picks its hot experts take.
pub fn map_init(
    model: &Path,
    spec: &crate::roles::PlacementSpec,
    kv_tokens: usize,
    kv_dtype: moelane_engine::kv::KvDtype,
    spare_slots: usize,
    gpu: bool,
    out: &Path,
) -> Result<()> {
    let plan = crate::roles::plan_map(model, spec, kv_tokens, kv_dtype, spare_slots, gpu)?;
    let ckpt = moelane_engine::checkpoint::Checkpoint::open(model)?;
    let c = &ckpt.config;
    let layers = plan.map.layers.len();
    let valid = plan
        .map
        .clone()
        .validate(&ckpt.id, layers, c.num_experts, None)?;
    valid.map.write_atomic(out)?;
    println!(
        "{:>5} {:>5} {:>6} {:>22}",
        "layer", "hot", "cold", "hot share of picks"
    );
    for (l, lm) in valid.map.layers.iter().enumerate() {
        let row = &plan.counts[l];
        let all = row.iter().sum::<u64>().max(1) as f64;
        let hot: u64 = lm.hot.iter().map(|&e| row[e as usize]).sum();
        println!(
            "{:>5} {:>5} {:>6} {:>21.2}%",
            l,
            lm.hot.len(),
            lm.cold.len(),
            100.0 * hot as f64 / all
        );
    }
    println!("map (epoch 0) written to {}", out.display());
    Ok(())
}
