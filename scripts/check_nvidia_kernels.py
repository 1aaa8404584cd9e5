#!/usr/bin/env python3
"""Compiles Atlas's kernels for NVIDIA GPUs with NVRTC, without a GPU: the same source CudaRuntime
hands NVRTC at run time (kernel_source() in src/backend/gpu/runtime.rs: the common headers, then
each op file, #include lines removed) and the same options, for sm_80, sm_90 and sm_90a (Hopper,
where the wgmma kernels exist). NVRTC comes from
the `nvidia-cuda-nvrtc` wheel (pip); pass its libnvrtc.so with --nvrtc or let the script find it
in the installed package. Any compile error fails the script, and so does ptxas's advice that it
serialised wgmma products (C7515); the log is printed. So does a GEMV kernel whose static shared
memory (ptxas's report) exceeds the bound the host adds to its dynamic shared memory when it checks
that a launch fits (the *STATIC_SHARED constants of src/backend/gpu/mod.rs): such a launch could
pass the host's check and fail on the device."""
import argparse, ctypes, glob, os, re, sys, site

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_source():
    text = open(os.path.join(ROOT, "src/backend/gpu/runtime.rs")).read()
    files = re.findall(r'include_str!\("\.\./\.\./\.\./(kernels/[^"]+)"\)', text)
    if not files:
        sys.exit("check_nvidia_kernels: no kernel files listed in runtime.rs")
    out = []
    for f in files:
        lines = open(os.path.join(ROOT, f)).read().split("\n")
        out.append("\n".join(l for l in lines if not l.startswith('#include "')))
    return "\n".join(out) + "\n", files


def compile_program(lib, src, arch, cubin=False):
    """NVRTC's exit code, its log (with ptxas's resource report) and, when asked, the cubin."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"atlas.cu", 0, None, None):
        sys.exit("check_nvidia_kernels: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    binary = None
    if cubin and rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        binary = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), binary


def resources(log):
    """kernel -> (registers, spill stores + loads in bytes, shared bytes) from ptxas's report."""
    out, name, spill = {}, None, 0
    for line in log.split("\n"):
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spill = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and name:
            out[name] = (int(m.group(1)), spill, int(m.group(2)))
            spill = 0
    return out


def static_shared_bound(kernel, bounds):
    """The host's bound on `kernel`'s static shared memory (GpuWeight::gemv1_group, the MoE fits
    checks), or None where the host checks no such bound."""
    if kernel.startswith("gemv1_") and "bf16" in kernel and "_mma" not in kernel:
        return "GEMV_STATIC_SHARED"
    if kernel.startswith("gemv1_") and re.search(r"_tokens(_async)?$", kernel):
        return "FP8_GEMV1_STATIC_SHARED"
    if kernel.startswith("gemv1_") or (kernel.startswith(("moe_gate_up_", "moe_down_")) and "bf16" not in kernel):
        return "FP8_GEMV_STATIC_SHARED"
    return None


def host_bounds():
    text = open(os.path.join(ROOT, "src/backend/gpu/mod.rs")).read()
    bounds = {k: int(v.replace("_", "")) for k, v in re.findall(r"const (\w*STATIC_SHARED): u32 = ([\d_]+);", text)}
    if not {"GEMV_STATIC_SHARED", "FP8_GEMV_STATIC_SHARED", "FP8_GEMV1_STATIC_SHARED"} <= bounds.keys():
        sys.exit("check_nvidia_kernels: the *STATIC_SHARED constants are missing from src/backend/gpu/mod.rs")
    return bounds


def find_nvrtc(explicit):
    if explicit:
        return explicit
    roots = site.getsitepackages() + [site.getusersitepackages()]
    for r in roots:
        hits = sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib", "libnvrtc.so.*")))
        hits = [h for h in hits if re.search(r"libnvrtc\.so\.\d+$", h)]
        if hits:
            return hits[-1]
    sys.exit("check_nvidia_kernels: libnvrtc not found (pip install nvidia-cuda-nvrtc)")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nvrtc", help="path of libnvrtc.so.N")
    ap.add_argument("--arch", action="append", help="sm_XX (repeatable; default sm_80, sm_90 and sm_90a)")
    args = ap.parse_args()
    lib = ctypes.CDLL(find_nvrtc(args.nvrtc))
    src, files = kernel_source()
    bounds = host_bounds()
    ok = True
    for arch in args.arch or ["sm_80", "sm_90", "sm_90a"]:
        rc, full, _ = compile_program(lib, src, arch)
        # ptxas's resource report, read below, is no message of its own.
        text = "\n".join(l for l in full.split("\n") if not re.match(r"ptxas( info|\s+\.)", l)).strip()
        over = [
            f"{k}: {smem} bytes of static shared memory, above {b} ({bounds[b]})"
            for k, (_, _, smem) in sorted(resources(full).items())
            if (b := static_shared_bound(k, bounds)) and smem > bounds[b]
        ]
        if rc != 0:
            ok = False
            print(f"check_nvidia_kernels: {arch}: FAILED\n{text}")
        elif "C7515" in full:
            # ptxas serialises the wgmma GEMMs' products (an accumulator defined while one runs).
            ok = False
            print(f"check_nvidia_kernels: {arch}: FAILED: wgmma serialised\n{text}")
        elif over:
            ok = False
            print(f"check_nvidia_kernels: {arch}: FAILED: the host's shared-memory bounds are too small\n" + "\n".join(over))
        else:
            print(f"check_nvidia_kernels: {arch}: ok ({len(files)} files)" + (f"\n{text}" if text else ""))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
