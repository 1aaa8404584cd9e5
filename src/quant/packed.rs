//! The device layout of the 4-, 5-, 6- and 8-bit block formats: every GGML format Atlas reads, and
//! NVFP4 safetensors, rearranged (not re-quantised) into planes that a GPU reads with aligned
//! 16-byte loads. The bytes are the file's own, moved: a matrix takes as much memory on the device
//! as in the file (plus 4 bytes for NVFP4's tensor factor).
//!
//! A row is cut into runs of 32 values. Three planes follow each other in one buffer:
//! - **codes**: 16 bytes a run, `rows * cols / 2` in all. Byte i holds the low 4 bits of value i
//!   (low nibble) and of value i + 16 (high nibble), the arrangement Q4_0 already has.
//! - **high bits** (Q5_K: 1, Q6_K: 2, Q8_0: 4 bits a value): per run four fields of `8 * hb` bits, one
//!   for each 32-bit word of its codes; in field w, byte k of that word (k = 0..3) owns `2 * hb`
//!   bits at `2 * hb * k`: the low `hb` for value 4w + k, the next `hb` for value 16 + 4w + k. So a
//!   kernel that takes a word of codes finds the matching high bits in one small load.
//! - **meta**: the scales, per group of runs as the format has them (Q4_K's 16-byte header of 8
//!   runs, Q4_0's f16 per run, ...), unchanged; then, for NVFP4, the f32 tensor factor (1 for GGUF).
//!
//! Each run has a scale `s` and an offset `o` for its first 16 values and for its last 16
//! (`RunScales`); value = s · level(code) − o, where level is the code minus a zero point (Q8_0:
//! 128, Q4_0: 8, Q6_K: 32, else 0) or an entry of the format's table (IQ4, E2M1, ROCmFP4's
//! Codebook10). `dequant_row` computes it in the same f32 operations as `GgmlFormat::dequant_blocks`,
//! so the two agree exactly; kernels/common/packed.h is its device twin.

use super::fp4::{Nvfp4Matrix, CODEBOOK10, E2M1_DOUBLED};
use super::ggml::{scale_min_k4, IQ4_LEVELS};
use super::{GgmlFormat, QuantMatrix};
use crate::{Error, Result};

/// Values per run.
pub const RUN: usize = 32;

/// A matrix in the device layout.
pub struct PackedMatrix {
    pub format: GgmlFormat,
    pub rows: usize,
    pub cols: usize,
    /// codes, high bits, meta and (NVFP4) the factor, back to back.
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedMatrix {} [{}, {}]", self.format, self.rows, self.cols)
    }
}

/// High bits per value beyond the four of the codes plane.
pub fn high_bits(format: GgmlFormat) -> usize {
    match format {
        GgmlFormat::Q8_0 => 4,
        GgmlFormat::Q6_K => 2,
        GgmlFormat::Q5_K | GgmlFormat::Q5_0 | GgmlFormat::Q5_1 => 1,
        _ => 0,
    }
}

/// (runs, bytes) of one group of the meta plane.
pub fn meta_group(format: GgmlFormat) -> (usize, usize) {
    match format {
        GgmlFormat::Q4_K | GgmlFormat::Q5_K => (8, 16),
        GgmlFormat::Q6_K => (8, 18),
        GgmlFormat::IQ4_XS => (8, 8),
        GgmlFormat::Q4_1 | GgmlFormat::Q5_1 => (1, 4),
        GgmlFormat::Q5_0 => (1, 2),
        GgmlFormat::MXFP4 | GgmlFormat::ROCMFP4_FAST => (1, 1),
        GgmlFormat::Q8_0 | GgmlFormat::Q4_0 | GgmlFormat::IQ4_NL | GgmlFormat::NVFP4 | GgmlFormat::ROCMFP4 => (1, 2),
    }
}

