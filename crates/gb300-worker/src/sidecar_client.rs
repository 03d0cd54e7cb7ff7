//! The primary's client of a sidecar process: REGISTER under a fencing token (and the data
//! link that REGISTER answers with), and the swap protocol's messages as the coordinator's
//! [`Participant`] for that tier. A status from the sidecar keeps its category as the
//! swap step's fault.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use moelane_engine::rowmap::Rowmap;
use moelane_proto::control::*;
use moelane_proto::Category;
use moelane_residency_actor::{Participant, SwapError};
use tonic::Status;

/// A gRPC status from the sidecar as a swap step's failure, keeping its category.
pub fn swap_error(s: &Status, at: &str) -> SwapError {
    let fault = moelane_engine::error::Fault::from_name(Category::of(s).as_str());
    SwapError::new(fault, format!("{at}: {}", s.message()))
}

/// Installs a data link that REGISTER answered with (the primary opens it).
pub type OnLink = Arc<dyn Fn(&RegisterReply) -> Result<(), SwapError> + Send + Sync>;

/// What a link needs sent with REGISTER, made fresh for each (the ipc link's reply box).
pub type LinkParams = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

/// A sidecar process, driven over its control API.
pub struct RemoteSidecar {
    pub client:
        moelane_proto::control::sidecar_client::SidecarClient<moelane_proto::auth::AuthChannel>,
    pub model: String,
    /// The fencing token of this coordinator's registration: fresh at every primary start,
    /// and raised at every REGISTER, so that a late REGISTER (or anything sent under an older
    /// one) is refused.
    pub incarnation: Arc<AtomicU64>,
    /// The data link to reopen on resync ("tcp"/"shm").
    pub link: String,
    pub on_link: Option<OnLink>,
    /// Made before every REGISTER, sent as its `link_params`.
    pub link_params: Option<LinkParams>,
}

/// This primary process's id, as it registers with its sidecar and heartbeats (random at its
/// start): a sidecar serves one primary and tells them apart by it.
pub fn process_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let mut b = [0u8; 16];
        if getrandom::fill(&mut b).is_err() {
            // (no random source: the process and the time still tell two primaries apart)
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            b[..4].copy_from_slice(&std::process::id().to_le_bytes());
            b[4..].copy_from_slice(&t.to_le_bytes()[..12]);
        }
        b.iter().map(|x| format!("{x:02x}")).collect()
    })
}

impl RemoteSidecar {
    fn inc(&self) -> u64 {
        self.incarnation.load(Ordering::SeqCst)
    }

    /// REGISTER under a new token: the sidecar adopts `map` and opens a data link of
    /// `self.link`.
    pub async fn register(&self, map: &Rowmap) -> Result<RegisterReply, Status> {
        // above our last token and above whatever the sidecar obeys now (a predecessor of
        // this process, or a clock that stepped back)
        let theirs = match self
            .client
            .clone()
            .health(SidecarHealthRequest::default())
            .await
        {
            Ok(h) => h.into_inner().incarnation,
            Err(_) => 0,
        };
        let token = self.inc().max(theirs) + 1;
        self.incarnation.store(token, Ordering::SeqCst);
        let rowmap_json = map
            .to_json()
            .map_err(|e| Category::Internal.status(e.to_string()))?;
        let link_params = match &self.link_params {
            Some(f) => f().map_err(|e| Category::Unavailable.status(e))?,
            None => String::new(),
        };
        self.client
            .clone()
            .register(RegisterRequest {
                model: self.model.clone(),
                link: self.link.clone(),
                map_epoch: map.epoch,
                rowmap_json,
                incarnation: token,
                protocol: moelane_proto::PROTOCOL,
                build: moelane_proto::BUILD.into(),
                link_params,
                primary: process_id().into(),
            })
            .await
            .map(|r| r.into_inner())
            .and_then(|r| {
                moelane_proto::check_protocol("sidecar", r.protocol, &r.build)
                    .map_err(|e| Category::BadRequest.status(e))?;
                Ok(r)
            })
    }
}

impl Participant for RemoteSidecar {
    fn name(&self) -> &'static str {
        "sidecar"
    }
    fn prepare<'a>(
        &'a self,
        base: u64,
        next: &'a Rowmap,
        incoming: Vec<moelane_engine::swap::Incoming>,
    ) -> futures::future::BoxFuture<'a, Result<(), SwapError>> {
        let mut c = self.client.clone();
        Box::pin(async move {
            let rowmap_json = next
                .to_json()
                .map_err(|e| SwapError::internal(e.to_string()))?;
            let incoming = incoming
                .into_iter()
                .map(|(l, e, checksum)| Staged {
                    layer: l as u32,
                    expert: e as u32,
                    checksum,
                })
                .collect();
            c.prepare(moelane_telemetry::request(PrepareRequest {
                epoch: next.epoch,
                rowmap_json,
                incoming,
                base_epoch: base,
                incarnation: self.inc(),
            }))
            .await
            .map(|_| ())
            .map_err(|s| swap_error(&s, "sidecar PREPARE"))
        })
    }
    fn release(&self, epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        let mut c = self.client.clone();
        Box::pin(async move {
            c.release(moelane_telemetry::request(ReleaseRequest {
                epoch,
                incarnation: self.inc(),
            }))
            .await
            .map(|_| ())
            .map_err(|s| swap_error(&s, "sidecar RELEASE"))
        })
    }
    fn abort(&self, epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        let mut c = self.client.clone();
        Box::pin(async move {
            c.abort(moelane_telemetry::request(AbortRequest {
                epoch,
                incarnation: self.inc(),
            }))
            .await
            .map(|_| ())
            .map_err(|s| swap_error(&s, "sidecar ABORT"))
        })
    }
    fn resync<'a>(
        &'a self,
        map: &'a Rowmap,
    ) -> futures::future::BoxFuture<'a, Result<u64, SwapError>> {
        Box::pin(async move {
            let rep = self.register(map).await.map_err(|s| {
                // a sidecar that did not answer did not refuse anything
                // (a sidecar's own errors carry their category; a transport's do not)
                let unreached = s.metadata().get("moelane-error").is_none()
                    && matches!(
                        s.code(),
                        tonic::Code::Unavailable
                            | tonic::Code::DeadlineExceeded
                            | tonic::Code::Cancelled
                            | tonic::Code::Unknown
                    );
                let at = if unreached {
                    "the sidecar could not be reached to register"
                } else {
                    "the sidecar refused registration"
                };
                swap_error(&s, at)
            })?;
            if let Some(f) = &self.on_link {
                f(&rep).map_err(|e| e.context("opening the data link"))?;
            }
            Ok(rep.highest_epoch)
        })
    }
}
