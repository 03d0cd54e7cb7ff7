//! The NCCL link in a build without the `cuda` feature: the same names, none of which can be
//! opened ([`Error::NotCompiledWithCuda`]), so the primary's and the sidecar's wiring need no
//! `cfg` of their own.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use moelane_engine::error::{Error, Result};
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};

use crate::ColdService;

/// Whether libnccl can be loaded: never, in this build.
pub fn available() -> Result<()> {
    Err(Error::NotCompiledWithCuda)
}

/// A communicator's id: none can be made or read in this build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclId(Never);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Never {}

impl NcclId {
    pub fn new() -> Result<Self> {
        Err(Error::NotCompiledWithCuda)
    }
    pub fn to_hex(&self) -> String {
        match self.0 {}
    }
    pub fn from_hex(s: &str) -> Result<Self> {
        let _ = s;
        Err(Error::NotCompiledWithCuda)
    }
}

/// The primary's end: never connected in this build.
pub struct NcclTier(Never);

impl NcclTier {
    pub fn connect(ordinal: usize, id: &NcclId, hidden: usize, timeout: Duration) -> Result<Self> {
        let _ = (ordinal, hidden, timeout);
        match id.0 {}
    }
}

impl RemoteTier for NcclTier {
    fn send(&mut self, req: ColdRequest) -> Result<()> {
        let _ = req;
        match self.0 {}
    }
    fn recv(&mut self) -> Result<ColdReply> {
        match self.0 {}
    }
    fn kind(&self) -> &'static str {
        "nccl"
    }
}

/// The sidecar's end: this build cannot serve one.
pub fn serve(
    ordinal: usize,
    id: NcclId,
    svc: Arc<dyn ColdService>,
    stop: Arc<AtomicBool>,
    join_timeout: Duration,
) -> Result<std::thread::JoinHandle<Result<()>>> {
    let _ = (ordinal, svc, stop, join_timeout);
    match id.0 {}
}

/// As [`serve`], on the calling thread.
pub fn serve_blocking(
    ordinal: usize,
    id: &NcclId,
    svc: &Arc<dyn ColdService>,
    stop: &AtomicBool,
    join_timeout: Duration,
) -> Result<()> {
    let _ = (ordinal, svc, stop, join_timeout);
    match id.0 {}
}
