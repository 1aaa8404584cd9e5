//! The GGUF container (v2 and v3, little-endian): header, metadata key/values, tensor table, and the
//! aligned data section, read over a memory map.
//!
//! Every count, length, offset and size read from the file is checked against the bytes that remain
//! (with checked arithmetic) before it is used, so a truncated or corrupt file gives an error naming
//! the file, the key or tensor, and the reason; nothing is allocated from a count the file cannot back,
//! and tables whose entries outgrow their encoding in memory are reserved fallibly.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant::{BlockBytes, BlockSource};
use crate::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are refused (real files use none; the bound keeps recursion shallow).
const MAX_ARRAY_DEPTH: usize = 8;
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// (type number, name, elements per block, bytes per block) of every ggml type a GGUF file may hold
/// (ggml's `ggml_type` enum; the gaps are retired types).
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
    // The ROCmFPX llama.cpp fork's ROCmFP4 types.
    (100, "Q4_0_ROCMFP4", 32, 18),
    (101, "Q4_0_ROCMFP4_FAST", 32, 17),
];

/// A ggml tensor type known to this reader (its size is known, even when Atlas cannot decode it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const BF16: GgmlType = GgmlType(30);

    /// `None` for a type number ggml does not define.
    pub fn from_u32(t: u32) -> Option<Self> {
        GGML_TYPES.iter().any(|e| e.0 == t).then_some(GgmlType(t))
    }

    fn entry(self) -> (u32, &'static str, u64, u64) {
        // Only constructed through from_u32 or the constants above, which are all in the table.
        GGML_TYPES.iter().copied().find(|e| e.0 == self.0).unwrap_or((self.0, "?", 1, 1))
    }

    pub fn id(self) -> u32 {
        self.0
    }

    pub fn name(self) -> &'static str {
        self.entry().1
    }

    pub fn block_size(self) -> u64 {
        self.entry().2
    }

    pub fn block_bytes(self) -> u64 {
        self.entry().3
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(MetaArray),
}

/// A metadata array, stored by element type (so a long array costs its elements, not an enum each).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    Array(Vec<MetaArray>),
}

impl MetaArray {
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as an integer, whatever the integer element type (`None` for floats, strings, ...).
    pub fn int_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            MetaArray::U8(v) => *v.get(i)? as i128,
            MetaArray::I8(v) => *v.get(i)? as i128,
            MetaArray::U16(v) => *v.get(i)? as i128,
            MetaArray::I16(v) => *v.get(i)? as i128,
            MetaArray::U32(v) => *v.get(i)? as i128,
            MetaArray::I32(v) => *v.get(i)? as i128,
            MetaArray::U64(v) => *v.get(i)? as i128,
            MetaArray::I64(v) => *v.get(i)? as i128,
            _ => return None,
        })
    }

    fn type_name(&self) -> &'static str {
        match self {
            MetaArray::U8(_) => "u8",
            MetaArray::I8(_) => "i8",
            MetaArray::U16(_) => "u16",
            MetaArray::I16(_) => "i16",
            MetaArray::U32(_) => "u32",
            MetaArray::I32(_) => "i32",
            MetaArray::F32(_) => "f32",
            MetaArray::Bool(_) => "bool",
            MetaArray::String(_) => "string",
            MetaArray::U64(_) => "u64",
            MetaArray::I64(_) => "i64",
            MetaArray::F64(_) => "f64",
            MetaArray::Array(_) => "array",
        }
    }
}

impl MetaValue {
    /// The value as an integer when it is one (of any width or signedness).
    pub fn as_int(&self) -> Option<i128> {
        Some(match self {
            MetaValue::U8(v) => *v as i128,
            MetaValue::I8(v) => *v as i128,
            MetaValue::U16(v) => *v as i128,
            MetaValue::I16(v) => *v as i128,
            MetaValue::U32(v) => *v as i128,
            MetaValue::I32(v) => *v as i128,
            MetaValue::U64(v) => *v as i128,
            MetaValue::I64(v) => *v as i128,
            _ => return None,
        })
    }

