//! GGML block-format weights repacked for the CPU's integer kernels (`q8dot`): rows in groups of
//! eight, so that a 256-bit register holds the same four values of eight rows, a lane a row. One
//! `dpbusd` (or `maddubs`) then adds four products to each of eight rows' sums, with the input's
//! four codes broadcast from memory, and a group's eight results come out as one vector: no
//! horizontal sums, and a block's scales are applied to eight rows at once.
//!
//! Codes are read unsigned (`u` = code + bias: Q8_0 and the codebook formats + 128, Q4_0 + 8,
//! Q5_0 + 16, Q6_K + 32; the others have none), so `dpbusd` (unsigned × signed bytes) takes them as they are. A group's data is,
//! for each block of its rows (32 values, or 256 for the k-quants), a header and then one piece
//! per 32 values:
//!
//! | format | header (each field 8 lanes, one per row) | piece |
//! | --- | --- | --- |
//! | Q8_0 | d (f16) | 8 vectors of `u` |
//! | Q4_0 | d (f16) | 4 vectors of nibbles |
//! | Q4_1 | d, m (f16) | 4 vectors of nibbles |
//! | Q4_K | d, dmin (f16); 6-bit scales, then minimums (u8), for each of the 8 pieces | 4 vectors of nibbles |
//! | Q5_K | as Q4_K | 4 vectors of nibbles, 1 of fifth bits |
//! | Q5_0, Q5_1 | as Q4_0, Q4_1 | as Q5_K |
//! | Q6_K | d (f16); signed scales (i8) of each piece's two halves | 4 vectors of nibbles, 2 of high bit pairs |
//! | IQ4_NL | d (f16) | 4 vectors of level indices |
//! | IQ4_XS | d (f16); signed 6-bit scales (i8, ls − 32) of the 8 pieces | as IQ4_NL |
//! | MXFP4 | the E8M0 scale byte | as IQ4_NL |
//! | NVFP4 (64) | the E4M3 scale of each piece's halves, halved, as f16 (exact) | as IQ4_NL |
//! | ROCmFP4 | the scale of each half (ROCMFP4_FAST: one) as f16 (exact) | as IQ4_NL |
//!
//! The codebook formats (IQ4, FP4) keep their 4-bit indices; a kernel looks each level up (plus
//! 128) in a 16-byte table.
//!
//! Vector v's lane r holds row r's values 4v..4v+4 (Q8_0, v < 8), or as nibbles: low = values
//! 4v + c, high = values 16 + 4v + c of its byte c. Fifth bits: byte c of lane r, bit v = value
//! 4v + c's, bit 4 + v = value 16 + 4v + c's. Q6_K's high pairs: bits 2v..2v+2 of byte c of lane r
//! are value 4v + c's (first vector) or value 16 + 4v + c's (second). A last group short of eight
//! rows is padded with zero rows. The layout is the same size as the file's, but for the
//! k-quants' unpacked scales (+3 %).

use super::fp4::{e8m0_half, rocmfp4_scale, ue4m3_half, CODEBOOK10, E2M1_DOUBLED};
use super::ggml::{scale_min_k4, IQ4_LEVELS};
use super::{DType, GgmlFormat, GgmlMatrix, QuantMatrix};

/// Rows a group interleaves: the lanes of a 256-bit register of 32-bit sums.
pub const GROUP: usize = 8;
/// Values a piece holds: one block of the 8-bit input.
pub const PIECE: usize = super::q8dot::Q8_BLOCK;


/// (header bytes of a group's block, bytes of each piece).
#[inline(always)]
pub fn layout(format: GgmlFormat) -> (usize, usize) {
    match format {
        GgmlFormat::Q8_0 => (16, 256),
        GgmlFormat::Q4_0 => (16, 128),
        GgmlFormat::Q4_1 => (32, 128),
        GgmlFormat::Q4_K => (160, 128),
        GgmlFormat::Q5_K => (160, 160),
        GgmlFormat::Q5_0 => (16, 160),
        GgmlFormat::Q5_1 => (32, 160),
        GgmlFormat::Q6_K => (144, 192),
        GgmlFormat::IQ4_XS => (80, 128),
        GgmlFormat::MXFP4 => (8, 128),
        GgmlFormat::NVFP4 => (64, 128),
        GgmlFormat::ROCMFP4 => (32, 128),
        _ => (16, 128),
    }
}

