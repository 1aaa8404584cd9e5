//! NVIDIA through cudarc's driver and NVRTC bindings, both loaded at run time (no CUDA needed to
//! build or to run on the CPU). Kernels are compiled by NVRTC for the GPU present and cached on
//! disk as CUBIN, keyed by source hash, architecture and driver and NVRTC versions; a cached
//! CUBIN the driver refuses is compiled again and replaced.
//!
//! Memory comes from a pool of Atlas's own, which keeps freed blocks (no driver call for per-op
//! temporaries) and gives them back when the runtime is dropped; the device's default pool, which
//! the host may use, is left as it is.
//!
//! Atlas runs inside a host process that may use CUDA itself, on the same threads: every call
//! makes Atlas's context current only for its duration and puts the caller's back.

use std::collections::HashMap;
use std::ffi::CString;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::runtime::{fnv1a, kernel_cache_dir, kernel_source, load_kernels, Arg, ArgWords, Runtime};
use crate::{Error, Result};

pub struct CudaRuntime {
    /// Released in Drop, where the caller's context must be put back after cudarc binds this one
    /// to release it.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    /// Null until made: `new` fills the runtime in step by step, so that Drop releases whatever
    /// was made when a later step fails.
    stream: sys::CUstream,
    /// Atlas's own memory pool (see `pool_props`).
    pool: sys::CUmemoryPool,
    module: sys::CUmodule,
    functions: HashMap<String, sys::CUfunction>,
    /// Programmatic dependent launch (sm_90+): `launch_early` lets a kernel start before the
    /// previous one ends.
    early_launch: bool,
    max_shared_bytes: u32,
    multiprocessors: u32,
    /// Compiled for sm_90a: the WGMMA_KERNELS exist.
    wgmma: bool,
    /// Compute capability 8.0 or later: mma.sync, and the MMA_KERNELS; cp.async.
    mma: bool,
    description: String,
}

// SAFETY: the stream, module and function handles belong to `ctx` (the pool to its device), which
// is made current on the calling thread for every use; the engine serialises all calls on one
// model.
unsafe impl Send for CudaRuntime {}
// SAFETY: as above.
unsafe impl Sync for CudaRuntime {}

