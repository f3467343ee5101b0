//! One request through the cluster (DESIGN.md's lifecycle): choose a decode and a prefill
//! worker (`router.route` span), reserve KV on the decode worker and open its token stream;
//! prefill on the prefill worker with that KV target, retrying on another prefill worker
//! while the lease holds; relay tokens as they come. Both worker calls carry the request's
//! trace context and class in gRPC metadata, so the workers' spans join the request's trace.
//!
//! The `RequestRecord` travels with the request and is finished where the request ends.
//! Dropping the returned stream (client gone) cancels both sides: the decode worker sees
//! its stream closed and frees the blocks; the prefill task is aborted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pb::decode_event::Event;
use pb::decode_worker_client::DecodeWorkerClient;
use pb::prefill_worker_client::PrefillWorkerClient;
use pd_proto::v1 as pb;
use pd_telemetry::metrics::RouterMetrics;
use pd_telemetry::opentelemetry::{Context, KeyValue};
use pd_telemetry::{RequestClass, StageSpan};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::error::RouterError;
use crate::record::{DecodeTimings, PrefillTimings, RequestRecord};
use crate::validate::ValidRequest;
use crate::workers::{Picked, Pools};

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
        tonic::Code::InvalidArgument => {
            RouterError::InvalidRequest { message: status.message().to_string(), param: None }
        }
        tonic::Code::ResourceExhausted => RouterError::Overloaded(status.message().to_string()),
        _ => RouterError::Worker { stage: "decode", message: status.message().to_string() },
    }
}

/// A worker request carrying the trace context `cx` and the traffic class.
fn traced<T>(message: T, cx: &Context, class: &RequestClass) -> tonic::Request<T> {
    let mut request = pd_telemetry::otel::request_with_context(message, cx);
    if let Ok(v) = class.as_str().parse() {
        request.metadata_mut().insert(RequestClass::HEADER, v);
    }
    request
}

/// Aborts a task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The decode stream opened and, unless the decode worker prefills the prompt itself, the
/// KV target and the first prefill worker chosen.
struct Opened {
    events: tonic::Streaming<pb::DecodeEvent>,
    remote: Option<(pb::KvTarget, Picked<PrefillWorkerClient<Channel>>)>,
}

async fn open(pools: &Pools, req: &ValidRequest, record: &mut RequestRecord) -> Result<Opened, RouterError> {
    let route = StageSpan::start("router.route", record.span().context());
    let here = pools.prefill_here(req.prompt_tokens.len());
    let picked = async {
        let decode = pools.pick_decode(&[]).await?;
        let prefill = if here { None } else { Some(pools.pick_prefill(&[]).await?) };
        Ok::<_, RouterError>((decode, prefill))
    }
    .await;
    let (decode, prefill) = match picked {
        Ok(p) => p,
        Err(e) => {
            route.error(e.to_string());
            return Err(e);
        }
    };
    route.set("pd.decode.worker", decode.addr.clone());
    route.set("pd.decode.why", decode.why.clone());
    record.decode_worker = decode.addr.clone();
    match &prefill {
        Some(p) => {
            route.set("pd.prefill.worker", p.addr.clone());
            route.set("pd.prefill.why", p.why.clone());
            record.prefill_worker = p.addr.clone();
        }
        None => {
            let why = if pools.prefill.specs_empty() {
                "colocated: no prefill pool".to_string()
            } else {
                format!("short prompt: {} <= {} tokens", req.prompt_tokens.len(), pools.local_prefill_max_tokens)
            };
            route.set("pd.prefill.worker", "decode worker");
            route.set("pd.prefill.why", why);
            record.prefill_worker = format!("local:{}", decode.addr);
        }
    }
    route.end();
    let Picked { addr: decode_addr, client: mut decode, .. }: Picked<DecodeWorkerClient<Channel>> = decode;
    let decode_request = pb::DecodeRequest {
        request_id: record.request_id.clone(),
        prompt_tokens: req.prompt_tokens.clone(),
        sampling: Some(req.sampling.clone()),
        lease_ms: 0,
        prefill_here: here,
    };
    let mut events = match decode.generate(traced(decode_request, record.span().context(), record.class())).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            pools.decode.forget(&decode_addr);
            return Err(decode_error(status));
        }
    };
    let Some(prefill) = prefill else {
        return Ok(Opened { events, remote: None });
    };
    let target = match events.message().await {
        Ok(Some(pb::DecodeEvent { event: Some(Event::Target(t)) })) => t,
        Ok(_) => return Err(RouterError::Worker { stage: "decode", message: "no KV target".into() }),
        Err(status) => return Err(decode_error(status)),
    };
    Ok(Opened { events, remote: Some((target, prefill)) })
}