    /// A non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| u64::try_from(v).ok())
    }

    /// A float or an integer, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            MetaValue::F32(v) => Some(*v as f64),
            MetaValue::F64(v) => Some(*v),
            other => other.as_int().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            MetaValue::Bool(v) => Some(*v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            MetaValue::Array(MetaArray::String(v)) => Some(v),
            _ => None,
        }
    }

    /// The GGUF type name ("u32", "string", "array of string", ...), for error messages and listings.
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::U8(_) => "u8".into(),
            MetaValue::I8(_) => "i8".into(),
            MetaValue::U16(_) => "u16".into(),
            MetaValue::I16(_) => "i16".into(),
            MetaValue::U32(_) => "u32".into(),
            MetaValue::I32(_) => "i32".into(),
            MetaValue::F32(_) => "f32".into(),
            MetaValue::Bool(_) => "bool".into(),
            MetaValue::String(_) => "string".into(),
            MetaValue::U64(_) => "u64".into(),
            MetaValue::I64(_) => "i64".into(),
            MetaValue::F64(_) => "f64".into(),
            MetaValue::Array(a) => format!("array of {}", a.type_name()),
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's `ne`: innermost (fastest-moving) dimension first, so `dims[0]` is a matrix's columns.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// From the start of the data section, as stored.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
    /// Absolute byte range inside the file (checked to lie inside it).
    start: usize,
    end: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time not to overflow.
        self.dims.iter().product()
    }

    /// The shape in row-major (PyTorch / Hugging Face) order: `dims` reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

enum Backing {
    Mmap(Mmap),
    Bytes(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Bytes(b) => b,
        }
    }
}

impl AsRef<[u8]> for Backing {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl BlockSource for Backing {
    fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Backing::Mmap(m) = self {
            // SAFETY: the map is a read-only view of the file: pages dropped are read back from
            // the file on the next access, with the same bytes, so no reference into the map
            // sees a change. The advice only saves memory; its failure changes nothing.
            let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
        }
        // Elsewhere (Windows) no advice: the map's pages are clean copies of the file, which the
        // system trims from the working set by itself under memory pressure.
        #[cfg(not(unix))]
        let _ = range;
    }
}

/// A parsed GGUF file; tensor data stays in the map until asked for.
pub struct GgufFile {
    path: PathBuf,
    data: Arc<Backing>,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            return Err(Error::bad_file(path, "not a GGUF file: the file is empty"));
        }
        // SAFETY: the file is opened read-only; like every mmap-based loader we rely on nobody
        // truncating the model file while it is loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path.to_path_buf(), Backing::Mmap(mmap))
    }

    /// Parses a GGUF image held in memory; `path` is only used in messages.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(path.into(), Backing::Bytes(bytes))
    }

    fn parse(path: PathBuf, data: Backing) -> Result<Self> {
        let parsed = parse(data.bytes()).map_err(|reason| Error::bad_file(&path, reason))?;
        let Parsed { version, metadata, meta_index, tensors, tensor_index, alignment, data_start } = parsed;
        Ok(GgufFile { path, data: Arc::new(data), version, metadata, meta_index, tensors, tensor_index, alignment, data_start })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, or 32.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Every key/value, in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A string value; `Ok(None)` when absent, an error when present with another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetaValue::as_str)
    }

    /// A non-negative integer value (any integer type).
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", MetaValue::as_u64)
    }

    /// A number (float or integer) as f64.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", MetaValue::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", MetaValue::as_bool)
    }

    fn typed<'a, T>(&'a self, key: &str, what: &str, f: impl Fn(&'a MetaValue) -> Option<T>) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| {
                Error::bad_file(&self.path, format!("metadata {key} must be {what}, found {}", v.type_name()))
            }),
        }
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor of this file.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.data.bytes()[t.start..t.end]
    }

    /// Once a tensor's bytes have been copied: its pages of the mapping need not stay resident
    /// (a touch of a small tensor can map a whole huge page of its neighbours).
    pub fn release(&self, t: &TensorInfo) {
        self.data.release(t.start..t.end);
    }

    /// `bytes` (a slice of this file's data, as `tensor_data` gives) as blocks that share the
    /// file's mapping instead of copying it; None for bytes from elsewhere.
    pub fn share(&self, bytes: &[u8]) -> Option<BlockBytes> {
        let whole = self.data.bytes();
        let start = (bytes.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
        let range = start..start.checked_add(bytes.len())?;
        (range.end <= whole.len()).then(|| BlockBytes::Shared { source: self.data.clone(), range })
    }
}