pub(crate) const KERNELS: [&str; 144] = [
    "silu_mul", "to_bf16", "add_inplace", "copy_spans", "embed_bf16", "embed_fp8", "fill_random_bf16", "fill_random_fp8", "rms_norm",
    "norm_rope", "qkv_rope_append", "rope", "gemv1_bf16", "gemv1_fp8", "gemv1_gate_up_bf16", "gemv1_gate_up_fp8",
    "gemv1_bf16_tokens", "gemv1_bf16_tokens4", "gemv1_gate_up_bf16_tokens", "gemv1_gate_up_bf16_tokens4", "gemv1_fp8_tokens", "gemv1_fp8_long", "gemv1_gate_up_fp8_long", "gemv1_gate_up_fp8_tokens", "gemv_bf16", "gemm_bf16", "gemm_fp8", "kv_append", "attention_decode", "flash_attention", "argmax", "top_k",
    "logit_adjust", "log_partition", "draw_in_order",
    "moe_route", "moe_gate_up_bf16", "moe_gate_up_fp8", "moe_down_bf16", "moe_down_fp8", "moe_count", "moe_index",
    "moe_gather", "moe_gemm_bf16", "moe_gemm_fp8", "moe_combine",
    "conv1d_silu", "conv1d_silu_rows", "gated_delta_rule", "gated_delta_rule_rows", "delta_chunk_prep", "delta_chunk_state",
    "delta_chunk_out",
    "gated_rms_norm", "sigmoid_gate",
    "embed_packed", "dequant_packed_bf16", "dequant_fp8_bf16", "gemm_packed",
    "gemv1_q8_0", "gemv1_q4_0", "gemv1_q4_1", "gemv1_q4_k", "gemv1_q5_k", "gemv1_q6_k", "gemv1_iq4_nl", "gemv1_iq4_xs",
    "gemv1_mxfp4", "gemv1_nvfp4", "gemv1_rocmfp4", "gemv1_rocmfp4_fast", "gemv1_q5_0", "gemv1_q5_1",
    "gemv1_gate_up_q8_0", "gemv1_gate_up_q4_0", "gemv1_gate_up_q4_1", "gemv1_gate_up_q4_k", "gemv1_gate_up_q5_k",
    "gemv1_gate_up_q6_k", "gemv1_gate_up_iq4_nl", "gemv1_gate_up_iq4_xs", "gemv1_gate_up_mxfp4", "gemv1_gate_up_nvfp4",
    "gemv1_gate_up_rocmfp4", "gemv1_gate_up_rocmfp4_fast", "gemv1_gate_up_q5_0", "gemv1_gate_up_q5_1",
    "gemv1_q8_0_tokens", "gemv1_q4_0_tokens", "gemv1_q4_1_tokens", "gemv1_q4_k_tokens", "gemv1_q5_k_tokens", "gemv1_q6_k_tokens",
    "gemv1_iq4_nl_tokens", "gemv1_iq4_xs_tokens", "gemv1_mxfp4_tokens", "gemv1_nvfp4_tokens", "gemv1_rocmfp4_tokens",
    "gemv1_rocmfp4_fast_tokens", "gemv1_q5_0_tokens", "gemv1_q5_1_tokens", "gemv1_gate_up_q8_0_tokens",
    "gemv1_gate_up_q4_0_tokens", "gemv1_gate_up_q4_1_tokens", "gemv1_gate_up_q4_k_tokens", "gemv1_gate_up_q5_k_tokens",
    "gemv1_gate_up_q6_k_tokens", "gemv1_gate_up_iq4_nl_tokens", "gemv1_gate_up_iq4_xs_tokens", "gemv1_gate_up_mxfp4_tokens",
    "gemv1_gate_up_nvfp4_tokens", "gemv1_gate_up_rocmfp4_tokens", "gemv1_gate_up_rocmfp4_fast_tokens",
    "gemv1_gate_up_q5_0_tokens", "gemv1_gate_up_q5_1_tokens",
    "moe_gemm_packed",
    "moe_gate_up_q8_0", "moe_gate_up_q4_0", "moe_gate_up_q4_1", "moe_gate_up_q4_k", "moe_gate_up_q5_k",
    "moe_gate_up_q6_k", "moe_gate_up_iq4_nl", "moe_gate_up_iq4_xs", "moe_gate_up_mxfp4", "moe_gate_up_nvfp4",
    "moe_gate_up_rocmfp4", "moe_gate_up_rocmfp4_fast", "moe_gate_up_q5_0", "moe_gate_up_q5_1",
    "moe_down_q8_0", "moe_down_q4_0", "moe_down_q4_1", "moe_down_q4_k", "moe_down_q5_k", "moe_down_q6_k",
    "moe_down_iq4_nl", "moe_down_iq4_xs", "moe_down_mxfp4", "moe_down_nvfp4", "moe_down_rocmfp4",
    "moe_down_rocmfp4_fast", "moe_down_q5_0", "moe_down_q5_1",
];

/// Kernels that exist only where mma.sync does (kernels/linear.hip's BF16_ROWS_MMA, sm_80+).
const MMA_KERNELS: [&str; 6] = [
    "gemv1_bf16_mma",
    "gemv1_bf16_mma_tokens",
    "gemv1_gate_up_bf16_mma",
    "gemv1_gate_up_bf16_mma_tokens",
    "gemv1_fp8_split",
    "gemv1_gate_up_fp8_split",
];

/// Kernels that exist only where wgmma does (kernels/gemm.hip, sm_90a).
const WGMMA_KERNELS: [&str; 5] = ["gemm_wg_bf16", "gemm_wg_bf16_wide", "gemm_wg_bf16_gate_up", "gemm_wg_fp8", "gemm_wg_packed"];

fn dev_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("CUDA {what}: {e:?}"))
}

/// True when the CUDA driver library can be opened (cudarc panics on first use otherwise).
pub fn available() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { sys::is_culib_present() && nvrtc_sys::is_culib_present() }
}

/// The calling thread's current context (or none), made current again when dropped.
struct HostContext(sys::CUcontext);

impl HostContext {
    fn save() -> Result<Self> {
        let current = cu::ctx::get_current().map_err(|e| dev_err("current context", e))?;
        Ok(HostContext(current.unwrap_or(std::ptr::null_mut())))
    }
}

impl Drop for HostContext {
    fn drop(&mut self) {
        // SAFETY: the context was current when saved (null unbinds), and Atlas never destroys a
        // context it did not make.
        let _ = unsafe { cu::ctx::set_current(self.0) };
    }
}

