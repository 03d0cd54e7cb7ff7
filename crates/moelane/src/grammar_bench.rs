//! `moelane bench grammar`: what structured output costs per token at a real model's
//! vocabulary size. The synthetic checkpoints have 2,048 tokens; Qwen's and DeepSeek's have
//! ~150k, and the grammar's mask grows with the vocabulary. This builds a byte-level BPE of
//! `--vocab` tokens (the 256 bytes, then merges of two earlier tokens, mostly printable
//! ASCII of word-like lengths, so the trie has a real vocabulary's shape), compiles a JSON
//! schema against it and follows answers token by token (each pick the best of random
//! logits under the mask, a random valid answer): the time to build the token trie, to
//! compile, to make one mask (the part the mask worker takes off the step loop) and to
//! apply one to a row of logits (the part left on it). With `--strict-tools`, the grammar of
//! an `auto` answer with a strict tool instead: free text with a call begun every 32 tokens,
//! the masks in text and in calls apart.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use moelane_engine::bpe::Bpe;
use moelane_engine::rng::Rng;
use moelane_engine::tokenizer::byte_encoder;
use moelane_text::grammar::{json_schema_grammar, lark_grammar, Grammars};
use moelane_text::tokenizer::Tokenizer;

use crate::loadgen::pct;

/// The schema followed when none is given: strings, an array, numbers, a boolean and an
/// enum, as tool arguments and extraction schemas mix them.
fn default_schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "count": {"type": "integer", "minimum": 0, "maximum": 100000},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma"]}},
        "required": ["name", "tags", "count", "score", "ok", "kind"],
        "additionalProperties": false})
}

/// A byte-level BPE of `n` tokens (specials aside): the 256 bytes, then tokens made by
/// merging two earlier ones, where both are printable ASCII (a space only in front) and
/// the result is at most 16 bytes.
fn vocabulary(n: usize, seed: u64) -> Bpe {
    let enc = byte_encoder();
    let mut rng = Rng::new(seed);
    let mut vocab: Vec<String> = (0..256).map(|b| enc[b].to_string()).collect();
    let mut bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen: std::collections::HashSet<Vec<u8>> = bytes.iter().cloned().collect();
    let mut merges = Vec::new();
    // the printable ones, which merges draw from (letters more often, as text has them)
    let mut pool: Vec<usize> = (0..256)
        .filter(|&b| (b as u8).is_ascii_graphic() || b == b' ' as usize)
        .collect();
    let letters: Vec<usize> = (0..256)
        .filter(|&b| (b as u8).is_ascii_lowercase())
        .collect();
    let mut tries = 0usize;
    while vocab.len() < n && tries < 50 * n {
        tries += 1;
        let a = if rng.below(3) == 0 {
            letters[rng.below(letters.len())]
        } else {
            pool[rng.below(pool.len())]
        };
        let b = if rng.below(2) == 0 {
            letters[rng.below(letters.len())]
        } else {
            pool[rng.below(pool.len())]
        };
        let mut t = bytes[a].clone();
        t.extend_from_slice(&bytes[b]);
        // a space only leads a token; at most 16 bytes; new
        if t.len() > 16 || t[1..].contains(&b' ') || !seen.insert(t.clone()) {
            continue;
        }
        merges.push((vocab[a].clone(), vocab[b].clone()));
        vocab.push(t.iter().map(|&c| enc[c as usize]).collect());
        pool.push(bytes.len());
        bytes.push(t);
    }
    Bpe { vocab, merges }
}

