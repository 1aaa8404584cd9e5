//! The small runtime interface the GPU backend needs from a vendor: memory, copies, kernel
//! launches on one in-order stream. CUDA (cudarc) and HIP (libloading) implement it; everything
//! above it is vendor-neutral.

use crate::Result;

/// One kernel argument, passed by value.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

pub trait Runtime: Send + Sync {
    /// Device name, architecture and kernel-cache state, for load reports.
    fn describe(&self) -> String;
    /// Device memory, ordered on the stream (valid for work queued after this call).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Frees after the work queued so far.
    fn free(&self, ptr: u64);
    /// Host to device; returns once `src` may be reused.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Device to host after all queued work.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
}

/// The kernel sources as one translation unit: the portability header first, then every op file
/// with its `#include` of that header removed (the run-time compilers get no include path).
pub fn kernel_source() -> String {
    const HEADER: &str = include_str!("../../../kernels/common/portable.h");
    const FILES: [&str; 6] = [
        include_str!("../../../kernels/elementwise.hip"),
        include_str!("../../../kernels/norm.hip"),
        include_str!("../../../kernels/rope.hip"),
        include_str!("../../../kernels/linear.hip"),
        include_str!("../../../kernels/attention.hip"),
        include_str!("../../../kernels/sampling.hip"),
    ];
    let mut src = String::from(HEADER);
    for f in FILES {
        src.push('\n');
        src.push_str(&f.replace("#include \"common/portable.h\"", ""));
    }
    src
}

/// FNV-1a, 64 bits: the kernel cache key (source + architecture + options).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are kept: `$ATLAS_CACHE/kernels` or `~/.cache/atlas/kernels`.
pub fn kernel_cache_dir() -> std::path::PathBuf {
    crate::engine::default_model_path().parent().map(|p| p.join("kernels")).unwrap_or_else(|| "kernels".into())
}
