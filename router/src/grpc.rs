//! The public `pd.v1.Generation` gRPC API, over the same lifecycle as HTTP.

use std::sync::Arc;

use futures_util::StreamExt;
use pb::generation_server::Generation;
use pd_engine::ChatMessage;
use pd_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::error::RouterError;
use crate::http::AppState;
use crate::lifecycle::{self, Update};
use crate::record::Arrival;
use crate::validate::{Kind, ValidRequest};
use pd_telemetry::RequestClass;

/// The Generation service.
#[derive(Debug, Clone)]
pub struct GenerationService {
    pub state: Arc<AppState>,
}

fn validate(state: &AppState, req: pb::GenerateRequest) -> Result<ValidRequest, RouterError> {
    if !req.model.is_empty() && req.model != state.model_name {
        return Err(RouterError::ModelNotFound(req.model));
    }
    let (kind, prompt_tokens) = match (req.prompt.is_empty(), req.messages.is_empty()) {
        (false, true) => (
            Kind::Completion,
            state.text.tokenizer.encode(&req.prompt).map_err(|e| RouterError::invalid("prompt", e.to_string()))?,
        ),
        (true, false) => {
            let messages: Vec<ChatMessage> =
                req.messages.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect();
            let template = state
                .text
                .chat_template
                .as_ref()
                .ok_or_else(|| RouterError::invalid("messages", "the model has no chat template"))?;
            let prompt =
                template.render(&messages, true).map_err(|e| RouterError::invalid("messages", e.to_string()))?;
            (
                Kind::Chat,
                state.text.tokenizer.encode(&prompt).map_err(|e| RouterError::invalid("messages", e.to_string()))?,
            )
        }
        _ => return Err(RouterError::invalid("prompt", "set exactly one of `prompt` and `messages`")),
    };
    if prompt_tokens.is_empty() {
        return Err(RouterError::invalid("prompt", "the prompt is empty"));
    }
    let mut sampling = req.sampling.unwrap_or_default();
    if sampling.max_tokens == 0 {
        sampling.max_tokens = state.limits.default_completion_tokens;
    }
    if sampling.max_tokens > state.limits.max_tokens {
        return Err(RouterError::invalid(
            "sampling.max_tokens",
            format!("at most {} is allowed", state.limits.max_tokens),
        ));
    }
    if prompt_tokens.len() + sampling.max_tokens as usize > state.text.max_position {
        return Err(RouterError::invalid(
            "sampling.max_tokens",
            format!("prompt + max_tokens exceed the context length of {}", state.text.max_position),
        ));
    }
    if !(sampling.temperature >= 0.0 && sampling.temperature <= 2.0) {
        return Err(RouterError::invalid("sampling.temperature", "must be between 0 and 2"));
    }
    if !(sampling.top_p >= 0.0 && sampling.top_p <= 1.0) {
        return Err(RouterError::invalid("sampling.top_p", "must be in (0, 1] (0 = off)"));
    }
    Ok(ValidRequest {
        kind,
        model: state.model_name.clone(),
        prompt_tokens,
        sampling,
        stream: true,
        include_usage: true,
    })
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream =
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let arrival = Arrival::new(&pd_telemetry::otel::extract_metadata(request.metadata()));
        let class = AppState::class(request.metadata().get(RequestClass::HEADER).map(|v| v.as_bytes()));
        let req = request.into_inner();
        let id = if req.request_id.is_empty() { self.state.request_id() } else { req.request_id.clone() };
        let validated = validate(&self.state, req);
        let (valid, record) = self.state.admit(arrival, class, validated, id.clone()).map_err(|e| e.to_status())?;
        let updates = lifecycle::start(self.state.pools.clone(), &valid, record).await.map_err(|e| e.to_status())?;
        let stream = updates.map(move |u| match u {
            Ok(Update::Token { token_id, text }) => Ok(pb::GenerateResponse {
                message: Some(pb::generate_response::Message::Token(pb::GeneratedToken { token_id, text })),
            }),
            Ok(Update::Done { finish_reason, prompt_tokens, completion_tokens }) => Ok(pb::GenerateResponse {
                message: Some(pb::generate_response::Message::Done(pb::GenerationDone {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    request_id: id.clone(),
                })),
            }),
            Err(e) => Err(e.to_status()),
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
