//! pd-kv-transfer: Ships KV blocks between processes (wire format, gRPC and UCX backends, receiver-side reservations). Built by the KV-transfer issue on top of `pd_engine::kv::export`.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
