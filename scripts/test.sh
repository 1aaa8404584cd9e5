#!/usr/bin/env bash
# Builds once in release and runs every test (unit, integration, golden).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked
cargo test --release --locked
