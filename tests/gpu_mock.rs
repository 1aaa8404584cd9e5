//! The real GPU backend over a mock runtime, so that it runs without a GPU. No kernel runs, but the
//! mock tracks every device allocation, records launches into graphs like a capturing stream, and
//! checks each KV-cache write (`qkv_rope_append`, `kv_append`, launched or replayed from a graph)
//! against the buffer it lands in. It can also panic inside a launch while capturing.

use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};

use atlas::backend::cpu::CpuBackend;
use atlas::backend::gpu::runtime::{Arg, Runtime};
use atlas::backend::gpu::GpuBackend;
use atlas::model::config::RopeScaling;
use atlas::backend::kv_pool::KV_BLOCK;
use atlas::backend::StepOutput;
use atlas::model::{Architecture, BatchRow, Bound, LanguageModel, ModelConfig, WeightSource};
use atlas::quant::synthetic::SyntheticMatrix;
use atlas::quant::{DType, QuantMatrix};
use atlas::{Error, Result};

const LAYERS: usize = 2;
/// Bytes of device memory whose contents the mock keeps: enough for the recorded decode steps'
/// inputs (tokens, positions and limit, room for 64 rows), which replays read.
const KEPT_BYTES: usize = 1024;

#[derive(Clone)]
struct Launch {
    kernel: String,
    grid: [u32; 3],
    args: Vec<Arg>,
}

struct Allocation {
    bytes: usize,
    live: bool,
    data: Option<Vec<u8>>,
}

#[derive(Default)]
struct State {
    next_address: u64,
    allocations: BTreeMap<u64, Allocation>,
    /// The launches queued since begin_capture; None while the stream is not capturing.
    capture: Option<Vec<Launch>>,
    graphs: HashMap<u64, Vec<Launch>>,
    next_graph: u64,
    graph_launches: usize,
    /// Every launch that ran, directly or from a graph.
    ran: Vec<Launch>,
    panic_while_capturing: Option<&'static str>,
    /// Out-of-bounds KV writes and double frees.
    violations: Vec<String>,
}

#[derive(Default)]
struct MockRuntime(Mutex<State>);

impl MockRuntime {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn ptr(arg: &Arg) -> u64 {
    match *arg {
        Arg::Ptr(p) => p,
        other => panic!("expected a pointer argument, got {other:?}"),
    }
}

fn int(arg: &Arg) -> i64 {
    match *arg {
        Arg::I32(v) => i64::from(v),
        other => panic!("expected an i32 argument, got {other:?}"),
    }
}

/// The cache rows a launch writes, from the kernels' signatures (kernels/norm.hip, attention.hip):
/// one entry per sequence whose cache it writes.
struct KvWrite {
    /// Used unless `position_ptr` points at the position on the device (a recorded step).
    position: i64,
    position_ptr: u64,
    rows: i64,
    keys: u64,
    values: u64,
    /// The sequence's block table: position p's row is in block table[p / KV_BLOCK].
    table: u64,
    width: i64,
}

impl KvWrite {
    fn of(launch: &Launch) -> Vec<KvWrite> {
        let a = &launch.args;
        let rows = i64::from(launch.grid[1]);
        match launch.kernel.as_str() {
            "qkv_rope_append" => {
                let Arg::KvRows(caches) = a[7] else { panic!("qkv_rope_append without its KvRows, got {:?}", a[7]) };
                let (position_ptr, width) = (ptr(&a[8]), int(&a[10]) * int(&a[11]));
                let count = i64::from(caches.count);
                assert!((1..=caches.keys.len() as i64).contains(&count) && count <= rows, "KvRows of {count} sequences for {rows} rows");
                (0..count as usize)
                    .map(|s| KvWrite {
                        position: i64::from(caches.pos[s]),
                        position_ptr: if position_ptr == 0 { 0 } else { position_ptr + 4 * s as u64 },
                        // The last sequence takes the rows left.
                        rows: if s as i64 == count - 1 { rows - s as i64 } else { 1 },
                        keys: caches.keys[s],
                        values: caches.values[s],
                        table: caches.tables[s],
                        width,
                    })
                    .collect()
            }
            "kv_append" => vec![KvWrite {
                position: int(&a[5]),
                position_ptr: ptr(&a[6]),
                rows,
                keys: ptr(&a[2]),
                values: ptr(&a[3]),
                table: ptr(&a[4]),
                width: int(&a[7]),
            }],
            _ => Vec::new(),
        }
    }
}

impl State {
    /// The allocation holding `address`: its base and record.
    fn allocation(&self, address: u64) -> Option<(u64, &Allocation)> {
        let (&base, a) = self.allocations.range(..=address).next_back()?;
        (address < base + a.bytes as u64).then_some((base, a))
    }

