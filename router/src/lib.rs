//! pd-router: The public APIs (OpenAI HTTP, gRPC), admission control, worker choice and the request lifecycle. Built by the cluster issue.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
