//! The CPU's fast products for block formats: the input is quantised once to 8 bits in blocks of
//! 32 values (a scale each, and the scaled sum of its codes, as ggml's Q8_1), and each 32-value
//! piece of a weight row meets its input block in exact integer sums. A piece gives eight partial
//! sums (four products each, the lanes of an AVX2 register), scaled and added in f32 (a multiply
//! then an add: a fused one would need the scalar kernel's `mul_add`, which MinGW's libm does not
//! fuse) into eight accumulators, which meet in a fixed tree at the end of the row;
//! formats with an offset (Q4_1's m, the k-quants' minimums) add it times the input block's sum.
//! The scalar and SIMD kernels (AVX2's byte multiplies, AVX-512 VNNI's dot instructions) do the
//! same arithmetic in the same order, so all give the same bits (tested). Several rows share each
//! load of an input block and several tokens each piece's decoding (tiles). The f32 reference (`QuantMatrix::dequant_row` and `quant::dot`)
//! stays the oracle these are held to.
//!
//! Pieces of ggml's layouts (value = scale · code + offset): Q8_0 = f16 d, 32 × i8 codes;
//! Q4_0 = f16 d, 16 bytes of nibbles (low nibble = value j, high = value j + 16), code = q − 8;
//! Q4_1 = the same nibbles after f16 d and m; Q4_K and Q5_K = eight pieces per 256 (6-bit scales
//! and minimums, code = nibble, plus a fifth bit from qh); Q6_K = eight pieces per 256, a scale
//! for each 16 values (hence two per piece, for lanes 0-3 and 4-7), code = 6 bits − 32.

use super::ggml::scale_min_k4;
use super::GgmlFormat;

/// Values per input block.
pub const Q8_BLOCK: usize = 32;

/// 32 input values as `d · qs[i]`; `sum` = `d · Σ qs` (Q4_1's offset term needs it).
#[derive(Debug, Clone, Copy)]
pub struct Q8Block {
    pub d: f32,
    pub sum: f32,
    pub qs: [i8; Q8_BLOCK],
}

/// Quantises `x` (a whole number of blocks) into `out`: each block's largest magnitude becomes
/// ±127, the rest rounded to the nearest step.
pub fn quantize_input(x: &[f32], out: &mut Vec<Q8Block>) {
    debug_assert_eq!(x.len() % Q8_BLOCK, 0);
    out.clear();
    out.extend(x.chunks_exact(Q8_BLOCK).map(|values| {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; Q8_BLOCK];
        for (q, v) in qs.iter_mut().zip(values) {
            *q = round_half_away(v * inverse) as i8;
        }
        let codes: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        Q8Block { d, sum: d * codes as f32, qs }
    }));
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
    /// x86-64 with AVX-512 VNNI and VL besides: `vpdpbusd` on 256-bit registers, 32 of them, so
    /// prefill tiles are four rows by four tokens.
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

/// The formats `dot_rows` takes.
const FORMATS: [GgmlFormat; 6] = [GgmlFormat::Q8_0, GgmlFormat::Q4_0, GgmlFormat::Q4_1, GgmlFormat::Q4_K, GgmlFormat::Q5_K, GgmlFormat::Q6_K];

/// Whether `dot_rows` takes this format.
pub fn supports(format: GgmlFormat) -> bool {
    FORMATS.contains(&format)
}

