//! Scoring a prompt (`PrefillWorker.Score`): the step loop computes it whole beside the other
//! prompts (`Steps::submit_scored`, every position's logits turned into the next prompt
//! token's log probability as each chunk finishes), then the first output token is sampled
//! as a prefill would. No KV target, no decode worker: the prompt's blocks are freed (their
//! full blocks offered to the prefix cache) as soon as it is scored.

use std::time::Instant;

use pd_engine::{Engine, Sampler, SamplingParams, TokenLogprobs, MAX_TOP_LOGPROBS};
use pd_kv_transfer::convert::{logprobs_to_pb, sampling_from_pb};
use pd_proto::v1 as pb;

use crate::error::PrefillError;
use crate::steps::{StepEvent, Steps};

/// A scoring request that passed its checks.
pub struct ScoreJob {
    pub prompt: Vec<u32>,
    pub top: usize,
    pub sampling: SamplingParams,
}

/// Checks `req` against the model.
pub fn check(engine: &Engine, req: pb::ScoreRequest) -> Result<ScoreJob, PrefillError> {
    if req.prompt_tokens.is_empty() {
        return Err(PrefillError::Invalid("prompt_tokens is empty".into()));
    }
    let max = engine.model().config().max_position;
    if req.prompt_tokens.len() > max {
        let message = format!("prompt_tokens ({}) exceed the context length of {max}", req.prompt_tokens.len());
        return Err(PrefillError::Invalid(message));
    }
    let vocab = engine.model().config().vocab_size;
    if let Some((i, id)) = req.prompt_tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(PrefillError::Invalid(format!("prompt_tokens[{i}] ({id}) is outside the vocabulary of {vocab}")));
    }
    let top = req.top_logprobs as usize;
    if top > MAX_TOP_LOGPROBS {
        return Err(PrefillError::Invalid(format!("top_logprobs ({top}) is above {MAX_TOP_LOGPROBS}")));
    }
    let sampling = sampling_from_pb(req.sampling.as_ref(), 0)?;
    Ok(ScoreJob { prompt: req.prompt_tokens, top, sampling })
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
