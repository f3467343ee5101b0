//! The decode batch as plain synchronous state: which sequences run, what each feeds into the
//! next forward step, and what a step's logits do to them. No model and no runtime here: the
//! batch loop (`batcher`) owns a `BatchState` and calls, per step,
//!
//! `admit` (new sequences) -> `drop_cancelled` -> `plan` (prompt tokens per sequence under
//! the prefill policy) -> `inputs` / `batch` (the forward's rows) -> `apply_logits` (sample,
//! stream, finish) — or `fail_all` when the step failed.
//!
//! Invariants: a sequence leaves the state exactly once, with a `Finished` event, an error, or
//! because its client went away; its KV blocks are freed when it leaves (dropped with it).
//! Blocks for the whole output were reserved at admission, so a step never runs out of KV.

use std::time::Instant;

use pd_engine::{
    BatchSeq, BlockAllocation, EngineError, OutputTracker, Sampler, SamplingParams, SequenceKv, TokenLogprobs,
    Tokenizer,
};
use pd_kv_transfer::convert::logprobs_to_pb;
use pd_proto::v1 as pb;
use pd_telemetry::metrics::DecodeMetrics;
use pd_telemetry::opentelemetry::KeyValue;
use pd_telemetry::{StageLabels, StageSpan};
use tokio::sync::{mpsc, oneshot};

use crate::plan::Row;

/// What the batch reports about one sequence, on its stream.
pub type Event = Result<pb::DecodeEvent, tonic::Status>;

/// Wraps one event of a decode stream.
pub fn event(e: pb::decode_event::Event) -> Event {
    Ok(pb::DecodeEvent { event: Some(e) })
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// How prompts prefilled on this worker share steps with the running streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillPolicy {
    /// Prompt chunks fill what the decode rows leave of `step_tokens` per step, first come
    /// first served: a long prompt spreads over many steps (Sarathi-style chunked prefill).
    Chunked { step_tokens: usize },
    /// The oldest waiting prompt runs whole in the next step, one per step (the baseline whose
    /// stalls disaggregation removes).
    Naive,
}

impl std::str::FromStr for PrefillPolicy {
    type Err = String;

    /// `chunked` (256 tokens per step), `chunked:N` or `naive`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "naive" => Ok(PrefillPolicy::Naive),
            "chunked" => Ok(PrefillPolicy::Chunked { step_tokens: 256 }),
            other => other
                .strip_prefix("chunked:")
                .and_then(|n| n.parse().ok())
                .filter(|n| *n > 0)
                .map(|step_tokens| PrefillPolicy::Chunked { step_tokens })
                .ok_or_else(|| format!("prefill policy `{other}` is not naive, chunked or chunked:N (N > 0)")),
        }
    }
}

/// Where a sequence's prompt stands when it joins.
#[derive(Debug)]
pub enum Start {
    /// The KV holds the prompt (a prefill worker sent it) and this is the first token (with
    /// its log probabilities, when asked for, as the prefill worker computed them).
    Prefilled { first_token: u32, logprobs: Option<pb::TokenLogprobs> },
    /// The prompt runs here, in the batch, from position `from` (before it: its cached prefix).
    Prompt { from: usize },
}

/// What the decode worker measured before the sequence joined.
#[derive(Debug, Clone, Copy, Default)]
pub struct Received {
    pub kv_transfer_ms: f64,
    pub kv_bytes: u64,
}

/// A sequence ready to join the batch.
#[derive(Debug)]
pub struct Admission {
    /// Which of the request's answers this is (0 .. n; its events carry it).
    pub index: u32,
    pub kv: SequenceKv,
    pub start: Start,
    /// The whole prompt (its full blocks join the prefix cache).
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Leading prompt tokens found in the prefix cache (not computed or shipped for this request).
    pub cached_tokens: usize,
    pub received: Received,
    pub events: mpsc::UnboundedSender<Event>,
    /// `decode.generate`, ended when the sequence leaves the batch.
    pub span: StageSpan,
    pub labels: StageLabels,
    /// The request's other answers, for a prompt that runs here: they join once it has run,
    /// over its KV (the prompt computed once for all of them).
    pub forks: Vec<Fork>,
    /// A prompt scored here (`DecodeWorker.Score`); None for a generation.
    pub score: Option<Scoring>,
}