/// Starts `req` and returns its updates. Errors before the first token come back directly.
pub async fn start(
    pools: Arc<Pools>,
    req: &ValidRequest,
    mut record: RequestRecord,
) -> Result<ReceiverStream<Result<Update, RouterError>>, RouterError> {
    let Opened { mut events, remote } = match open(&pools, req, &mut record).await {
        Ok(o) => o,
        Err(e) => {
            record.fail(&e);
            return Err(e);
        }
    };
    let prefill = remote.map(|(target, first_prefill)| {
        let lease_left = Duration::from_millis(
            target.lease_deadline_unix_ms.saturating_sub(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
            ),
        );
        let prefill_req = pb::PrefillRequest {
            request_id: record.request_id.clone(),
            prompt_tokens: req.prompt_tokens.clone(),
            target: Some(target),
            sampling: Some(req.sampling.clone()),
        };
        AbortOnDrop(tokio::spawn(prefill_with_retries(
            pools.clone(),
            first_prefill,
            prefill_req,
            lease_left,
            record.span().context().clone(),
            record.class().clone(),
            record.metrics().clone(),
        )))
    });
    let (tx, rx) = mpsc::channel(64);
    // Relay decode events until done, failure, or the client leaving.
    tokio::spawn(async move {
        // The prefill task (if any) is aborted when this relay ends.
        let mut prefill = prefill;
        let mut prefill_pending = prefill.is_some();
        let mut record = record;
        loop {
            let message = tokio::select! {
                m = events.message() => m,
                p = async {
                    match prefill.as_mut() {
                        Some(task) => (&mut task.0).await,
                        None => std::future::pending().await,
                    }
                }, if prefill_pending => {
                    prefill_pending = false;
                    match p {
                        Ok(Ok((worker, timings))) => {
                            record.prefill_worker = worker;
                            record.prefilled(timings);
                            continue;
                        }
                        Ok(Err(e)) => {
                            let _ = tx.send(Err(e.clone())).await;
                            record.fail(&e);
                        }
                        Err(join) => {
                            let e = RouterError::Worker { stage: "prefill", message: format!("prefill task: {join}") };
                            let _ = tx.send(Err(e.clone())).await;
                            record.fail(&e);
                        }
                    }
                    return;
                }
                _ = tx.closed() => return, // client gone: dropping `events` cancels the decode stream
            };
            let update = match message {
                Ok(Some(pb::DecodeEvent { event: Some(Event::Token(t)) })) => {
                    record.token();
                    Ok(Update::Token { token_id: t.token_id, text: t.text })
                }
                Ok(Some(pb::DecodeEvent { event: Some(Event::Finished(f)) })) => {
                    if f.prefill_ms > 0.0 {
                        // Prefilled on the decode worker, which measured it.
                        record.prefilled(PrefillTimings {
                            queue_ms: f.queue_ms,
                            prefill_ms: f.prefill_ms,
                            kv_commit_ms: 0.0,
                        });
                    }
                    record.decoded(DecodeTimings {
                        kv_transfer_ms: f.kv_transfer_ms,
                        decode_ms: f.decode_ms,
                        kv_bytes: f.kv_bytes,
                    });
                    Ok(Update::Done {
                        finish_reason: f.finish_reason,
                        prompt_tokens: f.prompt_tokens,
                        completion_tokens: f.completion_tokens,
                    })
                }
                Ok(Some(_)) => continue,
                Ok(None) => {
                    Err(RouterError::Worker { stage: "decode", message: "the stream ended without finishing".into() })
                }
                Err(status) => Err(decode_error(status)),
            };
            match &update {
                Ok(Update::Token { .. }) => {
                    if tx.send(update).await.is_err() {
                        return;
                    }
                }
                Ok(Update::Done { finish_reason, .. }) => {
                    let reason = finish_reason.clone();
                    // The prefill response normally arrived long before the last token; wait
                    // briefly for it so the record carries the prefill worker's timings.
                    if let (true, Some(task)) = (prefill_pending, prefill.as_mut()) {
                        if let Ok(Ok(Ok((worker, timings)))) =
                            tokio::time::timeout(Duration::from_millis(200), &mut task.0).await
                        {
                            record.prefill_worker = worker;
                            record.prefilled(timings);
                        }
                    }
                    let _ = tx.send(update).await;
                    record.finish(&reason);
                    return;
                }
                Err(e) => {
                    let e = e.clone();
                    let _ = tx.send(update).await;
                    record.fail(&e);
                    return;
                }
            }
        }
    });
    Ok(ReceiverStream::new(rx))
}

/// Prefills on `first`, then on other workers while the lease holds. Returns the worker that
/// succeeded and its timings.
async fn prefill_with_retries(
    pools: Arc<Pools>,
    first: Picked<PrefillWorkerClient<Channel>>,
    request: pb::PrefillRequest,
    lease_left: Duration,
    cx: Context,
    class: RequestClass,
    metrics: RouterMetrics,
) -> Result<(String, PrefillTimings), RouterError> {
    let deadline = Instant::now() + lease_left;
    let mut tried = Vec::new();
    let mut next = Some(first);
    let mut last_error = RouterError::NoWorker("prefill");
    for attempt in 0..PREFILL_ATTEMPTS {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
        let Picked { addr, mut client, why } = match next.take() {
            Some(p) => p,
            None => match pools.pick_prefill(&tried).await {
                Ok(p) => p,
                Err(e) => {
                    last_error = e;
                    break;
                }
            },
        };
        if attempt > 0 {
            use pd_telemetry::opentelemetry::trace::TraceContextExt;
            cx.span().add_event(
                "prefill.retry",
                vec![KeyValue::new("pd.prefill.worker", addr.clone()), KeyValue::new("pd.prefill.why", why)],
            );
            metrics.migrations.inc();
        }
        match tokio::time::timeout(left, client.prefill(traced(request.clone(), &cx, &class))).await {
            Ok(Ok(response)) => {
                let r = response.into_inner();
                return Ok((
                    addr,
                    PrefillTimings { queue_ms: r.queue_ms, prefill_ms: r.prefill_ms, kv_commit_ms: r.kv_commit_ms },
                ));
            }
            Ok(Err(status)) => {
                let retryable = matches!(
                    status.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Internal
                );
                last_error = RouterError::Worker { stage: "prefill", message: status.message().to_string() };
                pools.prefill.forget(&addr);
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
    Err(last_error)
}