    fn read_i32(&self, address: u64) -> i64 {
        let (base, a) = self.allocation(address).expect("position read from unallocated memory");
        let data = a.data.as_ref().expect("position read from a buffer the mock does not keep");
        let at = (address - base) as usize;
        i64::from(i32::from_le_bytes(data[at..at + 4].try_into().unwrap()))
    }

    fn run(&mut self, launch: Launch) {
        for w in KvWrite::of(&launch) {
            let position = if w.position_ptr != 0 { self.read_i32(w.position_ptr) } else { w.position };
            for p in position..position + w.rows {
                let entry = w.table + 4 * (p as u64 / KV_BLOCK as u64);
                let table_size = self.allocations.get(&w.table).filter(|a| a.live).map_or(0, |a| a.bytes as u64);
                if p < 0 || entry + 4 > w.table + table_size {
                    self.violations.push(format!("{} writes position {p}, past its block table of {table_size} bytes", launch.kernel));
                    continue;
                }
                // Entries never written read as -1 (the mock's fill).
                let block = self.read_i32(entry);
                let (start, end) = (i128::from((block * KV_BLOCK as i64 + p % KV_BLOCK as i64) * w.width * 2), 0);
                let end = end + start + i128::from(w.width * 2);
                for buffer in [w.keys, w.values] {
                    let size = self.allocations.get(&buffer).filter(|a| a.live).map_or(0, |a| a.bytes as i128);
                    if block < 0 || end > size {
                        self.violations.push(format!(
                            "{} writes bytes {start}..{end} (position {p}, block {block}) of a {size}-byte pool",
                            launch.kernel
                        ));
                    }
                }
            }
        }
        self.ran.push(launch);
    }
}

impl Runtime for MockRuntime {
    fn describe(&self) -> String {
        "mock".into()
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let mut s = self.state();
        // Gaps between allocations, so that a write past one lands in none.
        let base = 0x1000_0000 + s.next_address;
        s.next_address += (bytes as u64).next_multiple_of(256) + 256;
        // Not zeros: a block table's entry read before it is written is then -1, no block.
        let data = (bytes <= KEPT_BYTES).then(|| vec![0xff; bytes]);
        s.allocations.insert(base, Allocation { bytes, live: true, data });
        Ok(base)
    }

