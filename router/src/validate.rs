//! One validation for every front end ("parse, don't validate"): the HTTP API and the gRPC
//! API both turn their wire request into `GenerateParams`, and `validate` checks it, applies
//! the one set of defaults, renders the chat template and tokenizes, giving a `ValidRequest`.
//! Tokenizing is CPU work: callers run `validate` off the async runtime (`spawn_blocking`).

use pd_engine::{ChatMessage, OutputConstraint, SamplingParams, TextSide};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::RouterError;
use crate::tools::{PastCall, ToolFormat, Tools};

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
    /// A tool's answer to a call (`tool_call_id`).
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// A role by name.
    pub fn parse(s: &str) -> Option<Self> {
        [Role::System, Role::User, Role::Assistant, Role::Tool].into_iter().find(|r| r.as_str() == s)
    }
}

/// One chat turn as a front end read it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub role: Role,
    pub content: String,
    /// An assistant turn's calls.
    pub calls: Vec<PastCall>,
    /// A `tool` turn: the call it answers.
    pub call_id: Option<String>,
    /// An assistant turn's reasoning (`reasoning_content`), for templates that read it.
    pub reasoning: Option<String>,
}

impl Turn {
    pub fn new(role: Role, content: &str) -> Self {
        Turn { role, content: content.to_string(), calls: Vec::new(), call_id: None, reasoning: None }
    }

    /// The turn for a template that renders tools itself: calls and call id as fields.
    fn structured(&self) -> ChatMessage {
        let mut m = ChatMessage::new(self.role.as_str(), &self.content);
        if !self.calls.is_empty() {
            m.tool_calls = Some(self.calls.iter().map(PastCall::as_template_json).collect());
        }
        m.tool_call_id = self.call_id.clone();
        m.reasoning_content = self.reasoning.clone();
        m
    }

    /// The turn for a template that does not render calls: calls as text in `format`
    /// (`tools.rs`), tool results as Hermes `<tool_response>` user turns.
    fn as_text(&self, format: ToolFormat) -> ChatMessage {
        if self.role == Role::Tool {
            return ChatMessage::new("user", &crate::tools::response_text(&self.content));
        }
        let mut text = self.content.clone();
        for call in &self.calls {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&crate::tools::call_text(format, &call.name, &call.arguments));
        }
        let mut m = ChatMessage::new(self.role.as_str(), &text);
        m.reasoning_content = self.reasoning.clone();
        m
    }
}

/// The text to generate from.
#[derive(Debug, Clone)]
pub enum Input {
    Prompt(String),
    Messages(Vec<Turn>),
    /// A completion prompt given as token ids.
    Tokens(Vec<u32>),
    /// Several completion prompts (`batch`: each one its own request).
    Batch(Vec<Input>),
}

/// What changes the logits before sampling, and what is reported of them, as a front end read
/// it: OpenAI's penalties, `logit_bias` and log probabilities, vLLM's `repetition_penalty` and
/// `min_tokens`. None is the field's default.
#[derive(Debug, Clone, Default)]
pub struct LogitParams {
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// (token id as the client wrote it, bias).
    pub logit_bias: Vec<(String, f64)>,
    pub min_tokens: Option<u64>,
    /// Alternatives per token; None: no log probabilities.
    pub logprobs: Option<u64>,
    /// The field the number of alternatives came from, for errors.
    pub logprobs_field: &'static str,
}

/// Most `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;

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
    pub logits: LogitParams,
    /// OpenAI's `user`: the caller's end-user id, a label on the request's record.
    pub user: Option<String>,
    /// Structured output, with the field it came from (errors name it).
    pub constraint: Option<(OutputConstraint, &'static str)>,
    /// Chat: the functions the model may call.
    pub tools: Option<Tools>,
    /// Answers to sample from the prompt (None: one), with the field it came from.
    pub n: Option<u64>,
    /// Completions: the prompt comes back before the output (with `logprobs`, scored).
    pub echo: bool,
    /// Chat: further chat template variables (`chat_template_kwargs`).
    pub template_kwargs: Map<String, Value>,
}

/// Prompt text up to this many bytes is validated on the async runtime (`GenerateParams::is_light`).
const LIGHT_TEXT_BYTES: usize = 4096;

