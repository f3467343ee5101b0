//! The public `pd.v1.Generation` gRPC API, over the same validation and lifecycle as HTTP.
//! On the wire (proto3) an unset number is 0: `temperature` 0 is greedy, `top_p` and `top_k`
//! 0 are off, `max_tokens` 0 takes the same default as HTTP (chat 512, completion 16).

use std::sync::Arc;

use futures_util::StreamExt;
use pb::generation_server::Generation;
use pd_engine::TextSide;
use pd_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::api::logprobs::with_texts;
use crate::api::request::{FunctionCallIn, FunctionSpec, Message, ToolCallIn, ToolSpec};
use crate::classes::CLASS_HEADER;
use crate::error::RouterError;
use crate::http::AppState;
use crate::record::{client_request_id, Arrival};
use crate::relay::Update;
use crate::tools::Tools;
use crate::validate::{GenerateParams, Input, Kind, LogitParams, Role, Turn};

/// The public service's full name (what reflection lists and health reports on).
pub const SERVICE: &str = "pd.v1.Generation";

/// The Generation service.
#[derive(Debug, Clone)]
pub struct GenerationService {
    pub state: Arc<AppState>,
}

/// A gRPC chat message as the HTTP API's (the same checks and rendering).
fn message_from_pb(i: usize, m: pb::ChatMessage) -> Result<Turn, RouterError> {
    let role = Role::parse(&m.role).ok_or_else(|| {
        RouterError::invalid(
            &format!("messages[{i}].role"),
            format!("role `{}` is not system, user, assistant or tool", m.role),
        )
    })?;
    let calls = m.tool_calls.into_iter().map(|c| ToolCallIn {
        id: Some(c.id).filter(|id| !id.is_empty()),
        kind: None,
        function: FunctionCallIn { name: c.name, arguments: c.arguments },
    });
    let message = Message {
        role,
        content: Some(serde_json::Value::String(m.content)).filter(|c| c.as_str() != Some("")),
        name: None,
        tool_calls: Some(calls.collect::<Vec<_>>()).filter(|c| !c.is_empty()),
        tool_call_id: Some(m.tool_call_id).filter(|id| !id.is_empty()),
        // gRPC answers carry tokens' text, not a split reasoning block.
        reasoning_content: None,
    };
    message.turn(i)
}

/// The request's tools as the HTTP API's `tools`, `tool_choice`, `parallel_tool_calls`.
fn tools_from_pb(req: &mut pb::GenerateRequest) -> Result<Option<Tools>, RouterError> {
    let mut specs = Vec::with_capacity(req.tools.len());
    for (i, f) in std::mem::take(&mut req.tools).into_iter().enumerate() {
        let parameters =
            match f.parameters_json.trim() {
                "" => None,
                text => Some(serde_json::from_str(text).map_err(|e| {
                    RouterError::invalid(&format!("tools[{i}].parameters_json"), format!("not JSON: {e}"))
                })?),
            };
        let function = FunctionSpec {
            name: f.name,
            description: Some(f.description).filter(|d| !d.is_empty()),
            parameters,
            strict: None,
        };
        specs.push(ToolSpec { kind: "function".into(), function });
    }
    let choice = match (req.tool_choice.as_str(), req.tool_choice_function.as_str()) {
        ("", "") => None,
        (c, "") => Some(serde_json::Value::String(c.to_string())),
        ("", name) => Some(serde_json::json!({"type": "function", "function": {"name": name}})),
        _ => return Err(RouterError::invalid("tool_choice", "set `tool_choice` or `tool_choice_function`, not both")),
    };
    let parallel = Some(req.parallel_tool_calls).filter(|&p| p);
    crate::api::request::tools(Some(specs).filter(|s| !s.is_empty()), choice, parallel)
}

