//! Writing the k-quants Q4_K, Q5_K and Q6_K (super-blocks of 256; the layouts `ggml::q4_k`,
//! `ggml::q5_k` and `ggml::q6_k` decode). Each sub-block gets the scale (and, for Q4_K, the offset) that fits its
//! values best in a least-squares sense, searched over a few candidates; the super-block then
//! stores those as 6- or 8-bit multiples of one f16 scale, and every value is rounded again
//! against the scales as stored. Not ggml's search step for step, so the bytes may differ from
//! llama.cpp's; the error is of the same kind (measured in docs/quantization.md).

fn nearest(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

/// Scale `s` and offset `m` >= 0 for values `x` ≈ s·q - m with q in 0..=max_q, fitted by least
/// squares over candidate grids (the min-max one and some around it). (0, 0) for all-zero input.
fn fit_affine(x: &[f32], max_q: i32) -> (f32, f32) {
    let lo = x.iter().fold(0f32, |a, &v| a.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let error = |s: f32, m: f32| -> f32 {
        x.iter().map(|&v| {
            let q = if s > 0.0 { nearest((v + m) / s, 0, max_q) } else { 0 };
            let d = v - (s * q as f32 - m);
            d * d
        }).sum()
    };
    let mut best = ((hi - lo) / max_q as f32, -lo);
    let mut best_err = error(best.0, best.1);
    // Stretch the grid a little either way, then refit s and m to the rounded codes.
    for step in -6..=6 {
        let s0 = (hi - lo) / (max_q as f32 + step as f32 * 0.25);
        if s0 <= 0.0 {
            continue;
        }
        let q: Vec<f32> = x.iter().map(|&v| nearest((v - lo) / s0, 0, max_q) as f32).collect();
        let n = x.len() as f32;
        let (sq, sqq, sx, sqx) = q.iter().zip(x).fold((0f32, 0f32, 0f32, 0f32), |(a, b, c, d), (&q, &v)| (a + q, b + q * q, c + v, d + q * v));
        let det = n * sqq - sq * sq;
        if det <= 0.0 {
            continue;
        }
        let s = (n * sqx - sq * sx) / det;
        let m = ((s * sq - sx) / n).max(0.0);
        if s > 0.0 {
            let err = error(s, m);
            if err < best_err {
                best = (s, m);
                best_err = err;
            }
        }
    }
    best
}

/// Scale `s` (signed) for values `x` ≈ s·q with q in -32..=31: the largest magnitude maps to -32,
/// then a few nearby scales refitted by least squares.
fn fit_symmetric(x: &[f32]) -> f32 {
    let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    if max == 0.0 {
        return 0.0;
    }
    let error = |s: f32| -> f32 { x.iter().map(|&v| (v - s * nearest(v / s, -32, 31) as f32).powi(2)).sum() };
    let mut best = max / -32.0;
    let mut best_err = error(best);
    for step in -4..=4 {
        let s0 = max / (-32.0 + step as f32 * 0.5);
        let (qx, qq) = x.iter().fold((0f32, 0f32), |(a, b), &v| {
            let q = nearest(v / s0, -32, 31) as f32;
            (a + q * v, b + q * q)
        });
        if qq > 0.0 {
            let s = qx / qq;
            let err = error(s);
            if err < best_err {
                best = s;
                best_err = err;
            }
        }
    }
    best
}

fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// One Q4_K super-block: { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }.
pub(super) fn quantize_q4_k(x: &[f32], out: &mut Vec<u8>) {
    quantize_affine_k(x, 15, out);
}

/// One Q5_K super-block: { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }: Q4_K's with a
/// fifth bit per value (bit r of qh[l] for value 32r + l).
pub(super) fn quantize_q5_k(x: &[f32], out: &mut Vec<u8>) {
    quantize_affine_k(x, 31, out);
}

/// Q4_K (`max_q` 15) or Q5_K (31): eight sub-blocks of 32, each s·q − m with 6-bit multiples of
/// the super-block's d and dmin.
fn quantize_affine_k(x: &[f32], max_q: i32, out: &mut Vec<u8>) {
    let fits: Vec<(f32, f32)> = x.chunks_exact(32).map(|sub| fit_affine(sub, max_q)).collect();
    let max_scale = fits.iter().fold(0f32, |a, f| a.max(f.0));
    let max_min = fits.iter().fold(0f32, |a, f| a.max(f.1));
    let d = f16_round(max_scale / 63.0);
    let dmin = f16_round(max_min / 63.0);
    let sc: Vec<u8> = fits.iter().map(|f| if d > 0.0 { nearest(f.0 / d, 0, 63) as u8 } else { 0 }).collect();
    let mn: Vec<u8> = fits.iter().map(|f| if dmin > 0.0 { nearest(f.1 / dmin, 0, 63) as u8 } else { 0 }).collect();
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = sc[j];
            scales[j + 4] = mn[j];
        } else {
            scales[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
            scales[j - 4] |= (sc[j] >> 4) << 6;
            scales[j] |= (mn[j] >> 4) << 6;
        }
    }
    let q: Vec<u8> = x
        .chunks_exact(32)
        .enumerate()
        .flat_map(|(j, sub)| {
            let (s, m) = (d * sc[j] as f32, dmin * mn[j] as f32);
            sub.iter().map(move |&v| if s > 0.0 { nearest((v + m) / s, 0, max_q) as u8 } else { 0 }).collect::<Vec<_>>()
        })
        .collect();
    out.extend(half::f16::from_f32(d).to_le_bytes());
    out.extend(half::f16::from_f32(dmin).to_le_bytes());
    out.extend(scales);
    if max_q > 15 {
        out.extend((0..32).map(|l| (0..8).fold(0u8, |h, r| h | ((q[32 * r + l] >> 4) << r))));
    }
    // Chunk c holds sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles).
    for c in 0..4 {
        out.extend((0..32).map(|l| (q[64 * c + l] & 0x0F) | ((q[64 * c + 32 + l] & 0x0F) << 4)));
    }
}

/// One Q6_K super-block: { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }.
pub(super) fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let fits: Vec<f32> = x.chunks_exact(16).map(fit_symmetric).collect();
    let max = fits.iter().fold(0f32, |a, &s| if s.abs() > a.abs() { s } else { a });
    let d = f16_round(max.abs() / 127.0);
    let sc: Vec<i8> = fits.iter().map(|&s| if d > 0.0 { nearest(s / d, -128, 127) as i8 } else { 0 }).collect();
    // Codes plus 32, in 0..64.
    let q: Vec<u8> = x
        .chunks_exact(16)
        .zip(&sc)
        .flat_map(|(sub, &c)| {
            let s = d * c as f32;
            sub.iter().map(move |&v| (if s != 0.0 { nearest(v / s, -32, 31) } else { 0 } + 32) as u8).collect::<Vec<_>>()
        })
        .collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    // Half h holds values 128h.. as four rows of 32: ql low nibbles (rows 0, 1), high (2, 3).
    for h in 0..2 {
        for l in 0..32 {
            let [q1, q2, q3, q4] = [0, 32, 64, 96].map(|o| q[128 * h + o + l]);
            ql[64 * h + l] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
            ql[64 * h + 32 + l] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
            qh[32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.iter().map(|&c| c as u8));
    out.extend(half::f16::from_f32(d).to_le_bytes());
}
