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
    pub deadline: StallDeadline,
}

/// The per-step deadline of a reply, sized from the round trips seen: a decaying maximum of
/// the time per expert pick, times the picks of the request, times a margin, never under
/// `floor` (the stall detection time) nor over `cap` (the link timeout). Before any round
/// trip it is `cap`. A sidecar that stops answering (SIGSTOP, a cut link) fails the step in
/// about `floor`; a large prefill, which takes long for a reason, gets room in proportion.
#[derive(Clone, Debug)]
pub struct StallDeadline {
    pub floor: Duration,
    pub cap: Duration,
    per_pick_ns: f64,
    sent: Option<(std::time::Instant, usize)>,
    /// Round trips seen on this link (the deadline is the cap until a few were).
    seen: u32,
    /// Bumped each time a new link is installed: a new link (a restarted sidecar, warming
    /// up) starts from the cap again.
    pub link_gen: Arc<std::sync::atomic::AtomicU64>,
    gen_seen: u64,
}

impl StallDeadline {
    /// The margin over the slowest time per pick seen.
    const MARGIN: f64 = 8.0;
    /// Round trips a link serves at the cap before its own deadline applies.
    const WARM_UP: u32 = 8;

    pub fn new(floor: Duration, cap: Duration) -> Self {
        StallDeadline {
            floor: floor.min(cap),
            cap,
            per_pick_ns: 0.0,
            sent: None,
            seen: 0,
            link_gen: Default::default(),
            gen_seen: 0,
        }
    }

    fn sending(&mut self, picks: usize) {
        let g = self.link_gen.load(std::sync::atomic::Ordering::Acquire);
        if g != self.gen_seen {
            self.gen_seen = g;
            self.per_pick_ns = 0.0;
            self.seen = 0;
        }
        self.sent = Some((std::time::Instant::now(), picks.max(1)));
    }

    /// The deadline of the reply to the request sent last.
    pub fn for_reply(&self) -> Duration {
        let Some((_, picks)) = self.sent else {
            return self.cap;
        };
        if self.per_pick_ns <= 0.0 || self.seen < Self::WARM_UP {
            return self.cap;
        }
        let ns = self.per_pick_ns * picks as f64 * Self::MARGIN;
        Duration::from_secs_f64((ns * 1e-9).min(self.cap.as_secs_f64()))
            .max(self.floor)
            .min(self.cap)
    }

    fn received(&mut self) {
        if let Some((t, picks)) = self.sent.take() {
            let per = t.elapsed().as_nanos() as f64 / picks as f64;
            // a decaying maximum: one slow round trip raises it at once, it fades over
            // about a thousand round trips
            self.per_pick_ns = per.max(self.per_pick_ns * 0.999);
            self.seen = self.seen.saturating_add(1);
        }
    }
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
        self.deadline.sending(req.picks.len());
        self.call(|t| t.send(req))
    }
    fn recv(&mut self) -> moelane_engine::Result<moelane_engine::tier::ColdReply> {
        let d = self.deadline.for_reply();
        let r = self.call(|t| {
            t.set_reply_deadline(d);
            t.recv()
        });
        if r.is_ok() {
            self.deadline.received();
        }
        r
    }
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn device_ordinal(&self) -> Option<usize> {
        self.slot.lock().ok()?.as_ref()?.device_ordinal()
    }
    fn device_mailbox(&mut self) -> Option<moelane_engine::tier::MailboxPtrs> {
        self.slot.lock().ok()?.as_mut()?.device_mailbox()
    }
    fn device_failed(&mut self) {
        // the device saw the link fail: dropped, and the supervisor re-registers
        let mut g = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if g.take().is_some() {
            self.broken.notify_one();
        }
    }
    fn reply_deadline(&self) -> Option<Duration> {
        // the device's waits are per layer: a stall is one past the detection time
        Some(self.deadline.floor)
    }
    unsafe fn send_device(
        &mut self,
        req: moelane_engine::tier::ColdRequest,
        acts: u64,
        acts_len: usize,
    ) -> moelane_engine::Result<()> {
        self.deadline.sending(req.picks.len());
        // SAFETY: the caller's guarantee, passed on
        self.call(|t| unsafe { t.send_device(req, acts, acts_len) })
    }
    fn recv_device(
        &mut self,
    ) -> moelane_engine::Result<(moelane_engine::tier::ColdReply, u64, usize)> {
        let d = self.deadline.for_reply();
        let r = self.call(|t| {
            t.set_reply_deadline(d);
            t.recv_device()
        });
        if r.is_ok() {
            self.deadline.received();
        }
        r
    }
}

#[cfg(test)]
mod deadline_tests {
    use super::StallDeadline;
    use std::time::Duration;

    #[test]
    fn the_deadline_follows_round_trips_between_floor_and_cap() {
        let mut d = StallDeadline::new(Duration::from_secs(1), Duration::from_secs(30));
        for _ in 0..StallDeadline::WARM_UP {
            d.sending(4);
            assert_eq!(
                d.for_reply(),
                Duration::from_secs(30),
                "warming up: the cap"
            );
            std::thread::sleep(Duration::from_millis(4));
            d.received();
        }
        d.sending(4);
        // ~1 ms a pick x 4 picks x 8 = ~32 ms: the floor
        assert_eq!(d.for_reply(), Duration::from_secs(1));
        // a prefill of 4,000 picks gets room in proportion (~32 s, capped at 30 s)
        d.sending(4000);
        let big = d.for_reply();
        assert!(big > Duration::from_secs(10), "{big:?}");
        assert!(big <= Duration::from_secs(30), "{big:?}");
        // a new link starts over at the cap
        d.received();
        d.link_gen.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        d.sending(4);
        assert_eq!(d.for_reply(), Duration::from_secs(30));
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
    fn device_mailbox(&mut self) -> Option<moelane_engine::tier::MailboxPtrs> {
        self.inner.device_mailbox()
    }
    fn device_failed(&mut self) {
        self.inner.device_failed()
    }
    fn set_reply_deadline(&mut self, deadline: Duration) {
        self.inner.set_reply_deadline(deadline)
    }
    fn reply_deadline(&self) -> Option<Duration> {
        self.inner.reply_deadline()
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
/// Over TCP with cluster TLS the sidecar's certificate is checked for `host` (the host the
/// primary reached the sidecar at for control), or for the endpoint's own host without one.
pub fn open_link(
    kind: &str,
    endpoint: &str,
    host: Option<&str>,
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
        "tcp" => Box::new(match host {
            Some(h) => moelane_link::tcp::TcpTier::connect_named(endpoint, h, timeout)?,
            None => moelane_link::tcp::TcpTier::connect(endpoint, timeout)?,
        }),
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