struct Parsed {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

/// A bounds-checked little-endian reader; errors are plain reasons, given context by the caller.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> std::result::Result<&'a [u8], String> {
        let n_usize = usize::try_from(n).ok().filter(|&n| n <= self.remaining()).ok_or_else(|| {
            format!(
                "{what} needs {n} bytes at offset {} but the file has {} bytes (truncated?)",
                self.pos,
                self.buf.len()
            )
        })?;
        let out = &self.buf[self.pos..self.pos + n_usize];
        self.pos += n_usize;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// Checks that `count` items of at least `min_size` bytes each can still fit in the file.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> std::result::Result<usize, String> {
        let fits = count.checked_mul(min_size).is_some_and(|need| need <= self.remaining() as u64);
        if !fits {
            return Err(format!(
                "{what} claims {count} entries at offset {}, more than the {} bytes left in the file can hold",
                self.pos,
                self.remaining()
            ));
        }
        usize::try_from(count).map_err(|_| format!("{what}: count {count} does not fit in memory"))
    }
}

/// Room for `n` entries, each backed by at least one byte of the file (see `check_count`). An entry
/// in memory is several times its encoding, so a large enough file can still ask for more than the
/// process can get: that must be an error, as an allocation failure would abort the host process.
fn reserved<T>(n: usize, what: &str) -> std::result::Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| format!("{what}: not enough memory for {n} entries"))?;
    Ok(v)
}

/// [`reserved`] for an index by name.
fn reserved_index(n: usize, what: &str) -> std::result::Result<HashMap<String, usize>, String> {
    let mut m = HashMap::new();
    m.try_reserve(n).map_err(|_| format!("{what}: not enough memory for {n} entries"))?;
    Ok(m)
}

/// A name read from the file, made printable and short enough for an error message.
fn shown(name: &str) -> String {
    let escaped: String = name.escape_debug().collect();
    if escaped.chars().count() > 80 {
        format!("{}...", escaped.chars().take(80).collect::<String>())
    } else {
        escaped
    }
}

/// Smallest encoding of a value of GGUF type `t` (strings: the length; arrays: type + count).
fn min_value_size(t: u32) -> Option<u64> {
    Some(match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

fn read_value(c: &mut Cursor, t: u32, what: &str, depth: usize) -> std::result::Result<MetaValue, String> {
    Ok(match t {
        0 => MetaValue::U8(c.array::<1>(what)?[0]),
        1 => MetaValue::I8(c.array::<1>(what)?[0] as i8),
        2 => MetaValue::U16(u16::from_le_bytes(c.array(what)?)),
        3 => MetaValue::I16(i16::from_le_bytes(c.array(what)?)),
        4 => MetaValue::U32(c.u32(what)?),
        5 => MetaValue::I32(i32::from_le_bytes(c.array(what)?)),
        6 => MetaValue::F32(f32::from_le_bytes(c.array(what)?)),
        7 => MetaValue::Bool(c.array::<1>(what)?[0] != 0),
        8 => MetaValue::String(c.string(what)?),
        9 => MetaValue::Array(read_array(c, what, depth)?),
        10 => MetaValue::U64(c.u64(what)?),
        11 => MetaValue::I64(i64::from_le_bytes(c.array(what)?)),
        12 => MetaValue::F64(f64::from_le_bytes(c.array(what)?)),
        other => return Err(format!("{what} has unknown value type {other}")),
    })
}

fn read_array(c: &mut Cursor, what: &str, depth: usize) -> std::result::Result<MetaArray, String> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(format!("{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep"));
    }
    let elem = c.u32(what)?;
    let min = min_value_size(elem).ok_or_else(|| format!("{what} is an array of unknown value type {elem}"))?;
    let count = c.u64(what)?;
    let n = c.check_count(count, min, what)?;
    macro_rules! fixed {
        ($variant:ident, $ty:ty, $size:expr) => {{
            let bytes = c.take(n as u64 * $size, what)?;
            MetaArray::$variant(
                bytes.chunks_exact($size).map(|b| <$ty>::from_le_bytes(b.try_into().unwrap_or_default())).collect(),
            )
        }};
    }
    Ok(match elem {
        0 => MetaArray::U8(c.take(n as u64, what)?.to_vec()),
        1 => MetaArray::I8(c.take(n as u64, what)?.iter().map(|&b| b as i8).collect()),
        2 => fixed!(U16, u16, 2),
        3 => fixed!(I16, i16, 2),
        4 => fixed!(U32, u32, 4),
        5 => fixed!(I32, i32, 4),
        6 => fixed!(F32, f32, 4),
        7 => MetaArray::Bool(c.take(n as u64, what)?.iter().map(|&b| b != 0).collect()),
        10 => fixed!(U64, u64, 8),
        11 => fixed!(I64, i64, 8),
        12 => fixed!(F64, f64, 8),
        8 => {
            let mut v = reserved(n, what)?;
            for _ in 0..n {
                v.push(c.string(what)?);
            }
            MetaArray::String(v)
        }
        9 => {
            let mut v = reserved(n, what)?;
            for _ in 0..n {
                v.push(read_array(c, what, depth + 1)?);
            }
            MetaArray::Array(v)
        }
        _ => return Err(format!("{what} is an array of unknown value type {elem}")),
    })
}

