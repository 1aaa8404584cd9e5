//! FP4 formats: 4-bit codes (a sign bit and eight magnitudes) in small blocks, each block with a
//! scale. MXFP4 (32 E2M1 codes, a power-of-two E8M0 scale) and NVFP4 (16 E2M1 codes, an FP8 E4M3
//! scale) as GGUF stores them, and ROCmFP4 (GGUF types 100 and 101 of the ROCmFPX llama.cpp fork:
//! 32 codes over the magnitudes 0, 1, 2, 3, 4, 6, 8, 10, with one or two "half E4M3" scales). The
//! CPU references; E2M1 codes are kept as doubled integers (-12..12) so a block is integers times
//! one float.

use super::fp8::e4m3_to_f32;
use super::{DType, QuantMatrix};

/// E2M1 code → value × 2 (bit 3 is the sign).
pub(super) const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An unsigned E4M3 scale byte (bias 7; exponent 0 is subnormal: man · 2^-9), halved to undo the
/// doubled codes; 0x7F (the NaN pattern) and 0 are 0.
pub(super) fn ue4m3_half(x: u8) -> f32 {
    let exp = (x >> 3) & 0x0F;
    let man = (x & 7) as f32;
    let value = if exp == 0 { man * (2f32).powi(-9) } else { (1.0 + man / 8.0) * (2f32).powi(exp as i32 - 7) };
    if x == 0 || x == 0x7F { 0.0 } else { value * 0.5 }
}

/// An E8M0 scale byte 2^(e - 127), halved to undo the doubled codes (e = 0 and 1 are the
/// subnormal-range powers 2^-128 and 2^-127 as ggml computes them).
pub(super) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e - 1) as u32) << 23 };
    f32::from_bits(bits)
}

/// block_mxfp4 { u8 e; u8 qs[16] }: low nibbles are elements 0..16, high nibbles 16..32.
pub(super) fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[1..17].iter().enumerate() {
        lo[j] = d * E2M1_DOUBLED[(q & 0x0F) as usize] as f32;
        hi[j] = d * E2M1_DOUBLED[(q >> 4) as usize] as f32;
    }
}

/// block_nvfp4 { u8 scales[4]; u8 qs[32] }: four runs of 16, run s at scale s from 8 bytes of qs:
/// low nibbles are its elements 0..8, high nibbles 8..16.
pub(super) fn nvfp4_ggml(b: &[u8], y: &mut [f32]) {
    for (s, (qs, out)) in b[4..36].chunks_exact(8).zip(y.chunks_exact_mut(16)).enumerate() {
        let d = ue4m3_half(b[s]);
        let (lo, hi) = out.split_at_mut(8);
        for (j, &q) in qs.iter().enumerate() {
            lo[j] = d * E2M1_DOUBLED[(q & 0x0F) as usize] as f32;
            hi[j] = d * E2M1_DOUBLED[(q >> 4) as usize] as f32;
        }
    }
}

/// A `[rows, cols]` NVFP4 weight as safetensors checkpoints hold it (NVIDIA ModelOpt, and
/// compressed-tensors' `nvfp4-pack-quantized`): E2M1 codes two per byte along a row (element 2j in
/// the low nibble of byte j), one FP8 E4M3 scale per 16 elements of a row (`[rows, cols / 16]`,
/// row-major), and one f32 factor for the whole tensor (ModelOpt's `weight_scale_2`; the inverse
/// of compressed-tensors' `weight_global_scale`). y = e2m1(code) · e4m3(scale) · factor.
pub struct Nvfp4Matrix {
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
    scales: Vec<u8>,
    factor: f32,
}

impl std::fmt::Debug for Nvfp4Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nvfp4Matrix [{}, {}] × {}", self.rows, self.cols, self.factor)
    }
}

