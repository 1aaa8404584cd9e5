//! GGML block formats (the weights of GGUF files): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (blocks of 32), the
//! k-quants Q4_K, Q5_K, Q6_K and IQ4_XS (super-blocks of 256), and the FP4 formats MXFP4, NVFP4 and
//! ROCmFP4 (`super::fp4`). A matrix keeps its raw blocks, row-major, each row a whole
//! number of blocks; `dequant_row` is the CPU reference and follows ggml's `dequantize_row_*` step for
//! step (same products in the same order, all in f32), so it matches ggml's own output.

use std::ops::Range;
use std::sync::Arc;

use super::{fp4, kquant, DType, QuantMatrix};
use crate::{Error, Result};

/// The block formats Atlas can decode.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlFormat {
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    NVFP4,
    /// ROCmFP4 with two scales a block (GGUF type 100, the ROCmFPX fork's `q4_0_rocmfp4`).
    ROCMFP4,
    /// ROCmFP4 with one scale a block (type 101, `q4_0_rocmfp4_fast`).
    ROCMFP4_FAST,
    /// 5 bits: Q4_0 and Q4_1 with a fifth bit a value (llama.cpp puts them where a row is not whole
    /// k-quant super-blocks, as in SmolLM2's Q4_K_M).
    Q5_0,
    Q5_1,
}

/// Elements per k-quant super-block (ggml's QK_K).
const QK_K: usize = 256;

