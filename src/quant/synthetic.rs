//! Synthetic weights for benchmarks: value i of a matrix is a hash of (seed, i) mapped to
//! [-scale, scale) and rounded to bf16, so the CPU and every GPU make the same matrix without
//! storing it. The GPU twin is `fill_random_bf16` in kernels/elementwise.hip.

use super::{DType, QuantMatrix};

#[derive(Debug, Clone)]
pub struct SyntheticMatrix {
    rows: usize,
    cols: usize,
    seed: u64,
    scale: f32,
}

impl SyntheticMatrix {
    pub fn new(rows: usize, cols: usize, seed: u64, scale: f32) -> Self {
        SyntheticMatrix { rows, cols, seed, scale }
    }
}

/// The value at flat index `i` (splitmix64 of seed + i·golden ratio).
pub fn value(seed: u64, i: u64, scale: f32) -> f32 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
    half::bf16::from_f32((2.0 * u - 1.0) * scale).to_f32()
}

impl QuantMatrix for SyntheticMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn dtype(&self) -> DType {
        DType::BF16
    }

    fn storage_bytes(&self) -> usize {
        self.rows * self.cols * 2
    }

    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let base = (row * self.cols) as u64;
        for (c, o) in out.iter_mut().enumerate() {
            *o = value(self.seed, base + c as u64, self.scale);
        }
    }

    fn synthetic(&self) -> Option<(u64, f32)> {
        Some((self.seed, self.scale))
    }
}
