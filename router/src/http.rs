//! The OpenAI-compatible HTTP API: completions and chat completions (JSON or SSE), models,
//! health and readiness. Errors are OpenAI-shaped JSON; a failure after streaming began ends
//! the stream with an error event (never a silent close or a `[DONE]`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{Stream, StreamExt};
use pd_engine::TextSide;
use pd_proto::v1 as pb;

use crate::api::logprobs::Logprobs;
use crate::api::request;
use crate::api::response::{
    object_name, Choice, Chunk, ChunkChoice, Completion, ModelList, ToolCall, ToolCallDelta, Usage,
};
use crate::classes::{Class, CLASS_HEADER};
use crate::error::RouterError;
use crate::lifecycle;
use crate::reasoning::{Part, ReasoningStream};
use crate::record::{client_request_id, Arrival, RequestRecord};
use crate::relay::Update;
use crate::schedule::Scheduler;
use crate::tools::{CallStream, Piece};
use crate::validate::{validate, GenerateParams, Input, Kind, Limits, ValidRequest};
use pd_telemetry::metrics::RouterMetrics;
use pd_telemetry::{Metrics, RequestClass};

/// What the HTTP and gRPC front ends share.
#[derive(Debug)]
pub struct AppState {
    pub text: Arc<TextSide>,
    pub scheduler: Arc<Scheduler>,
    pub limits: Limits,
    pub model_name: String,
    pub body_limit: usize,
    /// How long a body may take to arrive (408 past it).
    pub body_read_timeout: std::time::Duration,
    pub metrics: Arc<Metrics>,
    pub router_metrics: RouterMetrics,
    /// Set on SIGTERM: `/ready` fails so the load balancer stops sending new requests.
    pub draining: AtomicBool,
    /// `--log-content`: the request record carries the prompt and the generated text.
    pub log_content: bool,
    /// A thinking model's `<think>` block goes to `reasoning_content` (`--reasoning-parser`).
    pub separate_reasoning: bool,
}

/// Who sent a request: its traffic class (or why it has none) and its tenant.
pub struct Caller {
    pub class: Result<Arc<Class>, RouterError>,
    pub tenant: Option<String>,
}

impl AppState {
    /// A new request id, unique across router replicas and restarts without any coordination:
    /// a UUIDv7 (milliseconds since the epoch, then 74 random bits). Workers key the request's
    /// KV transfer by it, so two routers over the same workers must never make the same id
    /// (a counter with the pid collided: every replica is pid 1 in its own container).
    pub fn request_id() -> String {
        format!("req-{}", uuid::Uuid::now_v7().simple())
    }

    /// The request's traffic class from its API key, `x-pd-class` header or metadata value,
    /// and the tenant its key belongs to.
    pub fn caller(&self, header: Option<&[u8]>, authorization: Option<&[u8]>) -> Caller {
        let classes = &self.scheduler.classes;
        Caller { class: classes.assign(header, authorization), tenant: classes.tenant(authorization) }
    }

