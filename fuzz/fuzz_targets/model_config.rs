//! A checkpoint's config.json: parsed, never a panic, whatever the numbers.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = moelane_engine::config::ModelConfig::from_json_str(text, "config.json".as_ref()) {
        let _ = c.moe_layers();
    }
});