impl GenerateParams {
    /// Cheap enough to validate on the async runtime rather than the blocking pool: a short
    /// text and nothing to compile (a schema or tools). Rendering and tokenizing a few hundred
    /// bytes takes tens of microseconds, less than the hand-off to a blocking thread and back
    /// (two thread wake-ups), which the router paid on every request.
    pub fn is_light(&self) -> bool {
        fn text_bytes(input: &Input) -> usize {
            match input {
                Input::Prompt(p) => p.len(),
                Input::Messages(turns) => turns.iter().map(|t| t.content.len() + 64 * t.calls.len()).sum(),
                Input::Tokens(t) => t.len(),
                Input::Batch(all) => all.iter().map(text_bytes).sum(),
            }
        }
        self.constraint.is_none() && self.tools.is_none() && text_bytes(&self.input) <= LIGHT_TEXT_BYTES
    }
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
    pub user: Option<String>,
    /// Tools whose calls are parsed out of the answer (`tool_choice` other than `none`).
    pub tools: Option<std::sync::Arc<Tools>>,
    /// Answers sampled from the prompt (at least 1): one prefill, the prompt's KV shared.
    pub n: usize,
    /// Echo the prompt (and score it, with logprobs): served by a prefill worker alone
    /// (`score`), `max_tokens` 0 or 1, whole (not streamed), one answer.
    pub echo: bool,
    /// A chat answer of a model whose template writes a `<think>` block: where the answer
    /// starts (`reasoning`).
    pub reasoning: Option<crate::reasoning::Start>,
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
    /// Largest `n` accepted.
    pub max_n: u32,
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
    let n = match p.n {
        None => 1,
        Some(0) => return Err(RouterError::invalid("n", "`n` must be at least 1")),
        Some(n) if n > limits.max_n as u64 => {
            return Err(RouterError::invalid("n", format!("`n` is {n}; this server allows at most {}", limits.max_n)))
        }
        Some(n) => n as usize,
    };
    if let Some(tools) = p.tools.as_mut() {
        force_call(tools, &mut p.constraint, text)?;
    }
    let (field, prompt_tokens, reasoning) =
        tokenize(&p.input, p.tools.as_ref().filter(|t| t.active()), &p.template_kwargs, text)?;
    let context = text.max_position;
    if prompt_tokens.len() >= context {
        let message = format!("the prompt has {} tokens; the context length is {context}", prompt_tokens.len());
        return Err(RouterError::invalid(field, message));
    }
    let max_tokens = if p.echo {
        echo_tokens(&p, prompt_tokens.len(), context, limits)?
    } else {
        max_tokens(&p, prompt_tokens.len(), context, limits)?
    };
    let vocab = text.tokenizer.vocab_size();
    let logits = check_logits(&p.logits, vocab, max_tokens)?;
    if let Some(id) = p.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(RouterError::invalid(
            "stop_token_ids",
            format!("token id {id} is outside the vocabulary of {vocab}"),
        ));
    }
    let constraint = match p.constraint.take() {
        None => None,
        Some((c, field)) => {
            // Compiled here so a schema the library cannot take is a 400 naming it, before
            // anything reaches a worker (each worker compiles it again for its sequence).
            let grammars = text.tokenizer.grammars().map_err(|e| RouterError::invalid(field, e.to_string()))?;
            grammars.compile(&c).map_err(|e| RouterError::invalid(field, format!("`{field}`: {e}")))?;
            Some(c)
        }
    };
    let params = SamplingParams {
        constraint,
        temperature: p.temperature.unwrap_or(0.0),
        top_k: p.top_k.map(|k| k as usize),
        top_p: p.top_p.filter(|&t| t < 1.0),
        // A fresh seed per request unless the client fixed one: repeatable with a seed,
        // random without (the seed is on the request's span, so any answer can be replayed).
        seed: p.seed.unwrap_or_else(random_seed),
        max_tokens,
        stop_token_ids: p.stop_token_ids,
        stop_strings: p.stop,
        ignore_eos: p.ignore_eos,
        output_offset: 0,
        ..logits
    };
    let (kind, stream, include_usage, user) = (p.kind, p.stream, p.include_usage, p.user);
    let tools = p.tools.filter(Tools::active).map(std::sync::Arc::new);
    let echo = p.echo;
    // A constrained answer is what its grammar writes: one that the prompt put inside a
    // reasoning block (DeepSeek-R1's template) would otherwise read as all reasoning.
    let reasoning = reasoning.filter(|&s| s == crate::reasoning::Start::Outside || params.constraint.is_none());
    Ok(ValidRequest { kind, model, prompt_tokens, params, stream, include_usage, user, tools, n, echo, reasoning })
}

