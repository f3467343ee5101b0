//! The prefill part of a request: the prefill worker computes the prompt's KV into the decode
//! worker's reservation and answers with the first token. A worker that fails or vanishes is
//! replaced by another while the reservation's lease holds (at most `PREFILL_ATTEMPTS`
//! workers, counted in `pd_prefill_retries_total`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::{OutputTracker, SamplingParams, TextSide};
use pd_proto::v1 as pb;
use pd_telemetry::metrics::RouterMetrics;
use pd_telemetry::opentelemetry::trace::TraceContextExt;
use pd_telemetry::opentelemetry::{Context, KeyValue};
use pd_telemetry::RequestClass;
use tonic::transport::Channel;

use crate::error::RouterError;
use crate::record::PrefillTimings;
use crate::schedule::Scheduler;
use crate::workers::Picked;

/// Prefill attempts per request (each on another worker).
pub const PREFILL_ATTEMPTS: usize = 3;

type Client = pb::prefill_worker_client::PrefillWorkerClient<Channel>;

/// A worker request carrying the trace context `cx` and the traffic class.
pub fn traced<T>(message: T, cx: &Context, class: &RequestClass) -> tonic::Request<T> {
    let mut request = pd_telemetry::otel::request_with_context(message, cx);
    if let Ok(v) = class.as_str().parse() {
        request.metadata_mut().insert(RequestClass::HEADER, v);
    }
    request
}

/// One request's prefill, with what a retry needs.
#[derive(Debug)]
pub struct PrefillCall {
    pub scheduler: Arc<Scheduler>,
    /// The worker the route chose (taken by the first attempt).
    pub first: Option<Picked<Client>>,
    pub request: pb::PrefillRequest,
    /// The decode worker's lease ends here: no attempt after it.
    pub deadline: Instant,
    pub cx: Context,
    pub class: RequestClass,
    pub metrics: RouterMetrics,
    /// For the first token's text.
    pub text: Arc<TextSide>,
    pub params: SamplingParams,
}

/// What a successful prefill gives the relay.
#[derive(Debug, Clone)]
pub struct Prefilled {
    pub worker: String,
    pub timings: PrefillTimings,
    pub first_token: u32,
    /// The first token's text, exactly as the decode worker's output tracker makes it.
    pub first_text: String,
    pub first_logprobs: Option<pb::TokenLogprobs>,
}

impl PrefillCall {
    /// Prefills on `first`, then on other workers while the lease holds.
    pub async fn run(mut self) -> Result<Prefilled, RouterError> {
        let mut tried = Vec::new();
        let mut next = self.first.take();
        let mut last_error = RouterError::NoWorker("prefill");
        for attempt in 0..PREFILL_ATTEMPTS {
            let Some(left) = self.deadline.checked_duration_since(Instant::now()) else { break };
            let picked = match next.take() {
                Some(p) => p,
                None => match self.scheduler.retry_prefill_worker(&tried).await {
                    Some(addr) => {
                        match self.scheduler.pools.prefill_client(&addr, "retry: shortest estimated wait".into()) {
                            Ok(p) => p,
                            Err(e) => return Err(if tried.is_empty() { e } else { last_error }),
                        }
                    }
                    None => return Err(last_error),
                },
            };
            if attempt > 0 {
                let attributes = vec![
                    KeyValue::new("pd.prefill.worker", picked.addr.clone()),
                    KeyValue::new("pd.prefill.why", picked.why.clone()),
                ];
                self.cx.span().add_event("prefill.retry", attributes);
                self.metrics.prefill_retries.inc();
            }
            let addr = picked.addr.clone();
            match self.attempt(picked, left).await {
                Ok(response) => return self.prefilled(addr, response),
                Err((error, retryable)) => {
                    last_error = error;
                    tried.push(addr);
                    if !retryable {
                        break;
                    }
                }
            }
        }
        Err(last_error)
    }

    /// One worker's try: the response, or the error and whether another worker may succeed.
    async fn attempt(
        &self,
        picked: Picked<Client>,
        left: Duration,
    ) -> Result<pb::PrefillResponse, (RouterError, bool)> {
        let Picked { addr, mut client, .. } = picked;
        let request = traced(self.request.clone(), &self.cx, &self.class);
        match tokio::time::timeout(left, client.prefill(request)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => {
                use tonic::Code;
                let retryable =
                    matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Internal);
                self.scheduler.pools.prefill.forget(&addr);
                Err((RouterError::Worker { stage: "prefill", message: status.message().to_string() }, retryable))
            }
            Err(_) => Err((RouterError::Worker { stage: "prefill", message: "timed out".into() }, true)),
        }
    }

    fn prefilled(&self, worker: String, r: pb::PrefillResponse) -> Result<Prefilled, RouterError> {
        let mut tracker = OutputTracker::new(self.params.clone(), &self.text.tokenizer);
        let first = tracker.push(r.first_token, &self.text.tokenizer).map_err(|e| RouterError::Worker {
            stage: "prefill",
            message: format!("first token {}: {e}", r.first_token),
        })?;
        let timings = PrefillTimings {
            queue_ms: r.queue_ms,
            prefill_ms: r.prefill_ms,
            kv_commit_ms: r.kv_commit_ms,
            cached_tokens: r.cached_tokens,
        };
        Ok(Prefilled {
            worker,
            timings,
            first_token: r.first_token,
            first_text: first.text_delta,
            first_logprobs: r.first_logprobs,
        })
    }
}
