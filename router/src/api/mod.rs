//! The OpenAI HTTP API's JSON as typed serde structs: `request` (what clients send, with
//! vLLM's `ignore_eos` and `top_k` extensions) and `response` (what they get back: whole
//! responses, stream chunks, errors). Decoding reports the path of a bad field
//! (`messages[1].role`), which becomes the error's `param`.

pub mod logprobs;
pub mod request;
pub mod response;
pub mod tokenize;
