//! pd-prefill: Prefill scheduling and pushing KV to decode workers. Built by the cluster issue on pd-engine.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