/// Byte offsets of the high-bits and meta planes and the total size, for `rows` rows of `cols`
/// values (the kernels compute the same from the matrix shape).
pub fn plane_offsets(format: GgmlFormat, rows: usize, cols: usize) -> Option<(usize, usize, usize)> {
    let runs = rows.checked_mul(cols / RUN)?;
    let (group_runs, group_bytes) = meta_group(format);
    let high = runs.checked_mul(16)?;
    let meta = high.checked_add(runs.checked_mul(4 * high_bits(format))?)?;
    let end = meta.checked_add((runs / group_runs).checked_mul(group_bytes)?)?;
    let factor = if format == GgmlFormat::NVFP4 { 4 } else { 0 };
    Some((high, meta, end.checked_add(factor)?))
}

/// Whether a matrix of `cols` values a row can be packed: whole runs, and whole meta groups.
fn packable(format: GgmlFormat, cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(RUN * meta_group(format).0)
}

/// One run's scale and offset for its first and its last 16 values.
#[derive(Debug, Clone, Copy, PartialEq)]
struct RunScales {
    s_lo: f32,
    o_lo: f32,
    s_hi: f32,
    o_hi: f32,
}

impl RunScales {
    fn same(s: f32, o: f32) -> Self {
        RunScales { s_lo: s, o_lo: o, s_hi: s, o_hi: o }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The scales of run `j` (0-based within its meta group `m`), times `factor` where the format has one.
fn run_scales(format: GgmlFormat, m: &[u8], j: usize, factor: f32) -> RunScales {
    match format {
        GgmlFormat::Q8_0 | GgmlFormat::Q4_0 | GgmlFormat::Q5_0 | GgmlFormat::IQ4_NL => RunScales::same(f16_at(m, 0), 0.0),
        GgmlFormat::Q4_1 | GgmlFormat::Q5_1 => RunScales::same(f16_at(m, 0), -f16_at(m, 2)),
        GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
            let (sc, mn) = scale_min_k4(j, &m[4..16]);
            RunScales::same(f16_at(m, 0) * sc as f32, f16_at(m, 2) * mn as f32)
        }
        GgmlFormat::Q6_K => {
            let d = f16_at(m, 16);
            let (lo, hi) = (m[2 * j] as i8, m[2 * j + 1] as i8);
            RunScales { s_lo: d * lo as f32, o_lo: 0.0, s_hi: d * hi as f32, o_hi: 0.0 }
        }
        GgmlFormat::IQ4_XS => {
            let scales_h = u16::from_le_bytes([m[2], m[3]]);
            let low = (m[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
            let high = ((scales_h >> (2 * j)) & 3) as u8;
            RunScales::same(f16_at(m, 0) * ((low | (high << 4)) as i32 - 32) as f32, 0.0)
        }
        GgmlFormat::MXFP4 => RunScales::same(super::fp4::e8m0_half(m[0]), 0.0),
        GgmlFormat::NVFP4 => RunScales {
            s_lo: super::fp4::ue4m3_half(m[0]) * factor,
            o_lo: 0.0,
            s_hi: super::fp4::ue4m3_half(m[1]) * factor,
            o_hi: 0.0,
        },
        GgmlFormat::ROCMFP4 => RunScales {
            s_lo: super::fp4::rocmfp4_scale(m[0]),
            o_lo: 0.0,
            s_hi: super::fp4::rocmfp4_scale(m[1]),
            o_hi: 0.0,
        },
        GgmlFormat::ROCMFP4_FAST => RunScales::same(super::fp4::rocmfp4_scale(m[0]), 0.0),
    }
}

/// The level of a code (low 4 bits | high bits << 4).
fn level(format: GgmlFormat, q: u8) -> f32 {
    match format {
        GgmlFormat::Q8_0 => (q as i32 - 128) as f32,
        GgmlFormat::Q4_0 => (q as i32 - 8) as f32,
        GgmlFormat::Q6_K => (q as i32 - 32) as f32,
        GgmlFormat::Q5_0 => (q as i32 - 16) as f32,
        GgmlFormat::Q4_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K | GgmlFormat::Q5_1 => q as f32,
        GgmlFormat::IQ4_NL | GgmlFormat::IQ4_XS => IQ4_LEVELS[q as usize] as f32,
        GgmlFormat::MXFP4 | GgmlFormat::NVFP4 => E2M1_DOUBLED[q as usize] as f32,
        GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => CODEBOOK10[q as usize] as f32,
    }
}

/// One run of a source row, as codes (full width) and its meta bytes.
type RunCodes = [u8; RUN];

/// Appends one row's runs to the planes: `codes` gets the runs' codes (full width, up to 8 bits).
fn push_runs(format: GgmlFormat, runs: &[RunCodes], codes: &mut Vec<u8>, high: &mut Vec<u8>) {
    let hb = high_bits(format);
    for run in runs {
        codes.extend((0..16).map(|i| (run[i] & 0x0F) | (run[i + 16] << 4)));
        if hb == 0 {
            continue;
        }
        for w in 0..4 {
            let mut field = 0u32;
            for k in 0..4 {
                let (lo, hi) = ((run[4 * w + k] >> 4) as u32, (run[16 + 4 * w + k] >> 4) as u32);
                field |= (lo | (hi << hb)) << (2 * hb * k);
            }
            high.extend_from_slice(&field.to_le_bytes()[..hb]);
        }
    }
}

/// The runs (codes) and meta bytes of one row of GGML blocks.
fn split_row(format: GgmlFormat, blocks: &[u8], runs: &mut Vec<RunCodes>, meta: &mut Vec<u8>) {
    let bb = format.block_bytes();
    for b in blocks.chunks_exact(bb) {
        match format {
            GgmlFormat::Q8_0 => {
                meta.extend_from_slice(&b[..2]);
                runs.push(std::array::from_fn(|i| b[2 + i] ^ 0x80));
            }
            GgmlFormat::Q4_0 | GgmlFormat::IQ4_NL => {
                meta.extend_from_slice(&b[..2]);
                runs.push(nibble_run(&b[2..18]));
            }
            GgmlFormat::Q4_1 => {
                meta.extend_from_slice(&b[..4]);
                runs.push(nibble_run(&b[4..20]));
            }
            // The fifth bit of value i is bit i of the four qh bytes.
            GgmlFormat::Q5_0 => {
                meta.extend_from_slice(&b[..2]);
                runs.push(fifth_bits(nibble_run(&b[6..22]), &b[2..6]));
            }
            GgmlFormat::Q5_1 => {
                meta.extend_from_slice(&b[..4]);
                runs.push(fifth_bits(nibble_run(&b[8..24]), &b[4..8]));
            }
            GgmlFormat::MXFP4 => {
                meta.push(b[0]);
                runs.push(nibble_run(&b[1..17]));
            }
            GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => {
                meta.extend_from_slice(&b[16..]);
                runs.push(nibble_run(&b[..16]));
            }
            GgmlFormat::NVFP4 => {
                // Four runs of 16 (8 bytes each: low nibbles its values 0..8, high 8..16) become two
                // runs of 32 with a scale per half.
                for pair in 0..2 {
                    meta.extend_from_slice(&b[2 * pair..2 * pair + 2]);
                    runs.push(std::array::from_fn(|i| {
                        let (sub, j) = (2 * pair + i / 16, i % 16);
                        let byte = b[4 + 8 * sub + j % 8];
                        if j < 8 { byte & 0x0F } else { byte >> 4 }
                    }));
                }
            }
            GgmlFormat::Q4_K => {
                meta.extend_from_slice(&b[..16]);
                push_k_runs(&b[16..144], None, runs);
            }
            GgmlFormat::Q5_K => {
                meta.extend_from_slice(&b[..16]);
                push_k_runs(&b[48..176], Some(&b[16..48]), runs);
            }
            GgmlFormat::Q6_K => {
                meta.extend_from_slice(&b[192..210]);
                for r in 0..8 {
                    // Value v of the super-block: half v / 128, l = v % 32, quarter (v % 128) / 32.
                    runs.push(std::array::from_fn(|i| {
                        let v = 32 * r + i;
                        let (half, quarter, l) = (v / 128, (v % 128) / 32, v % 32);
                        let ql = b[64 * half + l + 32 * (quarter % 2)];
                        let low = if quarter < 2 { ql & 0x0F } else { ql >> 4 };
                        let qh = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
                        low | (qh << 4)
                    }));
                }
            }
            GgmlFormat::IQ4_XS => {
                meta.extend_from_slice(&b[..8]);
                for r in 0..8 {
                    runs.push(nibble_run(&b[8 + 16 * r..24 + 16 * r]));
                }
            }
        }
    }
}

/// `run` with bit i of `qh` (four little-endian bytes) as bit 4 of code i.
fn fifth_bits(run: RunCodes, qh: &[u8]) -> RunCodes {
    let bits = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    std::array::from_fn(|i| run[i] | (((bits >> i) & 1) as u8) << 4)
}

/// 16 bytes of codes already in the run arrangement (low nibbles 0..16, high 16..32).
fn nibble_run(qs: &[u8]) -> RunCodes {
    std::array::from_fn(|i| if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 })
}

/// The 8 runs of a Q4_K / Q5_K super-block: qs byte 32c + l holds value 64c + l (low nibble) and
/// 64c + 32 + l (high); Q5_K's fifth bit of value 32r + l is bit r of qh[l].
fn push_k_runs(qs: &[u8], qh: Option<&[u8]>, runs: &mut Vec<RunCodes>) {
    for r in 0..8 {
        runs.push(std::array::from_fn(|l| {
            let byte = qs[32 * (r / 2) + l];
            let low = if r % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            low | qh.map_or(0, |h| ((h[l] >> r) & 1) << 4)
        }));
    }
}

impl PackedMatrix {
    /// Rearranges `rows` rows of GGML blocks (`row(r)` gives row r's bytes).
    fn from_ggml_rows<'a>(format: GgmlFormat, rows: usize, cols: usize, row: impl Fn(usize) -> &'a [u8] + Sync) -> Result<Self> {
        Self::build(format, rows, cols, 1.0, |r, runs, meta| split_row(format, row(r), runs, meta))
    }

    fn build(
        format: GgmlFormat,
        rows: usize,
        cols: usize,
        factor: f32,
        split: impl Fn(usize, &mut Vec<RunCodes>, &mut Vec<u8>) + Sync,
    ) -> Result<Self> {
        use rayon::prelude::*;
        let (_, _, end) = plane_offsets(format, rows, cols)
            .filter(|_| packable(format, cols))
            .ok_or_else(|| Error::InvalidArgument(format!("{format} matrix [{rows}, {cols}] cannot be packed")))?;
        // Bands of rows in parallel (a large model's load waits on this), joined in order.
        const BAND: usize = 256;
        let bands: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = (0..rows.div_ceil(BAND))
            .into_par_iter()
            .map(|band| {
                let (mut codes, mut high, mut meta, mut runs) = (Vec::new(), Vec::new(), Vec::new(), Vec::with_capacity(cols / RUN));
                for r in band * BAND..((band + 1) * BAND).min(rows) {
                    runs.clear();
                    split(r, &mut runs, &mut meta);
                    push_runs(format, &runs, &mut codes, &mut high);
                }
                (codes, high, meta)
            })
            .collect();
        let mut bytes = Vec::with_capacity(end);
        for plane in 0..3 {
            for band in &bands {
                bytes.extend_from_slice([&band.0, &band.1, &band.2][plane]);
            }
        }
        if format == GgmlFormat::NVFP4 {
            bytes.extend_from_slice(&factor.to_le_bytes());
        }
        if bytes.len() != end {
            return Err(Error::InvalidArgument(format!("{format} matrix [{rows}, {cols}]: packed {} bytes, expected {end}", bytes.len())));
        }
        Ok(PackedMatrix { format, rows, cols, bytes })
    }

    /// The NVFP4 safetensors layout (codes two per byte along a row, an E4M3 scale per 16, a
    /// tensor factor) in the device layout; `rows` picks and orders the rows.
    fn from_nvfp4(m: &Nvfp4Matrix, rows: &[usize]) -> Result<Self> {
        let (codes, scales, factor) = m.parts();
        let cols = m.cols();
        Self::build(GgmlFormat::NVFP4, rows.len(), cols, factor, |r, runs, meta| {
            let row = rows[r];
            let (c, s) = (&codes[row * cols / 2..(row + 1) * cols / 2], &scales[row * cols / 16..(row + 1) * cols / 16]);
            for run in 0..cols / RUN {
                meta.extend_from_slice(&s[2 * run..2 * run + 2]);
                runs.push(std::array::from_fn(|i| {
                    let v = RUN * run + i;
                    if v.is_multiple_of(2) { c[v / 2] & 0x0F } else { c[v / 2] >> 4 }
                }));
            }
        })
    }

    /// The tensor factor (NVFP4) or 1.
    fn factor(&self) -> f32 {
        match self.format {
            GgmlFormat::NVFP4 => {
                let at = self.bytes.len() - 4;
                f32::from_le_bytes([self.bytes[at], self.bytes[at + 1], self.bytes[at + 2], self.bytes[at + 3]])
            }
            _ => 1.0,
        }
    }

    /// The CPU reference of the device decode: row `row` as f32.
    pub fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let (format, cols) = (self.format, self.cols);
        let (high_at, meta_at, _) = plane_offsets(format, self.rows, cols).unwrap_or_default();
        let hb = high_bits(format);
        let (group_runs, group_bytes) = meta_group(format);
        let runs = cols / RUN;
        let factor = self.factor();
        for (run, values) in out.chunks_exact_mut(RUN).enumerate() {
            let global = row * runs + run;
            let codes = &self.bytes[16 * global..16 * global + 16];
            let group = global / group_runs;
            let meta = &self.bytes[meta_at + group * group_bytes..meta_at + (group + 1) * group_bytes];
            let sc = run_scales(format, meta, global % group_runs, factor);
            for (i, v) in values.iter_mut().enumerate() {
                let (byte, upper) = (i % 16, i >= 16);
                let mut q = if upper { codes[byte] >> 4 } else { codes[byte] & 0x0F };
                if hb > 0 {
                    let (w, k) = (byte / 4, byte % 4);
                    let at = high_at + (global * 4 + w) * hb;
                    let mut field = [0u8; 4];
                    field[..hb].copy_from_slice(&self.bytes[at..at + hb]);
                    let bits = u32::from_le_bytes(field) >> (2 * hb * k + if upper { hb } else { 0 });
                    q |= ((bits & ((1 << hb) - 1)) as u8) << 4;
                }
                let (s, o) = if upper { (sc.s_hi, sc.o_hi) } else { (sc.s_lo, sc.o_lo) };
                *v = s * level(format, q) - o;
            }
        }
    }
}