/// A prompt scored in the batch (colocated `Score`): each position's logits give the log
/// probability of the prompt token after it (with `top` alternatives), sent on `sink` once
/// the prompt is complete; the first output token then streams as any sequence's does.
#[derive(Debug)]
pub struct Scoring {
    pub top: usize,
    pub sink: oneshot::Sender<Vec<TokenLogprobs>>,
}

/// One more answer to a prompt that runs here: joins when the prompt is complete, sharing its
/// full blocks, recomputing its last position to draw its own first token.
#[derive(Debug)]
pub struct Fork {
    pub index: u32,
    /// Its own blocks, from the block of the prompt's last position to the end of its output.
    pub own: BlockAllocation,
    pub params: SamplingParams,
    pub span: StageSpan,
}

/// What applying a step's logits needs from the worker: detokenizing, metrics, and forking
/// a completed prompt's KV for its other answers.
#[derive(Clone, Copy)]
pub struct StepTools<'a> {
    pub tokenizer: &'a Tokenizer,
    pub metrics: &'a DecodeMetrics,
    pub fork: Forker<'a>,
}

/// Makes a fork's KV: the parent's first `valid` positions, growing into `own`
/// (`Engine::fork_sequence` in the batch loop).
pub type Forker<'a> = &'a dyn Fn(&SequenceKv, usize, BlockAllocation) -> Result<SequenceKv, EngineError>;

#[derive(Debug)]
enum Phase {
    /// Prompt tokens `done..` still to run.
    Prompt { done: usize },
    /// The next token to feed.
    Decode { next: u32 },
}

/// Timings of one sequence on this worker.
#[derive(Debug)]
struct Clock {
    admitted: Instant,
    prefill_started: Option<Instant>,
    queue_ms: f64,
    prefill_ms: f64,
    /// The first token's time (decode time runs from here).
    started: Instant,
}

#[derive(Debug)]
struct Running {
    index: u32,
    kv: SequenceKv,
    phase: Phase,
    sampler: Sampler,
    tracker: OutputTracker,
    prompt: Vec<u32>,
    cached_tokens: usize,
    received: Received,
    clock: Clock,
    events: mpsc::UnboundedSender<Event>,
    span: StageSpan,
    labels: StageLabels,
    /// Answers waiting for this prompt to complete.
    forks: Vec<Fork>,
    /// Scoring this prompt, and the scores so far.
    score: Option<(Scoring, Vec<TokenLogprobs>)>,
}

impl Drop for Running {
    /// However the sequence leaves, the full blocks it computed join the prefix cache: a later
    /// turn of the same chat resends the prompt and this answer.
    fn drop(&mut self) {
        if matches!(self.phase, Phase::Decode { .. }) {
            let tokens: Vec<u32> = self.prompt.iter().chain(self.tracker.generated()).copied().collect();
            self.kv.cache_prefix(&tokens);
        }
    }
}

impl Running {
    /// Ends the sequence with `status` (reported to its stream and recorded on its span).
    fn fail(&self, status: tonic::Status) {
        self.span.error(status.message());
        let _ = self.events.send(Err(status));
    }

    fn finished_event(&self, finish: pd_engine::FinishReason, decode_ms: f64) -> Event {
        event(pb::decode_event::Event::Finished(pb::Finished {
            finish_reason: finish.as_str().to_string(),
            prompt_tokens: self.prompt.len() as u32,
            cached_tokens: self.cached_tokens as u32,
            completion_tokens: self.tracker.generated().len() as u32,
            kv_transfer_ms: self.received.kv_transfer_ms,
            decode_ms,
            kv_bytes: self.received.kv_bytes,
            queue_ms: self.clock.queue_ms,
            prefill_ms: self.clock.prefill_ms,
            index: self.index,
        }))
    }

