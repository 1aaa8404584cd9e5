//! FP8 block-scaled weights as Qwen's and DeepSeek's FP8 checkpoints store them: `weight` is
//! F8_E4M3 `[N, K]`, `weight_scale_inv` is `[ceil(N/128), ceil(K/128)]`, and the real weight is
//! `fp8 × scale_inv` of the weight's 128×128 block.

use super::{DType, QuantMatrix};

pub const FP8_BLOCK: usize = 128;

/// E4M3 "fn" (no infinities): sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7f/0xff are NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0f);
    let man = f32::from(b & 0x07);
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

#[derive(Debug, Clone)]
pub struct Fp8BlockMatrix {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    /// `[ceil(rows/128), ceil(cols/128)]`, row-major.
    scales: Vec<f32>,
}

impl Fp8BlockMatrix {
    /// `data`: rows*cols E4M3 bytes; `scales`: the scale_inv grid. The caller checked the sizes.
    pub fn new(rows: usize, cols: usize, data: Vec<u8>, scales: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "fp8 data length");
        assert_eq!(scales.len(), rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK), "fp8 scale grid");
        Fp8BlockMatrix { rows, cols, data, scales }
    }
}

impl QuantMatrix for Fp8BlockMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn dtype(&self) -> DType {
        DType::F8E4M3
    }

    fn storage_bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 4
    }

    fn fp8_blocks(&self) -> Option<(&[u8], &[f32])> {
        Some((&self.data, &self.scales))
    }

    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let scale_row = &self.scales[(row / FP8_BLOCK) * self.cols.div_ceil(FP8_BLOCK)..];
        for (c, (o, b)) in out.iter_mut().zip(&self.data[row * self.cols..(row + 1) * self.cols]).enumerate() {
            *o = e4m3_to_f32(*b) * scale_row[c / FP8_BLOCK];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x3c), 1.5);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // Monotonic over the positive codes.
        for b in 1u8..0x7e {
            assert!(e4m3_to_f32(b + 1) > e4m3_to_f32(b), "{b:#x}");
        }
    }

    #[test]
    fn blocks_take_their_own_scale() {
        // 130 x 200: a 2 x 2 scale grid with partial edge blocks.
        let (rows, cols) = (130, 200);
        let data = vec![0x38u8; rows * cols]; // every element 1.0 before scaling
        let m = Fp8BlockMatrix::new(rows, cols, data, vec![1.0, 2.0, 3.0, 4.0]);
        let mut row = vec![0f32; cols];
        m.dequant_row(0, &mut row);
        assert_eq!((row[0], row[127], row[128], row[199]), (1.0, 1.0, 2.0, 2.0));
        m.dequant_row(129, &mut row);
        assert_eq!((row[0], row[128]), (3.0, 4.0));
    }
}