/// The format `pack` would give `w`, without packing it (None: `pack` would return None).
pub fn packed_format(w: &dyn QuantMatrix) -> Option<GgmlFormat> {
    if let Some(m) = w.as_ggml() {
        return packable(m.format(), m.cols()).then_some(m.format());
    }
    if let Some(m) = w.as_nvfp4() {
        return packable(GgmlFormat::NVFP4, m.cols()).then_some(GgmlFormat::NVFP4);
    }
    w.row_selection().and_then(|(inner, _)| packed_format(inner))
}

/// The matrix in the device layout, rows `rows` (in that order) or all; None for formats that are
/// not block formats (BF16, FP8, ...) or shapes that are not whole meta groups.
pub fn pack(w: &dyn QuantMatrix, rows: Option<&[usize]>) -> Option<Result<PackedMatrix>> {
    let all: Vec<usize>;
    let rows = match rows {
        Some(r) => r,
        None => {
            all = (0..w.rows()).collect();
            &all
        }
    };
    if let Some(m) = w.as_ggml() {
        let format = m.format();
        if !packable(format, m.cols()) {
            return None;
        }
        return Some(PackedMatrix::from_ggml_rows(format, rows.len(), m.cols(), |r| m.row_blocks(rows[r])));
    }
    if let Some(m) = w.as_nvfp4() {
        if !packable(GgmlFormat::NVFP4, m.cols()) {
            return None;
        }
        return Some(PackedMatrix::from_nvfp4(m, rows));
    }
    if let Some((inner, selected)) = w.row_selection() {
        let mapped: Vec<usize> = rows.iter().map(|&r| selected[r]).collect();
        return pack(inner, Some(&mapped));
    }
    None
}


