//! Rowmap files and LoadMap/REGISTER payloads: parsed and validated, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(m) = moelane_engine::rowmap::Rowmap::from_json(text) {
        for (layers, experts) in [(2, 64), (1, 8), (48, 128)] {
            if let Ok(v) = m.clone().validate("m", layers, experts, None) {
                let _ = v.epoch();
            }
        }
    }
});
