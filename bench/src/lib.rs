//! pd-bench: measurement tools. `pd-bench` is the load generator for any OpenAI-compatible
//! server (`loadgen`); `pd-engine-bench` measures the engine alone on the real model,
//! `pd-kv-bench` the KV transfer, `pd-load` a first cluster-vs-engine latency comparison,
//! `pd-otlp-sink` receives spans for the tracing-overhead benchmark.

pub mod loadgen;
