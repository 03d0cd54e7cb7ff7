//! The primary's data link to a sidecar process, supervised: [`open_link`] opens the kind
//! REGISTER answered with (tcp, shm, or NCCL between GPUs); [`Relink`] drops a link whose
//! call failed and wakes the supervisor, which re-registers through the residency
//! coordinator and installs a new one; [`Metered`] counts the link's bytes and round trips.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use moelane_engine::tier::RemoteTier;

/// The data link to a sidecar process. When a call on it fails, the link is dropped and the
/// supervisor re-registers with the sidecar through the residency coordinator (which brings
/// the sidecar onto the committed map) and installs the new link; steps fail with a clear
/// error meanwhile.
pub struct Relink {
    pub slot: Arc<std::sync::Mutex<Option<Box<dyn RemoteTier>>>>,
    pub broken: Arc<tokio::sync::Notify>,
    pub kind: &'static str,
}

impl Relink {
    fn call<T>(
        &mut self,
        f: impl FnOnce(&mut Box<dyn RemoteTier>) -> moelane_engine::Result<T>,
    ) -> moelane_engine::Result<T> {
        // a panic mid-exchange leaves the link in an unknown state: drop it, as any failure
        let broken = &self.broken;
        let mut g = self.slot.lock().unwrap_or_else(|p| {
            let mut g = p.into_inner();
            *g = None;
            broken.notify_one();
            g
        });
        let Some(t) = g.as_mut() else {
            return Err(moelane_engine::Error::link(
                self.kind,
                moelane_engine::error::Fault::Unavailable,
                "the sidecar link is down; reconnecting",
            ));
        };
        let r = f(t);
        if r.is_err() {
            *g = None;
            self.broken.notify_one();
        }
        r
    }
}

impl RemoteTier for Relink {
    fn send(&mut self, req: moelane_engine::tier::ColdRequest) -> moelane_engine::Result<()> {
        self.call(|t| t.send(req))
    }
    fn recv(&mut self) -> moelane_engine::Result<moelane_engine::tier::ColdReply> {
        self.call(|t| t.recv())
    }
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn device_ordinal(&self) -> Option<usize> {
        self.slot.lock().ok()?.as_ref()?.device_ordinal()
    }
    unsafe fn send_device(
        &mut self,
        req: moelane_engine::tier::ColdRequest,
        acts: u64,
        acts_len: usize,
    ) -> moelane_engine::Result<()> {
        // SAFETY: the caller's guarantee, passed on
        self.call(|t| unsafe { t.send_device(req, acts, acts_len) })
    }
    fn recv_device(
        &mut self,
    ) -> moelane_engine::Result<(moelane_engine::tier::ColdReply, u64, usize)> {
        self.call(|t| t.recv_device())
    }
}

/// Counts link bytes and round trips of a tier (handles taken once; an atomic add each).
pub struct Metered {
    inner: Box<dyn RemoteTier>,
    sent_at: Option<std::time::Instant>,
    rtt: metrics::Histogram,
    sent: metrics::Counter,
    received: metrics::Counter,
}

impl Metered {
    pub fn wrap(inner: Box<dyn RemoteTier>) -> Box<dyn RemoteTier> {
        use moelane_telemetry::names as n;
        let link = inner.kind();
        Box::new(Metered {
            inner,
            sent_at: None,
            rtt: metrics::histogram!(n::LINK_ROUND_TRIP, "link" => link),
            sent: metrics::counter!(n::LINK_BYTES, "link" => link, "side" => "primary", "direction" => "sent"),
            received: metrics::counter!(n::LINK_BYTES, "link" => link, "side" => "primary", "direction" => "received"),
        })
    }
}

impl Metered {
    /// Times the round trip from here and counts `bytes` sent once `send` succeeds.
    fn sending(
        &mut self,
        bytes: usize,
        send: impl FnOnce(&mut dyn RemoteTier) -> moelane_engine::Result<()>,
    ) -> moelane_engine::Result<()> {
        self.sent_at = Some(std::time::Instant::now());
        send(self.inner.as_mut())?;
        self.sent.increment(bytes as u64);
        Ok(())
    }

    /// Ends the round trip's timing and counts `floats` received.
    fn count_reply(&mut self, floats: usize) {
        if let Some(t) = self.sent_at.take() {
            self.rtt.record(t.elapsed().as_secs_f64());
        }
        self.received.increment((floats * 4) as u64);
    }
}

impl RemoteTier for Metered {
    fn send(&mut self, req: moelane_engine::tier::ColdRequest) -> moelane_engine::Result<()> {
        // the frame's payload: activations and picks
        let bytes = req.activations.len() * 4 + req.picks.len() * 8;
        self.sending(bytes, |t| t.send(req))
    }
    fn recv(&mut self) -> moelane_engine::Result<moelane_engine::tier::ColdReply> {
        let r = self.inner.recv()?;
        self.count_reply(r.outputs.len());
        Ok(r)
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn device_ordinal(&self) -> Option<usize> {
        self.inner.device_ordinal()
    }
    unsafe fn send_device(
        &mut self,
        req: moelane_engine::tier::ColdRequest,
        acts: u64,
        acts_len: usize,
    ) -> moelane_engine::Result<()> {
        let bytes = acts_len * 4 + req.picks.len() * 8;
        // SAFETY: the caller's guarantee, passed on
        self.sending(bytes, |t| unsafe { t.send_device(req, acts, acts_len) })
    }
    fn recv_device(
        &mut self,
    ) -> moelane_engine::Result<(moelane_engine::tier::ColdReply, u64, usize)> {
        let r = self.inner.recv_device()?;
        self.count_reply(r.2);
        Ok(r)
    }
}

/// Where the primary's end of an NCCL link lives: its GPU and the model's hidden size.
#[derive(Clone, Copy)]
pub struct NcclEnd {
    pub ordinal: usize,
    pub hidden: usize,
}

/// Opens a data link of `kind` ("tcp", "shm", "nccl") to `endpoint`, as REGISTER answered.
pub fn open_link(
    kind: &str,
    endpoint: &str,
    timeout: Duration,
    nccl: Option<NcclEnd>,
) -> moelane_engine::Result<Box<dyn RemoteTier>> {
    Ok(match kind {
        "nccl" => {
            moelane_link::nccl::available()?;
            let end = nccl.ok_or_else(|| {
                moelane_engine::Error::Invalid(
                    "the nccl link needs the primary on a GPU (--primary-device cuda:N)".into(),
                )
            })?;
            let id = moelane_link::nccl::NcclId::from_hex(endpoint)?;
            Box::new(moelane_link::nccl::NcclTier::connect(
                end.ordinal,
                &id,
                end.hidden,
                timeout,
            )?)
        }
        "tcp" => Box::new(moelane_link::tcp::TcpTier::connect(endpoint, timeout)?),
        "shm" => Box::new(moelane_link::shm::ShmTier::open(
            Path::new(endpoint),
            timeout,
        )?),
        other => {
            return Err(moelane_engine::Error::Invalid(format!(
                "--link {other:?}: choose tcp, shm or nccl"
            )));
        }
    })
}
