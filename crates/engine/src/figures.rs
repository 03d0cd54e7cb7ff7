//! Measures what a synthetic checkpoint must show to be realistic for residency: per
//! language, the cold share of picks under a map fitted on English and under a map fitted
//! on that language; a two-language mix under its own map; and greedy answers that do not
//! collapse (distinct tokens, language kept, distinct experts per layer).

use std::path::Path;

use serde::Serialize;

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::load::{engine_from, EngineOptions};
use crate::rowmap::Rowmap;
use crate::step::{Engine, SeqStep};
use crate::synth::{fit_map, prompts, LANGS};
use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug, Serialize)]
pub struct LangFigures {
    pub lang: String,
    pub prompts: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// cold share of this language's picks under the map fitted on English
    pub cold_share_en_map: f64,
    /// cold share under the map fitted on this language itself
    pub cold_share_own_map: f64,
    /// the same two, on decode picks alone
    pub decode_cold_share_en_map: f64,
    pub decode_cold_share_own_map: f64,
    /// distinct tokens in a greedy answer of `answer_len` tokens
    pub answer_distinct_tokens: usize,
    /// share of the answer's tokens labelled with the prompt's language
    pub answer_in_language: f64,
    /// fewest distinct experts any layer used while decoding the answer
    pub answer_min_distinct_experts: usize,
    pub answer_preview: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenReport {
    pub checkpoint: String,
    pub hot: usize,
    pub experts: usize,
    pub layers: usize,
    pub answer_len: usize,
    pub langs: Vec<LangFigures>,
    /// cold share of an English+German mix under the map fitted on that mix
    pub mix_en_de_own_map: f64,
    pub mix_en_de_en_map: f64,
}

fn fresh_counts(e: &Engine) -> Vec<Vec<u64>> {
    e.counters.picks.clone()
}

fn diff(a: &[Vec<u64>], b: &[Vec<u64>]) -> Vec<Vec<u64>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p - q).collect())
        .collect()
}

fn add(a: &[Vec<u64>], b: &[Vec<u64>]) -> Vec<Vec<u64>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect())
        .collect()
}

