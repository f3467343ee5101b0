//! The allocator of every binary that runs a model: mimalloc, with its arenas committed as
//! they are used rather than up front (`mi_option_arena_eager_commit` = 0).
//!
//! Why: with eager commit, the memory mimalloc frees back into an arena stayed resident
//! (Linux counts it in RSS until the kernel needs it), so a worker looked 20-33 MiB larger
//! at every phase than the model and KV pool explain: Qwen3-0.6B geometry, Q4_1, 1,040 MiB
//! pool, `pd-engine-bench --prefill 512 --batch 1,16 --context 512`: prefill peak 1.105x
//! against 1.081x of the file plus the pool, decode peak 1.073x against 1.048x, with equal
//! prefill and decode speed in alternating runs.
//!
//! The option must be set before mimalloc reserves its first arena, which happens at the
//! process's first allocation, before `main`: hence a constructor in `.init_array` with a
//! priority that runs ahead of the C runtime's unprioritized ones. It sets the option's
//! default only, so `MIMALLOC_ARENA_EAGER_COMMIT` in the environment still decides.

pub use mimalloc::MiMalloc;

/// `mi_option_arena_eager_commit` in mimalloc's `mi_option_e` (4 in its v2 and v3 headers).
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// Makes mimalloc commit arena memory on demand (see the module header). Called by the
/// constructor that `model_allocator!` declares; harmless, but too late to matter, after the
/// first allocation.
pub extern "C" fn commit_arenas_on_demand() {
    // SAFETY: sets one integer option's default; mimalloc allows it at any time.
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_ARENA_EAGER_COMMIT, 0) }
}

/// Declares mimalloc as the binary's global allocator and, on Linux, the constructor that
/// configures it before the first allocation. One line in each model-running binary's root.
#[macro_export]
macro_rules! model_allocator {
    () => {
        #[global_allocator]
        static GLOBAL: $crate::alloc::MiMalloc = $crate::alloc::MiMalloc;

        #[cfg(target_os = "linux")]
        #[used]
        #[link_section = ".init_array.00200"]
        static CONFIGURE_ALLOCATOR: extern "C" fn() = $crate::alloc::commit_arenas_on_demand;
    };
}