/// A gRPC request as the parameters validation checks.
pub fn params_from_pb(mut req: pb::GenerateRequest) -> Result<GenerateParams, RouterError> {
    let tools = tools_from_pb(&mut req)?;
    let field = "chat_template_kwargs_json";
    let kwargs = match req.chat_template_kwargs_json.trim() {
        "" => None,
        text => Some(serde_json::from_str(text).map_err(|e| {
            RouterError::invalid(field, format!("`{field}` must be a JSON object of template variables: {e}"))
        })?),
    };
    let template_kwargs = crate::api::request::template_kwargs(kwargs, field)?;
    let (kind, input) = match (req.prompt.is_empty(), req.messages.is_empty()) {
        (false, true) if tools.is_some() => return Err(RouterError::invalid("tools", "`tools` need `messages`")),
        (false, true) if !template_kwargs.is_empty() => {
            return Err(RouterError::invalid(field, format!("`{field}` needs `messages`")))
        }
        (true, false) if req.echo => return Err(RouterError::invalid("echo", "`echo` needs a `prompt`")),
        (false, true) => (Kind::Completion, Input::Prompt(req.prompt)),
        (true, false) => {
            let messages = req.messages.into_iter().enumerate().map(|(i, m)| message_from_pb(i, m));
            (Kind::Chat, Input::Messages(messages.collect::<Result<_, _>>()?))
        }
        _ => return Err(RouterError::invalid("prompt", "set exactly one of `prompt` and `messages`")),
    };
    let s = req.sampling.unwrap_or_default();
    let logits = LogitParams {
        frequency_penalty: Some(s.frequency_penalty as f64).filter(|&v| v != 0.0),
        presence_penalty: Some(s.presence_penalty as f64).filter(|&v| v != 0.0),
        repetition_penalty: Some(s.repetition_penalty as f64).filter(|&v| v != 0.0),
        logit_bias: s.logit_bias.iter().map(|(id, &b)| (id.to_string(), b as f64)).collect(),
        min_tokens: Some(s.min_tokens as u64).filter(|&m| m > 0),
        logprobs: s.logprobs.then_some(s.top_logprobs as u64),
        logprobs_field: "sampling.top_logprobs",
    };
    let constraint = pd_kv_transfer::convert::constraint_from_pb(s.constraint.as_ref())
        .map_err(|e| RouterError::invalid(e.field, e.message))?
        .map(|c| (c, "sampling.constraint"));
    Ok(GenerateParams {
        constraint,
        kind,
        model: Some(req.model).filter(|m| !m.is_empty()),
        input,
        max_tokens: Some(s.max_tokens as u64).filter(|&n| n > 0),
        max_tokens_field: "sampling.max_tokens",
        temperature: Some(s.temperature as f64),
        top_p: Some(s.top_p as f64).filter(|&p| p != 0.0),
        top_k: Some(s.top_k).filter(|&k| k > 0),
        seed: s.seed,
        stop: s.stop,
        stop_token_ids: s.stop_token_ids,
        ignore_eos: s.ignore_eos,
        // gRPC answers are message streams either way; `stream` is the HTTP choice of SSE over
        // one whole answer (which `echo` with nothing generated requires).
        stream: false,
        include_usage: true,
        logits,
        user: None,
        tools,
        n: Some(req.n as u64).filter(|&n| n > 0),
        echo: req.echo,
        template_kwargs,
    })
}

/// Turns a request's updates into its gRPC messages: `choice_done` per answer when there
/// are several, `done` (with answer 0's finish reason) at the end. With tools each answer's
/// text is kept so its calls can be parsed when it ends.
struct Responses {
    request_id: String,
    side: Arc<TextSide>,
    n: usize,
    tools: Option<Arc<Tools>>,
    texts: Vec<String>,
    first_finish: String,
    first_calls: Vec<pb::ToolCall>,
    /// With `echo`: per answer, how many of its next tokens are the echoed prompt's.
    prompt_left: Vec<usize>,
}

impl Responses {
    fn new(request_id: String, side: Arc<TextSide>, req: &crate::validate::ValidRequest) -> Self {
        let texts = vec![String::new(); if req.tools.is_some() { req.n } else { 0 }];
        let (first_finish, first_calls) = (String::new(), Vec::new());
        let prompt_left = vec![req.prompt_tokens.len(); if req.echo { req.n } else { 0 }];
        let tools = req.tools.clone();
        Responses { request_id, side, n: req.n, tools, texts, first_finish, first_calls, prompt_left }
    }

