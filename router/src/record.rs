//! One request's account at the router: its root span (`router.request`), the client-side
//! latency metrics (TTFT, every inter-token gap, e2e) and the structured record logged when
//! it ends (docs/design.md's fields). Worker timings come from the workers themselves: queue and
//! prefill time from the prefill worker's response, KV transfer and decode time from the
//! decode worker's `Finished` event; nothing here is derived by subtraction.
//!
//! A record dropped without `finish` or `fail` (the client went away) ends as `cancelled`.

use std::time::Instant;

use pd_telemetry::metrics::RouterMetrics;
use pd_telemetry::opentelemetry::KeyValue;
use pd_telemetry::{input_bucket, RequestClass, StageLabels, StageSpan};

use crate::error::RouterError;
use crate::validate::{Kind, ValidRequest};

/// A request from its arrival until it was validated: the root span (`router.request`, child
/// of the client's trace context if it sent one) and `router.queue`, the time before routing
/// (body read, validation, tokenization).
#[derive(Debug)]
pub struct Arrival {
    arrived: Instant,
    root: StageSpan,
    queue: StageSpan,
    /// The caller's own id for the request (`x-request-id`, gRPC `request_id`): a label on
    /// the span and the record, never a key (the router's id keys the KV transfer).
    client_request_id: Option<String>,
}

/// Longest client request id kept (bytes).
pub const MAX_CLIENT_REQUEST_ID: usize = 128;

/// A caller's request id from `field`, checked: 1 to 128 visible ASCII characters (it goes
/// into logs and traces as it is).
pub fn client_request_id(value: &[u8], field: &str) -> Result<String, RouterError> {
    let visible = value.iter().all(|b| (0x21..=0x7e).contains(b));
    if value.is_empty() || value.len() > MAX_CLIENT_REQUEST_ID || !visible {
        let message = format!("`{field}` must be 1 to {MAX_CLIENT_REQUEST_ID} visible ASCII characters");
        return Err(RouterError::invalid(field, message));
    }
    Ok(String::from_utf8_lossy(value).into_owned())
}

impl Arrival {
    pub fn new(parent: &pd_telemetry::opentelemetry::Context) -> Self {
        let root = StageSpan::start("router.request", parent);
        let queue = StageSpan::start("router.queue", root.context());
        Arrival { arrived: Instant::now(), root, queue, client_request_id: None }
    }

    /// Keeps the caller's id for the request as a label.
    pub fn with_client_id(mut self, id: Option<String>) -> Self {
        self.client_request_id = id;
        self
    }

    /// Ends the queue span and opens the request's record (`req` is None when validation
    /// failed: the caller then fails the record with the error).
    pub fn into_record(
        self,
        metrics: RouterMetrics,
        request_id: String,
        class: RequestClass,
        req: Option<&ValidRequest>,
    ) -> RequestRecord {
        let Arrival { arrived, root, queue, client_request_id } = self;
        queue.end();
        if let Some(id) = &client_request_id {
            root.set("pd.client_request_id", id.clone());
        }
        if let Some(r) = req {
            let operation = match r.kind {
                Kind::Chat => "chat",
                Kind::Completion => "text_completion",
            };
            root.set("gen_ai.operation.name", operation);
            root.set("gen_ai.request.model", r.model.clone());
            root.set("gen_ai.request.max_tokens", r.params.max_tokens as i64);
            root.set("gen_ai.request.temperature", r.params.temperature);
            if let Some(top_p) = r.params.top_p {
                root.set("gen_ai.request.top_p", top_p);
            }
            // The seed, given or drawn: any sampled answer can be replayed from its trace.
            root.set("gen_ai.request.seed", r.params.seed as i64);
            if let Some(user) = &r.user {
                root.set("pd.user", user.clone());
            }
        }
        let input_tokens = req.map(|r| r.prompt_tokens.len()).unwrap_or(0);
        let mut record = RequestRecord::new(metrics, request_id, class, input_tokens, arrived, root);
        record.client_request_id = client_request_id;
        record
    }
}

