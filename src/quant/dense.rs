//! Unquantised weights: f32, f16 and bf16, stored as they are in the checkpoint.

use half::slice::HalfFloatSliceExt;

use super::{DType, QuantMatrix};

#[derive(Debug, Clone)]
pub enum DenseData {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
}

#[derive(Debug, Clone)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    data: DenseData,
}

impl DenseMatrix {
    /// `data` holds `rows * cols` elements, row-major; the caller has checked the length.
    pub fn new(rows: usize, cols: usize, data: DenseData) -> Self {
        let len = match &data {
            DenseData::F32(v) => v.len(),
            DenseData::F16(v) => v.len(),
            DenseData::BF16(v) => v.len(),
        };
        assert_eq!(len, rows * cols, "dense matrix data length");
        DenseMatrix { rows, cols, data }
    }

    /// Decodes little-endian bytes of `dtype` into a matrix; `bytes.len()` must be rows*cols*size.
    pub fn from_le_bytes(rows: usize, cols: usize, dtype: DType, bytes: &[u8]) -> Self {
        let data = match dtype {
            DType::F32 => DenseData::F32(
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            DType::F16 => DenseData::F16(
                bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect(),
            ),
            DType::BF16 => DenseData::BF16(
                bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect(),
            ),
            other => panic!("DenseMatrix::from_le_bytes: {other:?} is a block format, not a dense dtype"),
        };
        DenseMatrix::new(rows, cols, data)
    }
}

impl QuantMatrix for DenseMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn dtype(&self) -> DType {
        match self.data {
            DenseData::F32(_) => DType::F32,
            DenseData::F16(_) => DType::F16,
            DenseData::BF16(_) => DType::BF16,
        }
    }

    fn storage_bytes(&self) -> usize {
        let size = if self.dtype() == DType::F32 { 4 } else { 2 };
        self.rows * self.cols * size
    }

    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let range = row * self.cols..(row + 1) * self.cols;
        match &self.data {
            DenseData::F32(v) => out.copy_from_slice(&v[range]),
            DenseData::F16(v) => v[range].convert_to_f32_slice(out),
            DenseData::BF16(v) => v[range].convert_to_f32_slice(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_each_dtype() {
        let values = [1.5f32, -2.25, 0.0, 3.0e4];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        for (dtype, bytes) in [(DType::F32, f32_bytes), (DType::F16, f16_bytes), (DType::BF16, bf16_bytes)] {
            let m = DenseMatrix::from_le_bytes(2, 2, dtype, &bytes);
            let mut row = [0f32; 2];
            m.dequant_row(1, &mut row);
            assert_eq!(row[0], 0.0, "{dtype:?}");
            assert!((row[1] - 3.0e4).abs() <= 3.0e4 * 4e-3, "{dtype:?}: {}", row[1]);
        }
    }
}