    /// The `validate` stage, off the async runtime (it renders and tokenizes), then the class's
    /// limits, and the request's record: a refused request is logged, counted and answered.
    pub async fn accept(
        self: &Arc<Self>,
        arrival: Arrival,
        caller: Caller,
        params: Result<GenerateParams, RouterError>,
        request_id: String,
    ) -> Result<(ValidRequest, Arc<Class>, RequestRecord), RouterError> {
        let Caller { class, tenant } = caller;
        let state = self.clone();
        let run = move |p: GenerateParams| {
            let (given, field) = (p.max_tokens.is_some(), p.max_tokens_field);
            let mut valid = validate(p, &state.text, &state.model_name, &state.limits)?;
            valid.reasoning = valid.reasoning.filter(|_| state.separate_reasoning);
            Ok((valid, given, field))
        };
        let validated = match params {
            Ok(p) if p.is_light() => run(p),
            Ok(p) => tokio::task::spawn_blocking(move || run(p))
                .await
                .unwrap_or_else(|e| Err(RouterError::Unprocessable(format!("validation failed: {e}")))),
            Err(e) => Err(e),
        };
        let label = class.as_ref().map_or_else(|_| RequestClass::default_class(), |c| c.label());
        let checked = class.and_then(|c| {
            let (mut req, given, field) = validated?;
            req.params.max_tokens = c.check(req.prompt_tokens.len(), req.params.max_tokens, given, field)?;
            Ok((c, req))
        });
        match checked {
            Ok((class, req)) => {
                let mut record = arrival.into_record(self.router_metrics.clone(), request_id, label, Some(&req));
                record.tenant = tenant;
                if self.log_content {
                    record.log_content(self.text.tokenizer.decode(&req.prompt_tokens, false).unwrap_or_default());
                }
                Ok((req, class, record))
            }
            Err(e) => {
                let mut record = arrival.into_record(self.router_metrics.clone(), request_id, label, None);
                record.tenant = tenant;
                record.fail(&e);
                Err(e)
            }
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, RouterError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if !json {
        return Err(RouterError::UnsupportedMediaType);
    }
    // Read up to the limit; past it, keep reading (and dropping) what the client still sends,
    // up to a hard cap, so it receives the 413 instead of a broken connection.
    // The whole body within `body_read_timeout` (the header timeout covers the head only): a
    // client trickling its body gets 408 instead of holding the connection for ever.
    let read = async {
        let mut stream = body.into_data_stream();
        let mut bytes = Vec::new();
        let mut total = 0usize;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk
                .map_err(|e| RouterError::InvalidRequest { message: format!("reading the body: {e}"), param: None })?;
            total += chunk.len();
            if total <= state.body_limit {
                bytes.extend_from_slice(&chunk);
            } else if total > DRAIN_CAP {
                break;
            }
        }
        Ok::<_, RouterError>((bytes, total))
    };
    let timeout = state.body_read_timeout;
    let (bytes, total) = tokio::time::timeout(timeout, read).await.map_err(|_| {
        RouterError::ClientTooSlow(format!("the request body did not arrive within {} ms", timeout.as_millis()))
    })??;
    if total > state.body_limit {
        return Err(RouterError::TooLarge(state.body_limit));
    }
    Ok(Bytes::from(bytes))
}

/// The caller's own request id (kept as a label; the response's `id` is the router's).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Most bytes of an oversized body read before answering 413 anyway.
const DRAIN_CAP: usize = 64 << 20;

async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(state, Kind::Completion, headers, body).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(state, Kind::Chat, headers, body).await
}

async fn handle(state: Arc<AppState>, kind: Kind, headers: HeaderMap, body: Body) -> Response {
    let client_id = headers.get(REQUEST_ID_HEADER).map(|v| client_request_id(v.as_bytes(), REQUEST_ID_HEADER));
    let arrival = Arrival::new(&pd_telemetry::otel::extract_headers(&headers))
        .with_client_id(client_id.clone().and_then(Result::ok));
    let caller = state.caller(
        headers.get(CLASS_HEADER).map(|v| v.as_bytes()),
        headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()),
    );
    let params = match &client_id {
        Some(Err(e)) => Err(e.clone()),
        _ => read_body(&state, &headers, body).await.and_then(|b| request::decode(kind, &b)),
    };
    if let Some(p) = params.as_ref().ok().filter(|p| matches!(p.input, Input::Batch(_))) {
        // Each prompt arrives as its own request (the first one keeps this arrival).
        return handle_batch(state, &headers, arrival, client_id.and_then(Result::ok), p.clone()).await;
    }
    let id = AppState::request_id();
    let (req, class, record) = match state.accept(arrival, caller, params, id.clone()).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if req.echo && crate::score::scored_alone(&req) {
        return echo_response(&state, req, id, record).await;
    }
    let updates = match start(&state, &req, class, record).await {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let text = state.text.clone();
    if req.stream {
        stream_response(req, id, updates, text).into_response()
    } else {
        collect_response(req, id, updates, &text).await
    }
}

/// The updates of an accepted request: those of its generation, after its prompt's when it
/// echoes it (`score::prompt_updates`).
pub(crate) async fn start(
    state: &AppState,
    req: &ValidRequest,
    class: Arc<Class>,
    mut record: RequestRecord,
) -> Result<futures_util::stream::BoxStream<'static, Result<Update, RouterError>>, RouterError> {
    let prompt = match req.echo {
        true => crate::score::prompt_updates(&state.scheduler, &state.text, req, &mut record).await?,
        false => Vec::new(),
    };
    let updates = lifecycle::start(state.scheduler.clone(), state.text.clone(), req, class, record).await?;
    Ok(futures_util::stream::iter(prompt.into_iter().map(Ok)).chain(updates).boxed())
}

