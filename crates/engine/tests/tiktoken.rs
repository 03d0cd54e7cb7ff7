//! A checkpoint that ships a tiktoken vocabulary (`tiktoken.model`, Kimi K2) instead of
//! `tokenizer.json`: tiny's byte-level BPE rewritten as tiktoken ranks, with a
//! `tokenization_*.py` whose `pat_str` is the GPT-2 pattern tiny's pre-tokenizer uses, encodes
//! every text to the same ids and decodes them to the same bytes; a pattern with Kimi's class
//! intersections keeps Han runs apart; malformed files are refused naming the line.

mod common;

use std::path::Path;

use moelane_engine::tokenizer::{tiktoken, Tokenizer};

fn b64(bytes: &[u8]) -> String {
    tiktoken::to_base64(bytes)
}

/// tiny's tokenizer as a tiktoken checkpoint directory, with `parts` as its pattern.
fn as_tiktoken(dir: &Path, parts: &[&str]) -> Tokenizer {
    let tok = Tokenizer::from_file(&common::tiny().join("tokenizer.json")).unwrap();
    tiktoken::write(&tok, dir, parts).unwrap();
    tok
}

#[test]
fn a_tiktoken_vocabulary_encodes_as_the_tokenizer_it_came_from() {
    let dir = common::scratch("tiktoken");
    let want = as_tiktoken(&dir, &tiktoken::GPT2_PATTERN);
    assert!(Tokenizer::exists_in(&dir));
    let got = Tokenizer::from_dir(&dir).unwrap();
    // the reserved range of 256 ids after the ranks (tiny's three specials first, named)
    let base = (0..want.vocab_size() as u32)
        .take_while(|&i| !want.is_special(i))
        .count();
    assert_eq!(got.vocab_size(), base + tiktoken::RESERVED);
    let unnamed = (base + 7) as u32;
    assert_eq!(
        got.token_to_id(&format!("<|reserved_token_{unnamed}|>")),
        Some(unnamed)
    );
    let mut texts: Vec<String> = (0..moelane_engine::synth::LANGS.len())
        .flat_map(|l| {
            moelane_engine::synth::prompts(l)
                .into_iter()
                .map(String::from)
        })
        .collect();
    texts.extend(
        [
            "",
            " ",
            "  leading and trailing  ",
            "it's they'll we've I'd",
            "tabs\tand\nnew\r\nlines\n\n\n",
            "<|im_start|>user\nGuten Morgen<|im_end|>\n<|im_start|>assistant\n",
            "1234567 + 89 = ?!",
            "emoji 🙂 and é and ß and 日本語",
        ]
        .map(String::from),
    );
    let mut tokens = 0;
    for t in &texts {
        let a = want.encode(t).unwrap();
        let b = got.encode(t).unwrap();
        assert_eq!(a, b, "{t:?}");
        assert_eq!(got.decode_lossy(&b), want.decode_lossy(&a), "{t:?}");
        tokens += b.len();
    }
    eprintln!(
        "{} texts, {tokens} tokens: the tiktoken rewrite encodes every one as tokenizer.json",
        texts.len()
    );
    // the specials keep their ids and stay special
    let im_end = want.token_to_id("<|im_end|>").unwrap();
    assert_eq!(got.token_to_id("<|im_end|>"), Some(im_end));
    assert!(got.is_special(im_end));
    assert!(got.eos_ids.contains(&im_end));
}

#[test]
fn kimi_style_patterns_compile_and_keep_han_runs_apart() {
    // Kimi's pattern is not ours to copy; this one has its shape: a Han run first, then letter
    // runs whose classes subtract Han by intersection (`&&`), which the regex engine must take
    let dir = common::scratch("tiktoken-han");
    as_tiktoken(
        &dir,
        &[
            r"[\p{Han}]+",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ],
    );
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let text = "hello你好世界world 12345";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode_lossy(&ids), text);
    // no token holds both a Han character's bytes and an ASCII letter
    for &i in &ids {
        let b = tok.token_bytes(i);
        let han = b.iter().any(|&x| x >= 0x80);
        let ascii = b.iter().any(|x| x.is_ascii_alphabetic());
        assert!(!(han && ascii), "token {i} mixes Han and Latin: {b:?}");
    }
    // digits in runs of at most three
    let digits: Vec<usize> = ids
        .iter()
        .map(|&i| tok.token_bytes(i))
        .filter(|b| b.iter().all(u8::is_ascii_digit))
        .map(<[u8]>::len)
        .collect();
    assert!(digits.iter().all(|&n| n <= 3), "{digits:?}");
}

#[test]
fn malformed_tiktoken_files_are_refused_naming_the_line() {
    let dir = common::scratch("tiktoken-bad");
    as_tiktoken(&dir, &tiktoken::GPT2_PATTERN);
    let good = std::fs::read_to_string(dir.join("tiktoken.model")).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    for (bad, want) in [
        (format!("{}\n{}", lines[0], "not-base64! 1"), "line 2"),
        (format!("{}\n{} 5", lines[0], b64(b"zz")), "line 2: rank 5"),
        (
            format!("{}\n{}", lines[0], lines[0].replace(" 0", " 1")),
            "line 2",
        ),
        (format!("{} x", lines[0]), "line 1"),
        (String::new(), "no tokens"),
    ] {
        std::fs::write(dir.join("tiktoken.model"), &bad).unwrap();
        let e = tiktoken::read_ranks(&dir.join("tiktoken.model"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want) && e.contains("tiktoken.model"), "{e}");
    }
    // a special token that repeats another would move the later ids: refused
    std::fs::write(dir.join("tiktoken.model"), &good).unwrap();
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let m = v["added_tokens_decoder"].as_object_mut().unwrap();
    let first: usize = m.keys().map(|k| k.parse().unwrap()).min().unwrap();
    let dup = m[&first.to_string()].clone();
    m.insert((first + 10).to_string(), dup);
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let e = Tokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("repeats"), "{e}");
    std::fs::write(&cfg_path, cfg).unwrap();
    // no pattern: said, naming what is missing
    std::fs::write(dir.join("tiktoken.model"), &good).unwrap();
    std::fs::remove_file(dir.join("tokenization_moelane.py")).unwrap();
    let e = Tokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("pat_str"), "{e}");
}