impl Nvfp4Matrix {
    /// `codes`: `rows * cols / 2` bytes; `scales`: `rows * cols / 16` E4M3 bytes.
    pub fn new(rows: usize, cols: usize, codes: Vec<u8>, scales: Vec<u8>, factor: f32) -> Result<Self, String> {
        if !cols.is_multiple_of(16) {
            return Err(format!("NVFP4 rows of {cols} values are not whole groups of 16"));
        }
        let want = (rows.checked_mul(cols / 2), rows.checked_mul(cols / 16));
        if want != (Some(codes.len()), Some(scales.len())) {
            return Err(format!("NVFP4 [{rows}, {cols}] needs {:?} code and scale bytes, got {} and {}", want, codes.len(), scales.len()));
        }
        if !factor.is_finite() {
            return Err(format!("NVFP4 tensor scale {factor} is not finite"));
        }
        Ok(Nvfp4Matrix { rows, cols, codes, scales, factor })
    }

    /// (codes, scales, factor) as `new` took them.
    pub fn parts(&self) -> (&[u8], &[u8], f32) {
        (&self.codes, &self.scales, self.factor)
    }
}

impl QuantMatrix for Nvfp4Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn dtype(&self) -> DType {
        DType::NVFP4
    }
    fn storage_bytes(&self) -> usize {
        self.codes.len() + self.scales.len() + 4
    }
    fn as_nvfp4(&self) -> Option<&Nvfp4Matrix> {
        Some(self)
    }
    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let codes = &self.codes[row * self.cols / 2..(row + 1) * self.cols / 2];
        let scales = &self.scales[row * self.cols / 16..(row + 1) * self.cols / 16];
        for ((group, bytes), &scale) in out.chunks_exact_mut(16).zip(codes.chunks_exact(8)).zip(scales) {
            // Halved: the codes are doubled.
            let d = e4m3_to_f32(scale) * self.factor * 0.5;
            for (pair, &q) in group.chunks_exact_mut(2).zip(bytes) {
                pair[0] = d * E2M1_DOUBLED[(q & 0x0F) as usize] as f32;
                pair[1] = d * E2M1_DOUBLED[(q >> 4) as usize] as f32;
            }
        }
    }
}

/// The E4M3 byte (0..=0x7E) nearest a non-negative value, ties to the even byte; values past 448
/// saturate. By bisection over the byte order, which is the value order for non-negative bytes.
fn e4m3_nearest(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= x { lo = mid } else { hi = mid }
    }
    let (dl, dh) = (x - e4m3_to_f32(lo), e4m3_to_f32(hi) - x);
    if dl < dh || (dl == dh && lo % 2 == 0) { lo } else { hi }
}

/// The nearest E2M1 code of `x` (ties to the smaller magnitude).
fn e2m1_nearest(x: f32) -> u8 {
    const UPPER: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let level = if x.is_finite() { UPPER.iter().position(|&u| x.abs() <= u).unwrap_or(7) } else { 0 } as u8;
    if level != 0 && x < 0.0 { level | 8 } else { level }
}

