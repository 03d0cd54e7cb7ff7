//! The lane registry, a kameo actor: which lanes exist, whether each is healthy, which drain,
//! how many requests each carries. Picking returns an RAII guard that counts the request in
//! flight until dropped.
//!
//! Health has two inputs, as in Envoy's outlier detection: the active checker's last answer
//! (the lane's Health RPC: up, draining) and passive failure counting on real requests. A lane
//! that fails `eject_after` requests in a row is ejected for a backoff that doubles with each
//! ejection (capped); when it ends the lane gets traffic again (half-open) and one success
//! closes the breaker. A lane is picked only when it is up, not draining, not ejected.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kameo::message::{Context, Message};
use kameo::Actor;

use crate::lane::Lane;

/// The circuit breaker's settings.
#[derive(Clone, Debug)]
pub struct Breaker {
    /// Consecutive failed requests that eject a lane.
    pub eject_after: u32,
    /// The first ejection's length; each further one doubles it.
    pub base_ejection: Duration,
    /// The longest ejection.
    pub max_ejection: Duration,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            eject_after: 2,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(30),
        }
    }
}

pub struct Entry {
    pub lane: Arc<dyn Lane>,
    /// Where the lane came from: "flag", "file", or the DNS name it was resolved from.
    pub source: String,
    /// Drained by the operator (POST /admin/drain).
    pub draining: bool,
    /// The lane's own last answer: it drains (its primary is stopping).
    pub remote_draining: bool,
    /// The active checker's last answer (true until the first check).
    pub up: bool,
    /// Why the last check said down.
    pub down_reason: String,
    pub failures: u32,
    /// Health checks in a row that had no answer in time.
    pub misses: u32,
    pub ejections: u32,
    pub ejected_until: Option<Instant>,
    pub inflight: Arc<AtomicUsize>,
    pub model: String,
    pub map_epoch: u64,
    pub build: String,
    pub incarnation: u64,
    /// Why the lane serves degraded (empty: it does not): picked after lanes that are not.
    pub degraded: String,
}

impl Entry {
    fn new(lane: Arc<dyn Lane>, source: String) -> Self {
        Entry {
            lane,
            source,
            draining: false,
            remote_draining: false,
            up: true,
            down_reason: String::new(),
            failures: 0,
            misses: 0,
            ejections: 0,
            ejected_until: None,
            inflight: Arc::new(AtomicUsize::new(0)),
            model: String::new(),
            map_epoch: 0,
            build: String::new(),
            incarnation: 0,
            degraded: String::new(),
        }
    }

    fn ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|t| t > now)
    }

    /// Whether new requests may go to this lane.
    pub fn eligible(&self, now: Instant) -> bool {
        self.up && !self.draining && !self.remote_draining && !self.ejected(now)
    }

    fn state(&self, now: Instant) -> &'static str {
        if self.draining || self.remote_draining {
            "draining"
        } else if !self.up {
            "down"
        } else if self.ejected(now) {
            "ejected"
        } else {
            "up"
        }
    }
}

#[derive(Actor, Default)]
pub struct Registry {
    lanes: Vec<Entry>,
    breaker: Breaker,
    /// The checkpoint id the gateway serves (its `--model`): a lane whose Health names
    /// another is down, since its tokens mean another vocabulary's (None: not checked).
    expect_model: Option<String>,
}

impl Registry {
    pub fn new(breaker: Breaker) -> Self {
        Registry {
            lanes: Vec::new(),
            breaker,
            expect_model: None,
        }
    }

    /// Lanes must serve checkpoint `id` ([`Registry::expect_model`]).
    pub fn expecting(mut self, id: String) -> Self {
        self.expect_model = Some(id);
        self
    }
}