    /// Records `token`; false when the sequence is done (finished, failed or abandoned).
    fn emit(
        &mut self,
        token: u32,
        logprobs: Option<pb::TokenLogprobs>,
        tokenizer: &Tokenizer,
        metrics: &DecodeMetrics,
    ) -> bool {
        let out = match self.tracker.push(token, tokenizer) {
            Ok(out) => out,
            Err(e) => {
                self.fail(tonic::Status::internal(e.to_string()));
                return false;
            }
        };
        let token_event = pb::TokenEvent {
            token_id: token,
            text: out.text_delta,
            server_time_unix_nanos: now_nanos(),
            logprobs,
            index: self.index,
        };
        if self.events.send(event(pb::decode_event::Event::Token(token_event))).is_err() {
            self.span.set("pd.outcome", "cancelled");
            return false; // client gone: free the blocks now
        }
        let Some(finish) = out.finish else {
            self.phase = Phase::Decode { next: token };
            return true;
        };
        let decode_time = self.clock.started.elapsed();
        self.labels.observe(&metrics.decode_time, decode_time.as_secs_f64());
        self.span.set("gen_ai.usage.output_tokens", self.tracker.generated().len() as i64);
        self.span.set("gen_ai.response.finish_reasons", finish.as_str().to_string());
        let _ = self.events.send(self.finished_event(finish, decode_time.as_secs_f64() * 1e3));
        false
    }

    /// Counts `take` prompt tokens as computed at a step that began at `step_started`; true
    /// when the prompt is complete (its last row's logits give the first token).
    fn advance_prompt(&mut self, take: usize, step_started: Instant) -> bool {
        let Phase::Prompt { done } = &mut self.phase else { return true };
        if self.clock.prefill_started.is_none() {
            self.clock.prefill_started = Some(step_started);
            self.clock.queue_ms = (step_started - self.clock.admitted).as_secs_f64() * 1e3;
        }
        *done += take;
        self.span.event("prefill.chunk", vec![KeyValue::new("pd.chunk.tokens", take as i64)]);
        if *done < self.prompt.len() {
            return false;
        }
        self.kv.cache_prefix(&self.prompt);
        self.clock.prefill_ms = self.clock.prefill_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
        self.clock.started = Instant::now();
        true
    }

    /// Scores the `take` rows of `logits` from `row` on (this sequence's chunk at its
    /// `done..`): each position but the prompt's last gives the next prompt token's log
    /// probability. When the chunk completes the prompt, the scores go to the sink.
    fn score_chunk(&mut self, logits: &candle_core::Tensor, row: usize, take: usize) -> Result<(), EngineError> {
        let (Phase::Prompt { done }, Some((scoring, scored))) = (&self.phase, &mut self.score) else { return Ok(()) };
        for j in 0..take {
            let Some(&next) = self.prompt.get(done + j + 1) else { break };
            let values = logits.get(row + j)?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            scored.push(pd_engine::token_logprobs(&values, next, scoring.top));
        }
        if done + take == self.prompt.len() {
            if let Some((scoring, scored)) = self.score.take() {
                let _ = scoring.sink.send(scored);
            }
        }
        Ok(())
    }

