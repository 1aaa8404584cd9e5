#!/usr/bin/env bash
# Builds the C++ wrapper (cpp_adapter/) with CMake against the already-built
# target/release/libatlas.so and runs its ctest suite: plain, then under AddressSanitizer + UBSan
# with leak detection. It does not build the crate: run `cargo build --release` (or scripts/test.sh)
# first. Installs cmake (and a C++ compiler, make) with apt-get when missing, as CI (root, Debian 12) needs.
set -euo pipefail
cd "$(dirname "$0")/.."

lib=$PWD/target/release/libatlas.so
if [[ ! -f $lib ]]; then
    echo "$lib is missing: run cargo build --release first" >&2
    exit 1
fi

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v c++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
if ((${#missing[@]})); then
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
fi

# build_and_test DIR CXXFLAGS: configure, build and run the suite in DIR.
build_and_test() {
    cmake -S cpp_adapter -B "$1" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="$2" -DATLAS_LIBRARY="$lib"
    cmake --build "$1" -j "$(nproc)"
    ctest --test-dir "$1" --output-on-failure
}

build_and_test target/cpp-build "-Werror"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    build_and_test target/cpp-build-asan "-Werror -g -fsanitize=address,undefined -fno-omit-frame-pointer"
