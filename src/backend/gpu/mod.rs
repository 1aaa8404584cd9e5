//! The GPU backend: the Backend trait over a vendor runtime (CUDA today, HIP through the same
//! kernels). Activations are f32, weights bf16 or FP8 block-scaled (other formats are converted
//! to bf16 at upload), the KV cache bf16.

pub mod cuda;
mod delta_net;
pub mod hip;
mod kv;
mod moe;
pub mod runtime;

pub use self::moe::GpuExperts;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use half::bf16;
use rayon::prelude::*;

use self::kv::GpuKvPool;
pub use self::kv::GpuKvCache;
use self::runtime::{Arg, KvRows, Runtime, KV_ROWS};
use super::kv_pool::{self, KV_BLOCK};
use super::{AttentionShape, Backend, Capability, KvRestore, Proj, QkNorms, Rope, StepOutput, StepResult};
use crate::quant::fp8::FP8_BLOCK;
use crate::sampling::{Adjustment, LogPartition, MAX_DEVICE_TOP_K};
use crate::quant::{packed, DType, GgmlFormat, QuantMatrix};
use crate::{Error, Result};

/// A device allocation, freed when dropped; or a slice of the recording arena, which is not.
pub struct DeviceBuffer {
    ptr: u64,
    rt: Option<Arc<dyn Runtime>>,
}

impl DeviceBuffer {
    fn new(rt: &Arc<dyn Runtime>, bytes: usize) -> Result<Self> {
        Ok(DeviceBuffer { ptr: rt.alloc(bytes)?, rt: Some(rt.clone()) })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(rt) = &self.rt {
            rt.free(self.ptr);
        }
    }
}

/// f32 activations `[rows, cols]` on the device.
pub struct GpuTensor {
    buf: DeviceBuffer,
    pub rows: usize,
    pub cols: usize,
}

/// A weight matrix `[rows, cols]` on the device: bf16, FP8 block-scaled, or a block format in the
/// device layout of `quant::packed` (the file's bytes rearranged, never widened).
pub struct GpuWeight {
    buf: DeviceBuffer,
    rows: usize,
    cols: usize,
    format: WeightFormat,
}

enum WeightFormat {
    Bf16,
    /// E4M3 codes in `buf`, f32 scales `[ceil(rows/128), ceil(cols/128)]` here.
    Fp8 { scales: DeviceBuffer },
    /// Codes, high bits and meta planes in `buf` (kernels/common/packed.h).
    Packed(GgmlFormat),
}

/// The id of a block format in the kernels (kernels/common/packed.h: GgmlFormat::ALL's order) and
/// the suffix of its one-token kernels.
fn packed_kernel(format: GgmlFormat) -> (i32, &'static str) {
    let id = GgmlFormat::ALL.iter().position(|&f| f == format).unwrap_or(0) as i32;
    let name = match format {
        GgmlFormat::Q8_0 => "q8_0",
        GgmlFormat::Q4_0 => "q4_0",
        GgmlFormat::Q4_1 => "q4_1",
        GgmlFormat::Q4_K => "q4_k",
        GgmlFormat::Q5_K => "q5_k",
        GgmlFormat::Q6_K => "q6_k",
        GgmlFormat::IQ4_NL => "iq4_nl",
        GgmlFormat::IQ4_XS => "iq4_xs",
        GgmlFormat::MXFP4 => "mxfp4",
        GgmlFormat::NVFP4 => "nvfp4",
        GgmlFormat::ROCMFP4 => "rocmfp4",
        GgmlFormat::ROCMFP4_FAST => "rocmfp4_fast",
        GgmlFormat::Q5_0 => "q5_0",
        GgmlFormat::Q5_1 => "q5_1",
    };
    (id, name)
}

impl std::fmt::Debug for GpuWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let format = match self.format {
            WeightFormat::Bf16 => "Bf16".to_string(),
            WeightFormat::Fp8 { .. } => "Fp8".to_string(),
            WeightFormat::Packed(g) => format!("Packed({g})"),
        };
        write!(f, "GpuWeight [{}, {}] {format}", self.rows, self.cols)
    }
}

impl GpuWeight {
    /// Bytes the weight takes on the device.
    pub fn device_bytes(&self) -> usize {
        let (rows, cols) = (self.rows, self.cols);
        match self.format {
            WeightFormat::Bf16 => rows * cols * 2,
            WeightFormat::Fp8 { .. } => rows * cols + rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK) * 4,
            WeightFormat::Packed(f) => packed::plane_offsets(f, rows, cols).map_or(0, |p| p.2),
        }
    }

    fn scales(&self) -> u64 {
        match &self.format {
            WeightFormat::Fp8 { scales } => scales.ptr,
            WeightFormat::Bf16 | WeightFormat::Packed(_) => 0,
        }
    }

    fn is_fp8(&self) -> bool {
        matches!(self.format, WeightFormat::Fp8 { .. })
    }

    fn is_bf16(&self) -> bool {
        matches!(self.format, WeightFormat::Bf16)
    }

    /// The format's kernel suffix: `bf16`, `fp8` or `q4_k` (and so on); weights with the same
    /// suffix share a launch.
    fn suffix(&self) -> &'static str {
        match self.format {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Fp8 { .. } => "fp8",
            WeightFormat::Packed(f) => packed_kernel(f).1,
        }
    }

    /// Kernel name for this format: `{stem}_bf16`, `{stem}_fp8` or `{stem}_q4_k` (and so on).
    fn kernel(&self, stem: &str) -> String {
        format!("{stem}_{}", self.suffix())
    }

    /// The one-token kernels' launch for `rows` output rows and `tokens` rows of input over this
    /// weight format: grid, block and dynamic shared memory. bf16 stages the normalised input as
    /// f32 (kernels/linear.hip's gemv_input), in warps of GEMV_ROWS (GEMV_TOKENS_ROWS for the
    /// several-token kernel) outputs, or, on matrix cores, in blocks of 16 as FP8, reading it in
    /// place; fp8 stages it as f16 in whole 128-column blocks (fp8_rows_dot; several tokens of
    /// one tile without a norm read it in place), packed formats in whole 256-column steps
    /// (pk_rows_dot; several tokens without a norm read it in place; the one-token kernels with
    /// weight slots launch at most a wave of blocks, `packed_wave`, each taking several tiles);
    /// several FP8 tokens on matrix cores take the split kernels (`split`: a block for each
    /// unit's share of K in 16 SPLIT_TILES rows, that share of each token's input staged as f16).
    /// `tiles`: 16-row tiles a block takes at once (gemv1 1; gate/up 2, or 1 for FP8's one-token
    /// kernel and bf16's on matrix cores, which pair 8 gate rows with their up rows): the FP8
    /// one-tile kernels have weight slots where async copies exist, so they are the largest
    /// launch (what the fits checks measure). `several`: the several-token kernel
    /// (`gemv1_kernel`), whatever `tokens` this launch takes.
    fn gemv1_launch(&self, rows: usize, tiles: usize, normed: bool, tokens: usize, several: bool, dev: GemvDevice) -> ([u32; 3], [u32; 3], u32) {
        let several = several || self.lacks_slots(dev);
        match self.format {
            _ if self.split(rows, several, dev) => {
                // A unit's share of each token's input as f16, 16 bytes more.
                let share = self.cols.div_ceil(FP8_BLOCK).div_ceil(SPLIT_UNITS) * FP8_BLOCK;
                let grid = [rows.div_ceil(16 * SPLIT_TILES) as u32, SPLIT_UNITS as u32, 1];
                (grid, [32 * SPLIT_TILES as u32, 1, 1], (tokens * (share * 2 + 16)) as u32)
            }
            WeightFormat::Bf16 => {
                if dev.bf16_mma {
                    // The norm's weights, staged.
                    let shared = if normed { self.cols * 4 } else { 0 };
                    return ([blocks(rows, FP8_GEMV_ROWS), 1, 1], [FP8_GEMV_THREADS, 1, 1], shared as u32);
                }
                let shared = if normed { (tokens * self.cols * 4) as u32 } else { 0 };
                let per_warp = if several { GEMV_TOKENS_ROWS } else { GEMV_ROWS };
                ([blocks(rows, per_warp * GEMV_THREADS / dev.warp_size), 1, 1], [GEMV_THREADS, 1, 1], shared)
            }
            WeightFormat::Fp8 { .. } => {
                // Several tokens of one tile without a norm are read in place (fp8_rows_dot).
                let staged = !(several && tiles == 1 && !normed);
                let input = if staged { tokens * self.cols.div_ceil(FP8_BLOCK) * FP8_BLOCK * 2 } else { 0 };
                // One token's tile streams its weights through slots.
                let slots = if dev.async_copy && tiles == 1 && !several { fp8_slots(self.cols, rows, dev) } else { 0 } * FP8_SLOT_TILE_BYTES;
                ([blocks(rows, FP8_GEMV_ROWS), 1, 1], [FP8_GEMV_THREADS, 1, 1], (input + slots) as u32)
            }
            WeightFormat::Packed(format) => {
                // Several tokens stage their inputs only for a norm (else read in place) and
                // take no weight slots (pk_rows_dot).
                let shared = match (several, normed) {
                    (false, _) => packed_gemv_shared(format, self.cols, dev.async_copy),
                    (true, true) => tokens * self.cols.div_ceil(PACKED_STEP) * PACKED_STEP * 2,
                    (true, false) => 0,
                };
                // The one-token kernels with weight slots take several tiles a block where the
                // tiles are more than one wave of blocks (pk_rows_dot): each block stages the input
                // once and keeps its copies in flight from one tile to the next.
                let tiles = blocks(rows, FP8_GEMV_ROWS);
                let slots = !several && dev.async_copy && packed_slot_bytes(format, self.cols).is_some();
                let grid = if slots { tiles.min(packed_wave(shared, dev)) } else { tiles };
                ([grid, 1, 1], [FP8_GEMV_THREADS, 1, 1], shared as u32)
            }
        }
    }

    /// Whether the one-token kernels take `tokens` rows of input: whole 16-byte chunks per row
    /// (whole runs for packed formats, which every packed matrix has), and a staged input that fits
    /// the shared memory (`max_shared` bytes per block). They take up to GEMV1_TOKENS tokens,
    /// each with the bits it gets alone (kernels/linear.hip), in launches of `gemv1_group` tokens.
    fn gemv1_fits(&self, normed: bool, dev: GemvDevice, tokens: usize) -> bool {
        let chunk = match self.format {
            WeightFormat::Bf16 => 8,
            WeightFormat::Fp8 { .. } => 16,
            WeightFormat::Packed(_) => packed::RUN,
        };
        (1..=GEMV1_TOKENS).contains(&tokens) && self.cols.is_multiple_of(chunk) && self.gemv1_group(normed, dev, tokens) > 0
    }

    /// Tokens one launch of the one-token kernels takes for an input of `tokens` rows: one at a
    /// time for one (the one-token kernel), else as many as the shared memory stages, at most
    /// GEMV1_TOKENS (the `_tokens` kernels; 0 when even one does not fit).
    fn gemv1_group(&self, normed: bool, dev: GemvDevice, tokens: usize) -> usize {
        // The kernels' static shared memory: one token's, several tokens'.
        let fixed = match self.format {
            WeightFormat::Bf16 if !dev.bf16_mma => [GEMV_STATIC_SHARED; 2],
            WeightFormat::Bf16 | WeightFormat::Fp8 { .. } | WeightFormat::Packed(_) => [FP8_GEMV_STATIC_SHARED, FP8_GEMV1_STATIC_SHARED],
        };
        // The same bound for one token as for several: an input takes the same kernels alone as
        // beside others.
        if tokens == 1 && !self.lacks_slots(dev) {
            return usize::from(self.gemv1_launch(1, 1, normed, 1, false, dev).2 + fixed[0] <= dev.max_shared);
        }
        (1..=GEMV1_TOKENS)
            .take_while(|&t| self.gemv1_launch(1, 1, normed, t, true, dev).2 + fixed[1] <= dev.max_shared)
            .last()
            .unwrap_or(0)
    }

    /// Whether several tokens of this FP8 weight take the split kernels (`rows` tile rows): where
    /// the device has them, a row group's ticket for each 16 SPLIT_TILES rows. Each block stages
    /// its unit's share of the inputs once for SPLIT_TILES tiles, where the `_tokens` kernels
    /// stage all of every token's input for each tile (kernels/linear.hip); a token gets the same
    /// bits.
    fn split(&self, rows: usize, several: bool, dev: GemvDevice) -> bool {
        dev.split && self.is_fp8() && several && rows.div_ceil(16 * SPLIT_TILES) <= SPLIT_MAX_GROUPS
    }

    /// Whether this packed weight's one-token kernels need weight slots that its rows cannot have
    /// (packed_slots_unfit): a single token then takes the several-token kernel, which gives it
    /// the same bits.
    fn lacks_slots(&self, dev: GemvDevice) -> bool {
        matches!(self.format, WeightFormat::Packed(f) if packed_slots_unfit(f, self.cols, dev.async_copy))
    }

    /// The kernel for `tokens` rows of input and `rows` weight rows (gate/up's paired tiles count
    /// both) from its stem ("gemv1", "gemv1_gate_up"), and the token count argument that the
    /// several-token kernels take after the others.
    fn gemv1_kernel(&self, stem: &str, tokens: usize, rows: usize, dev: GemvDevice) -> (String, Option<Arg>) {
        let name = match self.format {
            WeightFormat::Bf16 if dev.bf16_mma => format!("{}_mma", self.kernel(stem)),
            WeightFormat::Fp8 { .. } if tokens == 1 && dev.async_copy && fp8_slots(self.cols, rows, dev) == FP8_ASYNC_SLOTS_LONG => {
                format!("{}_long", self.kernel(stem))
            }
            _ => self.kernel(stem),
        };
        match tokens {
            1 if !self.lacks_slots(dev) => (name, None),
            _ if self.split(rows, true, dev) => (format!("{name}_split"), Some(Arg::I32(tokens as i32))),
            // Up to 4 tokens of bf16 on CUDA cores: a form with fewer registers, the same sums.
            _ if tokens <= 4 && matches!(self.format, WeightFormat::Bf16) && !dev.bf16_mma => (format!("{name}_tokens4"), Some(Arg::I32(tokens as i32))),
            _ => (format!("{name}_tokens"), Some(Arg::I32(tokens as i32))),
        }
    }
}

