//! `moelane`: the one CLI binary of the project.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use moelane_engine::figures;
use moelane_engine::synth::{self, Preset};

mod bench;

#[derive(Parser)]
#[command(
    name = "moelane",
    version,
    about = "Serve Mixture-of-Experts models on a lane: a primary (attention, dense weights, hot experts) and a sidecar (cold experts)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a synthetic qwen3_moe checkpoint (config.json, tokenizer.json,
    /// model.safetensors, rowmap.json fitted on English) and print its routing figures.
    Gen {
        /// tiny (tests: seconds to make and load) or mini (serving default: 384 experts, 6 picked, 295 hot)
        #[arg(long, default_value = "mini")]
        preset: String,
        /// Seed: everything written is a deterministic function of it.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Output directory (created).
        #[arg(long)]
        out: PathBuf,
        /// Length of the greedy answers used to check that generation does not collapse.
        #[arg(long, default_value_t = 400)]
        answer_len: usize,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCmd,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Gen {
            preset,
            seed,
            out,
            answer_len,
        } => {
            let Some(p) = Preset::by_name(&preset) else {
                bail!("--preset {preset:?}: unknown preset (choose tiny or mini)");
            };
            let t0 = Instant::now();
            synth::generate(&p, seed, &out)
                .with_context(|| format!("generating {} into {}", p.name, out.display()))?;
            eprintln!(
                "wrote {} checkpoint (seed {seed}) to {} in {:.1} s; measuring routing...",
                p.name,
                out.display(),
                t0.elapsed().as_secs_f64()
            );
            let t1 = Instant::now();
            let report = figures::measure(&out, p.hot, answer_len)?;
            print!("{}", report.table());
            let rp = out.join("moelane_gen_report.json");
            std::fs::write(&rp, serde_json::to_vec_pretty(&report)?)?;
            eprintln!(
                "measured in {:.1} s; figures in {}, initial map (fitted on en) in {}",
                t1.elapsed().as_secs_f64(),
                rp.display(),
                out.join("rowmap.json").display()
            );
            for l in &report.langs {
                eprintln!("  {:<4} {}", l.lang, l.answer_preview.replace('\n', " "));
            }
        }
        Cmd::Bench { what } => bench::run(what)?,
    }
    Ok(())
}
