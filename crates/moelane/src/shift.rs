//! `moelane bench shift`: the domain-shift run. An embedded lane (`moelane serve`, its own
//! process per run) is driven through four traffic phases: English, German + Japanese,
//! Korean (a language the starting map was not fitted on), then all five languages mixed;
//! with the fixed (English-fitted) map, a map refit offline on the first two phases' counts,
//! and live adaptive residency; at each number of concurrent users. The lane's counters are
//! sampled every few seconds: tokens/s, cold share of picks, wait share of step time, epoch,
//! swaps. Writes shift.json, shift.svg and a Markdown table.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moelane_engine::rowmap::Rowmap;
use moelane_engine::tokenizer::Tokenizer;
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::{GenerateRequest, ResidencyRequest, StatsReply, StatsRequest};
use serde::Serialize;

pub const PHASES: [(&str, &[&str]); 4] = [
    ("en", &["en"]),
    ("de+ja", &["de", "ja"]),
    ("ko", &["ko"]),
    ("mix", &["en", "de", "ja", "ko", "code"]),
];

pub struct ShiftOptions {
    pub model: PathBuf,
    pub users: Vec<usize>,
    pub modes: Vec<String>,
    pub phase_s: Vec<f64>,
    pub sample_s: f64,
    pub warmup_s: f64,
    pub max_tokens: usize,
    pub out: PathBuf,
    pub adaptive_args: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// seconds since the run started (end of the window)
    pub t: f64,
    pub phase: usize,
    pub tok_s: f64,
    pub cold_share: f64,
    pub wait_share: f64,
    pub epoch: u64,
    pub swaps: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PhaseSummary {
    pub phase: String,
    pub tok_s: f64,
    pub cold_share: f64,
    pub wait_share: f64,
    /// seconds from the phase's start to the end of the first window after which the cold
    /// share stays under 2% for the rest of the phase (None: it does not)
    pub under_2pct_after_s: Option<f64>,
    pub swaps: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Run {
    pub mode: String,
    pub users: usize,
    pub samples: Vec<Sample>,
    pub phases: Vec<PhaseSummary>,
    pub swaps_done: u64,
    pub swaps_aborted: u64,
    pub longest_step_ms: f64,
    pub mean_step_ms: f64,
}

pub(crate) struct Lane {
    child: Child,
    /// the primary's gRPC URL
    pub url: String,
    /// the gateway's host:port
    pub gateway: String,
}

impl Drop for Lane {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_lane(model: &Path, map: &Path, extra: &[String]) -> Result<Lane> {
    let mut a = vec!["--map".to_string(), map.display().to_string()];
    a.extend(extra.iter().cloned());
    start_serve(model, &a, &[])
}

/// Starts `moelane serve` (this binary) on `model`; waits until it listens.
pub(crate) fn start_serve(model: &Path, extra: &[String], env: &[(&str, &str)]) -> Result<Lane> {
    let exe = std::env::current_exe().context("locating the moelane binary")?;
    let mut child = Command::new(exe)
        .args(["serve", "--model"])
        .arg(model)
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting moelane serve")?;
    let out = child.stdout.take().context("lane stdout")?;
    let mut rd = BufReader::new(out);
    let mut line = String::new();
    let mut url = None;
    let gateway = loop {
        line.clear();
        if rd.read_line(&mut line)? == 0 {
            bail!("moelane serve exited before listening");
        }
        if let Some(p) = line.find("primary grpc://") {
            let addr = line[p + "primary grpc://".len()..]
                .split(',')
                .next()
                .unwrap_or_default()
                .trim()
                .to_string();
            url = Some(format!("http://{addr}"));
        }
        if let Some(p) = line.find("gateway listening on http://") {
            break line[p + "gateway listening on http://".len()..]
                .trim()
                .trim_end_matches("/v1")
                .to_string();
        }
    };
    let url = url.context("moelane serve did not print its primary's address")?;
    std::thread::spawn(move || {
        let mut l = String::new();
        while rd.read_line(&mut l).unwrap_or(0) > 0 {
            l.clear();
        }
    });
    Ok(Lane {
        child,
        url,
        gateway,
    })
}

fn totals(s: &StatsReply) -> (u64, u64, u64, u64, u64) {
    let (mut h, mut c, mut w) = (0, 0, 0);
    for l in &s.layers {
        h += l.hot_picks;
        c += l.cold_picks;
        w += l.wait_ns;
    }
    (s.tokens_generated, h, c, w, s.step_ns)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Prompt token ids per phase.
fn phase_prompts(model: &Path) -> Result<Vec<Vec<Vec<u32>>>> {
    let tok = Tokenizer::from_dir(model)?;
    PHASES
        .iter()
        .map(|(_, langs)| {
            let mut v = Vec::new();
            for l in *langs {
                let i = moelane_engine::synth::lang_index(l)
                    .with_context(|| format!("no corpus for {l}"))?;
                for p in moelane_engine::synth::prompts(i) {
                    v.push(tok.encode(&p.chars().take(60).collect::<String>())?);
                }
            }
            // interleave languages of a phase
            let n = langs.len();
            let per = v.len() / n;
            let mut out = Vec::new();
            for k in 0..per {
                for j in 0..n {
                    out.push(v[j * per + k].clone());
                }
            }
            Ok(out)
        })
        .collect()
}

async fn user(
    url: String,
    id: usize,
    prompts: std::sync::Arc<Vec<Vec<Vec<u32>>>>,
    ends: Vec<f64>,
    t0: Instant,
    max_tokens: usize,
) -> Result<()> {
    let mut c = crate::client::primary(&url).await?;
    let mut k = id * 7;
    loop {
        let t = t0.elapsed().as_secs_f64();
        let Some(phase) = ends.iter().position(|&e| t < e) else {
            return Ok(());
        };
        let ps = &prompts[phase];
        let p = ps[k % ps.len()].clone();
        k += 1;
        let mut s = c
            .generate(GenerateRequest {
                request_id: format!("shift-{id}-{k}"),
                prompt: p,
                max_tokens: max_tokens as u32,
                top_p: 1.0,
                ignore_eos: true,
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("generate: {}", e.message()))?
            .into_inner();
        while s
            .message()
            .await
            .map_err(|e| anyhow::anyhow!("generate stream: {}", e.message()))?
            .is_some()
        {}
    }
}

async fn stats(c: &mut PrimaryClient<moelane_proto::auth::AuthChannel>) -> Result<StatsReply> {
    Ok(c.stats(StatsRequest {})
        .await
        .map_err(|e| anyhow::anyhow!("stats: {}", e.message()))?
        .into_inner())
}

async fn run_one(
    o: &ShiftOptions,
    mode: &str,
    users: usize,
    map: &Path,
    prompts: std::sync::Arc<Vec<Vec<Vec<u32>>>>,
    counts_after: Option<usize>,
) -> Result<(Run, Option<Vec<Vec<u64>>>)> {
    let extra = if mode == "adaptive" {
        let mut v = vec!["--adaptive".to_string()];
        v.extend(o.adaptive_args.iter().cloned());
        v
    } else {
        vec![]
    };
    // each run starts from its own copy (the lane persists its map as it swaps)
    let run_map = o.out.join(format!("map-{mode}-{users}.json"));
    std::fs::copy(map, &run_map).with_context(|| format!("copying {}", map.display()))?;
    let lane = start_lane(&o.model, &run_map, &extra)?;
    let mut c = crate::client::primary(&lane.url).await?;
    let mut ends = Vec::new();
    let mut acc = 0.0;
    for d in &o.phase_s {
        acc += d;
        ends.push(acc);
    }
    let t0 = Instant::now();
    let handles: Vec<_> = (0..users)
        .map(|i| {
            tokio::spawn(user(
                lane.url.clone(),
                i,
                prompts.clone(),
                ends.clone(),
                t0,
                o.max_tokens,
            ))
        })
        .collect();
    let mut samples = Vec::new();
    let mut counts = None;
    let mut prev = totals(&stats(&mut c).await?);
    let mut prev_t = 0.0;
    let mut iv = tokio::time::interval(Duration::from_secs_f64(o.sample_s));
    iv.tick().await;
    loop {
        iv.tick().await;
        let t = t0.elapsed().as_secs_f64();
        let s = stats(&mut c).await?;
        let r = c
            .residency(ResidencyRequest {})
            .await
            .map(|r| r.into_inner().swaps_done)
            .unwrap_or(0);
        let now = totals(&s);
        let dt = (t - prev_t).max(1e-9);
        let picks = (now.1 - prev.1) + (now.2 - prev.2);
        let phase = ends.iter().position(|&e| t <= e).unwrap_or(ends.len() - 1);
        samples.push(Sample {
            t,
            phase,
            tok_s: (now.0 - prev.0) as f64 / dt,
            cold_share: (now.2 - prev.2) as f64 / picks.max(1) as f64,
            wait_share: (now.3 - prev.3) as f64 / (now.4 - prev.4).max(1) as f64,
            epoch: s.map_epoch,
            swaps: r,
        });
        if counts.is_none() && counts_after.is_some_and(|p| t >= ends[p]) {
            counts = Some(s.layers.iter().map(|l| l.expert_picks.clone()).collect());
        }
        eprintln!(
            "  {mode} x{users} t={t:>5.1}s {:<6} {:>7.1} tok/s cold {:>5.2}% wait {:>5.2}% epoch {} swaps {}",
            PHASES[phase].0,
            samples.last().map(|x| x.tok_s).unwrap_or(0.0),
            100.0 * samples.last().map(|x| x.cold_share).unwrap_or(0.0),
            100.0 * samples.last().map(|x| x.wait_share).unwrap_or(0.0),
            s.map_epoch,
            r
        );
        prev = now;
        prev_t = t;
        if t >= acc {
            break;
        }
    }
    for h in handles {
        h.await??;
    }
    let s = stats(&mut c).await?;
    let res = c
        .residency(ResidencyRequest {})
        .await
        .map_err(|e| anyhow::anyhow!("residency: {}", e.message()))?
        .into_inner();
    drop(lane);
    let mut phases = Vec::new();
    let mut start = 0.0;
    for (i, (name, _)) in PHASES.iter().enumerate() {
        let ws: Vec<&Sample> = samples
            .iter()
            .filter(|x| x.phase == i && x.t - o.sample_s >= start + o.warmup_s - 1e-9)
            .collect();
        let all: Vec<&Sample> = samples.iter().filter(|x| x.phase == i).collect();
        let swaps_before = samples
            .iter()
            .filter(|x| x.t <= start)
            .map(|x| x.swaps)
            .max()
            .unwrap_or(0);
        phases.push(PhaseSummary {
            phase: name.to_string(),
            tok_s: median(ws.iter().map(|x| x.tok_s).collect()),
            cold_share: median(ws.iter().map(|x| x.cold_share).collect()),
            wait_share: median(ws.iter().map(|x| x.wait_share).collect()),
            // from the first whole window of the phase after which it stays under 2%
            under_2pct_after_s: {
                let whole: Vec<&&Sample> = all
                    .iter()
                    .filter(|x| x.t - o.sample_s >= start - 0.25 * o.sample_s)
                    .collect();
                let last_over = whole.iter().rposition(|x| x.cold_share >= 0.02);
                match last_over {
                    None => whole.first().map(|x| x.t - start),
                    Some(i) if i + 1 < whole.len() => Some(whole[i + 1].t - start),
                    Some(_) => None,
                }
            },
            swaps: all.iter().map(|x| x.swaps).max().unwrap_or(0) - swaps_before,
        });
        start = ends[i];
    }
    Ok((
        Run {
            mode: mode.to_string(),
            users,
            samples,
            phases,
            swaps_done: res.swaps_done,
            swaps_aborted: res.swaps_aborted,
            longest_step_ms: s.max_step_ns as f64 / 1e6,
            mean_step_ms: s.step_ns as f64 / 1e6 / s.steps.max(1) as f64,
        },
        counts,
    ))
}

pub async fn run(o: ShiftOptions) -> Result<()> {
    if o.phase_s.len() != PHASES.len() {
        bail!(
            "--phase-s needs {} durations (en, de+ja, ko, mix), got {}",
            PHASES.len(),
            o.phase_s.len()
        );
    }
    for m in &o.modes {
        if !["fixed", "refit", "adaptive"].contains(&m.as_str()) {
            bail!("--modes: unknown mode {m:?} (fixed, refit, adaptive)");
        }
    }
    if o.modes.iter().any(|m| m == "refit") && o.modes.first().map(String::as_str) != Some("fixed")
    {
        bail!("--modes: refit is fitted on the fixed run's counts; list fixed first");
    }
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    let fixed_map = o.model.join("rowmap.json");
    let ckpt = moelane_engine::checkpoint::Checkpoint::open(&o.model)?;
    let base = moelane_engine::load::resolve_map(&ckpt, Some(Rowmap::read(&fixed_map)?))?;
    drop(ckpt);
    let hot = base.map.layers.first().map(|l| l.hot.len()).unwrap_or(0);
    let prompts = std::sync::Arc::new(phase_prompts(&o.model)?);
    let refit_path = o.out.join("refit.json");
    let mut runs = Vec::new();
    for &users in &o.users {
        for mode in &o.modes {
            eprintln!("run: {mode}, {users} user(s)");
            let map = if mode == "refit" {
                refit_path.clone()
            } else {
                fixed_map.clone()
            };
            let want_counts = mode == "fixed" && !refit_path.exists();
            let (run, counts) = run_one(
                &o,
                mode,
                users,
                &map,
                prompts.clone(),
                want_counts.then_some(1),
            )
            .await?;
            if let Some(counts) = counts {
                let refit = base.refit(&counts, hot)?;
                refit.write_atomic(&refit_path)?;
                let ckpt = moelane_engine::checkpoint::Checkpoint::open(&o.model)?;
                let refit = moelane_engine::load::resolve_map(&ckpt, Some(refit))?;
                eprintln!(
                    "refit on the en + de+ja phases' counts: cold share of those counts {:.2}% -> {:.2}%",
                    100.0 * base.cold_share(&counts),
                    100.0 * refit.cold_share(&counts)
                );
            }
            runs.push(run);
        }
    }
    std::fs::write(o.out.join("shift.json"), serde_json::to_vec_pretty(&runs)?)?;
    std::fs::write(o.out.join("shift.svg"), svg(&runs, &o.phase_s))?;
    let table = table(&runs);
    std::fs::write(o.out.join("shift.md"), &table)?;
    print!("{table}");
    eprintln!("wrote {}/shift.json, shift.svg, shift.md", o.out.display());
    Ok(())
}

pub fn table(runs: &[Run]) -> String {
    let mut s = String::from(
        "| map | users | phase | tokens/s | cold share | wait share | swaps | < 2% cold after |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        for p in &r.phases {
            s += &format!(
                "| {} | {} | {} | {:.1} | {:.2}% | {:.2}% | {} | {} |\n",
                r.mode,
                r.users,
                p.phase,
                p.tok_s,
                100.0 * p.cold_share,
                100.0 * p.wait_share,
                p.swaps,
                p.under_2pct_after_s
                    .map(|t| format!("{t:.0} s"))
                    .unwrap_or_else(|| "never".into())
            );
        }
    }
    s += "\n| map | users | swaps done | aborted | longest step | mean step |\n|---|---|---|---|---|---|\n";
    for r in runs {
        s += &format!(
            "| {} | {} | {} | {} | {:.2} ms | {:.2} ms |\n",
            r.mode, r.users, r.swaps_done, r.swaps_aborted, r.longest_step_ms, r.mean_step_ms
        );
    }
    s
}

/// Cold share and tokens/s over time, one column per user count, one line per map.
pub fn svg(runs: &[Run], phase_s: &[f64]) -> String {
    let mut users: Vec<usize> = runs.iter().map(|r| r.users).collect();
    users.dedup();
    let (pw, ph, ml, mt) = (520.0, 200.0, 60.0, 40.0);
    let w = ml + users.len() as f64 * (pw + ml) + 20.0;
    let h = mt + 2.0 * (ph + 60.0) + 40.0;
    let total: f64 = phase_s.iter().sum();
    let colors = [
        ("fixed", "#d62728"),
        ("refit", "#1f77b4"),
        ("adaptive", "#2ca02c"),
    ];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (ci, &u) in users.iter().enumerate() {
        let x0 = ml + ci as f64 * (pw + ml);
        let mine: Vec<&Run> = runs.iter().filter(|r| r.users == u).collect();
        let max_tok = mine
            .iter()
            .flat_map(|r| r.samples.iter().map(|x| x.tok_s))
            .fold(1.0f64, f64::max)
            * 1.1;
        let max_cold = mine
            .iter()
            .flat_map(|r| r.samples.iter().map(|x| x.cold_share * 100.0))
            .fold(5.0f64, f64::max)
            * 1.1;
        for (pi, (title, ymax, unit)) in [
            ("cold share of picks", max_cold, "%"),
            ("tokens/s", max_tok, ""),
        ]
        .iter()
        .enumerate()
        {
            let y0 = mt + pi as f64 * (ph + 60.0);
            s += &format!(
                "<text x=\"{}\" y=\"{}\" font-weight=\"bold\">{title}, {u} user(s)</text>\n",
                x0,
                y0 - 8.0
            );
            s += &format!(
                "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n"
            );
            for k in 0..=4 {
                let v = ymax * k as f64 / 4.0;
                let y = y0 + ph - ph * k as f64 / 4.0;
                s += &format!(
                    "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.0}{unit}</text><line x1=\"{x0}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#eee\"/>\n",
                    x0 - 4.0,
                    y + 4.0,
                    x0 + pw
                );
            }
            if pi == 0 {
                let y = y0 + ph - ph * 2.0 / ymax;
                s += &format!(
                    "<line x1=\"{x0}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#999\" stroke-dasharray=\"2,3\"/><text x=\"{}\" y=\"{}\" fill=\"#666\">2%</text>\n",
                    x0 + pw,
                    x0 + pw - 24.0,
                    y - 3.0
                );
            }
            let mut acc = 0.0;
            for (i, d) in phase_s.iter().enumerate() {
                let xa = x0 + pw * acc / total;
                s += &format!(
                    "<text x=\"{}\" y=\"{}\" fill=\"#555\">{}</text>\n",
                    xa + 4.0,
                    y0 + 14.0,
                    PHASES[i].0
                );
                acc += d;
                if i + 1 < phase_s.len() {
                    let xb = x0 + pw * acc / total;
                    s += &format!(
                        "<line x1=\"{xb}\" x2=\"{xb}\" y1=\"{y0}\" y2=\"{}\" stroke=\"#aaa\" stroke-dasharray=\"4,3\"/>\n",
                        y0 + ph
                    );
                }
            }
            s += &format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">seconds</text>\n",
                x0 + pw / 2.0,
                y0 + ph + 30.0
            );
            for r in &mine {
                let color = colors
                    .iter()
                    .find(|c| c.0 == r.mode)
                    .map(|c| c.1)
                    .unwrap_or("#000");
                let pts: Vec<String> = r
                    .samples
                    .iter()
                    .map(|x| {
                        let v = if pi == 0 {
                            x.cold_share * 100.0
                        } else {
                            x.tok_s
                        };
                        format!(
                            "{:.1},{:.1}",
                            x0 + pw * (x.t / total).min(1.0),
                            y0 + ph - ph * (v / ymax).min(1.0)
                        )
                    })
                    .collect();
                s += &format!(
                    "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                    pts.join(" ")
                );
            }
        }
    }
    for (i, (m, c)) in colors.iter().enumerate() {
        let x = ml + i as f64 * 110.0;
        let y = h - 14.0;
        s += &format!(
            "<line x1=\"{x}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"{c}\" stroke-width=\"3\"/><text x=\"{}\" y=\"{}\">{m} map</text>\n",
            x + 24.0,
            x + 30.0,
            y + 4.0
        );
    }
    s += "</svg>\n";
    s
}