    /// The answers waiting for this (complete) prompt, over its KV; a fork whose KV cannot be
    /// made fails the request on the shared stream.
    fn spawn_forks(&mut self, fork: Forker<'_>) -> Vec<Admission> {
        let last = self.prompt.len() - 1;
        let forks = std::mem::take(&mut self.forks);
        let mut admissions = Vec::with_capacity(forks.len());
        for f in forks {
            match fork(&self.kv, last, f.own) {
                Ok(kv) => admissions.push(Admission {
                    index: f.index,
                    kv,
                    start: Start::Prompt { from: last },
                    prompt: self.prompt.clone(),
                    params: f.params,
                    cached_tokens: self.cached_tokens,
                    received: Received::default(),
                    events: self.events.clone(),
                    span: f.span,
                    labels: self.labels.clone(),
                    forks: Vec::new(),
                    score: None,
                }),
                Err(e) => {
                    let message = format!("answer {} could not share the prompt's KV: {e}", f.index);
                    f.span.error(message.clone());
                    let _ = self.events.send(Err(tonic::Status::internal(message)));
                }
            }
        }
        admissions
    }
}

/// The running batch; see the module docs.
#[derive(Debug)]
pub struct BatchState {
    running: Vec<Running>,
    policy: PrefillPolicy,
    max_batch: usize,
}

impl BatchState {
    pub fn new(policy: PrefillPolicy, max_batch: usize) -> Self {
        BatchState { running: Vec::new(), policy, max_batch: max_batch.max(1) }
    }

    /// Sequences in the batch (prompts being prefilled here included).
    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// How many more sequences may join (answers waiting for their prompt count: they join
    /// without asking). A prompt with forks may take the batch past `max_batch` by them once.
    pub fn room(&self) -> usize {
        let held: usize = self.running.iter().map(|s| 1 + s.forks.len()).sum();
        self.max_batch.saturating_sub(held)
    }

    /// Joins `a` to the batch. A prefilled sequence streams its first token at once (it may
    /// also finish with it); a bad sampling setup fails the sequence with INVALID_ARGUMENT.
    pub fn admit(&mut self, a: Admission, tokenizer: &Tokenizer, metrics: &DecodeMetrics) {
        let mut sampler = match Sampler::for_sequence(&a.params, &a.prompt, tokenizer) {
            Ok(s) => s,
            Err(e) => {
                a.span.error(e.to_string());
                let _ = a.events.send(Err(tonic::Status::invalid_argument(e.to_string())));
                return;
            }
        };
        let (phase, first) = match a.start {
            Start::Prefilled { first_token, logprobs } => {
                // The prefill worker sampled the first output position.
                if let Err(e) = sampler.accept(first_token) {
                    let message = format!("the first token {first_token} does not fit the request: {e}");
                    a.span.error(message.clone());
                    let _ = a.events.send(Err(tonic::Status::invalid_argument(message)));
                    return;
                }
                (Phase::Decode { next: first_token }, Some((first_token, logprobs)))
            }
            Start::Prompt { from } => (Phase::Prompt { done: from.min(a.prompt.len()) }, None),
        };
        let now = Instant::now();
        let mut seq = Running {
            index: a.index,
            tracker: OutputTracker::new(a.params, tokenizer),
            kv: a.kv,
            phase,
            sampler,
            prompt: a.prompt,
            cached_tokens: a.cached_tokens,
            received: a.received,
            clock: Clock { admitted: now, prefill_started: None, queue_ms: 0.0, prefill_ms: 0.0, started: now },
            events: a.events,
            span: a.span,
            labels: a.labels,
            forks: a.forks,
            score: a.score.map(|s| (s, Vec::new())),
        };
        if first.is_none_or(|(token, logprobs)| seq.emit(token, logprobs, tokenizer, metrics)) {
            self.running.push(seq);
        }
    }

    /// Removes the sequences whose client went away (their blocks are freed).
    pub fn drop_cancelled(&mut self) {
        self.running.retain(|s| !s.events.is_closed());
    }

    /// Ends every sequence with `status` (a failed step, or shutdown after the grace period).
    pub fn fail_all(&mut self, status: tonic::Status) {
        for seq in self.running.drain(..) {
            seq.fail(status.clone());
        }
    }

