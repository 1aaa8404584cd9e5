//! Synthetic weights for benchmarks: element i of a matrix is a hash of (seed, i), so the CPU and
//! every GPU make the same matrix without storing it. In bf16, the hash is mapped to
//! [-scale, scale) and rounded to bf16; in fp8, it gives an E4M3 code of magnitude below 1.875 and
//! every 128×128 block has the scale `scale`. The GPU twins are `fill_random_bf16` and
//! `fill_random_fp8` in kernels/elementwise.hip.

use super::fp8::{e4m3_to_f32, FP8_BLOCK};
use super::{DType, QuantMatrix};

#[derive(Debug, Clone)]
pub struct SyntheticMatrix {
    rows: usize,
    cols: usize,
    seed: u64,
    scale: f32,
    dtype: DType,
}

impl SyntheticMatrix {
    /// `dtype`: BF16 or F8E4M3.
    pub fn new(rows: usize, cols: usize, seed: u64, scale: f32, dtype: DType) -> Self {
        debug_assert!(matches!(dtype, DType::BF16 | DType::F8E4M3));
        SyntheticMatrix { rows, cols, seed, scale, dtype }
    }
}

fn hash(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The bf16 value at flat index `i` (splitmix64 of seed + i·golden ratio).
pub fn value(seed: u64, i: u64, scale: f32) -> f32 {
    let u = (hash(seed, i) >> 40) as f32 * (1.0 / 16_777_216.0);
    half::bf16::from_f32((2.0 * u - 1.0) * scale).to_f32()
}

/// The E4M3 code at flat index `i`: a random sign and a magnitude code below 0x40.
pub fn fp8_code(seed: u64, i: u64) -> u8 {
    let z = hash(seed, i);
    (((z >> 56) & 0x80) | ((z >> 40) & 0x3f)) as u8
}

impl QuantMatrix for SyntheticMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn storage_bytes(&self) -> usize {
        match self.dtype {
            DType::F8E4M3 => self.rows * self.cols + self.rows.div_ceil(FP8_BLOCK) * self.cols.div_ceil(FP8_BLOCK) * 4,
            _ => self.rows * self.cols * 2,
        }
    }

    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let base = (row * self.cols) as u64;
        for (c, o) in out.iter_mut().enumerate() {
            *o = match self.dtype {
                DType::F8E4M3 => e4m3_to_f32(fp8_code(self.seed, base + c as u64)) * self.scale,
                _ => value(self.seed, base + c as u64, self.scale),
            };
        }
    }

    fn synthetic(&self) -> Option<(u64, f32)> {
        Some((self.seed, self.scale))
    }
}

/// `n` random GGML blocks of `format` (seeded): random codes, with finite moderate scales (f16
/// scales within ±0.05; MXFP4's power of two and NVFP4's E4M3 bytes near 1), for tests of every
/// decoder and kernel.
pub fn random_ggml_blocks(format: super::GgmlFormat, n: usize, seed: u64) -> Vec<u8> {
    use super::GgmlFormat as F;
    let mut i = 0u64;
    let mut byte = || {
        i += 1;
        hash(seed, i) as u8
    };
    let mut out = Vec::with_capacity(n * format.block_bytes());
    for _ in 0..n {
        let mut b: Vec<u8> = (0..format.block_bytes()).map(|_| byte()).collect();
        let scale_at: &[usize] = match format {
            F::Q8_0 | F::Q4_0 | F::Q5_0 | F::IQ4_NL | F::IQ4_XS => &[0],
            F::Q4_1 | F::Q5_1 | F::Q4_K | F::Q5_K => &[0, 2],
            F::Q6_K => &[208],
            F::MXFP4 => {
                b[0] = 120 + byte() % 8;
                &[]
            }
            F::NVFP4 => {
                b[..4].iter_mut().for_each(|s| *s = 0x28 + byte() % 0x18);
                &[]
            }
            F::ROCMFP4 | F::ROCMFP4_FAST => &[],
        };
        for &at in scale_at {
            let unit = u16::from_le_bytes([byte(), byte()]) as f32 / 32768.0 - 1.0;
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(unit * 0.05).to_le_bytes());
        }
        out.extend_from_slice(&b);
    }
    out
}
