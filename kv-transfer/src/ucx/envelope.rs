//! One UCX message = an envelope (transfer id + a pd.v1 message) in the AM header, and the
//! frame's KV bytes (if any) as the AM payload.

use prost::Message;

use crate::error::TransferError;

/// `[u16 id length][id][prost message]`.
pub(crate) fn encode(transfer_id: &str, message: &impl Message) -> Vec<u8> {
    let id = transfer_id.as_bytes();
    let mut out = Vec::with_capacity(2 + id.len() + message.encoded_len());
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(id);
    message.encode(&mut out).expect("a Vec grows as needed");
    out
}

/// The transfer id and the message bytes of an envelope.
pub(crate) fn decode<M: Message + Default>(bytes: &[u8]) -> Result<(String, M), TransferError> {
    let bad = |what: &str| TransferError::Protocol(format!("malformed UCX envelope: {what}"));
    let len = bytes.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize).ok_or_else(|| bad("short"))?;
    let id = bytes.get(2..2 + len).ok_or_else(|| bad("id past the end"))?;
    let id = std::str::from_utf8(id).map_err(|_| bad("id is not UTF-8"))?.to_string();
    let message = M::decode(&bytes[2 + len..]).map_err(|e| bad(&e.to_string()))?;
    Ok((id, message))
}
