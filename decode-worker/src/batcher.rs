//! Continuous batching: one thread owns the decode loop. Sequences join as their KV commits
//! and leave when they finish, fail, or their client goes away; every step runs all running
//! sequences' next tokens in one forward pass.
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
use pd_telemetry::StageSpan;
use tokio::sync::mpsc;

/// What the batch loop reports about one sequence.
pub type Event = Result<pb::DecodeEvent, tonic::Status>;

/// Wraps one event of a decode stream.
pub fn event(e: pb::decode_event::Event) -> Event {
    Ok(pb::DecodeEvent { event: Some(e) })
}

/// A sequence ready to decode: its KV holds the prompt; `first_token` came from prefill.
pub struct Admission {
    pub kv: SequenceKv,
    pub first_token: u32,
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

struct Running {
    kv: SequenceKv,
    next: u32,
    sampler: Sampler,
    tracker: OutputTracker,
    prompt_tokens: usize,
    kv_transfer_ms: f64,
    kv_bytes: u64,
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
    pub fn start(engine: Arc<Engine>, max_batch: usize, metrics: DecodeMetrics) -> Self {
        let (admit, rx) = std_mpsc::channel();
        let running = Arc::new(AtomicUsize::new(0));
        let end_all = Arc::new(AtomicBool::new(false));
        let loop_state = Loop { engine, gauge: running.clone(), end_all: end_all.clone(), metrics, max_batch: max_batch.max(1) };
        std::thread::Builder::new()
            .name("pd-decode-batch".into())
            .spawn(move || run(loop_state, rx))
            .expect("spawning the decode loop thread");
        Batcher { admit, running, end_all }
    }

    /// Ends every running and every later sequence with UNAVAILABLE (shutdown).
    pub fn end_all(&self) {
        // Checked before every step; an idle loop has nothing to end, and a sequence admitted
        // later ends right after its first token.
        self.end_all.store(true, Ordering::Relaxed);
    }

    /// Sequences in the running batch.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Hands a committed sequence to the loop; if the loop is gone the sequence is dropped
    /// (its blocks freed) and the caller gets it back as an error.
    pub fn admit(&self, admission: Admission) -> Result<(), tonic::Status> {
        self.admit
            .send(admission)
            .map_err(|_| tonic::Status::unavailable("the decode loop has stopped"))
    }
}

fn token_event(token: u32, text: String) -> Event {
    event(pb::decode_event::Event::Token(pb::TokenEvent { token_id: token, text, server_time_unix_nanos: now_nanos() }))
}

/// Records `token` for `seq`; returns false if the sequence is done (finished or abandoned).
/// Ends `seq` with `status` (reported to its stream and recorded on its span).
fn fail(seq: &Running, status: tonic::Status) {
    seq.span.error(status.message());
    let _ = seq.events.send(Err(status));
}

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
        metrics.decode_time.with_label_values(&[seq.labels[0].as_str(), seq.labels[1].as_str()]).observe(decode_time.as_secs_f64());
        seq.span.set("gen_ai.usage.output_tokens", seq.tracker.generated().len() as i64);
        seq.span.set("gen_ai.response.finish_reasons", finish.as_str().to_string());
        let finished = pb::Finished {
            finish_reason: finish.as_str().to_string(),
            prompt_tokens: seq.prompt_tokens as u32,
            completion_tokens: seq.tracker.generated().len() as u32,
            kv_transfer_ms: seq.kv_transfer_ms,
            decode_ms: decode_time.as_secs_f64() * 1e3,
            kv_bytes: seq.kv_bytes,
        };
        let _ = seq.events.send(event(pb::decode_event::Event::Finished(finished)));
        return false;
    }
    seq.next = token;
    true
}

struct Loop {
    engine: Arc<Engine>,
    gauge: Arc<AtomicUsize>,
    end_all: Arc<AtomicBool>,
    metrics: DecodeMetrics,
    max_batch: usize,
}

fn run(state: Loop, admissions: std_mpsc::Receiver<Admission>) {
    let Loop { engine, gauge, end_all, metrics, max_batch } = state;
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
            let mut seq = Running {
                tracker: OutputTracker::new(a.params.clone(), engine.tokenizer()),
                kv: a.kv,
                next: a.first_token,
                sampler,
                prompt_tokens: a.prompt_tokens,
                kv_transfer_ms: a.kv_transfer_ms,
                kv_bytes: a.kv_bytes,
                started: Instant::now(),
                events: a.events,
                span: a.span,
                labels: a.labels,
            };
            if emit(&engine, &metrics, &mut seq, a.first_token) {
                running.push(seq);
            }
        }
        if end_all.load(Ordering::Relaxed) {
            for seq in running.drain(..) {
                fail(&seq, tonic::Status::unavailable("the decode worker shut down before the sequence finished (grace period over)"));
            }
        }
        // Clients that went away while we waited.
        running.retain(|s| !s.events.is_closed());
        gauge.store(running.len(), Ordering::Relaxed);
        if running.is_empty() {
            continue;
        }
        let logits = {
            let nexts: Vec<u32> = running.iter().map(|s| s.next).collect();
            let mut batch: Vec<BatchSeq<'_>> = running
                .iter_mut()
                .zip(&nexts)
                .map(|(s, t)| BatchSeq { tokens: std::slice::from_ref(t), kv: &mut s.kv, want_logits: true })
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
        let mut keep = Vec::with_capacity(running.len());
        for (i, mut seq) in running.drain(..).enumerate() {
            let token = logits.get(i).map_err(pd_engine::EngineError::from).and_then(|row| seq.sampler.sample(&row));
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
