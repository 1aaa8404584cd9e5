//! AMD through the HIP runtime (libamdhip64) and hipRTC, both opened at run time with libloading:
//! nothing of ROCm is needed to build, and a machine without it runs on the CPU. Kernels are
//! compiled by hipRTC for the GPU present and cached on disk as code objects, keyed by source
//! hash, architecture, options and HIP version.
//!
//! Libraries, first found wins, each name looked for in every place before the next name:
//! - Linux: the system search (`LD_LIBRARY_PATH`, ld.so.cache), then by full path in
//!   `$ROCM_PATH/lib`, `$HIP_PATH/lib`, `/opt/rocm/lib`.
//! - Windows: (1) the bare name through `LOAD_LIBRARY_SEARCH_DEFAULT_DIRS`: the application's
//!   directory, then System32, where the AMD driver installs `amdhip64_*.dll`; (2) by full path in
//!   `%ROCM_PATH%\bin`, then `%HIP_PATH%\bin`, where the HIP SDK installer puts its DLLs
//!   (hipRTC among them) and which it sets; (3) by full path in each absolute directory of
//!   `PATH`, in order (relative entries and `.` are skipped). Full paths load with
//!   `LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR | LOAD_LIBRARY_SEARCH_DEFAULT_DIRS`, so a DLL's own
//!   dependencies (amd_comgr, hiprtc-builtins) come from its folder or the system. The current
//!   directory is never searched, for the library or its dependencies: anyone may put a DLL of
//!   the same name there (DLL planting), while PATH is the user's own choice.
//! - HIP: `libamdhip64.so.7`, `.so.6`, `.so.5`, `libamdhip64.so`; Windows `amdhip64_7.dll`,
//!   `amdhip64_6.dll`, `amdhip64.dll`.
//! - hipRTC, matched to the HIP runtime's version (a newer hipRTC may emit code objects an older
//!   runtime cannot load), first in the directory the runtime came from: `libhiprtc.so.<major>`,
//!   then `libhiprtc.so`, then the hipRTC entry points of libamdhip64 itself (ROCm 5 shipped hipRTC
//!   inside it); Windows `hiprtc<MMmm>.dll` for the runtime's version, then other 5.x-7.x names.
//!
//! Architecture: hipRTC needs the gfx target, and only `hipDeviceProp_t::gcnArchName` carries it
//! (no hipDeviceGetAttribute value gives it, hipDeviceGetName gives the marketing name). The
//! struct's layout changed in ROCm 6, which therefore versions the symbol: ROCm 6 and 7 export
//! `hipGetDevicePropertiesR0600` (gcnArchName at byte 1160 of 1472; the layout is identical in
//! ROCm 7), ROCm 5 only `hipGetDeviceProperties` with the old layout (byte 396 of 792). We call
//! the versioned symbol when present, else the old one, into a zeroed 4 KiB buffer, and accept
//! the name only if it reads as a gfx target — exactly how hipRTC finds the architecture itself
//! when none is given. The full target id (`gfx90a:sramecc+:xnack-`) is passed to
//! `--offload-arch`, as hipRTC does. `ATLAS_HIP_ARCH` overrides the detection.
//!
//! Memory: stream-ordered allocations (`hipMallocFromPoolAsync`/`hipFreeAsync`) from a pool of
//! Atlas's own whose release threshold is raised, so that freed blocks stay pooled, destroyed when
//! the runtime is dropped; the device's default pool, which the host may use, is left as it is.
//! A runtime without `hipMemPoolCreate`, or one that refuses to make the pool, gets
//! `hipMallocAsync` on the default pool instead, with its threshold raised and the pool trimmed on
//! drop. All this when the runtime exports the stream-ordered calls and the device reports pool
//! support; otherwise (or with `ATLAS_HIP_MALLOC_ASYNC=0`) `hipMalloc` behind an exact-size block
//! cache, which is stream-ordered too because all work runs on the one in-order stream.
//! Graph capture (hipStreamBeginCapture ...) is opt-in with `ATLAS_HIP_GRAPHS=1` while it is
//! unverified on AMD hardware; without it the backend launches kernels one by one.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

use super::cuda::KERNELS;
use super::runtime::{fnv1a, kernel_cache_dir, kernel_source, load_kernels, Arg, ArgWords, Runtime};
use crate::{Error, Result};

type Status = c_int; // hipError_t
type RtcStatus = c_int; // hiprtcResult
type Stream = *mut c_void;
type Module = *mut c_void;
type Function = *mut c_void;
type MemPool = *mut c_void;
type Graph = *mut c_void;
type GraphExec = *mut c_void;
type Program = *mut c_void;

const HIP_SUCCESS: Status = 0;
const HIP_ERROR_OUT_OF_MEMORY: Status = 2;
const HIPRTC_SUCCESS: RtcStatus = 0;
/// hipStreamNonBlocking.
const STREAM_NON_BLOCKING: c_uint = 1;
/// hipStreamCaptureModeRelaxed.
const CAPTURE_MODE_RELAXED: c_int = 2;
/// hipDeviceAttribute_t values (the same in ROCm 5.2, 6.x and 7.x headers).
const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;
const ATTR_WARP_SIZE: c_int = 87;
const ATTR_MEMORY_POOLS_SUPPORTED: c_int = 88;
/// hipMemPoolAttrReleaseThreshold (value type u64).
const MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
/// hipMemAllocationTypePinned, hipMemHandleTypeNone, hipMemLocationTypeDevice.
const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const MEM_HANDLE_TYPE_NONE: c_int = 0;
const MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// hipMemPoolProps (88 bytes). ROCm 6 and 7 carve `maxSize` (0: no limit) out of what ROCm 5
/// declares as 64 reserved bytes, which must be zero: zero there means the same to both.
#[repr(C)]
struct MemPoolProps {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_security_attributes: *mut c_void,
    max_size: usize,
    reserved: [u8; 56],
}

impl MemPoolProps {
    /// Pinned device memory on `device`, not exportable, no size limit.
    fn device(device: c_int) -> Self {
        MemPoolProps {
            alloc_type: MEM_ALLOCATION_TYPE_PINNED,
            handle_types: MEM_HANDLE_TYPE_NONE,
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: device,
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            reserved: [0; 56],
        }
    }
}

/// Byte offset of `gcnArchName[256]` in hipDeviceProp_tR0600 (ROCm 6, 7) and in the ROCm 5 layout
/// (checked with offsetof against ROCm 5.2, 6.2 and 7 headers).
const GCN_ARCH_NAME_OFFSET_R0600: usize = 1160;
const GCN_ARCH_NAME_OFFSET_R0000: usize = 396;
/// Larger than either hipDeviceProp_t (1472 and 792 bytes).
const PROPS_BUFFER_BYTES: usize = 4096;

