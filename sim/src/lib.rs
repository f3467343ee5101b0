//! pd-sim: what it takes to run the real router against a fleet we do not have.
//!
//! - `cost`: a worker's timing as a function of its work (prefill chunks, decode steps, KV
//!   hand-off) and its limits (KV blocks, batch); `fit` fits it to measurements
//!   (`pd-bench profile`), `roofline` derives it from a hardware and a model description.
//! - `prefill`, `decode`: simulated workers serving the real pd.v1 APIs with that timing and
//!   no model compute; `fleet` starts many of them in one process (`pd-sim-worker`).

pub mod cost;
pub mod decode;
pub mod fit;
pub mod fleet;
pub mod prefill;
pub mod roofline;

/// The first token every simulated prompt produces (an ordinary token id of any vocabulary
/// the router's tokenizer has, so the router can render it).
pub const FIRST_TOKEN: u32 = 330;
