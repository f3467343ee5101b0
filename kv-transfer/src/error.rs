//! Why a transfer failed. Each variant is one check of docs/design.md's list; `kind()` is the
//! stable label sent on the wire and used in metrics; `to_status()` is the one mapping to gRPC.

/// A failed or refused transfer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// Model fingerprint, dtype, block size, head geometry or block list do not match.
    #[error("incompatible transfer: {0}")]
    Incompatible(String),
    /// No reservation has this transfer id (never made, already committed or freed).
    #[error("unknown transfer `{0}`")]
    UnknownTransfer(String),
    /// A reservation with this transfer id exists already.
    #[error("transfer `{0}` is already reserved")]
    AlreadyReserved(String),
    /// The reservation's lease ran out; its blocks were freed.
    #[error("lease of transfer `{0}` expired")]
    LeaseExpired(String),
    /// A frame names a layer the transfer does not have.
    #[error("layer {layer} is out of range (transfer has {layers} layers)")]
    LayerOutOfRange { layer: u32, layers: u32 },
    /// A frame names blocks outside the reservation.
    #[error("blocks {first}..{end} are not reserved (transfer has {reserved} blocks)")]
    BlockNotReserved { first: u64, end: u64, reserved: usize },
    /// A frame's byte length does not match its block count and the geometry.
    #[error("frame for layer {layer} has {got} bytes, expected {expected}")]
    ShapeMismatch { layer: u32, got: usize, expected: usize },
    /// A frame's data does not match its checksum.
    #[error("checksum mismatch in layer {layer} blocks {first}..{end}")]
    ChecksumMismatch { layer: u32, first: u32, end: u32 },
    /// A (layer, block) arrived twice.
    #[error("duplicate frame: layer {layer} block index {block} already received")]
    DuplicateFrame { layer: u32, block: u32 },
    /// Commit before every (layer, block) arrived, or with the wrong prompt length.
    #[error("incomplete transfer: {0}")]
    Incomplete(String),
    /// The peer aborted the transfer.
    #[error("aborted by the peer: {0}")]
    Aborted(String),
    /// Another sender took the transfer over; this one's messages are refused.
    #[error("transfer `{0}` was taken over by a newer sender")]
    Superseded(String),
    /// Messages out of protocol order, or a malformed message.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The destination could not store the data.
    #[error("storing KV failed: {0}")]
    Sink(String),
    /// The peer did not answer in time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(std::time::Duration, &'static str),
    /// The connection failed or closed.
    #[error("transport: {0}")]
    Transport(String),
}

impl TransferError {
    /// Stable machine-readable label (also the `kind` field of `KvRefused`).
    pub fn kind(&self) -> &'static str {
        match self {
            TransferError::Incompatible(_) => "incompatible",
            TransferError::UnknownTransfer(_) => "unknown_transfer",
            TransferError::AlreadyReserved(_) => "already_reserved",
            TransferError::LeaseExpired(_) => "lease_expired",
            TransferError::LayerOutOfRange { .. } => "layer_out_of_range",
            TransferError::BlockNotReserved { .. } => "block_not_reserved",
            TransferError::ShapeMismatch { .. } => "shape_mismatch",
            TransferError::ChecksumMismatch { .. } => "checksum_mismatch",
            TransferError::DuplicateFrame { .. } => "duplicate_frame",
            TransferError::Incomplete(_) => "incomplete",
            TransferError::Aborted(_) => "aborted",
            TransferError::Superseded(_) => "superseded",
            TransferError::Protocol(_) => "protocol",
            TransferError::Sink(_) => "sink",
            TransferError::Timeout(..) => "timeout",
            TransferError::Transport(_) => "transport",
        }
    }

    /// The error a receiver's refusal (`KvRefused { kind, reason }`) stands for, on the sender.
    pub fn from_refusal(kind: &str, reason: String) -> Self {
        match kind {
            "incompatible" => TransferError::Incompatible(reason),
            "unknown_transfer" => TransferError::UnknownTransfer(reason),
            "lease_expired" => TransferError::LeaseExpired(reason),
            "incomplete" => TransferError::Incomplete(reason),
            "superseded" => TransferError::Superseded(reason),
            other => TransferError::Protocol(format!("refused ({other}): {reason}")),
        }
    }

    /// The gRPC status for this error.
    pub fn to_status(&self) -> tonic::Status {
        use tonic::Code;
        let code = match self {
            TransferError::Incompatible(_) => Code::FailedPrecondition,
            TransferError::UnknownTransfer(_) => Code::NotFound,
            TransferError::AlreadyReserved(_) => Code::AlreadyExists,
            TransferError::LeaseExpired(_) => Code::DeadlineExceeded,
            TransferError::LayerOutOfRange { .. }
            | TransferError::BlockNotReserved { .. }
            | TransferError::ShapeMismatch { .. }
            | TransferError::DuplicateFrame { .. }
            | TransferError::Protocol(_) => Code::InvalidArgument,
            TransferError::ChecksumMismatch { .. } => Code::DataLoss,
            TransferError::Incomplete(_) => Code::FailedPrecondition,
            TransferError::Aborted(_) | TransferError::Superseded(_) => Code::Aborted,
            TransferError::Sink(_) => Code::Internal,
            TransferError::Timeout(..) => Code::DeadlineExceeded,
            TransferError::Transport(_) => Code::Unavailable,
        };
        tonic::Status::new(code, self.to_string())
    }
}