impl GgmlFormat {
    /// Their order is the kernels' format ids (kernels/common/packed.h).
    pub const ALL: [GgmlFormat; 14] = [
        GgmlFormat::Q8_0,
        GgmlFormat::Q4_0,
        GgmlFormat::Q4_1,
        GgmlFormat::Q4_K,
        GgmlFormat::Q5_K,
        GgmlFormat::Q6_K,
        GgmlFormat::IQ4_NL,
        GgmlFormat::IQ4_XS,
        GgmlFormat::MXFP4,
        GgmlFormat::NVFP4,
        GgmlFormat::ROCMFP4,
        GgmlFormat::ROCMFP4_FAST,
        GgmlFormat::Q5_0,
        GgmlFormat::Q5_1,
    ];

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlFormat::Q8_0 | GgmlFormat::Q4_0 | GgmlFormat::Q4_1 | GgmlFormat::IQ4_NL | GgmlFormat::MXFP4 => 32,
            GgmlFormat::Q5_0 | GgmlFormat::Q5_1 => 32,
            GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => 32,
            GgmlFormat::NVFP4 => 64,
            GgmlFormat::Q4_K | GgmlFormat::Q5_K | GgmlFormat::Q6_K | GgmlFormat::IQ4_XS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlFormat::Q8_0 => 34,
            GgmlFormat::Q4_0 => 18,
            GgmlFormat::Q4_1 => 20,
            GgmlFormat::Q5_0 => 22,
            GgmlFormat::Q5_1 => 24,
            GgmlFormat::Q4_K => 144,
            GgmlFormat::Q5_K => 176,
            GgmlFormat::Q6_K => 210,
            GgmlFormat::IQ4_NL => 18,
            GgmlFormat::IQ4_XS => 136,
            GgmlFormat::MXFP4 => 17,
            GgmlFormat::NVFP4 => 36,
            GgmlFormat::ROCMFP4 => 18,
            GgmlFormat::ROCMFP4_FAST => 17,
        }
    }

    /// The type number of this format in ggml's `ggml_type` enum (as stored in GGUF files).
    pub fn ggml_type(self) -> u32 {
        match self {
            GgmlFormat::Q4_0 => 2,
            GgmlFormat::Q4_1 => 3,
            GgmlFormat::Q5_0 => 6,
            GgmlFormat::Q5_1 => 7,
            GgmlFormat::Q8_0 => 8,
            GgmlFormat::Q4_K => 12,
            GgmlFormat::Q5_K => 13,
            GgmlFormat::Q6_K => 14,
            GgmlFormat::IQ4_NL => 20,
            GgmlFormat::IQ4_XS => 23,
            GgmlFormat::MXFP4 => 39,
            GgmlFormat::NVFP4 => 40,
            GgmlFormat::ROCMFP4 => 100,
            GgmlFormat::ROCMFP4_FAST => 101,
        }
    }

    pub fn from_ggml_type(t: u32) -> Option<Self> {
        GgmlFormat::ALL.into_iter().find(|f| f.ggml_type() == t)
    }

    pub fn dtype(self) -> DType {
        match self {
            GgmlFormat::Q8_0 => DType::Q8_0,
            GgmlFormat::Q4_0 => DType::Q4_0,
            GgmlFormat::Q4_1 => DType::Q4_1,
            GgmlFormat::Q5_0 => DType::Q5_0,
            GgmlFormat::Q5_1 => DType::Q5_1,
            GgmlFormat::Q4_K => DType::Q4_K,
            GgmlFormat::Q5_K => DType::Q5_K,
            GgmlFormat::Q6_K => DType::Q6_K,
            GgmlFormat::IQ4_NL => DType::IQ4_NL,
            GgmlFormat::IQ4_XS => DType::IQ4_XS,
            GgmlFormat::MXFP4 => DType::MXFP4,
            GgmlFormat::NVFP4 => DType::NVFP4,
            GgmlFormat::ROCMFP4 => DType::ROCMFP4,
            GgmlFormat::ROCMFP4_FAST => DType::ROCMFP4_FAST,
        }
    }

    pub fn from_dtype(d: DType) -> Option<Self> {
        GgmlFormat::ALL.into_iter().find(|f| f.dtype() == d)
    }

    pub fn name(self) -> &'static str {
        self.dtype().name()
    }

    /// Bytes of one row of `cols` elements; `None` unless `cols` is a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_size()) {
            return None;
        }
        (cols / self.block_size()).checked_mul(self.block_bytes())
    }

    /// Decodes whole blocks: `blocks.len()` must be `n * block_bytes()` and `out.len()` `n * block_size()`.
    pub fn dequant_blocks(self, blocks: &[u8], out: &mut [f32]) {
        let (bs, bb) = (self.block_size(), self.block_bytes());
        assert!(
            blocks.len().is_multiple_of(bb) && out.len() == blocks.len() / bb * bs,
            "{}: {} bytes do not decode into {} values",
            self.name(),
            blocks.len(),
            out.len()
        );
        for (b, y) in blocks.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
            match self {
                GgmlFormat::Q8_0 => q8_0(b, y),
                GgmlFormat::Q4_0 => q4_0(b, y),
                GgmlFormat::Q4_1 => q4_1(b, y),
                GgmlFormat::Q5_0 => q5_0(b, y),
                GgmlFormat::Q5_1 => q5_1(b, y),
                GgmlFormat::Q4_K => q4_k(b, y),
                GgmlFormat::Q5_K => q5_k(b, y),
                GgmlFormat::Q6_K => q6_k(b, y),
                GgmlFormat::IQ4_NL => iq4_nl(b, y),
                GgmlFormat::IQ4_XS => iq4_xs(b, y),
                GgmlFormat::MXFP4 => fp4::mxfp4(b, y),
                GgmlFormat::NVFP4 => fp4::nvfp4_ggml(b, y),
                GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => fp4::rocmfp4(b, y),
            }
        }
    }
}

impl GgmlFormat {
    /// The formats `quantize_row` can write.
    pub const WRITABLE: [GgmlFormat; 7] = [
        GgmlFormat::Q8_0,
        GgmlFormat::Q4_0,
        GgmlFormat::Q4_K,
        GgmlFormat::Q5_K,
        GgmlFormat::Q6_K,
        GgmlFormat::ROCMFP4,
        GgmlFormat::ROCMFP4_FAST,
    ];

