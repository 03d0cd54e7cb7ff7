//! Every metric moelane exports, named in one place: `moelane_` prefix, the unit in the
//! name, `_total` only on counters. [`describe`] registers help texts and units;
//! docs/OBSERVABILITY.md lists them with their labels.

/// gauge = 1; labels: version, role
pub const BUILD_INFO: &str = "moelane_build_info";

// gateway
/// counter; labels: route, code
pub const HTTP_REQUESTS: &str = "moelane_http_requests_total";
/// histogram (whole request, to the last streamed byte); labels: route
pub const REQUEST_DURATION: &str = "moelane_request_duration_seconds";
/// histogram
pub const TIME_TO_FIRST_TOKEN: &str = "moelane_time_to_first_token_seconds";
/// histogram
pub const INTER_TOKEN_LATENCY: &str = "moelane_inter_token_latency_seconds";
/// counter: tokens streamed to clients
pub const GENERATED_TOKENS: &str = "moelane_generated_tokens_total";
/// counter
pub const PROMPT_TOKENS: &str = "moelane_prompt_tokens_total";
/// gauge 1/0; labels: lane
pub const LANE_UP: &str = "moelane_lane_up";
/// gauge 1/0; labels: lane
pub const LANE_DRAINING: &str = "moelane_lane_draining";
/// gauge; labels: lane
pub const LANE_INFLIGHT: &str = "moelane_lane_inflight_requests";
/// counter: lanes ejected by the circuit breaker; labels: lane
pub const LANE_EJECTIONS: &str = "moelane_lane_ejections_total";
/// counter: requests sent again to another lane before their first token; labels: reason
pub const REQUEST_RETRIES: &str = "moelane_request_retries_total";
/// counter: requests that ended in an error after tokens were sent; labels: reason
pub const STREAMS_CUT: &str = "moelane_streams_cut_total";
/// gauge 1/0: this process is draining (stopping: it takes nothing new)
pub const DRAINING: &str = "moelane_draining";
/// gauge: responses the gateway keeps for `previous_response_id` (`--responses-store-mb`)
pub const RESPONSES_STORED: &str = "moelane_responses_stored";
/// gauge: bytes of the kept responses (their conversations and response objects, as JSON)
pub const RESPONSES_STORED_BYTES: &str = "moelane_responses_stored_bytes";
/// gauge 1/0: the primary computes its cold experts itself (its sidecar is lost, --degraded)
pub const LANE_DEGRADED: &str = "moelane_lane_degraded";
/// counter: cold experts a degraded primary read from its checkpoint
pub const DEGRADED_LOADS: &str = "moelane_degraded_expert_loads_total";
/// counter: cold experts a degraded primary dropped to stay within --degraded-memory
pub const DEGRADED_EVICTIONS: &str = "moelane_degraded_expert_evictions_total";
/// gauge: bytes of cold experts a degraded primary holds
pub const DEGRADED_BYTES: &str = "moelane_degraded_resident_bytes";

