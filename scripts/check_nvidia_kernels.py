#!/usr/bin/env python3
"""Compiles Atlas's kernels for NVIDIA GPUs with NVRTC, without a GPU: the same source CudaRuntime
hands NVRTC at run time (kernel_source() in src/backend/gpu/runtime.rs: the common headers, then
each op file, #include lines removed) and the same options, for sm_80, sm_90 and sm_90a (Hopper,
where the wgmma kernels exist). NVRTC comes from
the `nvidia-cuda-nvrtc` wheel (pip); pass its libnvrtc.so with --nvrtc or let the script find it
in the installed package. Any compile error fails the script, and so does ptxas's advice that it
serialised wgmma products (C7515); the log is printed."""
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
    ok = True
    for arch in args.arch or ["sm_80", "sm_90", "sm_90a"]:
        prog = ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"atlas.cu", 0, None, None):
            sys.exit("check_nvidia_kernels: nvrtcCreateProgram failed")
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if rc != 0:
            ok = False
            print(f"check_nvidia_kernels: {arch}: FAILED\n{text}")
        elif "C7515" in text:
            # ptxas serialises the wgmma GEMMs' products (an accumulator defined while one runs).
            ok = False
            print(f"check_nvidia_kernels: {arch}: FAILED: wgmma serialised\n{text}")
        else:
            print(f"check_nvidia_kernels: {arch}: ok ({len(files)} files)" + (f"\n{text}" if text else ""))
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