/// What the one-token kernels' launch depends on besides the weight: the shared memory a block
/// may use, the warp width, and whether bf16 takes its matrix-core kernels (on a device that has
/// them, in a model that decodes several sequences: `GpuBackend::several_sequences`).
#[derive(Clone, Copy)]
struct GemvDevice {
    max_shared: u32,
    warp_size: u32,
    /// Several tokens of FP8 take the split kernels: mma.sync (NVIDIA sm_80+).
    split: bool,
    bf16_mma: bool,
    async_copy: bool,
    multiprocessors: u32,
}

/// `bytes` (even) from `src` to `dst` on the device; see `GpuBackend::copy_spans`.
struct CopySpan {
    dst: u64,
    src: u64,
    bytes: usize,
}

pub struct GpuBackend {
    rt: Arc<dyn Runtime>,
    /// Tickets of the kernels whose last block finishes the work (attention_decode's splits, one
    /// per kv head, argmax, top_k), each left at zero by its launch, and their partial results
    /// (see `Scratch`).
    tickets: Mutex<Option<DeviceBuffer>>,
    /// The rotary frequency table on the device, uploaded once (every layer uses the same one).
    rope_table: Mutex<Option<(Vec<f32>, GpuTensor)>>,
    decode: Mutex<DecodeGraph>,
    /// The model decodes several sequences side by side (`Backend::plan_sequences`): bf16 one-token
    /// products take their matrix-core kernels where the device has them.
    several_sequences: AtomicBool,
    /// The token mask (see `Backend::set_token_mask`) as argmax and top_k read it: the word count
    /// (0: no mask), then the words; made at the first mask and kept (recorded steps point at it).
    token_mask: Mutex<Option<(DeviceBuffer, usize)>>,
    /// A request's adjustments (see `Backend::set_logit_adjustments`) as the logit_adjust kernel reads them:
    /// the count, the ids, then the biases, repetitions and subtrahends; with its capacity in entries, kept like the mask.
    logit_adjust: Mutex<Option<(DeviceBuffer, usize)>>,
    /// Where new KV caches take their blocks (`Backend::set_kv_pool`).
    kv_pool: Mutex<Option<Arc<GpuKvPool>>>,
}

/// The recorded decode steps. While recording, ops read the tokens and positions from `inputs`
/// instead of taking them as launch arguments, and attention covers the whole cache, so one
/// recording serves every later step.
struct DecodeGraph {
    recording: bool,
    /// Device [tokens[rows], positions[rows], argmax limit] of the step recorded or replayed
    /// (room for RECORDED_ROWS rows).
    inputs: Option<DeviceBuffer>,
    /// Rows of the step being recorded, and the sequence whose ops are being recorded
    /// (`Backend::sequence_row`): its position is at `inputs` + 4 * (rows + row).
    rows: usize,
    row: usize,
    /// One recording per key (a sequence slot of the model: each points at its own caches).
    graphs: Vec<Option<Recorded>>,
    /// The key whose step ran last: `recorded_output` reads its outputs.
    last: usize,
    /// Batched steps' recordings, by their slots in row order (at most RECORDED_BATCHES).
    batches: HashMap<Vec<usize>, RecordedBatch>,
    /// Temporaries of the recorded step come from this arena, so the graph holds kernels only,
    /// no allocation nodes. Too small an arena still records (with allocation nodes) and is
    /// resized for the next recording.
    arena: Option<DeviceBuffer>,
    arena_size: usize,
    arena_used: usize,
}

/// A recorded batched step: its forward pass, which leaves the logits [rows, vocab] in `logits`.
struct RecordedBatch {
    /// None once the arena it used was replaced (it is recorded again at its next step).
    exec: Option<u64>,
    logits: GpuTensor,
}

impl DecodeGraph {
    /// After a recording that outgrew the arena: a larger one for the next, and every
    /// recording's graph to destroy (they point into the old one; each is recorded again at its
    /// next step, with room for every temporary).
    fn outgrown(&mut self) -> Vec<u64> {
        if self.arena_used <= self.arena_size {
            return Vec::new();
        }
        self.arena_size = self.arena_used.saturating_add(self.arena_used / 4);
        self.arena = None;
        self.take_execs()
    }

    /// Takes every recording's graph (they point into the arena, or at caches about to change).
    fn take_execs(&mut self) -> Vec<u64> {
        let singles = self.graphs.iter_mut().flatten().filter_map(|g| g.exec.take());
        let batches = self.batches.values_mut().filter_map(|g| g.exec.take());
        singles.chain(batches).collect()
    }
}

/// One recorded step and where it leaves its outputs.
struct Recorded {
    /// None once the arena it used was replaced (it is recorded again at its next step).
    exec: Option<u64>,
    logits: GpuTensor,
    /// The step's argmax.
    token: DeviceBuffer,
}

const INITIAL_ARENA: usize = 64 << 20;
/// Rows a recorded step's inputs have room for (the most sequence slots a model keeps).
const RECORDED_ROWS: usize = 64;
/// Batched steps kept recorded (each set of slots decoding together has its own); past this
/// many, all are dropped and recorded again as they come.
const RECORDED_BATCHES: usize = 32;

const BLOCK: u32 = 256;
const GEMV_MAX_T: usize = 8;
/// Projections of one input that the one-token GEMV (gemv1_*) takes in a launch.
const GEMV1_SEGMENTS: usize = 4;
/// Launch shapes fixed by the kernels (their #defines).
const GEMV_THREADS: u32 = 256;
const GEMV_ROWS: u32 = 2;
/// Outputs per warp of the several-token bf16 kernels (GEMV_TOKENS_ROWS).
const GEMV_TOKENS_ROWS: u32 = 4;
const GEMM_BM: usize = 128;
const GEMM_BN: usize = 128;
const GEMM_THREADS: u32 = 256;
/// The wgmma GEMMs' K step and dynamic shared memory (kernels/gemm.hip: GWG_BK, GEMM_WG_SHARED_*:
/// three stages of bf16 x and W tiles; of x tiles and FP8 codes, with two decoded W tiles; two
/// stages of x and W tiles; each with 1 KB to align them).
const GEMM_WG_BK: usize = 64;
const GWG_TILE: u32 = 128 * 64 * 2;
const GEMM_WG_SHARED_BF16: u32 = 3 * 2 * GWG_TILE + 1024;
const GEMM_WG_SHARED_FP8: u32 = 5 * GWG_TILE + 3 * (128 * 64 + 16) + 1024;
const GEMM_WG_SHARED_PACKED: u32 = 4 * GWG_TILE + 1024;
/// gemm_wg_bf16_wide and gemm_wg_bf16_gate_up: W tiles of GEMM_WG_WIDE_BN rows, four stages of an
/// x tile and two W tiles.
const GEMM_WG_WIDE_BN: usize = 256;
const GEMM_WG_SHARED_WIDE: u32 = 4 * 3 * GWG_TILE + 1024;
/// From this many tokens a packed or FP8 weight is decoded to bf16 for the streamed wgmma GEMM
/// (the decode costs about as much as 50 tokens of products); below, gemm_wg_packed and
/// gemm_wg_fp8 decode it per tile.
const WIDEN_MIN_T: usize = 256;
const FA_BQ: usize = 64;
const FA_THREADS: u32 = 128;
const DEC_THREADS: u32 = 256;
const DEC_MAX_TILE: usize = 64;
const DEC_TILE_ELEMS: usize = 8192;
/// Largest input the bf16 expert kernels (moe_gate_up_bf16) normalise into shared memory (48 KB with
/// their scratch).
const GEMV_MAX_STAGED: usize = 12_224;
/// The bf16 one-token kernels' static shared memory (block_sum's scratch), rounded up.
const GEMV_STATIC_SHARED: u32 = 256;
/// The fp8 one-token kernels: output rows per block, threads, static shared memory (rounded up).
const FP8_GEMV_ROWS: u32 = 16;
const FP8_GEMV_THREADS: u32 = 256;
const FP8_GEMV_STATIC_SHARED: u32 = 2_300;
/// The several-token kernels (gemv1_fp8_tokens, gemv1_gate_up_fp8_tokens and the packed formats'
/// `_tokens` kernels), whose partial sums have room for GEMV1_TOKENS tokens.
const FP8_GEMV1_STATIC_SHARED: u32 = 8_500;
/// Tokens the FP8 one-token kernels take at once (GEMV1_TOKENS in kernels/linear.hip).
const GEMV1_TOKENS: usize = 8;
/// The split kernels (gemv1_fp8_split and gemv1_gate_up_fp8_split in
/// kernels/linear.hip): the units sharing K (a block each), the 16-row tiles of a row group (a warp
/// each), and the most row groups a launch may have (one ticket each in `Scratch`).
const SPLIT_UNITS: usize = 8;
const SPLIT_TILES: usize = 8;
const SPLIT_MAX_GROUPS: usize = 16_384;
// Block u of a row group computes token u's norm scale (u < tokens <= GEMV1_TOKENS) with as many
// threads as the one-token kernel, so that each token's scale has the bits it has alone.
const _: () = assert!(32 * SPLIT_TILES as u32 == FP8_GEMV_THREADS && SPLIT_UNITS >= GEMV1_TOKENS);
/// The FP8 one-token, one-tile kernel's weight slots in shared memory (kernels/linear.hip's
/// Fp8Async): FP8_ASYNC_SLOTS of them, each 16 rows of FP8_SLOT_ROW bytes and FP8_SLOT_SCALES
/// floats.
const FP8_ASYNC_SLOTS: usize = 3;
const FP8_ASYNC_SLOTS_LONG: usize = 2;
const FP8_SLOT_TILE_BYTES: usize = 16 * (1088 + 9 * 4);
/// The slots of the FP8 one-token, one-tile kernel over rows of `cols` values, for `rows` outputs:
/// three (gemv1_fp8), or two (gemv1_fp8_long) where its smaller blocks, more of them an SM, fill
/// the last wave of the grid at least a tenth better. A grid of a little more than one wave waits
/// on its last blocks (kernels/linear.hip). An SM's shared memory is taken as a block's limit
/// + 1 KB, as on NVIDIA's sm_80 and later (the only devices with the slots).
fn fp8_slots(cols: usize, rows: usize, dev: GemvDevice) -> usize {
    let grid = rows.div_ceil(FP8_GEMV_ROWS as usize);
    let per_sm = dev.max_shared as usize + 1024;
    let filled = |slots: usize| {
        let block = cols.div_ceil(FP8_BLOCK) * FP8_BLOCK * 2 + slots * FP8_SLOT_TILE_BYTES + FP8_GEMV_STATIC_SHARED as usize;
        wave_fill(grid, dev.multiprocessors as usize * (per_sm / block))
    };
    if dev.multiprocessors > 0 && filled(FP8_ASYNC_SLOTS_LONG) > filled(FP8_ASYNC_SLOTS) + 0.1 {
        FP8_ASYNC_SLOTS_LONG
    } else {
        FP8_ASYNC_SLOTS
    }
}
/// How full a grid of `grid` blocks keeps its waves of `wave` blocks (its last one included):
/// 1 when it fills them all, 0 when no block fits an SM.
fn wave_fill(grid: usize, wave: usize) -> f64 {
    if wave == 0 {
        return 0.0;
    }
    grid as f64 / (grid.div_ceil(wave) * wave) as f64
}
/// The packed one-token kernels' slots in shared memory (kernels/linear.hip's PkAsync), for rows
/// of `cols` values where they stream through them (formats without high bits, a row's meta bytes
/// a multiple of 4): PK_ASYNC_SLOTS slots of 16 rows, each row's codes (1088
/// bytes) and 64 runs' meta groups (rounded up to 16 bytes, + 16).
fn packed_slot_bytes(format: GgmlFormat, cols: usize) -> Option<usize> {
    let (group_runs, group_bytes) = packed::meta_group(format);
    if packed::high_bits(format) > 0 || !(cols / packed::RUN / group_runs * group_bytes).is_multiple_of(4) {
        return None;
    }
    let meta = 64 / group_runs * group_bytes;
    Some(PK_ASYNC_SLOTS * 16 * (1088 + meta.div_ceil(16) * 16 + 16))
}
const PK_ASYNC_SLOTS: usize = 3;
/// Whether the packed one-token kernels over rows of `cols` values would stream their weights
/// through slots (kernels/linear.hip's PK_SLOTS: a format without high bits, where async copies
/// exist) that such rows cannot have: those kernels are built for slots alone.
fn packed_slots_unfit(format: GgmlFormat, cols: usize, async_copy: bool) -> bool {
    async_copy && packed::high_bits(format) == 0 && packed_slot_bytes(format, cols).is_none()
}
/// Dynamic shared memory of the packed one-token kernels over rows of `cols` values: the input
/// staged as f16 in whole steps, and the weight slots where async copies stream the weights.
fn packed_gemv_shared(format: GgmlFormat, cols: usize, async_copy: bool) -> usize {
    let input = cols.div_ceil(PACKED_STEP) * PACKED_STEP * 2;
    input + if async_copy { packed_slot_bytes(format, cols).unwrap_or(0) } else { 0 }
}
/// Columns per step of the packed one-token kernels (PK_STEP).
const PACKED_STEP: usize = 256;
/// Blocks of the packed one-token kernels with weight slots that the device holds at once, each
/// with `shared` bytes of dynamic shared memory: three an SM (their launch bounds, PK_BLOCKS) where
/// the shared memory allows (an SM's being a block's limit + 1 KB, 1 KB of it kept per block, as
/// on NVIDIA's sm_80 and later, the only devices with the slots); unbounded where the device does
/// not say its SMs.
fn packed_wave(shared: usize, dev: GemvDevice) -> u32 {
    const PK_SLOT_BLOCKS: usize = 3;
    if dev.multiprocessors == 0 {
        return u32::MAX;
    }
    let per_sm = (dev.max_shared as usize + 1024) / (shared + FP8_GEMV_STATIC_SHARED as usize + 1024);
    dev.multiprocessors * per_sm.clamp(1, PK_SLOT_BLOCKS) as u32
}
/// Decode attention: splits of at least this many cached positions, at most ATTENTION_MAX_SPLITS.
const ATTENTION_CHUNK: usize = 256;
const ATTENTION_MAX_SPLITS: usize = 128;
const MAX_KV_HEADS: usize = 1024;
/// The attention kernels' largest head (their tiles pad smaller ones); rotary pairs need it even.
const MAX_HEAD_DIM: usize = 256;
const ARGMAX_BLOCKS: u32 = 128;
/// Rows of logits one argmax launch takes (each with its own ticket and partial results).
const ARGMAX_ROWS: usize = 8;
const TOPK_BLOCKS: u32 = 128;
const LOGZ_BLOCKS: u32 = 128;
const DRAW_BLOCKS: u32 = 128;
/// TOPK_MAX of kernels/sampling.hip.
const TOPK_PARTIAL: usize = TOPK_BLOCKS as usize * MAX_DEVICE_TOP_K;

