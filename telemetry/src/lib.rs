//! pd-telemetry: Tracing, OpenTelemetry export, W3C propagation and the Prometheus registry shared by the binaries. Built by the observability issue.
//!
//! This crate holds no code yet; the workspace layout of DESIGN.md is in place from the start.