    /// Encodes a row of `x.len()` values (a whole number of blocks) as this format's blocks;
    /// None for a format Atlas only reads. Q8_0 and Q4_0 round as ggml's reference quantisers
    /// do; Q4_K, Q5_K and Q6_K fit their scales by least squares (kquant); ROCmFP4 chooses its scales
    /// as the ROCmFPX fork does (fp4::rocmfp4_quantize).
    pub fn quantize_row(self, x: &[f32]) -> Option<Vec<u8>> {
        let bs = self.block_size();
        if !x.len().is_multiple_of(bs) || !GgmlFormat::WRITABLE.contains(&self) {
            return None;
        }
        let mut out = Vec::with_capacity(x.len() / bs * self.block_bytes());
        for block in x.chunks_exact(bs) {
            match self {
                GgmlFormat::Q8_0 => quantize_q8_0(block, &mut out),
                GgmlFormat::Q4_0 => quantize_q4_0(block, &mut out),
                GgmlFormat::Q4_K => kquant::quantize_q4_k(block, &mut out),
                GgmlFormat::Q5_K => kquant::quantize_q5_k(block, &mut out),
                GgmlFormat::Q6_K => kquant::quantize_q6_k(block, &mut out),
                GgmlFormat::ROCMFP4 => fp4::rocmfp4_quantize(block, true, &mut out),
                _ => fp4::rocmfp4_quantize(block, false, &mut out),
            }
        }
        Some(out)
    }
}

/// Q8_0: d = max|x| / 127, q = round(x / d) (multiplying by 1/d, as ggml).
fn quantize_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(half::f16::from_f32(d).to_le_bytes());
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// Q4_0: the value of largest magnitude maps to -8: d = max / -8, q = min(15, trunc(x / d + 8.5)).
fn quantize_q4_0(x: &[f32], out: &mut Vec<u8>) {
    let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
    out.extend(half::f16::from_f32(d).to_le_bytes());
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

impl std::fmt::Display for GgmlFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// block_q8_0 { f16 d; i8 qs[32] }: y = q * d.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = (q as i8) as f32 * d;
    }
}

/// block_q4_0 { f16 d; u8 qs[16] }: low nibbles are elements 0..16, high nibbles 16..32; y = (q - 8) * d.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// block_q4_1 { f16 d; f16 m; u8 qs[16] }: y = q * d + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        lo[j] = (q & 0x0F) as f32 * d + m;
        hi[j] = (q >> 4) as f32 * d + m;
    }
}

/// The fifth bits of Q5_0 / Q5_1: bit j of `qh` (four little-endian bytes) for value j, as bit 4.
fn q5_high(qh: &[u8], j: usize) -> u8 {
    ((u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]) >> j) as u8 & 1) << 4
}

/// Q5_0: d (f16), 32 fifth bits, then Q4_0's nibbles; value = (q - 16) · d.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[6..22].iter().enumerate() {
        lo[j] = (((q & 0x0F) | q5_high(&b[2..6], j)) as i32 - 16) as f32 * d;
        hi[j] = (((q >> 4) | q5_high(&b[2..6], j + 16)) as i32 - 16) as f32 * d;
    }
}

/// Q5_1: d and m (f16), 32 fifth bits, then Q4_1's nibbles; value = q · d + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[8..24].iter().enumerate() {
        lo[j] = ((q & 0x0F) | q5_high(&b[4..8], j)) as f32 * d + m;
        hi[j] = ((q >> 4) | q5_high(&b[4..8], j + 16)) as f32 * d + m;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 `scales` bytes of Q4_K / Q5_K