    /// Tokens each sequence runs in the next step: 1 for a decoding one, the prompt chunk the
    /// policy admits (maybe 0) for one being prefilled here (`plan::plan`).
    pub fn plan(&self) -> Vec<usize> {
        let rows: Vec<Row> = self
            .running
            .iter()
            .map(|s| match &s.phase {
                Phase::Decode { .. } => Row::Decode,
                Phase::Prompt { done } => Row::Prompt { left: s.prompt.len() - done },
            })
            .collect();
        crate::plan::plan(self.policy, &rows)
    }

    /// The token rows of each sequence for `takes` (empty for a sequence that waits).
    pub fn inputs(&self, takes: &[usize]) -> Vec<Vec<u32>> {
        let rows = self.running.iter().zip(takes).map(|(s, &take)| match &s.phase {
            Phase::Decode { next } => vec![*next],
            Phase::Prompt { done } => s.prompt[*done..*done + take].to_vec(),
        });
        rows.collect()
    }

    /// The forward's batch for `inputs`: every sequence with rows, asking for logits where a
    /// token will be sampled (decode rows, and a prompt's last chunk).
    pub fn batch<'a>(&'a mut self, inputs: &'a [Vec<u32>]) -> Vec<BatchSeq<'a>> {
        let rows = self.running.iter_mut().zip(inputs).filter(|(_, t)| !t.is_empty());
        rows.map(|(s, tokens)| {
            let want_logits = match &s.phase {
                Phase::Decode { .. } => true,
                Phase::Prompt { done } => done + tokens.len() == s.prompt.len(),
            };
            BatchSeq { tokens, kv: &mut s.kv, want_logits }
        })
        .collect()
    }

    /// For each sequence of `batch(inputs)`, whether it wants a logits row for every one of its
    /// tokens (a prompt being scored), in the same order.
    pub fn every_row(&self, inputs: &[Vec<u32>]) -> Vec<bool> {
        let rows = self.running.iter().zip(inputs).filter(|(_, t)| !t.is_empty());
        rows.map(|(s, _)| s.score.is_some() && matches!(s.phase, Phase::Prompt { .. })).collect()
    }

    /// Applies a step's logits (one row per sequence that asked, in batch order; every row of
    /// a prompt being scored): scores prompts, advances them (a complete one lets its forks
    /// join, made by `fork`), samples and streams tokens, and removes the sequences that are
    /// done.
    pub fn apply_logits(
        &mut self,
        takes: &[usize],
        logits: &candle_core::Tensor,
        step_started: Instant,
        with: StepTools<'_>,
    ) {
        let StepTools { tokenizer, metrics, fork } = with;
        let mut row = 0;
        let mut keep = Vec::with_capacity(self.running.len());
        let mut forked = Vec::new();
        for (mut seq, &take) in self.running.drain(..).zip(takes) {
            if take > 0 && seq.score.is_some() {
                let completes = matches!(seq.phase, Phase::Prompt { done } if done + take == seq.prompt.len());
                if let Err(e) = seq.score_chunk(logits, row, take) {
                    seq.fail(tonic::Status::internal(format!("scoring the prompt failed: {e}")));
                    row += take;
                    continue;
                }
                // The prompt's last row is the one every prompt gives (the first token's).
                row += if completes { take - 1 } else { take };
            }
            if take == 0 || !seq.advance_prompt(take, step_started) {
                keep.push(seq);
                continue;
            }
            if !seq.forks.is_empty() {
                forked.extend(seq.spawn_forks(fork));
            }
            let sampled = logits.get(row).map_err(EngineError::from).and_then(|r| seq.sampler.draw(&r));
            row += 1;
            match sampled {
                Ok(s) if seq.emit(s.token, s.logprobs.as_ref().map(logprobs_to_pb), tokenizer, metrics) => {
                    keep.push(seq)
                }
                Ok(_) => {}
                Err(e) => seq.fail(tonic::Status::internal(format!("sampling failed: {e}"))),
            }
        }
        self.running = keep;
        for a in forked {
            self.admit(a, tokenizer, metrics);
        }
    }
}

#[cfg(test)]
mod tests;