impl CudaRuntime {
    pub fn new(ordinal: usize) -> Result<Self> {
        if !available() {
            return Err(Error::Device("no CUDA driver (libcuda) or NVRTC (libnvrtc) found".into()));
        }
        // The current context can only be read from an initialised driver.
        cu::init().map_err(|e| dev_err("init", e))?;
        // Dropped last: the context is made current below, also on the error paths.
        let _host = HostContext::save()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("context", e))?;
        let mut rt = CudaRuntime {
            ctx: ManuallyDrop::new(ctx),
            stream: std::ptr::null_mut(),
            pool: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            functions: HashMap::new(),
            early_launch: false,
            max_shared_bytes: 0,
            multiprocessors: 0,
            wgmma: false,
            mma: false,
            description: String::new(),
        };
        let device = rt.ctx.cu_device();
        let (major, minor) = rt.ctx.compute_capability().map_err(|e| dev_err("compute capability", e))?;
        // Hopper's arch-specific target adds wgmma (the gemm_wg_* kernels); the CUBIN then runs
        // on sm_90 devices only, which this one is.
        let wgmma = (major, minor) == (9, 0);
        let arch = if wgmma { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
        let name = cu::device::get_name(device).unwrap_or_else(|_| "CUDA device".into());
        rt.stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| dev_err("stream", e))?;
        // A pool of Atlas's own that keeps freed blocks across synchronisations: per-op
        // temporaries then cost no driver call. Drop destroys it, so that unloading gives the
        // memory back. (Raising the threshold of the device's default pool instead would keep the
        // host's freed memory too.)
        let props = pool_props(ordinal)?;
        // SAFETY: `props` is a valid, fully initialised description; the attribute takes a u64.
        unsafe {
            rt.pool = cu::mem_pool::create(&props).map_err(|e| dev_err(&format!("memory pool for device {ordinal}"), e))?;
            let mut threshold = u64::MAX;
            cu::mem_pool::set_attribute(rt.pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut threshold as *mut u64).cast())
                .map_err(|e| dev_err("memory pool release threshold", e))?;
        }
        let (module, cache_state) = load_module(&arch)?;
        rt.module = module;
        // SAFETY: the device handle is valid.
        let max_shared = unsafe {
            cu::device::get_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        }
        .map_err(|e| dev_err("shared memory size", e))?;
        // SAFETY: as above.
        let sms = unsafe { cu::device::get_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) }
            .map_err(|e| dev_err("multiprocessor count", e))?;
        let mma = major >= 8;
        let optional = [(mma, &MMA_KERNELS[..]), (wgmma, &WGMMA_KERNELS[..])];
        let extra = optional.iter().filter(|(present, _)| *present).flat_map(|(_, names)| names.iter());
        for &name in KERNELS.iter().chain(extra) {
            let cname = CString::new(name).map_err(|e| dev_err("kernel name", e))?;
            // SAFETY: the module is loaded and the name is NUL-terminated; the attributes are plain
            // integers. Beyond 48 KB, dynamic shared memory must be allowed per function.
            let f = unsafe {
                let f = cu::module::get_function(rt.module, cname).map_err(|e| dev_err(name, e))?;
                let fixed = cu::function::get_function_attribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                    .map_err(|e| dev_err(name, e))?;
                cu::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max_shared - fixed,
                )
                .map_err(|e| dev_err(name, e))?;
                f
            };
            rt.functions.insert(name.to_string(), f);
        }
        rt.description = format!("cuda {name} ({arch}, kernels {cache_state})");
        rt.early_launch = major >= 9;
        rt.wgmma = wgmma;
        rt.mma = mma;
        rt.max_shared_bytes = max_shared as u32;
        rt.multiprocessors = u32::try_from(sms).unwrap_or(0);
        Ok(rt)
    }

    /// Makes Atlas's context current until the returned guard drops.
    fn bind(&self) -> Result<HostContext> {
        let host = HostContext::save()?;
        if host.0 != self.ctx.cu_ctx() {
            // SAFETY: the context lives as long as `self`.
            unsafe { cu::ctx::set_current(self.ctx.cu_ctx()) }.map_err(|e| dev_err("bind context", e))?;
        }
        Ok(host)
    }
}

/// Atlas's memory pool: pinned device memory on device `ordinal`, not exportable; the rest zero
/// (the reserved bytes must be).
fn pool_props(ordinal: usize) -> Result<sys::CUmemPoolProps> {
    let id = i32::try_from(ordinal).map_err(|_| Error::Device(format!("CUDA device ordinal {ordinal} out of range")))?;
    // SAFETY: plain data (enums, integers, a null pointer); zero is valid for every field.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = id;
    Ok(props)
}

/// The driver's and NVRTC's versions: either may change the code compiled, or what loads.
fn toolchain_versions() -> Result<String> {
    let (mut driver, mut major, mut minor) = (0, 0, 0);
    // SAFETY: plain out-parameters.
    unsafe {
        sys::cuDriverGetVersion(&mut driver).result().map_err(|e| dev_err("driver version", e))?;
        nvrtc_sys::nvrtcVersion(&mut major, &mut minor).result().map_err(|e| dev_err("NVRTC version", e))?;
    }
    Ok(format!("driver {driver}, nvrtc {major}.{minor}"))
}