// primary
/// gauge: requests waiting for admission
pub const QUEUE_DEPTH: &str = "moelane_queue_depth_requests";
/// gauge: sequences in the running batch
pub const BATCH_SIZE: &str = "moelane_running_batch_sequences";
/// gauge
pub const KV_BLOCKS_USED: &str = "moelane_kv_cache_used_blocks";
/// gauge
pub const KV_BLOCKS_FREE: &str = "moelane_kv_cache_free_blocks";
/// counter: running sequences preempted because the KV cache was full (their blocks freed,
/// their prompt and generated tokens recomputed when they are admitted again)
pub const KV_PREEMPTIONS: &str = "moelane_kv_preemptions_total";
/// counter, label action: what the fair share among clients did (`over_batch`: a sequence
/// of a client with nothing running admitted past a full batch; `refused`: a full queue's
/// latest request of the client holding the most places refused for another client's;
/// `prefill_deferred`: a prompt's chunk sat out a step, its client served more of the steps'
/// time than another)
pub const FAIR_SHARE: &str = "moelane_fair_share_actions_total";
/// counter: steps that fed part of a sequence's prompt (or recompute), the rest left for the
/// next steps (the step's token bound, `--max-step-tokens`, or a prompt's log-probabilities)
pub const PREFILL_CHUNKS: &str = "moelane_prefill_chunks_total";
/// histogram: one constrained request's grammar work in a step on the step loop's thread (its
/// token mask applied, the picked token followed)
pub const GRAMMAR_STEP: &str = "moelane_grammar_step_seconds";
/// counter: steps a constrained request sat out, its logits held, because its grammar's
/// mask (made on the slow worker: its masks are costly) was not ready when the step ended
pub const GRAMMAR_HELD: &str = "moelane_grammar_held_steps_total";
/// histogram: one constrained request's next token mask made, on the mask worker while the
/// step's forward pass runs
pub const GRAMMAR_MASK: &str = "moelane_grammar_mask_seconds";
/// histogram: one engine step (every running sequence advanced one token)
pub const STEP_DURATION: &str = "moelane_step_duration_seconds";
/// counter: tokens the primary generated (lane side)
pub const LANE_TOKENS: &str = "moelane_lane_generated_tokens_total";
/// counter: requests ended on the lane; labels: outcome (finished, cancelled, failed)
pub const LANE_REQUESTS: &str = "moelane_lane_requests_total";
/// counter; labels: layer
pub const HOT_PICKS: &str = "moelane_expert_hot_picks_total";
/// counter; labels: layer
pub const COLD_PICKS: &str = "moelane_expert_cold_picks_total";
/// counter (float, seconds): time the primary waited on the sidecar; labels: layer
pub const SIDECAR_WAIT: &str = "moelane_sidecar_wait_seconds_total";
/// counter (float, seconds): time inside engine steps (the wall time wait shares are taken of)
pub const STEP_TIME: &str = "moelane_step_time_seconds_total";
/// gauge: cold picks / all picks over the last scrape interval; labels: layer
pub const COLD_SHARE: &str = "moelane_cold_share_ratio";
/// counter: bytes over the primary<->sidecar link; labels: link (inproc, shm, tcp), side
/// (primary, sidecar), direction (sent, received)
pub const LINK_BYTES: &str = "moelane_link_bytes_total";
/// histogram: from sending a layer's cold picks to taking their reply; labels: link
pub const LINK_ROUND_TRIP: &str = "moelane_link_round_trip_seconds";

// residency
/// gauge: the committed map epoch; labels: tier (primary, sidecar)
pub const MAP_EPOCH: &str = "moelane_map_epoch";
/// counter: swap phases; labels: phase (prepare, commit, release, abort), outcome (ok, error)
pub const SWAP_PHASES: &str = "moelane_swap_phases_total";
/// counter: swap batches; labels: outcome (committed, aborted, rejected: no moves or moves that cannot be made)
pub const SWAPS: &str = "moelane_swaps_total";
/// histogram: one swap batch, PREPARE to RELEASE
pub const SWAP_DURATION: &str = "moelane_swap_duration_seconds";
/// counter: experts moved by committed swaps; labels: to (hot, cold)
pub const EXPERTS_MOVED: &str = "moelane_experts_moved_total";

// sidecar
/// counter
pub const SIDECAR_REQUESTS: &str = "moelane_sidecar_requests_total";
/// counter
pub const SIDECAR_PICKS: &str = "moelane_sidecar_picks_total";
/// counter (float, seconds)
pub const SIDECAR_COMPUTE: &str = "moelane_sidecar_compute_seconds_total";
/// gauge: experts resident in the sidecar's bank
pub const SIDECAR_EXPERTS: &str = "moelane_sidecar_resident_experts";
/// counter: expert weight bytes the sidecar's computations read
pub const SIDECAR_WEIGHT_BYTES: &str = "moelane_sidecar_weight_read_bytes_total";
/// gauge: the host's measured read bandwidth (a sidecar started with --probe-bandwidth)
pub const HOST_READ_BANDWIDTH: &str = "moelane_host_read_bandwidth_bytes_per_second";

