//! The `pd.v1.DecodeWorker` service. One request goes through named stages:
//!
//! - `check`: the request against this worker's model (context length, sampling);
//! - `reserve`: blocks for the prompt and its whole output under a lease (decode-first), and
//!   the KV target the router hands to a prefill worker;
//! - `await_commit`: the KV arrives (or the client leaves, or the transfer fails);
//! - `admit`: the sequence joins the batch loop, which streams its tokens.
//!
//! A prompt prefilled here (`prefill_here`) skips the transfer: `admit_local` reserves and
//! admits it with its prompt still to run.
//!
//! Several answers (`n`): the prompt's KV arrives once; answer 0 starts from the prefill
//! worker's first token, every other answer is a fork of it (`Engine::fork_sequence`: the
//! prompt's full blocks shared by reference count, the last partial block copied into its
//! own) that recomputes the prompt's last token to draw its own first one with its own
//! seed. Every answer's blocks are reserved up front with the prompt's. A prompt prefilled
//! here runs once per answer (its cached prefix shared). Spans in the request's trace: `decode.admit` (the
//! reservation), `kv.receive` (header accepted to commit, as measured by the KV registry; a
//! child of the prefill worker's `kv.send`, whose context came in the transfer header) and
//! `decode.generate` (in the batch loop). While draining, new requests are refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use pb::decode_worker_server::DecodeWorker;
use pd_engine::{BlockAllocation, Engine, SamplingParams, SequenceKv, WireDType};
use pd_kv_transfer::convert::{sampling_from_pb, Target};
use pd_kv_transfer::engine_io::geometry_of;
use pd_kv_transfer::{CommittedKv, KvRegistry, Outcome, Reservation};
use pd_proto::v1 as pb;
use pd_telemetry::metrics::DecodeMetrics;
use pd_telemetry::opentelemetry::Context;
use pd_telemetry::{RequestClass, StageLabels, StageSpan};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::batch::{event, Admission, Event, Fork, Received, Start};
use crate::batcher::Batcher;
use crate::error::DecodeError;

/// Shared state of the decode worker's services.
#[derive(Debug, Clone)]
pub struct DecodeService {
    pub(crate) engine: Arc<Engine>,
    pub(crate) registry: Arc<KvRegistry>,
    pub(crate) batcher: Batcher,
    pub(crate) kv_endpoint: String,
    pub(crate) kv_dtype: WireDType,
    pub(crate) lease: Duration,
    pub(crate) metrics: DecodeMetrics,
    pub(crate) stopping: Arc<AtomicBool>,
}

/// A request that passed `check`, with what every later stage needs.
struct Checked {
    request_id: String,
    prompt: Vec<u32>,
    params: SamplingParams,
    /// Answers to sample (at least 1).
    n: usize,
    lease: Duration,
    /// The request's trace context and metric labels.
    parent: Context,
    labels: StageLabels,
}

/// A reservation waiting for its KV.
struct Reserved {
    target: Target,
    outcome: oneshot::Receiver<Outcome>,
    held: Held,
}

/// The blocks a reservation holds beside the transfer's.
struct Held {
    /// The prompt's cached prefix blocks and the tokens they hold.
    prefix: BlockAllocation,
    cached: usize,
    /// The output's blocks, joined to the prompt's once the KV is committed.
    growth: BlockAllocation,
    /// Answers 1.. : each one's own blocks, from the prompt's last (partial) block on.
    forks: Vec<BlockAllocation>,
}

impl DecodeService {
    /// Refuses new requests from now on (SIGTERM); running ones go on.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Updates the scrape-time gauges.
    pub fn refresh_gauges(&self) {
        self.metrics.running.set(self.batcher.running() as f64);
        self.metrics.kv_usage.set(self.engine.blocks().usage_ratio());
        self.metrics.prefix.cached_blocks.set(self.engine.blocks().cached_blocks() as f64);
    }

    /// Counts and records a refusal; the status the router gets.
    pub(crate) fn refuse(&self, span: &StageSpan, error: DecodeError) -> Status {
        span.error(error.to_string());
        self.metrics.rejected.with_label_values(&[error.reason()]).inc();
        error.to_status()
    }