/// The kernels for `arch` as a loaded module: the cached CUBIN when the driver takes it, else
/// compiled by NVRTC (and cached).
fn load_module(arch: &str) -> Result<(sys::CUmodule, &'static str)> {
    let source = kernel_source();
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    let versions = toolchain_versions()?;
    let key = fnv1a(&[source.as_bytes(), arch.as_bytes(), options.join(" ").as_bytes(), versions.as_bytes()]);
    let path = kernel_cache_dir().join(format!("{key:016x}-{arch}.cubin"));
    load_kernels(
        &path,
        || nvrtc_compile(&source, arch, &options),
        // SAFETY: `cubin` is a whole CUBIN image (checked by the cache or made by NVRTC) that
        // outlives the call; the context is current.
        |cubin| unsafe { cu::module::load_data(cubin.as_ptr().cast()) }.map_err(|e| dev_err(&format!("module load ({arch})"), e)),
    )
}

/// NVRTC's CUBIN for `arch`.
fn nvrtc_compile(source: &str, arch: &str, options: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(source).map_err(|e| dev_err("kernel source", e))?;
    let prog = nvrtc::create_program(&src, None).map_err(|e| dev_err("nvrtc program", e))?;
    // SAFETY: `prog` is a live program; options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(prog, options) };
    if compiled.is_err() {
        // SAFETY: as above.
        let log = unsafe { nvrtc::get_program_log(prog) }.unwrap_or_default();
        let log: String = log.iter().map(|c| char::from(c.to_ne_bytes()[0])).collect();
        // SAFETY: `prog` is live and not used again.
        unsafe { nvrtc::destroy_program(prog) }.ok();
        return Err(Error::Device(format!("NVRTC could not compile the kernels for {arch}:\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: the program compiled for a real architecture, so it has a CUBIN; the program is
    // destroyed on every way out.
    unsafe {
        let cubin = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| dev_err("cubin size", e)).and_then(|()| {
            let mut buf = vec![0u8; size];
            nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()).result().map_err(|e| dev_err("cubin", e)).map(|()| buf)
        });
        nvrtc::destroy_program(prog).ok();
        cubin
    }
}

impl Runtime for CudaRuntime {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn max_shared_bytes(&self) -> u32 {
        self.max_shared_bytes
    }

    fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    fn bf16_gemv_on_matrix_cores(&self) -> bool {
        self.mma
    }

    fn has_wgmma(&self) -> bool {
        self.wgmma
    }

    fn has_async_copy(&self) -> bool {
        self.mma
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let _bound = self.bind()?;
        // SAFETY: the pool and the stream belong to the current context's device.
        unsafe { cu::mem_pool::alloc_async(self.pool, bytes.max(1), self.stream) }.map_err(|e| dev_err(&format!("alloc {bytes} bytes"), e))
    }

    fn free(&self, ptr: u64) {
        if let Ok(_bound) = self.bind() {
            // SAFETY: `ptr` came from alloc (Atlas's pool) and is freed once, after queued work.
            let _ = unsafe { cu::free_async(ptr, self.stream) };
        }
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: dst holds at least src.len() bytes; we wait before `src` can be dropped.
        unsafe {
            cu::memcpy_htod_async(dst, src, self.stream).map_err(|e| dev_err("upload", e))?;
            cu::stream::synchronize(self.stream).map_err(|e| dev_err("upload", e))
        }
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: src holds at least dst.len() bytes.
        unsafe {
            cu::memcpy_dtoh_async(dst, src, self.stream).map_err(|e| dev_err("download", e))?;
            cu::stream::synchronize(self.stream).map_err(|e| dev_err("download", e))
        }
    }

    fn free_memory(&self) -> Option<usize> {
        let _bound = self.bind().ok()?;
        cu::mem_get_info().ok().map(|(free, _total)| free)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: both ranges are device allocations of at least `bytes`.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream) }.map_err(|e| dev_err("copy", e))
    }

    fn launch(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<()> {
        let _bound = self.bind()?;
        let f = *self.functions.get(kernel).ok_or_else(|| Error::Device(format!("no kernel {kernel}")))?;
        let mut words = ArgWords::new(args);
        let mut params = words.pointers();
        // SAFETY: the argument list matches the kernel's signature (checked by the GPU op tests).
        unsafe {
            cu::launch_kernel(f, (grid[0], grid[1], grid[2]), (block[0], block[1], block[2]), shared_bytes, self.stream, &mut params)
        }
        .map_err(|e| dev_err(kernel, e))
    }

    fn launch_early(&self, kernel: &str, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &[Arg]) -> Result<()> {
        if !self.early_launch {
            return self.launch(kernel, grid, block, shared_bytes, args);
        }
        let _bound = self.bind()?;
        let f = *self.functions.get(kernel).ok_or_else(|| Error::Device(format!("no kernel {kernel}")))?;
        let mut words = ArgWords::new(args);
        let mut params = words.pointers();
        // SAFETY: a zeroed attribute is a valid plain-data value; the id and value are then set.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid[0],
            gridDimY: grid[1],
            gridDimZ: grid[2],
            blockDimX: block[0],
            blockDimY: block[1],
            blockDimZ: block[2],
            sharedMemBytes: shared_bytes,
            hStream: self.stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as launch; `config` and `attr` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| dev_err(kernel, e))
    }

    fn synchronize(&self) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the stream is live.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| dev_err("synchronize", e))
    }

    fn begin_capture(&self) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: the stream is live and not capturing.
        unsafe { cu::stream::begin_capture(self.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }
            .map_err(|e| dev_err("begin capture", e))
    }

    fn end_capture(&self) -> Result<u64> {
        let _bound = self.bind()?;
        // SAFETY: the stream is capturing; the graph is destroyed once instantiated.
        unsafe {
            let graph = cu::stream::end_capture(self.stream).map_err(|e| dev_err("end capture", e))?;
            let exec = cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0));
            cu::graph::destroy(graph).ok();
            Ok(exec.map_err(|e| dev_err("graph instantiate", e))? as u64)
        }
    }

    fn launch_graph(&self, graph: u64) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: `graph` came from end_capture and was not destroyed.
        unsafe { cu::graph::launch(graph as sys::CUgraphExec, self.stream) }.map_err(|e| dev_err("graph launch", e))
    }

    fn destroy_graph(&self, graph: u64) {
        if let Ok(_bound) = self.bind() {
            // SAFETY: as above; destroyed once.
            let _ = unsafe { cu::graph::exec_destroy(graph as sys::CUgraphExec) };
        }
    }
}

