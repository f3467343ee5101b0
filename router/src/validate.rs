//! One validation for every front end ("parse, don't validate"): the HTTP API and the gRPC
//! API both turn their wire request into `GenerateParams`, and `validate` checks it, applies
//! the one set of defaults, renders the chat template and tokenizes, giving a `ValidRequest`.
//! Tokenizing is CPU work: callers run `validate` off the async runtime (`spawn_blocking`).

use pd_engine::{ChatMessage, SamplingParams, TextSide};
use serde::Deserialize;

use crate::error::RouterError;

/// Which API shape a request came in (and which defaults apply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// A chat message's author.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Role::System, Role::User, Role::Assistant].into_iter().find(|r| r.as_str() == s)
    }
}

/// The text to generate from.
#[derive(Debug, Clone)]
pub enum Input {
    Prompt(String),
    Messages(Vec<(Role, String)>),
}

/// A request as a front end decoded it, before any check.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub kind: Kind,
    pub model: Option<String>,
    pub input: Input,
    pub max_tokens: Option<u64>,
    /// The field `max_tokens` came from, for error messages.
    pub max_tokens_field: &'static str,
    /// None = greedy (0).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
}

/// A request the cluster can run.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub kind: Kind,
    pub model: String,
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
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

/// Most stop sequences per request (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// Checks `p` against the served model and the limits, renders and tokenizes it.
pub fn validate(
    mut p: GenerateParams,
    text: &TextSide,
    served_model: &str,
    limits: &Limits,
) -> Result<ValidRequest, RouterError> {
    let model = match p.model.take() {
        None => served_model.to_string(),
        Some(m) if m.is_empty() || m == served_model => served_model.to_string(),
        Some(m) => return Err(RouterError::ModelNotFound(m)),
    };
    check_sampling(&p)?;
    let (field, prompt_tokens) = tokenize(&p.input, text)?;
    let context = text.max_position;
    if prompt_tokens.len() >= context {
        let message = format!("the prompt has {} tokens; the context length is {context}", prompt_tokens.len());
        return Err(RouterError::invalid(field, message));
    }
    let max_tokens = max_tokens(&p, prompt_tokens.len(), context, limits)?;
    let params = SamplingParams {
        temperature: p.temperature.unwrap_or(0.0),
        top_k: p.top_k.map(|k| k as usize),
        top_p: p.top_p.filter(|&t| t < 1.0),
        seed: p.seed.unwrap_or(0),
        max_tokens,
        stop_token_ids: p.stop_token_ids,
        stop_strings: p.stop,
        ignore_eos: p.ignore_eos,
        output_offset: 0,
    };
    Ok(ValidRequest { kind: p.kind, model, prompt_tokens, params, stream: p.stream, include_usage: p.include_usage })
}

fn check_sampling(p: &GenerateParams) -> Result<(), RouterError> {
    if let Some(t) = p.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(RouterError::invalid("temperature", "`temperature` must be between 0 and 2"));
        }
    }
    if let Some(top_p) = p.top_p {
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(RouterError::invalid("top_p", "`top_p` must be in (0, 1]"));
        }
    }
    if p.top_k == Some(0) {
        return Err(RouterError::invalid("top_k", "`top_k` must be at least 1"));
    }
    if p.stop.len() > MAX_STOP {
        return Err(RouterError::invalid("stop", format!("`stop` takes at most {MAX_STOP} sequences")));
    }
    if p.stop.iter().any(String::is_empty) {
        return Err(RouterError::invalid("stop", "`stop` sequences must not be empty"));
    }
    Ok(())
}

/// The prompt's tokens, and the field they came from.
fn tokenize(input: &Input, text: &TextSide) -> Result<(&'static str, Vec<u32>), RouterError> {
    let (field, prompt) = match input {
        Input::Prompt(p) if p.is_empty() => return Err(RouterError::invalid("prompt", "`prompt` must not be empty")),
        Input::Prompt(p) => ("prompt", p.clone()),
        Input::Messages(m) if m.is_empty() => {
            return Err(RouterError::invalid("messages", "`messages` must not be empty"))
        }
        Input::Messages(messages) => {
            let template = text
                .chat_template
                .as_ref()
                .ok_or_else(|| RouterError::invalid("messages", "the model has no chat template"))?;
            let messages: Vec<ChatMessage> = messages.iter().map(|(r, c)| ChatMessage::new(r.as_str(), c)).collect();
            let prompt =
                template.render(&messages, true).map_err(|e| RouterError::invalid("messages", e.to_string()))?;
            ("messages", prompt)
        }
    };
    let tokens = text.tokenizer.encode(&prompt).map_err(|e| RouterError::invalid(field, e.to_string()))?;
    if tokens.is_empty() {
        return Err(RouterError::invalid(field, format!("`{field}` gives no tokens")));
    }
    Ok((field, tokens))
}

/// `max_tokens` as given (checked against the limit and the context left), or the kind's
/// default capped at the context left.
fn max_tokens(p: &GenerateParams, prompt: usize, context: usize, limits: &Limits) -> Result<usize, RouterError> {
    let field = p.max_tokens_field;
    let room = (context - prompt) as u64;
    match p.max_tokens {
        Some(0) => Err(RouterError::invalid(field, format!("`{field}` must be at least 1"))),
        Some(n) if n > limits.max_tokens as u64 => Err(RouterError::invalid(
            field,
            format!("`{field}` is {n}; this server allows at most {}", limits.max_tokens),
        )),
        Some(n) if n > room => Err(RouterError::invalid(
            field,
            format!("prompt ({prompt} tokens) + `{field}` ({n}) exceed the context length of {context}"),
        )),
        Some(n) => Ok(n as usize),
        None => {
            let default =
                if p.kind == Kind::Chat { limits.default_chat_tokens } else { limits.default_completion_tokens };
            Ok(default.min(room as u32) as usize)
        }
    }
}

#[cfg(test)]
mod tests;