    fn check(&self, req: pb::DecodeRequest, parent: Context, class: &RequestClass) -> Result<Checked, DecodeError> {
        if req.request_id.is_empty() {
            return Err(DecodeError::Invalid("request_id is required".into()));
        }
        if req.prompt_tokens.is_empty() {
            return Err(DecodeError::Invalid("prompt_tokens is empty".into()));
        }
        // Checked here, so a bad id fails this request alone (in the batch's step it would
        // fail every sequence of the step).
        let vocab = self.engine.model().config().vocab_size;
        if let Some((i, id)) = req.prompt_tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(DecodeError::Invalid(format!(
                "prompt_tokens[{i}] ({id}) is outside the vocabulary of {vocab}"
            )));
        }
        let params = sampling_from_pb(req.sampling.as_ref(), req.output_offset)?;
        let n = req.n.max(1) as usize;
        if n > self.batcher.max_batch() {
            let m = format!("n ({n}) exceeds this worker's batch of {} sequences", self.batcher.max_batch());
            return Err(DecodeError::Invalid(m));
        }
        let max = self.engine.model().config().max_position;
        let prompt = req.prompt_tokens.len();
        if prompt + params.max_tokens > max {
            let m = format!(
                "prompt_tokens ({prompt}) + max_tokens ({}) exceed the context length of {max}",
                params.max_tokens
            );
            return Err(DecodeError::Invalid(m));
        }
        let lease = if req.lease_ms > 0 { Duration::from_millis(req.lease_ms.into()) } else { self.lease };
        let labels = StageLabels::new(class, prompt);
        Ok(Checked { request_id: req.request_id, prompt: req.prompt_tokens, params, n, lease, parent, labels })
    }

    /// Blocks for the prompt and the whole output (so decoding never runs out of KV): the
    /// prompt's cached prefix (shared, held from now on), its uncached rest under a transfer
    /// reservation (the only part a prefill worker ships), and the output's.
    fn reserve(&self, c: &Checked, admit: &StageSpan) -> Result<Reserved, DecodeError> {
        let blocks = self.engine.blocks();
        let capacity = c.prompt.len() + c.params.max_tokens;
        let (mut prefix, cached) = blocks.allocate_prefix(&c.prompt, capacity).map_err(DecodeError::OutOfBlocks)?;
        let forks = self.fork_blocks(c)?;
        let growth = prefix.split_off(blocks.blocks_for(c.prompt.len()));
        let suffix = prefix.split_off(cached / blocks.block_size());
        let geometry = geometry_of(&self.engine, self.kv_dtype);
        let target = Target {
            transfer_id: c.request_id.clone(),
            kv_endpoint: self.kv_endpoint.clone(),
            geometry,
            block_ids: suffix.ids().to_vec(),
            lease_deadline: SystemTime::now() + c.lease,
            cached_tokens: cached as u32,
        };
        let reservation = Reservation {
            transfer_id: c.request_id.clone(),
            geometry,
            blocks: suffix,
            num_tokens: (c.prompt.len() - cached) as u32,
            lease: c.lease,
        };
        let outcome = self.registry.reserve(reservation).map_err(DecodeError::Reservation)?;
        self.metrics.prefix.observe(c.prompt.len(), cached);
        let fork_blocks: usize = forks.iter().map(|f| f.ids().len()).sum();
        admit.set("pd.kv.blocks_reserved", (blocks.blocks_for(capacity) + fork_blocks) as i64);
        admit.set("pd.kv.free_blocks_after", blocks.free_blocks() as i64);
        admit.set("pd.prefix.cached_tokens", cached as i64);
        Ok(Reserved { target, outcome, held: Held { prefix, cached, growth, forks } })
    }

    /// The own blocks of answers 1.. : from the block of the prompt's last position (which a
    /// fork recomputes) to the end of its output. All or nothing.
    fn fork_blocks(&self, c: &Checked) -> Result<Vec<BlockAllocation>, DecodeError> {
        let blocks = self.engine.blocks();
        let shared = (c.prompt.len() - 1) / blocks.block_size();
        let own = blocks.blocks_for(c.prompt.len() + c.params.max_tokens) - shared;
        (1..c.n).map(|_| blocks.allocate(own).map_err(DecodeError::OutOfBlocks)).collect()
    }

    /// A prompt that runs here: blocks for prompt and output now (its cached prefix shared),
    /// no KV target, no transfer. The prompt runs once: answers 1.. join over its KV when it
    /// is complete (their own blocks taken now, all or nothing).
    fn admit_local(
        &self,
        c: Checked,
        events: mpsc::UnboundedSender<Event>,
        admit: &StageSpan,
    ) -> Result<(), DecodeError> {
        let capacity = c.prompt.len() + c.params.max_tokens;
        let (kv, cached) = self.engine.sequence_for_prompt(&c.prompt, capacity).map_err(DecodeError::OutOfBlocks)?;
        let own = self.fork_blocks(&c)?;
        self.metrics.prefix.observe(c.prompt.len(), cached);
        admit.set("pd.prefix.cached_tokens", cached as i64);
        let forks = own
            .into_iter()
            .enumerate()
            .map(|(i, own)| {
                let index = i + 1;
                let span = self.generate_span(&c, index);
                span.set("pd.prefill_here", true);
                Fork { index: index as u32, own, params: c.params.for_choice(index), span }
            })
            .collect();
        let span = self.generate_span(&c, 0);
        span.set("pd.prefill_here", true);
        self.batcher.admit(Admission {
            index: 0,
            kv,
            start: Start::Prompt { from: cached },
            prompt: c.prompt.clone(),
            params: c.params.clone(),
            cached_tokens: cached,
            received: Received::default(),
            events,
            span,
            labels: c.labels.clone(),
            forks,
            score: None,
        })
    }

    /// `decode.generate` of answer `index`.
    fn generate_span(&self, c: &Checked, index: usize) -> StageSpan {
        let span = StageSpan::start("decode.generate", &c.parent);
        span.set("pd.request_id", c.request_id.clone());
        if c.n > 1 {
            span.set("gen_ai.request.choice.index", index as i64);
        }
        span
    }

    /// Waits for the reservation's KV; None (after telling the stream why) when it will not
    /// come: the transfer failed, or the client went away (then the blocks are freed now).
    async fn await_commit(
        &self,
        c: &Checked,
        outcome: oneshot::Receiver<Outcome>,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Option<CommittedKv> {
        let outcome = tokio::select! {
            outcome = outcome => outcome,
            _ = events.closed() => {
                let _ = self.registry.abort(&c.request_id, "client disconnected");
                return None;
            }
        };
        let error = match outcome {
            Ok(Ok(committed)) => return Some(committed),
            Ok(Err(e)) => DecodeError::Transfer(e),
            Err(_) => DecodeError::Internal("the KV reservation vanished".into()),
        };
        StageSpan::start("kv.receive", &c.parent).error(error.to_string());
        let _ = events.send(Err(error.to_status()));
        None
    }

    /// The receive as the registry measured it (header accepted to commit), as span and metrics.
    fn record_receive(&self, c: &Checked, committed: &CommittedKv) {
        let now = SystemTime::now();
        let parent = pd_telemetry::otel::extract_map(&committed.trace_context);
        let receive =
            StageSpan::start_at("kv.receive", &parent, now.checked_sub(committed.receive_time).unwrap_or(now));
        receive.set("pd.kv.bytes", committed.bytes as i64);
        receive.set("pd.kv.frames", committed.frames as i64);
        receive.set("pd.kv.layers", self.engine.model().config().num_layers as i64);
        receive.end_at(now);
        c.labels.observe(&self.metrics.kv_transfer_time, committed.receive_time.as_secs_f64());
        self.metrics.kv_transfer_bytes.inc_by(committed.bytes);
    }

    /// Joins a committed sequence (cached prefix, then the shipped rest, then room for the
    /// output) to the batch; its prompt blocks join the prefix cache. Answers 1.. fork it.
    fn admit(
        &self,
        c: Checked,
        committed: CommittedKv,
        held: Held,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<(), DecodeError> {
        // A first token outside the vocabulary fails this request (its blocks are freed as
        // `committed` and `held` drop), not the batch's next step.
        let vocab = self.engine.model().config().vocab_size;
        if committed.first_token as usize >= vocab {
            let bad = committed.first_token;
            return Err(DecodeError::Invalid(format!(
                "the KV commit's first_token ({bad}) is outside the vocabulary of {vocab}"
            )));
        }
        let received =
            Received { kv_transfer_ms: committed.receive_time.as_secs_f64() * 1e3, kv_bytes: committed.bytes };
        let Held { mut prefix, cached, growth, forks } = held;
        let internal = |e: pd_engine::EngineError| DecodeError::Internal(e.to_string());
        prefix.absorb(committed.blocks).map_err(internal)?;
        prefix.absorb(growth).map_err(internal)?;
        let mut kv = SequenceKv::new(prefix);
        kv.commit_len(cached + committed.num_tokens as usize);
        kv.cache_prefix(&c.prompt);
        let last = c.prompt.len() - 1;
        let mut admissions = Vec::with_capacity(c.n);
        for (i, own) in forks.into_iter().enumerate() {
            let index = i + 1;
            admissions.push(Admission {
                index: index as u32,
                kv: self.engine.fork_sequence(&kv, last, own).map_err(internal)?,
                start: Start::Prompt { from: last },
                prompt: c.prompt.clone(),
                params: c.params.for_choice(index),
                cached_tokens: cached,
                received: Received::default(),
                events: events.clone(),
                span: self.generate_span(&c, index),
                labels: c.labels.clone(),
                forks: Vec::new(),
                score: None,
            });
        }
        admissions.insert(
            0,
            Admission {
                index: 0,
                kv,
                start: Start::Prefilled { first_token: committed.first_token, logprobs: committed.first_logprobs },
                prompt: c.prompt.clone(),
                params: c.params.clone(),
                cached_tokens: cached,
                received,
                events,
                span: self.generate_span(&c, 0),
                labels: c.labels.clone(),
                forks: Vec::new(),
                score: None,
            },
        );
        admissions.into_iter().try_for_each(|a| self.batcher.admit(a))
    }

    /// The stages after the reservation, on their own task.
    async fn follow(self, c: Checked, reserved: Reserved, events: mpsc::UnboundedSender<Event>) {
        let Some(committed) = self.await_commit(&c, reserved.outcome, &events).await else { return };
        self.record_receive(&c, &committed);
        if let Err(e) = self.admit(c, committed, reserved.held, events.clone()) {
            let _ = events.send(Err(e.to_status()));
        }
    }
}

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type GenerateStream = UnboundedReceiverStream<Event>;

    async fn generate(&self, request: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let parent = pd_telemetry::otel::extract_metadata(request.metadata());
        let class = RequestClass::from_metadata(request.metadata());
        let admit = StageSpan::start("decode.admit", &parent);
        if self.stopping.load(Ordering::Relaxed) {
            return Err(self.refuse(&admit, DecodeError::ShuttingDown));
        }
        let req = request.into_inner();
        let prefill_here = req.prefill_here;
        let checked = self.check(req, parent, &class).map_err(|e| self.refuse(&admit, e))?;
        admit.set("pd.request_id", checked.request_id.clone());
        admit.set("pd.prefill_here", prefill_here);
        admit.set("gen_ai.request.max_tokens", checked.params.max_tokens as i64);
        let (events, rx) = mpsc::unbounded_channel::<Event>();
        if prefill_here {
            self.admit_local(checked, events, &admit).map_err(|e| self.refuse(&admit, e))?;
        } else {
            let reserved = self.reserve(&checked, &admit).map_err(|e| self.refuse(&admit, e))?;
            let _ = events.send(event(pb::decode_event::Event::Target(reserved.target.to_pb())));
            tokio::spawn(self.clone().follow(checked, reserved, events));
        }
        admit.end();
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn score(&self, request: Request<pb::ScoreRequest>) -> Result<Response<pb::ScoreResponse>, Status> {
        let parent = pd_telemetry::otel::extract_metadata(request.metadata());
        let class = RequestClass::from_metadata(request.metadata());
        let span = StageSpan::start("decode.score", &parent);
        if self.stopping.load(Ordering::Relaxed) {
            return Err(self.refuse(&span, DecodeError::ShuttingDown));
        }
        let req = request.into_inner();
        span.set("pd.request_id", req.request_id.clone());
        let labels = StageLabels::new(&class, req.prompt_tokens.len());
        let answer = self.score_here(req, &span, labels).await;
        match &answer {
            Ok(a) => span.set("pd.prefill.compute_ms", a.prefill_ms),
            Err(status) => span.error(status.message()),
        }
        span.end();
        answer.map(Response::new)
    }

    async fn load(&self, request: Request<pb::LoadRequest>) -> Result<Response<pb::DecodeLoad>, Status> {
        self.load_now(request.get_ref()).map(Response::new)
    }

    type LoadStreamStream = pd_proto::LoadAnswers<pb::DecodeLoad>;

    async fn load_stream(
        &self,
        request: Request<Streaming<pb::LoadRequest>>,
    ) -> Result<Response<Self::LoadStreamStream>, Status> {
        let this = self.clone();
        Ok(Response::new(pd_proto::answer_loads(request.into_inner(), move |r| this.load_now(r))))
    }
}

impl DecodeService {
    /// This worker's load, with its prefix-cache events after `request`'s cursor.
    fn load_now(&self, request: &pb::LoadRequest) -> Result<pb::DecodeLoad, Status> {
        if self.stopping.load(Ordering::Relaxed) {
            // The router's choice skips workers whose load query fails.
            return Err(DecodeError::ShuttingDown.to_status());
        }
        let blocks = self.engine.blocks();
        Ok(pb::DecodeLoad {
            free_blocks: blocks.free_blocks() as u32,
            total_blocks: blocks.total_blocks() as u32,
            running_sequences: self.batcher.running() as u32,
            waiting_transfers: self.registry.len() as u32,
            kv_cache_usage: blocks.usage_ratio(),
            block_size: blocks.block_size() as u32,
            max_batch: self.batcher.max_batch() as u32,
            step_ms: self.batcher.step_ms(),
            cache: pd_kv_transfer::convert::cache_events(blocks, request),
        })
    }
}