/// Every metric name, for checks that a dashboard names only real ones.
pub const ALL: &[&str] = &[
    BUILD_INFO,
    HTTP_REQUESTS,
    REQUEST_DURATION,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    GENERATED_TOKENS,
    PROMPT_TOKENS,
    LANE_UP,
    LANE_DRAINING,
    LANE_INFLIGHT,
    LANE_EJECTIONS,
    REQUEST_RETRIES,
    STREAMS_CUT,
    DRAINING,
    RESPONSES_STORED,
    RESPONSES_STORED_BYTES,
    LANE_DEGRADED,
    DEGRADED_LOADS,
    DEGRADED_EVICTIONS,
    DEGRADED_BYTES,
    QUEUE_DEPTH,
    BATCH_SIZE,
    KV_BLOCKS_USED,
    KV_BLOCKS_FREE,
    KV_PREEMPTIONS,
    FAIR_SHARE,
    PREFILL_CHUNKS,
    GRAMMAR_STEP,
    GRAMMAR_MASK,
    GRAMMAR_HELD,
    STEP_DURATION,
    LANE_TOKENS,
    LANE_REQUESTS,
    HOT_PICKS,
    COLD_PICKS,
    SIDECAR_WAIT,
    STEP_TIME,
    COLD_SHARE,
    LINK_BYTES,
    LINK_ROUND_TRIP,
    MAP_EPOCH,
    SWAP_PHASES,
    SWAPS,
    SWAP_DURATION,
    EXPERTS_MOVED,
    SIDECAR_REQUESTS,
    SIDECAR_PICKS,
    SIDECAR_COMPUTE,
    SIDECAR_EXPERTS,
    SIDECAR_WEIGHT_BYTES,
    HOST_READ_BANDWIDTH,
];

