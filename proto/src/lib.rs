//! pd-proto: The one crate that compiles `proto/pd/v1/*.proto`. The worker and KV-transfer APIs arrive with the issues that use them.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
