//! The prefill step loop: one thread owns the engine's prefill steps. Requests hand it whole
//! prompts; every step it plans (`step::plan`) which prompts run and how many tokens each,
//! takes blocks for prompts starting now (a prompt waiting for blocks holds none; one whose
//! prefix is in the prefix cache starts after it, on the shared blocks), runs them
//! together in one forward, and tells each request what happened: `Started` (its blocks),
//! `Chunk` after each of its steps, `Layer(l)` during its last step as soon as layer `l`
//! holds its whole prompt (so the pipeline ships it while later layers compute), then
//! `Done` with the logits and its KV, whose full blocks then join the prefix cache. A request
//! whose receiver is gone (cancelled) is dropped
//! before the next step and its blocks are freed. The measured step times correct the cost
//! model, which gives the worker's tokens/s for short prompts (what the router's wait
//! estimates are about: a step of a full short chunk at no context).
//!
//! Preemption (`StepConfig::preempt`): a step of long prompts' chunks only, none of them
//! finishing, stops between layers when a short prompt has been submitted since the step
//! began (while at least a quarter of its layers are left), so the short prompt waits about
//! one layer instead of the rest of the step. Nothing advanced; the long chunks run again in
//! a later step (their half-written K/V are overwritten). A step whose prompt finishes is
//! never stopped: its layers are already being shipped.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use candle_core::Tensor;
use pd_engine::{BatchSeq, Engine, EngineError, SequenceKv};
use tokio::sync::mpsc;

use crate::step::{plan, Candidate, CostModel, StepConfig};

/// What the loop tells one request.
#[derive(Debug)]
pub enum StepEvent {
    /// Its blocks, and how many leading tokens they already hold (prefix cache hit).
    Started {
        blocks: Vec<u32>,
        cached: usize,
        at: SystemTime,
    },
    Chunk {
        tokens: usize,
        at: SystemTime,
    },
    Layer(usize, Instant),
    Done(Box<Finished>),
    Failed(EngineError),
}

/// A prompt's prefill, finished.
#[derive(Debug)]
pub struct Finished {
    /// `[vocab]` logits after the last prompt token.
    pub logits: Tensor,
    /// A scored prompt's: the log probability of each prompt token after the first given the
    /// ones before it (with its `k` most likely alternatives), in order.
    pub prompt_logprobs: Vec<pd_engine::TokenLogprobs>,
    pub kv: SequenceKv,
    /// Time of the steps this prompt was in.
    pub compute_time: Duration,
    pub ended: Instant,
    pub ended_wall: SystemTime,
}

struct Submitted {
    prompt: Vec<u32>,
    /// Scored: every prompt position's log probabilities, with this many alternatives.
    score: Option<usize>,
    events: mpsc::UnboundedSender<StepEvent>,
    arrived: Instant,
}

/// A prompt in the loop.
struct Active {
    prompt: Vec<u32>,
    score: Option<usize>,
    scored: Vec<pd_engine::TokenLogprobs>,
    done: usize,
    kv: Option<SequenceKv>,
    events: mpsc::UnboundedSender<StepEvent>,
    since: Instant,
    compute: Duration,
}

/// Handle to the loop; the loop ends when every handle is dropped.
#[derive(Debug, Clone)]
pub struct Steps {
    submit: std_mpsc::Sender<Submitted>,
    config: StepConfig,
    /// Short-prompt tokens/s, as f64 bits (0 until a step was measured).
    rate: Arc<AtomicU64>,
    counters: Arc<Counters>,
}

/// What the loop counts for the worker's metrics; the submitted-short count is how a step
/// learns that a short prompt is waiting to be accepted.
#[derive(Debug, Default)]
struct Counters {
    /// Short prompts submitted (counted after they are on the loop's channel).
    short_submitted: AtomicU64,
    /// Steps stopped between layers for a short prompt.
    preempted: AtomicU64,
    /// Compute those steps had done and threw away, in microseconds.
    discarded_us: AtomicU64,
}

/// Preempted steps so far and the compute they threw away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Preemptions {
    pub steps: u64,
    pub discarded: Duration,
}

