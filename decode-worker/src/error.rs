//! Everything a decode request can fail with on this worker, named by the stage that failed,
//! and the one mapping to a gRPC status and to the `reason` label of
//! `pd_requests_rejected_total`.

use pd_engine::EngineError;
use pd_kv_transfer::convert::InvalidField;
use pd_kv_transfer::TransferError;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// SIGTERM was received: new requests are refused.
    #[error("the decode worker is shutting down")]
    ShuttingDown,
    /// The request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Not enough free KV blocks for the prompt and its whole output.
    #[error("no KV blocks: {0}")]
    OutOfBlocks(EngineError),
    /// The reservation could not be made (transfer id already reserved, geometry, sizes).
    #[error("KV reservation failed: {0}")]
    Reservation(TransferError),
    /// The KV never arrived complete (refused frame, aborted, lease over).
    #[error("KV transfer failed: {0}")]
    Transfer(TransferError),
    /// The batch loop is gone.
    #[error("the decode loop has stopped")]
    LoopStopped,
    /// An internal invariant broke (a lost reservation, a block list that does not fit).
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<InvalidField> for DecodeError {
    fn from(e: InvalidField) -> Self {
        DecodeError::Invalid(e.to_string())
    }
}

impl DecodeError {
    /// The `reason` label of the rejected-requests counter.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::ShuttingDown => "shutting_down",
            DecodeError::Invalid(_) => "invalid_request",
            DecodeError::OutOfBlocks(_) => "kv_blocks",
            DecodeError::Reservation(_) => "reservation",
            DecodeError::Transfer(_) => "kv_transfer",
            DecodeError::LoopStopped => "loop_stopped",
            DecodeError::Internal(_) => "internal",
        }
    }

    pub fn to_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            DecodeError::ShuttingDown | DecodeError::LoopStopped => tonic::Status::unavailable(message),
            DecodeError::Invalid(_) => tonic::Status::invalid_argument(message),
            DecodeError::OutOfBlocks(_) => tonic::Status::resource_exhausted(message),
            DecodeError::Reservation(e) | DecodeError::Transfer(e) => tonic::Status::new(e.to_status().code(), message),
            DecodeError::Internal(_) => tonic::Status::internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_stage_maps_to_its_status() {
        let out_of_blocks = EngineError::OutOfBlocks { needed: 9, free: 1, total: 8 };
        let cases = [
            (DecodeError::ShuttingDown, Code::Unavailable, "shutting_down"),
            (DecodeError::Invalid("prompt_tokens is empty".into()), Code::InvalidArgument, "invalid_request"),
            (DecodeError::OutOfBlocks(out_of_blocks), Code::ResourceExhausted, "kv_blocks"),
            (DecodeError::Reservation(TransferError::AlreadyReserved("r1".into())), Code::AlreadyExists, "reservation"),
            (DecodeError::Transfer(TransferError::LeaseExpired("r1".into())), Code::DeadlineExceeded, "kv_transfer"),
            (DecodeError::LoopStopped, Code::Unavailable, "loop_stopped"),
            (DecodeError::Internal("lost".into()), Code::Internal, "internal"),
        ];
        for (error, code, reason) in cases {
            let status = error.to_status();
            assert_eq!((status.code(), error.reason()), (code, reason), "{error}");
            assert_eq!(status.message(), error.to_string());
        }
    }
}
