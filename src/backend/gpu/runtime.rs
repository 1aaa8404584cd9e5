//! The small runtime interface the GPU backend needs from a vendor: memory, copies, kernel
//! launches on one in-order stream. CUDA (cudarc) and HIP (libloading) implement it; everything
//! above it is vendor-neutral.

use std::path::{Path, PathBuf};

use crate::Result;

/// One kernel argument, passed by value.
// A launch's dozen arguments live on the stack for its duration: boxing the one large variant
// would allocate at every launch of the decode step instead.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    KvRows(KvRows),
    DnStates(DnStates),
}

/// Sequences a decode-shaped step's rows belong to, as kernels/common/kv_rows.h's struct of the
/// same name (which the kernels take by value): each sequence's key and value pool, block table
/// and first row's position; row t belongs to sequence min(t, count - 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvRows {
    pub keys: [u64; KV_ROWS],
    pub values: [u64; KV_ROWS],
    pub tables: [u64; KV_ROWS],
    pub pos: [i32; KV_ROWS],
    pub count: i32,
}

/// KV_ROWS in kernels/common/kv_rows.h.
pub const KV_ROWS: usize = 8;

impl KvRows {
    /// Appends the C struct's words: the pointers, then the positions and the count two to a word
    /// (its size, 232 bytes, is a whole number of words: the count's word ends in padding).
    fn push_words(&self, words: &mut Vec<u64>) {
        let mut ints = [0i32; KV_ROWS + 2];
        ints[..KV_ROWS].copy_from_slice(&self.pos);
        ints[KV_ROWS] = self.count;
        words.extend(self.keys.iter().chain(&self.values).chain(&self.tables));
        words.extend(ints.chunks_exact(2).map(|p| u64::from(p[0] as u32) | u64::from(p[1] as u32) << 32));
    }
}

/// The recurrent states of the sequences of a batched decode step, as kernels/delta_net.hip's
/// struct of the same name: each sequence's conv1d state, then its delta-rule state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DnStates {
    pub conv: [u64; DN_SEQS],
    pub delta: [u64; DN_SEQS],
}

/// DN_SEQS in kernels/delta_net.hip: sequences a launch of its _rows kernels takes.
pub const DN_SEQS: usize = 8;

/// The arguments as the launch APIs want them, one pointer per parameter to its bytes: a scalar
/// in an 8-byte word (the runtime copies as many bytes as the kernel's parameter has, so 4-byte
/// ones read the low half, little-endian), a `KvRows` or `DnStates` in as many words as its struct.
pub struct ArgWords {
    words: Vec<u64>,
    starts: Vec<usize>,
}

impl ArgWords {
    pub fn new(args: &[Arg]) -> Self {
        let mut words = Vec::with_capacity(args.len());
        let mut starts = Vec::with_capacity(args.len());
        for a in args {
            starts.push(words.len());
            match *a {
                Arg::Ptr(p) | Arg::U64(p) => words.push(p),
                Arg::I64(v) => words.push(v as u64),
                Arg::I32(v) => words.push(u64::from(v as u32)),
                Arg::F32(v) => words.push(u64::from(v.to_bits())),
                Arg::KvRows(ref rows) => rows.push_words(&mut words),
                Arg::DnStates(ref states) => words.extend(states.conv.iter().chain(&states.delta)),
            }
        }
        ArgWords { words, starts }
    }

    /// One pointer per parameter into `self`, which must stay in place until the launch returns.
    pub fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        let base = self.words.as_mut_ptr();
        self.starts.iter().map(|&i| base.wrapping_add(i).cast()).collect()
    }
}

/// Bytes after a cached code object: its length and FNV-1a hash, little-endian u64s, so that a
/// truncated, damaged or foreign file is compiled afresh instead of handed to the driver. The hash
/// finds damage, not an attacker (who could write the trailer too): what keeps others' code out is
/// that only the user can write the cache directory (`untrusted_cache_dir`).
const CACHE_TRAILER: usize = 16;

