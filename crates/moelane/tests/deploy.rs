//! The deployment artifacts stay true: the Kubernetes manifests validate strictly against the
//! Kubernetes 1.30 schemas (kubernetes-validate, installed by scripts/test.sh), every moelane
//! flag the manifests, the Compose file and the systemd units pass exists, and the units pass
//! `systemd-analyze verify` with this build's binary in ExecStart.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no *.{ext} in {dir}");
    v
}

#[test]
fn kubernetes_manifests_validate_strictly() {
    let py = std::env::var("MOELANE_PYTHON")
        .expect("MOELANE_PYTHON is unset: run the suite through scripts/test.sh");
    let mut cmd = Command::new(py);
    cmd.args(["-m", "kubernetes_validate", "--strict", "-k", "1.30.0"]);
    cmd.args(files("deploy/kubernetes", "yaml"));
    let o = cmd.output().expect("run kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    assert!(text.contains("passed"), "{text}");
    assert!(!text.contains("failed"), "{text}");
}

/// The `--flag` words of a file's non-comment text.
fn flags_in(p: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(p).expect("read");
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.split('#').next().unwrap_or("");
        for w in code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
            if let Some(f) = w.strip_prefix("--") {
                if f.len() > 1 && f.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                    out.push(format!("--{f}"));
                }
            }
        }
    }
    out
}

#[test]
fn every_flag_the_deploy_files_pass_exists() {
    let help = Command::new(common::bin())
        .args(["lane", "--help"])
        .output()
        .expect("moelane lane --help");
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let mut checked = 0;
    let mut paths = files("deploy/kubernetes", "yaml");
    paths.extend(files("deploy/systemd", "service"));
    paths.push(repo().join("deploy/compose/docker-compose.yml"));
    for p in paths {
        for f in flags_in(&p) {
            assert!(
                help.contains(&format!("{f} ")) || help.contains(&format!("{f}\n")),
                "{} passes {f}, which `moelane lane` does not have",
                p.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 30, "only {checked} flags found");
}

#[test]
fn systemd_units_verify() {
    let Ok(v) = Command::new("systemd-analyze").arg("--version").output() else {
        println!("SKIPPED: systemd-analyze is not installed: the units were not verified");
        return;
    };
    assert!(v.status.success());
    let dir = std::env::temp_dir().join(format!("moelane-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut units = Vec::new();
    for p in files("deploy/systemd", "service") {
        let text = std::fs::read_to_string(&p)
            .expect("read")
            .replace("/usr/local/bin/moelane", common::bin());
        let to = dir.join(p.file_name().expect("name"));
        std::fs::write(&to, text).expect("write");
        units.push(to);
    }
    let o = Command::new("systemd-analyze")
        .arg("verify")
        .args(&units)
        .output()
        .expect("systemd-analyze verify");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // what a build machine lacks (the unit's user, network-online.target's providers) is not
    // the units' fault; anything about the unit files themselves is
    let real: Vec<&str> = text
        .lines()
        .filter(|l| {
            !l.is_empty()
                && !l.contains("User=moelane")
                && !l.contains("not-found")
                && !l.contains("unit is not found")
        })
        .collect();
    assert!(o.status.success() || real.is_empty(), "{text}");
}