/// `out[r · T + i]` = weight row `rows[r]` (whole blocks of `format`, 32 values for each of an
/// input's blocks) times `inputs[i]`, for T = `inputs.len()` tokens. `format` must be one
/// `supports` takes; `kernel` one `DotKernel::detect` allows on this CPU. Each output is summed
/// in the same order whichever rows and tokens share the call.
pub fn dot_rows(kernel: DotKernel, format: GgmlFormat, rows: &[&[u8]], inputs: &[Vec<Q8Block>], out: &mut [f32]) {
    debug_assert!(supports(format) && rows.len() * inputs.len() == out.len());
    debug_assert!(rows.iter().all(|row| inputs.iter().all(|x| row.len() * format.block_size() == x.len() * Q8_BLOCK * format.block_bytes())));
    match kernel {
        DotKernel::Scalar => scalar::dot_rows(format, rows, inputs, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: DotKernel::Avx2 is only chosen where AVX2 and F16C are detected.
        DotKernel::Avx2 => unsafe { x86::dot_rows_avx2(format, rows, inputs, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: DotKernel::Avx512Vnni is only chosen where all its features are detected.
        DotKernel::Avx512Vnni => unsafe { x86::dot_rows_vnni(format, rows, inputs, out) },
        #[cfg(not(target_arch = "x86_64"))]
        DotKernel::Avx2 | DotKernel::Avx512Vnni => scalar::dot_rows(format, rows, inputs, out),
    }
}

/// The f16 at the start of `bytes`, widened (exactly, as `half::f16::to_f32`, without its run-time
/// dispatch).
#[inline(always)]
fn half(bytes: &[u8]) -> f32 {
    let h = u32::from(u16::from_le_bytes([bytes[0], bytes[1]]));
    let (sign, exponent, mantissa) = ((h & 0x8000) << 16, (h >> 10) & 31, h & 0x3ff);
    let magnitude = match exponent {
        0 => (mantissa as f32 * (1.0 / 16_777_216.0)).to_bits(),
        31 => 0x7f80_0000 | (mantissa << 13),
        _ => ((exponent + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// Where a block's two f16 fields lie: its scale d, and Q4_1's m or the k-quants' dmin (formats
/// without a second field name the first twice).
#[inline(always)]
fn halves_at(format: GgmlFormat) -> [usize; 2] {
    match format {
        GgmlFormat::Q4_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K => [0, 2],
        GgmlFormat::Q6_K => [208, 208],
        _ => [0, 0],
    }
}

/// How one 32-value piece scales: `scales[0]` for its first 16 values, `scales[1]` for the rest;
/// `offset` is added to every value (its product is `offset` times the input block's sum).
struct Piece {
    scales: [f32; 2],
    offset: f32,
}

/// Pieces (of 32 values) in one block of the format.
#[inline(always)]
fn pieces_per_block(format: GgmlFormat) -> usize {
    format.block_size() / Q8_BLOCK
}

#[inline(always)]
fn has_offset(format: GgmlFormat) -> bool {
    matches!(format, GgmlFormat::Q4_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K)
}

/// Whether the format's codes are signed (else unsigned, below 128).
#[inline(always)]
fn signed(format: GgmlFormat) -> bool {
    matches!(format, GgmlFormat::Q8_0 | GgmlFormat::Q4_0 | GgmlFormat::Q6_K)
}

/// Piece `k` of a block whose f16 fields (at `halves_at`) widen to `halves`: its scales and offset.
#[inline(always)]
fn piece(format: GgmlFormat, block: &[u8], halves: [f32; 2], k: usize) -> Piece {
    let one = |scale: f32, offset: f32| Piece { scales: [scale, scale], offset };
    match format {
        GgmlFormat::Q4_1 => one(halves[0], halves[1]),
        GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
            let (sc, m) = scale_min_k4(k, &block[4..16]);
            one(halves[0] * sc as f32, -(halves[1] * m as f32))
        }
        GgmlFormat::Q6_K => {
            let sc = &block[192 + 8 * (k / 4) + 2 * (k % 4)..];
            Piece { scales: [halves[0] * (sc[0] as i8) as f32, halves[0] * (sc[1] as i8) as f32], offset: 0.0 }
        }
        _ => one(halves[0], 0.0),
    }
}

/// The eight accumulators' total, in the order the AVX2 kernel adds them.
#[inline(always)]
fn tree(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

mod scalar {
    use super::{half, halves_at, has_offset, piece, pieces_per_block, tree, GgmlFormat, Piece, Q8Block};

    pub fn dot_rows(format: GgmlFormat, rows: &[&[u8]], inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        let (per_block, bytes, at) = (pieces_per_block(format), format.block_bytes(), halves_at(format));
        for (row, out) in rows.iter().zip(out.chunks_exact_mut(inputs.len().max(1))) {
            for (x, o) in inputs.iter().zip(out) {
                let (mut acc, mut offsets) = ([0f32; 8], 0f32);
                for (p, x) in x.iter().enumerate() {
                    let (block, k) = (&row[p / per_block * bytes..][..bytes], p % per_block);
                    let w = codes(format, block, k);
                    let Piece { scales, offset } = piece(format, block, [half(&block[at[0]..]), half(&block[at[1]..])], k);
                    let scaled = [scales[0] * x.d, scales[1] * x.d];
                    for (lane, a) in acc.iter_mut().enumerate() {
                        let sum: i32 = (4 * lane..4 * lane + 4).map(|j| w[j] * i32::from(x.qs[j])).sum();
                        *a += scaled[lane / 4] * sum as f32;
                    }
                    if has_offset(format) {
                        offsets += offset * x.sum;
                    }
                }
                *o = tree(acc) + offsets;
            }
        }
    }

    /// Piece `k` of a block: its 32 integer codes.
    fn codes(format: GgmlFormat, block: &[u8], k: usize) -> [i32; 32] {
        let mut w = [0i32; 32];
        match format {
            GgmlFormat::Q8_0 => {
                for (w, &b) in w.iter_mut().zip(&block[2..34]) {
                    *w = i32::from(b as i8);
                }
            }
            GgmlFormat::Q4_0 | GgmlFormat::Q4_1 => {
                let (nibbles, shift) = if format == GgmlFormat::Q4_0 { (&block[2..18], -8) } else { (&block[4..20], 0) };
                for (j, &c) in nibbles.iter().enumerate() {
                    w[j] = i32::from(c & 15) + shift;
                    w[j + 16] = i32::from(c >> 4) + shift;
                }
            }
            GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
                let (qs, qh) = if format == GgmlFormat::Q4_K { (&block[16..144], None) } else { (&block[48..176], Some(&block[16..48])) };
                for (l, w) in w.iter_mut().enumerate() {
                    let byte = qs[32 * (k / 2) + l];
                    let nibble = if k.is_multiple_of(2) { byte & 15 } else { byte >> 4 };
                    let fifth = qh.map_or(0, |qh| ((qh[l] >> k) & 1) << 4);
                    *w = i32::from(nibble | fifth);
                }
            }
            _ => {
                let (n, part) = (k / 4, k % 4);
                for (l, w) in w.iter_mut().enumerate() {
                    let byte = block[64 * n + 32 * (part % 2) + l];
                    let nibble = if part < 2 { byte & 15 } else { byte >> 4 };
                    let high = (block[128 + 32 * n + l] >> (2 * part)) & 3;
                    *w = i32::from(nibble | (high << 4)) - 32;
                }
            }
        }
        w
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{halves_at, has_offset, piece, pieces_per_block, signed, GgmlFormat, Piece, Q8Block, FORMATS};

    /// Weight rows that share each load of an input block (with VNNI always, with plain AVX2 in
    /// decode): one accumulator chain each, so the adds overlap.
    const ROWS: usize = 4;
    /// Tokens that share one decoding of a weight piece (prefill).
    const TOKENS: usize = 4;

    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dot_rows_avx2(format: GgmlFormat, rows: &[&[u8]], inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // Sixteen registers hold a tile of one row by four tokens in prefill, four rows by one in
        // decode.
        // SAFETY: the features of this function, which the inlined body uses.
        unsafe { by_format::<false>(format, rows, inputs, out) }
    }

    /// # Safety
    /// The CPU must support AVX2, F16C, AVX-512 F and VL, and AVX-512 VNNI.
    #[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn dot_rows_vnni(format: GgmlFormat, rows: &[&[u8]], inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // 32 registers hold a tile of four rows by four tokens.
        // SAFETY: the features of this function, which the inlined body uses.
        unsafe { by_format::<true>(format, rows, inputs, out) }
    }

    /// One copy of the loops per format, its decoding resolved at compile time.
    #[inline(always)]
    unsafe fn by_format<const VNNI: bool>(format: GgmlFormat, rows: &[&[u8]], inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        // SAFETY: the caller's target features, which grid's inlined body uses.
        unsafe {
            match FORMATS.iter().position(|&f| f == format) {
                Some(0) => grid::<0, VNNI>(rows, inputs, out),
                Some(1) => grid::<1, VNNI>(rows, inputs, out),
                Some(2) => grid::<2, VNNI>(rows, inputs, out),
                Some(3) => grid::<3, VNNI>(rows, inputs, out),
                Some(4) => grid::<4, VNNI>(rows, inputs, out),
                _ => grid::<5, VNNI>(rows, inputs, out),
            }
        }
    }

    /// Cuts rows × tokens into tiles: `ROWS` rows (one with plain AVX2 in prefill) by `TOKENS`
    /// tokens, or by one token in decode; rows and tokens left over go in thinner tiles.
    /// Inlined into the callers above, whose target features its intrinsics need (a function
    /// with target features cannot be inlined, nor generic over them).
    #[inline(always)]
    unsafe fn grid<const F: usize, const VNNI: bool>(rows: &[&[u8]], inputs: &[Vec<Q8Block>], out: &mut [f32]) {
        let t = inputs.len();
        let token_groups = if t < TOKENS { 0 } else { t / TOKENS };
        let row_tile = if VNNI || token_groups == 0 { ROWS } else { 1 };
        // (first token, tokens) of each tile along a band of rows.
        let groups = (0..token_groups).map(|g| (g * TOKENS, TOKENS)).chain((token_groups * TOKENS..t).map(|i| (i, 1)));
        let mut r = 0;
        while r < rows.len() {
            let band = if r + row_tile <= rows.len() { row_tile } else { 1 };
            for (first, width) in groups.clone() {
                let x = &inputs[first..][..width];
                let mut values = [0f32; ROWS * TOKENS];
                let values = &mut values[..band * width];
                // SAFETY: the caller's target features, which tile's inlined body uses.
                unsafe {
                    match (band, width) {
                        (ROWS, TOKENS) => values.copy_from_slice(tile::<F, VNNI, ROWS, TOKENS>(&rows[r..], x).as_flattened()),
                        (ROWS, _) => values.copy_from_slice(tile::<F, VNNI, ROWS, 1>(&rows[r..], x).as_flattened()),
                        (_, TOKENS) => values.copy_from_slice(tile::<F, VNNI, 1, TOKENS>(&rows[r..], x).as_flattened()),
                        _ => values.copy_from_slice(tile::<F, VNNI, 1, 1>(&rows[r..], x).as_flattened()),
                    }
                }
                for (j, v) in values.chunks_exact(width).enumerate() {
                    out[(r + j) * t + first..][..width].copy_from_slice(v);
                }
            }
            r += band;
        }
    }

    /// The first R rows of `rows` times T tokens (`inputs.len()` = T), each product in its own
    /// accumulators. A block's f16 fields are widened once for all its pieces. With VNNI the
    /// codes are biased to unsigned bytes for `dpbusd`, which starts from −bias · Σ input codes
    /// so that the lanes hold exactly the sums the sign trick of plain AVX2 gives.
    #[inline(always)]
    unsafe fn tile<const F: usize, const VNNI: bool, const R: usize, const T: usize>(rows: &[&[u8]], inputs: &[Vec<Q8Block>]) -> [[f32; T]; R] {
        let format = FORMATS[F];
        let (signed, offsets_too, per_block, bytes, at) = (signed(format), has_offset(format), pieces_per_block(format), format.block_bytes(), halves_at(format));
        let inputs: &[Vec<Q8Block>; T] = inputs.try_into().expect("T tokens");
        let blocks = inputs[0].len() / per_block;
        let bias_shift = match format {
            GgmlFormat::Q8_0 => 7,
            GgmlFormat::Q4_0 => 3,
            _ => 5,
        };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        // Each row's offsets for the T tokens, one lane a token (T ≤ 4).
        let mut offsets = [_mm_setzero_ps(); R];
        // Plain loops, not array::from_fn: closures would not inherit the caller's target
        // features and stay uninlined calls.
        let mut block: [&[u8]; R] = [&[]; R];
        let mut scales = [BlockScales { first: [0.0; 8], second: [0.0; 8], offset: [0.0; 8] }; R];
        let mut q = [_mm256_setzero_si256(); T];
        let mut start = [_mm256_setzero_si256(); T];
        let mut input_scale = [_mm256_setzero_ps(); T];
        let mut input_sums = [0f32; 4];
        for b in 0..blocks {
            for r in 0..R {
                block[r] = &rows[r][b * bytes..][..bytes];
                if T == 1 {
                    // Decode reads each row once: the rows two tiles on (in a matrix's usual
                    // layout) are fetched while these are summed, every cache line of their
                    // block (a k-quant block spans three or four), as rows are too short for the
                    // hardware to see a stream. (Prefill reuses a row from L1 for every token.)
                    let ahead = block[r].as_ptr().wrapping_add(2 * R * rows[r].len());
                    for line in (0..bytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
                    }
                }
                // SAFETY: F16C and AVX2, as the caller.
                scales[r] = unsafe { block_scales(format, block[r], widen(block[r], at)) };
            }
            for k in 0..per_block {
                let p = b * per_block + k;
                for i in 0..T {
                    let x = &inputs[i][p];
                    // SAFETY: `qs` is 32 bytes; unaligned load.
                    q[i] = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
                    input_scale[i] = _mm256_set1_ps(x.d);
                    input_sums[i] = x.sum;
                    if VNNI && signed {
                        // SAFETY: AVX-512 VNNI and VL, as the caller.
                        let lane_sums = unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q[i]) };
                        start[i] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_sll_epi32(lane_sums, _mm_cvtsi32_si128(bias_shift)));
                    }
                }
                for r in 0..R {
                    // SAFETY: AVX2, as the caller; the block has its format's bytes.
                    let w = unsafe { codes::<VNNI>(format, block[r], k) };
                    // maddubs multiplies unsigned by signed bytes: |w| by q with w's sign.
                    let magnitude = if signed && !VNNI { _mm256_sign_epi8(w, w) } else { w };
                    let (first, second, offset) = (scales[r].first[k], scales[r].second[k], scales[r].offset[k]);
                    let row_scale = if format == GgmlFormat::Q6_K { _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(first)) } else { _mm256_set1_ps(first) };
                    for i in 0..T {
                        let lanes = if VNNI {
                            // SAFETY: AVX-512 VNNI and VL, as the caller.
                            unsafe { _mm256_dpbusd_epi32(start[i], w, q[i]) }
                        } else {
                            let q = if signed { _mm256_sign_epi8(q[i], w) } else { q[i] };
                            _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, q), _mm256_set1_epi16(1))
                        };
                        let scale = _mm256_mul_ps(row_scale, input_scale[i]);
                        acc[r][i] = _mm256_add_ps(acc[r][i], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(lanes)));
                    }
                    if offsets_too {
                        let sums = _mm_loadu_ps(input_sums.as_ptr());
                        offsets[r] = _mm_add_ps(offsets[r], _mm_mul_ps(_mm_set1_ps(offset), sums));
                    }
                }
            }
        }
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            let mut lanes = [0f32; 4];
            // SAFETY: SSE, as the caller; four floats.
            unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), offsets[r]) };
            for i in 0..T {
                // SAFETY: AVX, as the caller.
                out[r][i] = unsafe { horizontal(acc[r][i]) } + lanes[i];
            }
        }
        out
    }

    /// Every piece of a block as `piece` gives it: the scales of its halves and its offset.
    #[derive(Clone, Copy)]
    struct BlockScales {
        first: [f32; 8],
        second: [f32; 8],
        offset: [f32; 8],
    }

    /// The pieces of a block whose f16 fields widen to `halves`. The k-quants' scales (and Q4_K's
    /// and Q5_K's minimums) are unpacked at once and scaled in one vector each (the same
    /// products as `piece`'s, so the same bits), not one piece at a time.
    #[inline(always)]
    unsafe fn block_scales(format: GgmlFormat, block: &[u8], halves: [f32; 2]) -> BlockScales {
        let mut s = BlockScales { first: [0.0; 8], second: [0.0; 8], offset: [0.0; 8] };
        if matches!(format, GgmlFormat::Q4_K | GgmlFormat::Q5_K) {
            // scale_min_k4 for all eight: the low six bits of bytes 0-3 (scales) and 4-7
            // (minimums), then nibbles of bytes 8-11 topped by the two high bits of 0-3 and 4-7.
            let word = |i: usize| u32::from_le_bytes([block[i], block[i + 1], block[i + 2], block[i + 3]]);
            let (w0, w1, w2) = (word(4), word(8), word(12));
            let low6 = 0x3f3f_3f3f;
            let scale_codes = u64::from(w0 & low6) | u64::from((w2 & 0x0f0f_0f0f) | ((w0 >> 2) & 0x3030_3030)) << 32;
            let min_codes = u64::from(w1 & low6) | u64::from(((w2 >> 4) & 0x0f0f_0f0f) | ((w1 >> 2) & 0x3030_3030)) << 32;
            // SAFETY: AVX2, as the caller; eight floats each.
            unsafe {
                let scale_codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(scale_codes as i64)));
                let min_codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(min_codes as i64)));
                let first = _mm256_mul_ps(scale_codes, _mm256_set1_ps(halves[0]));
                let minimum = _mm256_mul_ps(min_codes, _mm256_set1_ps(halves[1]));
                _mm256_storeu_ps(s.first.as_mut_ptr(), first);
                _mm256_storeu_ps(s.second.as_mut_ptr(), first);
                _mm256_storeu_ps(s.offset.as_mut_ptr(), _mm256_xor_ps(minimum, _mm256_set1_ps(-0.0)));
            }
        } else if format == GgmlFormat::Q6_K {
            // Sixteen signed scales, one per 16 values: the even ones scale each piece's first
            // half, the odd ones its second.
            let codes: &[u8; 16] = block[192..208].try_into().expect("sixteen scales");
            // SAFETY: AVX2, as the caller; sixteen bytes in, eight floats out each.
            unsafe {
                let packed = _mm_loadu_si128(codes.as_ptr().cast());
                let split = _mm_shuffle_epi8(packed, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
                let even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(split));
                let odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(split)));
                _mm256_storeu_ps(s.first.as_mut_ptr(), _mm256_mul_ps(even, _mm256_set1_ps(halves[0])));
                _mm256_storeu_ps(s.second.as_mut_ptr(), _mm256_mul_ps(odd, _mm256_set1_ps(halves[0])));
            }
        } else {
            for k in 0..pieces_per_block(format) {
                let Piece { scales, offset } = piece(format, block, halves, k);
                (s.first[k], s.second[k], s.offset[k]) = (scales[0], scales[1], offset);
            }
        }
        s
    }

    /// A block's two f16 fields (at `at`), widened exactly by the F16C instruction.
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn widen(block: &[u8], at: [usize; 2]) -> [f32; 2] {
        let field = |i: usize| i32::from(u16::from_le_bytes([block[i], block[i + 1]]));
        let both = _mm_cvtph_ps(_mm_cvtsi32_si128(field(at[0]) | (field(at[1]) << 16)));
        [_mm_cvtss_f32(both), _mm_cvtss_f32(_mm_movehdup_ps(both))]
    }

    /// 32 bytes from `bytes` (unaligned).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(bytes: &[u8]) -> __m256i {
        assert!(bytes.len() >= 32);
        // SAFETY: at least 32 bytes, checked above.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
    }

    /// The low (or high) nibble of each byte.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibble(bytes: __m256i, high: bool) -> __m256i {
        let bytes = if high { _mm256_srli_epi16::<4>(bytes) } else { bytes };
        _mm256_and_si256(bytes, _mm256_set1_epi8(15))
    }

    /// (byte >> shift) & mask, moved up to bit 4: each code's high bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn high_bits(bytes: __m256i, shift: usize, mask: i8) -> __m256i {
        let moved = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift as i32));
        _mm256_slli_epi16::<4>(_mm256_and_si256(moved, _mm256_set1_epi8(mask)))
    }

    /// Piece `k` of a block: its 32 codes as bytes, signed where `signed` says so; BIASED: the
    /// signed ones plus 128 (Q8_0), 8 (Q4_0) or 32 (Q6_K), as unsigned bytes.
    #[inline(always)]
    unsafe fn codes<const BIASED: bool>(format: GgmlFormat, block: &[u8], k: usize) -> __m256i {
        // SAFETY: AVX2, as the caller, for every call below; the slices are the format's
        // fields, and load and nibbles check their lengths.
        unsafe {
            match format {
                GgmlFormat::Q8_0 if BIASED => _mm256_xor_si256(load(&block[2..34]), _mm256_set1_epi8(i8::MIN)),
                GgmlFormat::Q8_0 => load(&block[2..34]),
                GgmlFormat::Q4_0 if BIASED => nibbles(&block[2..18]),
                GgmlFormat::Q4_0 => _mm256_sub_epi8(nibbles(&block[2..18]), _mm256_set1_epi8(8)),
                GgmlFormat::Q4_1 => nibbles(&block[4..20]),
                GgmlFormat::Q4_K => nibble(load(&block[16 + 32 * (k / 2)..]), k % 2 == 1),
                GgmlFormat::Q5_K => _mm256_or_si256(nibble(load(&block[48 + 32 * (k / 2)..]), k % 2 == 1), high_bits(load(&block[16..48]), k, 1)),
                _ => {
                    let (n, part) = (k / 4, k % 4);
                    let low = nibble(load(&block[64 * n + 32 * (part % 2)..]), part >= 2);
                    let code = _mm256_or_si256(low, high_bits(load(&block[128 + 32 * n..]), 2 * part, 3));
                    if BIASED {
                        code
                    } else {
                        _mm256_sub_epi8(code, _mm256_set1_epi8(32))
                    }
                }
            }
        }
    }

    /// 16 bytes of nibbles as 32 bytes: the low nibbles (values 0..16), then the high ones.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(codes: &[u8]) -> __m256i {
        assert_eq!(codes.len(), 16);
        // SAFETY: 16 bytes, checked above.
        let packed = unsafe { _mm_loadu_si128(codes.as_ptr().cast()) };
        let low = _mm_and_si128(packed, _mm_set1_epi8(15));
        let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), _mm_set1_epi8(15));
        _mm256_set_m128i(high, low)
    }

    /// The eight lanes' total in `tree`'s order: lanes i and i + 4, then those of 0 and 2, 1 and 3.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn horizontal(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dot, GgmlMatrix, QuantMatrix};
    use crate::sampling::Rng;
    use half::f16;

    fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale).collect()
    }

    /// Random blocks of `format` (random bytes, with finite f16 scales where the format has them).
    fn random_blocks(rng: &mut Rng, format: GgmlFormat, blocks: usize) -> Vec<u8> {
        let mut data: Vec<u8> = (0..blocks * format.block_bytes()).map(|_| (rng.next_u64() & 0xff) as u8).collect();
        let halves: &[usize] = match format {
            GgmlFormat::Q4_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K => &[0, 2],
            GgmlFormat::Q6_K => &[208],
            _ => &[0],
        };
        for block in data.chunks_exact_mut(format.block_bytes()) {
            for &at in halves {
                let v = f16::from_f32((rng.next_f64() as f32 - 0.5) * 0.02);
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
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
    fn halves_widen_as_the_half_crate_does() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = super::half(&bits.to_le_bytes());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}: {got} vs {want}");
        }
    }

    #[test]
    fn quantised_input_round_trips_within_half_a_step() {
        let mut rng = Rng::new(5);
        let x = random(&mut rng, 96, 3.0);
        let mut q = Vec::new();
        quantize_input(&x, &mut q);
        for (block, values) in q.iter().zip(x.chunks_exact(Q8_BLOCK)) {
            assert!(block.qs.iter().any(|&c| c.abs() == 127));
            for (&c, &v) in block.qs.iter().zip(values) {
                assert!((c as f32 * block.d - v).abs() <= block.d * 0.5 + 1e-6);
            }
            assert_eq!(block.sum, block.d * block.qs.iter().map(|&c| c as i32).sum::<i32>() as f32);
        }
        quantize_input(&[0.0; 32], &mut q);
        assert_eq!((q[0].d, q[0].qs), (0.0, [0; 32]));
    }

    /// Each format against the f32 reference (dequantised row · x), on random blocks: the only
    /// difference is the input's rounding to 8 bits, at most half a step a value, so the error
    /// is bounded by Σ |w| · d_x / 2 (plus f32 rounding). Every kernel gives the same bits, and a
    /// token the same bits alone as among others (six: a group of four and two).
    #[test]
    fn integer_dots_match_the_reference_within_the_input_rounding() {
        let mut rng = Rng::new(11);
        let kernels = DotKernel::available();
        for format in [GgmlFormat::Q8_0, GgmlFormat::Q4_0, GgmlFormat::Q4_1, GgmlFormat::Q4_K, GgmlFormat::Q5_K, GgmlFormat::Q6_K] {
            assert!(supports(format));
            for blocks in [1, 3, 6] {
                let cols = blocks * format.block_size();
                let m = GgmlMatrix::new(format, 1, cols, random_blocks(&mut rng, format, blocks)).unwrap();
                let mut w = vec![f32::NAN; cols];
                m.dequant_row(0, &mut w);
                let xs: Vec<Vec<f32>> = (0..6).map(|_| random(&mut rng, cols, 2.0)).collect();
                let inputs: Vec<Vec<Q8Block>> = xs
                    .iter()
                    .map(|x| {
                        let mut q = Vec::new();
                        quantize_input(x, &mut q);
                        q
                    })
                    .collect();
                for &kernel in &kernels {
                    let mut together = vec![f32::NAN; 6];
                    dot_rows(kernel, format, &[m.row_blocks(0)], &inputs, &mut together);
                    for (i, (x, q)) in xs.iter().zip(&inputs).enumerate() {
                        let want = dot(&w, x);
                        let bound: f32 = w.chunks_exact(Q8_BLOCK).zip(q).map(|(w, b)| w.iter().map(|v| v.abs()).sum::<f32>() * b.d * 0.5).sum();
                        let magnitude: f32 = w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
                        let got = together[i];
                        assert!((got - want).abs() <= bound + 1e-5 * magnitude, "{format:?} × {blocks} {kernel:?}: {got} vs {want} (bound {bound})");
                        // Against the rounded input itself, only f32 rounding is left.
                        let rounded: Vec<f32> = q.iter().flat_map(|b| b.qs.map(|c| c as f32 * b.d)).collect();
                        let exact = dot(&w, &rounded);
                        assert!((got - exact).abs() <= 1e-5 * magnitude, "{format:?} × {blocks} {kernel:?}: {got} vs {exact} on the rounded input");
                        let mut alone = [f32::NAN];
                        dot_rows(kernel, format, &[m.row_blocks(0)], std::slice::from_ref(q), &mut alone);
                        let mut scalar = [f32::NAN];
                        dot_rows(DotKernel::Scalar, format, &[m.row_blocks(0)], std::slice::from_ref(q), &mut scalar);
                        assert_eq!((alone[0].to_bits(), scalar[0].to_bits()), (got.to_bits(), got.to_bits()), "{format:?} × {blocks} {kernel:?} token {i}");
                    }
                }
            }
        }
    }

    /// Seven rows (a tile of four and three alone) times 1, 3 and 6 tokens (one by one, and a
    /// group of four and two): every product has the bits of the scalar kernel's on that row
    /// and token alone.
    #[test]
    fn tiles_of_rows_and_tokens_give_each_product_the_bits_it_has_alone() {
        let mut rng = Rng::new(23);
        for format in FORMATS {
            let (rows, cols) = (7, 2 * format.block_size().max(64));
            let m = GgmlMatrix::new(format, rows, cols, random_blocks(&mut rng, format, rows * cols / format.block_size())).unwrap();
            let row_blocks: Vec<&[u8]> = (0..rows).map(|r| m.row_blocks(r)).collect();
            for tokens in [1, 3, 6] {
                let inputs: Vec<Vec<Q8Block>> = (0..tokens)
                    .map(|_| {
                        let mut q = Vec::new();
                        quantize_input(&random(&mut rng, cols, 2.0), &mut q);
                        q
                    })
                    .collect();
                for kernel in DotKernel::available() {
                    let mut out = vec![f32::NAN; rows * tokens];
                    dot_rows(kernel, format, &row_blocks, &inputs, &mut out);
                    for (r, row) in row_blocks.iter().enumerate() {
                        for (i, x) in inputs.iter().enumerate() {
                            let mut alone = [f32::NAN];
                            dot_rows(DotKernel::Scalar, format, &[row], std::slice::from_ref(x), &mut alone);
                            assert_eq!(out[r * tokens + i].to_bits(), alone[0].to_bits(), "{format:?} {kernel:?} row {r} token {i} of {tokens}");
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
        let x = Q8Block { d: 1.0, sum: 0.0, qs: [127; 32] };
        let want = 16.0 * (-128.0 * 127.0) + 16.0 * (127.0 * 127.0);
        for k in DotKernel::available() {
            let mut out = [f32::NAN];
            dot_rows(k, GgmlFormat::Q8_0, &[&block], &[vec![x]], &mut out);
            assert_eq!(out[0], want, "{k:?}");
        }
    }
}
