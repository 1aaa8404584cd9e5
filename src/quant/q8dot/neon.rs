//! The arm64 kernel of `q8dot`: the dot-product extension's `sdot` by element adds, in each
//! 32-bit lane, four byte products of one row with four input codes broadcast from a register,
//! so a group's eight rows take two registers (rows 0..4 and 4..8) and one input register
//! serves sixteen values. `sdot` takes both sides signed: Q8_0's codes lose their stored 128 by
//! a flip of the top bit and the codebook formats look up their signed levels, so their sums
//! start from zero; the others' codes are small and positive, their sums starting from
//! −bias · Σ q as VNNI's do. The same integer sums, the same f32 steps, the same bits as the
//! scalar kernel (tested, on qemu's emulated Armv8 in CI).
//!
//! Rust's `sdot` intrinsics are unstable, so the instruction is written as inline assembly; the
//! f16 scales widen by `fcvtl` (base Advanced SIMD) the same way.

use std::arch::aarch64::*;
use std::arch::asm;

use super::{bias, block_fields, has_offset, lane_scales, layout, pieces_per_block, GgmlFormat, InterleavedMatrix, Lanes, Q8Block, Range, GROUP};
use crate::quant::interleaved::{fifth_bits, group_block_bytes, levels, two_scales};

/// Eight rows' floats: rows 0..4, rows 4..8.
type Rows = [float32x4_t; 2];
/// Eight rows' integer sums.
type Sums = [int32x4_t; 2];
/// A piece's codes as signed bytes: `[values 0..16 | 16..32][v][rows 0..4 | 4..8]`, lane r of
/// vector v holding row r's values 4v..4v+4 of that half.
type Codes = [[[int8x16_t; 2]; 4]; 2];

/// `$acc` (int32x4_t) plus, in each 32-bit lane, the dot product of that lane's four bytes of
/// `$a` with the four bytes of lane `$lane` of `$b` (int8x16_t both). A macro, not a function, so
/// that the instruction is assembled inside a function with the dot-product feature.
macro_rules! sdot {
    ($acc:ident, $a:expr, $b:expr, $lane:literal) => {
        asm!(concat!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.4b[", $lane, "]"), acc = inout(vreg) $acc, a = in(vreg) $a, b = in(vreg) $b, options(pure, nomem, nostack))
    };
}

/// Tokens a tile shares each piece's decoding among (more would spill its sixteen code registers).
const TOKENS: usize = 4;

/// # Safety
/// The CPU must have the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn dot_groups(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
    // SAFETY: the features of this function, which the inlined bodies use.
    unsafe { for_each_format!(m.format(), F => bands::<F>(m, groups, inputs, out)) }
}

/// Each group times the tokens, TOKENS at a time sharing each decoding of a piece, the rest one
/// by one; a group's blocks stay in L1 while the inputs stream past.
#[inline(always)]
unsafe fn bands<const F: usize>(m: &InterleavedMatrix, groups: Range<usize>, inputs: &[Vec<Q8Block>], out: &mut [f32]) {
    let t = inputs.len();
    for (g, out) in groups.zip(out.chunks_exact_mut(t * GROUP)) {
        let group = m.group(g);
        let mut i = 0;
        while i < t {
            let n = if i + TOKENS <= t { TOKENS } else { 1 };
            // SAFETY: the caller's features; each store writes four floats of one token's slot
            // of eight.
            unsafe {
                let sums: &[Rows] = if n == TOKENS { &tile::<F, TOKENS>(group, &inputs[i..i + n]) } else { &tile::<F, 1>(group, &inputs[i..i + n]) };
                for (j, rows) in sums.iter().enumerate() {
                    let slot = &mut out[(i + j) * GROUP..][..GROUP];
                    vst1q_f32(slot[..4].as_mut_ptr(), rows[0]);
                    vst1q_f32(slot[4..].as_mut_ptr(), rows[1]);
                }
            }
            i += n;
        }
    }
}

