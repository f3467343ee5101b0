//! Which vector instructions the CPU kernels use, decided once per process at run time.
//!
//! The build assumes x86-64-v3 (AVX2, FMA, F16C; `.cargo/config.toml`). AVX-512 doubles the
//! lanes of every multiply-add and every f16 widening, which is what decode at batch 4-16 is
//! bound by, but many x86 servers lack it, so it is detected, never assumed.
//! `PD_ENGINE_SIMD=avx2` keeps a process on the AVX2 kernels (to compare the two paths on one
//! machine); any other value is refused by name when a model is loaded (`check_env`).

use std::sync::OnceLock;

use half::f16;

use crate::error::{EngineError, Result};

const ENV: &str = "PD_ENGINE_SIMD";

/// What `PD_ENGINE_SIMD` asks for: `None` for the CPU's best.
fn requested() -> std::result::Result<Option<Level>, String> {
    match std::env::var(ENV).ok().as_deref() {
        None | Some("") | Some("auto") => Ok(None),
        Some("avx2") => Ok(Some(Level::Avx2)),
        Some(other) => Err(other.to_string()),
    }
}

/// Refuses a `PD_ENGINE_SIMD` value that names no level (called when a model is loaded).
pub(crate) fn check_env() -> Result<()> {
    requested().map(|_| ()).map_err(|v| EngineError::Config(format!("{ENV}={v}: expected auto or avx2")))
}

/// The widest kernel family this process uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// AVX2 + FMA + F16C (the build's baseline on x86-64; portable loops elsewhere).
    Avx2,
    /// AVX-512 F (16 f32 lanes, 16-wide f16 widening).
    Avx512,
}

/// The level in force: the CPU's best unless `PD_ENGINE_SIMD` lowers it.
pub(crate) fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    // An unknown value was refused at load (`check_env`); here it means the CPU's best.
    *LEVEL.get_or_init(|| requested().ok().flatten().unwrap_or_else(detected))
}

/// The CPU's best level.
pub(crate) fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return Level::Avx512;
    }
    Level::Avx2
}

/// Whether the AVX-512 kernels run in this process.
pub(crate) fn avx512() -> bool {
    level() == Level::Avx512
}

/// An element the kernels widen to f32 as they load it (f32 itself, or f16: weights and the
/// KV cache).
pub(crate) trait Widen: Copy + Send + Sync + candle_core::WithDType {
    fn to_f32(self) -> f32;
    /// Eight consecutive elements at `ptr` as one f32 vector.
    ///
    /// # Safety
    /// `ptr` must be valid for reading eight elements.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    unsafe fn load8(ptr: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen consecutive elements at `ptr` as one f32 vector.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `ptr` must be valid for reading sixteen elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(ptr: *const Self) -> std::arch::x86_64::__m512;
}

impl Widen for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    #[inline(always)]
    unsafe fn load8(ptr: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: forwarded from the caller.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(ptr) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(ptr: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: forwarded from the caller.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(ptr) }
    }
}

impl Widen for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    #[inline(always)]
    unsafe fn load8(ptr: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: forwarded from the caller; 8 f16 are 16 bytes, one unaligned 128-bit load.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(ptr.cast::<__m128i>())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(ptr: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: forwarded from the caller; 16 f16 are 32 bytes, one unaligned 256-bit load.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(ptr.cast::<__m256i>())) }
    }
}
