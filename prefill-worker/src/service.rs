//! The `pd.v1.PrefillWorker` service: `check` the request, open the KV connection to the
//! decode worker named in its target, run the prefill pipeline (`pipeline`) on this worker's
//! step loop (`steps`: several prompts per step, shortest remaining first, no starvation),
//! and `report` the stages as spans in the request's trace (`prefill.queue`,
//! `prefill.compute` with an event per chunk, `kv.send`, whose context travels in the KV
//! transfer header so the decode worker's `kv.receive` is its child) and as metrics. While
//! draining (SIGTERM) new prefills are refused with UNAVAILABLE, which the router retries on
//! another worker.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pb::prefill_worker_server::PrefillWorker;
use pd_engine::Engine;
use pd_kv_transfer::convert::{sampling_from_pb, Target};
use pd_kv_transfer::engine_io::geometry_of;
use pd_proto::v1 as pb;
use pd_telemetry::metrics::PrefillMetrics;
use pd_telemetry::opentelemetry::{Context, KeyValue};
use pd_telemetry::{RequestClass, StageLabels, StageSpan};
use tonic::{Request, Response, Status, Streaming};

use crate::error::PrefillError;
use crate::gauges::{Counted, Gauges};
use crate::pipeline::{prefill_and_send, PrefillJob, PrefillSent};
use crate::senders::Senders;
use crate::step::StepConfig;
use crate::steps::{Preemptions, StepEvent, Steps};

/// How the service runs prefills.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// What one prefill step runs.
    pub step: StepConfig,
    /// Longest wait on a decode worker's KV service.
    pub kv_timeout: Duration,
    /// TLS for the KV links (None: plaintext).
    pub kv_tls: Option<tonic::transport::ClientTlsConfig>,
}

/// Shared state of the prefill service.
#[derive(Debug, Clone)]
pub struct PrefillService {
    engine: Arc<Engine>,
    /// The step loop that runs every prompt's chunks.
    steps: Steps,
    gauges: Arc<Gauges>,
    /// One KV connection per decode worker, reused across requests.
    senders: Senders,
    config: ServiceConfig,
    metrics: PrefillMetrics,
    stopping: Arc<AtomicBool>,
    /// The step loop's preemption totals at the last scrape (the counters add the rest).
    preemptions_seen: Arc<Mutex<Preemptions>>,
}

/// A request that passed `check`.
struct Checked {
    prompt: Vec<u32>,
    target: Target,
    sampling: pd_engine::SamplingParams,
}

/// The spans of one prefill in its request's trace.
struct Spans {
    parent: Context,
    queue: StageSpan,
    send: StageSpan,
}

impl PrefillService {
    pub fn new(engine: Arc<Engine>, config: ServiceConfig, metrics: PrefillMetrics) -> std::io::Result<Self> {
        Ok(PrefillService {
            steps: Steps::start(engine.clone(), config.step)?,
            engine,
            gauges: Arc::new(Gauges::default()),
            senders: Senders::new(config.kv_timeout, config.kv_tls.clone()),
            config,
            metrics,
            stopping: Arc::new(AtomicBool::new(false)),
            preemptions_seen: Arc::default(),
        })
    }

    /// Refuses new prefills from now on (SIGTERM); those already accepted go on.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Prefills accepted and not yet answered (queued or running).
    pub fn in_flight(&self) -> u32 {
        self.gauges.in_flight()
    }

    /// Updates the scrape-time gauges (waiting tokens, oldest queue age).
    pub fn refresh_gauges(&self) {
        self.metrics.waiting_tokens.set(self.gauges.waiting_tokens.load(Ordering::Relaxed) as f64);
        self.metrics.oldest_age.set(self.gauges.oldest_queued_age().as_secs_f64());
        // The counters follow the step loop's own totals.
        let now = self.steps.preemptions();
        if let Ok(mut seen) = self.preemptions_seen.lock() {
            self.metrics.preemptions.inc_by(now.steps.saturating_sub(seen.steps));
            self.metrics.preempted_compute.inc_by(now.discarded.saturating_sub(seen.discarded).as_secs_f64());
            *seen = now;
        }
    }

