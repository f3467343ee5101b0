//! OpenAI request bodies. Unknown fields are refused (a typo must not be silently ignored);
//! `user`, `frequency_penalty` and `presence_penalty` are accepted and change nothing.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use crate::error::RouterError;
use crate::validate::{GenerateParams, Input, Kind, Role};

/// `prompt`: one string (a list of one string is accepted too).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    List(Vec<String>),
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    List(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The body of `POST /v1/completions` (`prompt`) and `POST /v1/chat/completions`
/// (`messages`, `max_completion_tokens`): one struct, so both share every field's rules.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiRequest {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub user: Option<IgnoredAny>,
    pub frequency_penalty: Option<IgnoredAny>,
    pub presence_penalty: Option<IgnoredAny>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// Accepted for OpenAI compatibility; not used by the chat template.
    pub name: Option<String>,
}

/// Decodes a body of `kind` into the parameters validation checks. JSON syntax errors are
/// 400, a body that is not an object 422, a bad field 400 naming its path.
pub fn decode(kind: Kind, body: &[u8]) -> Result<GenerateParams, RouterError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| RouterError::InvalidRequest { message: format!("invalid JSON body: {e}"), param: None })?;
    if !value.is_object() {
        return Err(RouterError::Unprocessable("the body must be a JSON object".into()));
    }
    let mut r: OpenAiRequest = typed(value)?;
    let input = match kind {
        Kind::Completion => {
            if r.messages.is_some() || r.max_completion_tokens.is_some() {
                let field = if r.messages.is_some() { "messages" } else { "max_completion_tokens" };
                return Err(RouterError::invalid(field, format!("`{field}` belongs to /v1/chat/completions")));
            }
            let prompt = match r.prompt.take() {
                None => return Err(RouterError::invalid("prompt", "`prompt` is required")),
                Some(Prompt::One(p)) => p,
                Some(Prompt::List(mut list)) if list.len() == 1 => list.remove(0),
                Some(Prompt::List(_)) => {
                    return Err(RouterError::invalid(
                        "prompt",
                        "`prompt` must be one string (batches are not supported)",
                    ))
                }
            };
            Input::Prompt(prompt)
        }
        Kind::Chat => {
            if r.prompt.is_some() {
                return Err(RouterError::invalid(
                    "prompt",
                    "`prompt` belongs to /v1/completions; chat takes `messages`",
                ));
            }
            let messages =
                r.messages.take().ok_or_else(|| RouterError::invalid("messages", "`messages` is required"))?;
            Input::Messages(messages.into_iter().map(|m| (m.role, m.content)).collect())
        }
    };
    params(kind, input, r)
}

/// Deserializes with the path of the failing field (`messages[0].role`) as the error's param.
fn typed<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, RouterError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // An unknown field is reported at its parent; name the field itself.
        let unknown = inner.strip_prefix("unknown field `").and_then(|rest| rest.split('`').next()).map(str::to_string);
        let param = match (unknown, path.as_str()) {
            (Some(field), "." | "") => field,
            (Some(field), parent) => format!("{parent}.{field}"),
            (None, path) => path.to_string(),
        };
        let message = match inner.strip_prefix("unknown field") {
            Some(_) => format!("`{param}` is not supported by this server"),
            None => format!("`{param}`: {inner}"),
        };
        RouterError::InvalidRequest { message, param: Some(param) }
    })
}

fn params(kind: Kind, input: Input, c: OpenAiRequest) -> Result<GenerateParams, RouterError> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(RouterError::invalid("n", "only `n` = 1 is supported"));
    }
    let (max_tokens, max_tokens_field) = match c.max_completion_tokens {
        Some(n) => (Some(n), "max_completion_tokens"),
        None => (c.max_tokens, "max_tokens"),
    };
    let stop = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::List(list)) => list,
    };
    Ok(GenerateParams {
        kind,
        model: c.model,
        input,
        max_tokens,
        max_tokens_field,
        // OpenAI's default temperature is 1.
        temperature: Some(c.temperature.unwrap_or(1.0)),
        top_p: c.top_p,
        top_k: c.top_k,
        seed: c.seed,
        stop,
        stop_token_ids: Vec::new(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
    })
}
