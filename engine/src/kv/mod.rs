//! Paged KV cache: block bookkeeping (`blocks`), the tensors (`cache`) and the byte format
//! that moves a sequence's KV between processes (`export`).

pub mod blocks;
pub mod cache;
pub mod export;