/// Encodes a `[rows, cols]` row-major matrix (cols a multiple of 16) as NVFP4 the way ModelOpt
/// lays it out: (codes two per byte, E4M3 scales per 16, the per-tensor scale). The tensor scale
/// maps the largest value to the largest block scale (448) times the largest code (6); each
/// block's scale is its own largest value over 6, in units of the tensor scale, rounded to E4M3;
/// each value rounds to the nearest code at its block's scale.
pub fn nvfp4_quantize(x: &[f32], cols: usize) -> (Vec<u8>, Vec<u8>, f32) {
    let amax = x.iter().fold(0f32, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
    let tensor_scale = if amax > 0.0 { amax / (448.0 * 6.0) } else { 1.0 };
    let mut codes = Vec::with_capacity(x.len() / 2);
    let mut scales = Vec::with_capacity(x.len() / 16);
    for row in x.chunks_exact(cols) {
        for group in row.chunks_exact(16) {
            let block_max = group.iter().fold(0f32, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
            let e = e4m3_nearest(block_max / 6.0 / tensor_scale);
            let step = e4m3_to_f32(e) * tensor_scale;
            let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
            scales.push(e);
            codes.extend(group.chunks_exact(2).map(|p| e2m1_nearest(p[0] * inv) | (e2m1_nearest(p[1] * inv) << 4)));
        }
    }
    (codes, scales, tensor_scale)
}

/// ROCmFP4's "Codebook10": code → signed integer (bit 3 is the sign; code 8 is 0).
pub(super) const CODEBOOK10: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 10, 0, -1, -2, -3, -4, -6, -8, -10];

/// ROCmFP4's scale byte (4-bit exponent, 3-bit mantissa, bias 8): 2^(exp-8) · (1 + man/8), or
/// man · 2^-10 for exp 0. Bytes past 0x7E are invalid in the fork's files and decode to 0, as its
/// CPU code does.
pub(super) fn rocmfp4_scale(x: u8) -> f32 {
    let (exp, man) = ((x >> 3) as i32, (x & 7) as f32);
    match (x, exp) {
        (0x7F.., _) => 0.0,
        (_, 0) => man * (2f32).powi(-10),
        _ => (1.0 + man / 8.0) * (2f32).powi(exp - 8),
    }
}

/// block_rocmfp4 { u8 qs[16]; u8 e[2] } (type 100) or { u8 qs[16]; u8 e } (type 101): the codes
/// come first; low nibbles are elements 0..16 (scale e[0]), high nibbles 16..32 (e[1], or e again).
pub(super) fn rocmfp4(b: &[u8], y: &mut [f32]) {
    let (lo_scale, hi_scale) = match b.len() {
        18 => (rocmfp4_scale(b[16]), rocmfp4_scale(b[17])),
        _ => (rocmfp4_scale(b[16]), rocmfp4_scale(b[16])),
    };
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[..16].iter().enumerate() {
        lo[j] = lo_scale * CODEBOOK10[(q & 0x0F) as usize] as f32;
        hi[j] = hi_scale * CODEBOOK10[(q >> 4) as usize] as f32;
    }
}

/// The nearest Codebook10 index (0..8) for |x| / s = `a` (ties to the smaller magnitude, as the
/// fork rounds).
fn rocmfp4_level(a: f32) -> usize {
    const UPPER: [f32; 7] = [0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 9.0];
    UPPER.iter().position(|&u| a <= u).unwrap_or(7)
}

/// Codes for `x` at scale byte `e` (code 0 for non-finite values and for scale 0).
fn rocmfp4_codes(x: &[f32], e: u8, codes: &mut [u8]) {
    let s = rocmfp4_scale(e);
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    for (c, &v) in codes.iter_mut().zip(x) {
        let level = if v.is_finite() { rocmfp4_level((v * inv).abs()) } else { 0 };
        *c = if level != 0 && v < 0.0 { level as u8 | 8 } else { level as u8 };
    }
}

/// The scale byte of one group: the one of 1..=126 with the least squared error (ties to the
/// smaller byte), 0 for a group with no finite non-zero largest value or with a NaN (the
/// fork's results, byte for byte).
fn rocmfp4_group_scale(x: &[f32]) -> u8 {
    let max_abs = x.iter().fold(0f32, |m, &v| if v.abs() > m { v.abs() } else { m });
    if !(max_abs > 0.0 && max_abs.is_finite()) {
        return 0;
    }
    let mut codes = vec![0u8; x.len()];
    let mut best = (f32::INFINITY, 0u8);
    for e in 1..=0x7Eu8 {
        rocmfp4_codes(x, e, &mut codes);
        let s = rocmfp4_scale(e);
        let err = x.iter().zip(&codes).fold(0f32, |acc, (&v, &c)| {
            let d = v - CODEBOOK10[c as usize] as f32 * s;
            acc + d * d
        });
        if err < best.0 {
            best = (err, e);
        }
    }
    best.1
}

/// Quantises 32 values into one ROCmFP4 block: 18 bytes with a scale per half (`dual`, type
/// 100) or 17 with one scale (type 101).
pub fn rocmfp4_quantize(x: &[f32], dual: bool, out: &mut Vec<u8>) {
    let mut codes = [0u8; 32];
    let scales: Vec<u8> = if dual {
        let (e0, e1) = (rocmfp4_group_scale(&x[..16]), rocmfp4_group_scale(&x[16..32]));
        rocmfp4_codes(&x[..16], e0, &mut codes[..16]);
        rocmfp4_codes(&x[16..32], e1, &mut codes[16..]);
        vec![e0, e1]
    } else {
        let e = rocmfp4_group_scale(&x[..32]);
        rocmfp4_codes(&x[..32], e, &mut codes);
        vec![e]
    };
    out.extend((0..16).map(|j| codes[j] | (codes[j + 16] << 4)));
    out.extend(scales);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_and_codes_decode_by_hand() {
        // UE4M3 0x38: exp 7, man 0 → 1.0; 0x3C: 1.5; 0x08: 2^-6; 0x01: 2^-9 (subnormal).
        assert_eq!([ue4m3_half(0x38), ue4m3_half(0x3C), ue4m3_half(0x08), ue4m3_half(0x01)], [0.5, 0.75, 2f32.powi(-7), 2f32.powi(-10)]);
        assert_eq!((ue4m3_half(0x7F), ue4m3_half(0)), (0.0, 0.0));
        // E8M0 127 → 1.0 (halved: 0.5); 130 → 8 (4).
        assert_eq!((e8m0_half(127), e8m0_half(130)), (0.5, 4.0));
        // MXFP4 at 2^(128-127) = 2: byte 0x9F = low 0xF (-6), high 0x9 (-0.5).
        let mut block = [0u8; 17];
        block[0] = 128;
        block[1] = 0x9F;
        let mut y = [0f32; 32];
        mxfp4(&block, &mut y);
        assert_eq!((y[0], y[16], y[1]), (-12.0, -1.0, 0.0));
        // NVFP4: run 2 at scale 1.5 (0x3C), its first byte 0x72 = low 0x2 (1.0), high 0x7 (6.0).
        let mut block = [0u8; 36];
        block[2] = 0x3C;
        block[4 + 16] = 0x72;
        let mut y = [0f32; 64];
        nvfp4_ggml(&block, &mut y);
        assert_eq!((y[32], y[40], y[0]), (1.5, 9.0, 0.0));
    }

    fn hex(s: &str) -> Vec<u8> {
        s.split_whitespace().map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
    }

    #[test]
    fn nvfp4_safetensors_rows_decode_by_hand() {
        // ModelOpt: byte 0x7A = element 0 code 0xA (-1), element 1 code 0x7 (6); scale 0x3C (1.5);
        // weight_scale_2 0.0025 → -0.00375 and 0.0225.
        let mut codes = vec![0u8; 16];
        codes[0] = 0x7A;
        codes[8] = 0x2F; // row 1: element 0 code 0xF (-6), element 1 code 0x2 (1), scale 0x40 (2)
        let m = Nvfp4Matrix::new(2, 16, codes, vec![0x3C, 0x40], 0.0025).unwrap();
        let mut row = [f32::NAN; 16];
        m.dequant_row(0, &mut row);
        assert!((row[0] + 0.00375).abs() < 1e-7 && (row[1] - 0.0225).abs() < 1e-7, "{row:?}");
        assert!(row[2..].iter().all(|&v| v == 0.0));
        m.dequant_row(1, &mut row);
        assert!((row[0] + 0.03).abs() < 1e-7 && (row[1] - 0.005).abs() < 1e-7, "{row:?}");
        // compressed-tensors: 0xC3 at scale 0x52 (10) over a global scale of 5376 (a divisor).
        let m = Nvfp4Matrix::new(1, 16, [0xC3].into_iter().chain([0; 7]).collect(), vec![0x52], 1.0 / 5376.0).unwrap();
        m.dequant_row(0, &mut row);
        assert!((row[0] - 15.0 / 5376.0).abs() < 1e-8 && (row[1] + 20.0 / 5376.0).abs() < 1e-8, "{row:?}");
        assert!(Nvfp4Matrix::new(1, 24, vec![0; 12], vec![0; 1], 1.0).is_err(), "cols not a multiple of 16");
        assert!(Nvfp4Matrix::new(1, 16, vec![0; 7], vec![0; 1], 1.0).is_err(), "too few codes");
    }

    #[test]
    fn nvfp4_encoding_rounds_to_the_nearest_codes_and_scales() {
        assert_eq!((e4m3_nearest(1.0), e4m3_nearest(1.5), e4m3_nearest(448.0), e4m3_nearest(1e9), e4m3_nearest(0.0)), (0x38, 0x3C, 0x7E, 0x7E, 0));
        // Between 1.0 (0x38) and 1.125 (0x39): nearer 1.125 above the midpoint, the even byte at it.
        assert_eq!((e4m3_nearest(1.07), e4m3_nearest(1.0625)), (0x39, 0x38));
        assert_eq!((e2m1_nearest(0.2), e2m1_nearest(-0.8), e2m1_nearest(5.5), e2m1_nearest(-100.0)), (0, 0x0A, 7, 0x0F));
        // A round trip: every value within half a code step (at most 1 of 6 units) plus the
        // block scale's E4M3 rounding (1/16).
        let x: Vec<f32> = (0..4 * 48).map(|i| ((i * 7919 % 97) as f32 - 48.0) * 0.01 * (1 + i / 48) as f32).collect();
        let (codes, scales, t) = nvfp4_quantize(&x, 48);
        let m = Nvfp4Matrix::new(4, 48, codes, scales, t).unwrap();
        let mut row = vec![0f32; 48];
        for r in 0..4 {
            m.dequant_row(r, &mut row);
            for (g, (got, want)) in row.chunks(16).zip(x[r * 48..(r + 1) * 48].chunks(16)).enumerate() {
                let block_max = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= block_max * (1.0 / 6.0 + 1.0 / 16.0), "row {r} group {g}: {worst} of {block_max}");
            }
        }
    }

    #[test]
    fn rocmfp4_blocks_decode_by_hand() {
        // Type 101: scale 0x38 = 2^-1; byte j holds code j (low) and 15 - j (high).
        let fast = hex("f0 e1 d2 c3 b4 a5 96 87 78 69 5a 4b 3c 2d 1e 0f 38");
        let mut y = [f32::NAN; 32];
        rocmfp4(&fast, &mut y);
        let low = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -5.0];
        assert_eq!(y[..16], low);
        assert_eq!(y[16..].iter().rev().copied().collect::<Vec<_>>(), low);
        // Type 100: scales 0x40 = 1.0 (low nibbles) and 0x05 = 5 · 2^-10 (subnormal, high nibbles).
        let dual = hex("01 23 45 67 89 ab cd ef 10 32 54 76 98 ba dc fe 40 05");
        rocmfp4(&dual, &mut y);
        assert_eq!(y[..16], [1.0, 3.0, 6.0, 10.0, -1.0, -3.0, -6.0, -10.0, 0.0, 2.0, 4.0, 8.0, 0.0, -2.0, -4.0, -8.0]);
        let s1 = 5.0 * 2f32.powi(-10);
        assert_eq!(y[16..20], [0.0, 2.0 * s1, 4.0 * s1, 8.0 * s1]);
        assert_eq!((y[24], y[31]), (s1, -10.0 * s1));
        // Quantising: the fork's own outputs for these inputs (its C code, run by hand).
        let mut one = [0f32; 32];
        one[0] = 1.0;
        let mut out = Vec::new();
        rocmfp4_quantize(&one, true, &mut out);
        assert_eq!(out, [[6u8].as_slice(), &[0; 15], &[0x28, 0]].concat());
        out.clear();
        rocmfp4_quantize(&one, false, &mut out);
        assert_eq!(out, [[6u8].as_slice(), &[0; 15], &[0x28]].concat());
        one[0] = 1e6;
        out.clear();
        rocmfp4_quantize(&one, true, &mut out);
        assert_eq!((out[0], out[16], out[17]), (7, 0x7E, 0));
        // A round trip of a block decodes within half a step of its scale.
        let x: Vec<f32> = (0..32).map(|i| ((i * 7919 % 61) as f32 - 30.0) * 0.013).collect();
        out.clear();
        rocmfp4_quantize(&x, true, &mut out);
        rocmfp4(&out, &mut y);
        let worst = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 0.5 * 2.0 * rocmfp4_scale(out[16]).max(rocmfp4_scale(out[17])) + 1e-6, "{worst}");
        // The largest valid scale, 0x7E = 2^7 · 1.75 = 224; past it, 0.
        assert_eq!((rocmfp4_scale(0x7E), rocmfp4_scale(0x7F), rocmfp4_scale(0xFF), rocmfp4_scale(0)), (224.0, 0.0, 0.0, 0.0));
    }
}
