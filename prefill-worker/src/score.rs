//! Scoring a prompt (`PrefillWorker.Score`): the step loop computes it whole beside the other
//! prompts (`Steps::submit_scored`, every position's logits turned into the next prompt
//! token's log probability as each chunk finishes), then the first output token is sampled
//! as a prefill would. No KV target, no decode worker: the prompt's blocks are freed (their
//! full blocks offered to the prefix cache) as soon as it is scored.

use std::time::Instant;

use pd_engine::{Engine, Sampler, TokenLogprobs};
use pd_kv_transfer::convert::{logprobs_to_pb, score_job_from_pb, ScoreJob};
use pd_proto::v1 as pb;

use crate::error::PrefillError;
use crate::steps::{StepEvent, Steps};

/// Checks `req` against the model (`convert::score_job_from_pb`).
pub fn check(engine: &Engine, req: pb::ScoreRequest) -> Result<ScoreJob, PrefillError> {
    Ok(score_job_from_pb(req, engine.model().config())?)
}

/// What scoring gave.
pub struct Scored {
    pub prompt_logprobs: Vec<TokenLogprobs>,
    pub first_token: u32,
    pub first_logprobs: Option<TokenLogprobs>,
    pub waited_ms: f64,
    pub compute_ms: f64,
}

/// Scores `job` in the step loop; `progress` sees each step event (the gauges).
pub async fn score(
    engine: &Engine,
    steps: &Steps,
    job: ScoreJob,
    mut progress: impl FnMut(&StepEvent),
) -> Result<Scored, PrefillError> {
    let mut sampler = Sampler::for_sequence(&job.sampling, &job.prompt, engine.tokenizer())?;
    let submitted = Instant::now();
    let mut started = None;
    let mut events = steps.submit_scored(job.prompt, Some(job.top))?;
    while let Some(event) = events.recv().await {
        progress(&event);
        match event {
            StepEvent::Started { .. } => started = Some(submitted.elapsed()),
            StepEvent::Failed(e) => return Err(e.into()),
            StepEvent::Done(finished) => {
                let sampled = sampler.draw(&finished.logits)?;
                let waited = started.unwrap_or_default();
                return Ok(Scored {
                    prompt_logprobs: finished.prompt_logprobs,
                    first_token: sampled.token,
                    first_logprobs: sampled.logprobs,
                    waited_ms: waited.as_secs_f64() * 1e3,
                    compute_ms: finished.compute_time.as_secs_f64() * 1e3,
                });
            }
            StepEvent::Chunk { .. } | StepEvent::Layer(..) => {}
        }
    }
    Err(PrefillError::Thread("the prefill step loop ended before scoring the prompt".into()))
}

/// The answer on the wire.
pub fn to_pb(s: Scored) -> pb::ScoreResponse {
    pb::ScoreResponse {
        prompt_logprobs: s.prompt_logprobs.iter().map(logprobs_to_pb).collect(),
        first_token: s.first_token,
        first_logprobs: s.first_logprobs.as_ref().map(logprobs_to_pb),
        queue_ms: s.waited_ms,
        prefill_ms: s.compute_ms,
    }
}
