//! Data-plane links between the primary and the sidecar, all behind the engine's
//! [`RemoteTier`] trait: one frame format (every message tagged with step, layer and map
//! epoch), carried over TCP between hosts or over a shared-memory ring between two
//! processes on one host (the analogue of a pinned PCIe buffer). The in-process link is the
//! engine's own. A broken link surfaces as an error on the step, never as a hang.

pub mod frame;
pub mod shm;
pub mod tcp;

use std::sync::Arc;

use moelane_engine::tier::{ColdReply, ColdRequest};

/// What a sidecar does with a request: shared by every link that serves it.
pub trait ColdService: Send + Sync {
    /// Fills `out` with one row per pick, or fails with a message.
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<(), String>;
}

/// Serves one request into a reply (the error text travels in the reply frame).
pub fn answer(
    svc: &Arc<dyn ColdService>,
    req: &ColdRequest,
    out: &mut Vec<f32>,
) -> Result<ColdReply, String> {
    svc.serve(req, out).map(|()| ColdReply {
        step: req.step,
        layer: req.layer,
        epoch: req.epoch,
        outputs: std::mem::take(out),
    })
}