/// The levels a codebook format's 4-bit indices stand for.
#[inline(always)]
pub fn levels(format: GgmlFormat) -> Option<&'static [i8; 16]> {
    match format {
        GgmlFormat::IQ4_NL | GgmlFormat::IQ4_XS => Some(&IQ4_LEVELS),
        GgmlFormat::MXFP4 | GgmlFormat::NVFP4 => Some(&E2M1_DOUBLED),
        GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => Some(&CODEBOOK10),
        _ => None,
    }
}

/// Whether a piece's two halves scale differently.
#[inline(always)]
pub fn two_scales(format: GgmlFormat) -> bool {
    matches!(format, GgmlFormat::Q6_K | GgmlFormat::NVFP4 | GgmlFormat::ROCMFP4)
}

/// What the stored codes exceed the signed ones by.
#[inline(always)]
pub fn bias(format: GgmlFormat) -> i32 {
    match format {
        GgmlFormat::Q4_0 => 8,
        GgmlFormat::Q5_0 => 16,
        GgmlFormat::Q6_K => 32,
        GgmlFormat::Q4_1 | GgmlFormat::Q5_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K => 0,
        _ => 128,
    }
}

/// Whether every value adds an offset (Q4_1's and Q5_1's m, the k-quants' minimums).
#[inline(always)]
pub fn has_offset(format: GgmlFormat) -> bool {
    matches!(format, GgmlFormat::Q4_1 | GgmlFormat::Q5_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K)
}

/// Whether codes have a fifth bit, in a vector after the nibbles.
#[inline(always)]
pub fn fifth_bits(format: GgmlFormat) -> bool {
    matches!(format, GgmlFormat::Q5_0 | GgmlFormat::Q5_1 | GgmlFormat::Q5_K)
}

/// Pieces in one block of the format.
#[inline(always)]
pub fn pieces_per_block(format: GgmlFormat) -> usize {
    format.block_size() / PIECE
}

/// Bytes of one block of a group (header and pieces).
#[inline(always)]
pub fn group_block_bytes(format: GgmlFormat) -> usize {
    let (header, piece) = layout(format);
    header + pieces_per_block(format) * piece
}

/// How piece `k` of a block scales, for row `r`: the scale of its first and second 16 values
/// (different only in Q6_K) and the offset of every value.
#[inline(always)]
pub fn piece_scales(format: GgmlFormat, header: &[u8], r: usize, k: usize) -> (f32, f32, f32) {
    let field = |at: usize| f16_at(header, at + 2 * r);
    let d = if format == GgmlFormat::MXFP4 { 0.0 } else { field(0) };
    match format {
        GgmlFormat::Q4_1 | GgmlFormat::Q5_1 => (d, d, field(16)),
        GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
            let scale = d * f32::from(header[32 + 8 * k + r]);
            (scale, scale, -(field(16) * f32::from(header[96 + 8 * k + r])))
        }
        GgmlFormat::Q6_K => (d * f32::from(header[16 + 16 * k + r] as i8), d * f32::from(header[24 + 16 * k + r] as i8), 0.0),
        GgmlFormat::IQ4_XS => {
            let scale = d * f32::from(header[16 + 8 * k + r] as i8);
            (scale, scale, 0.0)
        }
        GgmlFormat::MXFP4 => {
            let scale = e8m0_half(header[r]);
            (scale, scale, 0.0)
        }
        GgmlFormat::NVFP4 => (field(32 * k), field(32 * k + 16), 0.0),
        GgmlFormat::ROCMFP4 => (d, field(16), 0.0),
        _ => (d, d, 0.0),
    }
}