/// What the prefill worker measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillTimings {
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub kv_commit_ms: f64,
    /// Prompt tokens the prefilling worker's prefix cache held (not computed).
    pub cached_tokens: u32,
}

/// What the decode worker measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeTimings {
    pub kv_transfer_ms: f64,
    pub decode_ms: f64,
    pub kv_bytes: u64,
    /// Prompt tokens the decode worker already held (not shipped).
    pub cached_tokens: u32,
}

/// One request's account; see the module docs.
#[derive(Debug)]
pub struct RequestRecord {
    metrics: RouterMetrics,
    pub request_id: String,
    /// The caller's own id, if it sent one (logged beside `request_id`).
    pub client_request_id: Option<String>,
    class: RequestClass,
    input_tokens: usize,
    labels: StageLabels,
    arrived: Instant,
    root: StageSpan,
    pub prefill_worker: String,
    pub decode_worker: String,
    /// Prompt tokens the router expected the chosen decode / prefill worker to hold cached.
    pub route_cached: (usize, usize),
    /// Time in the router's own queue (admitted, waiting for room), and the decode worker's
    /// answer to the stream's opening (its KV reservation), first leg: together with the
    /// prefill worker's queue and compute, where a time to first token went.
    pub router_queue_ms: Option<f64>,
    pub decode_open_ms: Option<f64>,
    prefill: Option<PrefillTimings>,
    decode: Option<DecodeTimings>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    gaps_ms: Vec<f64>,
    output_tokens: u32,
    ended: bool,
    /// The tenant whose API key the request carried.
    pub tenant: Option<String>,
    /// `--log-content` only: the prompt as rendered and the text sent so far.
    content: Option<(String, String)>,
}