/// A random sampling seed (the operating system's generator).
fn random_seed() -> u64 {
    let mut bytes = [0u8; 8];
    // The OS generator only fails where no entropy source exists at all; the time then still
    // differs from one request to the next.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return nanos.as_nanos() as u64;
    }
    u64::from_le_bytes(bytes)
}

/// The logit processing and log probabilities as engine parameters (the rest left greedy's
/// defaults), each field checked against OpenAI's ranges and the vocabulary by name.
fn check_logits(l: &LogitParams, vocab: usize, max_tokens: usize) -> Result<SamplingParams, RouterError> {
    let mut params = SamplingParams::greedy(max_tokens);
    for (field, value, target) in [
        ("frequency_penalty", l.frequency_penalty, &mut params.frequency_penalty),
        ("presence_penalty", l.presence_penalty, &mut params.presence_penalty),
    ] {
        match value {
            Some(v) if !(-2.0..=2.0).contains(&v) => {
                return Err(RouterError::invalid(field, format!("`{field}` must be between -2 and 2")))
            }
            Some(v) => *target = v as f32,
            None => {}
        }
    }
    match l.repetition_penalty {
        Some(r) if !(r > 0.0 && r <= 2.0) => {
            return Err(RouterError::invalid("repetition_penalty", "`repetition_penalty` must be in (0, 2]"))
        }
        Some(r) => params.repetition_penalty = r as f32,
        None => {}
    }
    if l.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(RouterError::invalid("logit_bias", format!("`logit_bias` takes at most {MAX_LOGIT_BIAS} tokens")));
    }
    for (key, bias) in &l.logit_bias {
        let id = key.parse::<u32>().ok().filter(|&id| (id as usize) < vocab).ok_or_else(|| {
            RouterError::invalid("logit_bias", format!("`logit_bias` key `{key}` is not a token id below {vocab}"))
        })?;
        if !(-100.0..=100.0).contains(bias) {
            return Err(RouterError::invalid(
                "logit_bias",
                format!("`logit_bias` of `{key}` must be between -100 and 100"),
            ));
        }
        params.logit_bias.push((id, *bias as f32));
    }
    params.logit_bias.sort_by_key(|&(id, _)| id);
    if let Some(m) = l.min_tokens {
        if m > max_tokens as u64 {
            return Err(RouterError::invalid(
                "min_tokens",
                format!("`min_tokens` ({m}) exceeds max_tokens ({max_tokens})"),
            ));
        }
        params.min_tokens = m as usize;
    }
    if let Some(k) = l.logprobs {
        let field = l.logprobs_field;
        if k > pd_engine::MAX_TOP_LOGPROBS as u64 {
            let message = format!("`{field}` must be at most {}", pd_engine::MAX_TOP_LOGPROBS);
            return Err(RouterError::invalid(field, message));
        }
        params.logprobs = Some(k as usize);
    }
    Ok(params)
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

/// The prompt's tokens, the field they came from, and (chat) where a reasoning block starts.
fn tokenize(
    input: &Input,
    tools: Option<&Tools>,
    kwargs: &Map<String, Value>,
    text: &TextSide,
) -> Result<(&'static str, Vec<u32>, Option<crate::reasoning::Start>), RouterError> {
    let mut reasoning = None;
    let (field, prompt) = match input {
        Input::Prompt(p) if p.is_empty() => return Err(RouterError::invalid("prompt", "`prompt` must not be empty")),
        Input::Prompt(p) => ("prompt", p.clone()),
        Input::Messages(m) if m.is_empty() => {
            return Err(RouterError::invalid("messages", "`messages` must not be empty"))
        }
        Input::Batch(_) => {
            return Err(RouterError::invalid("prompt", "a list of prompts is answered prompt by prompt"))
        }
        Input::Tokens(ids) => {
            let vocab = text.tokenizer.vocab_size();
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                let message = format!("token id {id} is outside the vocabulary of {vocab}");
                return Err(RouterError::invalid(&format!("prompt[{i}]"), message));
            }
            return Ok(("prompt", ids.clone(), None));
        }
        Input::Messages(messages) => {
            let prompt = render_chat(messages, tools, kwargs, text, true)?;
            let source = text.chat_template.as_ref().map_or("", |t| t.source());
            reasoning = crate::reasoning::Start::of(source, &prompt);
            ("messages", prompt)
        }
    };
    // A raw prompt starts with BOS where the model's texts do (Llama, Gemma, Mistral), as
    // transformers and llama.cpp tokenize it; a rendered chat has its template's own.
    let tokens = match field {
        "prompt" => text.tokenizer.encode_prompt(&prompt),
        _ => text.tokenizer.encode(&prompt),
    };
    let tokens = tokens.map_err(|e| RouterError::invalid(field, e.to_string()))?;
    if tokens.is_empty() {
        return Err(RouterError::invalid(field, format!("`{field}` gives no tokens")));
    }
    Ok((field, tokens, reasoning))
}

