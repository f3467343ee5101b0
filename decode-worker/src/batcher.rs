//! Continuous batching: one thread owns the decode loop. Sequences join as their KV commits
//! (disaggregated) or with their prompt still to run (`prefill_here`: colocated serving, or a
//! short prompt under conditional disaggregation), and leave when they finish, fail, or
//! their client goes away. Every step is one forward pass over every decoding sequence's
//! next token plus the prompt chunks the prefill policy admits:
//!
//! - `Chunked { step_tokens }`: prompt chunks fill what the decode rows leave of a token
//!   budget per step, first come first served, so a long prompt is spread over many steps
//!   and running streams keep their pace (Sarathi-style chunked prefill);
//! - `Naive`: the oldest waiting prompt runs whole in the next step, one per step (the
//!   baseline whose stalls disaggregation removes).
//!
//! Blocks for a sequence's whole output were reserved with its prompt, so a step never runs
//! out of KV blocks; a sequence's blocks are freed the moment it leaves the batch.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use pd_engine::{BatchSeq, Engine, OutputTracker, Sampler, SamplingParams, SequenceKv};
use pd_proto::v1 as pb;
use pd_telemetry::metrics::DecodeMetrics;
use pd_telemetry::opentelemetry::KeyValue;
use pd_telemetry::StageSpan;
use tokio::sync::mpsc;

/// What the batch loop reports about one sequence.
pub type Event = Result<pb::DecodeEvent, tonic::Status>;

/// Wraps one event of a decode stream.
pub fn event(e: pb::decode_event::Event) -> Event {
    Ok(pb::DecodeEvent { event: Some(e) })
}

/// How prompts prefilled on this worker share steps with the running streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillPolicy {
    Chunked { step_tokens: usize },
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
pub enum Start {
    /// The KV holds the prompt (a prefill worker sent it) and this is the first token.
    Prefilled { first_token: u32 },
    /// The prompt runs here, in the batch.
    Prompt(Vec<u32>),
}

/// A sequence ready to join the batch.
pub struct Admission {
    pub kv: SequenceKv,
    pub start: Start,
    pub params: SamplingParams,
    pub prompt_tokens: usize,
    pub kv_transfer_ms: f64,
    pub kv_bytes: u64,
    pub events: mpsc::UnboundedSender<Event>,
    /// `decode.generate`, ended when the sequence leaves the batch.
    pub span: StageSpan,
    /// Metric labels: class and input bucket.
    pub labels: [String; 2],
}

enum Phase {
    /// Prompt tokens `done..` still to run.
    Prompt { tokens: Vec<u32>, done: usize },
    /// The next token to feed.
    Decode { next: u32 },
}

struct Running {
    kv: SequenceKv,
    phase: Phase,
    sampler: Sampler,
    tracker: OutputTracker,
    prompt_tokens: usize,
    kv_transfer_ms: f64,
    kv_bytes: u64,
    admitted: Instant,
    prefill_started: Option<Instant>,
    queue_ms: f64,
    prefill_ms: f64,
    /// The first token's time (decode time runs from here).
    started: Instant,
    events: mpsc::UnboundedSender<Event>,
    span: StageSpan,
    labels: [String; 2],
}

/// Handle to the batch loop.
#[derive(Clone)]
pub struct Batcher {
    admit: std_mpsc::Sender<Admission>,
    running: Arc<AtomicUsize>,
    /// Set at the end of a shutdown's grace period: every sequence still running ends
    /// with UNAVAILABLE and its blocks are freed.
    end_all: Arc<AtomicBool>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Batcher({} running)", self.running())
    }
}

fn now_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

impl Batcher {
    /// Starts the loop on its own thread; it ends when every handle is dropped.
    pub fn start(engine: Arc<Engine>, max_batch: usize, policy: PrefillPolicy, metrics: DecodeMetrics) -> Self {
        let (admit, rx) = std_mpsc::channel();
        let running = Arc::new(AtomicUsize::new(0));
        let end_all = Arc::new(AtomicBool::new(false));
        let loop_state = Loop {
            engine,
            gauge: running.clone(),
            end_all: end_all.clone(),
            metrics,
            max_batch: max_batch.max(1),
            policy,
        };
        std::thread::Builder::new()
            .name("pd-decode-batch".into())
            .spawn(move || run(loop_state, rx))
            .expect("spawning the decode loop thread");
        Batcher { admit, running, end_all }
    }

    /// Ends every running and every later sequence with UNAVAILABLE (shutdown).
    pub fn end_all(&self) {
        // Checked before every step; an idle loop has nothing to end, and a sequence admitted
        // later ends before its next step.
        self.end_all.store(true, Ordering::Relaxed);
    }

