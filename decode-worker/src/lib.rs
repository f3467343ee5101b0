//! pd-decode: Paged KV cache owner, continuous batching of decode steps, token streaming. Built by the cluster issue on pd-engine.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