/// Byte offsets in the tickets buffer: each kernel whose last block finishes the work has a
/// ticket (left at zero by every launch) and room for its blocks' partial results.
struct Scratch;

impl Scratch {
    const ARGMAX_TICKET: u64 = MAX_KV_HEADS as u64 * 4;
    const ARGMAX_V: u64 = Self::ARGMAX_TICKET + ARGMAX_ROWS as u64 * 4;
    const ARGMAX_I: u64 = Self::ARGMAX_V + (ARGMAX_ROWS * ARGMAX_BLOCKS as usize) as u64 * 4;
    const TOPK_TICKET: u64 = Self::ARGMAX_I + (ARGMAX_ROWS * ARGMAX_BLOCKS as usize) as u64 * 4;
    const TOPK_V: u64 = Self::TOPK_TICKET + 4;
    const TOPK_I: u64 = Self::TOPK_V + TOPK_PARTIAL as u64 * 4;
    const TOPK_OUT_V: u64 = Self::TOPK_I + TOPK_PARTIAL as u64 * 4;
    const TOPK_OUT_I: u64 = Self::TOPK_OUT_V + MAX_DEVICE_TOP_K as u64 * 4;
    const LOGZ_TICKET: u64 = Self::TOPK_OUT_I + MAX_DEVICE_TOP_K as u64 * 4;
    const LOGZ_PART: u64 = Self::LOGZ_TICKET + 4;
    const LOGZ_OUT: u64 = Self::LOGZ_PART + 3 * LOGZ_BLOCKS as u64 * 4;
    const DRAW_TICKET: u64 = Self::LOGZ_OUT + 2 * 4;
    const DRAW_PART: u64 = Self::DRAW_TICKET + 4;
    const DRAW_OUT: u64 = Self::DRAW_PART + 2 * DRAW_BLOCKS as u64 * 4;
    const SPLIT_TICKETS: u64 = Self::DRAW_OUT + 4;
    const BYTES: usize = (Self::SPLIT_TICKETS + SPLIT_MAX_GROUPS as u64 * 4) as usize;
}

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize) as u32
}

/// The product of a buffer's dimensions and element size, checked: a product that wrapped would
/// size a buffer smaller than what is then written into it.
fn byte_size(what: &str, factors: &[usize]) -> Result<usize> {
    factors.iter().try_fold(1usize, |n, &f| n.checked_mul(f)).ok_or_else(|| {
        let factors: Vec<String> = factors.iter().map(usize::to_string).collect();
        Error::InvalidArgument(format!("{what} of {} bytes does not fit in memory", factors.join(" x ")))
    })
}

/// Bytes of one bf16 KV buffer of `capacity` positions of `width` values.
fn kv_bytes(capacity: usize, width: usize) -> Result<usize> {
    let bytes = capacity.checked_mul(width).and_then(|n| n.checked_mul(2)).ok_or_else(|| {
        Error::InvalidArgument(format!("KV cache of {capacity} positions x {width} values does not fit in memory"))
    })?;
    if capacity > i32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "KV cache of {capacity} positions: the kernels take positions as 32-bit integers"
        )));
    }
    Ok(bytes)
}

impl GpuBackend {
    pub fn new(rt: Arc<dyn Runtime>) -> Self {
        let decode = DecodeGraph {
            recording: false,
            inputs: None,
            rows: 1,
            row: 0,
            graphs: Vec::new(),
            last: 0,
            batches: HashMap::new(),
            arena: None,
            arena_size: INITIAL_ARENA,
            arena_used: 0,
        };
        GpuBackend { rt, tickets: Mutex::new(None), rope_table: Mutex::new(None), decode: Mutex::new(decode), several_sequences: AtomicBool::new(false), token_mask: Mutex::new(None), logit_adjust: Mutex::new(None), kv_pool: Mutex::new(None) }
    }

    fn gemv_device(&self) -> GemvDevice {
        GemvDevice {
            max_shared: self.rt.max_shared_bytes(),
            warp_size: self.rt.warp_size(),
            split: self.rt.bf16_gemv_on_matrix_cores(),
            bf16_mma: self.rt.bf16_gemv_on_matrix_cores() && self.several_sequences.load(Ordering::Relaxed),
            async_copy: self.rt.has_async_copy(),
            multiprocessors: self.rt.multiprocessors(),
        }
    }

    fn decode_state(&self) -> std::sync::MutexGuard<'_, DecodeGraph> {
        self.decode.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Device pointer of the recorded step's [token, pos] pair, or None outside a recording.
    fn recorded_inputs(&self) -> Option<u64> {
        let d = self.decode_state();
        d.recording.then(|| d.inputs.as_ref().map(|b| b.ptr)).flatten()
    }

    /// Device pointer of the position of the sequence being recorded (see `DecodeGraph::rows`),
    /// or None outside a recording.
    fn recorded_pos(&self) -> Option<u64> {
        let d = self.decode_state();
        let inputs = d.inputs.as_ref().filter(|_| d.recording)?.ptr;
        Some(inputs + 4 * (d.rows + d.row) as u64)
    }

    /// The inputs buffer, made at its first use.
    fn inputs_buffer(&self) -> Result<u64> {
        let mut d = self.decode_state();
        if d.inputs.is_none() {
            d.inputs = Some(DeviceBuffer::new(&self.rt, 4 * (2 * RECORDED_ROWS + 1))?);
        }
        Ok(d.inputs.as_ref().map_or(0, |b| b.ptr))
    }

    /// A batched step's tokens and positions into the inputs buffer.
    fn set_batch_inputs(&self, tokens: &[u32], pos: &[usize]) -> Result<u64> {
        if tokens.len() != pos.len() || tokens.len() > RECORDED_ROWS {
            return Err(Error::InvalidArgument(format!("a recorded step of {} tokens and {} positions", tokens.len(), pos.len())));
        }
        let ptr = self.inputs_buffer()?;
        let words = tokens.iter().map(|&t| t as i32).chain(pos.iter().map(|&p| p.min(i32::MAX as usize) as i32)).chain([0]);
        let bytes: Vec<u8> = words.flat_map(i32::to_le_bytes).collect();
        self.rt.upload(ptr, &bytes)?;
        Ok(ptr)
    }

