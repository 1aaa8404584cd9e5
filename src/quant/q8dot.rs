//! The CPU's fast products for block formats: the input is quantised once to 8 bits in blocks of
//! 32 values (a scale each, the scaled sum of its codes as ggml's Q8_1, and the code sums of its
//! halves), and each 32-value piece of a weight row meets its input block in exact integer sums.
//! The weights are repacked in groups of eight rows (`interleaved`), so each instruction adds
//! four products to each of eight rows' sums and a group's results come out as one vector.
//!
//! The arithmetic, which every kernel follows (scalar, AVX2's byte multiplies, AVX-512 VNNI's
//! dot instructions), so that all give the same bits (tested): for each piece of a row, in order,
//! the integer sum S = Σ (u − bias) · q over its 32 values (over each half apart in Q6_K, whose
//! halves scale differently), then `acc += (scale · d_x) · S` in f32 (a multiply then an add: a
//! fused one would need the scalar kernel's `mul_add`, which MinGW's libm does not fuse); formats
//! with an offset (Q4_1's m, the k-quants' minimums) add `offset · sum_x` into a second
//! accumulator, added to the first at the end. A product's bits do not depend on which rows or
//! tokens share its call. The f32 reference (`QuantMatrix::dequant_row` and `quant::dot`) stays
//! the oracle these are held to.

use std::ops::Range;

use super::interleaved::{bias, code, has_offset, layout, piece_scales, pieces_per_block, InterleavedMatrix, GROUP};
use super::GgmlFormat;

/// Values per input block.
pub const Q8_BLOCK: usize = 32;

/// 32 input values as `d · qs[i]`; `sum` = `d · Σ qs` (the offset term needs it); `halves` =
/// Σ qs over values 0..16 and 16..32 (the stored codes' bias is removed through them).
#[derive(Debug, Clone, Copy)]
pub struct Q8Block {
    pub d: f32,
    pub sum: f32,
    pub halves: [i32; 2],
    pub qs: [i8; Q8_BLOCK],
}

/// Quantises `x` (a whole number of blocks) into `out`: each block's largest magnitude becomes
/// ±127, the rest rounded to the nearest step (halves away from zero; NaN to 0). The SIMD
/// kernels' CPUs do it in AVX2 registers, with the same bits (tested).
pub fn quantize_input(kernel: DotKernel, x: &[f32], out: &mut Vec<Q8Block>) {
    debug_assert_eq!(x.len() % Q8_BLOCK, 0);
    out.clear();
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both kernels are only chosen where AVX2 is detected.
        DotKernel::Avx2 | DotKernel::Avx512Vnni => unsafe { x86::quantize(x, out) },
        _ => out.extend(x.chunks_exact(Q8_BLOCK).map(quantize_block)),
    }
}

fn quantize_block(values: &[f32]) -> Q8Block {
    {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; Q8_BLOCK];
        for (q, v) in qs.iter_mut().zip(values) {
            *q = round_half_away(v * inverse) as i8;
        }
        let half = |h: usize| qs[16 * h..16 * h + 16].iter().map(|&q| i32::from(q)).sum::<i32>();
        let halves = [half(0), half(1)];
        Q8Block { d, sum: d * (halves[0] + halves[1]) as f32, halves, qs }
    }
}

/// `x.round()` (halves away from zero) for what `as i8` keeps of it, without the libm call that
/// `round` is on x86-64's baseline (so the loop vectorises): truncate, then step by the fraction.
#[inline(always)]
fn round_half_away(x: f32) -> f32 {
    let whole = x as i32 as f32;
    let fraction = x - whole;
    whole + f32::from(u8::from(fraction >= 0.5)) - f32::from(u8::from(fraction <= -0.5))
}

/// Which implementation computes the integer sums (all give the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotKernel {
    Scalar,
    /// x86-64 with AVX2 and F16C (checked at run time).
    Avx2,
    /// x86-64 with AVX-512 VNNI and VL besides: `vpdpbusd` on 256-bit registers.
    Avx512Vnni,
}