/// The HIP runtime entry points Atlas uses.
struct Hip {
    init: unsafe extern "C" fn(c_uint) -> Status,
    runtime_get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> Status,
    set_device: unsafe extern "C" fn(c_int) -> Status,
    get_device: unsafe extern "C" fn(*mut c_int) -> Status,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> Status,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> Status,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> Status,
    get_device_properties_r0600: Option<unsafe extern "C" fn(*mut c_void, c_int) -> Status>,
    get_device_properties: Option<unsafe extern "C" fn(*mut c_void, c_int) -> Status>,
    get_error_name: unsafe extern "C" fn(Status) -> *const c_char,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    stream_create_with_flags: unsafe extern "C" fn(*mut Stream, c_uint) -> Status,
    stream_destroy: unsafe extern "C" fn(Stream) -> Status,
    stream_synchronize: unsafe extern "C" fn(Stream) -> Status,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Status,
    free: unsafe extern "C" fn(*mut c_void) -> Status,
    malloc_async: Option<unsafe extern "C" fn(*mut *mut c_void, usize, Stream) -> Status>,
    free_async: Option<unsafe extern "C" fn(*mut c_void, Stream) -> Status>,
    device_get_default_mem_pool: Option<unsafe extern "C" fn(*mut MemPool, c_int) -> Status>,
    mem_pool_create: Option<unsafe extern "C" fn(*mut MemPool, *const MemPoolProps) -> Status>,
    mem_pool_destroy: Option<unsafe extern "C" fn(MemPool) -> Status>,
    malloc_from_pool_async: Option<unsafe extern "C" fn(*mut *mut c_void, usize, MemPool, Stream) -> Status>,
    mem_pool_set_attribute: Option<unsafe extern "C" fn(MemPool, c_int, *mut c_void) -> Status>,
    mem_pool_trim_to: Option<unsafe extern "C" fn(MemPool, usize) -> Status>,
    memcpy_htod_async: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> Status,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> Status,
    memcpy_dtod_async: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> Status,
    mem_get_info: Option<unsafe extern "C" fn(*mut usize, *mut usize) -> Status>,
    module_load_data: unsafe extern "C" fn(*mut Module, *const c_void) -> Status,
    module_unload: unsafe extern "C" fn(Module) -> Status,
    module_get_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> Status,
    #[allow(clippy::type_complexity)]
    module_launch_kernel: unsafe extern "C" fn(
        Function,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Stream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> Status,
    stream_begin_capture: Option<unsafe extern "C" fn(Stream, c_int) -> Status>,
    stream_end_capture: Option<unsafe extern "C" fn(Stream, *mut Graph) -> Status>,
    graph_instantiate: Option<unsafe extern "C" fn(*mut GraphExec, Graph, *mut *mut c_void, *mut c_char, usize) -> Status>,
    graph_destroy: Option<unsafe extern "C" fn(Graph) -> Status>,
    graph_launch: Option<unsafe extern "C" fn(GraphExec, Stream) -> Status>,
    graph_exec_destroy: Option<unsafe extern "C" fn(GraphExec) -> Status>,
}

/// The hipRTC entry points.
struct Rtc {
    create_program:
        unsafe extern "C" fn(*mut Program, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> RtcStatus,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> RtcStatus,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> RtcStatus,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> RtcStatus,
    get_code_size: unsafe extern "C" fn(Program, *mut usize) -> RtcStatus,
    get_code: unsafe extern "C" fn(Program, *mut c_char) -> RtcStatus,
    destroy_program: unsafe extern "C" fn(*mut Program) -> RtcStatus,
    get_error_string: unsafe extern "C" fn(RtcStatus) -> *const c_char,
}

struct Api {
    hip: Hip,
    rtc: Rtc,
    /// HIP_VERSION of the runtime: major * 10_000_000 + minor * 100_000 + patch.
    version: i32,
    hip_library: String,
    rtc_library: String,
    // Never unloaded: the function pointers above point into these.
    _libraries: Vec<Library>,
}

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

fn api() -> Result<&'static Api> {
    API.get_or_init(load_api).as_ref().map_err(|e| Error::Device(e.clone()))
}

/// True when the HIP runtime and hipRTC libraries can be opened (it does not touch the GPU;
/// `HipRuntime::new` still fails cleanly on a machine with ROCm but no AMD GPU).
pub fn available() -> bool {
    api().is_ok()
}

/// File names of the HIP runtime, newest ROCm first.
fn hip_library_names(windows: bool) -> Vec<String> {
    let names: &[&str] = if windows {
        &["amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll"]
    } else {
        &["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"]
    };
    names.iter().map(|s| s.to_string()).collect()
}

/// File names of hipRTC for a HIP runtime of the given version, best match first.
fn rtc_library_names(windows: bool, major: i32, minor: i32) -> Vec<String> {
    let mut names = Vec::new();
    if windows {
        // The HIP SDK names it after its version: hiprtc0507.dll, hiprtc0602.dll, ...
        names.push(format!("hiprtc{major:02}{minor:02}.dll"));
        for ma in (5..=7).rev() {
            for mi in (0..=9).rev() {
                let name = format!("hiprtc{ma:02}{mi:02}.dll");
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
    } else {
        if major > 0 {
            names.push(format!("libhiprtc.so.{major}"));
        }
        names.push("libhiprtc.so".to_string());
    }
    names
}

/// Folders to look in after the system search, for a library that is not on it.
fn library_dirs(windows: bool) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let sub = if windows { "bin" } else { "lib" };
    for var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(PathBuf::from(root).join(sub));
        }
    }
    if windows {
        for dir in std::env::var_os("PATH").map(|p| path_dirs(&p)).unwrap_or_default() {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    } else {
        dirs.push(PathBuf::from("/opt/rocm/lib"));
    }
    dirs
}

/// The absolute directories of a PATH value, in order and without repeats (quotes removed, as
/// Windows does); relative entries, `.` among them, would be looked up from the current directory.
fn path_dirs(path: &std::ffi::OsStr) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for dir in std::env::split_paths(path) {
        if dir.is_absolute() && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

/// Where to look for a library, in order: `first` (a directory that decides, such as the HIP
/// runtime's for hipRTC), the system search (None), then `dirs`. Relative folders are left out:
/// they would be looked up from the current directory.
fn search_places(first: Option<&Path>, dirs: &[PathBuf]) -> Vec<Option<PathBuf>> {
    let first = first.filter(|d| d.is_absolute()).map(|d| Some(d.to_path_buf()));
    let dirs = dirs.iter().filter(|d| d.is_absolute()).map(|d| Some(d.clone()));
    first.into_iter().chain([None]).chain(dirs).collect()
}

/// Windows' default search for a bare name also tries the current directory and PATH: bare names
/// are looked up in the application's directory and System32 only.
#[cfg(windows)]
fn open_library(path: &Path) -> std::result::Result<Library, libloading::Error> {
    use libloading::os::windows::{Library as WinLibrary, LOAD_LIBRARY_SEARCH_DEFAULT_DIRS, LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR};
    // A full path's DLL finds its own dependencies (hiprtc-builtins, amd_comgr) next to it.
    let flags = if path.is_absolute() {
        LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR | LOAD_LIBRARY_SEARCH_DEFAULT_DIRS
    } else {
        LOAD_LIBRARY_SEARCH_DEFAULT_DIRS
    };
    // SAFETY: loading the vendor library runs its initialisers, as any use of HIP does.
    unsafe { WinLibrary::load_with_flags(path, flags) }.map(Library::from)
}

#[cfg(not(windows))]
fn open_library(path: &Path) -> std::result::Result<Library, libloading::Error> {
    // SAFETY: loading the vendor library runs its initialisers, as any use of HIP does.
    unsafe { Library::new(path) }
}

/// The first of `names` that opens, each looked for in `places` (see `search_places`).
fn open_first(names: &[String], places: &[Option<PathBuf>], tried: &mut Vec<String>) -> Option<(Library, PathBuf)> {
    for name in names {
        let mut reason = None;
        for place in places {
            let path = place.as_ref().map_or_else(|| PathBuf::from(name), |dir| dir.join(name));
            if path.is_absolute() && !path.exists() {
                continue;
            }
            match open_library(&path) {
                Ok(lib) => return Some((lib, path)),
                // Present but unloadable (a missing dependency, glibc 2.41+ refusing a library that
                // asks for an executable stack, ...): worth telling.
                Err(e) if path.is_absolute() || !not_found(&e) => reason = Some(load_error(&e)),
                Err(_) => {}
            }
        }
        tried.push(match reason {
            Some(r) => format!("{name} ({r})"),
            None => name.clone(),
        });
    }
    None
}

/// libloading's message with its cause: on Windows only the cause says why (missing dependency,
/// wrong architecture, ...).
fn load_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// A bare name that the system search did not find (ERROR_MOD_NOT_FOUND on Windows, where it can
/// also mean a missing dependency: bare names come from System32, whose DLLs have theirs).
fn not_found(e: &libloading::Error) -> bool {
    let text = load_error(e);
    text.contains("No such file") || (cfg!(windows) && text.contains("(os error 126)"))
}

/// Resolves a symbol to a plain function pointer.
///
/// SAFETY: `T` must be the symbol's true C signature, and `lib` must outlive every call.
unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> std::result::Result<T, String> {
    let cname = format!("{name}\0");
    lib.get::<T>(cname.as_bytes()).map(|s| *s).map_err(|e| format!("{name}: {e}"))
}

unsafe fn opt_sym<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    sym(lib, name).ok()
}

fn load_api() -> std::result::Result<Api, String> {
    let windows = cfg!(windows);
    let dirs = library_dirs(windows);
    let mut tried = Vec::new();
    let Some((hip_lib, hip_path)) = open_first(&hip_library_names(windows), &search_places(None, &dirs), &mut tried) else {
        return Err(format!("no HIP runtime found (ROCm not installed?); tried {}", tried.join(", ")));
    };
    // SAFETY: the signatures in load_hip are those of hip_runtime_api.h (ROCm 5.2 to 7.x).
    let hip = unsafe { load_hip(&hip_lib) }
    .map_err(|e| format!("{} lacks a HIP entry point: {e}", hip_path.display()))?;
    let mut version = 0;
    // SAFETY: a plain out-parameter; works before hipInit.
    unsafe { (hip.runtime_get_version)(&mut version) };
    let (major, minor) = (version / 10_000_000, version / 100_000 % 100);

    // hipRTC next to the runtime first, then where the runtime was looked for, then inside
    // libamdhip64 (ROCm 5).
    let rtc_places = search_places(hip_path.parent(), &dirs);
    let mut rtc_tried = Vec::new();
    let rtc_names = rtc_library_names(windows, major, minor);
    let mut libraries = Vec::new();
    let (rtc, rtc_library) = match open_first(&rtc_names, &rtc_places, &mut rtc_tried) {
        Some((lib, path)) => {
            // SAFETY: the signatures of hiprtc.h.
            let rtc = unsafe { load_rtc(&lib) }.map_err(|e| format!("{} lacks a hipRTC entry point: {e}", path.display()))?;
            libraries.push(lib);
            (rtc, path.display().to_string())
        }
        // SAFETY: the signatures of hiprtc.h, which HIP runtimes that carry hipRTC export.
        None => match unsafe { load_rtc(&hip_lib) } {
            Ok(rtc) => (rtc, format!("{} (built in)", hip_path.display())),
            Err(_) => {
                return Err(format!(
                    "HIP runtime {} found but no hipRTC (install hiprtc / libhiprtc for ROCm {major}.{minor}); tried {}",
                    hip_path.display(),
                    rtc_tried.join(", ")
                ))
            }
        },
    };
    libraries.push(hip_lib);
    Ok(Api { hip, rtc, version, hip_library: hip_path.display().to_string(), rtc_library, _libraries: libraries })
}

/// SAFETY: `lib` must export the HIP runtime API of hip_runtime_api.h and outlive every call.
unsafe fn load_hip(lib: &Library) -> std::result::Result<Hip, String> {
    Ok(Hip {
        init: sym(lib, "hipInit")?,
        runtime_get_version: sym(lib, "hipRuntimeGetVersion")?,
        get_device_count: sym(lib, "hipGetDeviceCount")?,
        set_device: sym(lib, "hipSetDevice")?,
        get_device: sym(lib, "hipGetDevice")?,
        device_get: sym(lib, "hipDeviceGet")?,
        device_get_name: sym(lib, "hipDeviceGetName")?,
        device_get_attribute: sym(lib, "hipDeviceGetAttribute")?,
        get_device_properties_r0600: opt_sym(lib, "hipGetDevicePropertiesR0600"),
        get_device_properties: opt_sym(lib, "hipGetDeviceProperties"),
        get_error_name: sym(lib, "hipGetErrorName")?,
        get_error_string: sym(lib, "hipGetErrorString")?,
        stream_create_with_flags: sym(lib, "hipStreamCreateWithFlags")?,
        stream_destroy: sym(lib, "hipStreamDestroy")?,
        stream_synchronize: sym(lib, "hipStreamSynchronize")?,
        malloc: sym(lib, "hipMalloc")?,
        free: sym(lib, "hipFree")?,
        malloc_async: opt_sym(lib, "hipMallocAsync"),
        free_async: opt_sym(lib, "hipFreeAsync"),
        device_get_default_mem_pool: opt_sym(lib, "hipDeviceGetDefaultMemPool"),
        mem_pool_create: opt_sym(lib, "hipMemPoolCreate"),
        mem_pool_destroy: opt_sym(lib, "hipMemPoolDestroy"),
        malloc_from_pool_async: opt_sym(lib, "hipMallocFromPoolAsync"),
        mem_pool_set_attribute: opt_sym(lib, "hipMemPoolSetAttribute"),
        mem_pool_trim_to: opt_sym(lib, "hipMemPoolTrimTo"),
        memcpy_htod_async: sym(lib, "hipMemcpyHtoDAsync")?,
        memcpy_dtoh_async: sym(lib, "hipMemcpyDtoHAsync")?,
        memcpy_dtod_async: sym(lib, "hipMemcpyDtoDAsync")?,
        mem_get_info: opt_sym(lib, "hipMemGetInfo"),
        module_load_data: sym(lib, "hipModuleLoadData")?,
        module_unload: sym(lib, "hipModuleUnload")?,
        module_get_function: sym(lib, "hipModuleGetFunction")?,
        module_launch_kernel: sym(lib, "hipModuleLaunchKernel")?,
        stream_begin_capture: opt_sym(lib, "hipStreamBeginCapture"),
        stream_end_capture: opt_sym(lib, "hipStreamEndCapture"),
        graph_instantiate: opt_sym(lib, "hipGraphInstantiate"),
        graph_destroy: opt_sym(lib, "hipGraphDestroy"),
        graph_launch: opt_sym(lib, "hipGraphLaunch"),
        graph_exec_destroy: opt_sym(lib, "hipGraphExecDestroy"),
    })
}

/// SAFETY: `lib` must export the hipRTC API of hiprtc.h and outlive every call.
unsafe fn load_rtc(lib: &Library) -> std::result::Result<Rtc, String> {
    Ok(Rtc {
        create_program: sym(lib, "hiprtcCreateProgram")?,
        compile_program: sym(lib, "hiprtcCompileProgram")?,
        get_program_log_size: sym(lib, "hiprtcGetProgramLogSize")?,
        get_program_log: sym(lib, "hiprtcGetProgramLog")?,
        get_code_size: sym(lib, "hiprtcGetCodeSize")?,
        get_code: sym(lib, "hiprtcGetCode")?,
        destroy_program: sym(lib, "hiprtcDestroyProgram")?,
        get_error_string: sym(lib, "hiprtcGetErrorString")?,
    })
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: HIP returns static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Api {
    fn check(&self, what: &str, status: Status) -> Result<()> {
        if status == HIP_SUCCESS {
            return Ok(());
        }
        // SAFETY: both accept any status value.
        let (name, text) = unsafe { (cstr((self.hip.get_error_name)(status)), cstr((self.hip.get_error_string)(status))) };
        Err(Error::Device(format!("HIP {what}: {name} ({status}): {text}")))
    }

    fn check_rtc(&self, what: &str, status: RtcStatus) -> Result<()> {
        if status == HIPRTC_SUCCESS {
            return Ok(());
        }
        // SAFETY: accepts any status value.
        let text = cstr(unsafe { (self.rtc.get_error_string)(status) });
        Err(Error::Device(format!("hipRTC {what}: {text} ({status})")))
    }

    fn attribute(&self, attr: c_int, device: c_int) -> Option<i32> {
        let mut v = 0;
        // SAFETY: a plain out-parameter.
        (unsafe { (self.hip.device_get_attribute)(&mut v, attr, device) } == HIP_SUCCESS).then_some(v)
    }

    /// The device's gfx target id (`gfx1100`, `gfx90a:sramecc+:xnack-`) from hipDeviceProp_t.
    fn gcn_arch_name(&self, device: c_int) -> Result<String> {
        let (get, offset, symbol) = match (self.hip.get_device_properties_r0600, self.hip.get_device_properties) {
            (Some(f), _) => (f, GCN_ARCH_NAME_OFFSET_R0600, "hipGetDevicePropertiesR0600"),
            (None, Some(f)) => (f, GCN_ARCH_NAME_OFFSET_R0000, "hipGetDeviceProperties"),
            (None, None) => return Err(Error::Device("HIP runtime exports no hipGetDeviceProperties; set ATLAS_HIP_ARCH".into())),
        };
        let mut props = vec![0u64; PROPS_BUFFER_BYTES / 8];
        // SAFETY: the buffer is larger than either layout and suitably aligned.
        self.check(symbol, unsafe { get(props.as_mut_ptr().cast(), device) })?;
        // SAFETY: plain bytes of the u64 buffer.
        let bytes = unsafe { std::slice::from_raw_parts(props.as_ptr().cast::<u8>(), PROPS_BUFFER_BYTES) };
        arch_at(bytes, offset).ok_or_else(|| {
            Error::Device(format!(
                "HIP {symbol} returned no gfx architecture name (unknown hipDeviceProp_t layout?); set ATLAS_HIP_ARCH, e.g. gfx1100"
            ))
        })
    }
}

/// The gfx target id stored as a C string at `offset`, if it reads as one.
fn arch_at(bytes: &[u8], offset: usize) -> Option<String> {
    let field = bytes.get(offset..offset + 256)?;
    let end = field.iter().position(|&b| b == 0)?;
    let name = std::str::from_utf8(&field[..end]).ok()?;
    valid_arch(name).then(|| name.to_string())
}

/// `gfx` + alphanumerics, optionally followed by `:feature+` / `:feature-` settings.
fn valid_arch(name: &str) -> bool {
    let mut parts = name.split(':');
    let base = parts.next().unwrap_or("");
    base.len() > 3
        && base.starts_with("gfx")
        && base[3..].bytes().all(|b| b.is_ascii_alphanumeric())
        && parts.all(|f| f.len() > 1 && (f.ends_with('+') || f.ends_with('-')) && f[..f.len() - 1].bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// A file-name-safe form of a target id (`:` is not allowed on Windows).
fn arch_file_name(arch: &str) -> String {
    arch.replace(':', "_")
}

fn version_string(version: i32) -> String {
    format!("{}.{}.{}", version / 10_000_000, version / 100_000 % 100, version % 100_000)
}

/// Device memory: stream-ordered pool allocations, or hipMalloc behind a block cache.
enum Allocator {
    /// From Atlas's own pool, or from the device's default pool where `own` is None.
    Pool { own: Option<MemPool> },
    /// Freed blocks by exact size, and the size of every block handed out.
    Cache { free: HashMap<usize, Vec<u64>>, live: HashMap<u64, usize> },
}

pub struct HipRuntime {
    api: &'static Api,
    device: c_int,
    stream: Stream,
    module: Module,
    functions: HashMap<String, Function>,
    allocator: Mutex<Allocator>,
    graphs: bool,
    warp_size: u32,
    description: String,
}

// SAFETY: the stream, module and function handles are process-wide HIP objects; the device is made
// current on the calling thread before every use, and the engine serialises calls on one model.
unsafe impl Send for HipRuntime {}
// SAFETY: as above.
unsafe impl Sync for HipRuntime {}

/// The calling thread's current device, made current again when dropped: HIP keeps the device per
/// thread, and the host may use HIP itself on the same threads.
struct HostDevice {
    api: &'static Api,
    device: c_int,
}

impl HostDevice {
    fn save(api: &'static Api) -> Result<Self> {
        let mut device = 0;
        // SAFETY: an out-parameter.
        api.check("current device", unsafe { (api.hip.get_device)(&mut device) })?;
        Ok(HostDevice { api, device })
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        // SAFETY: the device was current when saved, so it is a valid ordinal.
        unsafe { (self.api.hip.set_device)(self.device) };
    }
}

fn env_flag(name: &str) -> Option<bool> {
    std::env::var(name).ok().map(|v| !matches!(v.trim(), "" | "0" | "false" | "off" | "no"))
}

impl HipRuntime {
    pub fn new(ordinal: usize) -> Result<Self> {
        let api = api()?;
        // SAFETY: every call below passes valid out-parameters and handles created here.
        unsafe {
            api.check("init (no usable AMD GPU or driver?)", (api.hip.init)(0))?;
            let mut count = 0;
            api.check("device count", (api.hip.get_device_count)(&mut count))?;
            if ordinal >= count.max(0) as usize {
                return Err(Error::Device(format!("HIP device {ordinal} requested, {count} present")));
            }
            let device = ordinal as c_int;
            let _host = HostDevice::save(api)?;
            api.check("set device", (api.hip.set_device)(device))?;
            let mut handle = 0;
            api.check("device handle", (api.hip.device_get)(&mut handle, device))?;
            let mut name = [0 as c_char; 256];
            let name = if (api.hip.device_get_name)(name.as_mut_ptr(), name.len() as c_int, handle) == HIP_SUCCESS {
                cstr(name.as_ptr())
            } else {
                "AMD GPU".to_string()
            };
            let arch = match std::env::var("ATLAS_HIP_ARCH") {
                Ok(a) if valid_arch(a.trim()) => a.trim().to_string(),
                Ok(a) => return Err(Error::InvalidArgument(format!("ATLAS_HIP_ARCH={a:?} is not a gfx target such as gfx1100"))),
                Err(_) => api.gcn_arch_name(device)?,
            };

            let pool = api.hip.malloc_async.is_some()
                && api.hip.free_async.is_some()
                && api.attribute(ATTR_MEMORY_POOLS_SUPPORTED, device) == Some(1)
                && env_flag("ATLAS_HIP_MALLOC_ASYNC") != Some(false);
            let graphs = pool
                && env_flag("ATLAS_HIP_GRAPHS") == Some(true)
                && api.hip.stream_begin_capture.is_some()
                && api.hip.stream_end_capture.is_some()
                && api.hip.graph_instantiate.is_some()
                && api.hip.graph_launch.is_some();

            let mut stream: Stream = std::ptr::null_mut();
            api.check("stream", (api.hip.stream_create_with_flags)(&mut stream, STREAM_NON_BLOCKING))?;
            let loaded = load_module(api, &arch);
            let (module, cache_state) = match loaded {
                Ok(m) => m,
                Err(e) => {
                    (api.hip.stream_destroy)(stream);
                    return Err(e);
                }
            };
            let mut functions = HashMap::new();
            for kernel in KERNELS {
                let cname = CString::new(kernel).map_err(|e| Error::Device(format!("kernel name {kernel}: {e}")))?;
                let mut f: Function = std::ptr::null_mut();
                if let Err(e) = api.check(&format!("kernel {kernel}"), (api.hip.module_get_function)(&mut f, module, cname.as_ptr())) {
                    (api.hip.module_unload)(module);
                    (api.hip.stream_destroy)(stream);
                    return Err(e);
                }
                functions.insert(kernel.to_string(), f);
            }
            let cus = api.attribute(ATTR_MULTIPROCESSOR_COUNT, device).unwrap_or(0);
            // Kernels are compiled with the compiler's default: wave64 on gfx9 (CDNA), wave32 after.
            let wave = api.attribute(ATTR_WARP_SIZE, device).unwrap_or(if arch.starts_with("gfx9") { 64 } else { 32 });
            // Last, so that no error path above has a pool to destroy.
            let allocator = if pool {
                Allocator::Pool { own: own_pool(api, device) }
            } else {
                Allocator::Cache { free: HashMap::new(), live: HashMap::new() }
            };
            let memory = match allocator {
                Allocator::Pool { own: Some(_) } => "pooled",
                Allocator::Pool { own: None } => "default-pool",
                Allocator::Cache { .. } => "cached",
            };
            let description = format!(
                "hip {name} ({arch}, {cus} CUs, wave{wave}, HIP {}, {memory} memory, kernels {cache_state})",
                version_string(api.version)
            );
            let warp_size = wave.max(1) as u32;
            Ok(HipRuntime { api, device, stream, module, functions, allocator: Mutex::new(allocator), graphs, warp_size, description })
        }
    }

    /// Where the libraries were found, for diagnostics.
    pub fn libraries() -> Result<(String, String)> {
        let api = api()?;
        Ok((api.hip_library.clone(), api.rtc_library.clone()))
    }

    /// Makes Atlas's device current until the returned guard drops.
    fn bind(&self) -> Result<HostDevice> {
        let host = HostDevice::save(self.api)?;
        if host.device != self.device {
            // SAFETY: the ordinal was validated in new().
            self.api.check("set device", unsafe { (self.api.hip.set_device)(self.device) })?;
        }
        Ok(host)
    }

    fn sync_stream(&self, what: &str) -> Result<()> {
        // SAFETY: the stream is live.
        self.api.check(what, unsafe { (self.api.hip.stream_synchronize)(self.stream) })
    }

    fn allocator(&self) -> std::sync::MutexGuard<'_, Allocator> {
        self.allocator.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A pool of Atlas's own on `device` that keeps freed blocks across synchronisations, like the
/// CUDA runtime's; None where the runtime cannot make one, after raising the default pool's
/// release threshold instead (which keeps the host's freed blocks too: the fallback).
///
/// SAFETY: `device` is a valid ordinal.
unsafe fn own_pool(api: &Api, device: c_int) -> Option<MemPool> {
    let hip = &api.hip;
    let keep_freed = |pool: MemPool| {
        if let Some(set_attr) = hip.mem_pool_set_attribute {
            let mut threshold = u64::MAX;
            // SAFETY: the pool is live; the attribute takes a u64.
            let _ = unsafe { set_attr(pool, MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut threshold as *mut u64).cast()) };
        }
    };
    if let (Some(create), Some(_), Some(_)) = (hip.mem_pool_create, hip.mem_pool_destroy, hip.malloc_from_pool_async) {
        let props = MemPoolProps::device(device);
        let mut pool: MemPool = std::ptr::null_mut();
        if create(&mut pool, &props) == HIP_SUCCESS && !pool.is_null() {
            keep_freed(pool);
            return Some(pool);
        }
    }
    if let Some(get_pool) = hip.device_get_default_mem_pool {
        let mut pool: MemPool = std::ptr::null_mut();
        if get_pool(&mut pool, device) == HIP_SUCCESS {
            keep_freed(pool);
        }
    }
    None
}

/// Loads the kernels' code object for `arch`: the cached one when the runtime takes it, else
/// compiled by hipRTC (and cached).
fn load_module(api: &Api, arch: &str) -> Result<(Module, &'static str)> {
    let source = kernel_source();
    let options = compile_options(arch);
    let hip_version = api.version.to_string();
    let key = fnv1a(&[source.as_bytes(), arch.as_bytes(), options.join(" ").as_bytes(), hip_version.as_bytes()]);
    let path = kernel_cache_dir().join(format!("{key:016x}-{}.hsaco", arch_file_name(arch)));
    load_kernels(
        &path,
        || compile(api, &source, arch, &options),
        |code| {
            let mut module: Module = std::ptr::null_mut();
            // SAFETY: `code` is a whole code object (checked by the cache or made by hipRTC) that
            // outlives the call; the device is current.
            api.check(&format!("module load ({arch})"), unsafe { (api.hip.module_load_data)(&mut module, code.as_ptr().cast()) })?;
            Ok(module)
        },
    )
}

fn compile_options(arch: &str) -> [String; 3] {
    [format!("--offload-arch={arch}"), "-O3".to_string(), "-std=c++17".to_string()]
}

fn compile(api: &Api, source: &str, arch: &str, options: &[String]) -> Result<Vec<u8>> {
    let rtc = &api.rtc;
    let src = CString::new(source).map_err(|e| Error::Device(format!("kernel source: {e}")))?;
    let opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str())).collect::<std::result::Result<_, _>>().map_err(|e| Error::Device(format!("hipRTC option: {e}")))?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    api.check_rtc(
        "create program",
        // SAFETY: NUL-terminated source and name, no headers.
        unsafe { (rtc.create_program)(&mut prog, src.as_ptr(), c"atlas_kernels.hip".as_ptr(), 0, std::ptr::null(), std::ptr::null()) },
    )?;
    // SAFETY: `prog` is live until destroyed at the end; buffers are sized by the size queries.
    unsafe {
        let status = (rtc.compile_program)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
        let result = if status != HIPRTC_SUCCESS {
            let mut size = 0usize;
            let mut log = String::new();
            if (rtc.get_program_log_size)(prog, &mut size) == HIPRTC_SUCCESS && size > 1 {
                let mut buf = vec![0u8; size];
                if (rtc.get_program_log)(prog, buf.as_mut_ptr().cast()) == HIPRTC_SUCCESS {
                    log = String::from_utf8_lossy(&buf[..size - 1]).into_owned();
                }
            }
            let text = cstr((rtc.get_error_string)(status));
            Err(Error::Device(format!("hipRTC could not compile the kernels for {arch} ({text}):\n{log}")))
        } else {
            let mut size = 0usize;
            api.check_rtc("code size", (rtc.get_code_size)(prog, &mut size)).and_then(|()| {
                let mut code = vec![0u8; size];
                api.check_rtc("code", (rtc.get_code)(prog, code.as_mut_ptr().cast())).and_then(|()| {
                    if code.is_empty() {
                        Err(Error::Device(format!("hipRTC produced no code object for {arch}")))
                    } else {
                        Ok(code)
                    }
                })
            })
        };
        (rtc.destroy_program)(&mut prog);
        result
    }
}

impl Runtime for HipRuntime {
    fn describe(&self) -> String {
        self.description.clone()
    }

    /// 64 on CDNA (gfx9), 32 on RDNA.
    fn warp_size(&self) -> u32 {
        self.warp_size
    }

    /// Every AMD GPU Atlas targets gives a workgroup 64 KiB of LDS (gfx950 more).
    fn max_shared_bytes(&self) -> u32 {
        64 * 1024
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let _bound = self.bind()?;
        let hip = &self.api.hip;
        let size = bytes.max(1);
        let mut allocator = self.allocator();
        match &mut *allocator {
            Allocator::Pool { own } => {
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: the pool (own_pool checked that this call exists with it) and the stream
                // are live; the pointer is an out-parameter.
                let status = match (*own, hip.malloc_from_pool_async, hip.malloc_async) {
                    // SAFETY: as above.
                    (Some(pool), Some(malloc_from_pool), _) => unsafe { malloc_from_pool(&mut p, size, pool, self.stream) },
                    // SAFETY: as above.
                    (None, _, Some(malloc_async)) => unsafe { malloc_async(&mut p, size, self.stream) },
                    _ => return Err(Error::Device("HIP alloc: no stream-ordered allocation entry point".into())),
                };
                self.api.check(&format!("alloc {bytes} bytes"), status)?;
                Ok(p as u64)
            }
            Allocator::Cache { free, live } => {
                if let Some(p) = free.get_mut(&size).and_then(Vec::pop) {
                    live.insert(p, size);
                    return Ok(p);
                }
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: an out-parameter.
                let mut status = unsafe { (hip.malloc)(&mut p, size) };
                if status == HIP_ERROR_OUT_OF_MEMORY && free.values().any(|v| !v.is_empty()) {
                    // Give the cached blocks back and try once more (hipFree waits for the device).
                    for (_, blocks) in free.drain() {
                        for b in blocks {
                            // SAFETY: cached blocks are no longer referenced by queued work after hipFree's implicit sync.
                            unsafe { (hip.free)(b as *mut c_void) };
                        }
                    }
                    // SAFETY: as above.
                    status = unsafe { (hip.malloc)(&mut p, size) };
                }
                self.api.check(&format!("alloc {bytes} bytes"), status)?;
                live.insert(p as u64, size);
                Ok(p as u64)
            }
        }
    }

    fn free(&self, ptr: u64) {
        if ptr == 0 {
            return;
        }
        let Ok(_bound) = self.bind() else { return };
        let hip = &self.api.hip;
        let mut allocator = self.allocator();
        match &mut *allocator {
            Allocator::Pool { .. } => {
                if let Some(free_async) = hip.free_async {
                    // SAFETY: `ptr` came from the pool and is freed once, after queued work.
                    let _ = unsafe { free_async(ptr as *mut c_void, self.stream) };
                }
            }
            // Reusing the block for later work is safe: everything runs on the one in-order stream.
            Allocator::Cache { free, live } => match live.remove(&ptr) {
                Some(size) => free.entry(size).or_default().push(ptr),
                // SAFETY: not ours to cache; hipFree waits for the device first.
                None => unsafe {
                    (hip.free)(ptr as *mut c_void);
                },
            },
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _bound = self.bind()?;
        // SAFETY: dst holds at least src.len() bytes; we wait before `src` can be dropped.
        let status = unsafe { (self.api.hip.memcpy_htod_async)(dst as *mut c_void, src.as_ptr() as *mut c_void, src.len(), self.stream) };
        self.api.check("upload", status)?;
        self.sync_stream("upload")
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return self.sync_stream("download");
        }
        let _bound = self.bind()?;
        // SAFETY: src holds at least dst.len() bytes; we wait before returning.
        let status = unsafe { (self.api.hip.memcpy_dtoh_async)(dst.as_mut_ptr().cast(), src as *mut c_void, dst.len(), self.stream) };
        self.api.check("download", status)?;
        self.sync_stream("download")
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _bound = self.bind()?;
        // SAFETY: both ranges are device allocations of at least `bytes`.
        let status = unsafe { (self.api.hip.memcpy_dtod_async)(dst as *mut c_void, src as *mut c_void, bytes, self.stream) };
        self.api.check("copy", status)
    }

    fn free_memory(&self) -> Option<usize> {
        let get = self.api.hip.mem_get_info?;
        let _bound = self.bind().ok()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two plain out-parameters, for the device bound above.
        let status = unsafe { get(&mut free, &mut total) };
        self.api.check("memory info", status).ok().map(|()| free)
    }

    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<()> {
        let _bound = self.bind()?;
        let f = *self.functions.get(kernel).ok_or_else(|| Error::Device(format!("no kernel {kernel}")))?;
        let mut words = ArgWords::new(args);
        let mut params = words.pointers();
        let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
        // SAFETY: the argument list matches the kernel's signature (checked by the GPU op tests).
        let status = unsafe {
            (self.api.hip.module_launch_kernel)(
                f,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared_bytes,
                self.stream,
                params_ptr,
                std::ptr::null_mut(),
            )
        };
        self.api.check(kernel, status)
    }

    fn synchronize(&self) -> Result<()> {
        let _bound = self.bind()?;
        self.sync_stream("synchronize")
    }

    fn begin_capture(&self) -> Result<()> {
        let begin = self.api.hip.stream_begin_capture.filter(|_| self.graphs);
        let begin = begin.ok_or_else(|| Error::Unsupported("graph capture on HIP (set ATLAS_HIP_GRAPHS=1 to try it)".into()))?;
        let _bound = self.bind()?;
        // SAFETY: the stream is live and not capturing.
        self.api.check("begin capture", unsafe { begin(self.stream, CAPTURE_MODE_RELAXED) })
    }

    fn end_capture(&self) -> Result<u64> {
        let hip = &self.api.hip;
        let (Some(end), Some(instantiate)) = (hip.stream_end_capture, hip.graph_instantiate) else {
            return Err(Error::Unsupported("graph capture on HIP".into()));
        };
        let _bound = self.bind()?;
        let mut graph: Graph = std::ptr::null_mut();
        // SAFETY: the stream is capturing; the graph is destroyed once instantiated.
        unsafe {
            self.api.check("end capture", end(self.stream, &mut graph))?;
            let mut exec: GraphExec = std::ptr::null_mut();
            let status = instantiate(&mut exec, graph, std::ptr::null_mut(), std::ptr::null_mut(), 0);
            if let Some(destroy) = hip.graph_destroy {
                destroy(graph);
            }
            self.api.check("graph instantiate", status)?;
            Ok(exec as u64)
        }
    }

    fn launch_graph(&self, graph: u64) -> Result<()> {
        let launch = self.api.hip.graph_launch.ok_or_else(|| Error::Unsupported("graph launch on HIP".into()))?;
        let _bound = self.bind()?;
        // SAFETY: `graph` came from end_capture and was not destroyed.
        self.api.check("graph launch", unsafe { launch(graph as GraphExec, self.stream) })
    }

    fn destroy_graph(&self, graph: u64) {
        if let Some(destroy) = self.api.hip.graph_exec_destroy {
            if let Ok(_bound) = self.bind() {
                // SAFETY: as above; destroyed once.
                let _ = unsafe { destroy(graph as GraphExec) };
            }
        }
    }
}

impl Drop for HipRuntime {
    fn drop(&mut self) {
        let Ok(_bound) = self.bind() else { return };
        let hip = &self.api.hip;
        // SAFETY: no buffer outlives the runtime (each holds an Arc to it); the handles were
        // created in new() and are released once.
        unsafe {
            (hip.stream_synchronize)(self.stream);
            match &mut *self.allocator() {
                Allocator::Cache { free, .. } => {
                    for (_, blocks) in free.drain() {
                        for b in blocks {
                            (hip.free)(b as *mut c_void);
                        }
                    }
                }
                // Freed blocks stay pooled while the runtime lives (see own_pool): unloading gives
                // them back. Every block was freed on the stream, which is done.
                Allocator::Pool { own: Some(pool) } => {
                    if let Some(trim) = hip.mem_pool_trim_to {
                        trim(*pool, 0);
                    }
                    if let Some(destroy) = hip.mem_pool_destroy {
                        destroy(*pool);
                    }
                }
                Allocator::Pool { own: None } => {
                    if let (Some(get_pool), Some(trim)) = (hip.device_get_default_mem_pool, hip.mem_pool_trim_to) {
                        let mut pool: MemPool = std::ptr::null_mut();
                        if get_pool(&mut pool, self.device) == HIP_SUCCESS {
                            trim(pool, 0);
                        }
                    }
                }
            }
            (hip.module_unload)(self.module);
            (hip.stream_destroy)(self.stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names_cover_rocm_5_to_7() {
        let linux = hip_library_names(false);
        assert_eq!(linux, ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"]);
        assert_eq!(hip_library_names(true), ["amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll"]);
        assert_eq!(rtc_library_names(false, 6, 2), ["libhiprtc.so.6", "libhiprtc.so"]);
        assert_eq!(rtc_library_names(false, 0, 0), ["libhiprtc.so"]);
        let win = rtc_library_names(true, 6, 2);
        assert_eq!(win[0], "hiprtc0602.dll");
        for name in ["hiprtc0507.dll", "hiprtc0601.dll", "hiprtc0604.dll", "hiprtc0700.dll", "hiprtc0701.dll"] {
            assert!(win.contains(&name.to_string()), "{name}");
        }
        assert_eq!(win.iter().filter(|n| *n == "hiprtc0602.dll").count(), 1);
    }

    #[test]
    fn libraries_are_looked_for_by_full_path_or_by_the_system_only() {
        // Absolute on the platform the test runs on (a Windows path needs its drive).
        let dir = |d: &str| if cfg!(windows) { PathBuf::from(format!("C:{d}")) } else { PathBuf::from(d) };
        let dirs = [dir("/opt/rocm-6.2/lib"), PathBuf::from("rocm/lib"), dir("/opt/rocm/lib")];
        let abs = |d: &str| Some(dir(d));
        assert_eq!(search_places(None, &dirs), [None, abs("/opt/rocm-6.2/lib"), abs("/opt/rocm/lib")]);
        // hipRTC: the runtime's own directory first, when it was found by full path.
        let runtime_dir = dir("/opt/rocm-6.2/lib");
        assert_eq!(search_places(Some(&runtime_dir), &dirs[2..]), [abs("/opt/rocm-6.2/lib"), None, abs("/opt/rocm/lib")]);
        assert_eq!(search_places(Path::new("libamdhip64.so.6").parent(), &[]), [None]);
    }

    /// PATH's absolute directories, in order and once each; never the current directory.
    #[test]
    fn path_entries_are_searched_only_when_absolute() {
        let (value, want): (&str, &[&str]) = if cfg!(windows) {
            (
                r#"C:\Windows\system32;.;bin;C:relative;\rooted;"C:\Program Files\AMD\ROCm\6.4\bin";;C:\Windows\system32;D:\t\"#,
                &[r"C:\Windows\system32", r"C:\Program Files\AMD\ROCm\6.4\bin", r"D:\t\"],
            )
        } else {
            ("/usr/bin:.:bin::/opt/rocm/bin:/usr/bin", &["/usr/bin", "/opt/rocm/bin"])
        };
        let want: Vec<PathBuf> = want.iter().map(PathBuf::from).collect();
        assert_eq!(path_dirs(std::ffi::OsStr::new(value)), want);
    }

    #[test]
    fn arch_names() {
        for ok in ["gfx1100", "gfx1151", "gfx942", "gfx90a:sramecc+:xnack-", "gfx942:sramecc+:xnack-", "gfx1200"] {
            assert!(valid_arch(ok), "{ok}");
        }
        for bad in ["", "gfx", "Radeon RX 7900", "gfx11 00", "gfx90a:", "gfx90a:xnack", "gfx90a:+", "sm_90"] {
            assert!(!valid_arch(bad), "{bad}");
        }
        assert_eq!(arch_file_name("gfx90a:sramecc+:xnack-"), "gfx90a_sramecc+_xnack-");
        assert_eq!(version_string(60_241_134), "6.2.41134");
        assert_eq!(version_string(50_221_153), "5.2.21153");
    }

    #[test]
    fn arch_read_from_either_props_layout() {
        for offset in [GCN_ARCH_NAME_OFFSET_R0600, GCN_ARCH_NAME_OFFSET_R0000] {
            let mut buf = vec![0u8; PROPS_BUFFER_BYTES];
            buf[..22].copy_from_slice(b"AMD Radeon RX 7900 XTX");
            let arch = b"gfx90a:sramecc+:xnack-";
            buf[offset..offset + arch.len()].copy_from_slice(arch);
            assert_eq!(arch_at(&buf, offset).as_deref(), Some("gfx90a:sramecc+:xnack-"));
            // The other layout's offset holds no name.
            let other = if offset == GCN_ARCH_NAME_OFFSET_R0600 { GCN_ARCH_NAME_OFFSET_R0000 } else { GCN_ARCH_NAME_OFFSET_R0600 };
            assert_eq!(arch_at(&buf, other), None);
            // Unterminated field.
            buf[offset..offset + 256].fill(b'x');
            assert_eq!(arch_at(&buf, offset), None);
        }
        assert_eq!(arch_at(&[0u8; 16], GCN_ARCH_NAME_OFFSET_R0000), None);
    }

    /// hipMemPoolProps as hip_runtime_api.h lays it out on 64-bit targets (ROCm 5: 64 reserved
    /// bytes after win32SecurityAttributes; ROCm 6 and 7: maxSize, then 56).
    #[test]
    fn pool_props_match_hip_mem_pool_props() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<MemPoolProps>(), 88);
        assert_eq!(offset_of!(MemPoolProps, handle_types), 4);
        assert_eq!(offset_of!(MemPoolProps, location_type), 8);
        assert_eq!(offset_of!(MemPoolProps, location_id), 12);
        assert_eq!(offset_of!(MemPoolProps, win32_security_attributes), 16);
        assert_eq!(offset_of!(MemPoolProps, max_size), 24);
        assert_eq!(offset_of!(MemPoolProps, reserved), 32);
        let props = MemPoolProps::device(2);
        assert_eq!((props.alloc_type, props.handle_types, props.location_type, props.location_id), (1, 0, 1, 2));
        assert!(props.win32_security_attributes.is_null());
        assert_eq!(props.max_size, 0);
        assert!(props.reserved.iter().all(|&b| b == 0));
    }

    /// Without ROCm (as on CI), the runtime reports a clean device error instead of panicking.
    #[test]
    fn new_fails_cleanly_without_rocm() {
        match HipRuntime::new(0) {
            Err(Error::Device(msg)) => {
                eprintln!("HipRuntime::new(0): {msg}");
                assert!(!msg.is_empty());
                if !available() {
                    assert!(msg.contains("no HIP runtime") || msg.contains("hipRTC"), "{msg}");
                }
            }
            Err(e) => panic!("expected a device error, got {e}"),
            // A machine with an AMD GPU: nothing to check here.
            Ok(rt) => assert!(rt.describe().starts_with("hip ")),
        }
        if !available() {
            assert!(HipRuntime::libraries().is_err());
        }
    }

    /// Where ROCm's libraries are installed (no GPU needed), hipRTC compiles the kernels for an
    /// RDNA and a CDNA target into code objects holding every kernel the runtime looks up. (ROCm
    /// 5.2's comgr aborts the process on targets it does not know, such as gfx1100: older runtimes
    /// get older targets.)
    #[test]
    fn hiprtc_compiles_the_kernels_when_rocm_is_present() {
        let Ok(api) = api() else { return };
        eprintln!("HIP {} from {}, hipRTC from {}", version_string(api.version), api.hip_library, api.rtc_library);
        let targets: &[&str] = if api.version >= 60_000_000 { &["gfx1100", "gfx942"] } else { &["gfx1030", "gfx90a"] };
        for &arch in targets {
            let code = compile(api, &kernel_source(), arch, &compile_options(arch)).unwrap_or_else(|e| panic!("{e}"));
            assert!(code.starts_with(b"\x7fELF"), "{arch}: not an ELF code object");
            for kernel in KERNELS {
                let descriptor = format!("{kernel}.kd");
                assert!(code.windows(descriptor.len()).any(|w| w == descriptor.as_bytes()), "{arch}: no kernel {kernel}");
            }
        }
    }
}
