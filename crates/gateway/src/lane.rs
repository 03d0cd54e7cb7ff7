//! How the gateway reaches a lane: one small trait, a gRPC implementation.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::*;
use moelane_proto::Category;

#[derive(Clone, Debug)]
pub struct LaneError {
    pub category: Category,
    pub message: String,
}

impl From<tonic::Status> for LaneError {
    fn from(s: tonic::Status) -> Self {
        LaneError {
            category: Category::of(&s),
            message: s.message().to_string(),
        }
    }
}

pub type EventStream = BoxStream<'static, Result<GenerateEvent, LaneError>>;

/// A lane's answer to a health check.
#[derive(Clone, Debug, Default)]
pub struct Health {
    /// It takes new requests (its scheduler answers, its sidecar link is up, it is not
    /// draining).
    pub ok: bool,
    /// Its primary is draining: it finishes what it runs and takes nothing new.
    pub draining: bool,
    /// Why it is not ok (empty when ok).
    pub reason: String,
    pub model: String,
    pub map_epoch: u64,
    pub link: String,
    /// The lane's build (empty: a build from before it was reported).
    pub build: String,
    /// Unique per primary process: a restarted lane answers another.
    pub incarnation: u64,
    /// Why the lane computes its cold experts itself (empty: it does not).
    pub degraded: String,
}

impl From<HealthReply> for Health {
    fn from(h: HealthReply) -> Self {
        Health {
            ok: h.ok,
            draining: h.draining,
            reason: h.reason,
            model: h.model,
            map_epoch: h.map_epoch,
            link: h.link,
            build: h.build,
            incarnation: h.incarnation,
            degraded: h.degraded,
        }
    }
}

/// A lane as the gateway sees it. Dropping a generate stream cancels the request.
pub trait Lane: Send + Sync {
    fn name(&self) -> &str;
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, LaneError>>;
    fn health(&self) -> BoxFuture<'_, Result<Health, LaneError>>;
    fn stats(&self) -> BoxFuture<'_, Result<StatsReply, LaneError>>;
}

/// A lane whose primary is reached over gRPC.
pub struct GrpcLane {
    name: String,
    client: PrimaryClient<moelane_proto::auth::AuthChannel>,
}

impl GrpcLane {
    /// Connects lazily: the first call dials, and a lane that is down fails that call.
    /// HTTP/2 keep-alive pings find a primary that stopped answering (a frozen process, a
    /// cut link) while a stream is open, so the stream fails instead of hanging.
    pub fn new(url: &str) -> Result<Self, LaneError> {
        Self::named(url, url)
    }

    /// A lane dialled at `url` and known as `name` (a DNS-resolved address keeps the name it
    /// was found under in its label).
    pub fn named(name: &str, url: &str) -> Result<Self, LaneError> {
        use std::time::Duration;
        let ch = moelane_proto::tls::endpoint(url)
            .map_err(|e| LaneError {
                category: Category::BadRequest,
                message: format!("lane url {url:?}: {e}"),
            })?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(2))
            .keep_alive_timeout(Duration::from_secs(3))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(GrpcLane {
            name: name.to_string(),
            // a long prompt's log-probabilities come a chunk at a time, each far under this
            client: PrimaryClient::new(moelane_proto::auth::attach(ch))
                .max_decoding_message_size(64 << 20),
        })
    }
}

impl Lane for GrpcLane {
    fn name(&self) -> &str {
        &self.name
    }

    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, LaneError>> {
        let mut c = self.client.clone();
        Box::pin(async move {
            // the request's trace continues on the primary (context in gRPC metadata)
            let s = c
                .generate(moelane_telemetry::request(req))
                .await?
                .into_inner();
            Ok(s.map(|r| r.map_err(LaneError::from)).boxed())
        })
    }

    fn health(&self) -> BoxFuture<'_, Result<Health, LaneError>> {
        let mut c = self.client.clone();
        Box::pin(async move { Ok(c.health(HealthRequest {}).await?.into_inner().into()) })
    }

    fn stats(&self) -> BoxFuture<'_, Result<StatsReply, LaneError>> {
        let mut c = self.client.clone();
        Box::pin(async move { Ok(c.stats(StatsRequest {}).await?.into_inner()) })
    }
}