    /// Sequences in the running batch (prompts being prefilled here included).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Hands a sequence to the loop; if the loop is gone the sequence is dropped (its blocks
    /// freed) and the caller gets it back as an error.
    pub fn admit(&self, admission: Admission) -> Result<(), tonic::Status> {
        self.admit.send(admission).map_err(|_| tonic::Status::unavailable("the decode loop has stopped"))
    }
}

fn token_event(token: u32, text: String) -> Event {
    event(pb::decode_event::Event::Token(pb::TokenEvent { token_id: token, text, server_time_unix_nanos: now_nanos() }))
}

/// Ends `seq` with `status` (reported to its stream and recorded on its span).
fn fail(seq: &Running, status: tonic::Status) {
    seq.span.error(status.message());
    let _ = seq.events.send(Err(status));
}

/// Records `token` for `seq`; returns false if the sequence is done (finished or abandoned).
fn emit(engine: &Engine, metrics: &DecodeMetrics, seq: &mut Running, token: u32) -> bool {
    let out = match seq.tracker.push(token, engine.tokenizer()) {
        Ok(out) => out,
        Err(e) => {
            fail(seq, tonic::Status::internal(e.to_string()));
            return false;
        }
    };
    if seq.events.send(token_event(token, out.text_delta)).is_err() {
        seq.span.set("pd.outcome", "cancelled");
        return false; // client gone: free the blocks now
    }
    if let Some(finish) = out.finish {
        let decode_time = seq.started.elapsed();
        metrics
            .decode_time
            .with_label_values(&[seq.labels[0].as_str(), seq.labels[1].as_str()])
            .observe(decode_time.as_secs_f64());
        seq.span.set("gen_ai.usage.output_tokens", seq.tracker.generated().len() as i64);
        seq.span.set("gen_ai.response.finish_reasons", finish.as_str().to_string());
        let finished = pb::Finished {
            finish_reason: finish.as_str().to_string(),
            prompt_tokens: seq.prompt_tokens as u32,
            completion_tokens: seq.tracker.generated().len() as u32,
            kv_transfer_ms: seq.kv_transfer_ms,
            decode_ms: decode_time.as_secs_f64() * 1e3,
            kv_bytes: seq.kv_bytes,
            queue_ms: seq.queue_ms,
            prefill_ms: seq.prefill_ms,
        };
        let _ = seq.events.send(event(pb::decode_event::Event::Finished(finished)));
        return false;
    }
    seq.phase = Phase::Decode { next: token };
    true
}

struct Loop {
    engine: Arc<Engine>,
    gauge: Arc<AtomicUsize>,
    end_all: Arc<AtomicBool>,
    metrics: DecodeMetrics,
    max_batch: usize,
    policy: PrefillPolicy,
}

/// Prompt tokens each sequence runs in the next step (0 = none), under `policy`.
fn plan(running: &[Running], policy: PrefillPolicy) -> Vec<usize> {
    let decoding = running.iter().filter(|s| matches!(s.phase, Phase::Decode { .. })).count();
    let mut budget = match policy {
        // At least one chunk's worth of progress per step, even under a full decode batch.
        PrefillPolicy::Chunked { step_tokens } => step_tokens.saturating_sub(decoding).max(step_tokens / 4).max(1),
        PrefillPolicy::Naive => usize::MAX,
    };
    let mut prompts_this_step = 0;
    running
        .iter()
        .map(|s| match &s.phase {
            Phase::Decode { .. } => 1,
            Phase::Prompt { tokens, done } => {
                if budget == 0 || (policy == PrefillPolicy::Naive && prompts_this_step > 0) {
                    return 0;
                }
                let take = (tokens.len() - done).min(budget);
                budget -= take;
                prompts_this_step += 1;
                take
            }
        })
        .collect()
}