    fn set_inputs(&self, token: u32, pos: usize, want: StepOutput) -> Result<u64> {
        let ptr = self.inputs_buffer()?;
        let limit = match want {
            StepOutput::Argmax { limit } => limit.min(i32::MAX as usize) as i32,
            // The recording's argmax then reads nothing: the choice is made after the replay.
            StepOutput::Logits | StepOutput::AllLogits | StepOutput::ArgmaxEach { .. } | StepOutput::TopK { .. } | StepOutput::Draw { .. } => 0,
        };
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&(token as i32).to_le_bytes());
        bytes[4..8].copy_from_slice(&(pos as i32).to_le_bytes());
        bytes[8..].copy_from_slice(&limit.to_le_bytes());
        self.rt.upload(ptr, &bytes)?;
        Ok(ptr)
    }

    /// Memory for a temporary: from the arena while recording, else from the stream's pool.
    fn scratch(&self, bytes: usize) -> Result<DeviceBuffer> {
        let mut d = self.decode_state();
        if d.recording {
            // Saturated, an absurd request cannot wrap around into a slice the arena holds.
            let start = d.arena_used.checked_next_multiple_of(256).unwrap_or(usize::MAX);
            d.arena_used = start.saturating_add(bytes);
            if let Some(arena) = d.arena.as_ref().filter(|_| d.arena_used <= d.arena_size) {
                return Ok(DeviceBuffer { ptr: arena.ptr + start as u64, rt: None });
            }
        }
        drop(d);
        DeviceBuffer::new(&self.rt, bytes)
    }

    /// The rotary frequency table on the device, uploaded on first use.
    fn rope_freqs(&self, rope: &Rope) -> Result<u64> {
        let mut table = self.rope_table.lock().unwrap_or_else(|p| p.into_inner());
        if table.as_ref().is_none_or(|(host, _)| *host != rope.inv_freq) {
            *table = Some((rope.inv_freq.clone(), self.upload_f32(1, rope.inv_freq.len(), &rope.inv_freq)?));
        }
        Ok(table.as_ref().map_or(0, |(_, t)| t.buf.ptr))
    }

    /// One-token products of each row of `x` with up to four weights of one format (q, gate, k,
    /// v), each `(weight, bias, output)`; `norm` RMS-normalises the input first; `residual` (may be
    /// the first output) is added to the first product. Launches of `gemv1_group` tokens.
    fn gemv1(
        &self,
        x: &GpuTensor,
        projs: &[(&GpuWeight, Option<&GpuTensor>, u64)],
        norm: Option<(&GpuTensor, f32)>,
        residual: Option<u64>,
    ) -> Result<()> {
        let w = projs[0].0;
        let group = w.gemv1_group(norm.is_some(), self.gemv_device(), x.rows).max(1);
        let rows: usize = projs.iter().map(|p| p.0.rows).sum();
        let seg = |i: usize| projs.get(i);
        let (norm_w, eps) = norm.map_or((0, 0.0), |(w, eps)| (w.buf.ptr, eps));
        for first in (0..x.rows).step_by(group) {
            let tokens = group.min(x.rows - first);
            // Byte offsets of row `first` of a [T, cols] f32 tensor.
            let at = |cols: usize| (first * cols * 4) as u64;
            let mut args = Vec::with_capacity(26);
            args.extend((0..GEMV1_SEGMENTS).map(|i| Arg::Ptr(seg(i).map_or(0, |p| p.0.buf.ptr))));
            args.extend((0..GEMV1_SEGMENTS).map(|i| Arg::Ptr(seg(i).map_or(0, |p| p.0.scales()))));
            args.extend((0..GEMV1_SEGMENTS).map(|i| Arg::Ptr(seg(i).and_then(|p| p.1).map_or(0, |b| b.buf.ptr))));
            args.extend((0..GEMV1_SEGMENTS).map(|i| Arg::Ptr(seg(i).map_or(0, |p| p.2 + at(p.0.rows)))));
            args.extend((0..GEMV1_SEGMENTS).map(|i| Arg::I32(seg(i).map_or(0, |p| p.0.rows as i32))));
            let residual = residual.map_or(0, |r| r + at(w.rows));
            args.extend([Arg::Ptr(x.buf.ptr + at(x.cols)), Arg::Ptr(norm_w), Arg::F32(eps), Arg::Ptr(residual), Arg::I32(x.cols as i32)]);
            // An input of several rows takes the several-token kernel even for a last group of one,
            // which gives it the same bits.
            let (kernel, tokens_arg) = w.gemv1_kernel("gemv1", x.rows, rows, self.gemv_device());
            args.extend(tokens_arg.map(|_| Arg::I32(tokens as i32)));
            let split = self.split_args(w, rows, tokens, x.rows > 1)?;
            args.extend(split.iter().flat_map(|s| s.1.iter().copied()));
            let (grid, block, shared) = w.gemv1_launch(rows, 1, norm.is_some(), tokens, x.rows > 1, self.gemv_device());
            self.rt.launch_early(&kernel, grid, block, shared, &args)?;
        }
        Ok(())
    }

    /// The split kernels' last arguments where `w` takes them for `tokens` rows over `rows` tile
    /// rows (`GpuWeight::split`): a temporary for each unit's sums ([units][tokens][rows of the
    /// grid]) followed by room for the norm's scale of each token in each row group (which the
    /// kernel fills where it has a norm), and the row groups' tickets. The buffer must outlive the
    /// launch.
    fn split_args(&self, w: &GpuWeight, rows: usize, tokens: usize, several: bool) -> Result<Option<(DeviceBuffer, Vec<Arg>)>> {
        if !w.split(rows, several, self.gemv_device()) {
            return Ok(None);
        }
        let groups = rows.div_ceil(16 * SPLIT_TILES);
        let sums = byte_size("split partial sums", &[SPLIT_UNITS, tokens, groups * 16 * SPLIT_TILES, 4])?;
        let part = self.scratch(sums + groups * GEMV1_TOKENS * 4)?;
        let args = vec![Arg::Ptr(part.ptr), Arg::Ptr(self.tickets()? + Scratch::SPLIT_TICKETS), Arg::Ptr(part.ptr + sums as u64)];
        Ok(Some((part, args)))
    }

    /// `y = x · wᵀ (+ bias) (+ residual)` for any number of rows; `residual` may be `y` itself.
    fn matmul(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuTensor>, residual: Option<u64>, y: u64) -> Result<()> {
        let (n, k, t) = (w.rows, w.cols, x.rows);
        if x.cols != k {
            return Err(Error::InvalidArgument(format!("linear: input width {} but weight has {k} columns", x.cols)));
        }
        if t == 0 {
            return Ok(());
        }
        if w.gemv1_fits(false, self.gemv_device(), t) {
            return self.gemv1(x, &[(w, bias, y)], None, residual);
        }
        let common = [Arg::Ptr(x.buf.ptr), Arg::Ptr(bias.map_or(0, |b| b.buf.ptr)), Arg::Ptr(residual.unwrap_or(0)), Arg::Ptr(y)];
        let sizes = [Arg::I32(n as i32), Arg::I32(k as i32), Arg::I32(t as i32)];
        let grid = [blocks(n, GEMM_BN as u32), blocks(t, GEMM_BM as u32), 1];
        // Hopper's wgmma kernels take whole tiles of N and K (any T); the others take any shape.
        let wgmma = self.rt.has_wgmma() && n % GEMM_BN == 0 && k % GEMM_WG_BK == 0;
        // A long prefill of a packed or FP8 weight decodes it to bf16 once (exactly as their GEMMs
        // do per tile) and takes the streamed bf16 GEMM: the same products, in the same order.
        let widen = wgmma && t >= WIDEN_MIN_T && !w.is_bf16();
        if let WeightFormat::Packed(format) = w.format {
            if !widen {
                let (kernel, shared) = if wgmma { ("gemm_wg_packed", GEMM_WG_SHARED_PACKED) } else { ("gemm_packed", 0) };
                let args = [Arg::Ptr(w.buf.ptr), Arg::I32(packed_kernel(format).0)].into_iter().chain(common).chain(sizes);
                return self.rt.launch(kernel, grid, [GEMM_THREADS, 1, 1], shared, &args.collect::<Vec<_>>());
            }
        }
        let widened = if widen { Some(self.widen_to_bf16(w)?) } else { None };
        if t <= GEMV_MAX_T && w.is_bf16() && k % 8 == 0 {
            let args: Vec<Arg> = [Arg::Ptr(w.buf.ptr)].into_iter().chain(common).chain(sizes).collect();
            let grid = [blocks(n, BLOCK / self.rt.warp_size()), 1, 1];
            return self.rt.launch("gemv_bf16", grid, [BLOCK, 1, 1], 0, &args);
        }
        let mut args = vec![Arg::Ptr(widened.as_ref().map_or(w.buf.ptr, |bf| bf.buf.ptr))];
        let fp8 = w.is_fp8() && widened.is_none();
        if fp8 {
            args.push(Arg::Ptr(w.scales()));
        }
        if wgmma {
            let xb = self.wgmma_input(x)?;
            args.push(Arg::Ptr(xb.buf.ptr));
            args.extend(common.into_iter().skip(1).chain(sizes));
            // Wide tiles where they fill the device (the same bits as the square ones).
            if !fp8 && self.wide_gemm_fits(n, t) {
                let grid = [(n / GEMM_WG_WIDE_BN) as u32, blocks(t, GEMM_BM as u32), 1];
                return self.rt.launch("gemm_wg_bf16_wide", grid, [GEMM_THREADS, 1, 1], GEMM_WG_SHARED_WIDE, &args);
            }
            let (kernel, shared) = if fp8 { ("gemm_wg_fp8", GEMM_WG_SHARED_FP8) } else { ("gemm_wg_bf16", GEMM_WG_SHARED_BF16) };
            return self.rt.launch(kernel, grid, [GEMM_THREADS, 1, 1], shared, &args);
        }
        args.extend(common.into_iter().chain(sizes));
        self.rt.launch(&w.kernel("gemm"), grid, [GEMM_THREADS, 1, 1], 0, &args)
    }

    /// x [T, K] rounded to bf16, as the wgmma GEMMs take it: once here rather than once per tile
    /// of W (K % 8 == 0).
    fn wgmma_input(&self, x: &GpuTensor) -> Result<GpuTensor> {
        let xb = self.tensor(x.rows, x.cols / 2)?;
        let values = x.rows * x.cols;
        let round = [Arg::Ptr(x.buf.ptr), Arg::Ptr(xb.buf.ptr), Arg::I64(values as i64)];
        self.rt.launch("to_bf16", [blocks(values / 8, BLOCK), 1, 1], [BLOCK, 1, 1], 0, &round)?;
        Ok(xb)
    }

    /// silu(x gateᵀ) * (x upᵀ) (with their biases) in one wgmma GEMM whose wide tiles pair 128
    /// gate rows with the same 128 up rows (gemm_wg_bf16_gate_up; packed and FP8 weights widened
    /// to bf16 first, as `matmul` widens them): the bits of two GEMMs and silu_mul, without
    /// writing and reading back both products. None where it does not take the shapes, formats
    /// or token count.
    fn gate_up_gemm(&self, x: &GpuTensor, gate: &Proj<'_, Self>, up: &Proj<'_, Self>) -> Result<Option<GpuTensor>> {
        let (g, u) = (gate.weight, up.weight);
        let (n, k, t) = (g.rows, g.cols, x.rows);
        let shapes = (u.rows, u.cols) == (n, k) && x.cols == k && n.is_multiple_of(GEMM_BN) && k.is_multiple_of(GEMM_WG_BK);
        let (widen, tiles) = (!g.is_bf16(), n / GEMM_BN * t.div_ceil(GEMM_BM));
        if !self.rt.has_wgmma() || g.suffix() != u.suffix() || !shapes || !self.wide_tiles_fill(tiles) || (widen && t < WIDEN_MIN_T) {
            return Ok(None);
        }
        let widened = if widen { Some((self.widen_to_bf16(g)?, self.widen_to_bf16(u)?)) } else { None };
        let (gate_ptr, up_ptr) = widened.as_ref().map_or((g.buf.ptr, u.buf.ptr), |(gw, uw)| (gw.buf.ptr, uw.buf.ptr));
        let xb = self.wgmma_input(x)?;
        let y = self.tensor(t, n)?;
        let args = [
            Arg::Ptr(gate_ptr),
            Arg::Ptr(up_ptr),
            Arg::Ptr(xb.buf.ptr),
            Arg::Ptr(gate.bias.map_or(0, |b| b.buf.ptr)),
            Arg::Ptr(up.bias.map_or(0, |b| b.buf.ptr)),
            Arg::Ptr(y.buf.ptr),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I32(t as i32),
        ];
        let grid = [(n / GEMM_BN) as u32, blocks(t, GEMM_BM as u32), 1];
        self.rt.launch("gemm_wg_bf16_gate_up", grid, [GEMM_THREADS, 1, 1], GEMM_WG_SHARED_WIDE, &args)?;
        Ok(Some(y))
    }

    /// Whether the bf16 wgmma GEMM of `n` rows over `t` tokens takes the wide tiles
    /// (gemm_wg_bf16_wide, the same bits as gemm_wg_bf16): whole tiles of 256 rows that fill the
    /// device.
    fn wide_gemm_fits(&self, n: usize, t: usize) -> bool {
        n.is_multiple_of(GEMM_WG_WIDE_BN) && self.wide_tiles_fill(n / GEMM_WG_WIDE_BN * t.div_ceil(GEMM_BM))
    }

    /// Whether a grid of `tiles` blocks of the wide-tile kernels (one block an SM fits) gives every
    /// SM a block, and the device has the shared memory for their stages.
    fn wide_tiles_fill(&self, tiles: usize) -> bool {
        tiles >= self.rt.multiprocessors() as usize && self.rt.max_shared_bytes() >= GEMM_WG_SHARED_WIDE
    }

    /// A packed or FP8 weight decoded to bf16 [rows, cols] (a temporary; cols % 32 == 0).
    fn widen_to_bf16(&self, w: &GpuWeight) -> Result<GpuTensor> {
        let (n, k) = (w.rows, w.cols);
        let bf = self.tensor(n, k / 2)?;
        let (rows, cols, out) = (Arg::I32(n as i32), Arg::I32(k as i32), Arg::Ptr(bf.buf.ptr));
        let (kernel, args) = match w.format {
            WeightFormat::Packed(format) => ("dequant_packed_bf16", vec![Arg::Ptr(w.buf.ptr), Arg::I32(packed_kernel(format).0), rows, cols, out]),
            WeightFormat::Fp8 { ref scales } => {
                let kblocks = Arg::I32(k.div_ceil(128) as i32);
                ("dequant_fp8_bf16", vec![Arg::Ptr(w.buf.ptr), Arg::Ptr(scales.ptr), rows, cols, kblocks, out])
            }
            WeightFormat::Bf16 => return Err(Error::InvalidArgument("widen_to_bf16 of a bf16 weight".into())),
        };
        self.rt.launch(kernel, [blocks(n * k / 16, BLOCK), 1, 1], [BLOCK, 1, 1], 0, &args)?;
        Ok(bf)
    }

    /// The tickets buffer (see `tickets`), made with the first KV cache, never while a step is
    /// recorded. Offsets in `Scratch`.
    fn tickets(&self) -> Result<u64> {
        let mut c = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_none() {
            let buf = DeviceBuffer::new(&self.rt, Scratch::BYTES)?;
            self.rt.upload(buf.ptr, &vec![0u8; Scratch::BYTES])?;
            *c = Some(buf);
        }
        Ok(c.as_ref().map_or(0, |b| b.ptr))
    }

    /// Causal attention of `q` over the cache, whose rows `0..start_pos + q.rows` are written.
    fn attend(&self, q: &GpuTensor, cache: &GpuKvCache, start_pos: usize, shape: AttentionShape) -> Result<GpuTensor> {
        let AttentionShape { num_heads, num_kv_heads, head_dim: d } = shape;
        let t = q.rows;
        let pos_dev = self.recorded_pos();
        if decode_attention_fits(t, shape) {
            // A recording must fit every later position: it covers the whole cache (the kernel
            // sizes the splits from the position).
            let longest = if pos_dev.is_some() { cache.capacity() } else { start_pos + t };
            return self.attend_rows(q, KvRows::one(cache, start_pos), pos_dev, longest, shape);
        }
        let out = self.tensor(t, num_heads * d)?;
        let args = [
            Arg::Ptr(q.buf.ptr),
            Arg::Ptr(cache.keys()),
            Arg::Ptr(cache.values()),
            Arg::Ptr(cache.table()),
            Arg::Ptr(out.buf.ptr),
            Arg::I32(start_pos as i32),
            Arg::Ptr(pos_dev.unwrap_or(0)),
            Arg::I32(t as i32),
            Arg::I32(num_heads as i32),
            Arg::I32(num_kv_heads as i32),
            Arg::I32(d as i32),
            Arg::F32(1.0 / (d as f32).sqrt()),
        ];
        self.rt.launch("flash_attention", [blocks(t, FA_BQ as u32), num_heads as u32, 1], [FA_THREADS, 1, 1], 0, &args)?;
        Ok(out)
    }

    /// The decode attention kernel over the rows of `q`, each in the cache and at the position
    /// `rows` gives it (read from `pos_dev` in a recorded step); `longest`: the most positions a
    /// row may see. A row gets the same bits whatever rows come with it (kernels/attention.hip).
    fn attend_rows(&self, q: &GpuTensor, rows: KvRows, pos_dev: Option<u64>, longest: usize, shape: AttentionShape) -> Result<GpuTensor> {
        let AttentionShape { num_heads, num_kv_heads, head_dim: d } = shape;
        let t = q.rows;
        let out = self.tensor(t, num_heads * d)?;
        let splits = longest.div_ceil(ATTENTION_CHUNK).clamp(1, ATTENTION_MAX_SPLITS);
        let partial = self.scratch(byte_size("attention partial results", &[t, num_heads, splits, d + 2, 4])?)?;
        // The kernel's tiles, query and probabilities (bf16, the head padded to 16 columns), or
        // the merge's weights.
        let d16 = d.next_multiple_of(16);
        let tile = DEC_MAX_TILE.min(DEC_TILE_ELEMS / d16 / 16 * 16);
        let shared = (((2 * tile + 16) * (d16 + 8) + 16 * (tile + 8)) * 2).max(num_heads / num_kv_heads * splits * 4);
        let args = [
            Arg::Ptr(q.buf.ptr),
            Arg::KvRows(rows),
            Arg::Ptr(pos_dev.unwrap_or(0)),
            Arg::Ptr(partial.ptr),
            Arg::Ptr(self.tickets()?),
            Arg::Ptr(out.buf.ptr),
            Arg::I32(num_heads as i32),
            Arg::I32(num_kv_heads as i32),
            Arg::I32(d as i32),
            Arg::F32(1.0 / (d as f32).sqrt()),
            Arg::I32(ATTENTION_CHUNK as i32),
        ];
        let grid = [num_kv_heads as u32, splits as u32, t as u32];
        self.rt.launch("attention_decode", grid, [DEC_THREADS, 1, 1], shared as u32, &args)?;
        Ok(out)
    }

    /// Checks an attention call's widths against the shape and the cache.
    fn check_attention(q: &GpuTensor, k: &GpuTensor, v: &GpuTensor, width: usize, shape: AttentionShape) -> Result<()> {
        let AttentionShape { num_heads, num_kv_heads, head_dim: d } = shape;
        if k.cols != width || v.cols != width || q.cols != num_heads * d || num_kv_heads * d != width
            || num_kv_heads == 0 || num_heads % num_kv_heads != 0 || k.rows != q.rows || v.rows != q.rows
        {
            return Err(Error::InvalidArgument("attention: q/k/v widths disagree with the shape".into()));
        }
        if d > MAX_HEAD_DIM || d % 2 != 0 {
            return Err(Error::Unsupported(format!("head_dim {d} on the GPU (even, at most {MAX_HEAD_DIM})")));
        }
        Ok(())
    }

    /// Makes room in the cache for `rows` positions from `start_pos`. A step being recorded
    /// cannot take blocks (their table entries would be written into the recording): its caller
    /// reserves them first (`Backend::reserve_kv`).
    fn make_room(&self, cache: &mut GpuKvCache, start_pos: usize, rows: usize) -> Result<()> {
        let end = start_pos
            .checked_add(rows)
            .ok_or_else(|| Error::ContextOverflow(format!("{rows} positions from {start_pos}")))?;
        if self.recorded_pos().is_some() && end > cache.held() {
            return Err(Error::InvalidArgument(format!(
                "a recorded step reaches position {end}, past the {} positions its KV cache holds",
                cache.held()
            )));
        }
        self.grow_cache(cache, end)
    }

    /// The q/k norms, rotary embedding and cache append of a layer's attention
    /// (`qkv_rope_append`), row t into the cache and at the position `rows` gives it.
    #[allow(clippy::too_many_arguments)]
    fn rope_append(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        norms: QkNorms<'_, Self>,
        rope: &Rope,
        rows: KvRows,
        pos_dev: Option<u64>,
        shape: AttentionShape,
    ) -> Result<()> {
        let d = shape.head_dim;
        if rope.head_dim != d || 2 * rope.inv_freq.len() > d || [norms.q, norms.k].iter().flatten().any(|w| w.cols != d) {
            return Err(Error::InvalidArgument(format!("rotary_attention: rope or norms disagree with head_dim {d}")));
        }
        let args = [
            Arg::Ptr(q.buf.ptr),
            Arg::Ptr(k.buf.ptr),
            Arg::Ptr(v.buf.ptr),
            Arg::Ptr(norms.q.map_or(0, |w| w.buf.ptr)),
            Arg::Ptr(norms.k.map_or(0, |w| w.buf.ptr)),
            Arg::F32(norms.eps),
            Arg::Ptr(self.rope_freqs(rope)?),
            Arg::KvRows(rows),
            Arg::Ptr(pos_dev.unwrap_or(0)),
            Arg::I32(shape.num_heads as i32),
            Arg::I32(shape.num_kv_heads as i32),
            Arg::I32(d as i32),
            Arg::I32(rope.inv_freq.len() as i32),
        ];
        let threads = (d / 2).next_multiple_of(self.rt.warp_size() as usize) as u32;
        let grid = [(shape.num_heads + 2 * shape.num_kv_heads) as u32, q.rows as u32, 1];
        self.rt.launch("qkv_rope_append", grid, [threads, 1, 1], partial_rotary_shared(rope), &args)
    }

    /// The arena, emptied for a recording of `rows` rows.
    fn start_arena(&self, rows: usize) -> Result<()> {
        let mut d = self.decode_state();
        if d.arena.is_none() {
            let size = d.arena_size;
            d.arena = Some(DeviceBuffer::new(&self.rt, size)?);
        }
        (d.arena_used, d.rows, d.row) = (0, rows, 0);
        Ok(())
    }

    /// A tensor that borrows `t`'s memory.
    fn view(t: &GpuTensor) -> GpuTensor {
        GpuTensor { buf: DeviceBuffer { ptr: t.buf.ptr, rt: None }, rows: t.rows, cols: t.cols }
    }

    fn stop_recording(&self) {
        let mut d = self.decode_state();
        (d.recording, d.rows, d.row) = (false, 1, 0);
    }

    /// Drops every recorded step (each is recorded again at its next step).
    fn forget_recording(&self) {
        let stale = {
            let mut d = self.decode_state();
            let stale = d.take_execs();
            d.graphs.clear();
            d.batches.clear();
            stale
        };
        for exec in stale {
            self.rt.destroy_graph(exec);
        }
    }

    /// The first CUDA device.
    pub fn cuda() -> Result<Self> {
        Ok(GpuBackend::new(Arc::new(cuda::CudaRuntime::new(0)?)))
    }

    /// The first HIP (AMD) device.
    pub fn hip() -> Result<Self> {
        Ok(GpuBackend::new(Arc::new(hip::HipRuntime::new(0)?)))
    }

    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.rt
    }

    /// Row `r` of `x` as a `[1, cols]` tensor that borrows its memory (a kernel's view; it must
    /// not outlive `x`).
    fn row_view(x: &GpuTensor, r: usize) -> GpuTensor {
        GpuTensor { buf: DeviceBuffer { ptr: x.buf.ptr + (r * x.cols * 4) as u64, rt: None }, rows: 1, cols: x.cols }
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<GpuTensor> {
        Ok(GpuTensor { buf: self.scratch(byte_size(&format!("tensor [{rows}, {cols}]"), &[rows, cols, 4])?)?, rows, cols })
    }

    /// A tensor that outlives any recording (weights, tables, test inputs): never from the arena.
    pub fn upload_f32(&self, rows: usize, cols: usize, data: &[f32]) -> Result<GpuTensor> {
        let bytes = byte_size(&format!("tensor [{rows}, {cols}]"), &[rows, cols, 4])?;
        if bytes != std::mem::size_of_val(data) {
            return Err(Error::InvalidArgument(format!("upload of {} values into a tensor [{rows}, {cols}]", data.len())));
        }
        let t = GpuTensor { buf: DeviceBuffer::new(&self.rt, bytes)?, rows, cols };
        self.rt.upload(t.buf.ptr, as_bytes(data))?;
        Ok(t)
    }

    /// Queues the argmax of the first `limit` (or *limit_dev) logits of each of the first `rows`
    /// (at most ARGMAX_ROWS) rows of `logits` into out[row] (an i32 each).
    fn launch_argmax(&self, logits: &GpuTensor, rows: usize, limit: usize, limit_dev: u64, out: u64) -> Result<()> {
        debug_assert!((1..=ARGMAX_ROWS).contains(&rows));
        let limit = Arg::I32(limit.min(i32::MAX as usize) as i32);
        let base = self.tickets()?;
        let (ticket, part_v, part_i) = (base + Scratch::ARGMAX_TICKET, base + Scratch::ARGMAX_V, base + Scratch::ARGMAX_I);
        let args = [
            Arg::Ptr(logits.buf.ptr),
            Arg::I32(logits.cols as i32),
            limit,
            Arg::Ptr(limit_dev),
            Arg::Ptr(self.token_mask_ptr()),
            Arg::Ptr(part_v),
            Arg::Ptr(part_i),
            Arg::Ptr(ticket),
            Arg::Ptr(out),
        ];
        self.rt.launch("argmax", [ARGMAX_BLOCKS, rows as u32, 1], [256, 1, 1], 0, &args)
    }

    /// The `k` (at most MAX_DEVICE_TOP_K) largest of the first `limit` logits, largest first.
    fn device_top_k(&self, logits: &GpuTensor, k: usize, limit: usize) -> Result<Vec<(u32, f32)>> {
        let k = k.clamp(1, MAX_DEVICE_TOP_K);
        let base = self.tickets()?;
        let args = [
            Arg::Ptr(logits.buf.ptr),
            Arg::I32(logits.cols as i32),
            Arg::I32(limit.min(i32::MAX as usize) as i32),
            Arg::Ptr(0),
            Arg::I32(k as i32),
            Arg::Ptr(0),
            Arg::Ptr(self.token_mask_ptr()),
            Arg::Ptr(base + Scratch::TOPK_V),
            Arg::Ptr(base + Scratch::TOPK_I),
            Arg::Ptr(base + Scratch::TOPK_TICKET),
            Arg::Ptr(base + Scratch::TOPK_OUT_V),
            Arg::Ptr(base + Scratch::TOPK_OUT_I),
        ];
        self.rt.launch("top_k", [TOPK_BLOCKS, 1, 1], [256, 1, 1], 0, &args)?;
        let mut bytes = vec![0u8; 2 * MAX_DEVICE_TOP_K * 4];
        self.rt.download(base + Scratch::TOPK_OUT_V, &mut bytes)?;
        let (values, ids) = bytes.split_at(MAX_DEVICE_TOP_K * 4);
        let word = |b: &[u8], i: usize| [b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]];
        Ok((0..k)
            .map(|i| (i32::from_le_bytes(word(ids, i)), f32::from_le_bytes(word(values, i))))
            .filter(|&(id, _)| id >= 0)
            .map(|(id, v)| (id as u32, v))
            .collect())
    }

    /// Writes a count-prefixed list that argmax, top_k and the recorded decode step read at a fixed
    /// address (the token mask, the logit adjustments): `Some((entries, capacity, bytes))` with the
    /// whole list in `bytes`, count first, or None to set the count to 0 (nothing to do before
    /// the first list). A list past its buffer's entries gets a buffer for `capacity` of them,
    /// and the recorded step, which points at the old buffer, is forgotten.
    fn put_step_list(&self, slot: &Mutex<Option<(DeviceBuffer, usize)>>, list: Option<(usize, usize, &[u8])>) -> Result<()> {
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        let Some((entries, capacity, bytes)) = list else {
            return match slot.as_ref() {
                Some((buf, _)) => self.rt.upload(buf.ptr, &0u32.to_le_bytes()),
                None => Ok(()),
            };
        };
        if slot.as_ref().is_none_or(|(_, held)| *held < entries) {
            self.forget_recording();
            // The count, then up to `capacity` entries of (bytes - 4) / entries bytes each.
            let size = 4 + (bytes.len() - 4) / entries.max(1) * capacity;
            *slot = Some((DeviceBuffer::new(&self.rt, size)?, capacity));
        }
        let ptr = slot.as_ref().map_or(0, |(b, _)| b.ptr);
        drop(slot);
        self.rt.upload(ptr, bytes)
    }

    /// Adds the request's adjustments to `logits` in place (nothing before the first ones).
    fn adjust_logits(&self, logits: &GpuTensor) -> Result<()> {
        let slot = self.logit_adjust.lock().unwrap_or_else(|p| p.into_inner());
        let Some((buf, capacity)) = slot.as_ref() else { return Ok(()) };
        let args = [Arg::Ptr(logits.buf.ptr), Arg::I32(logits.cols as i32), Arg::Ptr(buf.ptr)];
        self.rt.launch("logit_adjust", [blocks(*capacity, BLOCK), 1, 1], [BLOCK, 1, 1], 0, &args)
    }

    /// The id a uniform `u` picks from the softmax at `temperature` of the first `limit` logits
    /// (mask applied), walking the ids in order; see the draw_in_order kernel.
    fn launch_draw(&self, logits: &GpuTensor, limit: usize, temperature: f32, u: f32) -> Result<u32> {
        let base = self.tickets()?;
        let args = [
            Arg::Ptr(logits.buf.ptr),
            Arg::I32(logits.cols as i32),
            Arg::I32(limit.min(i32::MAX as usize) as i32),
            Arg::Ptr(self.token_mask_ptr()),
            Arg::F32(1.0 / temperature),
            Arg::F32(u),
            Arg::Ptr(base + Scratch::DRAW_PART),
            Arg::Ptr(base + Scratch::DRAW_TICKET),
            Arg::Ptr(base + Scratch::DRAW_OUT),
        ];
        self.rt.launch("draw_in_order", [DRAW_BLOCKS, 1, 1], [256, 1, 1], 0, &args)?;
        self.download_token(base + Scratch::DRAW_OUT)
    }

    /// The `k` largest of the first `limit` logits (mask applied), on the device where it can.
    fn select_top_k(&self, x: &GpuTensor, k: usize, limit: usize) -> Result<Vec<(u32, f32)>> {
        if k > MAX_DEVICE_TOP_K || x.rows != 1 {
            let mut values = self.to_host(x)?;
            if let Some(mask) = self.host_token_mask()? {
                super::apply_token_mask(&mut values, &mask);
            }
            return Ok(crate::sampling::top_k(&values, k, limit));
        }
        self.device_top_k(x, k, limit)
    }

    /// The token mask in force, read back from the device (for the host's top-k of more than
    /// MAX_DEVICE_TOP_K candidates).
    fn host_token_mask(&self) -> Result<Option<Vec<u32>>> {
        let slot = self.token_mask.lock().unwrap_or_else(|p| p.into_inner());
        let Some((buf, capacity)) = slot.as_ref() else { return Ok(None) };
        let mut bytes = vec![0u8; (capacity + 1) * 4];
        self.rt.download(buf.ptr, &mut bytes)?;
        let words: Vec<u32> = bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect();
        let count = (words[0] as usize).min(*capacity);
        Ok((count > 0).then(|| words[1..=count].to_vec()))
    }

    /// The token mask's device address, 0 before the first mask.
    fn token_mask_ptr(&self) -> u64 {
        self.token_mask.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |(b, _)| b.ptr)
    }

    fn download_token(&self, ptr: u64) -> Result<u32> {
        let mut id = [0u8; 4];
        self.rt.download(ptr, &mut id)?;
        Ok(u32::from_le_bytes(id))
    }

    /// Widens `w` to bf16 on the host (rows in parallel) and uploads it to `at`.
    fn upload_widened(&self, w: &dyn QuantMatrix, at: u64) -> Result<()> {
        let cols = w.cols();
        let mut host = vec![bf16::ZERO; w.rows() * cols];
        host.par_chunks_mut(cols.max(1)).enumerate().for_each_init(
            || vec![0f32; cols],
            |row_buf, (r, out)| {
                w.dequant_row(r, row_buf);
                for (o, v) in out.iter_mut().zip(row_buf.iter()) {
                    *o = bf16::from_f32(*v);
                }
            },
        );
        // SAFETY: bf16 is a plain 2-byte value.
        let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), host.len() * 2) };
        self.rt.upload(at, bytes)
    }

    fn elementwise(&self, kernel: &str, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.rt.launch(kernel, [blocks(n, BLOCK), 1, 1], [BLOCK, 1, 1], 0, args)
    }

    /// Copies every span in one launch: a prefix-cache block is a span per layer for keys and
    /// for values, and a long history's restore thousands of them (one copy call each took
    /// ~4.5 µs, 21 ms for 16k positions of the Qwen3-8B shape).
    fn copy_spans(&self, spans: &[CopySpan]) -> Result<()> {
        // The grid's y dimension holds at most this many spans a launch.
        const SPANS_PER_LAUNCH: usize = 65_535;
        // Each thread copies up to this many 16-byte words of its span.
        const WORDS_PER_THREAD: usize = 4;
        let spans: Vec<&CopySpan> = spans.iter().filter(|s| s.bytes > 0).collect();
        let Some(longest) = spans.iter().map(|s| s.bytes).max() else { return Ok(()) };
        let table: Vec<u8> = spans.iter().flat_map(|s| [s.dst, s.src, s.bytes as u64]).flat_map(u64::to_le_bytes).collect();
        let buf = DeviceBuffer::new(&self.rt, table.len())?;
        self.rt.upload(buf.ptr, &table)?;
        let x = blocks(longest.div_ceil(16 * WORDS_PER_THREAD), BLOCK);
        for first in (0..spans.len()).step_by(SPANS_PER_LAUNCH) {
            let count = (spans.len() - first).min(SPANS_PER_LAUNCH) as u32;
            self.rt.launch("copy_spans", [x, count, 1], [BLOCK, 1, 1], 0, &[Arg::Ptr(buf.ptr + 24 * first as u64)])?;
        }
        Ok(())
    }

    fn grow_cache(&self, cache: &mut GpuKvCache, needed: usize) -> Result<()> {
        if cache.grow(&self.rt, needed)? {
            // The recorded decode steps point at the old block table.
            self.forget_recording();
        }
        Ok(())
    }
}