/// Counts one request on a lane while alive.
pub struct InFlight {
    pub lane: Arc<dyn Lane>,
    count: Arc<AtomicUsize>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Adds a lane that stays (a `--lane` flag).
pub struct AddLane(pub Arc<dyn Lane>);

/// The lanes `source` gives now: lanes of that source not listed are removed (requests in
/// flight on them finish; they hold the lane), listed ones not present are added; lanes that
/// stay keep their health and breaker state.
pub struct SyncLanes {
    pub source: String,
    pub lanes: Vec<Arc<dyn Lane>>,
}

/// Picks the eligible lane with the fewest requests in flight, skipping the names in
/// `exclude` (lanes this request already tried).
pub struct Pick {
    pub exclude: Vec<String>,
}

/// How a request went on a lane, for the breaker.
pub struct Report {
    pub lane: String,
    pub ok: bool,
}

/// The active checker's answer for one lane.
pub struct Checked {
    pub lane: String,
    pub result: Result<crate::lane::Health, String>,
    /// The check had no answer in time (not a refusal): a lane is down after two in a row,
    /// since one may be a long step or a slow network.
    pub timed_out: bool,
}

pub struct SetDrain {
    pub lane: String,
    pub draining: bool,
}
pub struct ListLanes;

#[derive(Clone, Debug, serde::Serialize)]
pub struct LaneInfo {
    pub name: String,
    pub source: String,
    /// up, down, ejected or draining
    pub state: &'static str,
    /// The last health check said it takes requests (whatever the operator's drain says):
    /// what a rollout waits for before its canary.
    pub healthy: bool,
    pub draining: bool,
    pub inflight: usize,
    pub failures: u32,
    pub ejections: u32,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub down_reason: String,
    pub model: String,
    pub map_epoch: u64,
    /// The lane's build, from its last health answer (lanes of two builds serve side by side
    /// during a rollout).
    pub build: String,
    /// The lane's primary process, from its last health answer (0 before one).
    pub incarnation: u64,
    /// Why it serves degraded (empty: it does not).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub degraded: String,
}

impl Message<AddLane> for Registry {
    type Reply = ();
    async fn handle(&mut self, AddLane(lane): AddLane, _: &mut Context<Self, Self::Reply>) {
        if !self.lanes.iter().any(|e| e.lane.name() == lane.name()) {
            self.lanes.push(Entry::new(lane, "flag".into()));
        }
    }
}

impl Message<SyncLanes> for Registry {
    /// (added, removed)
    type Reply = (usize, usize);
    async fn handle(&mut self, m: SyncLanes, _: &mut Context<Self, Self::Reply>) -> (usize, usize) {
        let wanted: HashMap<&str, &Arc<dyn Lane>> = m.lanes.iter().map(|l| (l.name(), l)).collect();
        let before = self.lanes.len();
        self.lanes
            .retain(|e| e.source != m.source || wanted.contains_key(e.lane.name()));
        let removed = before - self.lanes.len();
        let mut added = 0;
        for l in &m.lanes {
            if !self.lanes.iter().any(|e| e.lane.name() == l.name()) {
                self.lanes.push(Entry::new(l.clone(), m.source.clone()));
                added += 1;
            }
        }
        (added, removed)
    }
}

impl Message<Pick> for Registry {
    type Reply = Option<InFlight>;
    async fn handle(&mut self, m: Pick, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let now = Instant::now();
        let open = |e: &&Entry| !m.exclude.iter().any(|x| x == e.lane.name());
        let least = |e: &&Entry| (!e.degraded.is_empty(), e.inflight.load(Ordering::Acquire));
        let e = self
            .lanes
            .iter()
            .filter(|e| e.eligible(now) && open(e))
            // a degraded lane (computing its cold experts itself) only when no other will do
            .min_by_key(least)
            // panic mode: with no lane eligible, a lane down only because its health checks
            // timed out (slow under load, or stopped: its stream's keep-alive ends the wait)
            // is tried rather than failing for certain; a refused, draining or ejected one is
            // not
            .or_else(|| {
                self.lanes
                    .iter()
                    .filter(|e| {
                        !e.up
                            && e.misses >= 2
                            && !e.draining
                            && !e.remote_draining
                            && !e.ejected(now)
                            && open(e)
                    })
                    .min_by_key(least)
            })?;
        e.inflight.fetch_add(1, Ordering::AcqRel);
        Some(InFlight {
            lane: e.lane.clone(),
            count: e.inflight.clone(),
        })
    }
}

impl Message<Report> for Registry {
    /// Whether this report ejected the lane.
    type Reply = bool;
    async fn handle(&mut self, m: Report, _: &mut Context<Self, Self::Reply>) -> bool {
        let b = self.breaker.clone();
        let now = Instant::now();
        // never eject the last lane that takes requests: a request that fails everywhere
        // (its own fault) must not take the whole gateway down
        let others = self
            .lanes
            .iter()
            .filter(|e| e.lane.name() != m.lane && e.eligible(now))
            .count();
        let Some(e) = self.lanes.iter_mut().find(|e| e.lane.name() == m.lane) else {
            return false;
        };
        if m.ok {
            e.failures = 0;
            e.ejections = 0;
            return false;
        }
        e.failures += 1;
        if e.failures >= b.eject_after.max(1) && !e.ejected(now) && others > 0 {
            let factor = 1u32 << e.ejections.min(16);
            let len = b.base_ejection.saturating_mul(factor).min(b.max_ejection);
            e.ejected_until = Some(now + len);
            e.ejections += 1;
            e.failures = 0;
            metrics::counter!(moelane_telemetry::names::LANE_EJECTIONS, "lane" => m.lane.clone())
                .increment(1);
            tracing::warn!(lane = %m.lane, ejection_s = len.as_secs_f64(), "lane ejected after failed requests");
            return true;
        }
        false
    }
}

impl Message<Checked> for Registry {
    type Reply = ();
    async fn handle(&mut self, m: Checked, _: &mut Context<Self, Self::Reply>) {
        let Some(e) = self.lanes.iter_mut().find(|e| e.lane.name() == m.lane) else {
            return;
        };
        let was = e.up;
        if m.timed_out {
            e.misses += 1;
            if e.misses < 2 {
                return;
            }
        } else {
            e.misses = 0;
        }
        match m.result {
            Ok(h) => {
                let other = self
                    .expect_model
                    .as_ref()
                    .filter(|want| !h.model.is_empty() && h.model != **want);
                e.up = h.ok && other.is_none();
                e.remote_draining = h.draining;
                e.down_reason = match other {
                    Some(want) => format!(
                        "the lane serves checkpoint {:?}, this gateway {want:?} (its --model): \
                         its tokens would be read as another vocabulary's",
                        h.model
                    ),
                    None if h.ok => String::new(),
                    None => h.reason,
                };
                e.model = h.model;
                e.map_epoch = h.map_epoch;
                e.build = h.build;
                e.incarnation = h.incarnation;
                e.degraded = h.degraded;
            }
            Err(why) => {
                e.up = false;
                // a primary that drained and is gone is down, not still draining
                e.remote_draining = false;
                e.down_reason = why;
            }
        }
        if was != e.up {
            if e.up {
                tracing::info!(lane = %m.lane, "lane up");
            } else {
                tracing::warn!(lane = %m.lane, reason = %e.down_reason, "lane down");
            }
        }
    }
}

impl Message<SetDrain> for Registry {
    type Reply = bool;
    async fn handle(&mut self, m: SetDrain, _: &mut Context<Self, Self::Reply>) -> bool {
        let mut found = false;
        for e in self.lanes.iter_mut().filter(|e| e.lane.name() == m.lane) {
            e.draining = m.draining;
            found = true;
        }
        found
    }
}

impl Message<ListLanes> for Registry {
    type Reply = Vec<(LaneInfo, Arc<dyn Lane>)>;
    async fn handle(&mut self, _: ListLanes, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let now = Instant::now();
        self.lanes
            .iter()
            .map(|e| {
                (
                    LaneInfo {
                        name: e.lane.name().to_string(),
                        source: e.source.clone(),
                        state: e.state(now),
                        healthy: e.up && !e.remote_draining,
                        draining: e.draining || e.remote_draining,
                        inflight: e.inflight.load(Ordering::Acquire),
                        failures: e.failures,
                        ejections: e.ejections,
                        down_reason: e.down_reason.clone(),
                        model: e.model.clone(),
                        map_epoch: e.map_epoch,
                        build: e.build.clone(),
                        incarnation: e.incarnation,
                        degraded: e.degraded.clone(),
                    },
                    e.lane.clone(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lane::Health;
    use kameo::actor::Spawn;

    /// A real gRPC lane named `n` that is never dialled (the registry only keeps lanes).
    fn lane(n: &str) -> Arc<dyn Lane> {
        Arc::new(crate::lane::GrpcLane::named(n, "http://127.0.0.1:1").expect("lane"))
    }

    async fn pick(r: &kameo::actor::ActorRef<Registry>, exclude: &[&str]) -> Option<String> {
        r.ask(Pick {
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
        })
        .await
        .expect("registry")
        .map(|f| f.lane.name().to_string())
    }

    #[tokio::test]
    async fn failures_eject_with_doubling_backoff_and_a_success_closes_the_breaker() {
        let r = Registry::spawn(Registry::new(Breaker {
            eject_after: 2,
            base_ejection: Duration::from_millis(200),
            max_ejection: Duration::from_millis(300),
        }));
        r.ask(AddLane(lane("a"))).await.expect("add");
        r.ask(AddLane(lane("b"))).await.expect("add");
        let report = |ok| Report {
            lane: "a".into(),
            ok,
        };
        assert!(!r.ask(report(false)).await.expect("report"));
        assert!(
            r.ask(report(false)).await.expect("report"),
            "second failure ejects"
        );
        for _ in 0..3 {
            assert_eq!(pick(&r, &[]).await.as_deref(), Some("b"));
        }
        assert_eq!(pick(&r, &["b"]).await, None, "a is ejected, b excluded");
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(pick(&r, &["b"]).await.as_deref(), Some("a"), "half-open");
        // a second ejection doubles, capped at 300 ms
        r.ask(report(false)).await.expect("report");
        assert!(r.ask(report(false)).await.expect("report"));
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(
            pick(&r, &["b"]).await,
            None,
            "still ejected: 300 ms, not 200"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(pick(&r, &["b"]).await.as_deref(), Some("a"));
        // a success resets the count: one more failure does not eject
        r.ask(report(true)).await.expect("report");
        assert!(!r.ask(report(false)).await.expect("report"));
        assert_eq!(pick(&r, &["b"]).await.as_deref(), Some("a"));
        // the last lane that takes requests is never ejected
        r.ask(SetDrain {
            lane: "b".into(),
            draining: true,
        })
        .await
        .expect("drain");
        for _ in 0..4 {
            assert!(!r.ask(report(false)).await.expect("report"));
        }
        assert_eq!(pick(&r, &[]).await.as_deref(), Some("a"));
        // one missed health check is not down, two are
        let state = |r: kameo::actor::ActorRef<Registry>| async move {
            r.ask(ListLanes).await.expect("list")[0].0.state
        };
        for (n, want) in [(1, "up"), (2, "down")] {
            r.ask(Checked {
                lane: "a".into(),
                result: Err("no answer".into()),
                timed_out: true,
            })
            .await
            .expect("checked");
            assert_eq!(state(r.clone()).await, want, "after {n} misses");
        }
        // down by missed checks only, with no other lane to take it: still tried (panic
        // mode), but not once another lane is up
        assert_eq!(pick(&r, &[]).await.as_deref(), Some("a"));
        r.ask(SetDrain {
            lane: "b".into(),
            draining: false,
        })
        .await
        .expect("undrain");
        assert_eq!(pick(&r, &[]).await.as_deref(), Some("b"));
        assert_eq!(pick(&r, &["b"]).await.as_deref(), Some("a"));
        // a refused check means gone: never tried
        r.ask(Checked {
            lane: "a".into(),
            result: Err("connection refused".into()),
            timed_out: false,
        })
        .await
        .expect("checked");
        assert_eq!(pick(&r, &["b"]).await, None);
    }

    #[tokio::test]
    async fn down_or_draining_lanes_are_not_picked_and_sync_keeps_state() {
        let r = Registry::spawn(Registry::default());
        r.ask(SyncLanes {
            source: "file".into(),
            lanes: vec![lane("a"), lane("b")],
        })
        .await
        .expect("sync");
        r.ask(Checked {
            lane: "a".into(),
            result: Err("connection refused".into()),
            timed_out: false,
        })
        .await
        .expect("checked");
        r.ask(Checked {
            lane: "b".into(),
            timed_out: false,
            result: Ok(Health {
                ok: false,
                draining: true,
                reason: "draining".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("checked");
        assert_eq!(pick(&r, &[]).await, None);
        // re-listing keeps a's state; dropping b removes it; c is new and up
        let (added, removed) = r
            .ask(SyncLanes {
                source: "file".into(),
                lanes: vec![lane("a"), lane("c")],
            })
            .await
            .expect("sync");
        assert_eq!((added, removed), (1, 1));
        assert_eq!(pick(&r, &[]).await.as_deref(), Some("c"));
        assert_eq!(pick(&r, &["c"]).await, None, "a is still down");
        r.ask(Checked {
            lane: "a".into(),
            timed_out: false,
            result: Ok(Health {
                ok: true,
                ..Default::default()
            }),
        })
        .await
        .expect("checked");
        // c has one request in flight (the guard above was dropped: 0), a has none
        let got = pick(&r, &["c"]).await;
        assert_eq!(got.as_deref(), Some("a"));
        // another source's sync leaves these alone
        r.ask(SyncLanes {
            source: "dns://x:1".into(),
            lanes: vec![],
        })
        .await
        .expect("sync");
        let list = r.ask(ListLanes).await.expect("list");
        assert_eq!(list.len(), 2);
    }
}
