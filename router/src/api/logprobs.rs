//! Log probabilities in OpenAI's two shapes. Workers send token ids and numbers only; the
//! token texts come from the served tokenizer here. Chat: `logprobs.content[]` with `token`,
//! `logprob`, `bytes` and `top_logprobs[]`; completions: parallel lists `tokens`,
//! `token_logprobs`, `top_logprobs` (a `{token: logprob}` map per position) and `text_offset`.

use pd_engine::Tokenizer;
use pd_proto::v1 as pb;
use serde::Serialize;
use serde_json::{Map, Value};

/// OpenAI's stand-in for a log probability of minus infinity.
const FLOOR: f32 = -9999.0;

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        FLOOR
    }
}

/// One token's text and bytes (a byte-level token may hold part of a UTF-8 character: its
/// text then shows the replacement character, its bytes the truth).
fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// `l` with the texts of the sampled token and of every alternative filled in (the gRPC API's
/// form).
pub fn with_texts(tokenizer: &Tokenizer, token_id: u32, mut l: pb::TokenLogprobs) -> pb::TokenLogprobs {
    l.token = token_text(tokenizer, token_id).0;
    for t in &mut l.top {
        t.token = token_text(tokenizer, t.token_id).0;
    }
    l
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One position of chat's `logprobs.content`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat's `choices[].logprobs` (whole, or the positions of one stream chunk).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

/// Completions' `choices[].logprobs`.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// None (null) for an echoed prompt's first token, which has nothing before it.
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

/// Log probabilities of a choice in its API's shape, built one token at a time.
#[derive(Debug, Clone, PartialEq)]
pub enum Logprobs {
    Chat(ChatLogprobs),
    /// With the length of the text so far (for `text_offset`).
    Completion(CompletionLogprobs, usize),
}

impl Serialize for Logprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Logprobs::Chat(c) => c.serialize(s),
            Logprobs::Completion(c, _) => c.serialize(s),
        }
    }
}

impl Logprobs {
    pub fn new(kind: crate::validate::Kind) -> Self {
        match kind {
            crate::validate::Kind::Chat => Logprobs::Chat(ChatLogprobs::default()),
            crate::validate::Kind::Completion => Logprobs::Completion(CompletionLogprobs::default(), 0),
        }
    }

    /// Adds the position of `token_id`, whose final text (as streamed) is `text`.
    pub fn push(&mut self, tokenizer: &Tokenizer, token_id: u32, text: &str, l: &pb::TokenLogprobs) {
        let (token, bytes) = token_text(tokenizer, token_id);
        let top = l.top.iter().map(|t| {
            let (token, bytes) = token_text(tokenizer, t.token_id);
            TopLogprob { token, logprob: finite(t.logprob), bytes }
        });
        match self {
            Logprobs::Chat(c) => c.content.push(ChatTokenLogprob {
                token,
                logprob: finite(l.logprob),
                bytes,
                top_logprobs: top.collect(),
            }),
            Logprobs::Completion(c, offset) => {
                c.tokens.push(token);
                c.token_logprobs.push(Some(finite(l.logprob)));
                c.top_logprobs.push(Some(top.map(|t| (t.token, Value::from(t.logprob))).collect()));
                c.text_offset.push(*offset);
                *offset += text.len();
            }
        }
    }

    /// Adds an echoed prompt's first token, which has no log probability (completions; chat
    /// has no echo).
    pub fn push_unscored(&mut self, tokenizer: &Tokenizer, token_id: u32) {
        if let Logprobs::Completion(c, offset) = self {
            let (token, bytes) = token_text(tokenizer, token_id);
            c.tokens.push(token);
            c.token_logprobs.push(None);
            c.top_logprobs.push(None);
            c.text_offset.push(*offset);
            *offset += bytes.len();
        }
    }

    /// No positions.
    pub fn is_empty(&self) -> bool {
        match self {
            Logprobs::Chat(c) => c.content.is_empty(),
            Logprobs::Completion(c, _) => c.tokens.is_empty(),
        }
    }

    /// The positions added since the last `take` (one stream chunk's), keeping the text offset.
    pub fn take(&mut self) -> Logprobs {
        match self {
            Logprobs::Chat(c) => Logprobs::Chat(std::mem::take(c)),
            Logprobs::Completion(c, offset) => Logprobs::Completion(std::mem::take(c), *offset),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Kind;
    use serde_json::json;

    fn lp(logprob: f32, top: &[(u32, f32)]) -> pb::TokenLogprobs {
        let top = top.iter().map(|&(token_id, logprob)| pb::TopLogprob { token_id, logprob, token: String::new() });
        pb::TokenLogprobs { logprob, top: top.collect(), token: String::new() }
    }

    #[test]
    fn chat_and_completion_shapes_are_openais() {
        let tok = Tokenizer::characters().expect("tokenizer");
        let mut chat = Logprobs::new(Kind::Chat);
        chat.push(&tok, 0, "a", &lp(-0.25, &[(0, -0.25), (1, -2.0)]));
        assert_eq!(
            serde_json::to_value(&chat).expect("json"),
            json!({"content": [{"token": "a", "logprob": -0.25, "bytes": [97],
                "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}, {"token": "b", "logprob": -2.0, "bytes": [98]}]}],
                "refusal": null})
        );
        let mut completion = Logprobs::new(Kind::Completion);
        completion.push(&tok, 0, "a", &lp(-0.5, &[(0, -0.5)]));
        let first = completion.take();
        completion.push(&tok, 1, "b", &lp(f32::NEG_INFINITY, &[]));
        assert_eq!(
            serde_json::to_value(&first).expect("json"),
            json!({"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]})
        );
        assert_eq!(
            serde_json::to_value(&completion).expect("json"),
            json!({"tokens": ["b"], "token_logprobs": [-9999.0], "top_logprobs": [{}], "text_offset": [1]})
        );
        let filled = with_texts(&tok, 2, lp(-1.0, &[(3, -1.5)]));
        assert_eq!((filled.token.as_str(), filled.top[0].token.as_str()), ("c", "d"));
    }
}
