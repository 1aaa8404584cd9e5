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
    /// arm64 with the dot-product extension (Armv8.4, optional from 8.2): `sdot` by element.
    NeonDotprod,
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
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            kernels.push(DotKernel::NeonDotprod);
        }
        kernels
    }

    pub fn name(self) -> &'static str {
        match self {
            DotKernel::Scalar => "scalar",
            DotKernel::Avx2 => "avx2",
            DotKernel::Avx512Vnni => "avx512-vnni",
            DotKernel::NeonDotprod => "neon-dotprod",
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
        #[cfg(target_arch = "aarch64")]
        // SAFETY: DotKernel::NeonDotprod is only chosen where the dot-product extension is detected.
        DotKernel::NeonDotprod => unsafe { neon::dot_groups(m, groups, inputs, out) },
        // Never chosen on other CPUs (`available`); the same sums.
        _ => scalar::dot_groups(m, groups, inputs, out),
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

/// `$body` with `$F` a constant, the index of `$format` in `GgmlFormat::ALL`: a SIMD kernel's
/// one copy per format, its decoding resolved at compile time.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! for_each_format {
    ($format:expr, $F:ident => $body:expr) => {
        match GgmlFormat::ALL.iter().position(|&f| f == $format) {
            Some(0) => { const $F: usize = 0; $body }
            Some(1) => { const $F: usize = 1; $body }
            Some(2) => { const $F: usize = 2; $body }
            Some(3) => { const $F: usize = 3; $body }
            Some(4) => { const $F: usize = 4; $body }
            Some(5) => { const $F: usize = 5; $body }
            Some(6) => { const $F: usize = 6; $body }
            Some(7) => { const $F: usize = 7; $body }
            Some(8) => { const $F: usize = 8; $body }
            Some(9) => { const $F: usize = 9; $body }
            Some(10) => { const $F: usize = 10; $body }
            Some(11) => { const $F: usize = 11; $body }
            Some(12) => { const $F: usize = 12; $body }
            _ => { const $F: usize = 13; $body }
        }
    };
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const _: () = assert!(GgmlFormat::ALL.len() == 14, "for_each_format names each format's index");

/// Eight rows' floats in a SIMD kernel's registers (one or two), with the loads and steps the
/// block headers need: each the same values as the scalar kernel's.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
trait Lanes: Copy {
    /// Eight f16 (a row each), widened exactly.
    unsafe fn halves(bytes: &[u8]) -> Self;
    /// Eight E8M0 bytes (a row each) as `e8m0_half` gives them.
    unsafe fn powers_of_two(bytes: &[u8]) -> Self;
    /// Eight bytes (a row each) as floats, unsigned or signed.
    unsafe fn bytes(bytes: &[u8], signed: bool) -> Self;
    unsafe fn mul(self, other: Self) -> Self;
    unsafe fn neg(self) -> Self;
}

/// A group block's d and its second field (Q4_1's m, the k-quants' dmin, ROCmFP4's second
/// scale; d again where there is none), eight rows at once.
///
/// # Safety
/// The CPU features of `V`'s kernel.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn block_fields<V: Lanes>(format: GgmlFormat, header: &[u8]) -> (V, V) {
    // SAFETY: the caller's features; each load checks its slice.
    unsafe {
        let d = if format == GgmlFormat::MXFP4 { V::powers_of_two(&header[..8]) } else { V::halves(&header[..16]) };
        let second = if has_offset(format) || format == GgmlFormat::ROCMFP4 { V::halves(&header[16..32]) } else { d };
        (d, second)
    }
}

/// `piece_scales` for the eight rows of a group at once, given `block_fields`: the scales of
/// piece `k`'s two halves and its offset (where the format has them; else one of the fields).
///
/// # Safety
/// The CPU features of `V`'s kernel.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn lane_scales<V: Lanes>(format: GgmlFormat, header: &[u8], k: usize, (d, second): (V, V)) -> (V, V, V) {
    // SAFETY: the caller's features; each load checks its slice.
    unsafe {
        match format {
            GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
                let scale = d.mul(V::bytes(&header[32 + 8 * k..], false));
                (scale, scale, second.mul(V::bytes(&header[96 + 8 * k..], false)).neg())
            }
            GgmlFormat::Q6_K => (d.mul(V::bytes(&header[16 + 16 * k..], true)), d.mul(V::bytes(&header[24 + 16 * k..], true)), d),
            GgmlFormat::IQ4_XS => {
                let scale = d.mul(V::bytes(&header[16 + 8 * k..], true));
                (scale, scale, d)
            }
            GgmlFormat::NVFP4 => (V::halves(&header[32 * k..]), V::halves(&header[32 * k + 16..]), d),
            GgmlFormat::ROCMFP4 => (d, second, d),
            _ => (d, d, second),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "aarch64")]
mod neon;

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

    /// Where `ATLAS_EXPECT_DOT_KERNEL` names a kernel (scripts/test_arm64.sh names the one
    /// each emulated CPU must get), detection chooses it: a run meant for a SIMD kernel cannot
    /// pass on the scalar one unnoticed.
    #[test]
    fn detection_chooses_the_expected_kernel() {
        if let Ok(want) = std::env::var("ATLAS_EXPECT_DOT_KERNEL") {
            assert_eq!(DotKernel::detect().name(), want, "available: {:?}", DotKernel::available());
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