/// (ggml's `get_scale_min_k4`).
pub(super) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }: eight sub-blocks of 32, each with its
/// own 6-bit scale and min; y = d*sc * q - dmin*m.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            hi[l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }: Q4_K plus a fifth bit per
/// element from `qh` (bit 2*chunk for the low nibbles, 2*chunk+1 for the high ones).
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (ql, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            lo[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            hi[l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }: 6-bit values (low 4 bits in `ql`, high
/// 2 in `qh`) minus 32, sixteen sub-blocks of 16 with an 8-bit scale each; y = d * sc * q.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// The 16 non-linear 4-bit levels of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub(super) const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// block_iq4_nl { f16 d; u8 qs[16] }: low nibbles are elements 0..16, high nibbles 16..32; y = d *
/// IQ4_LEVELS[q].
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    iq4_run(f16_at(b, 0), &b[2..18], y);
}

/// 32 elements from 16 bytes of IQ4 codes at scale `d`: low nibbles first, then high nibbles.
fn iq4_run(d: f32, qs: &[u8], y: &mut [f32]) {
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in qs.iter().enumerate() {
        lo[j] = d * IQ4_LEVELS[(q & 0x0F) as usize] as f32;
        hi[j] = d * IQ4_LEVELS[(q >> 4) as usize] as f32;
    }
}

/// block_iq4_xs { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }: eight runs of 32 as IQ4_NL's,
/// each at d * (ls - 32) with the 6-bit ls of run i = nibble i of `scales_l` (low first) | 2 bits
/// of `scales_h` at 2i, shifted up by 4.
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    for (i, (qs, out)) in b[8..136].chunks_exact(16).zip(y.chunks_exact_mut(32)).enumerate() {
        let low = (scales_l[i / 2] >> (4 * (i % 2))) & 0x0F;
        let high = ((scales_h >> (2 * i)) & 3) as u8;
        let ls = (low | (high << 4)) as i32 - 32;
        iq4_run(d * ls as f32, qs, out);
    }
}

/// A `[rows, cols]` matrix of GGML blocks, row-major; every row is `cols / block_size` blocks.
/// The bytes a matrix's blocks live in: its own, or a range of something shared (a GGUF file's
/// mapping, kept alive by the matrices that read it: the weights are not copied).
#[derive(Clone)]
pub enum BlockBytes {
    Owned(Vec<u8>),
    Shared { source: Arc<dyn BlockSource>, range: Range<usize> },
}

/// Bytes that blocks can share without a copy: a file's mapping, or memory.
pub trait BlockSource: AsRef<[u8]> + Send + Sync {
    /// Lets the OS drop `range`'s pages from this process's memory where the file can give them
    /// back on the next read (a mapping); memory keeps its bytes.
    fn release(&self, _range: Range<usize>) {}
}

impl BlockBytes {
    /// Once bytes `part` of these blocks have been copied into another layout: their pages of a
    /// mapped file need not stay resident (they would count against the process twice).
    pub fn release(&self, part: Range<usize>) {
        if let BlockBytes::Shared { source, range } = self {
            source.release(range.start + part.start..range.start + part.end.min(range.len()));
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            BlockBytes::Owned(bytes) => bytes,
            BlockBytes::Shared { source, range } => &(**source).as_ref()[range.clone()],
        }
    }
}

impl From<Vec<u8>> for BlockBytes {
    fn from(bytes: Vec<u8>) -> Self {
        BlockBytes::Owned(bytes)
    }
}

pub struct GgmlMatrix {
    rows: usize,
    cols: usize,
    format: GgmlFormat,
    row_bytes: usize,
    data: BlockBytes,
}

impl std::fmt::Debug for GgmlMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgmlMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

impl GgmlMatrix {
    /// `data` holds the rows' blocks back to back. Errors (`InvalidArgument`) when `cols` is not a
    /// whole number of blocks or the byte count does not match.
    pub fn new(format: GgmlFormat, rows: usize, cols: usize, data: impl Into<BlockBytes>) -> Result<Self> {
        let data = data.into();
        let row_bytes = format.row_bytes(cols).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{format} stores rows in blocks of {} values, but a row has {cols}",
                format.block_size()
            ))
        })?;
        let expected = row_bytes.checked_mul(rows);
        if expected != Some(data.as_slice().len()) {
            return Err(Error::InvalidArgument(format!(
                "{format} matrix [{rows}, {cols}] needs {} bytes, got {}",
                expected.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
                data.as_slice().len()
            )));
        }
        Ok(GgmlMatrix { rows, cols, format, row_bytes, data })
    }

    pub fn format(&self) -> GgmlFormat {
        self.format
    }

    /// All blocks, row after row (for backends that decode on the device).
    pub fn blocks(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// The blocks of one row.
    pub fn row_blocks(&self, row: usize) -> &[u8] {
        &self.data.as_slice()[row * self.row_bytes..(row + 1) * self.row_bytes]
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// See `BlockBytes::release`: the pages of these rows.
    pub fn release_rows(&self, rows: Range<usize>) {
        self.data.release(rows.start * self.row_bytes..rows.end * self.row_bytes);
    }
}

impl QuantMatrix for GgmlMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn dtype(&self) -> DType {
        self.format.dtype()
    }

    fn storage_bytes(&self) -> usize {
        self.data.as_slice().len()
    }

    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        self.format.dequant_blocks(self.row_blocks(row), out);
    }

    fn as_ggml(&self) -> Option<&GgmlMatrix> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dot;

    /// A small deterministic generator (SplitMix64), so tests need no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    #[test]
    fn written_blocks_decode_back_close_to_their_values() {
        let mut rng = Rng(11);
        for format in GgmlFormat::WRITABLE {
            let x: Vec<f32> = (0..4 * format.block_size()).map(|_| rng.unit() * 0.1).collect();
            let blocks = format.quantize_row(&x).unwrap();
            assert_eq!(blocks.len(), 4 * format.block_bytes(), "{format}");
            let mut y = vec![0f32; x.len()];
            format.dequant_blocks(&blocks, &mut y);
            // Worst error relative to the block's largest value: half a step of 127, 8, and the
            // coarsest step of ROCmFP4's codebook (2 of 10).
            let bound = match format {
                GgmlFormat::Q8_0 => 0.5 / 127.0,
                GgmlFormat::Q4_0 => 1.0 / 8.0,
                // Half a step of the sub-block's range (15 or 63 steps) plus the 6- and 8-bit
                // rounding of its scale against the super-block's (Q5_K: 31 steps).
                GgmlFormat::Q4_K => 0.1,
                GgmlFormat::Q5_K => 0.05,
                GgmlFormat::Q6_K => 0.04,
                _ => 0.15,
            };
            for (bx, by) in x.chunks(format.block_size()).zip(y.chunks(format.block_size())) {
                let amax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                let worst = bx.iter().zip(by).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= bound * amax * 1.01, "{format}: {worst} of {amax}");
            }
        }
        assert_eq!(GgmlFormat::IQ4_XS.quantize_row(&[0.0; 256]), None);
        assert_eq!(GgmlFormat::Q8_0.quantize_row(&[0.0; 31]), None);
        // A known block: max|x| = 127, so d = 1 and q = round(x) (halves away from zero).
        let mut x = [0f32; 32];
        x[..4].copy_from_slice(&[127.0, -127.0, 3.4, -2.5]);
        let b = GgmlFormat::Q8_0.quantize_row(&x).unwrap();
        assert_eq!((f16_at(&b, 0), &b[2..6]), (1.0, [127u8, 129, 3, 253].as_slice()));
        // Q4_0: the largest magnitude (-8) maps to code 0 at d = 1; 7 to 15.
        x[..4].copy_from_slice(&[-8.0, 7.0, 0.4, 0.6]);
        let b = GgmlFormat::Q4_0.quantize_row(&x).unwrap();
        assert_eq!((f16_at(&b, 0), b[2] & 0x0F, b[3] & 0x0F, b[4] & 0x0F, b[5] & 0x0F), (1.0, 0, 15, 8, 9));
    }

    #[test]
    fn matrix_vector_product_matches_dequantised_matrix() {
        let mut rng = Rng(7);
        for format in GgmlFormat::ALL {
            let (rows, cols) = (5, 2 * format.block_size());
            let data = crate::quant::synthetic::random_ggml_blocks(format, rows * 2, 7 + format.ggml_type() as u64);
            let m = GgmlMatrix::new(format, rows, cols, data.clone()).unwrap();
            assert_eq!(m.dtype().name(), format.name());
            assert_eq!(m.storage_bytes(), rows * 2 * format.block_bytes());
            // The whole matrix decoded in one go is the reference.
            let mut full = vec![0f32; rows * cols];
            format.dequant_blocks(&data, &mut full);
            let x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                m.dequant_row(r, &mut row);
                assert_eq!(row, full[r * cols..(r + 1) * cols], "{format} row {r}");
                let y = dot(&row, &x);
                let exact: f64 =
                    full[r * cols..(r + 1) * cols].iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let scale: f64 = row.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                assert!((y as f64 - exact).abs() <= 1e-5 * scale.max(1e-3), "{format} row {r}: {y} vs {exact}");
            }
        }
    }

    #[test]
    fn known_values() {
        // Q8_0: d = 0.5, q = -3 .. 28
        let mut b = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 3) as u8));
        let mut y = [0f32; 32];
        GgmlFormat::Q8_0.dequant_blocks(&b, &mut y);
        assert_eq!(y[0], -1.5);
        assert_eq!(y[31], 14.0);
        // Q4_0: d = 2, byte j = (lo = j % 16, hi = 15 - j % 16)
        let mut b = half::f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        GgmlFormat::Q4_0.dequant_blocks(&b, &mut y);
        assert_eq!((y[0], y[15], y[16], y[31]), (-16.0, 14.0, 14.0, -16.0));
        // Q4_1: d = 1, m = -0.25
        let mut b = half::f16::from_f32(1.0).to_le_bytes().to_vec();
        b.extend(half::f16::from_f32(-0.25).to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        GgmlFormat::Q4_1.dequant_blocks(&b, &mut y);
        assert_eq!((y[0], y[15], y[16]), (-0.25, 14.75, 14.75));
        // Q5_0: d = 0.5, fifth bits set for values 1 and 16 (qh = 0x0001_0002), nibbles as Q4_0's.
        let mut b = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend(0x0001_0002u32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        GgmlFormat::Q5_0.dequant_blocks(&b, &mut y);
        // (q | h << 4) - 16, times 0.5: value 0 = 0 - 16, 1 = 17 - 16, 15 = 15 - 16, 16 = 31 - 16, 17 = 14 - 16.
        assert_eq!((y[0], y[1], y[15], y[16], y[17]), (-8.0, 0.5, -0.5, 7.5, -1.0));
        // Q5_1: d = 1, m = -0.25, fifth bit of value 31 only.
        let mut b = half::f16::from_f32(1.0).to_le_bytes().to_vec();
        b.extend(half::f16::from_f32(-0.25).to_le_bytes());
        b.extend(0x8000_0000u32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        GgmlFormat::Q5_1.dequant_blocks(&b, &mut y);
        assert_eq!((y[0], y[15], y[16], y[31]), (-0.25, 14.75, 14.75, 15.75));
    }

    #[test]
    fn rejects_partial_blocks_and_wrong_lengths() {
        assert!(GgmlMatrix::new(GgmlFormat::Q4_K, 1, 128, vec![0; 72]).is_err());
        assert!(GgmlMatrix::new(GgmlFormat::Q8_0, 2, 32, vec![0; 34]).is_err());
        assert!(GgmlMatrix::new(GgmlFormat::Q8_0, 2, 32, vec![0; 68]).is_ok());
        assert_eq!(GgmlFormat::Q6_K.row_bytes(255), None);
        for f in GgmlFormat::ALL {
            assert_eq!(GgmlFormat::from_ggml_type(f.ggml_type()), Some(f));
            assert_eq!(GgmlFormat::from_dtype(f.dtype()), Some(f));
        }
    }
}