use pd_telemetry::percentile;

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl RequestRecord {
    pub fn new(
        metrics: RouterMetrics,
        request_id: String,
        class: RequestClass,
        input_tokens: usize,
        arrived: Instant,
        root: StageSpan,
    ) -> Self {
        root.set("pd.request_id", request_id.clone());
        root.set("pd.class", class.as_str().to_string());
        root.set("pd.input_bucket", input_bucket(input_tokens));
        root.set("gen_ai.usage.input_tokens", input_tokens as i64);
        RequestRecord {
            metrics,
            request_id,
            client_request_id: None,
            labels: StageLabels::new(&class, input_tokens),
            class,
            input_tokens,
            arrived,
            root,
            prefill_worker: String::new(),
            decode_worker: String::new(),
            route_cached: (0, 0),
            router_queue_ms: None,
            decode_open_ms: None,
            prefill: None,
            decode: None,
            first_token: None,
            last_token: None,
            gaps_ms: Vec::new(),
            output_tokens: 0,
            ended: false,
            tenant: None,
            content: None,
        }
    }

    /// The root span (parent of every other span of the request).
    pub fn span(&self) -> &StageSpan {
        &self.root
    }

    pub fn metrics(&self) -> &RouterMetrics {
        &self.metrics
    }

    pub fn class(&self) -> &RequestClass {
        &self.class
    }

    /// Keep the prompt (and from now on the text sent) for the record (`--log-content`).
    pub fn log_content(&mut self, prompt: String) {
        self.content = Some((prompt, String::new()));
    }

    /// A token with `text` was handed to the client's stream now.
    pub fn token(&mut self, text: &str) {
        if let Some((_, sent)) = &mut self.content {
            sent.push_str(text);
        }
        let now = Instant::now();
        match self.last_token {
            None => {
                self.first_token = Some(now);
                self.labels.observe(&self.metrics.ttft, (now - self.arrived).as_secs_f64());
                self.root.event("first_token", vec![]);
            }
            Some(last) => {
                let gap = now - last;
                self.labels.observe(&self.metrics.itl, gap.as_secs_f64());
                self.gaps_ms.push(ms(gap));
            }
        }
        self.last_token = Some(now);
        self.output_tokens += 1;
    }

    pub fn prefilled(&mut self, t: PrefillTimings) {
        self.root.set("pd.prefix.cached_tokens", t.cached_tokens as i64);
        self.prefill = Some(t);
    }

    /// Prompt tokens the prefilling worker's prefix cache served (0 before its report).
    pub fn cached_tokens(&self) -> u32 {
        self.prefill.map_or(0, |p| p.cached_tokens)
    }

    pub fn decoded(&mut self, t: DecodeTimings) {
        self.decode = Some(t);
    }

    /// The request finished normally with `finish_reason`.
    pub fn finish(&mut self, finish_reason: &str) {
        self.root.set("gen_ai.response.finish_reasons", finish_reason.to_string());
        self.end("ok", Some(finish_reason), None);
    }

    /// The request failed with `error` (before or after its first token).
    pub fn fail(&mut self, error: &RouterError) {
        if self.first_token.is_none() {
            self.metrics.rejected.with_label_values(&[error.reason()]).inc();
        }
        self.root.error(error.to_string());
        self.end("error", None, Some(error));
    }

    fn end(&mut self, outcome: &str, finish_reason: Option<&str>, error: Option<&RouterError>) {
        if self.ended {
            return;
        }
        self.ended = true;
        let now = Instant::now();
        let e2e_ms = ms(now - self.arrived);
        if outcome == "ok" {
            self.labels.observe(&self.metrics.e2e, e2e_ms / 1e3);
        }
        self.metrics.requests.with_label_values(&[self.class.as_str(), outcome]).inc();
        let mut gaps = self.gaps_ms.clone();
        gaps.sort_by(f64::total_cmp);
        let ttft_ms = self.first_token.map(|t| ms(t - self.arrived));
        let (p, d) = (self.prefill, self.decode);
        self.root.set("gen_ai.usage.output_tokens", self.output_tokens as i64);
        self.root.set("pd.outcome", outcome.to_string());
        if let Some(t) = ttft_ms {
            self.root.set("pd.ttft_ms", t);
        }
        if let Some(tenant) = &self.tenant {
            self.root.set("pd.tenant", tenant.clone());
        }
        let (prompt, completion) = self.content.take().unzip();
        if let (Some(prompt), Some(completion)) = (&prompt, &completion) {
            self.root.set("pd.prompt", prompt.clone());
            self.root.set("pd.completion", completion.clone());
        }
        tracing::info!(
            target: "pd_request",
            request_id = %self.request_id,
            client_request_id = self.client_request_id.as_deref(),
            class = self.class.as_str(),
            tenant = self.tenant.as_deref(),
            input_tokens = self.input_tokens,
            output_tokens = self.output_tokens,
            router_queue_ms = self.router_queue_ms,
            decode_open_ms = self.decode_open_ms,
            queue_ms = p.map(|p| p.queue_ms),
            prefill_ms = p.map(|p| p.prefill_ms),
            kv_transfer_ms = d.map(|d| d.kv_transfer_ms),
            kv_bytes = d.map(|d| d.kv_bytes),
            cached_tokens = p.map(|p| p.cached_tokens),
            decode_cached_tokens = d.map(|d| d.cached_tokens),
            route_decode_cached_tokens = self.route_cached.0,
            route_prefill_cached_tokens = self.route_cached.1,
            ttft_ms,
            decode_ms = d.map(|d| d.decode_ms),
            itl_p50_ms = percentile(&gaps, 0.50),
            itl_p95_ms = percentile(&gaps, 0.95),
            itl_max_ms = gaps.last().copied(),
            e2e_ms,
            prefill_worker = %self.prefill_worker,
            decode_worker = %self.decode_worker,
            outcome,
            finish_reason,
            error = error.map(|e| e.to_string()),
            trace_id = Some(self.root.trace_id()).filter(|t| !t.is_empty()),
            prompt,
            completion,
            "request finished"
        );
        self.root.event("request.end", vec![KeyValue::new("pd.outcome", outcome.to_string())]);
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        // The client went away before the end: its stream was cancelled.
        self.end("cancelled", None, None);
    }
}
