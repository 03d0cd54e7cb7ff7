//! The picks-guessed-ahead diagnostic (`MOELANE_PREDICT_PICKS=1`, moelane_engine::predict):
//! in a child process with it on (read once per process), `tiny` decodes the same greedy
//! tokens as without it, and its guesses score: the pre-attention router names well above
//! the k / E share a blind guess would, and the previous-step guess is scored at every
//! decode step.

mod common;

use std::process::Command;

use moelane_engine::synth::{prompts, LANGS};
use moelane_engine::tokenizer::Tokenizer;

const NEW: usize = 16;

fn tokens(dir: &std::path::Path) -> Vec<Vec<u32>> {
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let mut eng = common::engine(dir, None);
    (0..LANGS.len())
        .flat_map(|l| prompts(l).into_iter().take(2))
        .map(|p| eng.greedy(&tok.encode(p).unwrap(), NEW).unwrap())
        .collect()
}

/// Runs in the child (`MOELANE_PREDICT_CHILD` set, the diagnostic on): prints the tokens
/// and the counts.
#[test]
fn child_guesses() {
    let Ok(dir) = std::env::var("MOELANE_PREDICT_CHILD") else {
        return;
    };
    assert!(moelane_engine::predict::enabled());
    let t = tokens(std::path::Path::new(&dir));
    println!("TOKENS {}", serde_json::to_string(&t).unwrap());
    println!(
        "COUNTS {}",
        serde_json::to_string(&moelane_engine::predict::counts()).unwrap()
    );
}

#[test]
fn guesses_score_and_change_nothing() {
    if std::env::var("MOELANE_PREDICT_CHILD").is_ok() {
        return;
    }
    let dir = common::tiny();
    assert!(!moelane_engine::predict::enabled());
    let want = tokens(dir);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_guesses",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("MOELANE_PREDICT_CHILD", dir)
        .env("MOELANE_PREDICT_PICKS", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the child failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.split_once(name).map(|(_, t)| t.to_string()))
            .unwrap_or_else(|| panic!("no {name} from the child:\n{text}"))
    };
    let got: Vec<Vec<u32>> = serde_json::from_str(&field("TOKENS ")).unwrap();
    assert_eq!(got, want, "the diagnostic changed the greedy tokens");
    let counts: [(u64, u64); 2] = serde_json::from_str(&field("COUNTS ")).unwrap();
    let ckpt = moelane_engine::checkpoint::Checkpoint::open(dir).unwrap();
    let c = &ckpt.config;
    let blind = c.num_experts_per_tok as f64 / c.num_experts as f64;
    let [(pre_hits, pre_total), (_, prev_total)] = counts;
    // every MoE layer of every row of every step was guessed before its attention
    let rows = want.len() * NEW; // decode rows at least (the prompts' rows come on top)
    assert!(
        pre_total >= (rows * c.moe_layers().len() * c.num_experts_per_tok) as u64,
        "{counts:?}"
    );
    let share = pre_hits as f64 / pre_total as f64;
    eprintln!(
        "tiny: the pre-attention router names {:.1}% of the picks (a blind guess {:.1}%); \
         {prev_total} picks scored against the previous step",
        100.0 * share,
        100.0 * blind
    );
    assert!(share > 3.0 * blind, "{counts:?}");
    assert!(prev_total > 0, "{counts:?}");
}
