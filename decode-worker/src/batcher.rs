//! Continuous batching: one thread owns the decode loop and its `BatchState`. Sequences join
//! as their KV commits (disaggregated) or with their prompt still to run (`prefill_here`:
//! colocated serving, or a short prompt under conditional disaggregation), and leave when
//! they finish, fail, or their client goes away. Every step is one forward pass over every
//! decoding sequence's next token plus the prompt chunks the prefill policy admits.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use pd_engine::Engine;
use pd_telemetry::metrics::DecodeMetrics;

use crate::batch::{Admission, BatchState, PrefillPolicy, StepTools};

/// Handle to the batch loop.
#[derive(Clone)]
pub struct Batcher {
    admit: std_mpsc::Sender<Admission>,
    running: Arc<AtomicUsize>,
    /// Set at the end of a shutdown's grace period: every sequence still running ends
    /// with UNAVAILABLE and its blocks are freed.
    end_all: Arc<AtomicBool>,
    max_batch: usize,
    /// Smoothed step time in ms, as f64 bits (0 when idle).
    step_ms: Arc<AtomicU64>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Batcher({} running)", self.running())
    }
}

impl Batcher {
    /// Starts the loop on its own thread; it ends when every handle is dropped.
    pub fn start(
        engine: Arc<Engine>,
        max_batch: usize,
        policy: PrefillPolicy,
        metrics: DecodeMetrics,
    ) -> std::io::Result<Self> {
        let (admit, rx) = std_mpsc::channel();
        let running = Arc::new(AtomicUsize::new(0));
        let end_all = Arc::new(AtomicBool::new(false));
        let state = BatchState::new(policy, max_batch);
        let step_ms = Arc::new(AtomicU64::new(0));
        let loop_state =
            Loop { engine, state, gauge: running.clone(), end_all: end_all.clone(), metrics, step_ms: step_ms.clone() };
        std::thread::Builder::new().name("pd-decode-batch".into()).spawn(move || loop_state.run(rx))?;
        Ok(Batcher { admit, running, end_all, max_batch: max_batch.max(1), step_ms })
    }

    /// Ends every running and every later sequence with UNAVAILABLE (shutdown).
    pub fn end_all(&self) {
        // Checked before every step; an idle loop has nothing to end, and a sequence admitted
        // later ends before its next step.
        self.end_all.store(true, Ordering::Relaxed);
    }

    /// Most sequences in one step.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Recent step time in milliseconds, smoothed (0 while idle).
    pub fn step_ms(&self) -> f64 {
        if self.running() == 0 {
            0.0
        } else {
            f64::from_bits(self.step_ms.load(Ordering::Relaxed))
        }
    }

    /// Sequences in the running batch (prompts being prefilled here included).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Hands a sequence to the loop; if the loop is gone the sequence is dropped (its blocks
    /// freed) and the caller gets an error.
    pub fn admit(&self, admission: Admission) -> Result<(), crate::DecodeError> {
        self.admit.send(admission).map_err(|_| crate::DecodeError::LoopStopped)
    }
}

struct Loop {
    engine: Arc<Engine>,
    state: BatchState,
    gauge: Arc<AtomicUsize>,
    end_all: Arc<AtomicBool>,
    metrics: DecodeMetrics,
    step_ms: Arc<AtomicU64>,
}

impl Loop {
    fn run(mut self, admissions: std_mpsc::Receiver<Admission>) {
        loop {
            if self.state.is_empty() {
                // Idle: sleep until a sequence arrives (or every handle is gone).
                match admissions.recv() {
                    Ok(a) => self.state.admit(a, self.engine.tokenizer(), &self.metrics),
                    Err(_) => return,
                }
            }
            while self.state.room() > 0 {
                match admissions.try_recv() {
                    Ok(a) => self.state.admit(a, self.engine.tokenizer(), &self.metrics),
                    Err(_) => break,
                }
            }
            if self.end_all.load(Ordering::Relaxed) {
                let status = "the decode worker shut down before the sequence finished (grace period over)";
                self.state.fail_all(tonic::Status::unavailable(status));
            }
            self.state.drop_cancelled();
            self.gauge.store(self.state.len(), Ordering::Relaxed);
            if !self.state.is_empty() {
                self.step();
                self.gauge.store(self.state.len(), Ordering::Relaxed);
            }
        }
    }

    /// One forward over the batch; a failed step fails every sequence in it, with the reason.
    fn step(&mut self) {
        let takes = self.state.plan();
        let inputs = self.state.inputs(&takes);
        let step_started = Instant::now();
        let every_row = self.state.every_row(&inputs);
        let mut batch = self.state.batch(&inputs);
        let logits = match every_row.contains(&true) {
            false => self.engine.forward(&mut batch),
            true => {
                let (model, cache) = (self.engine.model(), self.engine.cache());
                model.forward_rows(cache, &mut batch, &every_row, &mut |_| std::ops::ControlFlow::Continue(()))
            }
        };
        drop(batch);
        let took = step_started.elapsed().as_secs_f64() * 1e3;
        let old = f64::from_bits(self.step_ms.load(Ordering::Relaxed));
        let smoothed = if old == 0.0 { took } else { 0.7 * old + 0.3 * took };
        self.step_ms.store(smoothed.to_bits(), Ordering::Relaxed);
        match logits {
            Ok(logits) => {
                let engine = &self.engine;
                let fork = |kv: &pd_engine::SequenceKv, valid: usize, own: pd_engine::BlockAllocation| {
                    engine.fork_sequence(kv, valid, own)
                };
                let with = StepTools { tokenizer: engine.tokenizer(), metrics: &self.metrics, fork: &fork };
                self.state.apply_logits(&takes, &logits, step_started, with)
            }
            Err(e) => self.state.fail_all(tonic::Status::internal(format!("decode step failed: {e}"))),
        }
    }
}
