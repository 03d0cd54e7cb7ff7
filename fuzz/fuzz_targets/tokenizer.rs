//! The tokenizer, the incremental detokeniser and the agent splitter: any text encodes (with
//! and without special tokens recognised) and decodes without a panic, plain encoding never
//! yields a control token, any token sequence streams through the detokeniser with stop strings
//! to the same text as decoding it whole, up to the first stop, and any text split into
//! content, reasoning and tool calls (each family's markup) in streamed pieces gives the whole
//! text's parts.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use moelane_text::detok::Detokenizer;
use moelane_text::tokenizer::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<(Tokenizer, tempfile::TempDir)> = OnceLock::new();
    &T.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let p = moelane_engine::synth::Preset::by_name("tiny").expect("tiny");
        moelane_engine::synth::generate(&p, 1, dir.path()).expect("generate tiny");
        let t = Tokenizer::from_file(&dir.path().join("tokenizer.json")).expect("tokenizer");
        (t, dir)
    })
    .0
}

fuzz_target!(|data: &[u8]| {
    let t = tokenizer();
    let text = String::from_utf8_lossy(data);
    // the agent splitter: any text, streamed in pieces of any size, gives the whole's parts
    {
        use moelane_text::agent::{
            merge, split_whole, Splitter, DEEPSEEK_V3, GLM45, HARMONY, HERMES, KIMI_K2, MISTRAL,
            MISTRAL_ARGS,
        };
        let step = 1 + data.first().copied().unwrap_or(0) as usize % 7;
        // each family's markup, picked by the second byte
        let m = [
            HERMES,
            DEEPSEEK_V3,
            GLM45,
            HARMONY,
            KIMI_K2,
            MISTRAL,
            MISTRAL_ARGS,
        ][data.get(1).copied().unwrap_or(0) as usize % 7]
            .clone();
        for (calls, think, open) in [
            (true, true, false),
            (true, false, true),
            (false, true, true),
        ] {
            let whole = split_whole(m.clone(), calls, think, open, &text);
            let mut s = Splitter::new(m.clone(), calls, think, open);
            let chars: Vec<char> = text.chars().collect();
            let mut parts = Vec::new();
            for piece in chars.chunks(step) {
                parts.extend(s.push(&piece.iter().collect::<String>()));
            }
            parts.extend(s.finish());
            assert_eq!(merge(parts), whole, "the streamed split differs");
            // a call's arguments are always one JSON object
            for p in &whole {
                if let moelane_text::agent::Part::Call { arguments, .. } = p {
                    let v: Result<serde_json::Value, _> = serde_json::from_str(arguments);
                    assert!(v.is_ok_and(|v| v.is_object()), "arguments {arguments:?}");
                }
            }
        }
    }
    let _ = t.encode(&text);
    if let Ok(ids) = t.encode_plain(&text) {
        assert!(
            t.find_special(&text).is_some() || ids.iter().all(|&i| !t.is_special(i)),
            "plain text became a control token"
        );
        let _ = t.decode_lossy(&ids);
    }
    let _ = t.find_special(&text);
    // the bytes as token ids, streamed with a stop string cut from the input
    let v = t.vocab_size().max(1) as u32;
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32 % v)
        .collect();
    let stop: String = text.chars().take(3).collect();
    let mut d = Detokenizer::new(if stop.is_empty() {
        vec![]
    } else {
        vec![stop.clone()]
    });
    let mut streamed = String::new();
    for &i in &ids {
        streamed.push_str(&d.push(t.token_bytes(i)));
        if d.stopped() {
            break;
        }
    }
    if !d.stopped() {
        streamed.push_str(&d.finish());
        let whole = t.decode_lossy(&ids);
        let cut = if stop.is_empty() {
            None
        } else {
            whole.find(&stop)
        };
        if cut.is_none() {
            assert_eq!(streamed, whole, "streamed text differs from the whole");
        }
    }
});
