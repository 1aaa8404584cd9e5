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

/// Rows `rows` of the block-scaled matrix (`codes`, `scales`) with `cols` columns, as a matrix of
/// their own, when they are whole 128-row blocks (a fused projection split per head, heads being
/// multiples of 128 rows); None otherwise.
pub fn select_row_blocks(codes: &[u8], scales: &[f32], cols: usize, rows: &[usize]) -> Option<Fp8BlockMatrix> {
    let total_rows = codes.len() / cols.max(1);
    let aligned = rows.len().is_multiple_of(FP8_BLOCK)
        && rows.chunks_exact(FP8_BLOCK).all(|b| b[0] % FP8_BLOCK == 0 && b.iter().enumerate().all(|(i, &r)| r == b[0] + i))
        && rows.iter().all(|&r| r < total_rows);
    if !aligned {
        return None;
    }
    let grid_cols = cols.div_ceil(FP8_BLOCK);
    let mut data = Vec::with_capacity(rows.len() * cols);
    let mut picked = Vec::with_capacity(rows.len() / FP8_BLOCK * grid_cols);
    for block in rows.chunks_exact(FP8_BLOCK) {
        data.extend_from_slice(&codes[block[0] * cols..(block[0] + FP8_BLOCK) * cols]);
        let b = block[0] / FP8_BLOCK;
        picked.extend_from_slice(&scales[b * grid_cols..(b + 1) * grid_cols]);
    }
    Some(Fp8BlockMatrix::new(rows.len(), cols, data, picked))
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

#[cfg(test)]
mod row_block_tests {
    use super::*;

    #[test]
    fn whole_row_blocks_keep_their_codes_and_scales() {
        let (rows, cols) = (512, 130);
        let data: Vec<u8> = (0..rows * cols).map(|i| (i % 120) as u8).collect();
        let scales: Vec<f32> = (0..4 * 2).map(|i| 1.0 + i as f32).collect();
        let m = Fp8BlockMatrix::new(rows, cols, data, scales);
        let picked: Vec<usize> = (256..384).chain(0..128).collect();
        let (codes, grid) = m.fp8_blocks().unwrap();
        let part = select_row_blocks(codes, grid, cols, &picked).unwrap();
        let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
        for (i, &r) in picked.iter().enumerate() {
            m.dequant_row(r, &mut want);
            part.dequant_row(i, &mut got);
            assert_eq!(want, got, "row {r}");
        }
        assert!(select_row_blocks(codes, grid, cols, &(1..129).collect::<Vec<_>>()).is_none());
        assert!(select_row_blocks(codes, grid, cols, &(0..64).collect::<Vec<_>>()).is_none());
    }
}