    /// Checks a request against this worker's model.
    fn check(&self, req: pb::PrefillRequest) -> Result<Checked, PrefillError> {
        if req.prompt_tokens.is_empty() {
            return Err(PrefillError::Invalid("prompt_tokens is empty".into()));
        }
        // Checked here, so a bad id fails this request alone (in the step loop it would fail
        // every prompt of the step).
        let vocab = self.engine.model().config().vocab_size;
        if let Some((i, id)) = req.prompt_tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(PrefillError::Invalid(format!(
                "prompt_tokens[{i}] ({id}) is outside the vocabulary of {vocab}"
            )));
        }
        let target = req.target.as_ref().ok_or_else(|| PrefillError::Invalid("target is required".into()))?;
        let target = Target::from_pb(target).map_err(|e| PrefillError::Invalid(e.to_string()))?;
        let sampling = sampling_from_pb(req.sampling.as_ref(), req.output_offset)?;
        let ours = geometry_of(&self.engine, target.geometry.dtype);
        target.geometry.check_matches(&ours).map_err(PrefillError::Incompatible)?;
        let max = self.engine.model().config().max_position;
        if target.cached_tokens as usize >= req.prompt_tokens.len() {
            let message = format!(
                "target.cached_tokens ({}) must be less than prompt_tokens ({})",
                target.cached_tokens,
                req.prompt_tokens.len()
            );
            return Err(PrefillError::Invalid(message));
        }
        if req.prompt_tokens.len() > max {
            let message = format!("prompt_tokens ({}) exceed the context length of {max}", req.prompt_tokens.len());
            return Err(PrefillError::Invalid(message));
        }
        Ok(Checked { prompt: req.prompt_tokens, target, sampling })
    }

    /// Counts and records a refusal or failure; the status the router gets.
    fn refuse(&self, span: &StageSpan, error: PrefillError) -> Status {
        span.error(error.to_string());
        self.metrics.rejected.with_label_values(&[error.reason()]).inc();
        error.to_status()
    }

    /// Runs the pipeline for a checked request, counted in the gauges from `arrived`.
    async fn run(&self, checked: Checked, spans: &Spans, arrived: Instant) -> Result<PrefillSent, PrefillError> {
        let endpoint = checked.target.kv_endpoint.clone();
        let sender = self.senders.to(&endpoint).await?;
        spans.send.set("pd.kv.transport", sender.transport().name());
        let tokens = checked.prompt.len();
        let counted = Mutex::new(Counted::new(self.gauges.clone(), tokens as u64, arrived));
        let ship_from = checked.target.cached_tokens as usize;
        let shipped = (tokens - ship_from) as u32;
        let header = checked.target.header(shipped, pd_telemetry::otel::inject_map(spans.send.context()));
        let job = PrefillJob {
            engine: self.engine.clone(),
            prompt: checked.prompt,
            header,
            sampling: checked.sampling,
            ship_from,
        };
        let progress = |event: &StepEvent| {
            if let Ok(mut c) = counted.lock() {
                match event {
                    StepEvent::Started { cached, .. } => {
                        c.start_running();
                        c.advance(*cached as u64);
                    }
                    StepEvent::Chunk { tokens, .. } => c.advance(*tokens as u64),
                    _ => {}
                }
            }
        };
        let sent = prefill_and_send(job, &sender, &self.steps, progress).await;
        if sent.as_ref().is_err_and(PrefillError::breaks_connection) {
            self.senders.forget(&endpoint);
        }
        let outcome = if sent.is_ok() { "committed" } else { "failed" };
        self.metrics.kv_transfers.with_label_values(&[sender.transport().name(), outcome]).inc();
        sent
    }

    /// The stages as spans (measured: queued until the first chunk's turn; compute from there
    /// to the last chunk, with the waits between chunks in `pd.prefill.waited_ms`) and metrics.
    fn report(&self, spans: Spans, sent: &PrefillSent, labels: &StageLabels, tokens: usize) {
        let Spans { parent, queue, send } = spans;
        queue.end_at(sent.compute_started);
        let compute = StageSpan::start_at("prefill.compute", &parent, sent.compute_started);
        compute.set("gen_ai.usage.input_tokens", tokens as i64);
        compute.set("pd.prefix.cached_tokens", sent.cached_tokens as i64);
        compute.set("pd.prefill.step_target_ms", self.config.step.target.as_secs_f64() * 1e3);
        compute.set("pd.prefill.compute_ms", sent.prefill_time.as_secs_f64() * 1e3);
        compute.set("pd.prefill.waited_ms", sent.waited.as_secs_f64() * 1e3);
        for (i, (chunk_tokens, at)) in sent.chunks.iter().enumerate() {
            let attributes =
                vec![KeyValue::new("pd.chunk.index", i as i64), KeyValue::new("pd.chunk.tokens", *chunk_tokens as i64)];
            compute.event_at("prefill.chunk", *at, attributes);
        }
        compute.end_at(sent.compute_ended);
        send.set("pd.kv.bytes", sent.receipt.bytes as i64);
        send.set("pd.kv.frames", sent.receipt.frames as i64);
        send.set("pd.kv.layers", sent.layers as i64);
        send.set("pd.kv.prefill_end_to_commit_ms", sent.prefill_end_to_commit.as_secs_f64() * 1e3);
        send.end();
        labels.observe(&self.metrics.queue_time, sent.waited.as_secs_f64());
        labels.observe(&self.metrics.prefill_time, sent.prefill_time.as_secs_f64());
        self.metrics.kv_transfer_bytes.inc_by(sent.receipt.bytes);
        self.metrics.prefix.observe(tokens, sent.cached_tokens);
        self.metrics.prefix.cached_blocks.set(self.engine.blocks().cached_blocks() as f64);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let arrived = Instant::now();
        let parent = pd_telemetry::otel::extract_metadata(request.metadata());
        let class = RequestClass::from_metadata(request.metadata());
        let queue = StageSpan::start("prefill.queue", &parent);
        if self.stopping.load(Ordering::Relaxed) {
            return Err(self.refuse(&queue, PrefillError::ShuttingDown));
        }
        let checked = self.check(request.into_inner()).map_err(|e| self.refuse(&queue, e))?;
        let tokens = checked.prompt.len();
        queue.set("gen_ai.usage.input_tokens", tokens as i64);
        let send = StageSpan::start("kv.send", &parent);
        send.set("pd.kv.backend", "grpc");
        send.set("pd.kv.endpoint", checked.target.kv_endpoint.clone());
        send.set("pd.kv.blocks", checked.target.block_ids.len() as i64);
        send.set("pd.kv.receiver_cached_tokens", checked.target.cached_tokens as i64);
        let spans = Spans { parent, queue, send };
        let sent = match self.run(checked, &spans, arrived).await {
            Ok(sent) => sent,
            Err(e) => {
                spans.queue.error("the prefill failed; see kv.send");
                return Err(self.refuse(&spans.send, e));
            }
        };
        self.report(spans, &sent, &StageLabels::new(&class, tokens), tokens);
        Ok(Response::new(pb::PrefillResponse {
            first_token: sent.first_token,
            queue_ms: ms(sent.waited),
            prefill_ms: ms(sent.prefill_time),
            kv_commit_ms: ms(sent.prefill_end_to_commit),
            kv_bytes: sent.receipt.bytes,
            cached_tokens: sent.cached_tokens as u32,
            first_logprobs: sent.first_logprobs.as_ref().map(pd_kv_transfer::convert::logprobs_to_pb),
        }))
    }

    async fn score(&self, request: Request<pb::ScoreRequest>) -> Result<Response<pb::ScoreResponse>, Status> {
        let arrived = Instant::now();
        let parent = pd_telemetry::otel::extract_metadata(request.metadata());
        let class = RequestClass::from_metadata(request.metadata());
        let span = StageSpan::start("prefill.score", &parent);
        if self.stopping.load(Ordering::Relaxed) {
            return Err(self.refuse(&span, PrefillError::ShuttingDown));
        }
        let job = crate::score::check(&self.engine, request.into_inner()).map_err(|e| self.refuse(&span, e))?;
        let tokens = job.prompt.len();
        span.set("gen_ai.usage.input_tokens", tokens as i64);
        let counted = Mutex::new(Counted::new(self.gauges.clone(), tokens as u64, arrived));
        let progress = |event: &StepEvent| {
            if let Ok(mut c) = counted.lock() {
                match event {
                    StepEvent::Started { .. } => c.start_running(),
                    StepEvent::Chunk { tokens, .. } => c.advance(*tokens as u64),
                    _ => {}
                }
            }
        };
        let scored =
            crate::score::score(&self.engine, &self.steps, job, progress).await.map_err(|e| self.refuse(&span, e))?;
        span.set("pd.prefill.compute_ms", scored.compute_ms);
        span.set("pd.prefill.waited_ms", scored.waited_ms);
        let labels = StageLabels::new(&class, tokens);
        labels.observe(&self.metrics.queue_time, scored.waited_ms / 1e3);
        labels.observe(&self.metrics.prefill_time, scored.compute_ms / 1e3);
        span.end();
        Ok(Response::new(crate::score::to_pb(scored)))
    }

    async fn load(&self, request: Request<pb::LoadRequest>) -> Result<Response<pb::PrefillLoad>, Status> {
        self.load_now(request.get_ref()).map(Response::new)
    }

    type LoadStreamStream = pd_proto::LoadAnswers<pb::PrefillLoad>;

    async fn load_stream(
        &self,
        request: Request<Streaming<pb::LoadRequest>>,
    ) -> Result<Response<Self::LoadStreamStream>, Status> {
        let this = self.clone();
        Ok(Response::new(pd_proto::answer_loads(request.into_inner(), move |r| this.load_now(r))))
    }
}

impl PrefillService {
    /// This worker's load, with its prefix-cache events after `request`'s cursor.
    fn load_now(&self, request: &pb::LoadRequest) -> Result<pb::PrefillLoad, Status> {
        if self.stopping.load(Ordering::Relaxed) {
            // The router's choice skips workers whose load query fails.
            return Err(PrefillError::ShuttingDown.to_status());
        }
        Ok(pb::PrefillLoad {
            waiting_prefill_tokens: self.gauges.waiting_tokens.load(Ordering::Relaxed),
            running_prefills: self.gauges.running.load(Ordering::Relaxed),
            queued_prefills: self.gauges.queued.load(Ordering::Relaxed),
            prefill_tokens_per_s: self.steps.tokens_per_s(),
            max_partial_prefills: self.config.step.max_prompts as u32,
            cache: pd_kv_transfer::convert::cache_events(self.engine.blocks(), request),
        })
    }
}