/// A request with several prompts (`crate::batch`): each is accepted (validated, checked
/// against the class) and started as its own request; one answer holds their choices.
async fn handle_batch(
    state: Arc<AppState>,
    headers: &HeaderMap,
    arrival: Arrival,
    client_id: Option<String>,
    mut p: GenerateParams,
) -> Response {
    let Input::Batch(prompts) = std::mem::replace(&mut p.input, Input::Tokens(Vec::new())) else {
        return RouterError::invalid("prompt", "not a list of prompts").into_response();
    };
    let cx = pd_telemetry::otel::extract_headers(headers);
    let mut accepted = Vec::with_capacity(prompts.len());
    let mut kept = Some(arrival);
    for input in prompts {
        let one = GenerateParams { input, ..p.clone() };
        let arrival = kept.take().unwrap_or_else(|| Arrival::new(&cx).with_client_id(client_id.clone()));
        let caller = state.caller(
            headers.get(CLASS_HEADER).map(|v| v.as_bytes()),
            headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()),
        );
        match state.accept(arrival, caller, Ok(one), AppState::request_id()).await {
            Ok(a) => accepted.push(a),
            Err(e) => return e.into_response(),
        }
    }
    let id = AppState::request_id();
    let Some(first) = accepted.first() else { return RouterError::invalid("prompt", "no prompt").into_response() };
    let n = first.0.n;
    let shape = ValidRequest { n: n * accepted.len(), ..first.0.clone() };
    if shape.echo && crate::score::scored_alone(&first.0) {
        let mut choices = Vec::with_capacity(accepted.len());
        let (mut prompt_tokens, mut completion_tokens) = (0, 0);
        for (i, (req, _, mut record)) in accepted.into_iter().enumerate() {
            match crate::score::echo(&state.scheduler, &state.text, &req, &mut record).await {
                Ok(e) => {
                    prompt_tokens += req.prompt_tokens.len() as u32;
                    completion_tokens += e.completion_tokens;
                    choices.push(Choice::of(req.kind, e.text, e.finish_reason, e.logprobs).at(i as u32));
                }
                Err(e) => return e.into_response(),
            }
        }
        let usage = Usage::new(prompt_tokens, completion_tokens, 0);
        let object = object_name(shape.kind, false);
        return Json(Completion { id, object, created: unix_now(), model: shape.model, choices, usage })
            .into_response();
    }
    let mut parts = Vec::with_capacity(accepted.len());
    for (req, class, record) in accepted {
        match start(&state, &req, class, record).await {
            Ok(u) => parts.push(u),
            Err(e) => return e.into_response(),
        }
    }
    let merged = Box::pin(crate::batch::merge(parts, n));
    let text = state.text.clone();
    if shape.stream {
        stream_response(shape, id, merged, text).into_response()
    } else {
        collect_response(shape, id, merged, &text).await
    }
}