/// Keeps a compiled code object for next time, with the trailer `load_from_cache` checks. The
/// cache is an optimisation: a read-only home directory just means compiling again next time.
/// Missing directories are made 0700 (Unix); the file is written 0600.
pub fn store_in_cache(path: &Path, code: &[u8]) {
    if path.parent().is_some_and(|dir| crate::cache::create_private_dir(dir).is_err()) {
        return;
    }
    let mut file = code.to_vec();
    file.extend_from_slice(&(code.len() as u64).to_le_bytes());
    file.extend_from_slice(&fnv1a(&[code]).to_le_bytes());
    // Written aside and renamed, so that another process never reads a half-written file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = options.open(&tmp).and_then(|mut f| std::io::Write::write_all(&mut f, &file));
    if written.is_err() || std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// The code object `store_in_cache` kept at `path`, if the file is whole: an ELF image (CUBIN and
/// AMD code objects both are) of the length and hash its trailer records, in a file only this user
/// can write (Unix).
pub fn load_from_cache(path: &Path) -> Option<Vec<u8>> {
    if untrusted(path, false).is_some() {
        return None;
    }
    let mut file = std::fs::read(path).ok()?;
    let len = file.len().checked_sub(CACHE_TRAILER)?;
    let (code, trailer) = file.split_at(len);
    let (stored_len, stored_hash) = trailer.split_at(8);
    let whole = stored_len == (len as u64).to_le_bytes()
        && stored_hash == fnv1a(&[code]).to_le_bytes()
        && code.starts_with(b"\x7fELF");
    whole.then(|| {
        file.truncate(len);
        file
    })
}

/// Why the kernel cache directory `dir` may not be used, or None when it may: on Unix it must be a
/// directory owned by this user that neither its group nor others can write, since whoever can
/// write there chooses the code that runs on the GPU. On Windows the cache lives in the user's own
/// %LOCALAPPDATA% and is not checked here.
pub fn untrusted_cache_dir(dir: &Path) -> Option<String> {
    untrusted(dir, true)
}

#[cfg(unix)]
fn untrusted(path: &Path, dir: bool) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) => return Some(format!("{}: {e}", path.display())),
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if (dir && !meta.is_dir()) || (!dir && !meta.is_file()) {
        Some(format!("{} is not a {}", path.display(), if dir { "directory" } else { "file" }))
    } else if meta.uid() != me {
        Some(format!("{} is owned by uid {}, not this user (uid {me})", path.display(), meta.uid()))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!("{} is writable by its group or others (mode {:o})", path.display(), meta.mode() & 0o7777))
    } else {
        None
    }
}

#[cfg(not(unix))]
fn untrusted(path: &Path, dir: bool) -> Option<String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() == dir => None,
        Ok(_) => Some(format!("{} is not a {}", path.display(), if dir { "directory" } else { "file" })),
        Err(e) => Some(format!("{}: {e}", path.display())),
    }
}

/// Loads the kernels' code object with `load`: the one cached at `path` when it is whole and the
/// driver accepts it, otherwise one made by `compile`, which then replaces the cached file (a
/// cached file can pass the check and still be refused, e.g. when another driver produced it).
/// Returns the loaded module and where its code came from, for load reports. A relative `path`
/// (no cache directory, see `kernel_cache_dir`), or one in a directory others can write
/// (`untrusted_cache_dir`), is never read or written: compiled every time.
pub fn load_kernels<M>(
    path: &Path,
    compile: impl FnOnce() -> Result<Vec<u8>>,
    mut load: impl FnMut(&[u8]) -> Result<M>,
) -> Result<(M, &'static str)> {
    if !path.is_absolute() {
        return Ok((load(&compile()?)?, "compiled, not cached"));
    }
    if let Some(dir) = path.parent() {
        let _ = crate::cache::create_private_dir(dir);
        if untrusted_cache_dir(dir).is_some() {
            return Ok((load(&compile()?)?, NOT_PRIVATE));
        }
    }
    let (refused, damaged) = match load_from_cache(path) {
        Some(code) => match load(&code) {
            Ok(module) => return Ok((module, "cached")),
            Err(_) => (true, false),
        },
        None => (false, std::fs::symlink_metadata(path).is_ok()),
    };
    let code = compile()?;
    let module = load(&code)?;
    store_in_cache(path, &code);
    let state = match (refused, damaged) {
        (true, _) => "recompiled",
        (_, true) => "recompiled: the cached file failed its check",
        _ => "compiled",
    };
    Ok((module, state))
}