/// Runs the measurement on a checkpoint directory; writes `rowmap.json` (fitted on English)
/// and returns the figures.
pub fn measure(dir: &Path, hot: usize, answer_len: usize) -> Result<GenReport> {
    let ckpt = Checkpoint::open(dir)?;
    let tok = Tokenizer::from_dir(dir)?;
    let labels: Vec<Vec<String>> = moelane_text::files::read_bounded(
        &dir.join("moelane_token_languages.json"),
        moelane_text::files::VOCAB_LIMIT,
    )
    .ok()
    .and_then(|b| serde_json::from_slice(&b).ok())
    .unwrap_or_default();
    let c = ckpt.config.clone();
    let layers = c.moe_layers().len();
    let all_hot = Rowmap::all_hot(&ckpt.id, layers, c.num_experts).validate(
        &ckpt.id,
        layers,
        c.num_experts,
        None,
    )?;
    let mut eng = engine_from(
        &ckpt,
        all_hot,
        &EngineOptions {
            kv_tokens: 1 << 14,
            progress: false,
        },
    )?;

    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut answers = Vec::new();
    for (li, _) in LANGS.iter().enumerate() {
        let before = fresh_counts(&eng);
        let ps = prompts(li);
        let mut ntok = 0;
        for p in &ps {
            let ids = tok.encode(p)?;
            ntok += ids.len();
            let mut seq = eng.kv.new_seq();
            eng.step(&mut [SeqStep {
                kv: &mut seq,
                tokens: &ids,
            }])?;
        }
        let mid = fresh_counts(&eng);
        let prompt = tok.encode(ps[0])?;
        let ans = eng.greedy(&prompt, answer_len)?;
        let after = fresh_counts(&eng);
        // the greedy call also prefilled the prompt once: remove it from decode counts
        let mut seq = eng.kv.new_seq();
        let b2 = fresh_counts(&eng);
        eng.step(&mut [SeqStep {
            kv: &mut seq,
            tokens: &prompt,
        }])?;
        let prompt_counts = diff(&fresh_counts(&eng), &b2);
        prefill.push((diff(&mid, &before), ntok));
        decode.push(diff(&diff(&after, &mid), &prompt_counts));
        answers.push(ans);
    }
    let model = ckpt.id.clone();
    let total: Vec<Vec<Vec<u64>>> = prefill
        .iter()
        .zip(&decode)
        .map(|((p, _), d)| add(p, d))
        .collect();
    let en_map = fit_map(&model, &total[0], hot).validate(&model, layers, c.num_experts, None)?;
    let mut langs = Vec::new();
    for (li, (name, _)) in LANGS.iter().enumerate() {
        let own = fit_map(&model, &total[li], hot).validate(&model, layers, c.num_experts, None)?;
        let ans = &answers[li];
        let mut distinct = ans.clone();
        distinct.sort();
        distinct.dedup();
        let in_lang = ans
            .iter()
            .filter(|&&t| {
                labels
                    .get(t as usize)
                    .is_some_and(|l| l.iter().any(|x| x == name))
            })
            .count();
        let min_experts = decode[li]
            .iter()
            .map(|l| l.iter().filter(|&&n| n > 0).count())
            .min()
            .unwrap_or(0);
        langs.push(LangFigures {
            lang: name.to_string(),
            prompts: prompts(li).len(),
            prefill_tokens: prefill[li].1,
            decode_tokens: ans.len(),
            cold_share_en_map: en_map.cold_share(&total[li]),
            cold_share_own_map: own.cold_share(&total[li]),
            decode_cold_share_en_map: en_map.cold_share(&decode[li]),
            decode_cold_share_own_map: own.cold_share(&decode[li]),
            answer_distinct_tokens: distinct.len(),
            answer_in_language: in_lang as f64 / ans.len().max(1) as f64,
            answer_min_distinct_experts: min_experts,
            answer_preview: tok.decode_lossy(&ans[..ans.len().min(40)]),
        });
    }
    let mix = add(&total[0], &total[1]);
    let mix_map = fit_map(&model, &mix, hot).validate(&model, layers, c.num_experts, None)?;
    let report = GenReport {
        checkpoint: dir.display().to_string(),
        hot,
        experts: c.num_experts,
        layers,
        answer_len,
        langs,
        mix_en_de_own_map: mix_map.cold_share(&mix),
        mix_en_de_en_map: en_map.cold_share(&mix),
    };
    en_map.map.write_atomic(&dir.join("rowmap.json"))?;
    Ok(report)
}

impl GenReport {
    /// A table for the terminal.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:<5} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7} {:>8}\n",
            "lang",
            "prefill",
            "decode",
            "cold@en",
            "cold@own",
            "dcold@en",
            "dcold@own",
            "distinct",
            "inlang",
            "experts"
        );
        for l in &self.langs {
            s += &format!(
                "{:<5} {:>8} {:>8} {:>8.1}% {:>8.2}% {:>8.1}% {:>8.2}% {:>8} {:>6.0}% {:>8}\n",
                l.lang,
                l.prefill_tokens,
                l.decode_tokens,
                100.0 * l.cold_share_en_map,
                100.0 * l.cold_share_own_map,
                100.0 * l.decode_cold_share_en_map,
                100.0 * l.decode_cold_share_own_map,
                l.answer_distinct_tokens,
                100.0 * l.answer_in_language,
                l.answer_min_distinct_experts
            );
        }
        s += &format!(
            "en+de mix: cold share {:.2}% under its own map, {:.1}% under the English map ({} hot of {} experts, {} MoE layers)\n",
            100.0 * self.mix_en_de_own_map, 100.0 * self.mix_en_de_en_map, self.hot, self.experts, self.layers
        );
        s
    }
}
