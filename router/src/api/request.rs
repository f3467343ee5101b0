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
        let unknown = inner.strip_prefix("unknown field `").and_then(|rest| rest.split('`').next()).map(str::to_string);
        // An unknown field's path already ends with its name; at the top level it may be ".".
        let param = match (unknown, path.as_str()) {
            (Some(field), "." | "") => field,
            (_, path) => path.to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn param(kind: Kind, body: &str) -> Option<String> {
        match decode(kind, body.as_bytes()) {
            Err(RouterError::InvalidRequest { param, .. }) => param,
            other => panic!("expected an invalid request for {body}, got {other:?}"),
        }
    }

    #[test]
    fn bad_fields_are_named_by_their_path() {
        assert_eq!(
            param(Kind::Chat, r#"{"messages":[{"role":"user","content":"x"},{"role":"robot","content":"y"}]}"#)
                .as_deref(),
            Some("messages[1].role")
        );
        assert_eq!(param(Kind::Completion, r#"{"prompt":"x","temperature":"hot"}"#).as_deref(), Some("temperature"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":"x","frobnicate":1}"#).as_deref(), Some("frobnicate"));
        assert_eq!(
            param(Kind::Completion, r#"{"prompt":"x","stream_options":{"bogus":true}}"#).as_deref(),
            Some("stream_options.bogus")
        );
        assert_eq!(param(Kind::Completion, r#"{"prompt":["a","b"]}"#).as_deref(), Some("prompt"));
        assert_eq!(param(Kind::Completion, r#"{"messages":[]}"#).as_deref(), Some("messages"));
        assert_eq!(param(Kind::Chat, r#"{"prompt":"x"}"#).as_deref(), Some("prompt"));
        assert_eq!(param(Kind::Chat, r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#).as_deref(), Some("n"));
    }

    #[test]
    fn syntax_errors_and_non_objects_are_told_apart() {
        assert!(matches!(decode(Kind::Chat, b"{not json"), Err(RouterError::InvalidRequest { param: None, .. })));
        assert!(matches!(decode(Kind::Chat, b"[1,2]"), Err(RouterError::Unprocessable(_))));
    }

    #[test]
    fn openai_defaults_and_extensions_are_read() {
        let p = decode(Kind::Chat, br#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":7,"stop":"\n","ignore_eos":true,"top_k":3,"user":"u"}"#).expect("valid");
        assert_eq!((p.max_tokens, p.max_tokens_field, p.temperature), (Some(7), "max_completion_tokens", Some(1.0)));
        assert_eq!((p.stop, p.ignore_eos, p.top_k), (vec!["\n".to_string()], true, Some(3)));
        let p =
            decode(Kind::Completion, br#"{"prompt":["one"],"stream":true,"stream_options":{"include_usage":true}}"#)
                .expect("valid");
        assert!(p.stream && p.include_usage);
        assert!(matches!(p.input, Input::Prompt(ref s) if s == "one"));
    }
}