/// The load report's note when the cache directory is refused (`untrusted_cache_dir` says why).
pub const NOT_PRIVATE: &str =
    "compiled, not cached: the kernel cache directory is missing, not owned by this user or writable by others";

pub trait Runtime: Send + Sync {
    /// Device name, architecture and kernel-cache state, for load reports.
    fn describe(&self) -> String;
    /// Lanes per warp (wavefront): 32 on NVIDIA and RDNA, 64 on CDNA. Launch shapes depend on it.
    fn warp_size(&self) -> u32 {
        32
    }
    /// Shared memory one block may use, static and dynamic together (launches may ask for up to
    /// this much dynamic shared memory, less the kernel's static arrays).
    fn max_shared_bytes(&self) -> u32 {
        48 * 1024
    }
    /// True where the bf16 one-token kernels have a matrix-core form (NVIDIA sm_80+: kernels/linear.hip's
    /// `gemv1_*_bf16_mma`, launched as the FP8 ones are).
    fn bf16_gemv_on_matrix_cores(&self) -> bool {
        false
    }
    /// True where kernels/common/portable.h's async_copy is cp.async (NVIDIA sm_80+): the FP8
    /// one-token kernels then stream their weights through shared memory (`Fp8Async` in
    /// kernels/linear.hip), which their launches must make room for.
    fn has_async_copy(&self) -> bool {
        false
    }
    /// Multiprocessors (compute units) of the device; 0 where unknown. Launch shapes that depend on
    /// how a grid fills the device in waves use it.
    fn multiprocessors(&self) -> u32 {
        0
    }
    /// True where the kernels were compiled with Hopper's wgmma (NVIDIA sm_90a): the `gemm_wg_*`
    /// kernels exist (kernels/gemm.hip).
    fn has_wgmma(&self) -> bool {
        false
    }
    /// Bytes of device memory free now, where the runtime can tell.
    fn free_memory(&self) -> Option<usize> {
        None
    }
    /// Device memory, ordered on the stream (valid for work queued after this call).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Frees after the work queued so far.
    fn free(&self, ptr: u64);
    /// Host to device; returns once `src` may be reused.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Device to host after all queued work.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<()>;
    /// As `launch`, for a kernel that calls `pdl_wait()` (common/portable.h) before it touches
    /// memory the previous kernel writes or reads: where the vendor allows, it starts while the
    /// previous kernel still runs (its blocks prefetch weights meanwhile).
    fn launch_early(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<()> {
        self.launch(kernel, grid, block, shared_bytes, args)
    }
    fn synchronize(&self) -> Result<()>;

    /// Starts recording the stream's work into a graph instead of running it.
    fn begin_capture(&self) -> Result<()> {
        Err(crate::Error::Unsupported("graph capture on this runtime".into()))
    }
    /// Ends the recording; returns an executable graph handle.
    fn end_capture(&self) -> Result<u64> {
        Err(crate::Error::Unsupported("graph capture on this runtime".into()))
    }
    fn launch_graph(&self, _graph: u64) -> Result<()> {
        Err(crate::Error::Unsupported("graph capture on this runtime".into()))
    }
    fn destroy_graph(&self, _graph: u64) {}
}

/// The kernel sources as one translation unit: the common headers first, then every op file, with
/// the `#include "common/..."` lines removed (the run-time compilers get no include path).
pub fn kernel_source() -> String {
    const HEADERS: [&str; 6] = [
        include_str!("../../../kernels/common/portable.h"),
        include_str!("../../../kernels/common/mma.h"),
        include_str!("../../../kernels/common/fp8.h"),
        include_str!("../../../kernels/common/packed.h"),
        include_str!("../../../kernels/common/wgmma.h"),
        include_str!("../../../kernels/common/kv_rows.h"),
    ];
    const FILES: [&str; 10] = [
        include_str!("../../../kernels/elementwise.hip"),
        include_str!("../../../kernels/norm.hip"),
        include_str!("../../../kernels/rope.hip"),
        include_str!("../../../kernels/linear.hip"),
        include_str!("../../../kernels/gemm.hip"),
        include_str!("../../../kernels/attention.hip"),
        include_str!("../../../kernels/flash_attention.hip"),
        include_str!("../../../kernels/sampling.hip"),
        include_str!("../../../kernels/moe.hip"),
        include_str!("../../../kernels/delta_net.hip"),
    ];
    let strip = |text: &str| -> String {
        text.lines().filter(|l| !l.starts_with("#include \"")).collect::<Vec<_>>().join("\n")
    };
    let mut src = String::new();
    for f in HEADERS.iter().chain(FILES.iter()) {
        src.push_str(&strip(f));
        src.push('\n');
    }
    src
}

/// FNV-1a, 64 bits: the kernel cache key (source + architecture + options).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are kept: `kernels` in `cache::cache_dir()` (`~/.cache/atlas/kernels`,
/// `%LOCALAPPDATA%\atlas\kernels`), or an empty path, which `load_kernels` never caches into,
/// when there is no cache directory: never the host's current directory.
pub fn kernel_cache_dir() -> PathBuf {
    crate::cache::cache_dir().map(|dir| dir.join("kernels")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `KvRows` takes the bytes of kernels/common/kv_rows.h's struct: 8 key pointers at 0, 8
    /// value pointers at 64, 8 block tables at 128, 8 positions at 192, the count at 224, 232
    /// bytes in all; the parameters around it keep one word each.
    #[test]
    fn kv_rows_are_laid_out_as_the_kernels_struct() {
        let rows = KvRows {
            keys: std::array::from_fn(|i| 0x1000 + i as u64),
            values: std::array::from_fn(|i| 0x2000 + i as u64),
            tables: std::array::from_fn(|i| 0x3000 + i as u64),
            pos: std::array::from_fn(|i| 10 * i as i32 - 1),
            count: 5,
        };
        let mut words = ArgWords::new(&[Arg::I32(-2), Arg::KvRows(rows), Arg::F32(1.5)]);
        assert_eq!(words.words.len(), 1 + 29 + 1);
        assert_eq!(words.starts, [0, 1, 30]);
        let bytes: Vec<u8> = words.words[1..30].iter().flat_map(|w| w.to_le_bytes()).collect();
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let int = |at: usize| i32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        assert_eq!((word(0), word(56), word(64), word(120)), (0x1000, 0x1007, 0x2000, 0x2007));
        assert_eq!((word(128), word(184)), (0x3000, 0x3007));
        assert_eq!((int(192), int(196), int(220), int(224)), (-1, 9, 69, 5));
        assert_eq!(words.words[0] as u32 as i32, -2);
        assert_eq!(f32::from_bits(words.words[30] as u32), 1.5);
        let pointers = words.pointers();
        assert_eq!(pointers[1] as usize - pointers[0] as usize, 8);
        assert_eq!(pointers[2] as usize - pointers[1] as usize, 29 * 8);
    }

    /// A `DnStates` takes the bytes of kernels/delta_net.hip's struct: 8 conv-state pointers,
    /// then 8 delta-rule-state pointers, 128 bytes.
    #[test]
    fn dn_states_are_laid_out_as_the_kernels_struct() {
        let states = DnStates { conv: std::array::from_fn(|i| 0x1000 + i as u64), delta: std::array::from_fn(|i| 0x2000 + i as u64) };
        let words = ArgWords::new(&[Arg::DnStates(states), Arg::I32(7)]);
        assert_eq!(words.starts, [0, 2 * DN_SEQS]);
        assert_eq!((words.words[0], words.words[7], words.words[8], words.words[15]), (0x1000, 0x1007, 0x2000, 0x2007));
    }

    /// Without a cache directory, compiled kernels are not cached, least of all relative to the
    /// current directory.
    #[test]
    fn kernels_are_never_cached_at_a_relative_path() {
        let path = kernel_cache_dir().join("atlas-relative-cache-test.bin");
        assert!(path.is_absolute() || path == Path::new("atlas-relative-cache-test.bin"), "{}", path.display());
        let relative = Path::new("atlas-relative-cache-test.bin");
        let code = b"\x7fELF and more".to_vec();
        let (loaded, state) = load_kernels(relative, || Ok(code.clone()), |c| Ok(c.to_vec())).unwrap();
        assert_eq!((loaded, state), (code, "compiled, not cached"));
        assert!(!relative.exists());
    }

    #[test]
    fn the_kernel_cache_hands_back_only_whole_code_objects() {
        let dir = std::env::temp_dir().join(format!("atlas-kernel-cache-{}", std::process::id()));
        let path = dir.join("kernels.bin");
        let code: Vec<u8> = b"\x7fELF".iter().copied().chain((0..1000u32).map(|i| (i * 7) as u8)).collect();

        store_in_cache(&path, &code);
        assert_eq!(load_from_cache(&path).as_deref(), Some(&code[..]));
        let whole = std::fs::read(&path).unwrap();

        let mut flipped = whole.clone();
        flipped[100] ^= 1;
        let damaged: [(&str, &[u8]); 5] = [
            ("empty", &[]),
            ("trailer only", &whole[code.len()..]),
            ("truncated", &whole[..whole.len() - 1]),
            ("without its trailer", &code),
            ("with a flipped byte", &flipped),
        ];
        for (what, bytes) in damaged {
            std::fs::write(&path, bytes).unwrap();
            assert_eq!(load_from_cache(&path), None, "{what}");
        }

        store_in_cache(&path, b"not an ELF image");
        assert_eq!(load_from_cache(&path), None, "not ELF");
        assert_eq!(load_from_cache(&dir.join("missing")), None, "missing");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kernels_are_compiled_again_when_the_driver_refuses_the_cached_ones() {
        let dir = std::env::temp_dir().join(format!("atlas-kernel-load-{}", std::process::id()));
        let path = dir.join("kernels.bin");
        let ours = b"\x7fELF ours".to_vec();
        let foreign = b"\x7fELF from another driver".to_vec();
        let compiles = std::cell::Cell::new(0);
        let compile = |code: &[u8]| {
            let code = code.to_vec();
            let compiles = &compiles;
            move || {
                compiles.set(compiles.get() + 1);
                Ok(code)
            }
        };
        // The "driver" accepts only `ours`.
        let load = |code: &[u8]| if code == ours.as_slice() { Ok(code.len()) } else { Err(crate::Error::Device("refused".into())) };

        // Nothing cached: compiled, loaded, kept.
        assert_eq!(load_kernels(&path, compile(&ours), load).unwrap(), (ours.len(), "compiled"));
        assert_eq!(load_from_cache(&path).as_deref(), Some(&ours[..]));
        // Cached and accepted: not compiled.
        assert_eq!(load_kernels(&path, compile(&ours), load).unwrap(), (ours.len(), "cached"));
        assert_eq!(compiles.get(), 1);

        // A whole file the driver refuses: compiled again, and the cached file replaced.
        store_in_cache(&path, &foreign);
        assert_eq!(load_kernels(&path, compile(&ours), load).unwrap(), (ours.len(), "recompiled"));
        assert_eq!(compiles.get(), 2);
        assert_eq!(load_from_cache(&path).as_deref(), Some(&ours[..]));

        // Fresh code the driver refuses too: its error, and nothing cached.
        let _ = std::fs::remove_file(&path);
        assert!(matches!(load_kernels(&path, compile(&foreign), load), Err(crate::Error::Device(m)) if m == "refused"));
        assert_eq!(load_from_cache(&path), None);
        // A failing compile is the error.
        store_in_cache(&path, &foreign);
        let failed = load_kernels(&path, || Err(crate::Error::Device("nvrtc".into())), load);
        assert!(matches!(failed, Err(crate::Error::Device(m)) if m == "nvrtc"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A cached file whose code was changed but whose trailer was kept is refused, compiled again
    /// and replaced: the driver never sees it.
    #[test]
    fn a_tampered_cache_file_is_refused_and_recompiled() {
        let dir = std::env::temp_dir().join(format!("atlas-kernel-tamper-{}", std::process::id()));
        let path = dir.join("kernels.bin");
        let ours: Vec<u8> = b"\x7fELF".iter().copied().chain((0..4096u32).map(|i| (i * 13) as u8)).collect();
        store_in_cache(&path, &ours);
        let mut file = std::fs::read(&path).unwrap();
        file[200] ^= 0x55; // the code, not the trailer
        std::fs::write(&path, &file).unwrap();
        assert_eq!(load_from_cache(&path), None);

        let compiles = std::cell::Cell::new(0);
        let loaded = std::cell::RefCell::new(Vec::new());
        let (module, state) = load_kernels(
            &path,
            || {
                compiles.set(compiles.get() + 1);
                Ok(ours.clone())
            },
            |code| {
                loaded.borrow_mut().push(code.to_vec());
                Ok(code.len())
            },
        )
        .unwrap();
        assert_eq!((module, state, compiles.get()), (ours.len(), "recompiled: the cached file failed its check", 1));
        assert_eq!(*loaded.borrow(), vec![ours.clone()], "only the compiled code reached the driver");
        assert_eq!(load_from_cache(&path).as_deref(), Some(&ours[..]), "the cached file was replaced");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The cache directory is made 0700 and its files 0600; a directory (or file) its group or
    /// others can write is refused: compiled every time, nothing read or written there.
    #[cfg(unix)]
    #[test]
    fn the_kernel_cache_is_private_or_unused() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let root = std::env::temp_dir().join(format!("atlas-kernel-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (cache, kernels) = (root.join("atlas"), root.join("atlas").join("kernels"));
        let path = kernels.join("kernels.bin");
        let code = b"\x7fELF private".to_vec();
        let compile = || -> Result<Vec<u8>> { Ok(code.clone()) };
        let load = |c: &[u8]| -> Result<Vec<u8>> { Ok(c.to_vec()) };

        assert_eq!(load_kernels(&path, compile, load).unwrap().1, "compiled");
        assert_eq!((mode(&root), mode(&cache), mode(&kernels)), (0o700, 0o700, 0o700));
        assert_eq!(mode(&path) & 0o077, 0, "{:o}", mode(&path));
        assert_eq!(untrusted_cache_dir(&kernels), None);
        assert_eq!(load_kernels(&path, compile, load).unwrap().1, "cached");

        // A cached file others may write is not loaded (and is replaced).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(load_from_cache(&path), None);
        assert_eq!(load_kernels(&path, compile, load).unwrap().1, "recompiled: the cached file failed its check");
        assert_eq!(load_from_cache(&path).as_deref(), Some(&code[..]));

        // A group-writable cache directory: refused, the cached file is neither read nor replaced.
        std::fs::set_permissions(&kernels, std::fs::Permissions::from_mode(0o770)).unwrap();
        let why = untrusted_cache_dir(&kernels).expect("a group-writable directory is refused");
        assert!(why.contains("writable by its group or others (mode 770)"), "{why}");
        std::fs::write(&path, b"planted").unwrap();
        let compiles = std::cell::Cell::new(0);
        let counted = || -> Result<Vec<u8>> {
            compiles.set(compiles.get() + 1);
            Ok(code.clone())
        };
        assert_eq!(load_kernels(&path, counted, load).unwrap(), (code.clone(), NOT_PRIVATE));
        assert_eq!((compiles.get(), std::fs::read(&path).unwrap()), (1, b"planted".to_vec()));

        // Another owner (only root can make one): refused too.
        std::fs::set_permissions(&kernels, std::fs::Permissions::from_mode(0o700)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&kernels, Some(65534), None).unwrap();
            let why = untrusted_cache_dir(&kernels).expect("another user's directory is refused");
            assert!(why.contains("is owned by uid 65534"), "{why}");
            assert_eq!(load_kernels(&path, compile, load).unwrap().1, NOT_PRIVATE);
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
