//! OpenAI request bodies. Unknown fields are refused (a typo must not be silently ignored),
//! and so is every known field this server cannot honour (`best_of`, `suffix`, ...): nothing
//! is accepted and then ignored. `user` is kept as a label on the request's record.

use serde::Deserialize;
use serde_json::Value;

use crate::error::RouterError;
use crate::validate::{GenerateParams, Input, Kind, LogitParams, Role, Turn};
use pd_engine::OutputConstraint;

use crate::tools::{check_name, Function, PastCall, ToolChoice, Tools};

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
    /// A string, a list of token ids, or a list of one of either (read by `prompt_input`).
    pub prompt: Option<Value>,
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
    pub user: Option<String>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    /// vLLM's extension (1 = off).
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string key) -> bias added to its logit.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// vLLM's extension: no end token before this many output tokens.
    pub min_tokens: Option<u64>,
    /// Chat: a bool (with `top_logprobs` alternatives); completions: the number of
    /// alternatives.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u64>,
    /// Completions only; only `false` is served.
    pub echo: Option<bool>,
    /// OpenAI's structured output: `text`, `json_object` or `json_schema`.
    pub response_format: Option<ResponseFormat>,
    /// vLLM's structured-output extensions: a JSON schema (object or JSON text), a regex, a
    /// Lark grammar, or a list of choices.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    /// Chat only: functions the model may call, and how.
    pub tools: Option<Vec<ToolSpec>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Chat only (vLLM's and SGLang's extension): further variables for the chat template,
    /// as transformers' `apply_chat_template(**kwargs)` takes them (`enable_thinking`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// `response_format`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: String,
    pub description: Option<String>,
    pub schema: Option<Value>,
    /// Accepted: the schema is always enforced token by token, strict or not.
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    /// A string or a list of `text` parts; null in an assistant turn that only calls tools.
    pub content: Option<Value>,
    /// Accepted for OpenAI compatibility; not used by the chat template.
    pub name: Option<String>,
    /// An assistant turn's calls (rendered back into the prompt as the model wrote them).
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A `tool` message answers this call.
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, as this server returned it (`reasoning_content`):
    /// passed to templates that read it (Qwen3's keeps it after the last user turn).
    pub reasoning_content: Option<String>,
}

/// A tool call in an earlier assistant turn.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallIn {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

/// `tools[i]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionSpec,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionSpec {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    /// Accepted: a required or named call's arguments always follow the schema.
    pub strict: Option<bool>,
}

