//! Where a forward pass's time goes, by kind of operation, when a benchmark asks
//! (`pd-engine-bench --breakdown`). Off by default: each operation then costs one relaxed
//! atomic load. On CPU every operation has finished when it returns, so wall time per call is
//! its cost; on an asynchronous device these numbers would only show launch time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The kinds of operation a forward pass is split into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Q/K/V, output, gate/up and down projections.
    Projections,
    /// Decode and prefill attention over the paged cache.
    Attention,
    /// Writing the new tokens' K/V into the cache.
    KvWrite,
    /// RMS norms.
    Norms,
    /// Rotary embeddings.
    Rope,
    /// SiLU and the gate product.
    Activation,
    /// Residual additions.
    Residual,
    /// Final norm and the vocabulary projection.
    LmHead,
}

impl Op {
    pub const ALL: [Op; 8] =
        [Op::Projections, Op::Attention, Op::KvWrite, Op::Norms, Op::Rope, Op::Activation, Op::Residual, Op::LmHead];

    pub fn name(self) -> &'static str {
        match self {
            Op::Projections => "projections",
            Op::Attention => "attention",
            Op::KvWrite => "kv write",
            Op::Norms => "norms",
            Op::Rope => "rope",
            Op::Activation => "activation",
            Op::Residual => "residual",
            Op::LmHead => "lm head",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

/// Starts (or stops) timing operations, process-wide.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Time spent per operation since the last call, and resets the counters.
pub fn take() -> Vec<(Op, Duration)> {
    Op::ALL.iter().map(|&op| (op, Duration::from_nanos(NANOS[op as usize].swap(0, Ordering::Relaxed)))).collect()
}

/// Runs `f`, adding its wall time to `op` when timing is on.
#[inline]
pub(crate) fn timed<T>(op: Op, f: impl FnOnce() -> T) -> T {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    NANOS[op as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}