/// Chat messages (and tools) through the model's template (`generation_prompt`: ending with
/// the opening of the assistant's turn). A template that renders tools itself gets them, the
/// earlier calls and the tool results as its variables; one that does not gets the Hermes
/// tool prompt in the system message, calls as `<tool_call>` text and `tool` turns as
/// `<tool_response>` user turns (`tools.rs`). `kwargs`: further template variables
/// (`chat_template_kwargs`).
pub fn render_chat(
    messages: &[Turn],
    tools: Option<&Tools>,
    kwargs: &Map<String, Value>,
    text: &TextSide,
    generation_prompt: bool,
) -> Result<String, RouterError> {
    let template = text
        .chat_template
        .as_ref()
        .ok_or_else(|| RouterError::invalid("messages", "the model has no chat template"))?;
    let native = template.uses_tools();
    let format = ToolFormat::of_template(template.source(), native, template.system_tools());
    let mut turns: Vec<ChatMessage> =
        messages.iter().map(|t| if native { t.structured() } else { t.as_text(format) }).collect();
    let listed = tools.map(Tools::as_json);
    if let (Some(tools), false) = (tools, native) {
        let system = turns.first_mut().filter(|m| m.role == "system");
        match (system, format) {
            (Some(system), ToolFormat::Phi4Mini) => system.tools = Some(tools.system_field()),
            (None, ToolFormat::Phi4Mini) => {
                let mut system = ChatMessage::new("system", crate::tools::SYSTEM_WITH_TOOLS);
                system.tools = Some(tools.system_field());
                turns.insert(0, system);
            }
            (Some(system), _) => system.content = format!("{}\n\n{}", system.content, tools.system_prompt()),
            (None, _) => turns.insert(0, ChatMessage::new("system", &tools.system_prompt())),
        }
    }
    template
        .render_with_kwargs(&turns, listed.as_deref().filter(|_| native), generation_prompt, kwargs)
        .map_err(|e| RouterError::invalid("messages", e.to_string()))
}

/// Sets the tools' format from the model's chat template and, for `required` or a named
/// function, makes the call the output's constraint (in that format).
fn force_call(
    tools: &mut Tools,
    constraint: &mut Option<(OutputConstraint, &'static str)>,
    text: &TextSide,
) -> Result<(), RouterError> {
    if let Some(template) = &text.chat_template {
        tools.format = ToolFormat::of_template(template.source(), template.uses_tools(), template.system_tools());
    }
    if let Some(forced) = tools.constraint() {
        if let Some((_, field)) = constraint {
            return Err(RouterError::invalid(
                field,
                format!("`{field}` and a required tool call cannot both constrain the output"),
            ));
        }
        *constraint = Some((forced, "tools"));
    }
    Ok(())
}

/// `max_tokens` of an echo request: 0 by default (the prompt scored, nothing generated: one
/// whole answer with nothing to constrain), else as for any completion (the generation
/// follows the echoed prompt).
fn echo_tokens(p: &GenerateParams, prompt: usize, context: usize, limits: &Limits) -> Result<usize, RouterError> {
    if p.max_tokens.is_some_and(|m| m > 0) {
        return max_tokens(p, prompt, context, limits);
    }
    let refuse =
        |field: &str, why: &str| Err(RouterError::invalid(field, format!("with `echo` and `max_tokens` 0, {why}")));
    if p.stream {
        return refuse("stream", "the answer comes whole: `stream` must be false");
    }
    if p.n.is_some_and(|n| n > 1) {
        return refuse("n", "one answer only (`n` 1)");
    }
    if let Some((_, field)) = &p.constraint {
        return refuse(field, "nothing is generated to constrain");
    }
    Ok(0)
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
