#!/usr/bin/env bash
# Atlas beside llama.cpp on the very same GGUF files, on a CUDA machine (../shared/BENCHMARKING.md
# in the project's workplace; docs/benchmarks.md has the results): builds llama-bench and
# llama-quantize from a llama.cpp source tree (in the background), writes the Qwen3-8B-shape BF16
# GGUF with gguf-py, quantizes it to each TYPE with llama-quantize, and runs both benches on each
# file: pp512, pp4096, tg128, and tg128 at depth 8192. Steps whose output exists are skipped, so
# a second call on a warm machine resumes.
#
# ATLAS_ONLY=1 skips llama-bench (llama-quantize still writes the files).
#
# Usage: scripts/bench_vs_llama.sh ATLAS_BIN LLAMA_SRC MAKE_RANDOM_QWEN3_GGUF_PY WORK_DIR TYPE...
#   e.g. scripts/bench_vs_llama.sh devbin/atlas devbin/llama.cpp devbin/make_random_qwen3_gguf.py /tmp/bench Q4_K_M Q8_0
set -euo pipefail
[[ $# -ge 5 ]] || { sed -n 2,13p "$0"; exit 2; }
atlas=$(realpath "$1") src=$(realpath "$2") maker=$(realpath "$3") work=$4
shift 4
mkdir -p "$work"
build=$work/llama-build
builder=
if [[ ! -x $build/bin/llama-bench || ! -x $build/bin/llama-quantize ]]; then
    (cmake -S "$src" -B "$build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF >"$work/cmake.log" 2>&1 &&
        cmake --build "$build" --target llama-bench llama-quantize -j"$(nproc)" >"$work/build.log" 2>&1) &
    builder=$!
fi
bf16=$work/qwen3-8b-bf16.gguf
if [[ ! -f $bf16 ]]; then
    PYTHONPATH=$src/gguf-py python3 "$maker" "$bf16.part" 4096 12288 36 32 8 151936 >"$work/write.log" 2>&1
    mv "$bf16.part" "$bf16"
fi
if [[ -n $builder ]] && ! wait "$builder"; then
    tail -n 20 "$work/cmake.log" "$work/build.log"
    exit 1
fi
for type in "$@"; do
    file=$work/qwen3-8b-$type.gguf
    if [[ ! -f $file ]]; then
        "$build/bin/llama-quantize" "$bf16" "$file.part" "$type" "$(nproc)" >"$work/quantize-$type.log" 2>&1
        mv "$file.part" "$file"
    fi
    echo "== $type ($(du -h "$file" | cut -f1)): Atlas"
    "$atlas" bench -m "$file" -c 8448 -p 512,4096 -n 128 -r 3
    "$atlas" bench -m "$file" -c 8448 -p 0 -n 128 -d 8192 -r 2
    [[ ${ATLAS_ONLY:-0} == 1 ]] && continue
    echo "== $type: llama.cpp"
    "$build/bin/llama-bench" -m "$file" -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3
    "$build/bin/llama-bench" -m "$file" -ngl 99 -fa 1 -p 0 -n 128 -d 8192 -r 2
done