/// Stored code `j` (0..32) of row `r` in a piece.
#[inline(always)]
pub fn code(format: GgmlFormat, piece: &[u8], r: usize, j: usize) -> u8 {
    let (half, v, c) = (j / 16, j % 16 / 4, j % 4);
    if format == GgmlFormat::Q8_0 {
        return piece[32 * (j / 4) + 4 * r + c];
    }
    let byte = piece[32 * v + 4 * r + c];
    let nibble = if half == 0 { byte & 15 } else { byte >> 4 };
    match format {
        GgmlFormat::Q5_0 | GgmlFormat::Q5_1 | GgmlFormat::Q5_K => nibble | ((piece[128 + 4 * r + c] >> (4 * half + v)) & 1) << 4,
        GgmlFormat::Q6_K => nibble | ((piece[128 + 32 * half + 4 * r + c] >> (2 * v)) & 3) << 4,
        _ => match levels(format) {
            Some(levels) => (levels[usize::from(nibble)] as u8) ^ 0x80,
            None => nibble,
        },
    }
}

/// The f16 at `at`, widened.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// A GGML matrix with its rows in groups of eight (see the module's comment).
pub struct InterleavedMatrix {
    format: GgmlFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for InterleavedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterleavedMatrix").field("rows", &self.rows).field("cols", &self.cols).field("format", &self.format).finish_non_exhaustive()
    }
}

impl InterleavedMatrix {
    /// `m`'s rows (or those of `rows`, in that order) repacked. The source's pages of a mapped
    /// file are released as each group is copied (in order), and all once more at the end (a
    /// fault can map back a whole huge page), so that a matrix is never resident twice.
    pub fn pack(m: &GgmlMatrix, rows: Option<&[usize]>) -> Self {
        let format = m.format();
        let count = rows.map_or(m.rows(), <[usize]>::len);
        let row = |i: usize| m.row_blocks(rows.map_or(i, |r| r[i]));
        let (blocks, block_bytes, group_block) = (m.cols() / format.block_size(), format.block_bytes(), group_block_bytes(format));
        let mut data = vec![0u8; count.div_ceil(GROUP) * blocks * group_block];
        for (g, group) in data.chunks_exact_mut(blocks * group_block).enumerate() {
            for (b, out) in group.chunks_exact_mut(group_block).enumerate() {
                for r in 0..GROUP.min(count - g * GROUP) {
                    pack_block(format, &row(g * GROUP + r)[b * block_bytes..][..block_bytes], r, out);
                }
            }
            if rows.is_none() {
                m.release_rows(g * GROUP..(g + 1) * GROUP);
            }
        }
        m.release_rows(0..m.rows());
        InterleavedMatrix { format, rows: count, cols: m.cols(), data }
    }

    pub fn format(&self) -> GgmlFormat {
        self.format
    }

    /// Groups of eight rows (the last may be padded).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Group `g`'s blocks, one after another.
    pub fn group(&self, g: usize) -> &[u8] {
        let bytes = self.data.len() / self.groups();
        &self.data[g * bytes..][..bytes]
    }
}

/// Row `r` of a group takes its place in one block of the group (`out`): `block` is the row's
/// block in the file's layout.
fn pack_block(format: GgmlFormat, block: &[u8], r: usize, out: &mut [u8]) {
    let (header_bytes, piece_bytes) = layout(format);
    let (header, pieces) = out.split_at_mut(header_bytes);
    let mut put_f16 = |at: usize, value: f32| header[at + 2 * r..at + 2 * r + 2].copy_from_slice(&half::f16::from_f32(value).to_le_bytes());
    match format {
        GgmlFormat::MXFP4 => header[r] = block[0],
        GgmlFormat::NVFP4 => {
            for (i, &scale) in block[..4].iter().enumerate() {
                put_f16(16 * i, ue4m3_half(scale));
            }
        }
        GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => {
            put_f16(0, rocmfp4_scale(block[16]));
            if format == GgmlFormat::ROCMFP4 {
                put_f16(16, rocmfp4_scale(block[17]));
            }
        }
        _ => {
            let d_at = if format == GgmlFormat::Q6_K { 208 } else { 0 };
            header[2 * r..2 * r + 2].copy_from_slice(&block[d_at..d_at + 2]);
            if has_offset(format) {
                header[16 + 2 * r..18 + 2 * r].copy_from_slice(&block[2..4]);
            }
        }
    }
    for (k, piece) in pieces.chunks_exact_mut(piece_bytes).enumerate() {
        match format {
            GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
                let (scale, min) = scale_min_k4(k, &block[4..16]);
                (header[32 + 8 * k + r], header[96 + 8 * k + r]) = (scale, min);
            }
            GgmlFormat::Q6_K => {
                let scales = &block[192 + 8 * (k / 4) + 2 * (k % 4)..];
                (header[16 + 16 * k + r], header[24 + 16 * k + r]) = (scales[0], scales[1]);
            }
            GgmlFormat::IQ4_XS => {
                let low = (block[4 + k / 2] >> (4 * (k % 2))) & 15;
                let high = (u16::from_le_bytes([block[2], block[3]]) >> (2 * k)) as u8 & 3;
                header[16 + 8 * k + r] = ((low | high << 4) as i8 - 32) as u8;
            }
            _ => {}
        }
        let u = file_codes(format, block, k);
        for v in 0..4 {
            for c in 0..4 {
                let (low, high) = (u[4 * v + c], u[16 + 4 * v + c]);
                let at = 32 * v + 4 * r + c;
                if format == GgmlFormat::Q8_0 {
                    (piece[at], piece[at + 128]) = (low, high);
                    continue;
                }
                piece[at] = (low & 15) | (high & 15) << 4;
                if fifth_bits(format) {
                    piece[128 + 4 * r + c] |= (low >> 4) << v | (high >> 4) << (4 + v);
                } else if format == GgmlFormat::Q6_K {
                    piece[128 + 4 * r + c] |= (low >> 4) << (2 * v);
                    piece[160 + 4 * r + c] |= (high >> 4) << (2 * v);
                }
            }
        }
    }
}