#[cfg(test)]
mod tests {
    use super::super::synthetic::random_ggml_blocks;
    use super::super::GgmlMatrix;
    use super::*;

    /// Every format, packed, decodes to exactly the values of the file's own blocks.
    #[test]
    fn packed_rows_decode_to_the_blocks_values() {
        for format in GgmlFormat::ALL {
            let (rows, cols) = (5, 512);
            let blocks = random_ggml_blocks(format, rows * cols / format.block_size(), 7 + format.ggml_type() as u64);
            let m = GgmlMatrix::new(format, rows, cols, blocks).unwrap();
            let packed = pack(&m, None).unwrap().unwrap();
            assert_eq!(packed_format(&m), Some(packed.format), "{format}: the format pack gives");
            let factor = if format == GgmlFormat::NVFP4 { 4 } else { 0 };
            assert_eq!(packed.bytes.len(), m.storage_bytes() + factor, "{format}: the file's bytes");
            let (mut want, mut got) = (vec![0f32; cols], vec![f32::NAN; cols]);
            for r in 0..rows {
                m.dequant_row(r, &mut want);
                packed.dequant_row(r, &mut got);
                for (c, (w, g)) in want.iter().zip(&got).enumerate() {
                    assert!(w == g || (w.is_nan() && g.is_nan()), "{format} row {r} col {c}: {g} != {w}");
                }
            }
            // A selection of rows packs those rows.
            let picked = pack(&m, Some(&[3, 0])).unwrap().unwrap();
            picked.dequant_row(0, &mut got);
            m.dequant_row(3, &mut want);
            assert!(want.iter().zip(&got).all(|(w, g)| w == g || (w.is_nan() && g.is_nan())), "{format} selection");
        }
    }