impl Drop for CudaRuntime {
    fn drop(&mut self) {
        // Held to the end: releasing the context binds it again.
        let bound = self.bind();
        if bound.is_ok() {
            // SAFETY: no buffer outlives the runtime (each holds an Arc to it), so every block of
            // the pool was freed on the stream, and is free once the stream is done; the handles
            // were made in new() (or are null) and are released once.
            unsafe {
                if !self.stream.is_null() {
                    let _ = cu::stream::synchronize(self.stream);
                }
                if !self.module.is_null() {
                    let _ = cu::module::unload(self.module);
                }
                if !self.stream.is_null() {
                    let _ = cu::stream::destroy(self.stream);
                }
                if !self.pool.is_null() {
                    let _ = cu::mem_pool::trim_to(self.pool, 0);
                    let _ = cu::mem_pool::destroy(self.pool);
                }
            }
        }
        // SAFETY: dropped once, here; nothing uses the context after.
        unsafe { ManuallyDrop::drop(&mut self.ctx) };
        drop(bound);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atlas_pool_is_pinned_device_memory_on_its_own_device() {
        let props = pool_props(3).unwrap();
        assert_eq!(props.allocType, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        assert_eq!(props.handleTypes, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
        assert_eq!(props.location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(props.location.id, 3);
        assert!(props.win32SecurityAttributes.is_null());
        assert_eq!(props.maxSize, 0, "no size limit");
        assert!(props.reserved.iter().all(|&b| b == 0), "reserved bytes must be zero");
        assert!(pool_props(usize::MAX).is_err());
    }

    /// A kernel launched by name must be in a list, else the module never looks it up and every
    /// launch of it fails: callers with a fallback (the prefix cache recomputes) only show it as
    /// slowness. (Loading checks the other way: a listed kernel missing from the module is an error.)
    #[test]
    fn every_kernel_launched_by_name_is_loaded() {
        let sources = [include_str!("mod.rs"), include_str!("moe.rs"), include_str!("delta_net.rs")];
        let loaded: Vec<&str> = KERNELS.iter().chain(&MMA_KERNELS).chain(&WGMMA_KERNELS).copied().collect();
        for source in sources {
            for call in ["launch(\"", "launch_early(\""] {
                for (at, _) in source.match_indices(call) {
                    let name = source[at + call.len()..].split('"').next().unwrap_or_default();
                    assert!(loaded.contains(&name), "{name} is launched but not in KERNELS");
                }
            }
        }
    }
}
