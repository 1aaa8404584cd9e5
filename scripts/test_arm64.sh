#!/usr/bin/env bash
# arm64 without an arm64 machine: cross-builds the CPU tests for aarch64-unknown-linux-gnu and runs
# them under qemu-user, on two emulated CPUs:
#   1. qemu's `max` CPU (Armv8 with the dot-product extension): detection must choose the NEON
#      kernel (`neon-dotprod`), whose products must have the scalar kernel's bits and stay within
#      the f32 reference's bounds (quant::), the CPU backend's units (backend::cpu::), and a
#      block-format hybrid model end to end (tests/gguf_hybrid.rs) on the kernel auto chooses;
#   2. a Cortex-A53 (Armv8.0, no dot products): detection must fall back to the scalar kernel.
# qemu gives no timings worth reading: arm64 speed is not measured here.
#
# Installs what is missing with apt-get (qemu-user, gcc-aarch64-linux-gnu, libc6-dev-arm64-cross;
# as CI, root on Debian 12) and the rustup target. About 4 minutes on 2 cores, most of it compiling.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
say() { echo "test_arm64: $*" >&2; }

missing=()
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >"${TMPDIR:-/tmp}/atlas-apt-arm64.log" 2>&1 || {
        cat "${TMPDIR:-/tmp}/atlas-apt-arm64.log" >&2
        say "FAIL: apt-get install ${missing[*]}"
        exit 1
    }
fi
rustup target list --installed 2>/dev/null | grep -qx "$target" || rustup target add "$target"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# Warnings that only arm64 sees (cfg-dependent code) fail the run, as clippy -D warnings does on x86-64.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-D warnings"
emulate() { # the CPU qemu emulates for what follows
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $1 -L /usr/aarch64-linux-gnu"
}
tests=(cargo test --release --locked --target "$target")

say "--- cross-building"
"${tests[@]}" --lib --test gguf_hybrid --no-run

say "--- qemu max (dot products): the NEON kernel"
emulate max
ATLAS_EXPECT_DOT_KERNEL=neon-dotprod "${tests[@]}" --lib -- quant:: backend::cpu::
"${tests[@]}" --test gguf_hybrid

say "--- qemu cortex-a53 (no dot products): the scalar kernel"
emulate cortex-a53
ATLAS_EXPECT_DOT_KERNEL=scalar "${tests[@]}" --lib -- quant::q8dot
say "passed"
