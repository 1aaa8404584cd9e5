//! The x86-64 kernels of `q8dot`: AVX2's byte multiplies (`maddubs`) and AVX-512 VNNI's dot
//! instructions (`dpbusd`), on 256-bit registers whose eight 32-bit lanes are a group's rows.

use std::arch::x86_64::*;

use super::{bias, block_fields, has_offset, lane_scales, layout, pieces_per_block, GgmlFormat, InterleavedMatrix, Lanes, Q8Block, Range, GROUP, Q8_BLOCK};
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
    unsafe { for_each_format!(m.format(), F => grid::<F, VNNI>(m, groups, inputs, out)) }
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
            let fields = block_fields::<__m256>(format, header);
            for k in 0..per_block {
                let (first_scale, second_scale, offset) = lane_scales(format, header, k, fields);
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

impl Lanes for __m256 {
    #[inline(always)]
    unsafe fn halves(bytes: &[u8]) -> Self {
        // SAFETY: the caller's features (AVX2 and F16C, every x86 kernel's).
        unsafe { halves(bytes) }
    }
    #[inline(always)]
    unsafe fn powers_of_two(bytes: &[u8]) -> Self {
        // SAFETY: as above.
        unsafe { powers_of_two(bytes) }
    }
    #[inline(always)]
    unsafe fn bytes(bytes: &[u8], signed: bool) -> Self {
        // SAFETY: as above.
        unsafe { self::bytes(bytes, signed) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: as above.
        unsafe { _mm256_mul_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn neg(self) -> Self {
        // SAFETY: as above.
        unsafe { _mm256_xor_ps(self, _mm256_set1_ps(-0.0)) }
    }
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
