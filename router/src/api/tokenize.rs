//! vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer and chat
//! template, exactly as generation uses them (a client can count a prompt's tokens against
//! `max_model_len` before sending it).

use serde::{Deserialize, Serialize};

use crate::api::request::Message;
use crate::error::RouterError;
use crate::validate::{render_chat, Turn};
use pd_engine::TextSide;

/// `/tokenize`: a `prompt`, or chat `messages` rendered with the template.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    /// Chat only: end the rendering with the assistant's turn opening (default true).
    pub add_generation_prompt: Option<bool>,
    /// BOS first where the model starts texts with it (vLLM's field; by default true for a
    /// prompt, as a completion tokenizes it, and false for messages, whose template writes
    /// its own).
    pub add_special_tokens: Option<bool>,
    /// Also return each token's text.
    pub return_token_strs: Option<bool>,
    /// Chat only: further template variables, as chat requests take them.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

fn check_model(model: Option<&str>, served: &str) -> Result<(), RouterError> {
    match model {
        Some(m) if !m.is_empty() && m != served => Err(RouterError::ModelNotFound(m.to_string())),
        _ => Ok(()),
    }
}

pub fn tokenize(r: TokenizeRequest, text: &TextSide, served: &str) -> Result<TokenizeResponse, RouterError> {
    check_model(r.model.as_deref(), served)?;
    let (field, prompt) = match (r.prompt, r.messages) {
        (Some(_), None) if r.chat_template_kwargs.is_some() => {
            return Err(RouterError::invalid("chat_template_kwargs", "`chat_template_kwargs` needs `messages`"));
        }
        (Some(p), None) => ("prompt", p),
        (None, Some(messages)) => {
            let turns = messages.into_iter().enumerate().map(|(i, m)| m.turn(i));
            let messages: Vec<Turn> = turns.collect::<Result<_, _>>()?;
            let kwargs = super::request::template_kwargs(r.chat_template_kwargs, "chat_template_kwargs")?;
            ("messages", render_chat(&messages, None, &kwargs, text, r.add_generation_prompt.unwrap_or(true))?)
        }
        _ => return Err(RouterError::invalid("prompt", "set exactly one of `prompt` and `messages`")),
    };
    // vLLM's defaults: a prompt's tokens as a completion gets them (BOS first where the model
    // has one), a chat's as its template renders them.
    let tokens = match r.add_special_tokens.unwrap_or(field == "prompt") {
        true => text.tokenizer.encode_prompt(&prompt),
        false => text.tokenizer.encode(&prompt),
    };
    let tokens = tokens.map_err(|e| RouterError::invalid(field, e.to_string()))?;
    let token_strs = r.return_token_strs.unwrap_or(false).then(|| {
        tokens.iter().map(|&id| String::from_utf8_lossy(&text.tokenizer.token_bytes(id)).into_owned()).collect()
    });
    Ok(TokenizeResponse { count: tokens.len(), max_model_len: text.max_position, tokens, token_strs })
}

pub fn detokenize(r: DetokenizeRequest, text: &TextSide, served: &str) -> Result<DetokenizeResponse, RouterError> {
    check_model(r.model.as_deref(), served)?;
    let vocab = text.tokenizer.vocab_size();
    if let Some((i, id)) = r.tokens.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        let message = format!("token id {id} is outside the vocabulary of {vocab}");
        return Err(RouterError::invalid(&format!("tokens[{i}]"), message));
    }
    let prompt = text.tokenizer.decode(&r.tokens, false).map_err(|e| RouterError::invalid("tokens", e.to_string()))?;
    Ok(DetokenizeResponse { prompt })
}