pub fn run(
    vocab: usize,
    schema: Option<PathBuf>,
    steps: usize,
    seed: u64,
    strict_tools: bool,
    json: Option<PathBuf>,
) -> Result<()> {
    let schema = match schema {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("{} is not JSON", p.display()))?,
        None => default_schema(),
    };
    let t = Instant::now();
    let bpe = vocabulary(vocab.max(300), seed);
    let path =
        std::env::temp_dir().join(format!("moelane-bench-grammar-{}.json", std::process::id()));
    std::fs::write(&path, serde_json::to_vec(&bpe.to_json())?)
        .with_context(|| format!("writing {}", path.display()))?;
    let tok = Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("{e}"));
    let _ = std::fs::remove_file(&path);
    let tok = tok?;
    let made_s = t.elapsed().as_secs_f64();
    let v = tok.vocab_size();
    let eos = tok
        .token_to_id("<|im_end|>")
        .context("the vocabulary's end token")?;
    let tok = Arc::new(tok);
    let grammars = Grammars::new(tok.clone(), eos);
    let grammar = if strict_tools {
        let tools = [("fill".to_string(), schema.clone())];
        lark_grammar(
            &moelane_text::agent::auto_calls_grammar(&moelane_text::agent::HERMES, &tools, 8)
                .context("Hermes has an auto grammar")?,
        )
    } else {
        json_schema_grammar(&schema)
    };
    let marker = tok
        .encode_plain("<tool_call>")
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let t = Instant::now();
    let mut c = grammars
        .compile(&grammar)
        .map_err(|e| anyhow::anyhow!("the schema: {e}"))?;
    let first_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let _ = grammars
        .compile(&grammar)
        .map_err(|e| anyhow::anyhow!("the schema: {e}"))?;
    let compile_s = t.elapsed().as_secs_f64();
    println!(
        "vocabulary {v} tokens (made in {made_s:.1} s); trie and first compile {:.1} ms, a compile {:.2} ms",
        first_s * 1e3,
        compile_s * 1e3
    );
    let mut rng = Rng::new(seed ^ 0x9e37);
    let (mut masks, mut applies, mut allowed) = (Vec::new(), Vec::new(), Vec::new());
    // (strict tools) masks made in free text and inside calls; where the answer is
    let (mut in_text, mut in_call) = (Vec::new(), Vec::new());
    let (mut calling, mut free_run, mut since) = (false, 0usize, String::new());
    let mut answers = 0usize;
    let mut row = vec![0f32; v];
    for _ in 0..steps {
        for x in row.iter_mut() {
            *x = rng.uniform();
        }
        if strict_tools && !calling && free_run >= 32 {
            // the model begins a call
            for &id in &marker {
                c.consume(id).map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            (calling, free_run) = (true, 0);
            since.clear();
        }
        let t = Instant::now();
        let m = c.next_mask().map_err(|e| anyhow::anyhow!("{e}"))?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        masks.push(us);
        if calling {
            in_call.push(us);
        } else {
            in_text.push(us);
        }
        let t = Instant::now();
        m.apply(&mut row).map_err(|e| anyhow::anyhow!("{e}"))?;
        applies.push(t.elapsed().as_secs_f64() * 1e6);
        allowed.push(row.iter().filter(|x| x.is_finite()).count() as f64);
        let pick = moelane_engine::sampling::argmax(&row) as u32;
        if pick == eos || c.is_done() {
            answers += 1;
            c = grammars
                .compile(&grammar)
                .map_err(|e| anyhow::anyhow!("the schema: {e}"))?;
            (calling, free_run) = (false, 0);
            continue;
        }
        c.consume(pick).map_err(|e| anyhow::anyhow!("{e}"))?;
        if calling {
            since.push_str(&String::from_utf8_lossy(tok.token_bytes(pick)));
            if since.contains("</tool_call>") {
                calling = false;
            }
        } else {
            free_run += 1;
        }
    }
    let split = if strict_tools {
        let [t50, t99] = [0.5, 0.99].map(|q| pct(&mut in_text, q));
        let [c50, c99] = [0.5, 0.99].map(|q| pct(&mut in_call, q));
        println!(
            "strict tools: in free text ({} masks) p50 {t50:.1} us, p99 {t99:.1}; in calls ({} \
             masks) p50 {c50:.1} us, p99 {c99:.1}",
            in_text.len(),
            in_call.len()
        );
        serde_json::json!({"text_us": {"n": in_text.len(), "p50": t50, "p99": t99},
                           "call_us": {"n": in_call.len(), "p50": c50, "p99": c99}})
    } else {
        serde_json::Value::Null
    };
    let mean_allowed = allowed.iter().sum::<f64>() / allowed.len().max(1) as f64;
    let [m50, m90, m99, mmax] = [0.5, 0.9, 0.99, 1.0].map(|q| pct(&mut masks, q));
    let [a50, a99] = [0.5, 0.99].map(|q| pct(&mut applies, q));
    println!(
        "mask p50 {m50:.1} us, p90 {m90:.1}, p99 {m99:.1}, max {mmax:.1}; applied to a row p50 \
         {a50:.1} us, p99 {a99:.1}; {mean_allowed:.0} tokens allowed on average; {answers} \
         answers completed in {steps} steps"
    );
    let r = serde_json::json!({
        "vocab": v, "steps": steps, "answers_completed": answers,
        "trie_and_first_compile_ms": first_s * 1e3, "compile_ms": compile_s * 1e3,
        "mask_us": {"p50": m50, "p90": m90, "p99": m99, "max": mmax},
        "apply_us": {"p50": a50, "p99": a99},
        "mean_allowed_tokens": mean_allowed, "strict_tools": split,
    });
    if let Some(p) = json {
        std::fs::write(&p, serde_json::to_vec_pretty(&r)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