impl Steps {
    pub fn start(engine: Arc<Engine>, config: StepConfig) -> std::io::Result<Self> {
        let (submit, rx) = std_mpsc::channel();
        let rate = Arc::new(AtomicU64::new(0));
        let counters = Arc::new(Counters::default());
        let state = Loop {
            engine,
            config,
            cost: CostModel::default(),
            active: Vec::new(),
            rate: rate.clone(),
            last_short: None,
            counters: counters.clone(),
            short_accepted: 0,
        };
        std::thread::Builder::new().name("pd-prefill-steps".into()).spawn(move || state.run(rx))?;
        Ok(Steps { submit, config, rate, counters })
    }

    /// Steps stopped between layers for a short prompt so far, and the compute they threw away.
    pub fn preemptions(&self) -> Preemptions {
        Preemptions {
            steps: self.counters.preempted.load(Ordering::Relaxed),
            discarded: Duration::from_micros(self.counters.discarded_us.load(Ordering::Relaxed)),
        }
    }

    pub fn config(&self) -> StepConfig {
        self.config
    }

    /// Prompt tokens per second this worker computes for short prompts, from its cost model
    /// as corrected by the steps measured so far (0 before any step).
    pub fn tokens_per_s(&self) -> f64 {
        f64::from_bits(self.rate.load(Ordering::Relaxed))
    }

    /// Queues `prompt`; its events arrive on the returned receiver (drop it to cancel).
    pub fn submit(&self, prompt: Vec<u32>) -> Result<mpsc::UnboundedReceiver<StepEvent>, EngineError> {
        self.submit_scored(prompt, None)
    }

    /// `submit`, and with `score` = Some(k) every prompt token's log probability (and its
    /// k most likely alternatives) in `Finished::prompt_logprobs`: the prompt is computed
    /// whole, its cached prefix not reused (those positions' logits are needed).
    pub fn submit_scored(
        &self,
        prompt: Vec<u32>,
        score: Option<usize>,
    ) -> Result<mpsc::UnboundedReceiver<StepEvent>, EngineError> {
        let (events, rx) = mpsc::unbounded_channel();
        let short = self.config.is_short(prompt.len());
        self.submit
            .send(Submitted { prompt, score, events, arrived: Instant::now() })
            .map_err(|_| EngineError::InvalidBatch("the prefill step loop stopped".into()))?;
        if short {
            // After the send: a step that sees the count ahead of what the loop accepted
            // knows the prompt is on the channel.
            self.counters.short_submitted.fetch_add(1, Ordering::Release);
        }
        Ok(rx)
    }
}

struct Loop {
    engine: Arc<Engine>,
    config: StepConfig,
    cost: CostModel,
    active: Vec<Active>,
    rate: Arc<AtomicU64>,
    /// When the last short prompt arrived (`StepConfig::for_step`).
    last_short: Option<Instant>,
    counters: Arc<Counters>,
    /// Short prompts taken off the channel (`Counters::short_submitted` runs ahead while one
    /// waits there).
    short_accepted: u64,
}

