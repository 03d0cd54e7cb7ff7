//! Named fault-injection points, for proving the swap protocol under faults with real
//! processes. Off unless `MOELANE_FAILPOINTS` is set, e.g.
//! `MOELANE_FAILPOINTS="sidecar.load=delay:2000;coordinator.after-commit=crash@2"`:
//! `point=action[@N]`, fired at the point's N-th hit (default the first), once.
//!
//! Actions: `delay:MS` (sleep), `fail` (the operation errs), `lose-request` (a control message
//! is never delivered), `lose-reply` (delivered, but its answer never comes back),
//! `duplicate` (delivered twice, the copy late, after later messages), `crash` (the process
//! exits at once with status 86, as a kill would leave it).
//!
//! Points: `sidecar.load`, `primary.load` (loading a swap's experts: delay or fail);
//! `sidecar.prepare`, `sidecar.release`, `sidecar.abort` (control messages from the
//! coordinator to a sidecar process); `coordinator.after-prepare`, `coordinator.after-commit`,
//! `coordinator.after-persist`, `coordinator.after-release`; `sidecar.on-prepare` (staged,
//! before answering), `sidecar.on-release` (before applying).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The exit status of an injected crash.
pub const CRASH_STATUS: i32 = 86;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Delay(Duration),
    Fail,
    LoseRequest,
    LoseReply,
    Duplicate,
    Crash,
}

struct Point {
    action: Action,
    at: u64,
    hits: AtomicU64,
}

pub struct Plan {
    points: HashMap<String, Point>,
}

const POINTS: &[&str] = &[
    "sidecar.load",
    "primary.load",
    "sidecar.prepare",
    "sidecar.release",
    "sidecar.abort",
    "coordinator.after-prepare",
    "coordinator.after-commit",
    "coordinator.after-persist",
    "coordinator.after-release",
    "sidecar.on-prepare",
    "sidecar.on-release",
];

impl Plan {
    /// Parses `point=action[@N];...`; every error names the part that was wrong.
    pub fn parse(spec: &str) -> Result<Plan, String> {
        let mut points = HashMap::new();
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, rest) = part
                .split_once('=')
                .ok_or_else(|| format!("failpoint {part:?}: expected point=action"))?;
            let name = name.trim();
            if !POINTS.contains(&name) {
                return Err(format!(
                    "failpoint {name:?}: unknown point (known: {})",
                    POINTS.join(", ")
                ));
            }
            let (action, at) = match rest.split_once('@') {
                Some((a, n)) => (
                    a.trim(),
                    n.trim()
                        .parse::<u64>()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| format!("failpoint {part:?}: @N needs N >= 1"))?,
                ),
                None => (rest.trim(), 1),
            };
            let action = match action {
                "fail" => Action::Fail,
                "lose-request" => Action::LoseRequest,
                "lose-reply" => Action::LoseReply,
                "duplicate" => Action::Duplicate,
                "crash" => Action::Crash,
                a => match a.strip_prefix("delay:").map(str::parse::<u64>) {
                    Some(Ok(ms)) => Action::Delay(Duration::from_millis(ms)),
                    _ => {
                        return Err(format!(
                        "failpoint {part:?}: unknown action {a:?} (delay:MS, fail, lose-request, lose-reply, duplicate, crash)"
                    ))
                    }
                },
            };
            points.insert(
                name.to_string(),
                Point {
                    action,
                    at,
                    hits: AtomicU64::new(0),
                },
            );
        }
        Ok(Plan { points })
    }

    /// Counts a hit of `point`; returns the action when this hit is the one that fires.
    pub fn hit(&self, point: &str) -> Option<Action> {
        let p = self.points.get(point)?;
        let n = p.hits.fetch_add(1, Ordering::Relaxed) + 1;
        (n == p.at).then_some(p.action)
    }
}

fn plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(|| match std::env::var("MOELANE_FAILPOINTS") {
        Ok(s) if !s.trim().is_empty() => match Plan::parse(&s) {
            Ok(p) => {
                eprintln!("moelane: failpoints armed: {s}");
                p
            }
            Err(e) => {
                // a typo must not silently test nothing
                eprintln!("moelane: MOELANE_FAILPOINTS: {e}");
                std::process::exit(2);
            }
        },
        _ => Plan {
            points: HashMap::new(),
        },
    })
}

/// Checks `MOELANE_FAILPOINTS` at start (exits with a message naming the error).
pub fn init() {
    let _ = plan();
}

/// The action to take at `point` now, if any. `Crash` never returns.
pub fn hit(point: &str) -> Option<Action> {
    let p = plan();
    if p.points.is_empty() {
        return None;
    }
    let a = p.hit(point)?;
    eprintln!("moelane: failpoint {point}: {a:?}");
    if a == Action::Crash {
        std::process::exit(CRASH_STATUS);
    }
    Some(a)
}

/// For load points: sleeps on `delay`, errs on `fail`.
pub fn load_point(point: &str) -> Result<(), String> {
    match hit(point) {
        Some(Action::Delay(d)) => {
            std::thread::sleep(d);
            Ok(())
        }
        Some(Action::Fail) => Err(format!("injected failure at {point}")),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_fires_once_at_the_nth_hit() {
        let p = Plan::parse("sidecar.load=delay:5; coordinator.after-commit=crash@2").unwrap();
        assert_eq!(
            p.hit("sidecar.load"),
            Some(Action::Delay(Duration::from_millis(5)))
        );
        assert_eq!(p.hit("sidecar.load"), None);
        assert_eq!(p.hit("coordinator.after-commit"), None);
        assert_eq!(p.hit("coordinator.after-commit"), Some(Action::Crash));
        for bad in [
            "x=fail",
            "sidecar.load",
            "sidecar.load=explode",
            "sidecar.load=fail@0",
        ] {
            assert!(Plan::parse(bad).is_err(), "{bad}");
        }
    }
}
