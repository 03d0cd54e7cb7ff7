//! What the Anthropic and Responses routes share: a request opened on a lane and relayed to
//! the client as the parts of its answer (content, reasoning, tool calls with their arguments
//! in pieces), each route writing them as its own events.

use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use moelane_proto::lane::GenerateRequest;
use moelane_text::agent::Part;
use moelane_text::detok::Detokenizer;
use tracing::Instrument as _;

use crate::error::ApiError;
use crate::lane::EventStream;
use crate::server::{
    finish_of, lane_err, open, put, shutting_down, stream_ended, ActiveGuard, AppState, Timing,
    Tries, ValidRequest, HEAD_START, WAITING,
};

/// Where the parts of an answer go: a route's writer of its own events.
pub(crate) trait PartSink {
    /// Sends `parts`; false when the client left.
    fn send(&mut self, parts: Vec<Part>) -> impl std::future::Future<Output = bool> + Send;
    /// Resolves once the client left (its stream's receiver closed).
    fn closed(&self) -> impl std::future::Future<Output = ()> + Send + '_;
}

/// How a relayed answer ended.
pub(crate) struct Ended {
    pub completion: usize,
    /// The lane's finish (`stop`, `length`), or `stop` for a stop string; none when failed.
    pub finish: Option<String>,
    pub failed: Option<ApiError>,
    /// The stop string that ended it, if one did.
    pub stop_hit: Option<String>,
    /// The answer ended inside a tool call (its calls are not all whole).
    pub cut: bool,
    /// The client left (the sink said so): nothing more is sent.
    pub left: bool,
}

/// Opens `greq` on a lane (retrying before its first token as the chat route does), then
/// answers with a stream whose events `write` produces from the lane's events; `write` runs
/// on its own task until the answer ends or the client leaves. A request whose first event
/// is later than [`HEAD_START`] (queued on a full lane) gets its headers then and waits on in
/// that task; if it then fails to open, `fail` gives the error's events (the API's own error
/// event), since its status has been sent.
pub(crate) async fn open_stream<F, Fut>(
    st: &Arc<AppState>,
    greq: &GenerateRequest,
    deadline: Instant,
    active: ActiveGuard,
    fail: fn(&ApiError) -> Vec<SseEvent>,
    write: F,
) -> Result<Response, ApiError>
where
    F: FnOnce(
            Arc<AppState>,
            String,
            EventStream,
            Tries,
            tokio::sync::mpsc::Sender<SseEvent>,
        ) -> Fut
        + Send
        + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let opening = {
        let (st, greq) = (st.clone(), greq.clone());
        async move {
            let mut tries = Tries::default();
            let (inflight, events) = open(&st, &greq, deadline, &mut tries).await?;
            Ok::<_, ApiError>((inflight, events, tries))
        }
    };
    let mut opening = Box::pin(opening);
    let early = within_head_start(st, &mut opening).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    if early.is_none() {
        let _ = tx.try_send(SseEvent::default().comment(WAITING));
    }
    let st2 = st.clone();
    let relay = async move {
        let _active = active;
        let (inflight, events, tries) = match opened(&st2, early, opening, &tx).await {
            Some(Ok(o)) => o,
            // the client left while its request waited
            None => return,
            Some(Err(err)) => {
                crate::server::count_cut(&err);
                for ev in fail(&err) {
                    if !put(&tx, ev, &st2.shutdown).await {
                        break;
                    }
                }
                return;
            }
        };
        let lane = inflight.lane.name().to_string();
        let _inflight = inflight;
        write(st2, lane, events, tries, tx).await;
    };
    tokio::spawn(relay.instrument(tracing::Span::current()));
    let stream =
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `opening` (a request's lanes being opened) if it is done within [`HEAD_START`]; None if it
/// is not (it goes on: [`opened`]); a stopping gateway's error.
pub(crate) async fn within_head_start<F, T>(
    st: &AppState,
    opening: &mut F,
) -> Result<Option<T>, ApiError>
where
    F: std::future::Future<Output = Result<T, ApiError>> + Unpin,
{
    tokio::select! {
        r = opening => r.map(Some),
        _ = tokio::time::sleep(HEAD_START) => Ok(None),
        _ = st.shutdown.aborted() => Err(shutting_down()),
    }
}

/// What an opening gave: `early`, what [`within_head_start`] took, or else the rest of the
/// opening (its response's headers sent), or None once the client left (the opening dropped,
/// which cancels it).
pub(crate) async fn opened<T>(
    st: &AppState,
    early: Option<T>,
    opening: impl std::future::Future<Output = Result<T, ApiError>>,
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
) -> Option<Result<T, ApiError>> {
    if let Some(o) = early {
        return Some(Ok(o));
    }
    tokio::select! {
        r = opening => Some(r),
        _ = st.shutdown.aborted() => Some(Err(shutting_down())),
        _ = tx.closed() => None,
    }
}

/// Relays a lane's events as parts of the answer to `sink` (which returns false when the
/// client left): tokens detokenised (stop strings honoured), split by the request's markup,
/// the held-back tail given at the end. A lane that fails mid-answer is blamed.
pub(crate) async fn relay_parts(
    st: &AppState,
    vr: &ValidRequest,
    lane: &str,
    mut events: EventStream,
    mut tries: Tries,
    sink: &mut impl PartSink,
) -> Ended {
    let mut timing = Timing::new(true);
    let mut det = Detokenizer::new(vr.stop.clone());
    let mut split = vr.splitter();
    let mut end = Ended {
        completion: 0,
        finish: None,
        failed: None,
        stop_hit: None,
        cut: false,
        left: false,
    };
    let mut aborted = std::pin::pin!(st.shutdown.aborted());
    loop {
        let next = tokio::select! {
            e = events.next() => e,
            _ = &mut aborted => { end.failed = Some(shutting_down()); break; }
            // a client that leaves while no token comes (its sequence waits, preempted or
            // queued): the lane request is dropped, which cancels it, and its places freed
            _ = sink.closed() => { end.left = true; return end; }
        };
        let e = match next {
            Some(Ok(e)) => e,
            Some(Err(e)) => {
                tries.blame(st, lane, e.category).await;
                end.failed = Some(lane_err(lane, &e));
                break;
            }
            None => {
                let e = stream_ended();
                tries.blame(st, lane, e.category).await;
                end.failed = Some(lane_err(lane, &e));
                break;
            }
        };
        if let Some(t) = e.token {
            timing.token();
            end.completion += 1;
            let piece = det.push(vr.token_text(st, t));
            if !sink.send(split.push(&piece)).await {
                end.left = true;
                return end;
            }
            if det.stopped() {
                end.finish = Some("stop".into());
                end.stop_hit = det.stop_hit().map(String::from);
                break;
            }
        }
        if !e.finish_reason.is_empty() {
            match finish_of(&e.finish_reason) {
                Ok(f) => end.finish = Some(f),
                Err(err) => end.failed = Some(lane_err(lane, &err)),
            }
            break;
        }
    }
    drop(events);
    timing.done(
        vr.prompt.len(),
        end.completion,
        end.finish.as_deref().unwrap_or("error"),
    );
    if let Some(err) = &end.failed {
        crate::server::count_cut(err);
    } else {
        let mut tail = split.push(&det.finish());
        end.cut = split.in_call();
        tail.extend(split.finish());
        if !sink.send(tail).await {
            end.left = true;
        }
    }
    end
}
