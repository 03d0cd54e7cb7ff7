//! The cold tier as the primary sees it: send the cold picks of one layer, compute the hot
//! ones meanwhile, then wait for one output per pick. Every message carries the step, the
//! layer and the map epoch it was routed with. Links (in-process, shared memory, TCP, NCCL)
//! implement [`RemoteTier`]; this module has the in-process one.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::bank::{ExpertBank, Pick};
use crate::error::{Error, Result};

/// The cold request of one layer of one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColdRequest {
    pub step: u64,
    /// MoE layer index (the rowmap's layer).
    pub layer: u32,
    pub epoch: u64,
    pub picks: Vec<Pick>,
    /// `[rows, hidden]`: the distinct token rows the picks refer to.
    pub activations: Vec<f32>,
}

/// One output row per pick, in pick order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColdReply {
    pub step: u64,
    pub layer: u32,
    pub epoch: u64,
    pub outputs: Vec<f32>,
}

/// A link to the tier that holds the cold experts.
pub trait RemoteTier: Send {
    /// Sends one layer's cold picks; returns at once.
    fn send(&mut self, req: ColdRequest) -> Result<()>;
    /// Waits for the reply to the request sent last.
    fn recv(&mut self) -> Result<ColdReply>;
    /// Link kind, for metrics and logs.
    fn kind(&self) -> &'static str;
}

/// Resolves a request against a bank: checks the epoch the server can serve.
pub trait ColdServer: Send {
    fn serve(&mut self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()>;
}

/// A sidecar serving a single fixed bank (no swaps): epoch must match.
pub struct FixedBank {
    pub bank: ExpertBank,
    pub epoch: u64,
}

impl ColdServer for FixedBank {
    fn serve(&mut self, req: &ColdRequest, out: &mut Vec<f32>) -> Result<()> {
        if req.epoch != self.epoch {
            return Err(Error::Tier(format!(
                "request tagged epoch {} but this tier serves epoch {}",
                req.epoch, self.epoch
            )));
        }
        out.clear();
        out.resize(req.picks.len() * self.bank.hidden, 0.0);
        self.bank
            .compute(req.layer as usize, &req.picks, &req.activations, out)
    }
}

/// The cold tier on its own thread in this process: messages move, nothing is copied.
pub struct InProcessTier {
    tx: Option<mpsc::SyncSender<ColdRequest>>,
    rx: mpsc::Receiver<Result<ColdReply>>,
    thread: Option<JoinHandle<()>>,
}

impl InProcessTier {
    pub fn spawn(mut server: Box<dyn ColdServer>) -> Self {
        let (tx, req_rx) = mpsc::sync_channel::<ColdRequest>(1);
        let (rep_tx, rx) = mpsc::sync_channel::<Result<ColdReply>>(1);
        let thread = std::thread::Builder::new()
            .name("moelane-sidecar".into())
            .spawn(move || {
                let mut out = Vec::new();
                while let Ok(req) = req_rx.recv() {
                    let r = server.serve(&req, &mut out).map(|()| ColdReply {
                        step: req.step,
                        layer: req.layer,
                        epoch: req.epoch,
                        outputs: std::mem::take(&mut out),
                    });
                    if rep_tx.send(r).is_err() {
                        break;
                    }
                }
            })
            .ok();
        InProcessTier {
            tx: Some(tx),
            rx,
            thread,
        }
    }
}

impl RemoteTier for InProcessTier {
    fn send(&mut self, req: ColdRequest) -> Result<()> {
        self.tx
            .as_ref()
            .ok_or_else(|| Error::Tier("in-process sidecar stopped".into()))?
            .send(req)
            .map_err(|_| Error::Tier("in-process sidecar stopped".into()))
    }
    fn recv(&mut self) -> Result<ColdReply> {
        self.rx
            .recv()
            .map_err(|_| Error::Tier("in-process sidecar stopped".into()))?
    }
    fn kind(&self) -> &'static str {
        "inproc"
    }
}

impl Drop for InProcessTier {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