/// A group's eight rows times T tokens (`inputs.len()` = T): each token's eight products.
#[inline(always)]
unsafe fn tile<const F: usize, const T: usize>(group: &[u8], inputs: &[Vec<Q8Block>]) -> [Rows; T] {
    let format = GgmlFormat::ALL[F];
    let (header_bytes, piece_bytes) = layout(format);
    let (per_block, offsets_too) = (pieces_per_block(format), has_offset(format));
    // What the codes from `codes` exceed the signed ones by (Q8_0 and the codebooks: nothing).
    let bias = if format == GgmlFormat::Q8_0 || levels(format).is_some() { 0 } else { bias(format) };
    let zero = [vdupq_n_f32(0.0); 2];
    let mut acc = [zero; T];
    let mut offsets = [zero; T];
    for (b, block) in group.chunks_exact(group_block_bytes(format)).enumerate() {
        let (header, pieces) = block.split_at(header_bytes);
        // SAFETY: Advanced SIMD and the dot products, as the caller; the header holds each
        // field read.
        unsafe {
            let fields = block_fields::<Rows>(format, header);
            for k in 0..per_block {
                let (first_scale, second_scale, offset) = lane_scales(format, header, k, fields);
                let codes = codes(format, &pieces[k * piece_bytes..][..piece_bytes]);
                for i in 0..T {
                    let x = &inputs[i][b * per_block + k];
                    let (low, high) = (vld1q_s8(x.qs[..16].as_ptr()), vld1q_s8(x.qs[16..].as_ptr()));
                    let input_scale = vdupq_n_f32(x.d);
                    let start = |h: usize| [vdupq_n_s32(-bias * x.halves[h]); 2];
                    if two_scales(format) {
                        let first = sums(start(0), &codes[0], low);
                        let second = sums(start(1), &codes[1], high);
                        acc[i] = add_product(acc[i], mul_by(first_scale, input_scale), first);
                        acc[i] = add_product(acc[i], mul_by(second_scale, input_scale), second);
                    } else {
                        let both = [vdupq_n_s32(-bias * x.halves[0] - bias * x.halves[1]); 2];
                        let all = sums(sums(both, &codes[0], low), &codes[1], high);
                        acc[i] = add_product(acc[i], mul_by(first_scale, input_scale), all);
                    }
                    if offsets_too {
                        let product = mul_by(offset, vdupq_n_f32(x.sum));
                        offsets[i] = [vaddq_f32(offsets[i][0], product[0]), vaddq_f32(offsets[i][1], product[1])];
                    }
                }
            }
        }
    }
    if offsets_too {
        for (acc, offsets) in acc.iter_mut().zip(offsets) {
            *acc = [vaddq_f32(acc[0], offsets[0]), vaddq_f32(acc[1], offsets[1])];
        }
    }
    acc
}

/// `acc + scale · S` for each row, a multiply then an add (never fused: the scalar kernel's bits).
#[inline(always)]
fn add_product(acc: Rows, scale: Rows, sums: Sums) -> Rows {
    // SAFETY: Advanced SIMD, part of every arm64 CPU.
    unsafe { [0, 1].map(|p| vaddq_f32(acc[p], vmulq_f32(scale[p], vcvtq_f32_s32(sums[p])))) }
}

#[inline(always)]
fn mul_by(a: Rows, b: float32x4_t) -> Rows {
    // SAFETY: Advanced SIMD, part of every arm64 CPU.
    unsafe { [vmulq_f32(a[0], b), vmulq_f32(a[1], b)] }
}

/// `acc` plus, in each row's lane, the products of that row's codes (four a byte lane of each
/// of `codes`) with the 16 input codes of `x`, four at a time.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sums(acc: Sums, codes: &[[int8x16_t; 2]; 4], x: int8x16_t) -> Sums {
    let [mut rows, mut more] = acc;
    // SAFETY: registers only; the dot-product extension, as this function.
    unsafe {
        sdot!(rows, codes[0][0], x, 0);
        sdot!(rows, codes[1][0], x, 1);
        sdot!(rows, codes[2][0], x, 2);
        sdot!(rows, codes[3][0], x, 3);
        sdot!(more, codes[0][1], x, 0);
        sdot!(more, codes[1][1], x, 1);
        sdot!(more, codes[2][1], x, 2);
        sdot!(more, codes[3][1], x, 3);
    }
    [rows, more]
}

