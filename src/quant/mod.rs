//! Weight formats. Every format implements [`QuantMatrix`]: a `[rows, cols]` matrix (rows = output
//! features, cols = input features, as in `nn.Linear.weight`) that can hand out any row as f32. The CPU
//! backend builds its products on that one method, so a new format needs only its dequantisation.

mod dense;
pub mod fp4;
pub mod fp8;
mod ggml;
mod kquant;
pub mod packed;
pub mod interleaved;
pub mod q8dot;
pub mod synthetic;

pub use dense::{DenseMatrix, DenseData};
pub use ggml::{BlockBytes, BlockSource, GgmlFormat, GgmlMatrix};

/// Element types a weight can be stored in.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 with a scale per 128×128 block.
    F8E4M3,
    /// GGML block formats (GGUF files), see [`GgmlFormat`].
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    Q5_0,
    Q5_1,
    /// FP4 (E2M1) in blocks of 32 with a power-of-two scale (OCP microscaling).
    MXFP4,
    /// FP4 (E2M1) in blocks of 16 with an FP8 (E4M3) scale each (GGUF's four-block layout).
    NVFP4,
    /// ROCmFP4 (GGUF type 100): blocks of 32, a scale for each half.
    ROCMFP4,
    /// ROCmFP4 (GGUF type 101): blocks of 32, one scale.
    ROCMFP4_FAST,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "fp8_e4m3",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::IQ4_NL => "iq4_nl",
            DType::IQ4_XS => "iq4_xs",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::MXFP4 => "mxfp4",
            DType::NVFP4 => "nvfp4",
            DType::ROCMFP4 => "q4_0_rocmfp4",
            DType::ROCMFP4_FAST => "q4_0_rocmfp4_fast",
        }
    }
}

pub trait QuantMatrix: Send + Sync + std::fmt::Debug {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn dtype(&self) -> DType;
    /// Bytes the matrix occupies in its stored format.
    fn storage_bytes(&self) -> usize;
    /// Writes row `row` as f32 into `out` (`out.len() == cols`).
    fn dequant_row(&self, row: usize, out: &mut [f32]);
    /// (seed, scale) for benchmark matrices whose values are a hash of their index: a GPU backend
    /// generates those on the device instead of copying them.
    fn synthetic(&self) -> Option<(u64, f32)> {
        None
    }
    /// The E4M3 codes (`rows * cols`) and the scale grid of an FP8 block-scaled matrix, for backends
    /// that keep the format as it is.
    fn fp8_blocks(&self) -> Option<(&[u8], &[f32])> {
        None
    }
    /// The GGML blocks themselves, for backends that keep them packed (see [`packed`]).
    fn as_ggml(&self) -> Option<&GgmlMatrix> {
        None
    }
    /// GGML blocks repacked for the CPU's integer kernels.
    fn as_interleaved(&self) -> Option<&interleaved::InterleavedMatrix> {
        None
    }
    /// An NVFP4 safetensors matrix, likewise.
    fn as_nvfp4(&self) -> Option<&fp4::Nvfp4Matrix> {
        None
    }
    /// (matrix, rows) when this is some rows of another matrix.
    fn row_selection(&self) -> Option<(&dyn QuantMatrix, &[usize])> {
        None
    }
}

/// Some rows of a matrix, in a given order: one part of a fused projection.
#[derive(Debug)]
pub struct RowSelection {
    inner: std::sync::Arc<dyn QuantMatrix>,
    rows: Vec<usize>,
}

impl RowSelection {
    pub fn new(inner: std::sync::Arc<dyn QuantMatrix>, rows: Vec<usize>) -> crate::Result<Self> {
        if let Some(bad) = rows.iter().find(|&&r| r >= inner.rows()) {
            return Err(crate::Error::InvalidArgument(format!("row {bad} of a matrix of {} rows", inner.rows())));
        }
        Ok(RowSelection { inner, rows })
    }
}

impl QuantMatrix for RowSelection {
    fn rows(&self) -> usize {
        self.rows.len()
    }
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn storage_bytes(&self) -> usize {
        self.inner.storage_bytes() / self.inner.rows().max(1) * self.rows.len()
    }
    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        self.inner.dequant_row(self.rows[row], out)
    }
    fn row_selection(&self) -> Option<(&dyn QuantMatrix, &[usize])> {
        Some((self.inner.as_ref(), &self.rows))
    }
}

/// A range of columns of a matrix: one input's part of a projection of concatenated inputs
/// (`[a; b] · Wᵀ = a · W_aᵀ + b · W_bᵀ`).
#[derive(Debug)]
pub struct ColumnRange {
    inner: std::sync::Arc<dyn QuantMatrix>,
    start: usize,
    len: usize,
}

