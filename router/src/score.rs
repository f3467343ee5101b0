//! Completions with `echo`: the prompt comes back as the start of the text, and with
//! `logprobs` each prompt token's log probability given those before it (what evaluation
//! harnesses send to measure a loglikelihood), scored by one prefill worker's `Score` (the
//! prompt computed whole in its step loop, beside other prompts). The prefill worker with the
//! shortest estimated wait is asked; under colocated serving (no prefill pool) the decode
//! worker with the least load scores it in its batch (`DecodeWorker.Score`). A worker that is
//! unreachable is replaced by the next (at most three tries).
//!
//! With `max_tokens` 0 or 1, not streamed, one answer (`echo`): the one output token is the
//! prefill worker's own first token, so no decode worker and no KV reservation are involved.
//! Otherwise (`prompt_updates`) the scored prompt becomes the first updates of each answer
//! and the generation after it is an ordinary request.

use pd_engine::{OutputTracker, TextSide};
use pd_kv_transfer::convert::sampling_to_pb;
use pd_proto::v1 as pb;

use crate::api::logprobs::Logprobs;
use crate::error::RouterError;
use crate::prefill::traced;
use crate::record::{PrefillTimings, RequestRecord};
use crate::relay::worker_status_error;
use crate::relay::Update;
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

/// Scores `req`'s prompt on a prefill worker, or under colocated serving (no prefill pool)
/// on the least loaded decode worker, in its batch (see the module docs).
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
    let colocated = scheduler.pools.prefill.specs_empty();
    let stage = if colocated { "decode" } else { "prefill" };
    let mut tried = Vec::new();
    let mut last = RouterError::NoWorker(stage);
    while tried.len() < TRIES {
        let next = match colocated {
            true => scheduler.retry_decode_worker(&tried).await,
            false => scheduler.retry_prefill_worker(&tried).await,
        };
        let Some(addr) = next else { break };
        let request = traced(message.clone(), record.span().context(), record.class());
        let answer = match colocated {
            true => {
                let mut picked = scheduler.pools.decode_client(&addr, "score (colocated): least load".into())?;
                picked.client.score(request).await
            }
            false => {
                let mut picked = scheduler.pools.prefill_client(&addr, "score: shortest estimated wait".into())?;
                picked.client.score(request).await
            }
        };
        match answer {
            Ok(answer) => {
                if colocated {
                    record.decode_worker = addr.clone();
                    record.prefill_worker = format!("local:{addr}");
                } else {
                    record.prefill_worker = addr;
                }
                return Ok(answer.into_inner());
            }
            Err(status) if status.code() == tonic::Code::Unavailable => {
                match colocated {
                    true => scheduler.pools.decode.forget(&addr),
                    false => scheduler.pools.prefill.forget(&addr),
                }
                last = worker_status_error(stage, status);
                tried.push(addr);
            }
            Err(status) => return Err(worker_status_error(stage, status)),
        }
    }
    Err(last)
}

/// Answers an echo request served by a prefill worker alone (see the module docs) as one
/// whole answer; the record is finished either way.
pub async fn echo(
    scheduler: &Scheduler,
    side: &TextSide,
    req: &ValidRequest,
    record: &mut RequestRecord,
) -> Result<Echoed, RouterError> {
    let tokenizer = &side.tokenizer;
    let mut logprobs = req.params.logprobs.map(|_| Logprobs::new(req.kind));
    let (mut text, mut finish_reason, mut completion_tokens) = (String::new(), "length".to_string(), 0);
    for (i, update) in echo_updates(scheduler, side, req, record).await?.into_iter().enumerate() {
        match update {
            Update::Token { token_id, text: piece, logprobs: scores, .. } => {
                if let Some(all) = &mut logprobs {
                    // A prompt token is shown as its own bytes, a generated one as its text.
                    let shown = match i < req.prompt_tokens.len() {
                        true => String::from_utf8_lossy(&tokenizer.token_bytes(token_id)).into_owned(),
                        false => piece.clone(),
                    };
                    match &scores {
                        None => all.push_unscored(tokenizer, token_id),
                        Some(l) => all.push(tokenizer, token_id, &shown, l),
                    }
                }
                text.push_str(&piece);
            }
            Update::Finished { finish_reason: f, completion_tokens: c, .. } => {
                (finish_reason, completion_tokens) = (f, c)
            }
            Update::Done { .. } => {}
        }
    }
    Ok(Echoed { text, logprobs, finish_reason, completion_tokens })
}

