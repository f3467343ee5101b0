//! One request through the cluster (DESIGN.md's lifecycle): reserve KV on a decode worker
//! and open its token stream; prefill on a prefill worker with that KV target, retrying on
//! another prefill worker while the lease holds; relay tokens as they come. Dropping the
//! returned stream (client gone) cancels both sides: the decode worker sees its stream
//! closed and frees the blocks; the prefill retry task is aborted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_proto::v1 as pb;
use pb::decode_event::Event;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::RouterError;
use crate::validate::ValidRequest;
use crate::workers::Pools;

/// Prefill attempts per request (each on another worker).
const PREFILL_ATTEMPTS: usize = 3;

/// What the client sees of a generation.
#[derive(Debug, Clone)]
pub enum Update {
    Token { token_id: u32, text: String },
    Done { finish_reason: String, prompt_tokens: u32, completion_tokens: u32 },
}

fn decode_error(status: tonic::Status) -> RouterError {
    match status.code() {
        tonic::Code::InvalidArgument => RouterError::InvalidRequest { message: status.message().to_string(), param: None },
        tonic::Code::ResourceExhausted => RouterError::Overloaded(status.message().to_string()),
        _ => RouterError::Worker { stage: "decode", message: status.message().to_string() },
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts `req` and returns its updates. Errors before the first token come back directly.
pub async fn start(
    pools: Arc<Pools>,
    req: &ValidRequest,
    request_id: String,
) -> Result<ReceiverStream<Result<Update, RouterError>>, RouterError> {
    let (decode_addr, mut decode) = pools.pick_decode(&[]).await?;
    let decode_request = pb::DecodeRequest {
        request_id: request_id.clone(),
        prompt_tokens: req.prompt_tokens.clone(),
        sampling: Some(req.sampling.clone()),
        lease_ms: 0,
    };
    let mut events = match decode.generate(decode_request).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            pools.decode.forget(&decode_addr);
            return Err(decode_error(status));
        }
    };
    let target = match events.message().await {
        Ok(Some(pb::DecodeEvent { event: Some(Event::Target(t)) })) => t,
        Ok(_) => return Err(RouterError::Worker { stage: "decode", message: "no KV target".into() }),
        Err(status) => return Err(decode_error(status)),
    };
    let lease_left = Duration::from_millis(
        target.lease_deadline_unix_ms.saturating_sub(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
        ),
    );
    let (tx, rx) = mpsc::channel(64);
    // Prefill, with retries on other workers while the lease holds.
    let prefill_tx = tx.clone();
    let prefill_pools = pools.clone();
    let prefill_req = pb::PrefillRequest {
        request_id: request_id.clone(),
        prompt_tokens: req.prompt_tokens.clone(),
        target: Some(target),
        sampling: Some(req.sampling.clone()),
    };
    let prefill = tokio::spawn(async move {
        let deadline = Instant::now() + lease_left;
        let mut tried = Vec::new();
        let mut last_error = RouterError::NoWorker("prefill");
        for _ in 0..PREFILL_ATTEMPTS {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
            let (addr, mut client) = match prefill_pools.pick_prefill(&tried).await {
                Ok(pick) => pick,
                Err(e) => {
                    last_error = e;
                    break;
                }
            };
            match tokio::time::timeout(left, client.prefill(prefill_req.clone())).await {
                Ok(Ok(_response)) => return,
                Ok(Err(status)) => {
                    let retryable = matches!(
                        status.code(),
                        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Internal
                    );
                    last_error = RouterError::Worker { stage: "prefill", message: status.message().to_string() };
                    prefill_pools.prefill.forget(&addr);
                    tried.push(addr);
                    if !retryable {
                        break;
                    }
                }
                Err(_) => {
                    last_error = RouterError::Worker { stage: "prefill", message: "timed out".into() };
                    tried.push(addr);
                }
            }
        }
        let _ = prefill_tx.send(Err(last_error)).await;
    });
    let prefill = AbortOnDrop(prefill);
    // Relay decode events until done, failure, or the client leaving.
    tokio::spawn(async move {
        let _prefill = prefill; // aborted when this relay ends
        loop {
            let message = tokio::select! {
                m = events.message() => m,
                _ = tx.closed() => return, // client gone: dropping `events` cancels the decode stream
            };
            let update = match message {
                Ok(Some(pb::DecodeEvent { event: Some(Event::Token(t)) })) => Ok(Update::Token { token_id: t.token_id, text: t.text }),
                Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) => Ok(Update::Done {
                    finish_reason: f.finish_reason,
                    prompt_tokens: f.prompt_tokens,
                    completion_tokens: f.completion_tokens,
                }),
                Ok(Some(_)) => continue,
                Ok(None) => Err(RouterError::Worker { stage: "decode", message: "the stream ended without finishing".into() }),
                Err(status) => Err(decode_error(status)),
            };
            let last = !matches!(update, Ok(Update::Token { .. }));
            if tx.send(update).await.is_err() || last {
                return;
            }
        }
    });
    Ok(ReceiverStream::new(rx))
}