impl ColumnRange {
    pub fn new(inner: std::sync::Arc<dyn QuantMatrix>, start: usize, len: usize) -> crate::Result<Self> {
        if start.checked_add(len).is_none_or(|end| end > inner.cols()) {
            return Err(crate::Error::InvalidArgument(format!("columns {start}..+{len} of a matrix of {} columns", inner.cols())));
        }
        Ok(ColumnRange { inner, start, len })
    }
}

impl QuantMatrix for ColumnRange {
    fn rows(&self) -> usize {
        self.inner.rows()
    }
    fn cols(&self) -> usize {
        self.len
    }
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn storage_bytes(&self) -> usize {
        self.inner.storage_bytes() / self.inner.cols().max(1) * self.len
    }
    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let mut whole = vec![0f32; self.inner.cols()];
        self.inner.dequant_row(row, &mut whole);
        out.copy_from_slice(&whole[self.start..self.start + self.len]);
    }
}

/// Dot product with a fixed summation order (eight interleaved partial sums, then a fixed tree), so
/// results are reproducible and the compiler can vectorise the loop.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut tail = 0f32;
    for i in chunks..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `dots` in AVX registers, written out: left to the compiler, the N rows become the vector
/// lanes (a transposed, shuffling loop). The same lanes and operations, so the same bits.
///
/// # Safety
/// The CPU must support AVX.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
pub unsafe fn dots_avx<const N: usize>(a: &[f32], b: [&[f32]; N]) -> [f32; N] {
    use std::arch::x86_64::*;
    let chunks = a.len() / 8 * 8;
    let mut acc = [_mm256_setzero_ps(); N];
    for c in (0..chunks).step_by(8) {
        // SAFETY: eight floats from c in each (bounds checked by the slices).
        let va = unsafe { _mm256_loadu_ps(a[c..c + 8].as_ptr()) };
        for (acc, b) in acc.iter_mut().zip(&b) {
            // SAFETY: as above.
            let vb = unsafe { _mm256_loadu_ps(b[c..c + 8].as_ptr()) };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(va, vb));
        }
    }
    let mut out = [0f32; N];
    for n in 0..N {
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[n]) };
        let mut tail = 0f32;
        for i in chunks..a.len() {
            tail += a[i] * b[n][i];
        }
        out[n] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail;
    }
    out
}

/// `dot(a, b)` for each of N rows `b`, with the same bits, interleaved: N independent chains of
/// adds instead of one, so a core keeps several in flight (one `dot` waits on each add).
#[inline(always)]
pub fn dots<const N: usize>(a: &[f32], b: [&[f32]; N]) -> [f32; N] {
    let chunks = a.len() / 8 * 8;
    let mut acc = [[0f32; 8]; N];
    for c in (0..chunks).step_by(8) {
        let ca: [f32; 8] = a[c..c + 8].try_into().expect("eight values");
        for (acc, b) in acc.iter_mut().zip(b) {
            let cb: [f32; 8] = b[c..c + 8].try_into().expect("eight values");
            for i in 0..8 {
                acc[i] += ca[i] * cb[i];
            }
        }
    }
    let mut out = [0f32; N];
    for n in 0..N {
        let mut tail = 0f32;
        for i in chunks..a.len() {
            tail += a[i] * b[n][i];
        }
        let acc = &acc[n];
        out[n] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_give_the_bits_of_dot() {
        let mut rng = crate::sampling::Rng::new(3);
        for len in [8, 100, 128, 131] {
            let mut random = || (0..len).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect::<Vec<f32>>();
            let (a, rows) = (random(), [random(), random(), random(), random()]);
            let got = dots(&a, [&rows[0][..], &rows[1], &rows[2], &rows[3]]);
            for (row, got) in rows.iter().zip(got) {
                assert_eq!(got.to_bits(), dot(&a, row).to_bits(), "length {len}");
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx") {
                // SAFETY: AVX, checked above.
                let wide = unsafe { dots_avx(&a, [&rows[0][..], &rows[1], &rows[2], &rows[3]]) };
                assert_eq!(wide.map(f32::to_bits), got.map(f32::to_bits), "length {len}");
            }
        }
    }

    #[test]
    fn a_column_range_holds_those_columns_of_every_row() {
        let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let whole: std::sync::Arc<dyn QuantMatrix> = std::sync::Arc::new(DenseMatrix::new(3, 4, DenseData::F32(data)));
        let right = ColumnRange::new(whole.clone(), 1, 3).unwrap();
        let mut row = [f32::NAN; 3];
        right.dequant_row(2, &mut row);
        assert_eq!((right.rows(), right.cols(), row), (3, 3, [9.0, 10.0, 11.0]));
        assert!(ColumnRange::new(whole.clone(), 2, 3).is_err());
        assert!(ColumnRange::new(whole, usize::MAX, 2).is_err());
    }

    #[test]
    fn dot_matches_f64_sum() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - exact).abs() < 1e-5);
    }
}