/// Registers help texts (and units) with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        BUILD_INFO,
        "moelane build: version and role of this process"
    );
    describe_counter!(HTTP_REQUESTS, "HTTP requests by route and status code");
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Generation requests, from arrival to the last byte sent"
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "Time from arrival to the first generated token"
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY,
        Unit::Seconds,
        "Time between consecutive generated tokens of a request"
    );
    describe_counter!(GENERATED_TOKENS, "Tokens generated for clients");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens of admitted requests");
    describe_gauge!(LANE_UP, "1 if the lane answered its last health check");
    describe_gauge!(LANE_DRAINING, "1 if the lane is draining (no new requests)");
    describe_gauge!(LANE_INFLIGHT, "Requests in flight on the lane");
    describe_counter!(
        LANE_EJECTIONS,
        "Times the circuit breaker ejected the lane after failed requests"
    );
    describe_counter!(
        REQUEST_RETRIES,
        "Requests sent again to another lane after a failure before their first token"
    );
    describe_counter!(
        STREAMS_CUT,
        "Requests that ended in an error after tokens were sent (the client got an error, never a finish)"
    );
    describe_gauge!(
        LANE_DEGRADED,
        "1 while the primary computes its cold experts itself: its sidecar is lost (--degraded)"
    );
    describe_counter!(
        DEGRADED_LOADS,
        "Cold experts a degraded primary read from its checkpoint (on demand, checksums verified)"
    );
    describe_counter!(
        DEGRADED_EVICTIONS,
        "Cold experts a degraded primary dropped, least recently used first, to stay within --degraded-memory"
    );
    describe_gauge!(
        DEGRADED_BYTES,
        Unit::Bytes,
        "Bytes of cold experts a degraded primary holds (0 when its sidecar answers)"
    );
    describe_gauge!(
        RESPONSES_STORED,
        "Responses the gateway keeps for previous_response_id and GET /v1/responses/{id}"
    );
    describe_gauge!(
        RESPONSES_STORED_BYTES,
        Unit::Bytes,
        "Bytes the kept responses take (their conversations and response objects as JSON); the oldest are dropped past --responses-store-mb"
    );
    describe_gauge!(
        DRAINING,
        "1 while this process drains: it finishes what it runs and takes nothing new"
    );
    describe_gauge!(QUEUE_DEPTH, "Requests waiting for admission to the batch");
    describe_gauge!(BATCH_SIZE, "Sequences in the running batch");
    describe_gauge!(KV_BLOCKS_USED, "KV cache blocks in use");
    describe_gauge!(KV_BLOCKS_FREE, "KV cache blocks free");
    describe_histogram!(
        GRAMMAR_STEP,
        Unit::Seconds,
        "One constrained request's grammar work on the step loop: its mask applied and the pick followed"
    );
    describe_histogram!(
        GRAMMAR_MASK,
        Unit::Seconds,
        "One constrained request's next token mask, made while the step runs"
    );
    describe_counter!(
        GRAMMAR_HELD,
        "Steps a constrained request sat out, its logits held, because its grammar's mask (costly: made on the slow worker) was not ready"
    );
    describe_counter!(
        KV_PREEMPTIONS,
        "Running sequences preempted when the KV cache filled (recomputed on readmission)"
    );
    describe_counter!(
        FAIR_SHARE,
        "What the fair share among clients did: over_batch (a client with nothing running admitted past a full batch) refused (a full queue's place given up by the client holding the most) or prefill_deferred (a prompt's chunk sat out a step: its client had more of the steps' time)"
    );
    describe_counter!(
        PREFILL_CHUNKS,
        "Steps that fed part of a sequence's prompt, the rest left for the next steps (the step's token bound)"
    );
    describe_histogram!(
        STEP_DURATION,
        Unit::Seconds,
        "One engine step: every running sequence advanced by one token"
    );
    describe_counter!(LANE_TOKENS, "Tokens the lane generated");
    describe_counter!(LANE_REQUESTS, "Requests ended on the lane, by outcome");
    describe_counter!(
        HOT_PICKS,
        "Expert picks computed on the primary, per MoE layer"
    );
    describe_counter!(
        COLD_PICKS,
        "Expert picks computed on the sidecar, per MoE layer"
    );

    describe_gauge!(
        COLD_SHARE,
        "Cold picks over all picks since the previous scrape, per MoE layer"
    );
    describe_counter!(LINK_BYTES, "Bytes over the primary-sidecar link");
    describe_histogram!(
        LINK_ROUND_TRIP,
        Unit::Seconds,
        "From sending one layer's cold picks to taking their reply (overlaps hot compute)"
    );
    describe_gauge!(MAP_EPOCH, "Epoch of the committed rowmap");
    describe_counter!(SWAP_PHASES, "Swap protocol phases by outcome");
    describe_counter!(SWAPS, "Swap batches by outcome");
    describe_histogram!(
        SWAP_DURATION,
        Unit::Seconds,
        "One swap batch from PREPARE to RELEASE (or ABORT)"
    );
    describe_counter!(
        EXPERTS_MOVED,
        "Experts moved by committed swaps, by destination tier"
    );
    describe_counter!(SIDECAR_REQUESTS, "Layer requests the sidecar served");
    describe_counter!(SIDECAR_PICKS, "Expert picks the sidecar computed");

    describe_gauge!(SIDECAR_EXPERTS, "Experts resident in the sidecar's bank");
    describe_counter!(
        SIDECAR_WEIGHT_BYTES,
        Unit::Bytes,
        "Expert weight bytes the sidecar's computations read (each distinct expert of a layer request once)"
    );
    describe_gauge!(
        HOST_READ_BANDWIDTH,
        "The host's read bandwidth in bytes per second, measured once at start over four times the last-level cache"
    );
}

/// Help texts of the float counters (published with [`crate::set_seconds_total`]; the
/// `metrics` crate's counters are integers, and Prometheus's base unit is the second).
pub fn float_help(name: &str) -> &'static str {
    match name {
        SIDECAR_WAIT => {
            "Seconds the primary waited for the sidecar (not hidden by hot compute), per MoE layer"
        }
        STEP_TIME => "Seconds spent inside engine steps",
        SIDECAR_COMPUTE => "Seconds the sidecar spent computing cold experts",
        _ => "moelane float counter",
    }
}
