//! pd-bench: measures from outside, like a client. `pd-bench` is the load generator for any
//! OpenAI-compatible server (`loadgen`); `pd-load` a first cluster-vs-engine latency
//! comparison; `pd-otlp-sink` receives spans for the tracing-overhead benchmark. The
//! component benchmarks live with their components: `pd-engine-bench` (pd-engine),
//! `pd-kv-bench` (pd-kv-transfer), `pd-prefill-bench` (pd-prefill). `profile` fits a worker
//! pair's cost model (pd-sim) from pd.v1 calls; `plan` turns a load test into a capacity plan.

pub mod loadgen;
pub mod plan;
pub mod profile;
pub mod roofline;
pub mod simulate;