/// Whether the decode attention kernel takes `rows` query rows of this shape (a few: longer runs
/// take the prefill kernel).
fn decode_attention_fits(rows: usize, shape: AttentionShape) -> bool {
    let AttentionShape { num_heads, num_kv_heads, .. } = shape;
    (1..=KV_ROWS).contains(&rows) && num_kv_heads > 0 && num_heads / num_kv_heads <= 16 && rows * num_kv_heads <= MAX_KV_HEADS
}

impl KvRows {
    /// Rows of one sequence, the first at `start_pos` of `cache`.
    fn one(cache: &GpuKvCache, start_pos: usize) -> Self {
        let mut rows = KvRows { count: 1, ..KvRows::default() };
        rows.set(0, cache, start_pos);
        rows
    }

    fn set(&mut self, i: usize, cache: &GpuKvCache, pos: usize) {
        (self.keys[i], self.values[i], self.tables[i], self.pos[i]) = (cache.keys(), cache.values(), cache.table(), pos as i32);
    }
}

fn as_bytes(data: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

/// Dynamic shared memory of the fused norm + rotary kernels: the head, for partial rotary only.
fn partial_rotary_shared(rope: &Rope) -> u32 {
    if 2 * rope.inv_freq.len() == rope.head_dim {
        0
    } else {
        (rope.head_dim * 4) as u32
    }
}

fn same_shape(a: &GpuTensor, b: &GpuTensor, op: &str) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(Error::InvalidArgument(format!(
            "{op}: shapes [{}, {}] and [{}, {}] differ",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

impl Backend for GpuBackend {
    type Tensor = GpuTensor;
    type Weight = GpuWeight;
    type KvCache = GpuKvCache;
    type Experts = GpuExperts;

    fn describe(&self) -> String {
        self.rt.describe()
    }

    fn steps_round_alike(&self) -> bool {
        false
    }

    fn supports(&self, cap: Capability) -> bool {
        match cap {
            // The attention kernels pad heads to their tiles.
            Capability::HeadDim(d) => d <= MAX_HEAD_DIM && d % 2 == 0,
            Capability::GatedDeltaNet | Capability::SigmoidGate | Capability::PartialRotary => true,
            Capability::MixtureOfExperts => true,
        }
    }

    fn upload_weight(&self, w: Box<dyn QuantMatrix>) -> Result<GpuWeight> {
        let (rows, cols) = (w.rows(), w.cols());
        let what = format!("weight [{rows}, {cols}]");
        // FP8 checkpoints stay FP8 on the device: half the bytes to stream per token.
        if let Some((codes, scales)) = w.fp8_blocks() {
            let buf = DeviceBuffer::new(&self.rt, codes.len())?;
            self.rt.upload(buf.ptr, codes)?;
            let scales = self.upload_f32(1, scales.len(), scales)?.buf;
            return Ok(GpuWeight { buf, rows, cols, format: WeightFormat::Fp8 { scales } });
        }
        if let Some((seed, scale)) = w.synthetic() {
            // Random weights for benchmarks are made where they are used: no host copy of gigabytes.
            let n = byte_size(&what, &[rows, cols])?;
            let grid = [blocks(n, BLOCK).min(65535 * 8), 1, 1];
            if w.dtype() == DType::F8E4M3 {
                let scale_grid = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
                let buf = DeviceBuffer::new(&self.rt, n)?;
                let args = [Arg::Ptr(buf.ptr), Arg::I64(n as i64), Arg::U64(seed)];
                self.rt.launch("fill_random_fp8", grid, [BLOCK, 1, 1], 0, &args)?;
                let scales = self.upload_f32(1, scale_grid, &vec![scale; scale_grid])?.buf;
                return Ok(GpuWeight { buf, rows, cols, format: WeightFormat::Fp8 { scales } });
            }
            let buf = DeviceBuffer::new(&self.rt, byte_size(&what, &[rows, cols, 2])?)?;
            let args = [Arg::Ptr(buf.ptr), Arg::I64(n as i64), Arg::U64(seed), Arg::F32(scale)];
            self.rt.launch("fill_random_bf16", grid, [BLOCK, 1, 1], 0, &args)?;
            return Ok(GpuWeight { buf, rows, cols, format: WeightFormat::Bf16 });
        }
        // Block formats keep their bytes, rearranged into the layout the kernels read.
        if let Some(packed) = packed::pack(w.as_ref(), None) {
            let packed = packed?;
            let buf = DeviceBuffer::new(&self.rt, packed.bytes.len())?;
            self.rt.upload(buf.ptr, &packed.bytes)?;
            return Ok(GpuWeight { buf, rows, cols, format: WeightFormat::Packed(packed.format) });
        }
        // Every other format is widened on the host (in parallel) and stored as bf16.
        let buf = DeviceBuffer::new(&self.rt, byte_size(&what, &[rows, cols, 2])?)?;
        self.upload_widened(w.as_ref(), buf.ptr)?;
        Ok(GpuWeight { buf, rows, cols, format: WeightFormat::Bf16 })
    }

    fn upload_experts(&self, count: usize, expert: &mut dyn FnMut(usize) -> Result<super::HostMlp>) -> Result<GpuExperts> {
        self.stack_experts(count, expert)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<GpuTensor> {
        self.upload_f32(1, v.len(), v)
    }

    fn set_kv_pool(&self, kv_width: usize, blocks: usize) -> Result<()> {
        let mut pool = self.kv_pool.lock().unwrap_or_else(|p| p.into_inner());
        // The old pool's memory goes first (caches made from it keep it until they are dropped).
        *pool = None;
        *pool = Some(GpuKvPool::new(&self.rt, kv_width, blocks)?);
        Ok(())
    }

    fn kv_block_bytes(&self, kv_width: usize) -> usize {
        2 * kv_bytes(KV_BLOCK, kv_width).unwrap_or(usize::MAX / 2)
    }

    fn new_kv_cache(&self, kv_width: usize, capacity: usize) -> Result<GpuKvCache> {
        let pool = self.kv_pool.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let pool = pool.ok_or_else(|| Error::InvalidArgument("a KV cache before its pool (Backend::set_kv_pool)".into()))?;
        if pool.width() != kv_width {
            return Err(Error::InvalidArgument(format!("a KV cache of width {kv_width} from a pool of width {}", pool.width())));
        }
        self.tickets()?;
        // A recorded decode step points at the caches it was recorded with: a model that makes its
        // caches afresh (a hybrid one restarting its recurrent states at position 0) records anew.
        self.forget_recording();
        GpuKvCache::new(&self.rt, &pool, capacity)
    }

    fn reserve_kv(&self, cache: &mut GpuKvCache, positions: usize) -> Result<()> {
        self.grow_cache(cache, positions)
    }

    fn kv_pool_usage(&self) -> Option<(usize, usize)> {
        let pool = self.kv_pool.lock().unwrap_or_else(|p| p.into_inner());
        pool.as_ref().map(|p| (p.books().blocks() - p.books().free_blocks(), p.books().blocks()))
    }

    fn to_host(&self, x: &GpuTensor) -> Result<Vec<f32>> {
        let mut out = vec![0f32; x.rows * x.cols];
        // SAFETY: f32 has no invalid byte patterns.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 4) };
        self.rt.download(x.buf.ptr, bytes)?;
        Ok(out)
    }

    fn save_kv(&self, caches: &[&GpuKvCache], start: usize, len: usize) -> Result<Vec<GpuKvCache>> {
        let mut saved = Vec::with_capacity(caches.len());
        let mut spans = Vec::new();
        for cache in caches {
            if start.checked_add(len).is_none_or(|end| end > cache.held()) {
                return Err(Error::InvalidArgument(format!("save_kv: positions {start}..+{len} past a cache of {}", cache.held())));
            }
            // A piece of the prefix cache is no sequence's: its blocks are a pool of its own,
            // counted against the prefix cache's budget, not the sequences' pool.
            let pool = GpuKvPool::new(&self.rt, cache.width(), kv_pool::blocks_for(len))?;
            let mut copy = GpuKvCache::new(&self.rt, &pool, len)?;
            copy.grow(&self.rt, len)?;
            copy.set_len(len);
            GpuKvCache::spans(cache, start, &copy, 0, len, &mut spans)?;
            saved.push(copy);
        }
        self.copy_spans(&spans)?;
        Ok(saved)
    }

    fn restore_kv(&self, restores: &mut [KvRestore<'_, GpuKvCache>]) -> Result<()> {
        let mut spans = Vec::new();
        for KvRestore { cache, pieces } in restores.iter_mut() {
            let mut end = 0;
            for &(saved, start) in pieces.iter() {
                if saved.width() != cache.width() {
                    return Err(Error::InvalidArgument(format!("restore_kv: width {} into a cache of width {}", saved.width(), cache.width())));
                }
                let piece_end = start.checked_add(saved.len()).ok_or_else(|| Error::InvalidArgument("restore_kv: position overflow".into()))?;
                end = end.max(piece_end);
            }
            self.grow_cache(cache, end)?;
            for &(saved, start) in pieces.iter() {
                GpuKvCache::spans(saved, 0, cache, start, saved.len(), &mut spans)?;
            }
        }
        self.copy_spans(&spans)
    }

    fn kv_bytes(&self, cache: &GpuKvCache) -> usize {
        cache.bytes()
    }

    fn free_memory(&self) -> Option<usize> {
        self.rt.free_memory()
    }

    fn tensor_bytes(&self, x: &GpuTensor) -> usize {
        x.rows * x.cols * 4
    }

    fn save_tensor(&self, x: &GpuTensor) -> Result<GpuTensor> {
        let bytes = byte_size("saved tensor", &[x.rows, x.cols, 4])?;
        let saved = GpuTensor { buf: DeviceBuffer::new(&self.rt, bytes.max(4))?, rows: x.rows, cols: x.cols };
        self.rt.copy(saved.buf.ptr, x.buf.ptr, bytes)?;
        Ok(saved)
    }

    fn restore_tensor(&self, saved: &GpuTensor, x: &mut GpuTensor) -> Result<()> {
        if (saved.rows, saved.cols) != (x.rows, x.cols) {
            return Err(Error::InvalidArgument(format!(
                "restore_tensor: [{}, {}] into [{}, {}]",
                saved.rows, saved.cols, x.rows, x.cols
            )));
        }
        self.rt.copy(x.buf.ptr, saved.buf.ptr, byte_size("restored tensor", &[x.rows, x.cols, 4])?)
    }

    fn embed(&self, table: &GpuWeight, tokens: &[u32]) -> Result<GpuTensor> {
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the model's vocabulary of {}",
                table.rows
            )));
        }
        let out = self.tensor(tokens.len(), table.cols)?;
        let mut ids_buf = None;
        let ids_ptr = match self.recorded_inputs() {
            Some(inputs) => inputs,
            None => {
                let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                let buf = DeviceBuffer::new(&self.rt, ids.len() * 4)?;
                // SAFETY: i32 slice viewed as bytes.
                self.rt.upload(buf.ptr, unsafe { std::slice::from_raw_parts(ids.as_ptr().cast(), ids.len() * 4) })?;
                ids_buf.insert(buf).ptr
            }
        };
        let grid = [blocks(table.cols, BLOCK), tokens.len() as u32, 1];
        let (table_ptr, out_ptr, cols) = (Arg::Ptr(table.buf.ptr), Arg::Ptr(out.buf.ptr), Arg::I32(table.cols as i32));
        if let WeightFormat::Packed(format) = table.format {
            let args = [table_ptr, Arg::I32(packed_kernel(format).0), Arg::I32(table.rows as i32), Arg::Ptr(ids_ptr), out_ptr, cols];
            let grid = [blocks(table.cols / 16, BLOCK), tokens.len() as u32, 1];
            self.rt.launch("embed_packed", grid, [BLOCK, 1, 1], 0, &args)?;
        } else if table.is_fp8() {
            let kblocks = Arg::I32(table.cols.div_ceil(FP8_BLOCK) as i32);
            let args = [table_ptr, Arg::Ptr(table.scales()), Arg::Ptr(ids_ptr), out_ptr, cols, kblocks];
            self.rt.launch("embed_fp8", grid, [BLOCK, 1, 1], 0, &args)?;
        } else {
            self.rt.launch("embed_bf16", grid, [BLOCK, 1, 1], 0, &[table_ptr, Arg::Ptr(ids_ptr), out_ptr, cols])?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &GpuTensor, weight: &GpuTensor, eps: f32) -> Result<GpuTensor> {
        let group = weight.cols;
        if group == 0 || !x.cols.is_multiple_of(group) {
            return Err(Error::InvalidArgument(format!("rms_norm: width {} is not a multiple of {group}", x.cols)));
        }
        let out = self.tensor(x.rows, x.cols)?;
        let groups = x.rows * x.cols / group;
        // One float4 per thread where possible.
        let warp = self.rt.warp_size() as usize;
        let threads = (group / 4).clamp(warp, 1024).next_multiple_of(warp) as u32;
        let args = [Arg::Ptr(x.buf.ptr), Arg::Ptr(weight.buf.ptr), Arg::Ptr(out.buf.ptr), Arg::I32(group as i32), Arg::F32(eps)];
        if groups > 0 {
            self.rt.launch("rms_norm", [groups as u32, 1, 1], [threads, 1, 1], 0, &args)?;
        }
        Ok(out)
    }

    fn linear(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuTensor>) -> Result<GpuTensor> {
        let y = self.tensor(x.rows, w.rows)?;
        self.matmul(x, w, bias, None, y.buf.ptr)?;
        Ok(y)
    }

    fn linear_add(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuTensor>, residual: &mut GpuTensor) -> Result<()> {
        if (residual.rows, residual.cols) != (x.rows, w.rows) {
            return Err(Error::InvalidArgument(format!(
                "linear_add: residual [{}, {}] but the product is [{}, {}]",
                residual.rows, residual.cols, x.rows, w.rows
            )));
        }
        let out = residual.buf.ptr;
        self.matmul(x, w, bias, Some(out), out)
    }

    fn norm_linears<const N: usize>(
        &self,
        x: &GpuTensor,
        norm: &GpuTensor,
        eps: f32,
        projs: [Proj<'_, Self>; N],
    ) -> Result<[GpuTensor; N]> {
        let fused = N >= 1
            && norm.cols == x.cols
            && projs.iter().all(|p| {
                p.weight.cols == x.cols
                    && p.weight.gemv1_fits(true, self.gemv_device(), x.rows)
                    && p.weight.suffix() == projs[0].weight.suffix()
            });
        if !fused {
            let xn = self.rms_norm(x, norm, eps)?;
            let out = projs.iter().map(|p| self.linear(&xn, p.weight, p.bias)).collect::<Result<Vec<_>>>()?;
            return out.try_into().map_err(|_| Error::InvalidArgument("norm_linears: projection count".into()));
        }
        let out = projs.iter().map(|p| self.tensor(x.rows, p.weight.rows)).collect::<Result<Vec<_>>>()?;
        let segs: Vec<_> = projs.iter().zip(&out).map(|(p, y)| (p.weight, p.bias, y.buf.ptr)).collect();
        // The kernels take four projections a launch; each launch normalises the one row again.
        for group in segs.chunks(GEMV1_SEGMENTS) {
            self.gemv1(x, group, Some((norm, eps)), None)?;
        }
        out.try_into().map_err(|_| Error::InvalidArgument("norm_linears: projection count".into()))
    }

    fn norm_silu_gate_up(
        &self,
        x: &GpuTensor,
        norm: &GpuTensor,
        eps: f32,
        gate: Proj<'_, Self>,
        up: Proj<'_, Self>,
    ) -> Result<GpuTensor> {
        let (g, u) = (gate.weight, up.weight);
        let fused = norm.cols == x.cols
            && g.cols == x.cols
            && (u.rows, u.cols) == (g.rows, g.cols)
            && g.gemv1_fits(true, self.gemv_device(), x.rows)
            && g.suffix() == u.suffix();
        if !fused {
            let xn = self.rms_norm(x, norm, eps)?;
            if let Some(out) = self.gate_up_gemm(&xn, &gate, &up)? {
                return Ok(out);
            }
            let gv = self.linear(&xn, g, gate.bias)?;
            let uv = self.linear(&xn, u, up.bias)?;
            return self.silu_mul(&gv, &uv);
        }
        let out = self.tensor(x.rows, g.rows)?;
        let group = g.gemv1_group(true, self.gemv_device(), x.rows).max(1);
        for first in (0..x.rows).step_by(group) {
            let tokens = group.min(x.rows - first);
            let at = |cols: usize| (first * cols * 4) as u64;
            let mut args = vec![
                Arg::Ptr(g.buf.ptr),
                Arg::Ptr(u.buf.ptr),
                Arg::Ptr(g.scales()),
                Arg::Ptr(u.scales()),
                Arg::Ptr(gate.bias.map_or(0, |b| b.buf.ptr)),
                Arg::Ptr(up.bias.map_or(0, |b| b.buf.ptr)),
                Arg::Ptr(x.buf.ptr + at(x.cols)),
                Arg::Ptr(norm.buf.ptr),
                Arg::F32(eps),
                Arg::Ptr(out.buf.ptr + at(g.rows)),
                Arg::I32(g.rows as i32),
                Arg::I32(g.cols as i32),
            ];
            // The packed kernels, FP8's one-token kernel where it has weight slots, the split
            // kernels and bf16 on matrix cores take 8 gate rows and their 8 up rows a tile (as 16
            // rows); the others two tiles of 16 rows.
            let dev = self.gemv_device();
            let (tile_rows, tiles) = match g.format {
                WeightFormat::Packed(_) => (2 * g.rows, 2),
                WeightFormat::Bf16 if dev.bf16_mma => (2 * g.rows, 1),
                WeightFormat::Fp8 { .. } if x.rows == 1 && dev.async_copy => (2 * g.rows, 1),
                WeightFormat::Fp8 { .. } if g.split(2 * g.rows, x.rows > 1, dev) => (2 * g.rows, 1),
                _ => (g.rows, 2),
            };
            let (kernel, tokens_arg) = g.gemv1_kernel("gemv1_gate_up", x.rows, tile_rows, dev);
            args.extend(tokens_arg.map(|_| Arg::I32(tokens as i32)));
            let split = self.split_args(g, tile_rows, tokens, x.rows > 1)?;
            args.extend(split.iter().flat_map(|s| s.1.iter().copied()));
            let (grid, block, shared) = g.gemv1_launch(tile_rows, tiles, true, tokens, x.rows > 1, dev);
            self.rt.launch_early(&kernel, grid, block, shared, &args)?;
        }
        Ok(out)
    }

    fn norm_rope(&self, x: &mut GpuTensor, norm: Option<&GpuTensor>, eps: f32, rope: &Rope, start_pos: usize) -> Result<()> {
        let d = rope.head_dim;
        if d == 0 || !x.cols.is_multiple_of(d) || 2 * rope.inv_freq.len() > d || norm.is_some_and(|w| w.cols != d) || d > 2048 {
            return Err(Error::InvalidArgument(format!("norm_rope: width {} and head_dim {d} disagree", x.cols)));
        }
        let freqs = self.rope_freqs(rope)?;
        let pos_dev = self.recorded_pos().unwrap_or(0);
        let args = [
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(norm.map_or(0, |w| w.buf.ptr)),
            Arg::F32(eps),
            Arg::Ptr(freqs),
            Arg::I32(start_pos as i32),
            Arg::Ptr(pos_dev),
            Arg::I32(d as i32),
            Arg::I32(rope.inv_freq.len() as i32),
        ];
        let threads = (d / 2).next_multiple_of(self.rt.warp_size() as usize) as u32;
        let shared = partial_rotary_shared(rope);
        self.rt.launch("norm_rope", [(x.cols / d) as u32, x.rows as u32, 1], [threads, 1, 1], shared, &args)
    }

    fn rotary_attention(
        &self,
        q: GpuTensor,
        k: GpuTensor,
        v: &GpuTensor,
        norms: QkNorms<'_, Self>,
        rope: &Rope,
        cache: &mut GpuKvCache,
        start_pos: usize,
        shape: AttentionShape,
    ) -> Result<GpuTensor> {
        Self::check_attention(&q, &k, v, cache.width(), shape)?;
        self.make_room(cache, start_pos, q.rows)?;
        self.rope_append(&q, &k, v, norms, rope, KvRows::one(cache, start_pos), self.recorded_pos(), shape)?;
        self.attend(&q, cache, start_pos, shape)
    }

    fn rotary_attention_rows(
        &self,
        q: GpuTensor,
        k: GpuTensor,
        v: &GpuTensor,
        norms: QkNorms<'_, Self>,
        rope: &Rope,
        caches: &mut [&mut GpuKvCache],
        positions: &[usize],
        shape: AttentionShape,
    ) -> Result<GpuTensor> {
        let n = caches.len();
        if n != positions.len() || n != q.rows || !decode_attention_fits(n, shape) {
            return super::rotary_attention_one_by_one(self, q, k, v, norms, rope, caches, positions, shape);
        }
        // A recorded step reads each sequence's position from its row of the step's inputs.
        let pos_dev = self.recorded_pos();
        let mut rows = KvRows { count: n as i32, ..KvRows::default() };
        let mut longest = 0;
        for (i, (cache, &pos)) in caches.iter_mut().zip(positions).enumerate() {
            Self::check_attention(&q, &k, v, cache.width(), shape)?;
            self.make_room(cache, pos, 1)?;
            rows.set(i, cache, pos);
            longest = longest.max(if pos_dev.is_some() { cache.capacity() } else { pos + 1 });
        }
        self.rope_append(&q, &k, v, norms, rope, rows, pos_dev, shape)?;
        self.attend_rows(&q, rows, pos_dev, longest, shape)
    }

    fn rope(&self, x: &mut GpuTensor, rope: &Rope, start_pos: usize) -> Result<()> {
        let (d, half) = (rope.head_dim, rope.inv_freq.len());
        if d == 0 || !x.cols.is_multiple_of(d) || 2 * half > d {
            return Err(Error::InvalidArgument(format!("rope: width {} and head_dim {d} disagree", x.cols)));
        }
        if half == 0 || x.rows == 0 || x.cols == 0 {
            return Ok(());
        }
        let freqs = self.rope_freqs(rope)?;
        let pos_dev = self.recorded_pos().unwrap_or(0);
        let args = [Arg::Ptr(x.buf.ptr), Arg::Ptr(freqs), Arg::I32(start_pos as i32), Arg::Ptr(pos_dev), Arg::I32(d as i32), Arg::I32(half as i32)];
        // Partial rotary (Qwen3.5) turns only the first 2 * half values of each head.
        let threads = half.next_multiple_of(32) as u32;
        self.rt.launch("rope", [(x.cols / d) as u32, x.rows as u32, 1], [threads, 1, 1], 0, &args)
    }

    fn attention(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        cache: &mut GpuKvCache,
        start_pos: usize,
        shape: AttentionShape,
    ) -> Result<GpuTensor> {
        Self::check_attention(q, k, v, cache.width(), shape)?;
        self.make_room(cache, start_pos, q.rows)?;
        let width = cache.width();
        let pos_dev = self.recorded_pos().unwrap_or(0);
        let args = [
            Arg::Ptr(k.buf.ptr),
            Arg::Ptr(v.buf.ptr),
            Arg::Ptr(cache.keys()),
            Arg::Ptr(cache.values()),
            Arg::Ptr(cache.table()),
            Arg::I32(start_pos as i32),
            Arg::Ptr(pos_dev),
            Arg::I32(width as i32),
        ];
        self.rt.launch("kv_append", [blocks(width, BLOCK), q.rows as u32, 1], [BLOCK, 1, 1], 0, &args)?;
        self.attend(q, cache, start_pos, shape)
    }

    fn silu_mul(&self, gate: &GpuTensor, up: &GpuTensor) -> Result<GpuTensor> {
        same_shape(gate, up, "silu_mul")?;
        let out = self.tensor(gate.rows, gate.cols)?;
        let n = gate.rows * gate.cols;
        self.elementwise("silu_mul", n, &[Arg::Ptr(gate.buf.ptr), Arg::Ptr(up.buf.ptr), Arg::Ptr(out.buf.ptr), Arg::I32(n as i32)])?;
        Ok(out)
    }

    fn add_assign(&self, x: &mut GpuTensor, y: &GpuTensor) -> Result<()> {
        same_shape(x, y, "add")?;
        let n = x.rows * x.cols;
        self.elementwise("add_inplace", n, &[Arg::Ptr(x.buf.ptr), Arg::Ptr(y.buf.ptr), Arg::I32(n as i32)])
    }

    // Launches in moe.rs.
    fn moe_add(&self, xn: &GpuTensor, router_logits: &GpuTensor, experts: &GpuExperts, routing: super::Routing, residual: &mut GpuTensor) -> Result<()> {
        self.moe_forward(xn, router_logits, experts, routing, residual)
    }

    fn moe_block_add(
        &self,
        x: &mut GpuTensor,
        norm: &GpuTensor,
        eps: f32,
        router_logits: &GpuTensor,
        experts: &GpuExperts,
        shared: Option<super::SharedExpert<'_, Self>>,
        routing: super::Routing,
    ) -> Result<()> {
        self.moe_block(x, norm, eps, router_logits, experts, shared, routing)
    }

    // The Qwen3.5 hybrid ops: launches in delta_net.rs.
    fn conv1d_silu(&self, x: &GpuTensor, weight: &GpuTensor, state: &mut GpuTensor) -> Result<GpuTensor> {
        self.launch_conv1d_silu(x, weight, state)
    }

    fn gated_delta_rule(
        &self,
        qkv: &GpuTensor,
        a: &GpuTensor,
        b: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
        state: &mut GpuTensor,
        shape: super::DeltaShape,
    ) -> Result<GpuTensor> {
        self.launch_gated_delta_rule(qkv, a, b, a_log, dt_bias, state, shape)
    }

    fn delta_net_rows(
        &self,
        qkv: &GpuTensor,
        a: &GpuTensor,
        b: &GpuTensor,
        weights: super::DeltaWeights<'_, Self>,
        states: &mut [(&mut GpuTensor, &mut GpuTensor)],
        shape: super::DeltaShape,
    ) -> Result<GpuTensor> {
        self.launch_delta_net_rows(qkv, a, b, weights, states, shape)
    }

    fn gated_rms_norm(&self, x: &GpuTensor, z: &GpuTensor, weight: &GpuTensor, eps: f32) -> Result<GpuTensor> {
        self.launch_gated_rms_norm(x, z, weight, eps)
    }

    fn sigmoid_gate(&self, x: &mut GpuTensor, gate: &GpuTensor) -> Result<()> {
        self.launch_sigmoid_gate(x, gate)
    }

    fn last_row(&self, x: &GpuTensor) -> Result<GpuTensor> {
        if x.rows == 0 {
            return Err(Error::InvalidArgument("last_row of an empty tensor".into()));
        }
        let out = self.tensor(1, x.cols)?;
        self.rt.copy(out.buf.ptr, x.buf.ptr + ((x.rows - 1) * x.cols * 4) as u64, x.cols * 4)?;
        Ok(out)
    }

    fn rows(&self, x: &GpuTensor, start: usize, len: usize) -> Result<GpuTensor> {
        if start.checked_add(len).is_none_or(|end| end > x.rows) {
            return Err(Error::InvalidArgument(format!("rows {start}..+{len} of a tensor of {} rows", x.rows)));
        }
        let ptr = x.buf.ptr + (start * x.cols * 4) as u64;
        Ok(GpuTensor { buf: DeviceBuffer { ptr, rt: None }, rows: len, cols: x.cols })
    }

    fn stack_rows(&self, parts: &[GpuTensor]) -> Result<GpuTensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(Error::InvalidArgument("stack_rows: parts of different widths".into()));
        }
        let out = self.tensor(parts.iter().map(|p| p.rows).sum(), cols)?;
        let mut at = out.buf.ptr;
        for p in parts {
            self.rt.copy(at, p.buf.ptr, p.rows * cols * 4)?;
            at += (p.rows * cols * 4) as u64;
        }
        Ok(out)
    }

    fn set_token_mask(&self, mask: Option<&[u32]>) -> Result<()> {
        if mask.is_some_and(<[u32]>::is_empty) {
            return Err(Error::InvalidArgument("an empty token mask (it would allow nothing)".into()));
        }
        let Some(words) = mask else { return self.put_step_list(&self.token_mask, None) };
        // The word count first: the kernels allow no id past the mask (and 0 words means off).
        let count = u32::try_from(words.len()).map_err(|_| Error::InvalidArgument("token mask too long".into()))?;
        let bytes: Vec<u8> = std::iter::once(count).chain(words.iter().copied()).flat_map(u32::to_le_bytes).collect();
        self.put_step_list(&self.token_mask, Some((words.len(), words.len(), &bytes)))
    }

    fn argmax(&self, x: &GpuTensor, limit: usize) -> Result<u32> {
        self.adjust_logits(x)?;
        let out = self.scratch(4)?;
        self.launch_argmax(x, 1, limit, 0, out.ptr)?;
        self.download_token(out.ptr)
    }

    fn argmax_rows(&self, x: &GpuTensor, limit: usize) -> Result<Vec<u32>> {
        let out = self.scratch(4 * x.rows.max(1))?;
        for r in 0..x.rows {
            self.adjust_logits(&Self::row_view(x, r))?;
        }
        for first in (0..x.rows).step_by(ARGMAX_ROWS) {
            let rows = ARGMAX_ROWS.min(x.rows - first);
            self.launch_argmax(&Self::row_view(x, first), rows, limit, 0, out.ptr + 4 * first as u64)?;
        }
        let mut ids = vec![0u8; 4 * x.rows];
        self.rt.download(out.ptr, &mut ids)?;
        Ok(ids.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    fn top_k(&self, x: &GpuTensor, k: usize, limit: usize) -> Result<Vec<(u32, f32)>> {
        self.adjust_logits(x)?;
        self.select_top_k(x, k, limit)
    }

    // argmax and top_k adjust x in place: what follows sees the adjustments made.
    fn log_partition(&self, x: &GpuTensor, limit: usize, temperature: f32) -> Result<LogPartition> {
        if x.rows != 1 || temperature.is_nan() || temperature <= 0.0 {
            return Ok(LogPartition::of(&self.chosen_logits(x)?, limit, temperature));
        }
        let base = self.tickets()?;
        let args = [
            Arg::Ptr(x.buf.ptr),
            Arg::I32(x.cols as i32),
            Arg::I32(limit.min(i32::MAX as usize) as i32),
            Arg::Ptr(self.token_mask_ptr()),
            Arg::F32(1.0 / temperature),
            Arg::Ptr(base + Scratch::LOGZ_PART),
            Arg::Ptr(base + Scratch::LOGZ_TICKET),
            Arg::Ptr(base + Scratch::LOGZ_OUT),
        ];
        self.rt.launch("log_partition", [LOGZ_BLOCKS, 1, 1], [256, 1, 1], 0, &args)?;
        let mut bytes = [0u8; 8];
        self.rt.download(base + Scratch::LOGZ_OUT, &mut bytes)?;
        let at_temperature = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let raw = f32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        Ok(LogPartition { at_temperature, raw })
    }

    fn chosen_logits(&self, x: &GpuTensor) -> Result<Vec<f32>> {
        let mut values = self.to_host(x)?;
        if let Some(mask) = self.host_token_mask()? {
            super::apply_token_mask(&mut values, &mask);
        }
        Ok(values)
    }

    fn set_logit_adjustments(&self, list: &[Adjustment]) -> Result<()> {
        if list.is_empty() {
            return self.put_step_list(&self.logit_adjust, None);
        }
        let count = i32::try_from(list.len()).map_err(|_| Error::InvalidArgument("too many logit adjustments".into()))?;
        let ids = list.iter().map(|a| a.id.min(i32::MAX as u32) as i32);
        let mut bytes: Vec<u8> = std::iter::once(count).chain(ids).flat_map(i32::to_le_bytes).collect();
        for field in [|a: &Adjustment| a.bias, |a: &Adjustment| a.repetition, |a: &Adjustment| a.subtract] {
            bytes.extend(list.iter().flat_map(|a| field(a).to_le_bytes()));
        }
        // The kernel runs over the list's capacity: a few sizes only, each recorded once.
        let capacity = list.len().next_power_of_two().max(64);
        self.put_step_list(&self.logit_adjust, Some((list.len(), capacity, &bytes)))
    }

    fn draw(&self, x: &GpuTensor, limit: usize, temperature: f32, u: f32) -> Result<u32> {
        if x.rows != 1 {
            return Ok(crate::sampling::draw_in_order(&self.chosen_logits(x)?, limit, temperature, u));
        }
        self.adjust_logits(x)?;
        self.launch_draw(x, limit, temperature, u)
    }

    fn plan_sequences(&self, sequences: usize) {
        // Recorded steps hold the kernels chosen when they were recorded.
        if self.several_sequences.swap(sequences > 1, Ordering::Relaxed) != (sequences > 1) {
            self.forget_recording();
        }
    }

    fn replay_decode(&self, key: usize, token: u32, pos: usize, want: StepOutput) -> Result<bool> {
        let exec = {
            let mut d = self.decode_state();
            let exec = d.graphs.get(key).and_then(|g| g.as_ref()?.exec);
            if exec.is_some() {
                d.last = key;
            }
            exec
        };
        let Some(exec) = exec else { return Ok(false) };
        self.set_inputs(token, pos, want)?;
        self.rt.launch_graph(exec)?;
        Ok(true)
    }

    fn replay_batch(&self, key: &[usize], tokens: &[u32], pos: &[usize]) -> Result<Option<GpuTensor>> {
        let found = {
            let d = self.decode_state();
            d.batches.get(key).and_then(|g| Some((g.exec?, Self::view(&g.logits))))
        };
        let Some((exec, logits)) = found else { return Ok(None) };
        self.set_batch_inputs(tokens, pos)?;
        self.rt.launch_graph(exec)?;
        Ok(Some(logits))
    }

    fn record_batch(
        &self,
        key: &[usize],
        tokens: &[u32],
        pos: &[usize],
        vocab: usize,
        forward: &mut dyn FnMut() -> Result<GpuTensor>,
    ) -> Result<Option<GpuTensor>> {
        let old = self.decode_state().batches.remove(key).and_then(|g| g.exec);
        if let Some(exec) = old {
            self.rt.destroy_graph(exec);
        }
        let rows = tokens.len();
        // The logits live outside the graph, which ends by copying them there.
        let bytes = byte_size("batched decode logits", &[rows, vocab, 4])?;
        let logits = GpuTensor { buf: DeviceBuffer::new(&self.rt, bytes)?, rows, cols: vocab };
        self.set_batch_inputs(tokens, pos)?;
        self.start_arena(rows)?;
        let Ok(capture) = Capture::begin(self) else {
            self.stop_recording();
            return Ok(None);
        };
        forward().and_then(|out| {
            if (out.rows, out.cols) != (rows, vocab) {
                return Err(Error::InvalidArgument(format!("batched step returned [{}, {}]", out.rows, out.cols)));
            }
            self.rt.copy(logits.buf.ptr, out.buf.ptr, bytes)
        })?;
        let exec = capture.end()?;
        // Capturing records without running: run it once now.
        if let Err(e) = self.rt.launch_graph(exec) {
            self.rt.destroy_graph(exec);
            return Err(e);
        }
        let view = Self::view(&logits);
        let mut d = self.decode_state();
        let mut stale = Vec::new();
        if d.batches.len() >= RECORDED_BATCHES {
            stale.extend(d.batches.drain().filter_map(|(_, g)| g.exec));
        }
        d.batches.insert(key.to_vec(), RecordedBatch { exec: Some(exec), logits });
        stale.extend(d.outgrown());
        drop(d);
        for exec in stale {
            self.rt.destroy_graph(exec);
        }
        Ok(Some(view))
    }

    fn sequence_row(&self, row: usize) {
        self.decode_state().row = row;
    }

    fn recorded_output(&self, want: StepOutput, mask_changed: bool) -> Result<StepResult> {
        let d = self.decode_state();
        let g = d.graphs.get(d.last).and_then(Option::as_ref).ok_or_else(|| Error::Device("no recorded decode step".into()))?;
        match want {
            StepOutput::Logits => Ok(StepResult::Logits(self.to_host(&g.logits)?)),
            StepOutput::AllLogits | StepOutput::ArgmaxEach { .. } => Err(Error::Unsupported("every position's output from a recorded step".into())),
            StepOutput::Argmax { limit } => {
                if mask_changed {
                    // The recording chose under the previous mask: choose again (the logits adjusted already).
                    self.launch_argmax(&g.logits, 1, limit, 0, g.token.ptr)?;
                }
                Ok(StepResult::Token(self.download_token(g.token.ptr)?))
            }
            // Drawn after the replay, from the recorded step's logits (adjusted there).
            StepOutput::Draw { limit, temperature, u } => Ok(StepResult::Token(self.launch_draw(&g.logits, limit, temperature, u)?)),
            // Selected after the replay, from the recorded step's logits (adjusted there).
            StepOutput::TopK { k, limit, temperature, cut } => {
                let best = self.select_top_k(&g.logits, k, limit)?;
                super::candidates_result(self, &g.logits, best, limit, temperature, cut)
            }
        }
    }

    fn record_decode(
        &self,
        key: usize,
        token: u32,
        pos: usize,
        vocab: usize,
        want: StepOutput,
        step: &mut dyn FnMut() -> Result<GpuTensor>,
    ) -> Result<bool> {
        let old = self.decode_state().graphs.get_mut(key).and_then(Option::take).and_then(|g| g.exec);
        if let Some(exec) = old {
            self.rt.destroy_graph(exec);
        }
        // The outputs live outside the graph: it ends by copying the logits there and by taking
        // their argmax, so a replay hands back either.
        let logits_bytes = byte_size("decode logits", &[vocab, 4])?;
        let logits = GpuTensor { buf: DeviceBuffer::new(&self.rt, logits_bytes)?, rows: 1, cols: vocab };
        let token_out = DeviceBuffer::new(&self.rt, 4)?;
        let inputs = self.set_inputs(token, pos, want)?;
        self.start_arena(1)?;
        let Ok(capture) = Capture::begin(self) else { return Ok(false) };
        step().and_then(|out| {
            if (out.rows, out.cols) != (1, vocab) {
                return Err(Error::InvalidArgument(format!("decode step returned [{}, {}]", out.rows, out.cols)));
            }
            self.rt.copy(logits.buf.ptr, out.buf.ptr, logits_bytes)?;
            self.adjust_logits(&logits)?;
            self.launch_argmax(&logits, 1, vocab, inputs + 8, token_out.ptr)
        })?;
        let exec = capture.end()?;
        // Capturing records without running: run it once now.
        if let Err(e) = self.rt.launch_graph(exec) {
            self.rt.destroy_graph(exec);
            return Err(e);
        }
        let mut d = self.decode_state();
        if d.graphs.len() <= key {
            d.graphs.resize_with(key + 1, || None);
        }
        d.graphs[key] = Some(Recorded { exec: Some(exec), logits, token: token_out });
        d.last = key;
        let stale = d.outgrown();
        drop(d);
        for exec in stale {
            self.rt.destroy_graph(exec);
        }
        Ok(true)
    }
}

/// A recording in progress. Dropped without `end` (an error or a panic in the step), it stops the
/// capture and discards what was captured: left open, the capture would swallow the next request's
/// launches, and `recording` would point them at the recorded step's inputs.
struct Capture<'a> {
    backend: &'a GpuBackend,
    open: bool,
}

impl<'a> Capture<'a> {
    fn begin(backend: &'a GpuBackend) -> Result<Self> {
        backend.rt.begin_capture()?;
        backend.decode_state().recording = true;
        Ok(Capture { backend, open: true })
    }

    /// Stops the capture and returns the executable graph of what it recorded.
    fn end(mut self) -> Result<u64> {
        self.open = false;
        self.backend.stop_recording();
        self.backend.rt.end_capture()
    }
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        if self.open {
            self.backend.stop_recording();
            if let Ok(exec) = self.backend.rt.end_capture() {
                self.backend.rt.destroy_graph(exec);
            }
        }
    }
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        self.forget_recording();
    }
}
