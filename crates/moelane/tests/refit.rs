//! Offline refit end to end: traffic on a lane, `moelane status --counts-out`, `moelane
//! refit`, then a lane on the new map: the cold share falls and greedy output is unchanged.

mod common;

use common::*;
use serde_json::Value;

fn cold_share(addr: &str) -> f64 {
    let (_, v) = get(addr, "/v1/stats");
    let layers = v["lanes"][0]["stats"]["layers"].as_array().unwrap().clone();
    let (h, c): (u64, u64) = layers.iter().fold((0, 0), |a, l| {
        (
            a.0 + l["hot_picks"].as_u64().unwrap(),
            a.1 + l["cold_picks"].as_u64().unwrap(),
        )
    });
    c as f64 / (h + c) as f64
}

#[test]
fn status_counts_refit_and_serve_the_new_map() {
    let dir = tiny();
    let prompts = [
        "朝早く、川の上には濃い霧が立ちこめていて",
        "이른 아침 강 위에는 짙은 안개가",
        "この町の歴史は古く",
        "가을 산을 걸으면 고요한 숲과",
    ];
    let (p, primary, gw) = serve_lane(dir, &[]);
    let before: Vec<String> = prompts.iter().map(|q| complete(&gw, q, 48)).collect();
    let share_before = cold_share(&gw);
    let tmp = std::env::temp_dir().join(format!("moelane-refit-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let counts = tmp.join("counts.json");
    let out = std::process::Command::new(bin())
        .args(["status", "--primary", &primary, "--counts-out"])
        .arg(&counts)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("map epoch 0") && text.contains("ceiling"),
        "{text}"
    );
    drop(p);
    let c: Value = serde_json::from_slice(&std::fs::read(&counts).unwrap()).unwrap();
    let total: u64 = c["layers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()))
        .sum();
    // every pick counted: tokens through the lane x layers x k
    assert!(total > 0 && total.is_multiple_of(4), "{total}");

    let new_map = tmp.join("map.json");
    let out = std::process::Command::new(bin())
        .args(["refit", "--hot", "48", "--counts"])
        .arg(&counts)
        .arg("--map")
        .arg(dir.join("rowmap.json"))
        .arg("--out")
        .arg(&new_map)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m: Value = serde_json::from_slice(&std::fs::read(&new_map).unwrap()).unwrap();
    assert_eq!(m["epoch"], 1);

    // `map init` from the same counts: 48 hot per layer, the most counted ones
    let init_map = tmp.join("init.json");
    let out = std::process::Command::new(bin())
        .args(["map", "init", "--hot-experts", "48", "--model"])
        .arg(dir)
        .arg("--calibration-counts")
        .arg(&counts)
        .arg("--out")
        .arg(&init_map)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let im: Value = serde_json::from_slice(&std::fs::read(&init_map).unwrap()).unwrap();
    assert_eq!(im["epoch"], 0);
    for (l, lm) in im["layers"].as_array().unwrap().iter().enumerate() {
        let n = |e: &Value| {
            c["layers"][l][e.as_u64().unwrap() as usize]
                .as_u64()
                .unwrap()
        };
        let hot = lm["hot"].as_array().unwrap();
        assert_eq!(hot.len(), 48, "layer {l}");
        let min_hot = hot.iter().map(n).min().unwrap();
        let max_cold = lm["cold"].as_array().unwrap().iter().map(n).max().unwrap();
        assert!(min_hot >= max_cold, "layer {l}: {min_hot} < {max_cold}");
    }
    // counts of another model are refused, naming the file
    let mut other = c.clone();
    other["model"] = "qwen3_moe-0000000000000000".into();
    let other_path = tmp.join("other_counts.json");
    std::fs::write(&other_path, other.to_string()).unwrap();
    let out = std::process::Command::new(bin())
        .args(["map", "init", "--hot-experts", "4", "--model"])
        .arg(dir)
        .arg("--calibration-counts")
        .arg(&other_path)
        .arg("--out")
        .arg(&init_map)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("other_counts.json"),
        "{err}"
    );

    // a bad map is refused with an error naming the problem, before serving
    let mut bad = m.clone();
    bad["layers"][1]["cold"][0] = bad["layers"][1]["hot"][0].clone();
    let bad_path = tmp.join("bad.json");
    std::fs::write(&bad_path, bad.to_string()).unwrap();
    let out = std::process::Command::new(bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model",
            dir.to_str().unwrap(),
            "--map",
        ])
        .arg(&bad_path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("layer 1: expert"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (_p2, _, gw) = serve_lane(dir, &["--map", new_map.to_str().unwrap()]);
    let after: Vec<String> = prompts.iter().map(|q| complete(&gw, q, 48)).collect();
    assert_eq!(before, after, "the map changed the output");
    let share_after = cold_share(&gw);
    assert!(
        share_after < share_before / 4.0,
        "cold share {share_before} -> {share_after}"
    );
}