/// A piece's stored codes as signed bytes (see `Codes`), Q8_0's and the codebook formats'
/// without their bias.
#[inline(always)]
unsafe fn codes(format: GgmlFormat, piece: &[u8]) -> Codes {
    assert!(piece.len() >= if format == GgmlFormat::Q8_0 { 256 } else { 128 });
    let mut codes = [[[vdupq_n_s8(0); 2]; 4]; 2];
    let [lows, highs] = &mut codes;
    // SAFETY: Advanced SIMD; every load reads 16 bytes within the piece (its length checked
    // above and, for the fifth bits and Q6_K's pairs, by the slices).
    unsafe {
        for (v, (low_codes, high_codes)) in lows.iter_mut().zip(highs.iter_mut()).enumerate() {
            for p in 0..2 {
                let at = 32 * v + 16 * p;
                if format == GgmlFormat::Q8_0 {
                    let flip = vdupq_n_u8(0x80);
                    low_codes[p] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(piece[at..].as_ptr()), flip));
                    high_codes[p] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(piece[128 + at..].as_ptr()), flip));
                    continue;
                }
                let nibbles = vld1q_u8(piece[at..].as_ptr());
                let mut low = vandq_u8(nibbles, vdupq_n_u8(15));
                let mut high = vshrq_n_u8::<4>(nibbles);
                if let Some(levels) = levels(format) {
                    let table = vld1q_u8(levels.as_ptr().cast());
                    (low, high) = (vqtbl1q_u8(table, low), vqtbl1q_u8(table, high));
                }
                // Byte shifts by a signed count (negative: right) move the wanted bits to bit 4.
                let shifted = |bits: &[u8], by: i32, mask: u8| vandq_u8(vshlq_u8(vld1q_u8(bits[..16].as_ptr()), vdupq_n_s8(by as i8)), vdupq_n_u8(mask));
                if fifth_bits(format) {
                    let fifth = &piece[128 + 16 * p..];
                    low = vorrq_u8(low, shifted(fifth, 4 - v as i32, 0x10));
                    high = vorrq_u8(high, shifted(fifth, -(v as i32), 0x10));
                } else if format == GgmlFormat::Q6_K {
                    low = vorrq_u8(low, shifted(&piece[128 + 16 * p..], 4 - 2 * v as i32, 0x30));
                    high = vorrq_u8(high, shifted(&piece[160 + 16 * p..], 4 - 2 * v as i32, 0x30));
                }
                (low_codes[p], high_codes[p]) = (vreinterpretq_s8_u8(low), vreinterpretq_s8_u8(high));
            }
        }
    }
    codes
}

impl Lanes for Rows {
    #[inline(always)]
    unsafe fn halves(bytes: &[u8]) -> Self {
        // SAFETY: Advanced SIMD, part of every arm64 CPU.
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
        [vmulq_f32(self[0], other[0]), vmulq_f32(self[1], other[1])]
    }
    #[inline(always)]
    unsafe fn neg(self) -> Self {
        [vnegq_f32(self[0]), vnegq_f32(self[1])]
    }
}

/// Eight f16 (a row each), widened exactly by `fcvtl`.
#[inline(always)]
unsafe fn halves(bytes: &[u8]) -> Rows {
    assert!(bytes.len() >= 16);
    // SAFETY: 16 bytes, checked above; registers only otherwise.
    unsafe {
        let h = vld1q_u8(bytes.as_ptr());
        let (low, high): (float32x4_t, float32x4_t);
        asm!("fcvtl {low:v}.4s, {h:v}.4h", "fcvtl2 {high:v}.4s, {h:v}.8h", h = in(vreg) h, low = out(vreg) low, high = lateout(vreg) high, options(pure, nomem, nostack));
        [low, high]
    }
}

/// Eight E8M0 bytes (a row each) as `e8m0_half` gives them: 2^(e − 128), built as bits.
#[inline(always)]
unsafe fn powers_of_two(bytes: &[u8]) -> Rows {
    assert!(bytes.len() >= 8);
    // SAFETY: 8 bytes, checked above.
    let e = vmovl_u8(unsafe { vld1_u8(bytes.as_ptr()) });
    [vmovl_u16(vget_low_u16(e)), vmovl_high_u16(e)].map(|e| {
        let normal = vshlq_n_u32::<23>(vsubq_u32(e, vdupq_n_u32(1)));
        let subnormal = vshlq_u32(vdupq_n_u32(0x0020_0000), vreinterpretq_s32_u32(e));
        vreinterpretq_f32_u32(vbslq_u32(vcgtq_u32(e, vdupq_n_u32(1)), normal, subnormal))
    })
}

/// Eight bytes (a row each) as floats, unsigned or signed.
#[inline(always)]
unsafe fn bytes(bytes: &[u8], signed: bool) -> Rows {
    assert!(bytes.len() >= 8);
    // SAFETY: 8 bytes, checked above.
    let wide = unsafe { if signed { vmovl_s8(vld1_s8(bytes.as_ptr().cast())) } else { vreinterpretq_s16_u16(vmovl_u8(vld1_u8(bytes.as_ptr()))) } };
    [vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), vcvtq_f32_s32(vmovl_high_s16(wide))]
}
