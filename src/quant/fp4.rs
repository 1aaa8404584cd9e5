//! FP4 formats: 4-bit E2M1 codes (a sign bit and the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) in
//! small blocks, each block with a scale: MXFP4 (32 codes, a power-of-two E8M0 scale) and NVFP4
//! (16 codes, an FP8 E4M3 scale) as GGUF stores them. The CPU references; the codes are kept as
//! doubled integers (-12..12) so a block is integers times one float.

/// E2M1 code → value × 2 (bit 3 is the sign).
const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An unsigned E4M3 scale byte (bias 7; exponent 0 is subnormal: man · 2^-9), halved to undo the
/// doubled codes; 0x7F (the NaN pattern) and 0 are 0.
fn ue4m3_half(x: u8) -> f32 {
    let exp = (x >> 3) & 0x0F;
    let man = (x & 7) as f32;
    let value = if exp == 0 { man * (2f32).powi(-9) } else { (1.0 + man / 8.0) * (2f32).powi(exp as i32 - 7) };
    if x == 0 || x == 0x7F { 0.0 } else { value * 0.5 }
}

/// An E8M0 scale byte 2^(e - 127), halved to undo the doubled codes (e = 0 and 1 are the
/// subnormal-range powers 2^-128 and 2^-127 as ggml computes them).
fn e8m0_half(e: u8) -> f32 {
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
}
