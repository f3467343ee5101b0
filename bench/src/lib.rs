//! pd-bench: measures from outside, like a client. `pd-bench` is the load generator for any
//! OpenAI-compatible server (`loadgen`); `pd-load` a first cluster-vs-engine latency
//! comparison; `pd-otlp-sink` receives spans for the tracing-overhead benchmark. The
//! component benchmarks live with their components: `pd-engine-bench` (pd-engine),
//! `pd-kv-bench` (pd-kv-transfer), `pd-prefill-bench` (pd-prefill).

pub mod loadgen;
