//! The simulated workers of a virtual-time run: the same rules as `decode::SimDecode` and
//! `prefill::SimPrefill` (the same step planners, cost model, preemption rule and `Load`
//! answers, through `decode::plan_step` and `prefill::plan_step`), with no task, socket or
//! clock: the engine (`engine`) starts each step and tells the worker when it ended.

use std::time::Duration;

use pd_prefill::step::{CostModel, StepConfig, STOPPABLE_SHARE};
use pd_prefill::steps::short_prompt_rate;
use pd_proto::v1 as pb;

use crate::cost::WorkerCost;
use crate::decode::{self, StepRow};
use crate::prefill::{self, Planned};

/// A sequence in a decode batch (`id`: the engine's request id).
#[derive(Debug)]
pub struct DecodeSeq {
    pub id: u64,
    pub blocks: usize,
    pub prompt: usize,
    /// Prompt tokens still to compute here (prefilled on the decode worker).
    pub prompt_left: usize,
    pub generated: usize,
    pub max_tokens: usize,
}

/// What a decode step did to one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// A token (the first one when `generated` became 1).
    Token { id: u64, finished: bool },
}

/// A simulated decode worker.
#[derive(Debug)]
pub struct VDecode {
    pub free_blocks: usize,
    /// Reservations waiting for their KV.
    pub pending: usize,
    pub running: Vec<DecodeSeq>,
    step_ms: f64,
    /// The step under way: its length (ms) and the tokens each of the first rows runs.
    stepping: Option<(f64, Vec<usize>)>,
    /// Buffers kept from step to step (a run has millions of steps).
    rows: Vec<StepRow>,
    spare: Option<Vec<usize>>,
}

impl VDecode {
    pub fn new(cost: &WorkerCost) -> Self {
        VDecode {
            free_blocks: cost.worker.kv_blocks as usize,
            pending: 0,
            running: Vec::new(),
            step_ms: 0.0,
            stepping: None,
            rows: Vec::new(),
            spare: None,
        }
    }

    /// Blocks for `tokens` (prompt + output), or the real worker's RESOURCE_EXHAUSTED message.
    pub fn reserve(&mut self, cost: &WorkerCost, tokens: usize) -> Result<usize, String> {
        let blocks = cost.blocks_for(tokens);
        if blocks > self.free_blocks {
            return Err(format!(
                "out of KV blocks: {blocks} needed, {} free of {}",
                self.free_blocks, cost.worker.kv_blocks
            ));
        }
        self.free_blocks -= blocks;
        Ok(blocks)
    }

    pub fn is_stepping(&self) -> bool {
        self.stepping.is_some()
    }

    /// Starts a step over the first `max_batch` sequences; its length, or None when idle.
    pub fn start_step(&mut self, cost: &WorkerCost) -> Option<Duration> {
        if self.running.is_empty() {
            self.step_ms = 0.0;
            return None;
        }
        self.rows.clear();
        self.rows.extend(self.running.iter().take(cost.worker.max_batch as usize).map(|q| StepRow {
            prompt: q.prompt,
            prompt_left: q.prompt_left,
            generated: q.generated,
        }));
        let mut takes = self.spare.take().unwrap_or_default();
        let ms = decode::plan_step(cost, &self.rows, &mut takes);
        self.stepping = Some((ms, takes));
        Some(Duration::from_secs_f64(ms / 1e3))
    }

    /// The step ended: prompt chunks advance, every generating row gets a token, finished
    /// sequences free their blocks. Tokens go to `out`.
    pub fn end_step(&mut self, out: &mut Vec<StepOutcome>) {
        let Some((ms, takes)) = self.stepping.take() else { return };
        // Reported after the step, as the real-time worker does.
        self.step_ms = decode::smoothed(self.step_ms, ms);
        let mut freed = 0;
        let mut i = 0;
        self.running.retain_mut(|q| {
            if let Some(&take) = takes.get(i) {
                if let Some(t) = step_one(q, take) {
                    out.push(t);
                }
            }
            i += 1;
            let done = q.generated >= q.max_tokens;
            if done {
                freed += q.blocks;
            }
            !done
        });
        self.free_blocks += freed;
        self.spare = Some(takes);
    }