    #[test]
    fn nvfp4_safetensors_rows_decode_to_their_values() {
        let mut rng = crate::sampling::Rng::new(11);
        let (rows, cols) = (3, 96);
        let codes: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 16).map(|_| (rng.next_u64() % 0x7E) as u8).collect();
        let m = Nvfp4Matrix::new(rows, cols, codes, scales, 0.37).unwrap();
        let packed = pack(&m, None).unwrap().unwrap();
        assert_eq!(packed_format(&m), Some(GgmlFormat::NVFP4));
        // Rows that are not whole runs of 32 do not pack.
        let odd = Nvfp4Matrix::new(1, 48, vec![0x21; 24], vec![0x38; 3], 1.0).unwrap();
        assert!(packed_format(&odd).is_none() && pack(&odd, None).is_none());
        let (mut want, mut got) = (vec![0f32; cols], vec![f32::NAN; cols]);
        for r in 0..rows {
            m.dequant_row(r, &mut want);
            packed.dequant_row(r, &mut got);
            assert_eq!(want, got, "row {r}");
        }
    }

    #[test]
    fn plane_layout_by_hand() {
        // Q8_0, one run: codes are stored offset by 128; value i's high nibble sits in the field of
        // word i / 4 (i < 16) at byte i % 4, low half.
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2] = 0x7F; // value 0: 127 → 255
        block[2 + 21] = 0x81; // value 21: -127 → 1
        let m = GgmlMatrix::new(GgmlFormat::Q8_0, 1, 32, block).unwrap();
        let p = pack(&m, None).unwrap().unwrap();
        assert_eq!(p.bytes[0], 0x0F, "value 0 (0xFF) low nibble, value 16 (0x80) low nibble above it");
        assert_eq!(p.bytes[16] & 0x0F, 0x0F, "value 0's high nibble in word 0's field");
        // value 21 = 16 + 4·1 + 1: field of word 1 (bytes 20..24), byte 1, high half.
        assert_eq!(p.bytes[16 + 4 + 1] >> 4, 0, "1 >> 4");
        assert_eq!(p.bytes[5] >> 4, 1, "value 21's low nibble is byte 5's high nibble");
        let mut out = vec![0f32; 32];
        p.dequant_row(0, &mut out);
        assert_eq!((out[0], out[21], out[1]), (63.5, -63.5, 0.0));
    }
}