    fn free(&self, ptr: u64) {
        let mut s = self.state();
        match s.allocations.get_mut(&ptr) {
            Some(a) if a.live => a.live = false,
            _ => s.violations.push(format!("free of {ptr:#x}, which is not a live allocation")),
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        let mut s = self.state();
        let (base, a) = s.allocation(dst).expect("upload to unallocated memory");
        let at = (dst - base) as usize;
        assert!(at + src.len() <= a.bytes, "upload of {} bytes past the end of a {}-byte buffer", src.len(), a.bytes);
        if let Some(data) = s.allocations.get_mut(&base).and_then(|a| a.data.as_mut()) {
            data[at..at + src.len()].copy_from_slice(src);
        }
        Ok(())
    }

    fn download(&self, _src: u64, dst: &mut [u8]) -> Result<()> {
        dst.fill(0);
        Ok(())
    }

    fn copy(&self, _dst: u64, _src: u64, _bytes: usize) -> Result<()> {
        Ok(())
    }

    fn launch(&self, kernel: &str, grid: [u32; 3], _block: [u32; 3], _shared: u32, args: &[Arg]) -> Result<()> {
        let mut s = self.state();
        if s.capture.is_some() && s.panic_while_capturing == Some(kernel) {
            s.panic_while_capturing = None;
            drop(s);
            panic!("simulated bug while recording {kernel}");
        }
        let launch = Launch { kernel: kernel.into(), grid, args: args.to_vec() };
        match s.capture.as_mut() {
            Some(captured) => captured.push(launch),
            None => s.run(launch),
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn begin_capture(&self) -> Result<()> {
        let mut s = self.state();
        if s.capture.is_some() {
            return Err(Error::Device("the stream is already capturing".into()));
        }
        s.capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<u64> {
        let mut s = self.state();
        let launches = s.capture.take().ok_or_else(|| Error::Device("the stream is not capturing".into()))?;
        s.next_graph += 1;
        let graph = s.next_graph;
        s.graphs.insert(graph, launches);
        Ok(graph)
    }

    fn launch_graph(&self, graph: u64) -> Result<()> {
        let mut s = self.state();
        let launches = s.graphs.get(&graph).cloned().ok_or_else(|| Error::Device(format!("no graph {graph}")))?;
        s.graph_launches += 1;
        for launch in launches {
            s.run(launch);
        }
        Ok(())
    }

    fn destroy_graph(&self, graph: u64) {
        self.state().graphs.remove(&graph);
    }
}

/// Weights of any shape, made on the device from a seed (no host copies).
struct Synthetic;

impl WeightSource for Synthetic {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        Ok(Box::new(SyntheticMatrix::new(rows, cols, name.len() as u64, 0.1, DType::BF16)))
    }

    fn vector(&self, _name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(vec![1.0; len])
    }

    fn contains(&self, name: &str) -> bool {
        name != "lm_head.weight"
    }

    fn tensor_count(&self) -> usize {
        3 + 11 * LAYERS
    }
}

/// A tiny Qwen3: KV rows of 2 heads x 16 values.
fn config(max_positions: usize) -> ModelConfig {
    ModelConfig {
        arch: Architecture::Qwen3,
        vocab_size: 300,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: LAYERS,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        max_position_embeddings: max_positions,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: true,
        attention_bias: false,
        mlp_bias: false,
        qk_norm: true,
        rotary_dim: 16,
        moe: None,
        hybrid: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

fn load(mock: &Arc<MockRuntime>, ctx_size: usize) -> Result<Bound<GpuBackend>> {
    let backend = GpuBackend::new(mock.clone());
    Bound::load(backend, config(1024), &Synthetic, ctx_size, &mut |_| {})
}

#[test]
fn decode_stays_inside_the_kv_cache_and_refuses_steps_past_it() {
    let mock = Arc::new(MockRuntime::default());
    let ctx = 32;
    let mut model = load(&mock, ctx).unwrap();
    model.forward_greedy(&[1, 2, 3, 4, 5, 6, 7, 8], 0, usize::MAX).unwrap();
    for pos in 8..ctx {
        model.forward_greedy(&[1], pos, usize::MAX).unwrap();
    }
    assert!(mock.state().graph_launches >= ctx - 9, "the decode steps were not replayed from a graph");
    for (tokens, start) in [(&[1u32][..], ctx), (&[1, 2][..], ctx - 1), (&[1][..], usize::MAX)] {
        match model.forward_greedy(tokens, start, usize::MAX) {
            Err(Error::ContextOverflow(msg)) => assert!(msg.contains(&format!("{ctx}")), "{msg}"),
            Err(e) => panic!("{} tokens at {start}: expected a context overflow, got {e}", tokens.len()),
            Ok(_) => panic!("{} tokens at {start} ran past a context of {ctx}", tokens.len()),
        }
    }
    assert_eq!(mock.state().violations, Vec::<String>::new());
}

#[test]
fn batched_steps_write_each_sequence_into_its_own_cache() {
    let mock = Arc::new(MockRuntime::default());
    let ctx = 32;
    let mut model = load(&mock, ctx).unwrap();
    model.set_slots(3).unwrap();
    // The load's pool holds one whole context; the three sequences share one of three.
    let usage = model.kv_usage().unwrap();
    model.set_kv_cache_bytes(3 * usage.blocks * usage.block_bytes).unwrap();
    // Prompts of different lengths, so that the sequences decode at different positions.
    let lengths = [3usize, 7, 12];
    for (slot, &len) in lengths.iter().enumerate() {
        model.select(slot).unwrap();
        model.forward_greedy(&vec![1; len], 0, usize::MAX).unwrap();
    }
    let before = mock.state().ran.len();
    for step in 0..ctx - 12 {
        let rows: Vec<BatchRow> = lengths
            .iter()
            .enumerate()
            .map(|(slot, &len)| BatchRow { slot, token: 1, pos: len + step, want: StepOutput::Argmax { limit: usize::MAX } })
            .collect();
        assert_eq!(model.step_batch(&rows).unwrap().len(), 3);
    }
    let s = mock.state();
    // One append per layer a batched step, for the three sequences, each inside its own cache
    // (steps the model chose to run one by one, as it may when they measure cheaper, append one).
    let appends: Vec<&Launch> = s.ran[before..].iter().filter(|l| l.kernel == "qkv_rope_append" && l.grid[1] > 1).collect();
    assert!(!appends.is_empty(), "no batched step ran");
    for launch in &appends {
        let Arg::KvRows(caches) = launch.args[7] else { panic!("no KvRows") };
        assert_eq!((caches.count, launch.grid[1]), (3, 3), "a batched step split its sequences");
        assert!(caches.tables[..3].iter().all(|&t| t != 0) && caches.tables[0] != caches.tables[1] && caches.tables[1] != caches.tables[2]);
    }
    assert_eq!(s.violations, Vec::<String>::new());
}

#[test]
fn the_cpu_backend_refuses_steps_past_the_context_too() {
    let backend = CpuBackend::new(1).unwrap();
    let mut model = Bound::load(backend, config(1024), &Synthetic, 16, &mut |_| {}).unwrap();
    model.forward(&[1; 16], 0).unwrap();
    assert!(matches!(model.forward(&[1], 16), Err(Error::ContextOverflow(_))));
}

#[test]
fn an_absurd_context_is_refused_at_load() {
    // 2^62 positions x 32 values x 2 bytes wraps a 64-bit size (to zero); 2^31 positions do not
    // fit the kernels' 32-bit positions.
    for ctx in [1usize << 62, 1 << 31] {
        let mock = Arc::new(MockRuntime::default());
        match load(&mock, ctx) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains(&ctx.to_string()), "{msg}"),
            Err(e) => panic!("context {ctx}: expected an invalid argument, got {e}"),
            Ok(_) => panic!("a KV cache of {ctx} positions was made"),
        }
    }
}

#[test]
fn a_panic_while_recording_ends_the_capture() {
    let mock = Arc::new(MockRuntime::default());
    let mut model = load(&mock, 64).unwrap();
    model.forward_greedy(&[1, 2, 3], 0, usize::MAX).unwrap();
    mock.state().panic_while_capturing = Some("attention_decode");
    let step = catch_unwind(AssertUnwindSafe(|| model.forward_greedy(&[4], 3, usize::MAX)));
    assert!(step.is_err(), "the recorded step did not panic");
    {
        let s = mock.state();
        assert!(s.capture.is_none(), "the stream is still capturing");
        assert!(s.graphs.is_empty(), "the abandoned recording was not destroyed");
    }

    // The next request starts with a prompt: it runs now, with positions from its arguments.
    let before = mock.state().ran.len();
    model.forward_greedy(&[1, 2, 3], 0, usize::MAX).unwrap();
    {
        let s = mock.state();
        let appends: Vec<&Launch> = s.ran[before..].iter().filter(|l| l.kernel == "qkv_rope_append").collect();
        assert_eq!(appends.len(), LAYERS, "the prompt's launches did not run");
        assert!(appends.iter().all(|l| ptr(&l.args[8]) == 0), "the prompt read its position from the recording's inputs");
    }
    // And decoding records afresh (one run of the new graph) and replays it.
    model.forward_greedy(&[4], 3, usize::MAX).unwrap();
    model.forward_greedy(&[5], 4, usize::MAX).unwrap();
    let s = mock.state();
    assert_eq!(s.graph_launches, 2);
    assert_eq!(s.violations, Vec::<String>::new());
}
