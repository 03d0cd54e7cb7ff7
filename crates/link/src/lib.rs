//! Data-plane links between the primary and the sidecar, all behind the engine's
//! [`RemoteTier`] trait: one frame format (every message tagged with step, layer and map
//! epoch), carried over TCP between hosts or over a shared-memory ring between two
//! processes on one host (the analogue of a pinned PCIe buffer), or, with the `cuda` feature,
//! over NCCL between two GPUs. The in-process link is the engine's own. A broken link surfaces as an error on the step, never as a hang.

pub mod frame;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod shm;
pub mod tcp;

use std::sync::Arc;

use moelane_engine::error::{Error, Fault, Result};
use moelane_engine::tier::{ColdReply, ColdRequest};

/// What a sidecar does with a request: shared by every link that serves it.
pub trait ColdService: Send + Sync {
    /// Fills `out` with one row per pick, or fails saying how (the fault travels back).
    fn serve(&self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()>;

    /// The NCCL link's device path: the request's activations (`acts_len` floats at device
    /// address `acts`; `req.activations` is empty) are read and its outputs (one row per
    /// pick, at most `out_len` floats at `out`) written in the memory of GPU `ordinal`,
    /// without a host copy; returns the floats written. `None`: this service computes
    /// elsewhere, and the link stages through host memory.
    ///
    /// # Safety
    /// `acts` and `out` address that many floats of GPU `ordinal`, 16-byte aligned, and no
    /// other work touches them until this returns.
    unsafe fn serve_device(
        &self,
        _req: &ColdRequest,
        _ordinal: usize,
        _acts: u64,
        _acts_len: usize,
        _out: u64,
        _out_len: usize,
    ) -> Option<Result<usize>> {
        None
    }
}

/// A service behind the engine's in-process link (the embedded lane, the link benches).
pub struct InProcess(pub Arc<dyn ColdService>);

impl moelane_engine::tier::ColdServer for InProcess {
    fn serve(&mut self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()> {
        self.0.serve(req, out)
    }
}

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