/// The updates of an echo request served by a prefill worker alone: the prompt's tokens (with
/// their scores when asked; the first has none), the prefill worker's first token when one is
/// asked for, the answer's end and the request's. The record is finished either way.
pub async fn echo_updates(
    scheduler: &Scheduler,
    side: &TextSide,
    req: &ValidRequest,
    record: &mut RequestRecord,
) -> Result<Vec<Update>, RouterError> {
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
    let texts = token_texts(tokenizer, &req.prompt_tokens).map_err(|e| {
        let e = RouterError::Unprocessable(e.to_string());
        record.fail(&e);
        e
    })?;
    let asked = req.params.logprobs.is_some();
    // The first prompt token has nothing before it; the i-th score is token i + 1's.
    let mut scores = answer.prompt_logprobs.into_iter();
    let mut updates: Vec<Update> = (req.prompt_tokens.iter().zip(texts).enumerate())
        .map(|(i, (&token_id, text))| {
            let logprobs = if i == 0 || !asked { None } else { scores.next() };
            Update::Token { index: 0, token_id, text, logprobs }
        })
        .collect();
    let (mut finish_reason, mut completion_tokens) = ("length".to_string(), 0);
    if req.params.max_tokens >= 1 {
        let mut tracker = OutputTracker::new(req.params.clone(), tokenizer);
        let out = tracker.push(answer.first_token, tokenizer).map_err(|e| {
            let e = RouterError::Worker { stage: "prefill", message: e.to_string() };
            record.fail(&e);
            e
        })?;
        record.token(&out.text_delta);
        let logprobs = answer.first_logprobs.filter(|_| asked);
        updates.push(Update::Token { index: 0, token_id: answer.first_token, text: out.text_delta, logprobs });
        completion_tokens = 1;
        finish_reason = out.finish.map_or("length", |f| f.as_str()).to_string();
    }
    record.finish(&finish_reason);
    updates.push(Update::Finished { index: 0, finish_reason, completion_tokens });
    let prompt_tokens = req.prompt_tokens.len() as u32;
    updates.push(Update::Done { prompt_tokens, completion_tokens, cached_tokens: 0 });
    Ok(updates)
}

/// Whether an echo request is answered by the prefill worker alone (`echo`).
pub fn scored_alone(req: &ValidRequest) -> bool {
    req.params.max_tokens <= 1 && !req.stream && req.n == 1 && req.params.constraint.is_none()
}

/// The prompt of an echo request that also generates, as the updates that start each of its
/// answers: the prompt's tokens and their texts, with their log probabilities when asked
/// (scored on a prefill worker; the first token has none). The record fails with the error.
pub async fn prompt_updates(
    scheduler: &Scheduler,
    side: &TextSide,
    req: &ValidRequest,
    record: &mut RequestRecord,
) -> Result<Vec<Update>, RouterError> {
    let scores = match req.params.logprobs {
        None => None,
        Some(_) => match scored(scheduler, req, record).await {
            Ok(a) => Some(a.prompt_logprobs),
            Err(e) => {
                record.fail(&e);
                return Err(e);
            }
        },
    };
    let texts = token_texts(&side.tokenizer, &req.prompt_tokens).map_err(|e| {
        let e = RouterError::Unprocessable(e.to_string());
        record.fail(&e);
        e
    })?;
    let mut scores = scores.map(Vec::into_iter);
    let mut prompt = Vec::with_capacity(texts.len());
    for (i, (&token_id, text)) in req.prompt_tokens.iter().zip(texts).enumerate() {
        let logprobs = if i == 0 { None } else { scores.as_mut().and_then(Iterator::next) };
        prompt.push((token_id, text, logprobs));
    }
    let each = |index: u32| {
        prompt.iter().map(move |(token_id, text, logprobs)| Update::Token {
            index,
            token_id: *token_id,
            text: text.clone(),
            logprobs: logprobs.clone(),
        })
    };
    Ok((0..req.n as u32).flat_map(each).collect())
}

/// Each token's share of the decoded text (a token holding part of a UTF-8 character gets
/// none; the one completing it gets the character), adding up to the whole decode. A
/// tokenizer whose pieces do not add up (one that drops a leading space at the start of a
/// decode): the whole text on the first token.
fn token_texts(tokenizer: &pd_engine::Tokenizer, tokens: &[u32]) -> pd_engine::Result<Vec<String>> {
    const CONTEXT: usize = 4;
    let mut texts = Vec::with_capacity(tokens.len());
    let mut start = 0usize;
    for i in 0..tokens.len() {
        let from = start.saturating_sub(CONTEXT);
        let before = tokenizer.decode(&tokens[from..start], false)?;
        let with = tokenizer.decode(&tokens[from..=i], false)?;
        match with.strip_prefix(before.as_str()) {
            Some(piece) if !(piece.ends_with('\u{FFFD}') && i + 1 < tokens.len()) => {
                texts.push(piece.to_string());
                start = i + 1;
            }
            _ => texts.push(String::new()),
        }
    }
    let whole = tokenizer.decode(tokens, false)?;
    if texts.concat() != whole {
        texts.iter_mut().for_each(String::clear);
        if let Some(first) = texts.first_mut() {
            *first = whole;
        }
    }
    Ok(texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_texts_add_up_to_the_decoded_prompt() {
        let tokenizer = pd_engine::Tokenizer::characters().expect("tokenizer");
        let tokens = tokenizer.encode("echo me").expect("encode");
        let texts = token_texts(&tokenizer, &tokens).expect("texts");
        assert_eq!(texts.len(), tokens.len());
        assert_eq!(texts.concat(), tokenizer.decode(&tokens, false).expect("decode"));
        assert!(texts.iter().all(|t| !t.is_empty()), "a piece per token: {texts:?}");
    }
}