/// Piece `k` of a block in the file's layout: its 32 codes as stored (unsigned, plus `bias`; a
/// codebook format's level indices).
fn file_codes(format: GgmlFormat, block: &[u8], k: usize) -> [u8; PIECE] {
    let mut u = [0u8; PIECE];
    match format {
        GgmlFormat::Q8_0 => {
            for (u, &b) in u.iter_mut().zip(&block[2..34]) {
                *u = b ^ 0x80;
            }
        }
        GgmlFormat::Q4_0 | GgmlFormat::Q4_1 | GgmlFormat::IQ4_NL | GgmlFormat::MXFP4 | GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST | GgmlFormat::IQ4_XS => {
            let nibbles = match format {
                GgmlFormat::Q4_0 | GgmlFormat::IQ4_NL => &block[2..18],
                GgmlFormat::Q4_1 => &block[4..20],
                GgmlFormat::MXFP4 => &block[1..17],
                GgmlFormat::IQ4_XS => &block[8 + 16 * k..][..16],
                _ => &block[..16],
            };
            for (j, &c) in nibbles.iter().enumerate() {
                (u[j], u[j + 16]) = (c & 15, c >> 4);
            }
        }
        GgmlFormat::Q5_0 | GgmlFormat::Q5_1 => {
            let (nibbles, qh) = if format == GgmlFormat::Q5_0 { (&block[6..22], &block[2..6]) } else { (&block[8..24], &block[4..8]) };
            let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
            for (j, &c) in nibbles.iter().enumerate() {
                let fifth = |at: usize| (((qh >> at) & 1) as u8) << 4;
                (u[j], u[j + 16]) = ((c & 15) | fifth(j), (c >> 4) | fifth(j + 16));
            }
        }
        GgmlFormat::NVFP4 => {
            // Two runs of 16, each 8 bytes: low nibbles its first 8 values, high nibbles the rest.
            for (run, qs) in block[4 + 16 * k..][..16].chunks_exact(8).enumerate() {
                for (j, &c) in qs.iter().enumerate() {
                    (u[16 * run + j], u[16 * run + 8 + j]) = (c & 15, c >> 4);
                }
            }
        }
        GgmlFormat::Q4_K | GgmlFormat::Q5_K => {
            let (qs, qh) = if format == GgmlFormat::Q4_K { (&block[16..144], None) } else { (&block[48..176], Some(&block[16..48])) };
            for (l, u) in u.iter_mut().enumerate() {
                let byte = qs[32 * (k / 2) + l];
                let nibble = if k.is_multiple_of(2) { byte & 15 } else { byte >> 4 };
                *u = nibble | qh.map_or(0, |qh| ((qh[l] >> k) & 1) << 4);
            }
        }
        GgmlFormat::Q6_K => {
            let (n, part) = (k / 4, k % 4);
            for (l, u) in u.iter_mut().enumerate() {
                let byte = block[64 * n + 32 * (part % 2) + l];
                let nibble = if part < 2 { byte & 15 } else { byte >> 4 };
                *u = nibble | ((block[128 + 32 * n + l] >> (2 * part)) & 3) << 4;
            }
        }
    }
    u
}