impl DotKernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        *Self::available().last().expect("the scalar kernel runs everywhere")
    }

    /// Every kernel this CPU runs, slowest first.
    pub fn available() -> Vec<Self> {
        let mut kernels = vec![DotKernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
            kernels.push(DotKernel::Avx2);
            let vnni = std::arch::is_x86_feature_detected!("avx512vnni");
            if vnni && std::arch::is_x86_feature_detected!("avx512vl") && std::arch::is_x86_feature_detected!("avx512f") {
                kernels.push(DotKernel::Avx512Vnni);
            }
        }
        kernels
    }

    pub fn name(self) -> &'static str {
        match self {
            DotKernel::Scalar => "scalar",
            DotKernel::Avx2 => "avx2",
            DotKernel::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// `out[(g − groups.start) · 8T + 8i + r]` = row 8g + r of `m` times `inputs[i]`, for T =
/// `inputs.len()` tokens (each 32 values for each of a row's pieces); `kernel` one
/// `DotKernel::detect` allows on this CPU.
pub fn dot_groups(kernel: DotKernel, m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
    debug_assert_eq!(out.len(), groups.len() * inputs.len() * GROUP);
    debug_assert!(inputs.iter().all(|x| x.len() * Q8_BLOCK == super::QuantMatrix::cols(m)));
    match kernel {
        DotKernel::Scalar => scalar::dot_groups(m, groups, inputs, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: DotKernel::Avx2 is only chosen where AVX2 and F16C are detected.
        DotKernel::Avx2 => unsafe { x86::dot_groups_avx2(m, groups, inputs, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: DotKernel::Avx512Vnni is only chosen where all its features are detected.
        DotKernel::Avx512Vnni => unsafe { x86::dot_groups_vnni(m, groups, inputs, out) },
        #[cfg(not(target_arch = "x86_64"))]
        DotKernel::Avx2 | DotKernel::Avx512Vnni => scalar::dot_groups(m, groups, inputs, out),
    }
}

mod scalar {
    use super::{bias, code, has_offset, layout, piece_scales, pieces_per_block, GgmlFormat, InterleavedMatrix, Q8Block, Range, GROUP};
    use crate::quant::interleaved::{group_block_bytes, two_scales};

    pub fn dot_groups(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        for (g, out) in groups.zip(out.chunks_exact_mut(inputs.len() * GROUP)) {
            for (x, out) in inputs.iter().zip(out.chunks_exact_mut(GROUP)) {
                for (r, o) in out.iter_mut().enumerate() {
                    *o = row_dot(m.format(), m.group(g), r, x);
                }
            }
        }
    }

    /// Row `r` of a group times one token, in the module's arithmetic.
    fn row_dot(format: GgmlFormat, group: &[u8], r: usize, x: &[Q8Block]) -> f32 {
        let (header_bytes, piece_bytes) = layout(format);
        let (per_block, bias) = (pieces_per_block(format), bias(format));
        let (mut acc, mut offsets) = (0f32, 0f32);
        for (b, block) in group.chunks_exact(group_block_bytes(format)).enumerate() {
            let (header, pieces) = block.split_at(header_bytes);
            for (k, piece) in pieces.chunks_exact(piece_bytes).enumerate() {
                let x = &x[b * per_block + k];
                let (first, second, offset) = piece_scales(format, header, r, k);
                let half = |h: usize| -> i32 {
                    let products: i32 = (16 * h..16 * h + 16).map(|j| i32::from(code(format, piece, r, j)) * i32::from(x.qs[j])).sum();
                    products - bias * x.halves[h]
                };
                if two_scales(format) {
                    acc += (first * x.d) * half(0) as f32;
                    acc += (second * x.d) * half(1) as f32;
                } else {
                    acc += (first * x.d) * (half(0) + half(1)) as f32;
                }
                if has_offset(format) {
                    offsets += offset * x.sum;
                }
            }
        }
        if has_offset(format) {
            acc + offsets
        } else {
            acc
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{bias, has_offset, layout, pieces_per_block, GgmlFormat, InterleavedMatrix, Q8Block, Range, GROUP, Q8_BLOCK};
    use crate::quant::interleaved::{fifth_bits, group_block_bytes, levels, two_scales};


    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dot_groups_avx2(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // SAFETY: the features of this function, which the inlined body uses.
        unsafe { by_format::<false>(m, groups, inputs, out) }
    }

    /// # Safety
    /// The CPU must support AVX2, F16C, AVX-512 F and VL, and AVX-512 VNNI.
    #[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn dot_groups_vnni(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // SAFETY: the features of this function, which the inlined body uses.
        unsafe { by_format::<true>(m, groups, inputs, out) }
    }

    /// `quantize_block` for each block of `x`, into `out`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize(x: &[f32], out: &mut Vec<Q8Block>) {
        // Plain loops, not closures, which would not inherit this function's features.
        for values in x.chunks_exact(Q8_BLOCK) {
            let mut v = [_mm256_setzero_ps(); 4];
            for (i, v) in v.iter_mut().enumerate() {
                // SAFETY: 8 of the chunk's 32 floats; AVX, as this function.
                *v = unsafe { _mm256_loadu_ps(values[8 * i..][..8].as_ptr()) };
            }
            let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            // max_ps keeps its second operand where the first is NaN, as f32::max ignores NaN.
            let mut m = _mm256_setzero_ps();
            for v in v {
                m = _mm256_max_ps(_mm256_and_ps(v, magnitude), m);
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let inverse = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let one = _mm256_set1_ps(1.0);
            let mut codes = [_mm256_setzero_si256(); 4];
            for (code, v) in codes.iter_mut().zip(v) {
                let x = _mm256_mul_ps(v, inverse);
                // NaN to 0, as `as i32` makes it; every other product is within ±128.
                let x = _mm256_and_ps(x, _mm256_cmp_ps::<_CMP_ORD_Q>(x, x));
                let whole = _mm256_cvtepi32_ps(_mm256_cvttps_epi32(x));
                let fraction = _mm256_sub_ps(x, whole);
                let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(fraction, _mm256_set1_ps(0.5)), one);
                let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(fraction, _mm256_set1_ps(-0.5)), one);
                *code = _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(whole, up), down));
            }
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let mut qs = [0i8; Q8_BLOCK];
            // SAFETY: 32 bytes.
            unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes) };
            let mut halves = [0i32; 2];
            for (h, half) in halves.iter_mut().enumerate() {
                let s = _mm256_add_epi32(codes[2 * h], codes[2 * h + 1]);
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                *half = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)));
            }
            out.push(Q8Block { d, sum: d * (halves[0] + halves[1]) as f32, halves, qs });
        }
    }

    /// One copy of the loops per format, its decoding resolved at compile time.
    #[inline(always)]
    unsafe fn by_format<const VNNI: bool>(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // SAFETY: the caller's target features, which grid's inlined body uses.
        unsafe {
            match GgmlFormat::ALL.iter().position(|&f| f == m.format()) {
                Some(0) => grid::<0, VNNI>(m, groups, inputs, out),
                Some(1) => grid::<1, VNNI>(m, groups, inputs, out),
                Some(2) => grid::<2, VNNI>(m, groups, inputs, out),
                Some(3) => grid::<3, VNNI>(m, groups, inputs, out),
                Some(4) => grid::<4, VNNI>(m, groups, inputs, out),
                Some(5) => grid::<5, VNNI>(m, groups, inputs, out),
                Some(6) => grid::<6, VNNI>(m, groups, inputs, out),
                Some(7) => grid::<7, VNNI>(m, groups, inputs, out),
                Some(8) => grid::<8, VNNI>(m, groups, inputs, out),
                Some(9) => grid::<9, VNNI>(m, groups, inputs, out),
                Some(10) => grid::<10, VNNI>(m, groups, inputs, out),
                Some(11) => grid::<11, VNNI>(m, groups, inputs, out),
                Some(12) => grid::<12, VNNI>(m, groups, inputs, out),
                _ => grid::<13, VNNI>(m, groups, inputs, out),
            }
        }
    }

    /// Each group times the tokens, several at a time sharing each decoding of a piece (eight
    /// for the k-quants with VNNI's 32 registers, whose decoding and scales cost the most; else
    /// four: more would spill), tokens left over one by one; the group's
    /// blocks stay in L1 while the inputs stream past. Inlined into the callers above, whose
    /// target features its intrinsics need (a function with target features cannot be
    /// inlined, nor generic over them).
    #[inline(always)]
    unsafe fn grid<const F: usize, const VNNI: bool>(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // SAFETY: the caller's target features.
        unsafe {
            if VNNI && matches!(GgmlFormat::ALL[F], GgmlFormat::Q4_K | GgmlFormat::Q5_K | GgmlFormat::Q6_K | GgmlFormat::IQ4_XS) {
                bands::<F, VNNI, 8>(m, groups, inputs, out)
            } else {
                bands::<F, VNNI, 4>(m, groups, inputs, out)
            }
        }
    }

    /// `grid` with TOKENS tokens a tile.
    #[inline(always)]
    unsafe fn bands<const F: usize, const VNNI: bool, const TOKENS: usize>(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        let t = inputs.len();
        for (g, out) in groups.zip(out.chunks_exact_mut(t * GROUP)) {
            let group = m.group(g);
            let mut i = 0;
            while i < t {
                // SAFETY: the caller's target features, which tile's inlined body uses; each
                // store writes the eight floats of one token's slot.
                unsafe {
                    if i + TOKENS <= t {
                        let sums = tile::<F, VNNI, TOKENS>(group, &inputs[i..i + TOKENS]);
                        for (j, v) in sums.into_iter().enumerate() {
                            _mm256_storeu_ps(out[(i + j) * GROUP..][..GROUP].as_mut_ptr(), v);
                        }
                        i += TOKENS;
                    } else {
                        let [v] = tile::<F, VNNI, 1>(group, &inputs[i..i + 1]);
                        _mm256_storeu_ps(out[i * GROUP..][..GROUP].as_mut_ptr(), v);
                        i += 1;
                    }
                }
            }
        }
    }

    /// A group's eight rows times T tokens (`inputs.len()` = T): a vector of eight rows' products
    /// for each token. With VNNI, `dpbusd` takes the stored codes as they are and its sums start
    /// from −bias · Σ q; plain AVX2's `maddubs` would overflow on Q8_0's (up to 255 · 127 twice),
    /// so it takes them signed again, by the sign trick, from zero.
    #[inline(always)]
    unsafe fn tile<const F: usize, const VNNI: bool, const T: usize>(group: &[u8], inputs: &[Vec<Q8Block>]) -> [__m256; T] {
        let format = GgmlFormat::ALL[F];
        let (header_bytes, piece_bytes) = layout(format);
        let (per_block, bias, offsets_too) = (pieces_per_block(format), bias(format), has_offset(format));
        // Codes up to 255 would overflow AVX2's maddubs: it takes them signed (the sign trick).
        let signed = bias == 128 && !VNNI;
        let mut acc = [_mm256_setzero_ps(); T];
        let mut offsets = [_mm256_setzero_ps(); T];
        for (b, block) in group.chunks_exact(group_block_bytes(format)).enumerate() {
            let (header, pieces) = block.split_at(header_bytes);
            // SAFETY: F16C and AVX2, as the caller; the header holds each field read.
            unsafe {
                let d = if format == GgmlFormat::MXFP4 { powers_of_two(&header[..8]) } else { halves(&header[..16]) };
                let second = if offsets_too || format == GgmlFormat::ROCMFP4 { halves(&header[16..32]) } else { d };
                for k in 0..per_block {
                    let (first_scale, second_scale, offset) = match format {
                        GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
                            let scale = _mm256_mul_ps(d, bytes(&header[32 + 8 * k..], false));
                            let minimum = _mm256_mul_ps(second, bytes(&header[96 + 8 * k..], false));
                            (scale, scale, _mm256_xor_ps(minimum, _mm256_set1_ps(-0.0)))
                        }
                        GgmlFormat::Q6_K => (_mm256_mul_ps(d, bytes(&header[16 + 16 * k..], true)), _mm256_mul_ps(d, bytes(&header[24 + 16 * k..], true)), d),
                        GgmlFormat::IQ4_XS => {
                            let scale = _mm256_mul_ps(d, bytes(&header[16 + 8 * k..], true));
                            (scale, scale, d)
                        }
                        GgmlFormat::NVFP4 => (halves(&header[32 * k..]), halves(&header[32 * k + 16..]), d),
                        GgmlFormat::ROCMFP4 => (d, second, d),
                        _ => (d, d, second),
                    };
                    let (low, high) = codes(format, &pieces[k * piece_bytes..][..piece_bytes]);
                    for i in 0..T {
                        let x = &inputs[i][b * per_block + k];
                        let input_scale = _mm256_set1_ps(x.d);
                        let start = |h: usize| _mm256_set1_epi32(if signed { 0 } else { -bias * x.halves[h] });
                        if two_scales(format) {
                            let first = half_sums::<VNNI>(signed, start(0), &low, &x.qs[..16]);
                            let second = half_sums::<VNNI>(signed, start(1), &high, &x.qs[16..]);
                            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(first_scale, input_scale), _mm256_cvtepi32_ps(first)));
                            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(second_scale, input_scale), _mm256_cvtepi32_ps(second)));
                        } else {
                            let both = _mm256_add_epi32(start(0), start(1));
                            let all = half_sums::<VNNI>(signed, half_sums::<VNNI>(signed, both, &low, &x.qs[..16]), &high, &x.qs[16..]);
                            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(first_scale, input_scale), _mm256_cvtepi32_ps(all)));
                        }
                        if offsets_too {
                            offsets[i] = _mm256_add_ps(offsets[i], _mm256_mul_ps(offset, _mm256_set1_ps(x.sum)));
                        }
                    }
                }
            }
        }
        if offsets_too {
            for i in 0..T {
                acc[i] = _mm256_add_ps(acc[i], offsets[i]);
            }
        }
        acc
    }

    /// `sums`, its SIGNED chosen at run time (a constant once inlined into a format's copy).
    #[inline(always)]
    unsafe fn half_sums<const VNNI: bool>(signed: bool, acc: __m256i, codes: &[__m256i; 4], x: &[i8]) -> __m256i {
        // SAFETY: the caller's target features.
        unsafe {
            if signed {
                sums::<false, true>(acc, codes, x)
            } else {
                sums::<VNNI, false>(acc, codes, x)
            }
        }
    }

    /// `acc` plus, in each row's lane, the products of that row's codes (four a byte lane of
    /// each of `codes`) with 16 input codes, four broadcast to each lane at a time. SIGNED: the
    /// codes are stored plus 128, taken signed by the sign trick (plain AVX2).
    #[inline(always)]
    unsafe fn sums<const VNNI: bool, const SIGNED: bool>(mut acc: __m256i, codes: &[__m256i; 4], x: &[i8]) -> __m256i {
        assert_eq!(x.len(), 16);
        for (v, &w) in codes.iter().enumerate() {
            // SAFETY: four of the sixteen bytes checked above (unaligned read); AVX2 (and VNNI
            // where VNNI), as the caller.
            unsafe {
                let four = _mm256_set1_epi32(x.as_ptr().add(4 * v).cast::<i32>().read_unaligned());
                acc = if VNNI {
                    _mm256_dpbusd_epi32(acc, w, four)
                } else if SIGNED {
                    let w = _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN));
                    let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(four, w));
                    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
                } else {
                    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, four), _mm256_set1_epi16(1)))
                };
            }
        }
        acc
    }

    /// A piece's stored codes as bytes, lane r = row r: four vectors for values 0..16 (four
    /// a lane each) and four for values 16..32.
    #[inline(always)]
    unsafe fn codes(format: GgmlFormat, piece: &[u8]) -> ([__m256i; 4], [__m256i; 4]) {
        let mut low = [_mm256_setzero_si256(); 4];
        let mut high = [_mm256_setzero_si256(); 4];
        // SAFETY: AVX2, as the caller; every load reads within the piece (checked by load).
        unsafe {
            for v in 0..4 {
                if format == GgmlFormat::Q8_0 {
                    (low[v], high[v]) = (load(&piece[32 * v..]), load(&piece[128 + 32 * v..]));
                    continue;
                }
                let nibbles = load(&piece[32 * v..]);
                low[v] = _mm256_and_si256(nibbles, _mm256_set1_epi8(15));
                high[v] = _mm256_and_si256(_mm256_srli_epi16::<4>(nibbles), _mm256_set1_epi8(15));
                if let Some(levels) = levels(format) {
                    // Each index looked up: its level plus 128, as an unsigned byte.
                    let table = _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128(levels.as_ptr().cast())), _mm256_set1_epi8(i8::MIN));
                    (low[v], high[v]) = (_mm256_shuffle_epi8(table, low[v]), _mm256_shuffle_epi8(table, high[v]));
                }
                // Shifts of 16-bit lanes: each moves the wanted bits within their own byte.
                if fifth_bits(format) {
                    let fifth = load(&piece[128..]);
                    let up = _mm256_sll_epi16(fifth, _mm_cvtsi32_si128(4 - v as i32));
                    let down = _mm256_srl_epi16(fifth, _mm_cvtsi32_si128(v as i32));
                    low[v] = _mm256_or_si256(low[v], _mm256_and_si256(up, _mm256_set1_epi8(0x10)));
                    high[v] = _mm256_or_si256(high[v], _mm256_and_si256(down, _mm256_set1_epi8(0x10)));
                } else if format == GgmlFormat::Q6_K {
                    for (h, codes) in [&mut low, &mut high].into_iter().enumerate() {
                        let pairs = load(&piece[128 + 32 * h..]);
                        let moved = if v < 3 { _mm256_sll_epi16(pairs, _mm_cvtsi32_si128(4 - 2 * v as i32)) } else { _mm256_srli_epi16::<2>(pairs) };
                        codes[v] = _mm256_or_si256(codes[v], _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
                    }
                }
            }
        }
        (low, high)
    }

    /// Eight f16 (a row each), widened exactly by the F16C instruction.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn halves(bytes: &[u8]) -> __m256 {
        assert!(bytes.len() >= 16);
        // SAFETY: 16 bytes, checked above.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(bytes.as_ptr().cast())) }
    }

    /// Eight E8M0 bytes (a row each) as `e8m0_half` gives them: 2^(e − 128), built as bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn powers_of_two(bytes: &[u8]) -> __m256 {
        assert!(bytes.len() >= 8);
        // SAFETY: 8 bytes, checked above.
        let e = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(bytes.as_ptr().cast()) });
        let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
        let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let bits = _mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1)));
        _mm256_castsi256_ps(bits)
    }

    /// Eight bytes (a row each) as floats, unsigned or signed.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bytes(bytes: &[u8], signed: bool) -> __m256 {
        assert!(bytes.len() >= 8);
        // SAFETY: 8 bytes, checked above.
        let eight = unsafe { _mm_loadl_epi64(bytes.as_ptr().cast()) };
        _mm256_cvtepi32_ps(if signed { _mm256_cvtepi8_epi32(eight) } else { _mm256_cvtepu8_epi32(eight) })
    }

    /// 32 bytes from `bytes` (unaligned).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(bytes: &[u8]) -> __m256i {
        assert!(bytes.len() >= 32);
        // SAFETY: at least 32 bytes, checked above.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::interleaved::tests::random_blocks;
    use crate::quant::{dot, GgmlMatrix, QuantMatrix};
    use crate::sampling::Rng;
    use half::f16;

    fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale).collect()
    }

    fn quantized(x: &[f32]) -> Vec<Q8Block> {
        let mut q = Vec::new();
        quantize_input(DotKernel::Scalar, x, &mut q);
        q
    }

    /// Every kernel's quantisation gives the scalar one's blocks: random values of many scales,
    /// halves, NaN and infinities, zeros.
    #[test]
    fn every_kernel_quantises_the_input_alike() {
        let mut rng = Rng::new(9);
        let mut x: Vec<f32> = (0..32 * 200).map(|i| ((rng.next_f64() * 2.0 - 1.0) as f32) * 10f32.powi(i / 32 % 12 - 6)).collect();
        x[..32].fill(0.0);
        x[40] = f32::NAN;
        x[70] = f32::INFINITY;
        x[100] = f32::NEG_INFINITY;
        for (i, v) in x[128..160].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5 * (127.0 / 8.0);
        }
        let want = quantized(&x);
        for kernel in DotKernel::available() {
            let mut got = Vec::new();
            quantize_input(kernel, &x, &mut got);
            for (b, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!((g.d.to_bits(), g.sum.to_bits(), g.halves, g.qs), (w.d.to_bits(), w.sum.to_bits(), w.halves, w.qs), "{kernel:?} block {b}");
            }
        }
    }

    /// Every row of `m` times every input, as `dot_groups` lays them out, back in [row][token].
    fn products(kernel: DotKernel, m: &InterleavedMatrix, inputs: &[Vec<Q8Block>]) -> Vec<Vec<f32>> {
        let t = inputs.len();
        let mut out = vec![f32::NAN; m.groups() * t * GROUP];
        dot_groups(kernel, m, 0..m.groups(), inputs, &mut out);
        (0..m.rows()).map(|r| (0..t).map(|i| out[(r / GROUP) * t * GROUP + i * GROUP + r % GROUP]).collect()).collect()
    }

    #[test]
    fn rounding_halves_away_from_zero() {
        let mut rng = Rng::new(7);
        let special = [0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -127.5, 127.49999, 0.49999997, -0.49999997, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e10, -1e10];
        let random = (0..100_000).map(|_| (rng.next_f64() * 300.0 - 150.0) as f32);
        // The definition, |x| + 0.5 truncated with x's sign, in f64 where the sum is exact (not
        // libm's round: MinGW's rounds 0.49999997 up).
        let definition = |x: f32| (f64::from(x.abs()) + 0.5) as i64 as f64 * f64::from(x.signum());
        for x in special.into_iter().chain(random) {
            assert_eq!(super::round_half_away(x) as i8, definition(x) as i8, "{x}");
        }
    }

    #[test]
    fn quantised_input_round_trips_within_half_a_step() {
        let mut rng = Rng::new(5);
        let x = random(&mut rng, 96, 3.0);
        for (block, values) in quantized(&x).iter().zip(x.chunks_exact(Q8_BLOCK)) {
            assert!(block.qs.iter().any(|&c| c.abs() == 127));
            for (&c, &v) in block.qs.iter().zip(values) {
                assert!((c as f32 * block.d - v).abs() <= block.d * 0.5 + 1e-6);
            }
            let half = |h: usize| block.qs[16 * h..16 * h + 16].iter().map(|&c| c as i32).sum::<i32>();
            assert_eq!(block.halves, [half(0), half(1)]);
            assert_eq!(block.sum, block.d * (half(0) + half(1)) as f32);
        }
        let zeros = quantized(&[0.0; 32]);
        assert_eq!((zeros[0].d, zeros[0].qs, zeros[0].halves), (0.0, [0; 32], [0, 0]));
    }

    /// Each format against the f32 reference (dequantised row · x), on random blocks: the only
    /// difference is the input's rounding to 8 bits, at most half a step a value, so the error
    /// is bounded by Σ |w| · d_x / 2 (plus f32 rounding); against the rounded input itself only
    /// f32 rounding is left. Eleven rows (a group and three padded) times 1, 3 and 6 tokens (one
    /// by one, and a tile of four and two): every kernel gives every product the bits of the
    /// scalar kernel's on that row and token alone.
    #[test]
    fn integer_dots_match_the_reference_and_each_other() {
        let mut rng = Rng::new(11);
        for format in GgmlFormat::ALL {
            for blocks in [1, 3] {
                let (rows, cols) = (11, blocks * format.block_size().max(64));
                let m = GgmlMatrix::new(format, rows, cols, random_blocks(&mut rng, format, rows * cols / format.block_size())).unwrap();
                let packed = InterleavedMatrix::pack(&m, None);
                for tokens in [1, 3, 6] {
                    let xs: Vec<Vec<f32>> = (0..tokens).map(|_| random(&mut rng, cols, 2.0)).collect();
                    let inputs: Vec<Vec<Q8Block>> = xs.iter().map(|x| quantized(x)).collect();
                    for kernel in DotKernel::available() {
                        let got = products(kernel, &packed, &inputs);
                        for (r, got) in got.iter().enumerate() {
                            let mut w = vec![f32::NAN; cols];
                            m.dequant_row(r, &mut w);
                            for (i, (x, q)) in xs.iter().zip(&inputs).enumerate() {
                                let want = dot(&w, x);
                                let bound: f32 = w.chunks_exact(Q8_BLOCK).zip(q).map(|(w, b)| w.iter().map(|v| v.abs()).sum::<f32>() * b.d * 0.5).sum();
                                let magnitude: f32 = w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
                                assert!((got[i] - want).abs() <= bound + 1e-5 * magnitude, "{format:?} {kernel:?} row {r} token {i}: {} vs {want}", got[i]);
                                let rounded: Vec<f32> = q.iter().flat_map(|b| b.qs.map(|c| c as f32 * b.d)).collect();
                                let exact = dot(&w, &rounded);
                                assert!((got[i] - exact).abs() <= 1e-5 * magnitude, "{format:?} {kernel:?}: {} vs {exact} on the rounded input", got[i]);
                                let alone = products(DotKernel::Scalar, &packed, std::slice::from_ref(q));
                                assert_eq!(got[i].to_bits(), alone[r][0].to_bits(), "{format:?} {kernel:?} row {r} token {i} of {tokens}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The sign trick's edge: weight codes of −128 and inputs of ±127 stay exact.
    #[test]
    fn extreme_codes_sum_exactly() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        for (i, b) in block[2..].iter_mut().enumerate() {
            *b = if i % 2 == 0 { 0x80 } else { 0x7f };
        }
        let m = GgmlMatrix::new(GgmlFormat::Q8_0, 1, 32, block).unwrap();
        let packed = InterleavedMatrix::pack(&m, None);
        let x = Q8Block { d: 1.0, sum: 0.0, halves: [127 * 16; 2], qs: [127; 32] };
        let want = 16.0 * (-128.0 * 127.0) + 16.0 * (127.0 * 127.0);
        for k in DotKernel::available() {
            assert_eq!(products(k, &packed, &[vec![x]])[0][0], want, "{k:?}");
        }
    }
}
