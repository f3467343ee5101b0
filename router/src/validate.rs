//! OpenAI request bodies become `ValidRequest`s here ("parse, don't validate"): every field
//! is read explicitly so a bad one gets a message naming it.

use pd_engine::{ChatMessage, TextSide};
use pd_proto::v1 as pb;
use serde_json::{Map, Value};

use crate::error::RouterError;

/// Which OpenAI endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// A request the cluster can run.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub kind: Kind,
    pub model: String,
    pub prompt_tokens: Vec<u32>,
    pub sampling: pb::SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
}

/// Limits the router enforces.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest `max_tokens` accepted.
    pub max_tokens: u32,
    /// `max_tokens` when a completion request gives none (OpenAI: 16).
    pub default_completion_tokens: u32,
    /// `max_tokens` when a chat request gives none.
    pub default_chat_tokens: u32,
}

/// Fields accepted and ignored (they change nothing here).
const IGNORED: &[&str] = &["user", "frequency_penalty", "presence_penalty"];

fn number(body: &Map<String, Value>, field: &str) -> Result<Option<f64>, RouterError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(RouterError::invalid(field, format!("`{field}` must be a number"))),
    }
}

fn integer(body: &Map<String, Value>, field: &str) -> Result<Option<u64>, RouterError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| RouterError::invalid(field, format!("`{field}` must be a non-negative integer"))),
        Some(_) => Err(RouterError::invalid(field, format!("`{field}` must be an integer"))),
    }
}

fn boolean(body: &Map<String, Value>, field: &str) -> Result<bool, RouterError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RouterError::invalid(field, format!("`{field}` must be true or false"))),
    }
}

fn stop_list(body: &Map<String, Value>) -> Result<Vec<String>, RouterError> {
    let list = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| RouterError::invalid("stop", "`stop` must be a string or a list of strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(RouterError::invalid("stop", "`stop` must be a string or a list of strings")),
    };
    if list.len() > 4 {
        return Err(RouterError::invalid("stop", "`stop` takes at most 4 sequences"));
    }
    if list.iter().any(String::is_empty) {
        return Err(RouterError::invalid("stop", "`stop` sequences must not be empty"));
    }
    Ok(list)
}

