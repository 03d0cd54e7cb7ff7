//! The lane registry, a kameo actor: which lanes exist, which drain, how many requests each
//! carries. Picking returns an RAII guard that counts the request in flight until dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kameo::message::{Context, Message};
use kameo::Actor;

use crate::lane::Lane;

pub struct Entry {
    pub lane: Arc<dyn Lane>,
    pub draining: bool,
    pub inflight: Arc<AtomicUsize>,
}

#[derive(Actor, Default)]
pub struct Registry {
    lanes: Vec<Entry>,
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

pub struct AddLane(pub Arc<dyn Lane>);
pub struct Pick;
pub struct SetDrain {
    pub lane: String,
    pub draining: bool,
}
pub struct ListLanes;

#[derive(Clone, Debug, serde::Serialize)]
pub struct LaneInfo {
    pub name: String,
    pub draining: bool,
    pub inflight: usize,
}

impl Message<AddLane> for Registry {
    type Reply = ();
    async fn handle(&mut self, AddLane(lane): AddLane, _: &mut Context<Self, Self::Reply>) {
        self.lanes.push(Entry {
            lane,
            draining: false,
            inflight: Arc::new(AtomicUsize::new(0)),
        });
    }
}

impl Message<Pick> for Registry {
    type Reply = Option<InFlight>;
    async fn handle(&mut self, _: Pick, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let e = self
            .lanes
            .iter()
            .filter(|e| !e.draining)
            .min_by_key(|e| e.inflight.load(Ordering::Acquire))?;
        e.inflight.fetch_add(1, Ordering::AcqRel);
        Some(InFlight {
            lane: e.lane.clone(),
            count: e.inflight.clone(),
        })
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
        self.lanes
            .iter()
            .map(|e| {
                (
                    LaneInfo {
                        name: e.lane.name().to_string(),
                        draining: e.draining,
                        inflight: e.inflight.load(Ordering::Acquire),
                    },
                    e.lane.clone(),
                )
            })
            .collect()
    }
}