impl Message {
    /// The message as one turn (text parts joined), checked for what its role needs.
    pub fn turn(self, i: usize) -> Result<Turn, RouterError> {
        let field = |f: &str| format!("messages[{i}].{f}");
        let text = match self.content {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(Value::Array(parts)) => {
                let mut joined = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part["type"].as_str(), part["text"].as_str()) {
                        (Some("text"), Some(t)) => joined.push_str(t),
                        _ => {
                            return Err(RouterError::invalid(
                                &field(&format!("content[{j}]")),
                                "only `text` content parts are supported",
                            ))
                        }
                    }
                }
                Some(joined)
            }
            Some(_) => return Err(RouterError::invalid(&field("content"), "`content` must be a string or text parts")),
        };
        let calls = self.tool_calls.unwrap_or_default();
        if !calls.is_empty() && self.role != Role::Assistant {
            return Err(RouterError::invalid(&field("tool_calls"), "only assistant messages carry `tool_calls`"));
        }
        for (j, call) in calls.iter().enumerate() {
            let f = field(&format!("tool_calls[{j}]"));
            if call.kind.as_deref().is_some_and(|k| k != "function") {
                return Err(RouterError::invalid(&format!("{f}.type"), "the only tool type is `function`"));
            }
            crate::tools::check_name(&call.function.name, &format!("{f}.function.name"))?;
            if serde_json::from_str::<Value>(&call.function.arguments).is_err() {
                return Err(RouterError::invalid(&format!("{f}.function.arguments"), "`arguments` must be JSON text"));
            }
        }
        if self.role == Role::Tool && self.tool_call_id.is_none() {
            return Err(RouterError::invalid(&field("tool_call_id"), "a `tool` message needs `tool_call_id`"));
        }
        let content = match text {
            Some(t) => t,
            None if !calls.is_empty() => String::new(),
            None => return Err(RouterError::invalid(&field("content"), "`content` is required")),
        };
        let calls = calls
            .into_iter()
            .map(|c| PastCall { id: c.id, name: c.function.name, arguments: c.function.arguments })
            .collect();
        if self.reasoning_content.is_some() && self.role != Role::Assistant {
            return Err(RouterError::invalid(&field("reasoning_content"), "only assistant messages carry reasoning"));
        }
        Ok(Turn { role: self.role, content, calls, call_id: self.tool_call_id, reasoning: self.reasoning_content })
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls` as the request's tools (None without
/// tools); a choice naming an unknown function is refused.
pub(crate) fn tools(
    specs: Option<Vec<ToolSpec>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, RouterError> {
    if specs.as_ref().is_some_and(Vec::is_empty) {
        return Err(RouterError::invalid("tools", "`tools` must list at least one function"));
    }
    let specs = specs.unwrap_or_default();
    if specs.is_empty() {
        return match choice {
            None => Ok(None),
            Some(Value::String(s)) if s == "none" => Ok(None),
            Some(_) => Err(RouterError::invalid("tool_choice", "`tool_choice` needs `tools`")),
        };
    }
    let mut functions = Vec::with_capacity(specs.len());
    for (i, spec) in specs.into_iter().enumerate() {
        if spec.kind != "function" {
            return Err(RouterError::invalid(&format!("tools[{i}].type"), "the only tool type is `function`"));
        }
        let f = spec.function;
        check_name(&f.name, &format!("tools[{i}].function.name"))?;
        if functions.iter().any(|g: &Function| g.name == f.name) {
            return Err(RouterError::invalid(
                &format!("tools[{i}].function.name"),
                format!("`{}` is listed twice", f.name),
            ));
        }
        let parameters = f.parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
        if !parameters.is_object() {
            return Err(RouterError::invalid(
                &format!("tools[{i}].function.parameters"),
                "`parameters` must be a JSON schema object",
            ));
        }
        functions.push(Function { name: f.name, description: f.description, parameters });
    }
    let choice = match choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(RouterError::invalid(
                    "tool_choice",
                    format!("`tool_choice` `{other}` is not none, auto or required"),
                ))
            }
        },
        Some(v) => {
            let name = v["function"]["name"].as_str().filter(|_| v["type"] == "function").ok_or_else(|| {
                RouterError::invalid("tool_choice", "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
            })?;
            if !functions.iter().any(|f| f.name == name) {
                return Err(RouterError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not in `tools`"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
    };
    Ok(Some(Tools { functions, choice, parallel: parallel.unwrap_or(false), format: Default::default() }))
}

/// Decodes a JSON object body into `T`: syntax errors are 400, a body that is not an object
/// 422, a bad field 400 naming its path.
pub fn decode_object<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, RouterError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| RouterError::InvalidRequest { message: format!("invalid JSON body: {e}"), param: None })?;
    if !value.is_object() {
        return Err(RouterError::Unprocessable("the body must be a JSON object".into()));
    }
    typed(value)
}

/// Decodes a body of `kind` into the parameters validation checks.
pub fn decode(kind: Kind, body: &[u8]) -> Result<GenerateParams, RouterError> {
    let mut r: OpenAiRequest = decode_object(body)?;
    let input = match kind {
        Kind::Completion => {
            if r.messages.is_some() || r.max_completion_tokens.is_some() || r.chat_template_kwargs.is_some() {
                let field = if r.messages.is_some() {
                    "messages"
                } else if r.max_completion_tokens.is_some() {
                    "max_completion_tokens"
                } else {
                    "chat_template_kwargs"
                };
                return Err(RouterError::invalid(field, format!("`{field}` belongs to /v1/chat/completions")));
            }
            if r.top_logprobs.is_some() {
                return Err(RouterError::invalid(
                    "top_logprobs",
                    "`top_logprobs` belongs to /v1/chat/completions; completions take `logprobs`: N",
                ));
            }
            prompt_input(r.prompt.take().ok_or_else(|| RouterError::invalid("prompt", "`prompt` is required"))?)?
        }
        Kind::Chat => {
            if r.prompt.is_some() || r.echo.is_some() {
                let field = if r.prompt.is_some() { "prompt" } else { "echo" };
                return Err(RouterError::invalid(
                    field,
                    format!("`{field}` belongs to /v1/completions; chat takes `messages`"),
                ));
            }
            let messages =
                r.messages.take().ok_or_else(|| RouterError::invalid("messages", "`messages` is required"))?;
            let turns = messages.into_iter().enumerate().map(|(i, m)| m.turn(i));
            Input::Messages(turns.collect::<Result<_, _>>()?)
        }
    };
    params(kind, input, r)
}

/// A completion's `prompt`: a string, a list of token ids, or a list of either (several of
/// them: a batch, answered prompt by prompt, `crate::batch`).
fn prompt_input(prompt: Value) -> Result<Input, RouterError> {
    let shape = "`prompt` must be a string, a list of token ids, or a list of either";
    match prompt {
        Value::String(s) => Ok(Input::Prompt(s)),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => token_ids(&items, "prompt"),
        Value::Array(mut items) if items.len() == 1 => match items.remove(0) {
            Value::String(s) => Ok(Input::Prompt(s)),
            Value::Array(ids) if ids.iter().all(Value::is_number) => token_ids(&ids, "prompt[0]"),
            _ => Err(RouterError::invalid("prompt", shape)),
        },
        Value::Array(items) if items.len() > crate::batch::MAX_PROMPTS => Err(RouterError::invalid(
            "prompt",
            format!("{} prompts; at most {} in one request", items.len(), crate::batch::MAX_PROMPTS),
        )),
        Value::Array(items) if items.len() > 1 && items.iter().all(|i| i.is_string() || i.is_array()) => {
            let prompts = items.into_iter().enumerate().map(|(i, item)| match item {
                Value::String(s) => Ok(Input::Prompt(s)),
                Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_number) => {
                    token_ids(&ids, &format!("prompt[{i}]"))
                }
                _ => Err(RouterError::invalid(&format!("prompt[{i}]"), shape)),
            });
            Ok(Input::Batch(prompts.collect::<Result<_, _>>()?))
        }
        _ => Err(RouterError::invalid("prompt", shape)),
    }
}

/// Token ids as u32 (their range against the vocabulary is checked in validation).
fn token_ids(items: &[Value], field: &str) -> Result<Input, RouterError> {
    let ids = items.iter().enumerate().map(|(i, v)| {
        v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
            RouterError::invalid(&format!("{field}[{i}]"), format!("`{field}[{i}]` is {v}, not a token id"))
        })
    });
    Ok(Input::Tokens(ids.collect::<Result<_, _>>()?))
}

/// Chat's `logprobs` (bool) + `top_logprobs`, or a completion's `logprobs` (a count): the
/// number of alternatives per token, or None for no log probabilities.
fn logprobs(kind: Kind, logprobs: Option<Value>, top: Option<u64>) -> Result<Option<u64>, RouterError> {
    match (kind, logprobs.filter(|v| !v.is_null())) {
        (Kind::Chat, None | Some(Value::Bool(false))) if top.is_some_and(|k| k > 0) => {
            Err(RouterError::invalid("top_logprobs", "`top_logprobs` needs `logprobs`: true"))
        }
        (Kind::Chat, None | Some(Value::Bool(false))) => Ok(None),
        (Kind::Chat, Some(Value::Bool(true))) => Ok(Some(top.unwrap_or(0))),
        (Kind::Chat, Some(_)) => Err(RouterError::invalid("logprobs", "`logprobs` must be true or false in chat")),
        (Kind::Completion, None) => Ok(None),
        (Kind::Completion, Some(v)) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| RouterError::invalid("logprobs", "`logprobs` must be a number of alternatives (0 to 20)")),
    }
}

/// `logit_bias` as (key as sent, bias) pairs; keys and ranges are checked in validation.
fn logit_bias(map: Option<serde_json::Map<String, Value>>) -> Result<Vec<(String, f64)>, RouterError> {
    let entries = map.into_iter().flatten().map(|(key, v)| match v.as_f64() {
        Some(b) => Ok((key, b)),
        None => Err(RouterError::invalid("logit_bias", format!("`logit_bias` of `{key}` must be a number, not {v}"))),
    });
    entries.collect()
}

/// The one output constraint a request asks for (at most one of `response_format` other
/// than `text` and vLLM's `guided_*` fields), with the field it came from.
fn constraint(c: &mut OpenAiRequest) -> Result<Option<(OutputConstraint, &'static str)>, RouterError> {
    let mut found: Vec<(OutputConstraint, &'static str)> = Vec::new();
    match c.response_format.take() {
        None | Some(ResponseFormat::Text) => {}
        Some(ResponseFormat::JsonObject) => found.push((OutputConstraint::JsonObject, "response_format")),
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let schema = json_schema.schema.ok_or_else(|| {
                RouterError::invalid("response_format.json_schema.schema", "`json_schema.schema` is required")
            })?;
            found.push((OutputConstraint::JsonSchema(schema.to_string()), "response_format.json_schema.schema"));
        }
    }
    if let Some(schema) = c.guided_json.take() {
        let text = match schema {
            Value::String(s) => s,
            other => other.to_string(),
        };
        found.push((OutputConstraint::JsonSchema(text), "guided_json"));
    }
    if let Some(rx) = c.guided_regex.take() {
        found.push((OutputConstraint::Regex(rx), "guided_regex"));
    }
    if let Some(lark) = c.guided_grammar.take() {
        found.push((OutputConstraint::Lark(lark), "guided_grammar"));
    }
    if let Some(choices) = c.guided_choice.take() {
        if choices.is_empty() || choices.iter().any(String::is_empty) {
            return Err(RouterError::invalid("guided_choice", "`guided_choice` needs non-empty choices"));
        }
        let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
        found.push((OutputConstraint::Regex(format!("({})", alternatives.join("|"))), "guided_choice"));
    }
    if found.len() > 1 {
        let fields: Vec<&str> = found.iter().map(|(_, f)| *f).collect();
        return Err(RouterError::invalid(
            fields[1],
            format!("set one output constraint, not {}", fields.join(" and ")),
        ));
    }
    Ok(found.pop())
}

/// `text` as a regex matching itself.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out
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

fn params(kind: Kind, input: Input, mut c: OpenAiRequest) -> Result<GenerateParams, RouterError> {
    if kind == Kind::Completion && (c.tools.is_some() || c.tool_choice.is_some()) {
        let field = if c.tools.is_some() { "tools" } else { "tool_choice" };
        return Err(RouterError::invalid(field, format!("`{field}` belongs to /v1/chat/completions")));
    }
    let tools = tools(c.tools.take(), c.tool_choice.take(), c.parallel_tool_calls)?;
    let constraint = constraint(&mut c)?;
    let logits = LogitParams {
        frequency_penalty: c.frequency_penalty,
        presence_penalty: c.presence_penalty,
        repetition_penalty: c.repetition_penalty,
        logit_bias: logit_bias(c.logit_bias)?,
        min_tokens: c.min_tokens,
        logprobs: logprobs(kind, c.logprobs, c.top_logprobs)?,
        logprobs_field: if kind == Kind::Chat { "top_logprobs" } else { "logprobs" },
    };
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
        logits,
        user: c.user,
        constraint,
        tools,
        n: c.n,
        echo: c.echo.unwrap_or(false),
        template_kwargs: template_kwargs(c.chat_template_kwargs, "chat_template_kwargs")?,
    })
}

/// Template arguments (`chat_template_kwargs`, read from `field`), refused by name where
/// they would set a variable the router sets itself.
pub fn template_kwargs(
    kwargs: Option<serde_json::Map<String, Value>>,
    field: &str,
) -> Result<serde_json::Map<String, Value>, RouterError> {
    let kwargs = kwargs.unwrap_or_default();
    if let Some(name) = kwargs.keys().find(|k| pd_engine::RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str())) {
        let why = format!("`{name}` is set by the server from the request; it cannot be a template argument");
        return Err(RouterError::invalid(&format!("{field}.{name}"), why));
    }
    Ok(kwargs)
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
    fn chat_template_kwargs_are_chats_and_may_not_set_what_the_router_sets() {
        let chat = r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":false}}"#;
        let p = decode(Kind::Chat, chat.as_bytes()).expect("accepted");
        assert_eq!(p.template_kwargs.get("enable_thinking"), Some(&Value::Bool(false)));
        let reserved = r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"messages":[]}}"#;
        assert_eq!(param(Kind::Chat, reserved).as_deref(), Some("chat_template_kwargs.messages"));
        let completion = r#"{"prompt":"x","chat_template_kwargs":{"enable_thinking":false}}"#;
        assert_eq!(param(Kind::Completion, completion).as_deref(), Some("chat_template_kwargs"));
        let not_an_object = r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]}"#;
        assert_eq!(param(Kind::Chat, not_an_object).as_deref(), Some("chat_template_kwargs"));
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
        assert_eq!(param(Kind::Completion, r#"{"prompt":["a",[]]}"#).as_deref(), Some("prompt[1]"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":[[1],[2,-1]]}"#).as_deref(), Some("prompt[1][1]"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":[1,-2]}"#).as_deref(), Some("prompt[1]"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":[[1,4294967296]]}"#).as_deref(), Some("prompt[0][1]"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":[]}"#).as_deref(), Some("prompt"));
        assert_eq!(param(Kind::Chat, r#"{"messages":[],"echo":true}"#).as_deref(), Some("echo"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":"x","logprobs":true}"#).as_deref(), Some("logprobs"));
        assert_eq!(param(Kind::Completion, r#"{"prompt":"x","top_logprobs":2}"#).as_deref(), Some("top_logprobs"));
        assert_eq!(param(Kind::Chat, r#"{"messages":[],"top_logprobs":2}"#).as_deref(), Some("top_logprobs"));
        assert_eq!(param(Kind::Chat, r#"{"messages":[],"logprobs":3}"#).as_deref(), Some("logprobs"));
        assert_eq!(param(Kind::Chat, r#"{"messages":[],"logit_bias":{"5":"x"}}"#).as_deref(), Some("logit_bias"));
        assert_eq!(
            param(Kind::Chat, r#"{"messages":[],"frequency_penalty":"x"}"#).as_deref(),
            Some("frequency_penalty")
        );
        assert_eq!(param(Kind::Completion, r#"{"messages":[]}"#).as_deref(), Some("messages"));
        assert_eq!(param(Kind::Chat, r#"{"prompt":"x"}"#).as_deref(), Some("prompt"));
        assert_eq!(
            param(Kind::Chat, r#"{"messages":[{"role":"user","content":"x"}],"n":"two"}"#).as_deref(),
            Some("n")
        );
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
        let p = decode(Kind::Completion, br#"{"prompt":["a",[5]]}"#).expect("a batch");
        assert!(matches!(&p.input, Input::Batch(b) if matches!(b.as_slice(), [Input::Prompt(_), Input::Tokens(_)])));
        for body in [r#"{"prompt":[5,6,7]}"#, r#"{"prompt":[[5,6,7]]}"#] {
            let p = decode(Kind::Completion, body.as_bytes()).expect("token ids");
            assert!(matches!(p.input, Input::Tokens(ref ids) if ids == &[5, 6, 7]), "{body}");
        }
    }

    #[test]
    fn penalties_biases_and_logprobs_are_read_in_each_shape() {
        let body = br#"{"messages":[{"role":"user","content":"x"}],"frequency_penalty":0.5,"presence_penalty":-1,
            "repetition_penalty":1.2,"logit_bias":{"42":-100,"7":3.5},"min_tokens":2,"logprobs":true,"top_logprobs":5}"#;
        let l = decode(Kind::Chat, body).expect("valid").logits;
        assert_eq!((l.frequency_penalty, l.presence_penalty, l.repetition_penalty), (Some(0.5), Some(-1.0), Some(1.2)));
        let mut bias = l.logit_bias.clone();
        bias.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(bias, vec![("42".to_string(), -100.0), ("7".to_string(), 3.5)]);
        assert_eq!((l.min_tokens, l.logprobs), (Some(2), Some(5)));
        let chat_plain = decode(Kind::Chat, br#"{"messages":[{"role":"user","content":"x"}],"logprobs":true}"#);
        assert_eq!(chat_plain.expect("valid").logits.logprobs, Some(0));
        let completion = decode(Kind::Completion, br#"{"prompt":"x","logprobs":3,"echo":false}"#).expect("valid");
        assert_eq!(completion.logits.logprobs, Some(3));
        assert_eq!(decode(Kind::Completion, br#"{"prompt":"x"}"#).expect("valid").logits.logprobs, None);
    }
}
