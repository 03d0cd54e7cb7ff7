//! The metric names: one list, one convention (`moelane_` prefix, `_total` only on counters,
//! the unit in the name), and [`describe`] registering each with its kind. Checked through a
//! recorder local to the test, so nothing global is installed.

use std::collections::BTreeMap;
use std::sync::Mutex;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use moelane_telemetry::names::{self, describe, float_help, ALL};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// What `describe` said of one name: its kind, unit and help text.
type Description = (Kind, Option<Unit>, String);

/// Records what `describe` registers: name -> (kind, unit, help), and any name twice.
#[derive(Default)]
struct Described {
    seen: Mutex<BTreeMap<String, Description>>,
    twice: Mutex<Vec<String>>,
}

impl Described {
    fn put(&self, key: KeyName, kind: Kind, unit: Option<Unit>, help: SharedString) {
        let name = key.as_str().to_string();
        let old = self
            .seen
            .lock()
            .unwrap()
            .insert(name.clone(), (kind, unit, help.to_string()));
        if old.is_some() {
            self.twice.lock().unwrap().push(name);
        }
    }
}

impl Recorder for Described {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.put(key, Kind::Counter, unit, help);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.put(key, Kind::Gauge, unit, help);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.put(key, Kind::Histogram, unit, help);
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

fn described() -> BTreeMap<String, Description> {
    let r = Described::default();
    metrics::with_local_recorder(&r, describe);
    assert!(
        r.twice.lock().unwrap().is_empty(),
        "described twice: {:?}",
        r.twice.lock().unwrap()
    );
    r.seen.into_inner().unwrap()
}

/// The float counters: published by `set_seconds_total`, not described through `metrics`.
fn floats() -> Vec<&'static str> {
    let d = described();
    ALL.iter()
        .copied()
        .filter(|n| !d.contains_key(*n))
        .collect()
}

#[test]
fn every_name_is_prefixed_snake_case_and_listed_once() {
    let mut seen = std::collections::BTreeSet::new();
    for n in ALL {
        assert!(n.starts_with("moelane_"), "{n} lacks the moelane_ prefix");
        assert!(
            n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{n} is not snake case"
        );
        assert!(seen.insert(*n), "{n} is listed twice in ALL");
    }
}

#[test]
fn all_lists_every_name_the_module_defines() {
    let src = include_str!("../src/names.rs");
    let defined: Vec<&str> = src
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const "))
        .filter(|l| l.contains(": &str ="))
        .filter_map(|l| l.split('"').nth(1))
        .collect();
    assert!(defined.len() > 20, "parsed only {defined:?}");
    for n in &defined {
        assert!(ALL.contains(n), "{n} is defined but missing from ALL");
    }
    assert_eq!(
        defined.len(),
        ALL.len(),
        "ALL lists a name not defined here"
    );
}

#[test]
fn describe_registers_every_name_with_a_kind_that_fits_it() {
    let d = described();
    for (name, (kind, unit, help)) in &d {
        assert!(
            ALL.contains(&name.as_str()),
            "{name} described but not in ALL"
        );
        assert!(!help.trim().is_empty(), "{name} has no help text");
        match kind {
            Kind::Counter => assert!(name.ends_with("_total"), "counter {name} lacks _total"),
            Kind::Gauge | Kind::Histogram => {
                assert!(!name.ends_with("_total"), "{kind:?} {name} ends in _total")
            }
        }
        if *unit == Some(Unit::Seconds) {
            assert!(name.ends_with("_seconds"), "{name} is in seconds");
        }
        if *kind == Kind::Histogram {
            assert_eq!(*unit, Some(Unit::Seconds), "histogram {name} has no unit");
        }
    }
    // the gateway's and primary's core series, by kind
    assert_eq!(d[names::HTTP_REQUESTS].0, Kind::Counter);
    assert_eq!(d[names::QUEUE_DEPTH].0, Kind::Gauge);
    assert_eq!(d[names::STEP_DURATION].0, Kind::Histogram);
}

#[test]
fn the_names_describe_leaves_out_are_float_counters_with_their_own_help() {
    let f = floats();
    assert!(f.contains(&names::STEP_TIME), "{f:?}");
    for n in f {
        assert!(
            n.ends_with("_seconds_total"),
            "{n} is neither described nor a float seconds counter"
        );
        assert_ne!(
            float_help(n),
            float_help("moelane_not_a_metric"),
            "{n} has only the default help"
        );
    }
}
