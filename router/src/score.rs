//! Completions with `echo`: the prompt comes back as the start of the text, and with
//! `logprobs` each prompt token's log probability given those before it (what evaluation
//! harnesses send to measure a loglikelihood). Served by one prefill worker's `Score` (the
//! prompt computed whole in its step loop, beside other prompts), with `max_tokens` 0 or 1:
//! the one output token is the prefill worker's own first token, so no decode worker and no
//! KV reservation are involved. The prefill worker with the shortest estimated wait is
//! asked; one that is unreachable is replaced by the next (at most three tries).

use pd_engine::{OutputTracker, TextSide};
use pd_kv_transfer::convert::sampling_to_pb;
use pd_proto::v1 as pb;

use crate::api::logprobs::Logprobs;
use crate::error::RouterError;
use crate::prefill::traced;
use crate::record::{PrefillTimings, RequestRecord};
use crate::relay::worker_status_error;
use crate::schedule::Scheduler;
use crate::validate::ValidRequest;

/// Prefill workers tried before the request fails.
const TRIES: usize = 3;

/// The answer of an echo request: its text, its log probabilities (when asked), its finish
/// reason and its output token count.
pub struct Echoed {
    pub text: String,
    pub logprobs: Option<Logprobs>,
    pub finish_reason: String,
    pub completion_tokens: u32,
}

/// Scores `req`'s prompt on a prefill worker (see the module docs).
async fn scored(
    scheduler: &Scheduler,
    req: &ValidRequest,
    record: &mut RequestRecord,
) -> Result<pb::ScoreResponse, RouterError> {
    let mut sampling = req.params.clone();
    sampling.max_tokens = 1;
    let message = pb::ScoreRequest {
        request_id: record.request_id.clone(),
        prompt_tokens: req.prompt_tokens.clone(),
        top_logprobs: req.params.logprobs.unwrap_or(0) as u32,
        sampling: Some(sampling_to_pb(&sampling)),
    };
    let mut tried = Vec::new();
    let mut last = RouterError::NoWorker("prefill");
    while tried.len() < TRIES {
        let Some(addr) = scheduler.retry_prefill_worker(&tried) else { break };
        let mut picked = scheduler.pools.prefill_client(&addr, "score: shortest estimated wait".into())?;
        match picked.client.score(traced(message.clone(), record.span().context(), record.class())).await {
            Ok(answer) => {
                record.prefill_worker = addr;
                return Ok(answer.into_inner());
            }
            Err(status) if status.code() == tonic::Code::Unavailable => {
                scheduler.pools.prefill.forget(&addr);
                last = worker_status_error("prefill", status);
                tried.push(addr);
            }
            Err(status) => return Err(worker_status_error("prefill", status)),
        }
    }
    Err(last)
}

/// Answers an echo request (see the module docs); the record is finished either way.
pub async fn echo(
    scheduler: &Scheduler,
    side: &TextSide,
    req: &ValidRequest,
    record: &mut RequestRecord,
) -> Result<Echoed, RouterError> {
    let answer = match scored(scheduler, req, record).await {
        Ok(a) => a,
        Err(e) => {
            record.fail(&e);
            return Err(e);
        }
    };
    record.prefilled(PrefillTimings {
        queue_ms: answer.queue_ms,
        prefill_ms: answer.prefill_ms,
        kv_commit_ms: 0.0,
        cached_tokens: 0,
    });
    let tokenizer = &side.tokenizer;
    let mut logprobs = req.params.logprobs.map(|_| Logprobs::new(req.kind));
    if let Some(all) = &mut logprobs {
        // The first prompt token has nothing before it; the i-th score is token i + 1's.
        let mut scored = answer.prompt_logprobs.iter();
        for (i, &token) in req.prompt_tokens.iter().enumerate() {
            match if i == 0 { None } else { scored.next() } {
                None => all.push_unscored(tokenizer, token),
                Some(l) => all.push(tokenizer, token, &String::from_utf8_lossy(&tokenizer.token_bytes(token)), l),
            }
        }
    }
    let mut text =
        tokenizer.decode(&req.prompt_tokens, false).map_err(|e| RouterError::Unprocessable(e.to_string()))?;
    let (mut finish_reason, mut completion_tokens) = ("length".to_string(), 0);
    if req.params.max_tokens >= 1 {
        let mut tracker = OutputTracker::new(req.params.clone(), tokenizer);
        let out = tracker
            .push(answer.first_token, tokenizer)
            .map_err(|e| RouterError::Worker { stage: "prefill", message: e.to_string() })?;
        if let (Some(all), Some(l)) = (&mut logprobs, &answer.first_logprobs) {
            all.push(tokenizer, answer.first_token, &out.text_delta, l);
        }
        record.token(&out.text_delta);
        text.push_str(&out.text_delta);
        completion_tokens = 1;
        finish_reason = out.finish.map_or("length", |f| f.as_str()).to_string();
    }
    record.finish(&finish_reason);
    Ok(Echoed { text, logprobs, finish_reason, completion_tokens })
}
