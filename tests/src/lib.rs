//! pd-tests: End-to-end tests that start the real binaries on loopback. Arrives with the cluster issue; engine tests live in `engine/tests/`.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
