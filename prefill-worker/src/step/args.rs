//! The step policy's flags, declared once: the prefill worker, the simulated prefill worker
//! (pd-sim-worker) and the capacity planner (its defaults) all take them from here.

use std::time::Duration;

use clap::Parser;

use crate::step::StepConfig;

/// Flags of the prefill step policy (flattened into a binary's own flags).
#[derive(Debug, Clone, clap::Args)]
pub struct StepArgs {
    /// Largest chunk of one prompt in one prefill step, in tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Request-parallel prefill: most prompts in one step (vLLM's max_num_partial_prefills).
    #[arg(long, env = "PD_MAX_PARTIAL_PREFILLS", default_value_t = 4)]
    pub max_partial_prefills: usize,
    /// Most long prompts in one step (max_long_partial_prefills).
    #[arg(long, default_value_t = 1)]
    pub max_long_partial_prefills: usize,
    /// A prompt longer than this many tokens is long.
    #[arg(long, default_value_t = 512)]
    pub long_prefill_threshold: usize,
    /// Target time of one step (milliseconds): the step's token budget is what the cost
    /// model (tokens x context, corrected by measured steps) predicts fits in it; a short
    /// prompt that arrives during a document waits about one step.
    #[arg(long, env = "PD_STEP_TARGET_MS", default_value_t = 150)]
    pub step_target_ms: u64,
    /// The first prompt of a step gets at least this many tokens, whatever the budget.
    #[arg(long, default_value_t = 16)]
    pub min_chunk: usize,
    /// A prompt of at most --long-prefill-threshold tokens gets at least this many tokens per
    /// step whatever the budget (0: budget only).
    #[arg(long, default_value_t = 128)]
    pub short_chunk: usize,
    /// Steps take prompts shortest remaining first; one that has waited this long since its
    /// last chunk (milliseconds) goes first instead, so long prompts progress.
    #[arg(long, env = "PD_MAX_WAIT_MS", default_value_t = 2_000)]
    pub max_wait_ms: u64,
    /// Step target (milliseconds) while short prompts are about (one arrived within
    /// --short-window-ms): long prompts advance in shorter steps, so a short prompt arriving
    /// mid-step waits less and its own step carries no long chunk beyond the budget.
    #[arg(long, env = "PD_SHORT_STEP_TARGET_MS", default_value_t = 25)]
    pub short_step_target_ms: u64,
    /// How long after a short prompt arrived --short-step-target-ms holds (milliseconds;
    /// 0: never).
    #[arg(long, default_value_t = 3_000)]
    pub short_window_ms: u64,
    /// Stop a prefill step of long prompts between layers when a short prompt arrives, so it
    /// waits about one layer instead of the rest of the step (the long chunks run again).
    #[arg(long, env = "PD_PREFILL_PREEMPT", default_value_t = true, action = clap::ArgAction::Set)]
    pub preempt: bool,
}

/// For `StepArgs::default`: the flags alone, parsed from nothing.
#[derive(Parser)]
struct Only {
    #[command(flatten)]
    step: StepArgs,
}

impl Default for StepArgs {
    /// The flags' defaults, or their environment variables' values where those are set (as
    /// the prefill worker itself would take them).
    fn default() -> Self {
        Only::parse_from(["defaults"]).step
    }
}

impl StepArgs {
    /// The checked policy; an error names the flag that is out of range.
    pub fn config(&self) -> Result<StepConfig, String> {
        for (flag, value) in [
            ("--chunk", self.chunk as u64),
            ("--max-partial-prefills", self.max_partial_prefills as u64),
            ("--max-long-partial-prefills", self.max_long_partial_prefills as u64),
            ("--min-chunk", self.min_chunk as u64),
            ("--step-target-ms", self.step_target_ms),
            ("--short-step-target-ms", self.short_step_target_ms),
        ] {
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        Ok(StepConfig {
            max_prompts: self.max_partial_prefills,
            max_long: self.max_long_partial_prefills,
            long_threshold: self.long_prefill_threshold,
            target: Duration::from_millis(self.step_target_ms),
            min_chunk: self.min_chunk,
            short_chunk: self.short_chunk,
            max_chunk: self.chunk,
            max_wait: Duration::from_millis(self.max_wait_ms),
            short_target: Duration::from_millis(self.short_step_target_ms),
            short_window: Duration::from_millis(self.short_window_ms),
            preempt: self.preempt,
        })
    }
}
