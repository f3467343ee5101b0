//! Router errors: one enum, mapped in one place to an HTTP status with an OpenAI-shaped body
//! and to a gRPC status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::api::response::{ErrorBody, ErrorDetail};

/// Everything a request can fail with at the router.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    /// The request is malformed; names the field.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// The request names a model this cluster does not serve.
    #[error("model `{0}` is not served here")]
    ModelNotFound(String),
    /// The body is larger than the limit.
    #[error("request body is larger than {0} bytes")]
    TooLarge(usize),
    /// Unsupported media type.
    #[error("content type must be application/json")]
    UnsupportedMediaType,
    /// Valid JSON that does not describe a request.
    #[error("{0}")]
    Unprocessable(String),
    /// A request over its traffic class's input or output limit; names the limit.
    #[error("{0}")]
    OverClassLimit(String),
    /// Over capacity (class queue budget, wait beyond the TTFT SLO, no KV blocks): retry
    /// after `retry_after_s` seconds.
    #[error("over capacity: {message}")]
    Overloaded { message: String, retry_after_s: u64 },
    /// No worker of a pool answers.
    #[error("no {0} worker is available")]
    NoWorker(&'static str),
    /// An admitted request waited far past its class's queue age without being served: the
    /// workers are not taking requests (not an overload refusal: those come at admission).
    #[error("{0}")]
    QueueStalled(String),
    /// A worker failed while serving the request.
    #[error("{stage} failed: {message}")]
    Worker { stage: &'static str, message: String },
    /// No API key, or an unknown one, where one is required.
    #[error("{0}")]
    Unauthorized(String),
    /// The caller's key does not open what it asked for (a class reserved for other keys).
    #[error("{0}")]
    Forbidden(String),
    /// The request's decode worker was lost and it could not be continued elsewhere (no other
    /// decode worker, or the migration limit reached); says why.
    #[error("{0}")]
    Migration(String),
    /// The client took no event for longer than the send timeout; the request was ended so
    /// it holds no worker. Rarely seen by the client itself (it is not reading).
    #[error("{0}")]
    ClientTooSlow(String),
}

impl RouterError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        RouterError::InvalidRequest { message: message.into(), param: Some(param.to_string()) }
    }

    /// Every `reason` (`pd_requests_rejected_total`'s label values).
    pub const REASONS: [&'static str; 14] = [
        "invalid_request",
        "model_not_found",
        "too_large",
        "unsupported_media_type",
        "unprocessable",
        "over_class_limit",
        "overloaded",
        "no_worker",
        "queue_stalled",
        "worker_failed",
        "migration_failed",
        "unauthorized",
        "forbidden",
        "client_too_slow",
    ];

    /// The `reason` label of `pd_requests_rejected_total` and the record's outcome detail.
    pub fn reason(&self) -> &'static str {
        match self {
            RouterError::InvalidRequest { .. } => "invalid_request",
            RouterError::ModelNotFound(_) => "model_not_found",
            RouterError::TooLarge(_) => "too_large",
            RouterError::UnsupportedMediaType => "unsupported_media_type",
            RouterError::Unprocessable(_) => "unprocessable",
            RouterError::OverClassLimit(_) => "over_class_limit",
            RouterError::Overloaded { .. } => "overloaded",
            RouterError::NoWorker(_) => "no_worker",
            RouterError::QueueStalled(_) => "queue_stalled",
            RouterError::Worker { .. } => "worker_failed",
            RouterError::Migration(_) => "migration_failed",
            RouterError::Unauthorized(_) => "unauthorized",
            RouterError::Forbidden(_) => "forbidden",
            RouterError::ClientTooSlow(_) => "client_too_slow",
        }
    }

    pub fn http_status(&self) -> StatusCode {
        match self {
            RouterError::InvalidRequest { .. } | RouterError::OverClassLimit(_) => StatusCode::BAD_REQUEST,
            RouterError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            RouterError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            RouterError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            RouterError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            RouterError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            RouterError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            RouterError::Forbidden(_) => StatusCode::FORBIDDEN,
            RouterError::ClientTooSlow(_) => StatusCode::REQUEST_TIMEOUT,
            RouterError::NoWorker(_)
            | RouterError::QueueStalled(_)
            | RouterError::Worker { .. }
            | RouterError::Migration(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// OpenAI's `error.type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            RouterError::InvalidRequest { .. }
            | RouterError::OverClassLimit(_)
            | RouterError::TooLarge(_)
            | RouterError::UnsupportedMediaType
            | RouterError::Unprocessable(_) => "invalid_request_error",
            RouterError::ModelNotFound(_) => "not_found_error",
            RouterError::Overloaded { .. } => "rate_limit_error",
            RouterError::Unauthorized(_) => "authentication_error",
            RouterError::Forbidden(_) => "permission_error",
            RouterError::ClientTooSlow(_) => "timeout_error",
            RouterError::NoWorker(_)
            | RouterError::QueueStalled(_)
            | RouterError::Worker { .. }
            | RouterError::Migration(_) => "service_unavailable",
        }
    }

    pub fn body(&self) -> ErrorBody {
        let param = match self {
            RouterError::InvalidRequest { param, .. } => param.clone(),
            RouterError::ModelNotFound(_) => Some("model".into()),
            _ => None,
        };
        ErrorBody { error: ErrorDetail { message: self.to_string(), kind: self.error_type(), param, code: None } }
    }

    pub fn to_status(&self) -> tonic::Status {
        match self {
            // gRPC has no `param` field: the message names it.
            RouterError::InvalidRequest { message, param: Some(param) } if !message.contains(param.as_str()) => {
                tonic::Status::invalid_argument(format!("{param}: {message}"))
            }
            RouterError::InvalidRequest { .. }
            | RouterError::OverClassLimit(_)
            | RouterError::TooLarge(_)
            | RouterError::UnsupportedMediaType
            | RouterError::Unprocessable(_) => tonic::Status::invalid_argument(self.to_string()),
            RouterError::ModelNotFound(_) => tonic::Status::not_found(self.to_string()),
            RouterError::Overloaded { retry_after_s, .. } => retry_status(self.to_string(), *retry_after_s),
            RouterError::Unauthorized(_) => tonic::Status::unauthenticated(self.to_string()),
            RouterError::Forbidden(_) => tonic::Status::permission_denied(self.to_string()),
            RouterError::ClientTooSlow(_) => tonic::Status::deadline_exceeded(self.to_string()),
            RouterError::NoWorker(_)
            | RouterError::QueueStalled(_)
            | RouterError::Worker { .. }
            | RouterError::Migration(_) => tonic::Status::unavailable(self.to_string()),
        }
    }
}

