#!/usr/bin/env bash
# Atlas beside llama.cpp on the CPU, on the very same GGUF files and thread count, one engine after
# the other for each file (docs/benchmarks.md, "CPU"): SmolLM2-135M-Instruct Q4_1 (`atlas setup`'s
# default model: pp128, tg64) and a Qwen3-0.6B-shaped random BF16 GGUF quantised by llama-quantize
# to Q8_0 and Q4_K_M (pp512, tg128). Each run's peak RSS comes from /usr/bin/time. The machine is
# noisy: compare the two engines' ratios from one run, not absolute numbers across runs. Atlas
# runs with --cpu-kernels auto (its integer kernels, the default; `reference` is the f32 oracle).
#
# The 0.6B file: ../shared/tools/make_random_qwen3_gguf.py OUT 1024 3072 28 16 8 151936 (gguf-py
# from the llama.cpp tree on PYTHONPATH). llama.cpp CPU-only: cmake -DGGML_CUDA=OFF, targets
# llama-bench and llama-quantize (~10 minutes on 2 cores).
#
# Usage: scripts/bench_cpu_vs_llama.sh ATLAS_BIN LLAMA_BUILD_DIR SMOLLM2_GGUF QWEN3_06B_BF16_GGUF WORK_DIR [THREADS]
set -euo pipefail
[[ $# -ge 5 ]] || { sed -n 2,13p "$0"; exit 2; }
atlas=$(realpath "$1") llama=$(realpath "$2") smollm2=$(realpath "$3") bf16=$(realpath "$4") work=$5
threads=${6:-$(nproc)}
mkdir -p "$work"
for type in Q8_0 Q4_K_M; do
    [[ -f $work/qwen3-0.6b-$type.gguf ]] || "$llama/bin/llama-quantize" "$bf16" "$work/qwen3-0.6b-$type.gguf" "$type" >"$work/quantize-$type.log" 2>&1
done

# One engine on one file: its table rows, then its peak RSS.
run() {
    local name=$1 file=$2 p=$3 n=$4
    local log=$work/$name-$(basename "$file" .gguf).log
    if [[ $name == llama.cpp ]]; then
        /usr/bin/time -v "$llama/bin/llama-bench" -m "$file" -t "$threads" -p "$p" -n "$n" -r 3 >"$log" 2>&1
    else
        /usr/bin/time -v "$atlas" bench --model "$file" --device cpu --cpu-kernels auto -t "$threads" -p "$p" -n "$n" -r 3 >"$log" 2>&1
    fi
    echo "== $name $(basename "$file") ($threads threads)"
    grep -E '^\|' "$log" | grep -vE '^\| (model|---)' || true
    grep 'Maximum resident' "$log" | awk '{printf "peak RSS %.0f MB\n", $NF / 1024}'
}

run llama.cpp "$smollm2" 128 64
run atlas "$smollm2" 128 64
for type in Q8_0 Q4_K_M; do
    run llama.cpp "$work/qwen3-0.6b-$type.gguf" 512 128
    run atlas "$work/qwen3-0.6b-$type.gguf" 512 128
done