/// A completion with `echo`: the prompt scored on a prefill worker (`score`).
async fn echo_response(state: &AppState, req: ValidRequest, id: String, mut record: RequestRecord) -> Response {
    let echoed = match crate::score::echo(&state.scheduler, &state.text, &req, &mut record).await {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let prompt_tokens = req.prompt_tokens.len() as u32;
    Json(Completion {
        id,
        object: object_name(req.kind, false),
        created: unix_now(),
        model: req.model,
        choices: vec![Choice::of(req.kind, echoed.text, echoed.finish_reason, echoed.logprobs)],
        usage: Usage::new(prompt_tokens, echoed.completion_tokens, 0),
    })
    .into_response()
}

/// One answer as it builds up.
struct Answer {
    text: String,
    logprobs: Option<Logprobs>,
    /// Streaming: the role went out with the answer's first chunk.
    started: bool,
    /// Streaming with tools: the answer read for calls as it comes.
    calls: Option<CallStream>,
    /// Streaming from a thinking model: its `<think>` block read apart as it comes.
    thinking: Option<ReasoningStream>,
}

/// What a streamed answer sends: a piece of its reasoning, or of its content and calls.
enum Out {
    Reasoning(String),
    Piece(Piece),
}

impl Answer {
    fn new(req: &ValidRequest) -> Self {
        let logprobs = req.params.logprobs.map(|_| Logprobs::new(req.kind));
        let calls = req.tools.clone().filter(|_| req.stream).map(CallStream::new);
        let thinking = req.reasoning.filter(|_| req.stream).map(ReasoningStream::new);
        Answer { text: String::new(), logprobs, started: false, calls, thinking }
    }

    /// The next text of a streamed answer, as what can be sent now.
    fn stream(&mut self, text: String) -> Vec<Out> {
        let parts = match &mut self.thinking {
            Some(thinking) => thinking.push(&text),
            None => vec![Part::Content(text)],
        };
        self.route(parts)
    }

    /// The end of a streamed answer: what was held back, and whether it made calls.
    fn finish(&mut self) -> (Vec<Out>, bool) {
        let parts = self.thinking.as_mut().map(ReasoningStream::finish).unwrap_or_default();
        let mut out = self.route(parts);
        let (pieces, made_calls) = self.calls.as_mut().map(CallStream::finish).unwrap_or_default();
        out.extend(pieces.into_iter().map(Out::Piece));
        (out, made_calls)
    }

    /// Reasoning goes out as it is; content is read for calls when there are tools.
    fn route(&mut self, parts: Vec<Part>) -> Vec<Out> {
        let mut out = Vec::with_capacity(parts.len());
        for part in parts {
            match (part, &mut self.calls) {
                (Part::Reasoning(r), _) => out.push(Out::Reasoning(r)),
                (Part::Content(c), Some(calls)) => out.extend(calls.push(&c).into_iter().map(Out::Piece)),
                (Part::Content(c), None) => out.push(Out::Piece(Piece::Content(c))),
            }
        }
        out
    }

    /// The chunks of `pieces` (reasoning, content and pieces of calls); the log probabilities
    /// so far go with the first.
    fn chunks(&mut self, kind: Kind, index: u32, pieces: Vec<Out>) -> Vec<ChunkChoice> {
        let mut out = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let first = !std::mem::replace(&mut self.started, true);
            let logprobs = self.logprobs.as_mut().map(Logprobs::take).filter(|l| !l.is_empty());
            let choice = match piece {
                Out::Reasoning(text) => ChunkChoice::reasoning(text, first, logprobs),
                Out::Piece(Piece::Content(text)) => ChunkChoice::token(kind, text, first, logprobs),
                Out::Piece(call) => {
                    ChunkChoice::tool_call(ToolCallDelta::of(call).expect("a piece of a call"), first, logprobs)
                }
            };
            out.push(choice.at(index));
        }
        out
    }

    /// Adds a token's log probabilities, when asked (an echoed prompt's first token has none).
    fn push(&mut self, side: &TextSide, token_id: u32, text: &str, logprobs: Option<&pb::TokenLogprobs>) {
        match (&mut self.logprobs, logprobs) {
            (Some(all), Some(l)) => all.push(&side.tokenizer, token_id, text, l),
            (Some(all), None) => all.push_unscored(&side.tokenizer, token_id),
            (None, _) => {}
        }
    }
}

/// The answers of a request (`n` of them), by index.
struct Answers(Vec<Answer>);

impl Answers {
    fn new(req: &ValidRequest) -> Self {
        Answers((0..req.n).map(|_| Answer::new(req)).collect())
    }

    /// Answer `index` (the relay checked it against `n`).
    fn get(&mut self, index: u32) -> &mut Answer {
        let last = self.0.len() - 1;
        &mut self.0[(index as usize).min(last)]
    }
}

/// A whole response: every answer's text (and log probabilities, when asked), then the usage.
async fn collect_response(
    req: ValidRequest,
    id: String,
    mut updates: impl Stream<Item = Result<Update, RouterError>> + Unpin,
    side: &TextSide,
) -> Response {
    let mut answers = Answers::new(&req);
    let mut choices = Vec::with_capacity(req.n);
    while let Some(update) = updates.next().await {
        match update {
            Ok(Update::Token { index, token_id, text: t, logprobs: l }) => {
                let answer = answers.get(index);
                answer.push(side, token_id, &t, l.as_ref());
                answer.text.push_str(&t);
            }
            Ok(Update::Finished { index, finish_reason, .. }) => {
                let answer = answers.get(index);
                let (text, logprobs) = (std::mem::take(&mut answer.text), answer.logprobs.take());
                let (reasoning, text) = match req.reasoning {
                    Some(start) => crate::reasoning::split(&text, start),
                    None => (None, text),
                };
                let choice = match req.tools.as_deref().map(|t| crate::tools::parse(&text, t)) {
                    Some((content, calls)) if !calls.is_empty() => {
                        Choice::with_tool_calls(content, ToolCall::all(calls), logprobs)
                    }
                    _ => Choice::of(req.kind, text, finish_reason, logprobs),
                };
                let choice = choice.with_reasoning(reasoning);
                choices.push((index, choice.at(index)));
            }
            Ok(Update::Done { prompt_tokens, completion_tokens, cached_tokens }) => {
                choices.sort_by_key(|(index, _)| *index);
                return Json(Completion {
                    id,
                    object: object_name(req.kind, false),
                    created: unix_now(),
                    model: req.model,
                    choices: choices.into_iter().map(|(_, c)| c).collect(),
                    usage: Usage::new(prompt_tokens, completion_tokens, cached_tokens),
                })
                .into_response();
            }
            Err(e) => return e.into_response(),
        }
    }
    RouterError::Worker { stage: "decode", message: "the stream ended without finishing".into() }.into_response()
}