fn run(state: Loop, admissions: std_mpsc::Receiver<Admission>) {
    let Loop { engine, gauge, end_all, metrics, max_batch, policy } = state;
    let mut running: Vec<Running> = Vec::new();
    loop {
        let mut incoming = Vec::new();
        if running.is_empty() {
            match admissions.recv() {
                Ok(a) => incoming.push(a),
                Err(_) => return,
            }
        }
        while running.len() + incoming.len() < max_batch {
            match admissions.try_recv() {
                Ok(a) => incoming.push(a),
                Err(_) => break,
            }
        }
        for a in incoming {
            let sampler = match Sampler::new(&a.params) {
                Ok(s) => s,
                Err(e) => {
                    a.span.error(e.to_string());
                    let _ = a.events.send(Err(tonic::Status::invalid_argument(e.to_string())));
                    continue;
                }
            };
            let (phase, first) = match a.start {
                Start::Prefilled { first_token } => (Phase::Decode { next: first_token }, Some(first_token)),
                Start::Prompt(tokens) => (Phase::Prompt { tokens, done: 0 }, None),
            };
            let mut seq = Running {
                tracker: OutputTracker::new(a.params.clone(), engine.tokenizer()),
                kv: a.kv,
                phase,
                sampler,
                prompt_tokens: a.prompt_tokens,
                kv_transfer_ms: a.kv_transfer_ms,
                kv_bytes: a.kv_bytes,
                admitted: Instant::now(),
                prefill_started: None,
                queue_ms: 0.0,
                prefill_ms: 0.0,
                started: Instant::now(),
                events: a.events,
                span: a.span,
                labels: a.labels,
            };
            match first {
                Some(token) => {
                    if emit(&engine, &metrics, &mut seq, token) {
                        running.push(seq);
                    }
                }
                None => running.push(seq),
            }
        }
        if end_all.load(Ordering::Relaxed) {
            for seq in running.drain(..) {
                fail(
                    &seq,
                    tonic::Status::unavailable(
                        "the decode worker shut down before the sequence finished (grace period over)",
                    ),
                );
            }
        }
        // Clients that went away while we waited.
        running.retain(|s| !s.events.is_closed());
        gauge.store(running.len(), Ordering::Relaxed);
        if running.is_empty() {
            continue;
        }
        let takes = plan(&running, policy);
        let step_started = Instant::now();
        let logits = {
            let inputs: Vec<Vec<u32>> = running
                .iter()
                .zip(&takes)
                .map(|(s, &take)| match &s.phase {
                    Phase::Decode { next } => vec![*next],
                    Phase::Prompt { tokens, done } => tokens[*done..*done + take].to_vec(),
                })
                .collect();
            let mut batch: Vec<BatchSeq<'_>> = running
                .iter_mut()
                .zip(&inputs)
                .filter(|(_, t)| !t.is_empty())
                .map(|(s, t)| {
                    let want_logits = match &s.phase {
                        Phase::Decode { .. } => true,
                        Phase::Prompt { tokens, done } => done + t.len() == tokens.len(),
                    };
                    BatchSeq { tokens: t, kv: &mut s.kv, want_logits }
                })
                .collect();
            engine.forward(&mut batch)
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // A failed step fails every sequence in it, with the reason; none hangs.
                for seq in running.drain(..) {
                    fail(&seq, tonic::Status::internal(format!("decode step failed: {e}")));
                }
                gauge.store(0, Ordering::Relaxed);
                continue;
            }
        };
        let mut row = 0;
        let mut keep = Vec::with_capacity(running.len());
        for (mut seq, take) in running.drain(..).zip(takes) {
            let sampled_now = match &mut seq.phase {
                Phase::Decode { .. } => true,
                Phase::Prompt { tokens, done } => {
                    if take == 0 {
                        keep.push(seq);
                        continue;
                    }
                    if seq.prefill_started.is_none() {
                        seq.prefill_started = Some(step_started);
                        seq.queue_ms = (step_started - seq.admitted).as_secs_f64() * 1e3;
                    }
                    *done += take;
                    seq.span.event("prefill.chunk", vec![KeyValue::new("pd.chunk.tokens", take as i64)]);
                    let finished = *done == tokens.len();
                    if finished {
                        seq.prefill_ms = seq.prefill_started.map(|t| t.elapsed().as_secs_f64() * 1e3).unwrap_or(0.0);
                        seq.started = Instant::now();
                    }
                    finished
                }
            };
            if !sampled_now {
                keep.push(seq);
                continue;
            }
            let token = logits.get(row).map_err(pd_engine::EngineError::from).and_then(|r| seq.sampler.sample(&r));
            row += 1;
            match token {
                Ok(t) => {
                    if emit(&engine, &metrics, &mut seq, t) {
                        keep.push(seq);
                    }
                }
                Err(e) => fail(&seq, tonic::Status::internal(format!("sampling failed: {e}"))),
            }
        }
        running = keep;
        gauge.store(running.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::PrefillPolicy;

    #[test]
    fn policies_parse_and_bad_ones_are_named() {
        assert_eq!("naive".parse(), Ok(PrefillPolicy::Naive));
        assert_eq!("chunked".parse(), Ok(PrefillPolicy::Chunked { step_tokens: 256 }));
        assert_eq!("chunked:64".parse(), Ok(PrefillPolicy::Chunked { step_tokens: 64 }));
        for bad in ["chunked:0", "greedy", "chunked:x"] {
            let err = bad.parse::<PrefillPolicy>().expect_err(bad);
            assert!(err.contains(bad), "{err}");
        }
    }
}
