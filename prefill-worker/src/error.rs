//! Everything a prefill can fail with on this worker, named by the phase that failed, and the
//! one mapping to a gRPC status (the router retries UNAVAILABLE on another prefill worker)
//! and to the `reason` label of `pd_requests_rejected_total`.

use pd_engine::EngineError;
use pd_kv_transfer::convert::InvalidField;
use pd_kv_transfer::TransferError;

#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    /// SIGTERM was received: new prefills are refused.
    #[error("the prefill worker is shutting down")]
    ShuttingDown,
    /// The request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The request's KV target does not fit this worker's model.
    #[error("the KV target does not match this worker's model: {0}")]
    Incompatible(TransferError),
    /// The engine failed (out of blocks for a prompt larger than the cache, a forward error).
    #[error("prefill failed: {0}")]
    Engine(#[from] EngineError),
    /// Shipping the KV to the decode worker failed.
    #[error("KV transfer failed: {0}")]
    Transfer(#[from] TransferError),
    /// A compute thread died.
    #[error("prefill thread failed: {0}")]
    Thread(String),
}

impl From<InvalidField> for PrefillError {
    fn from(e: InvalidField) -> Self {
        PrefillError::Invalid(e.to_string())
    }
}

impl PrefillError {
    /// The `reason` label of the rejected-requests counter.
    pub fn reason(&self) -> &'static str {
        match self {
            PrefillError::ShuttingDown => "shutting_down",
            PrefillError::Invalid(_) => "invalid_request",
            PrefillError::Incompatible(_) => "incompatible",
            PrefillError::Engine(_) => "engine",
            PrefillError::Transfer(_) => "kv_transfer",
            PrefillError::Thread(_) => "thread",
        }
    }

    pub fn to_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            PrefillError::ShuttingDown => tonic::Status::unavailable(message),
            PrefillError::Invalid(_) => tonic::Status::invalid_argument(message),
            PrefillError::Incompatible(_) => tonic::Status::failed_precondition(message),
            PrefillError::Engine(EngineError::OutOfBlocks { .. }) => tonic::Status::resource_exhausted(message),
            PrefillError::Engine(_) | PrefillError::Thread(_) => tonic::Status::internal(message),
            PrefillError::Transfer(e) => tonic::Status::new(e.to_status().code(), message),
        }
    }

    /// True when the decode worker's KV connection should be dropped and reopened.
    pub fn breaks_connection(&self) -> bool {
        matches!(self, PrefillError::Transfer(TransferError::Transport(_) | TransferError::Timeout(..)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_phase_maps_to_its_status() {
        let cases = [
            (PrefillError::ShuttingDown, Code::Unavailable, "shutting_down"),
            (PrefillError::Invalid("prompt_tokens is empty".into()), Code::InvalidArgument, "invalid_request"),
            (
                PrefillError::Incompatible(TransferError::Incompatible("x".into())),
                Code::FailedPrecondition,
                "incompatible",
            ),
            (
                PrefillError::Engine(EngineError::OutOfBlocks { needed: 9, free: 1, total: 8 }),
                Code::ResourceExhausted,
                "engine",
            ),
            (PrefillError::Transfer(TransferError::Transport("gone".into())), Code::Unavailable, "kv_transfer"),
            (PrefillError::Thread("panicked".into()), Code::Internal, "thread"),
        ];
        for (error, code, reason) in cases {
            let status = error.to_status();
            assert_eq!((status.code(), error.reason()), (code, reason), "{error}");
            assert!(status.message().contains(&error.to_string()));
        }
        assert!(PrefillError::Transfer(TransferError::Transport("x".into())).breaks_connection());
        assert!(!PrefillError::Invalid("x".into()).breaks_connection());
    }
}