/// Parses and checks one request body.
pub fn validate(
    kind: Kind,
    body: &[u8],
    text: &TextSide,
    served_model: &str,
    limits: &Limits,
) -> Result<ValidRequest, RouterError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| RouterError::InvalidRequest { message: format!("invalid JSON body: {e}"), param: None })?;
    let Value::Object(body) = value else {
        return Err(RouterError::Unprocessable("the body must be a JSON object".into()));
    };
    let model = match body.get("model") {
        None | Some(Value::Null) => served_model.to_string(),
        Some(Value::String(m)) if m == served_model => m.clone(),
        Some(Value::String(m)) => return Err(RouterError::ModelNotFound(m.clone())),
        Some(_) => return Err(RouterError::invalid("model", "`model` must be a string")),
    };
    let known: &[&str] = match kind {
        Kind::Completion => &[
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "n",
            "ignore_eos",
        ],
        Kind::Chat => &[
            "model",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "n",
            "ignore_eos",
        ],
    };
    if let Some(field) = body.keys().find(|k| !known.contains(&k.as_str()) && !IGNORED.contains(&k.as_str())) {
        return Err(RouterError::invalid(field, format!("`{field}` is not supported by this server")));
    }
    if let Some(n) = integer(&body, "n")? {
        if n != 1 {
            return Err(RouterError::invalid("n", "only `n` = 1 is supported"));
        }
    }
    let prompt_tokens = match kind {
        Kind::Completion => {
            let prompt = match body.get("prompt") {
                None | Some(Value::Null) => return Err(RouterError::invalid("prompt", "`prompt` is required")),
                Some(Value::String(p)) => p.clone(),
                Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
                    items[0].as_str().unwrap_or_default().to_string()
                }
                Some(Value::Array(_)) => {
                    return Err(RouterError::invalid(
                        "prompt",
                        "`prompt` must be one string (batches are not supported)",
                    ))
                }
                Some(_) => return Err(RouterError::invalid("prompt", "`prompt` must be a string")),
            };
            if prompt.is_empty() {
                return Err(RouterError::invalid("prompt", "`prompt` must not be empty"));
            }
            text.tokenizer.encode(&prompt).map_err(|e| RouterError::invalid("prompt", e.to_string()))?
        }
        Kind::Chat => {
            let messages = match body.get("messages") {
                None | Some(Value::Null) => return Err(RouterError::invalid("messages", "`messages` is required")),
                Some(Value::Array(items)) => items,
                Some(_) => return Err(RouterError::invalid("messages", "`messages` must be a list")),
            };
            if messages.is_empty() {
                return Err(RouterError::invalid("messages", "`messages` must not be empty"));
            }
            let messages: Vec<ChatMessage> = messages
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let field = |name: &str| m.get(name).and_then(Value::as_str);
                    match (field("role"), field("content")) {
                        (Some(role @ ("system" | "user" | "assistant")), Some(content)) => {
                            Ok(ChatMessage::new(role, content))
                        }
                        (Some(role), Some(_)) => Err(RouterError::invalid(
                            &format!("messages[{i}].role"),
                            format!("role `{role}` is not system, user or assistant"),
                        )),
                        _ => Err(RouterError::invalid(
                            &format!("messages[{i}]"),
                            "each message needs a string `role` and `content`",
                        )),
                    }
                })
                .collect::<Result<_, _>>()?;
            let template = text
                .chat_template
                .as_ref()
                .ok_or_else(|| RouterError::invalid("messages", "the model has no chat template"))?;
            let prompt =
                template.render(&messages, true).map_err(|e| RouterError::invalid("messages", e.to_string()))?;
            text.tokenizer.encode(&prompt).map_err(|e| RouterError::invalid("messages", e.to_string()))?
        }
    };
    let context = text.max_position;
    if prompt_tokens.len() >= context {
        let field = if kind == Kind::Chat { "messages" } else { "prompt" };
        return Err(RouterError::invalid(
            field,
            format!("the prompt has {} tokens; the context length is {context}", prompt_tokens.len()),
        ));
    }
    let room = (context - prompt_tokens.len()) as u64;
    let max_field = if body.contains_key("max_completion_tokens") { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = match integer(&body, max_field)? {
        Some(0) => return Err(RouterError::invalid(max_field, format!("`{max_field}` must be at least 1"))),
        Some(n) if n > limits.max_tokens as u64 => {
            return Err(RouterError::invalid(
                max_field,
                format!("`{max_field}` is {n}; this server allows at most {}", limits.max_tokens),
            ));
        }
        Some(n) if n > room => {
            return Err(RouterError::invalid(
                max_field,
                format!(
                    "prompt ({} tokens) + `{max_field}` ({n}) exceed the context length of {context}",
                    prompt_tokens.len()
                ),
            ));
        }
        Some(n) => n as u32,
        None => {
            let default =
                if kind == Kind::Chat { limits.default_chat_tokens } else { limits.default_completion_tokens };
            default.min(room as u32)
        }
    };
    let temperature = number(&body, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(RouterError::invalid("temperature", "`temperature` must be between 0 and 2"));
    }
    let top_p = number(&body, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(RouterError::invalid("top_p", "`top_p` must be in (0, 1]"));
    }
    let seed = integer(&body, "seed")?.unwrap_or(0);
    let stream = boolean(&body, "stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?,
        Some(_) => return Err(RouterError::invalid("stream_options", "`stream_options` must be an object")),
    };
    Ok(ValidRequest {
        kind,
        model,
        prompt_tokens,
        sampling: pb::SamplingParams {
            temperature: temperature as f32,
            top_k: 0,
            top_p: if top_p < 1.0 { top_p as f32 } else { 0.0 },
            seed,
            max_tokens,
            stop_token_ids: Vec::new(),
            stop: stop_list(&body)?,
            // vLLM's extension: generate exactly max_tokens (benchmarks need fixed lengths).
            ignore_eos: boolean(&body, "ignore_eos")?,
        },
        stream,
        include_usage,
    })
}
