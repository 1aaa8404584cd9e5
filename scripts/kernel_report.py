#!/usr/bin/env python3
"""What the compiler made of Atlas's NVIDIA kernels, without a GPU: registers, spills and shared
memory per kernel (ptxas's report), and with --sass the machine code's instructions (counted by
opcode) between the first and the last matrix instruction of each kernel -- a kernel's inner loop,
unrolled. The source is compiled as CudaRuntime compiles it (check_nvidia_kernels.py's
kernel_source and options); NVRTC comes from the `nvidia-cuda-nvrtc` wheel, cuobjdump and the
nvdisasm it runs from the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels (pip; or give
the paths).

    python3 scripts/kernel_report.py 'gemv1_(nvfp4|q4_k)$' --sass

Instructions per weight value of a loop = its count over (matrix instructions x the values each
lane feeds one of them). Decode GEMVs with too few warps an SM to hide latency slow down with the
instructions their loops issue (docs/benchmarks.md)."""
import argparse, collections, ctypes, glob, importlib.util, os, re, site, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("check_nvidia_kernels", os.path.join(HERE, "check_nvidia_kernels.py"))
nvk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nvk)


def find_tool(name, explicit):
    if explicit:
        return explicit
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "bin", name)))
        if hits:
            return hits[-1]
    sys.exit(f"kernel_report: {name} not found (pip install nvidia-cuda-{name}, or --{name} PATH)")


def compile_cubin(lib, arch):
    src, _ = nvk.kernel_source()
    rc, log, cubin = nvk.compile_program(lib, src, arch, cubin=True)
    if rc != 0:
        sys.exit(f"kernel_report: {arch}: compile failed\n{log}")
    return log, cubin


def loop_opcodes(tools, cubin_path, kernel):
    """Opcodes between the kernel's first and last matrix instruction (HMMA/IMMA/HGMMA)."""
    cuobjdump, nvdisasm = tools
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(nvdisasm))
    sass = subprocess.run([cuobjdump, "-sass", "-fun", kernel, cubin_path], capture_output=True, text=True, check=True, env=env).stdout
    ops = []
    for line in sass.split("\n"):
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops.append(m.group(1))
    marks = [i for i, op in enumerate(ops) if op in ("HMMA", "IMMA", "HGMMA", "QGMMA")]
    return ops, ops[marks[0]:marks[-1] + 1] if marks else []


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pattern", help="regular expression matched against kernel names")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--sass", action="store_true", help="count each matching kernel's instructions (cuobjdump)")
    ap.add_argument("--nvrtc", help="path of libnvrtc.so.N")
    ap.add_argument("--cuobjdump", help="path of cuobjdump")
    ap.add_argument("--nvdisasm", help="path of nvdisasm")
    args = ap.parse_args()
    lib = ctypes.CDLL(nvk.find_nvrtc(args.nvrtc))
    log, cubin = compile_cubin(lib, args.arch)
    res = {k: v for k, v in nvk.resources(log).items() if re.search(args.pattern, k)}
    if not res:
        sys.exit(f"kernel_report: no kernel matches {args.pattern!r}")
    tools = (find_tool("cuobjdump", args.cuobjdump), find_tool("nvdisasm", args.nvdisasm)) if args.sass else None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        print(f"{'kernel':44} {'regs':>4} {'spill':>5} {'smem':>6}" + ("  instructions  mma  loop  top opcodes of the loop" if args.sass else ""))
        for name in sorted(res):
            regs, spill, smem = res[name]
            line = f"{name:44} {regs:4} {spill:5} {smem:6}"
            if tools:
                ops, loop = loop_opcodes(tools, f.name, name)
                mma = sum(op in ("HMMA", "IMMA", "HGMMA", "QGMMA") for op in ops)
                top = " ".join(f"{op}:{n}" for op, n in collections.Counter(loop).most_common(6))
                line += f"  {len(ops):12} {mma:4} {len(loop):5}  {top}"
            print(line)


if __name__ == "__main__":
    main()
