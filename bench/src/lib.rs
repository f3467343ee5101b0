//! pd-bench: measurement tools. `pd-engine-bench` measures the engine alone on the real
//! model (prefill, batched decode, KV export/import, memory).