impl Loop {
    fn run(mut self, rx: std_mpsc::Receiver<Submitted>) {
        loop {
            // Idle: block for work; busy: take what arrived since the last step.
            if self.active.is_empty() {
                match rx.recv() {
                    Ok(s) => self.accept(s),
                    Err(_) => return,
                }
            }
            while let Ok(s) = rx.try_recv() {
                self.accept(s);
            }
            self.active.retain(|a| !a.events.is_closed());
            if !self.step() {
                // Nothing could run (waiting for blocks): let running transfers free some.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    fn accept(&mut self, s: Submitted) {
        if self.config.is_short(s.prompt.len()) {
            self.last_short = Some(s.arrived);
            self.short_accepted += 1;
        }
        let a = Active {
            prompt: s.prompt,
            score: s.score,
            scored: Vec::new(),
            done: 0,
            kv: None,
            events: s.events,
            since: s.arrived,
            compute: Duration::ZERO,
        };
        self.active.push(a);
    }

    /// Plans and runs one step; false when nothing ran.
    fn step(&mut self) -> bool {
        let cands: Vec<Candidate> = self
            .active
            .iter()
            .map(|a| Candidate {
                remaining: a.prompt.len() - a.done,
                done: a.done,
                len: a.prompt.len(),
                waited: a.since.elapsed(),
            })
            .collect();
        let config = self.config.for_step(self.last_short.map(|t| t.elapsed()));
        let mut planned = plan(&cands, &config, &self.cost);
        planned.retain(|&(i, _)| self.take_blocks(i));
        // A prompt that started on cached blocks has fewer tokens left than planned.
        for (i, t) in planned.iter_mut() {
            let a = &self.active[*i];
            *t = (*t).min(a.prompt.len() - a.done);
        }
        if planned.is_empty() {
            return false;
        }
        let chunks: Vec<(usize, usize)> = planned.iter().map(|&(i, t)| (t, self.active[i].done)).collect();
        let started = Instant::now();
        let outcome = self.forward(&planned);
        let took = started.elapsed();
        tracing::debug!(
            chunks = ?planned.iter().map(|&(i, t)| (t, self.active[i].done, self.active[i].prompt.len())).collect::<Vec<_>>(),
            predicted_ms = self.cost.predict(&chunks).as_secs_f64() * 1e3,
            took_ms = took.as_secs_f64() * 1e3,
            preempted = matches!(outcome, Err(EngineError::Preempted { .. })),
            "prefill step (tokens, context, prompt length) per chunk"
        );
        if let Err(EngineError::Preempted { .. }) = outcome {
            // Nothing advanced: the chunks run again once the short prompt had its step.
            self.counters.preempted.fetch_add(1, Ordering::Relaxed);
            self.counters.discarded_us.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
            return true;
        }
        self.cost.observe(&chunks, took);
        self.rate.store(short_prompt_rate(&self.cost).to_bits(), Ordering::Relaxed);
        self.deliver(&planned, outcome, took);
        true
    }

    /// Gives candidate `i` its blocks at its first step; false (it waits) when none are free.
    fn take_blocks(&mut self, i: usize) -> bool {
        let a = &mut self.active[i];
        if a.kv.is_some() {
            return true;
        }
        let taken = match a.score {
            // A scored prompt needs every position's logits: nothing cached is reused.
            Some(_) => self.engine.sequence_with_capacity(a.prompt.len()).map(|kv| (kv, 0)),
            None => self.engine.sequence_for_prompt(&a.prompt, a.prompt.len()),
        };
        match taken {
            Ok((kv, cached)) => {
                let blocks = kv.blocks().ids().to_vec();
                let _ = a.events.send(StepEvent::Started { blocks, cached, at: SystemTime::now() });
                a.kv = Some(kv);
                a.done = cached;
                true
            }
            Err(EngineError::OutOfBlocks { .. })
                if self.engine.blocks().blocks_for(a.prompt.len()) <= self.engine.blocks().total_blocks() =>
            {
                false
            }
            Err(e) => {
                let _ = a.events.send(StepEvent::Failed(e));
                false // its receiver ends the request; dropped before the next step
            }
        }
    }

    /// One forward over the planned chunks; the layer events of prompts finishing in it.
    fn forward(&mut self, planned: &[(usize, usize)]) -> Result<Tensor, EngineError> {
        let finishing: Vec<usize> = planned
            .iter()
            .filter(|&&(i, t)| self.active[i].done + t == self.active[i].prompt.len())
            .map(|&(i, _)| i)
            .collect();
        let notify: Vec<mpsc::UnboundedSender<StepEvent>> =
            finishing.iter().map(|&i| self.active[i].events.clone()).collect();
        let chunks = planned.iter().map(|&(i, t)| (self.active[i].prompt.len(), t, self.active[i].done));
        let preemptible = self.config.preemptible(chunks);
        let layers = self.engine.model().config().num_layers;
        let (counters, accepted) = (&self.counters, self.short_accepted);
        let mut kvs: Vec<(usize, usize, SequenceKv)> =
            planned.iter().filter_map(|&(i, t)| self.active[i].kv.take().map(|kv| (i, t, kv))).collect();
        let every_row: Vec<bool> = kvs.iter().map(|(i, _, _)| self.active[*i].score.is_some()).collect();
        let result = {
            let active = &self.active;
            let mut batch: Vec<BatchSeq<'_>> = kvs
                .iter_mut()
                .map(|(i, t, kv)| {
                    let a = &active[*i];
                    BatchSeq { tokens: &a.prompt[a.done..a.done + *t], kv, want_logits: a.done + *t == a.prompt.len() }
                })
                .collect();
            let mut layer_done = |layer: usize| {
                let at = Instant::now();
                for tx in &notify {
                    let _ = tx.send(StepEvent::Layer(layer, at));
                }
                let waiting = counters.short_submitted.load(Ordering::Acquire) > accepted;
                if preemptible && waiting && crate::step::stops_after_layer(layer, layers) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            };
            if notify.is_empty() && !preemptible && !every_row.contains(&true) {
                self.engine.forward(&mut batch)
            } else {
                self.engine.model().forward_rows(self.engine.cache(), &mut batch, &every_row, &mut layer_done)
            }
        };
        for (i, _, kv) in kvs {
            self.active[i].kv = Some(kv);
        }
        result
    }

    /// Advances the planned prompts and tells each what happened; finished and failed ones
    /// leave the loop.
    fn deliver(&mut self, planned: &[(usize, usize)], outcome: Result<Tensor, EngineError>, took: Duration) {
        let now = (Instant::now(), SystemTime::now());
        let mut remove = Vec::new();
        let mut row = 0;
        for &(i, t) in planned {
            let a = &mut self.active[i];
            let finished = a.done + t == a.prompt.len();
            if let (Some(k), Ok(l)) = (a.score, &outcome) {
                // This chunk's rows: position p scores prompt token p + 1; the last prompt
                // position's row is the one every prompt gives (the first output token's).
                if let Err(e) = score_chunk(a, l, row, t, k) {
                    let _ = a.events.send(StepEvent::Failed(e));
                    remove.push(i);
                    row += t;
                    continue;
                }
                row += if finished { t - 1 } else { t };
            }
            let logits = match &outcome {
                Err(e) => {
                    let _ = a
                        .events
                        .send(StepEvent::Failed(EngineError::InvalidBatch(format!("prefill step failed: {e}"))));
                    remove.push(i);
                    continue;
                }
                Ok(l) if finished => {
                    row += 1;
                    Some(l.get(row - 1))
                }
                Ok(_) => None,
            };
            a.done += t;
            a.compute += took;
            a.since = now.0;
            let _ = a.events.send(StepEvent::Chunk { tokens: t, at: now.1 });
            let Some(logits) = logits else { continue };
            if let Some(mut kv) = a.kv.take() {
                kv.cache_prefix(&a.prompt);
                let event = match logits {
                    Ok(logits) => StepEvent::Done(Box::new(Finished {
                        logits,
                        prompt_logprobs: std::mem::take(&mut a.scored),
                        kv,
                        compute_time: a.compute,
                        ended: now.0,
                        ended_wall: now.1,
                    })),
                    Err(e) => StepEvent::Failed(EngineError::from(e)),
                };
                let _ = a.events.send(event);
                remove.push(i);
            }
        }
        remove.sort_unstable();
        for i in remove.into_iter().rev() {
            self.active.swap_remove(i);
        }
    }
}

/// Scores the `t` rows of `logits` from `row` on, the chunk of `a` at `a.done..`: each
/// position but the prompt's last gives the log probability of the prompt token after it.
fn score_chunk(a: &mut Active, logits: &Tensor, row: usize, t: usize, k: usize) -> Result<(), EngineError> {
    for j in 0..t {
        let Some(&next) = a.prompt.get(a.done + j + 1) else { break };
        let values = logits.get(row + j)?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
        a.scored.push(pd_engine::token_logprobs(&values, next, k));
    }
    Ok(())
}

/// Prompt tokens per second on short prompts (a 256-token chunk at no context) by `cost`: what
/// a prefill worker reports in `Load` as its drain rate.
pub fn short_prompt_rate(cost: &CostModel) -> f64 {
    const TOKENS: usize = 256;
    TOKENS as f64 / cost.predict(&[(TOKENS, 0)]).as_secs_f64().max(1e-6)
}
