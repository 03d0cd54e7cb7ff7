//! Data-plane links between the primary and the sidecar, all behind the engine's
//! [`RemoteTier`] trait: one frame format (every message tagged with step, layer and map
//! epoch), carried over TCP between hosts or over a shared-memory ring between two
//! processes on one host (the analogue of a pinned PCIe buffer), or, with the `cuda` feature,
//! over NCCL between two GPUs (without it, `nccl` is a stub whose every opening answers
//! `NotCompiledWithCuda`). The in-process link is the engine's own. A broken link surfaces as an error on the step, never as a hang.

pub mod frame;
#[cfg(feature = "cuda")]
pub mod ipc;
pub mod ipc_line;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(not(feature = "cuda"))]
#[path = "nccl_stub.rs"]
pub mod nccl;
pub mod shm;
pub mod tcp;

use std::sync::Arc;

use moelane_engine::error::{Error, Fault, Result};
use moelane_engine::tier::{ColdReply, ColdRequest};

/// What a sidecar does with a request (the engine's one cold-expert service trait, shared by
/// every link that serves it, the in-process one included).
pub use moelane_engine::tier::ColdService;

/// Serves one request into a reply (the error text travels in the reply frame).
pub fn answer(
    svc: &Arc<dyn ColdService>,
    req: &ColdRequest,
    out: &mut Vec<f32>,
) -> Result<ColdReply> {
    svc.serve(req, out).map(|()| ColdReply {
        step: req.step,
        layer: req.layer,
        epoch: req.epoch,
        outputs: std::mem::take(out),
    })
}

/// The sidecar's side of one exchange on any byte link: `buf` holds a request frame on entry
/// and the reply frame on return (an undecodable request gets an error reply, never a panic).
pub fn handle_frame(
    svc: &Arc<dyn ColdService>,
    buf: &mut Vec<u8>,
    req: &mut ColdRequest,
    out: &mut Vec<f32>,
) {
    let rep = match frame::decode_request(buf, req) {
        Ok(()) => answer(svc, req, out),
        Err(e) => Err(Error::Invalid(format!("request frame: {e}"))),
    };
    frame::encode_reply(&rep, req.step, req.layer, req.epoch, buf);
    if let Ok(r) = rep {
        *out = r.outputs; // keep the buffer for the next request
    }
}

/// The primary's side: decodes a reply frame from the `link` link. A sidecar's error keeps
/// the fault the sidecar gave it; a frame that does not decode is the link's own failure.
pub fn reply_from(link: &'static str, buf: &[u8]) -> Result<ColdReply> {
    let mut rep = ColdReply::default();
    frame::decode_reply(buf, &mut rep).map_err(|e| match e {
        frame::FrameError::Remote(fault, text) => {
            Error::link(link, fault, format!("the sidecar answered: {text}"))
        }
        frame::FrameError::Bad(text) => Error::link(link, Fault::Internal, text),
    })?;
    Ok(rep)
}

/// The fault of an I/O error on a link: a deadline passed, or the peer is gone.
pub fn io_fault(e: &std::io::Error) -> Fault {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Fault::Timeout,
        _ => Fault::Unavailable,
    }
}