impl QuantMatrix for InterleavedMatrix {
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
        self.data.len()
    }
    fn as_interleaved(&self) -> Option<&InterleavedMatrix> {
        Some(self)
    }
    /// The values the file's layout dequantises to, bit for bit (tested).
    fn dequant_row(&self, row: usize, out: &mut [f32]) {
        let format = self.format;
        let (header_bytes, piece_bytes) = layout(format);
        let (r, bias) = (row % GROUP, bias(format));
        let per_block = pieces_per_block(format);
        for (b, block) in self.group(row / GROUP).chunks_exact(group_block_bytes(format)).enumerate() {
            let (header, pieces) = block.split_at(header_bytes);
            for (k, piece) in pieces.chunks_exact(piece_bytes).enumerate() {
                let (first, second, offset) = piece_scales(format, header, r, k);
                for (j, y) in out[(b * per_block + k) * PIECE..][..PIECE].iter_mut().enumerate() {
                    let value = (i32::from(code(format, piece, r, j)) - bias) as f32 * if j < 16 { first } else { second };
                    *y = if has_offset(format) { value + offset } else { value };
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sampling::Rng;

    /// Random blocks of `format` (random bytes, with finite f16 scales where the format has them).
    pub(crate) fn random_blocks(rng: &mut Rng, format: GgmlFormat, blocks: usize) -> Vec<u8> {
        let mut data: Vec<u8> = (0..blocks * format.block_bytes()).map(|_| (rng.next_u64() & 0xff) as u8).collect();
        let halves: &[usize] = match format {
            GgmlFormat::Q4_1 | GgmlFormat::Q5_1 | GgmlFormat::Q4_K | GgmlFormat::Q5_K => &[0, 2],
            GgmlFormat::Q6_K => &[208],
            GgmlFormat::Q8_0 | GgmlFormat::Q4_0 | GgmlFormat::Q5_0 | GgmlFormat::IQ4_NL | GgmlFormat::IQ4_XS => &[0],
            _ => &[],
        };
        for block in data.chunks_exact_mut(format.block_bytes()) {
            for &at in halves {
                let v = half::f16::from_f32((rng.next_f64() as f32 - 0.5) * 0.02);
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
            // Scale bytes in a sane range (E8M0 near 2^-6, E4M3 and half-E4M3 any but NaN).
            match format {
                GgmlFormat::MXFP4 => block[0] = 118 + (rng.next_u64() % 8) as u8,
                GgmlFormat::NVFP4 => block[..4].iter_mut().for_each(|b| *b &= 0x7E),
                GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST => block[16..].iter_mut().for_each(|b| *b &= 0x7E),
                _ => {}
            }
        }
        data
    }

    /// Eleven rows (a group and three padded) dequantise to the file layout's values, bit for bit,
    /// in the stated order and in a chosen one.
    #[test]
    fn packed_rows_dequantise_as_the_file_does() {
        let mut rng = Rng::new(3);
        for format in GgmlFormat::ALL {
            let (rows, cols) = (11, 2 * format.block_size().max(64));
            let m = GgmlMatrix::new(format, rows, cols, random_blocks(&mut rng, format, rows * cols / format.block_size())).unwrap();
            let order: Vec<usize> = (0..rows).rev().collect();
            for picked in [None, Some(&order[..])] {
                let packed = InterleavedMatrix::pack(&m, picked);
                assert_eq!((packed.rows(), packed.cols(), packed.groups()), (rows, cols, 2));
                for r in 0..rows {
                    let (mut want, mut got) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
                    m.dequant_row(picked.map_or(r, |o| o[r]), &mut want);
                    packed.dequant_row(r, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{format:?} row {r}");
                }
            }
        }
    }
}