fn parse(buf: &[u8]) -> std::result::Result<Parsed, String> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, "the GGUF magic").map_err(|_| "not a GGUF file: shorter than its magic".to_string())?;
    if magic != MAGIC {
        return Err(format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""));
    }
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (only versions 2 and 3)".into()),
        v if (1..=3).contains(&v.swap_bytes()) => {
            return Err("big-endian GGUF files are not supported".into());
        }
        v => return Err(format!("GGUF version {v} is not supported (only versions 2 and 3)")),
    }
    let tensor_count = c.u64("the tensor count")?;
    let kv_count = c.u64("the metadata count")?;

    // A key/value needs at least a key length (8), a type (4) and one byte of value.
    let n_kv = c.check_count(kv_count, 13, "the metadata table")?;
    let mut metadata = reserved(n_kv, "the metadata table")?;
    let mut meta_index = reserved_index(n_kv, "the metadata table")?;
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let what = format!("metadata {}", shown(&key));
        let t = c.u32(&what)?;
        let value = read_value(&mut c, t, &what, 0)?;
        if meta_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(format!("metadata key {} appears twice", shown(&key)));
        }
        metadata.push((key, value));
    }

    let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a,
            _ => return Err(format!("general.alignment {v:?} is not a power of two")),
        },
    };

    // A tensor entry needs at least a name length (8), a dim count (4), a type (4) and an offset (8).
    let n_tensors = c.check_count(tensor_count, 24, "the tensor table")?;
    let mut entries = reserved(n_tensors, "the tensor table")?;
    let mut tensor_index = reserved_index(n_tensors, "the tensor table")?;
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor #{i}"))?;
        let what = format!("tensor {}", shown(&name));
        let n_dims = c.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(format!("{what} has {n_dims} dimensions (at most {MAX_DIMS})"));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let type_id = c.u32(&what)?;
        let offset = c.u64(&what)?;
        let ggml_type = GgmlType::from_u32(type_id).ok_or_else(|| format!("{what} has unknown ggml type {type_id}"))?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("{what}: dimensions {dims:?} overflow"))?;
        let (bs, bb) = (ggml_type.block_size(), ggml_type.block_bytes());
        if dims.first().is_some_and(|&d0| d0 % bs != 0) {
            return Err(format!(
                "{what}: row length {} is not a multiple of the {} block size {bs}",
                dims[0],
                ggml_type.name()
            ));
        }
        let size = (n_elements / bs)
            .checked_mul(bb)
            .ok_or_else(|| format!("{what}: byte size of dimensions {dims:?} overflows"))?;
        if offset % alignment != 0 {
            return Err(format!("{what}: data offset {offset} is not a multiple of the alignment {alignment}"));
        }
        if tensor_index.insert(name.clone(), entries.len()).is_some() {
            return Err(format!("tensor {} appears twice", shown(&name)));
        }
        entries.push((name, dims, ggml_type, offset, size));
    }

    let header_end = c.pos as u64;
    let data_start = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| "the data section offset overflows".to_string())?;
    let file_len = buf.len() as u64;
    let mut tensors = reserved(entries.len(), "the tensor table")?;
    for (name, dims, ggml_type, offset, size) in entries {
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(size));
        let (start, end) = match (start, end) {
            (Some(s), Some(e)) if e <= file_len => (s as usize, e as usize),
            _ => {
                return Err(format!(
                    "tensor {}: its {size} bytes at data offset {offset} (file offset {data_start} + {offset}) \
                     run past the end of the file ({file_len} bytes; truncated?)",
                    shown(&name)
                ))
            }
        };
        tensors.push(TensorInfo { name, dims, ggml_type, offset, size, start, end });
    }
    Ok(Parsed { version, metadata, meta_index, tensors, tensor_index, alignment, data_start })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv_string(out: &mut Vec<u8>, key: &str, value: &str) {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend((value.len() as u64).to_le_bytes());
        out.extend(value.as_bytes());
    }

    fn tiny(version: u32) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        kv_string(&mut b, "general.architecture", "llama");
        // "xs": array of 3 u16
        b.extend(2u64.to_le_bytes());
        b.extend(b"xs");
        b.extend(9u32.to_le_bytes());
        b.extend(2u32.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        for v in [1u16, 2, 3] {
            b.extend(v.to_le_bytes());
        }
        // tensor "t": f32 [2, 3]
        b.extend(1u64.to_le_bytes());
        b.extend(b"t");
        b.extend(2u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(3u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        for i in 0..6 {
            b.extend((i as f32).to_le_bytes());
        }
        b
    }

    #[test]
    fn reads_a_small_file() {
        for version in [2, 3] {
            let f = GgufFile::from_bytes("tiny.gguf", tiny(version)).unwrap();
            assert_eq!(f.version(), version);
            assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
            assert_eq!(f.get("xs").and_then(MetaValue::as_array).map(MetaArray::len), Some(3));
            let t = f.tensor("t").unwrap();
            assert_eq!(t.shape(), vec![3, 2]);
            assert_eq!(f.tensor_data(t).len(), 24);
            assert_eq!(f.data_start() % 32, 0);
            assert!(f.get_u64("general.architecture").is_err());
        }
    }

    #[test]
    fn rejects_truncation_with_the_file_name() {
        let b = tiny(3);
        let err = GgufFile::from_bytes("cut.gguf", b[..b.len() - 1].to_vec()).unwrap_err().to_string();
        assert!(err.contains("cut.gguf") && err.contains("tensor t"), "{err}");
        for n in 0..b.len() - 1 {
            assert!(GgufFile::from_bytes("cut.gguf", b[..n].to_vec()).is_err(), "length {n}");
        }
    }

    #[test]
    fn rejects_huge_counts_without_allocating() {
        let mut b = tiny(3);
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = GgufFile::from_bytes("x.gguf", b).unwrap_err().to_string();
        assert!(err.contains("tensor table"), "{err}");
        let mut b = tiny(3);
        // the u16 array count
        let at = b.windows(2).position(|w| w == b"xs").unwrap() + 2 + 8;
        b[at..at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let err = GgufFile::from_bytes("x.gguf", b).unwrap_err().to_string();
        assert!(err.contains("metadata xs"), "{err}");
    }

    #[test]
    fn an_impossible_reservation_is_an_error() {
        let err = reserved::<(String, MetaValue)>(usize::MAX / 16, "the metadata table").unwrap_err();
        assert!(err.contains("the metadata table"), "{err}");
        assert!(reserved_index(usize::MAX / 16, "the tensor table").is_err());
    }

    #[test]
    fn names_unknown_tensor_types() {
        let mut b = tiny(3);
        let at = b.windows(1).rposition(|w| w == b"t").unwrap() + 1 + 4 + 16;
        b[at..at + 4].copy_from_slice(&4u32.to_le_bytes());
        let err = GgufFile::from_bytes("x.gguf", b).unwrap_err().to_string();
        assert!(err.contains("tensor t") && err.contains("unknown ggml type 4"), "{err}");
    }
}