/// RESOURCE_EXHAUSTED with a `google.rpc.RetryInfo` detail (and a `retry-after` metadata
/// value for clients that do not read details).
fn retry_status(message: String, retry_after_s: u64) -> tonic::Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let details = ErrorDetails::with_retry_info(Some(std::time::Duration::from_secs(retry_after_s)));
    let mut status = tonic::Status::with_error_details(tonic::Code::ResourceExhausted, message, details);
    if let Ok(v) = retry_after_s.to_string().parse() {
        status.metadata_mut().insert("retry-after", v);
    }
    status
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let mut response = (self.http_status(), axum::Json(self.body())).into_response();
        if let RouterError::Overloaded { retry_after_s, .. } = &self {
            if let Ok(v) = axum::http::HeaderValue::from_str(&retry_after_s.to_string()) {
                response.headers_mut().insert("retry-after", v);
            }
        }
        if let RouterError::Unauthorized(_) = &self {
            response.headers_mut().insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_one_http_status_and_grpc_code_that_agree() {
        use tonic::Code;
        let cases = [
            (RouterError::invalid("prompt", "x"), StatusCode::BAD_REQUEST, Code::InvalidArgument, "invalid_request"),
            (RouterError::ModelNotFound("m".into()), StatusCode::NOT_FOUND, Code::NotFound, "model_not_found"),
            (RouterError::TooLarge(10), StatusCode::PAYLOAD_TOO_LARGE, Code::InvalidArgument, "too_large"),
            (
                RouterError::UnsupportedMediaType,
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                Code::InvalidArgument,
                "unsupported_media_type",
            ),
            (
                RouterError::Unprocessable("x".into()),
                StatusCode::UNPROCESSABLE_ENTITY,
                Code::InvalidArgument,
                "unprocessable",
            ),
            (
                RouterError::Overloaded { message: "x".into(), retry_after_s: 1 },
                StatusCode::TOO_MANY_REQUESTS,
                Code::ResourceExhausted,
                "overloaded",
            ),
            (
                RouterError::OverClassLimit("x".into()),
                StatusCode::BAD_REQUEST,
                Code::InvalidArgument,
                "over_class_limit",
            ),
            (RouterError::NoWorker("decode"), StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable, "no_worker"),
            (
                RouterError::QueueStalled("x".into()),
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "queue_stalled",
            ),
            (
                RouterError::Worker { stage: "prefill", message: "x".into() },
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "worker_failed",
            ),
            (RouterError::Unauthorized("x".into()), StatusCode::UNAUTHORIZED, Code::Unauthenticated, "unauthorized"),
            (RouterError::Forbidden("x".into()), StatusCode::FORBIDDEN, Code::PermissionDenied, "forbidden"),
            (
                RouterError::Migration("x".into()),
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "migration_failed",
            ),
            (
                RouterError::ClientTooSlow("x".into()),
                StatusCode::REQUEST_TIMEOUT,
                Code::DeadlineExceeded,
                "client_too_slow",
            ),
        ];
        // One case per variant, and REASONS (the metric's initialized label values) lists
        // exactly their reasons.
        let mut reasons: Vec<&str> = cases.iter().map(|c| c.3).collect();
        reasons.sort_unstable();
        let mut listed = RouterError::REASONS.to_vec();
        listed.sort_unstable();
        assert_eq!(reasons, listed);
        for (error, http, grpc, reason) in cases {
            assert_eq!(
                (error.http_status(), error.to_status().code(), error.reason()),
                (http, grpc, reason),
                "{error}"
            );
        }
        let body = serde_json::to_value(RouterError::ModelNotFound("m".into()).body()).expect("json");
        assert_eq!(
            (body["error"]["param"].as_str(), body["error"]["type"].as_str()),
            (Some("model"), Some("not_found_error"))
        );
    }

    #[test]
    fn an_overloaded_answer_says_when_to_retry() {
        let error = RouterError::Overloaded { message: "queue full".into(), retry_after_s: 3 };
        let response = error.clone().into_response();
        assert_eq!(response.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("3"));
        use tonic_types::StatusExt;
        let status = error.to_status();
        let retry = status.get_details_retry_info().and_then(|r| r.retry_delay);
        assert_eq!(retry, Some(std::time::Duration::from_secs(3)));
    }
}
