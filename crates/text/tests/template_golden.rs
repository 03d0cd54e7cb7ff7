//! Each family's chat template (and tests/golden/features.jinja, the Jinja features hub
//! templates use) rendered by moelane as transformers renders it: the
//! conversations and texts of tests/golden/templates.json (written by
//! scripts/template_golden.py through transformers' `apply_chat_template` machinery), byte
//! for byte; where transformers' render raised, ours refuses too. The same with each call's
//! arguments sent as JSON text (as OpenAI clients send them) instead of an object.

use moelane_text::chat::{ChatMessage, ChatTemplate};
use moelane_text::templates;
use serde_json::Value;

fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/templates.json");
    serde_json::from_slice(&std::fs::read(path).expect("golden file")).expect("golden JSON")
}

/// The case's messages, each call's arguments as JSON text when `as_text`.
fn messages(case: &Value, as_text: bool) -> Vec<ChatMessage> {
    let mut msgs = case["messages"].clone();
    if as_text {
        for m in msgs.as_array_mut().expect("messages") {
            for c in m["tool_calls"].as_array_mut().into_iter().flatten() {
                let text = c["function"]["arguments"].to_string();
                c["function"]["arguments"] = Value::String(text);
            }
        }
    }
    serde_json::from_value(msgs).expect("messages as ChatMessage")
}

#[test]
fn every_familys_template_renders_as_transformers_does() {
    let g = golden();
    let cases = g["cases"].as_array().expect("cases");
    let mut checked = 0;
    // the families' templates, and one of the Jinja features hub templates use
    let features = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/features.jinja"
    ))
    .expect("features.jinja");
    let all = templates::FAMILIES
        .iter()
        .copied()
        .chain([("features", features.as_str())]);
    for (family, source) in all {
        let fam = &g["families"][family];
        assert!(
            fam.is_object(),
            "{family} is not in the golden file: regenerate it"
        );
        let t = ChatTemplate::new(
            source.to_string(),
            fam["bos_token"].as_str().unwrap_or_default().into(),
            fam["eos_token"].as_str().unwrap_or_default().into(),
        )
        .unwrap_or_else(|e| panic!("{family}: {e}"));
        for case in cases {
            let name = case["name"].as_str().expect("name");
            let want = &fam["renders"][name];
            let tools = case["tools"]
                .as_bool()
                .unwrap_or(false)
                .then(|| &g["tools"]);
            let kwargs = case["kwargs"].as_object().cloned().unwrap_or_default();
            let prompt = case["add_generation_prompt"].as_bool().unwrap_or(true);
            for as_text in [false, true] {
                let got = t.render_full(&messages(case, as_text), tools, &kwargs, prompt);
                match (want["text"].as_str(), got) {
                    (Some(w), Ok(g)) => assert_eq!(g, w, "{family} / {name} (text: {as_text})"),
                    (None, Err(_)) => {}
                    (Some(_), Err(e)) => panic!("{family} / {name}: ours refused: {e}"),
                    (None, Ok(g)) => panic!(
                        "{family} / {name}: transformers refused ({}), ours rendered {g:?}",
                        want["error"]
                    ),
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 7 * cases.len() * 2);
}

#[test]
fn each_familys_template_gives_its_markup() {
    use moelane_text::agent::{DEEPSEEK_V3, GLM45, HARMONY, HERMES};
    for (family, source) in templates::FAMILIES {
        let t = ChatTemplate::new(source.into(), String::new(), String::new()).expect(family);
        let want = match family {
            "glm4_moe" => GLM45,
            "deepseek_v3" => DEEPSEEK_V3,
            "gpt_oss" => HARMONY,
            _ => HERMES,
        };
        assert_eq!(t.markup, want, "{family}");
        // every family but mixtral takes tools; qwen3, glm and gpt-oss think
        assert_eq!(t.takes_tools(), family != "mixtral", "{family}");
        assert_eq!(
            t.thinks(),
            matches!(family, "qwen3_moe" | "glm4_moe" | "gpt_oss" | "deepseek_v3"),
            "{family}"
        );
        assert_eq!(templates::for_family(family), Some(source));
    }
}
