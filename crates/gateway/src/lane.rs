//! How the gateway reaches a lane: one small trait, a gRPC implementation.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::*;
use moelane_proto::Category;
use tonic::transport::Channel;

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

/// A lane as the gateway sees it. Dropping a generate stream cancels the request.
pub trait Lane: Send + Sync {
    fn name(&self) -> &str;
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, LaneError>>;
    fn health(&self) -> BoxFuture<'_, Result<HealthReply, LaneError>>;
    fn stats(&self) -> BoxFuture<'_, Result<StatsReply, LaneError>>;
}

/// A lane whose primary is reached over gRPC.
pub struct GrpcLane {
    name: String,
    client: PrimaryClient<Channel>,
}

impl GrpcLane {
    /// Connects lazily: the first call dials, and a lane that is down fails that call.
    pub fn new(url: &str) -> Result<Self, LaneError> {
        let ch = Channel::from_shared(url.to_string())
            .map_err(|e| LaneError {
                category: Category::BadRequest,
                message: format!("lane url {url:?}: {e}"),
            })?
            .connect_timeout(std::time::Duration::from_secs(5))
            .connect_lazy();
        Ok(GrpcLane {
            name: url.to_string(),
            client: PrimaryClient::new(ch),
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

    fn health(&self) -> BoxFuture<'_, Result<HealthReply, LaneError>> {
        let mut c = self.client.clone();
        Box::pin(async move { Ok(c.health(HealthRequest {}).await?.into_inner()) })
    }

    fn stats(&self) -> BoxFuture<'_, Result<StatsReply, LaneError>> {
        let mut c = self.client.clone();
        Box::pin(async move { Ok(c.stats(StatsRequest {}).await?.into_inner()) })
    }
}