    pub fn load(&self, cost: &WorkerCost) -> pb::DecodeLoad {
        decode::load_of(cost, self.free_blocks, self.running.len(), self.pending, self.step_ms)
    }
}

/// One sequence's part of a step (as `decode::step_one`): a prompt chunk, or one token.
fn step_one(q: &mut DecodeSeq, take: usize) -> Option<StepOutcome> {
    if q.generated >= q.max_tokens {
        return None;
    }
    if q.prompt_left > 0 {
        let t = q.prompt_left.min(take);
        q.prompt_left -= t;
        if q.prompt_left > 0 || t == 0 {
            return None;
        }
    }
    q.generated += 1;
    Some(StepOutcome::Token { id: q.id, finished: q.generated >= q.max_tokens })
}

/// A prompt on a prefill worker.
#[derive(Debug)]
struct Job {
    id: u64,
    len: usize,
    done: usize,
    last_turn: Duration,
}

/// The step under way.
#[derive(Debug)]
struct Step {
    started: Duration,
    took: Duration,
    planned: Planned,
}

/// A simulated prefill worker.
#[derive(Debug, Default)]
pub struct VPrefill {
    jobs: Vec<Job>,
    planner: CostModel,
    last_short: Option<Duration>,
    step: Option<Step>,
    scratch: prefill::PlanScratch,
    /// Counts steps started, so the end of a step that was cut is recognized.
    pub generation: u64,
}

impl VPrefill {
    /// A prompt of `len` tokens arrives at `now`. True when a step must start now: the worker
    /// was idle, or a short prompt stops a preemptible step in its stoppable share (its time is
    /// lost and its chunks run again).
    pub fn submit(&mut self, step: &StepConfig, id: u64, len: usize, now: Duration) -> bool {
        self.jobs.push(Job { id, len, done: 0, last_turn: now });
        let short = step.is_short(len);
        if short {
            self.last_short = Some(now);
        }
        match &self.step {
            None => true,
            Some(s) => {
                let cut = short && s.planned.preemptible && now < s.started + s.took.mul_f64(STOPPABLE_SHARE);
                if cut {
                    self.step = None;
                }
                cut
            }
        }
    }

    /// Plans and starts the next step at `now`; its length, or None when idle.
    pub fn start_step(&mut self, cost: &WorkerCost, config: &StepConfig, now: Duration) -> Option<Duration> {
        let jobs = self.jobs.iter().map(|j| (j.id, j.len, j.done, now.saturating_sub(j.last_turn)));
        let since_short = self.last_short.map(|t| now.saturating_sub(t));
        let planned = prefill::plan_step(config, &self.planner, jobs, since_short, &mut self.scratch);
        if planned.chosen.is_empty() {
            return None;
        }
        let took = Duration::from_secs_f64(cost.prefill_step_ms(&planned.chunks) / 1e3);
        self.generation += 1;
        self.step = Some(Step { started: now, took, planned });
        Some(took)
    }

    /// The step of `generation` ended at `now` (false: it was cut); the
    /// prompts it finished go to `done` as (request id, prompt length).
    pub fn end_step(&mut self, generation: u64, now: Duration, done: &mut Vec<(u64, usize)>) -> bool {
        if generation != self.generation {
            return false;
        }
        let Some(step) = self.step.take() else { return false };
        self.planner.observe(&step.planned.chunks, step.took);
        for &(id, tokens) in &step.planned.chosen {
            if let Some(j) = self.jobs.iter_mut().find(|j| j.id == id) {
                j.done = (j.done + tokens).min(j.len);
                j.last_turn = now;
            }
        }
        self.jobs.retain(|j| {
            if j.done >= j.len {
                done.push((j.id, j.len));
                false
            } else {
                true
            }
        });
        true
    }

    pub fn is_stepping(&self) -> bool {
        self.step.is_some()
    }

    pub fn load(&self, step: &StepConfig) -> pb::PrefillLoad {
        prefill::load_of(step, self.jobs.iter().map(|j| (j.len, j.done)), short_prompt_rate(&self.planner))
    }
}
