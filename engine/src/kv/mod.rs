//! Paged KV cache: block bookkeeping and the prefix cache (`blocks`), content addresses and
//! cache events (`prefix`), the tensors (`cache`) and the byte format that moves a sequence's
//! KV between processes (`export`).

pub mod blocks;
pub mod cache;
pub mod export;
pub mod prefix;