/// Server-sent events: a chunk per token (of answer `index`), each answer's finish chunk,
/// the usage chunk if asked, then `[DONE]`; a failure ends the stream with an `error` event
/// instead. With tools an answer's text is read for calls as it comes (`tools::CallStream`):
/// its content streams as text, each call as OpenAI's `delta.tool_calls` pieces (id and name,
/// then the arguments as they are written), and an answer of complete calls finishes with
/// `tool_calls`.
fn stream_response(
    req: ValidRequest,
    id: String,
    updates: impl Stream<Item = Result<Update, RouterError>> + Send + 'static,
    side: Arc<TextSide>,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let created = unix_now();
    let (kind, include_usage) = (req.kind, req.include_usage);
    let model = req.model.clone();
    let chunk = move |choices: Vec<ChunkChoice>, usage: Option<Usage>| {
        let chunk =
            Chunk { id: id.clone(), object: object_name(kind, true), created, model: model.clone(), choices, usage };
        Event::default().data(serde_json::to_string(&chunk).unwrap_or_default())
    };
    let mut answers = Answers::new(&req);
    let events = updates.flat_map(move |update| {
        let out: Vec<Event> = match update {
            Ok(Update::Token { index, token_id, text, logprobs: l }) => {
                let answer = answers.get(index);
                answer.push(&side, token_id, &text, l.as_ref());
                let pieces = answer.stream(text);
                answer.chunks(kind, index, pieces).into_iter().map(|c| chunk(vec![c], None)).collect()
            }
            Ok(Update::Finished { index, mut finish_reason, .. }) => {
                let answer = answers.get(index);
                let (mut pieces, made_calls) = answer.finish();
                if pieces.is_empty() && answer.logprobs.as_ref().is_some_and(|l| !l.is_empty()) {
                    // Tokens held back at the end (white space after a call): their log
                    // probabilities still go out, on an empty chunk.
                    pieces.push(Out::Piece(Piece::Content(String::new())));
                }
                if made_calls {
                    finish_reason = "tool_calls".into();
                }
                let mut out: Vec<Event> =
                    answer.chunks(kind, index, pieces).into_iter().map(|c| chunk(vec![c], None)).collect();
                out.push(chunk(vec![ChunkChoice::finish(kind, finish_reason).at(index)], None));
                out
            }
            Ok(Update::Done { prompt_tokens, completion_tokens, cached_tokens }) => {
                let mut out = Vec::new();
                if include_usage {
                    out.push(chunk(Vec::new(), Some(Usage::new(prompt_tokens, completion_tokens, cached_tokens))));
                }
                out.push(Event::default().data("[DONE]"));
                out
            }
            Err(e) => vec![Event::default().event("error").data(serde_json::to_string(&e.body()).unwrap_or_default())],
        };
        futures_util::stream::iter(out.into_iter().map(Ok))
    });
    Sse::new(events)
}

async fn tokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&state, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let run = move || {
        let r = request::decode_object(&body)?;
        crate::api::tokenize::tokenize(r, &state.text, &state.model_name)
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(answer)) => Json(answer).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => RouterError::Unprocessable(format!("tokenizing failed: {e}")).into_response(),
    }
}

async fn detokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let answer = read_body(&state, &headers, body)
        .await
        .and_then(|b| request::decode_object(&b))
        .and_then(|r| crate::api::tokenize::detokenize(r, &state.text, &state.model_name));
    match answer {
        Ok(a) => Json(a).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList::one(&state.model_name, state.text.max_position))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    pd_telemetry::http::metrics_response(&state.metrics)
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining: shutting down").into_response();
    }
    if state.scheduler.ready().await {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no prefill or no decode worker answers").into_response()
    }
}
