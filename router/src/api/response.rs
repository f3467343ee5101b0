//! OpenAI response bodies: whole completions, stream chunks, usage and errors.

use serde::Serialize;

use crate::api::logprobs::Logprobs;
use crate::validate::Kind;

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt: how much of it a prefix cache served.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// Null when the answer is only tool calls.
    pub content: Option<String>,
    /// A thinking model's `<think>` block (`crate::reasoning`), as vLLM and SGLang return it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One call in `message.tool_calls`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The calls of one answer, each with a fresh id.
    pub fn all(calls: Vec<crate::tools::ParsedCall>) -> Vec<ToolCall> {
        let call = |c: crate::tools::ParsedCall| ToolCall {
            id: format!("call_{}", uuid::Uuid::now_v7().simple()),
            kind: "function",
            function: FunctionCall { name: c.name, arguments: c.arguments },
        };
        calls.into_iter().map(call).collect()
    }
}

/// A piece of a call in a stream's `delta.tool_calls`: the first names the call (id, type,
/// name, empty arguments), the next ones add to its arguments.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

impl ToolCallDelta {
    /// The delta of a stream's piece of a call (None for content).
    pub fn of(piece: crate::tools::Piece) -> Option<Self> {
        match piece {
            crate::tools::Piece::Content(_) => None,
            crate::tools::Piece::Call { index, id, name } => Some(ToolCallDelta {
                index,
                id: Some(id),
                kind: Some("function"),
                function: FunctionDelta { name: Some(name), arguments: String::new() },
            }),
            crate::tools::Piece::Arguments { index, text } => Some(ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: FunctionDelta { name: None, arguments: text },
            }),
        }
    }
}

/// One choice of a whole response.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Choice {
    Text { index: u32, text: String, finish_reason: String, logprobs: Option<Logprobs> },
    Message { index: u32, message: AssistantMessage, finish_reason: String, logprobs: Option<Logprobs> },
}

/// A whole (non-streamed) response.
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a stream chunk.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum ChunkChoice {
    Text {
        index: u32,
        text: String,
        finish_reason: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        logprobs: Option<Logprobs>,
    },
    Delta {
        index: u32,
        delta: Delta,
        finish_reason: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        logprobs: Option<Logprobs>,
    },
}

/// One server-sent event's data.
#[derive(Debug, Clone, Serialize)]
pub struct Chunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// OpenAI's `object` names.
pub fn object_name(kind: Kind, stream: bool) -> &'static str {
    match (kind, stream) {
        (Kind::Completion, _) => "text_completion",
        (Kind::Chat, false) => "chat.completion",
        (Kind::Chat, true) => "chat.completion.chunk",
    }
}

impl Choice {
    /// This choice as answer `i` of several.
    pub fn at(mut self, i: u32) -> Self {
        match &mut self {
            Choice::Text { index, .. } | Choice::Message { index, .. } => *index = i,
        }
        self
    }

    /// A chat answer that called tools: the text before the calls (if any) and the calls.
    pub fn with_tool_calls(content: String, calls: Vec<ToolCall>, logprobs: Option<Logprobs>) -> Self {
        let content = Some(content).filter(|c| !c.trim().is_empty());
        let message = AssistantMessage { role: "assistant", content, reasoning_content: None, tool_calls: Some(calls) };
        Choice::Message { index: 0, message, finish_reason: "tool_calls".into(), logprobs }
    }

    /// This chat choice with the answer's reasoning block.
    pub fn with_reasoning(mut self, reasoning: Option<String>) -> Self {
        if let Choice::Message { message, .. } = &mut self {
            message.reasoning_content = reasoning;
        }
        self
    }

    /// The one choice of a finished generation.
    pub fn of(kind: Kind, text: String, finish_reason: String, logprobs: Option<Logprobs>) -> Self {
        match kind {
            Kind::Completion => Choice::Text { index: 0, text, finish_reason, logprobs },
            Kind::Chat => Choice::Message {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: Some(text),
                    reasoning_content: None,
                    tool_calls: None,
                },
                finish_reason,
                logprobs,
            },
        }
    }
}

impl ChunkChoice {
    /// This chunk choice as answer `i` of several.
    pub fn at(mut self, i: u32) -> Self {
        match &mut self {
            ChunkChoice::Text { index, .. } | ChunkChoice::Delta { index, .. } => *index = i,
        }
        self
    }

    /// A chunk carrying `text` (and its token's log probabilities, when asked); the first chat
    /// chunk also names the role.
    pub fn token(kind: Kind, text: String, first: bool, logprobs: Option<Logprobs>) -> Self {
        match kind {
            Kind::Completion => ChunkChoice::Text { index: 0, text, finish_reason: None, logprobs },
            Kind::Chat => ChunkChoice::Delta {
                index: 0,
                delta: Delta { role: first.then_some("assistant"), content: Some(text), ..Delta::default() },
                finish_reason: None,
                logprobs,
            },
        }
    }

    /// A chat chunk carrying a piece of a tool call.
    pub fn tool_call(call: ToolCallDelta, first: bool, logprobs: Option<Logprobs>) -> Self {
        let delta = Delta { role: first.then_some("assistant"), tool_calls: Some(vec![call]), ..Delta::default() };
        ChunkChoice::Delta { index: 0, delta, finish_reason: None, logprobs }
    }

    /// A chat chunk carrying a piece of the reasoning block.
    pub fn reasoning(text: String, first: bool, logprobs: Option<Logprobs>) -> Self {
        let delta = Delta { role: first.then_some("assistant"), reasoning_content: Some(text), ..Delta::default() };
        ChunkChoice::Delta { index: 0, delta, finish_reason: None, logprobs }
    }

    /// The chunk that ends the choice.
    pub fn finish(kind: Kind, finish_reason: String) -> Self {
        let finish_reason = Some(finish_reason);
        match kind {
            Kind::Completion => ChunkChoice::Text { index: 0, text: String::new(), finish_reason, logprobs: None },
            Kind::Chat => ChunkChoice::Delta { index: 0, delta: Delta::default(), finish_reason, logprobs: None },
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// OpenAI's error body.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The context length in tokens (vLLM's field): prompt + output must fit.
    pub max_model_len: usize,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

impl ModelList {
    pub fn one(name: &str, max_model_len: usize) -> Self {
        let model = Model { id: name.to_string(), object: "model", created: 0, owned_by: "pd", max_model_len };
        ModelList { object: "list", data: vec![model] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_and_choices_have_openai_shapes() {
        let chunk = Chunk {
            id: "r".into(),
            object: object_name(Kind::Chat, true),
            created: 1,
            model: "m".into(),
            choices: vec![ChunkChoice::token(Kind::Chat, "Hi".into(), true, None)],
            usage: None,
        };
        let v = serde_json::to_value(&chunk).expect("json");
        assert_eq!(
            v["choices"][0],
            json!({"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": null})
        );
        assert!(v.get("usage").is_none());
        let end = serde_json::to_value(ChunkChoice::finish(Kind::Chat, "stop".into())).expect("json");
        assert_eq!(end, json!({"index": 0, "delta": {}, "finish_reason": "stop"}));
        let text = serde_json::to_value(Choice::of(Kind::Completion, "x".into(), "length".into(), None)).expect("json");
        assert_eq!(text, json!({"index": 0, "text": "x", "finish_reason": "length", "logprobs": null}));
        let usage = serde_json::to_value(Usage::new(3, 4, 2)).expect("json");
        assert_eq!(
            (usage["total_tokens"].as_u64(), usage["prompt_tokens_details"]["cached_tokens"].as_u64()),
            (Some(7), Some(2))
        );
    }
}