    /// Answer `index`'s calls (and "tool_calls" as its finish reason when it made any).
    fn calls(&mut self, index: u32, finish_reason: &mut String) -> Vec<pb::ToolCall> {
        let (Some(tools), Some(text)) = (&self.tools, self.texts.get_mut(index as usize)) else { return Vec::new() };
        let (_, calls) = crate::tools::parse(&std::mem::take(text), tools);
        if !calls.is_empty() {
            *finish_reason = "tool_calls".into();
        }
        let id = || format!("call_{}", uuid::Uuid::now_v7().simple());
        calls.into_iter().map(|c| pb::ToolCall { id: id(), name: c.name, arguments: c.arguments }).collect()
    }

    fn next(&mut self, update: Result<Update, RouterError>) -> Option<Result<pb::GenerateResponse, Status>> {
        use pb::generate_response::Message;
        let message = match update {
            Err(e) => return Some(Err(e.to_status())),
            Ok(Update::Token { index, token_id, text, logprobs }) => {
                if let Some(t) = self.texts.get_mut(index as usize) {
                    t.push_str(&text);
                }
                let prompt = match self.prompt_left.get_mut(index as usize) {
                    Some(left) if *left > 0 => {
                        *left -= 1;
                        true
                    }
                    _ => false,
                };
                Message::Token(pb::GeneratedToken {
                    token_id,
                    text,
                    logprobs: logprobs.map(|l| with_texts(&self.side.tokenizer, token_id, l)),
                    index,
                    prompt,
                })
            }
            Ok(Update::Finished { index, mut finish_reason, completion_tokens }) => {
                let tool_calls = self.calls(index, &mut finish_reason);
                if index == 0 {
                    self.first_finish = finish_reason.clone();
                }
                if self.n == 1 {
                    self.first_calls = tool_calls;
                    return None;
                }
                Message::ChoiceDone(pb::ChoiceDone { index, finish_reason, completion_tokens, tool_calls })
            }
            Ok(Update::Done { prompt_tokens, completion_tokens, cached_tokens }) => Message::Done(pb::GenerationDone {
                finish_reason: std::mem::take(&mut self.first_finish),
                prompt_tokens,
                completion_tokens,
                request_id: self.request_id.clone(),
                cached_tokens,
                tool_calls: std::mem::take(&mut self.first_calls),
            }),
        };
        Some(Ok(pb::GenerateResponse { message: Some(message) }))
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream =
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let arrival = Arrival::new(&pd_telemetry::otel::extract_metadata(request.metadata()));
        let metadata = request.metadata();
        let caller = self.state.caller(
            metadata.get(CLASS_HEADER).map(|v| v.as_bytes()),
            metadata.get("authorization").map(|v| v.as_bytes()),
        );
        let req = request.into_inner();
        // The caller's id is a label; the router's own id keys the request in the cluster.
        let client_id =
            Some(&req.request_id).filter(|id| !id.is_empty()).map(|id| client_request_id(id.as_bytes(), "request_id"));
        let arrival = arrival.with_client_id(client_id.clone().and_then(Result::ok));
        let id = AppState::request_id();
        let params = match client_id {
            Some(Err(e)) => Err(e),
            _ => params_from_pb(req),
        };
        let (valid, class, record) =
            self.state.accept(arrival, caller, params, id.clone()).await.map_err(|e| e.to_status())?;
        let updates = if valid.echo && crate::score::scored_alone(&valid) {
            let mut record = record;
            let updates = crate::score::echo_updates(&self.state.scheduler, &self.state.text, &valid, &mut record)
                .await
                .map_err(|e| e.to_status())?;
            futures_util::stream::iter(updates.into_iter().map(Ok)).boxed()
        } else {
            crate::http::start(&self.state, &valid, class, record).await.map_err(|e| e.to_status())?
        };
        let mut responses = Responses::new(id, self.state.text.clone(), &valid);
        Ok(Response::new(Box::pin(updates.filter_map(move |u| std::future::ready(responses.next(u))))))
    }
}
