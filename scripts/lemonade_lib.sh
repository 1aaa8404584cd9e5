# Shared by scripts/lemonade_patches.sh and scripts/lemonade_e2e.sh (sourced, not run): the
# Lemonade commit the patch series applies to, and how a patched Lemonade tree is configured and
# built here without network access.
#
# Build settings (environment):
#   LEMONADE_BUILD_TYPE   CMake build type (Debug: the quickest to compile; Release for speed)
#   LEMONADE_FETCH_DIRS   extra "-DFETCHCONTENT_SOURCE_DIR_<NAME>=<dir>" arguments, for the
#                         dependencies whose Debian packages are too old (docs/lemonade.md)
#   LEMONADE_JOBS         build jobs (default: all cores)

ATLAS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Lemonade 11.7.0 (lemonade-sdk/lemonade, 2026-08-22), the commit the patches are made against.
LEMONADE_COMMIT=e385039ed33551de7f54cb73194cd08088772c08
PATCH_DIR=$ATLAS_ROOT/cpp_adapter/lemonade/patches
# Fixed identity and dates, so that regenerating the series changes only what changed.
export GIT_AUTHOR_NAME="Atlas developers" GIT_AUTHOR_EMAIL="atlas@localhost"
export GIT_COMMITTER_NAME="Atlas developers" GIT_COMMITTER_EMAIL="atlas@localhost"
export GIT_AUTHOR_DATE="2026-12-01T00:00:00Z" GIT_COMMITTER_DATE="2026-12-01T00:00:00Z"

# lemond keeps its runtime files (a lock, the admin socket) under XDG_RUNTIME_DIR and refuses to
# start without one (a login session has it; a container or CI job often does not).
if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
    XDG_RUNTIME_DIR=$(mktemp -d)
    export XDG_RUNTIME_DIR
fi

say() { echo "lemonade: $*"; }
die() { echo "lemonade: error: $*" >&2; exit 1; }

# Checks that $1 is a git checkout of Lemonade holding LEMONADE_COMMIT with nothing uncommitted,
# then puts branch $2 at that commit.
lemonade_checkout() {
    local src=$1 branch=$2
    git -C "$src" rev-parse --git-dir >/dev/null 2>&1 || die "$src is not a git checkout of lemonade-sdk/lemonade"
    git -C "$src" cat-file -e "$LEMONADE_COMMIT^{commit}" 2>/dev/null \
        || die "$src lacks commit $LEMONADE_COMMIT (git -C $src fetch origin)"
    [ -z "$(git -C "$src" status --porcelain --untracked-files=no)" ] || die "$src has uncommitted changes"
    git -C "$src" checkout -q -B "$branch" "$LEMONADE_COMMIT"
}

# Builds libatlas, configures $1/build (Ninja) with Atlas registered, and builds the given
# targets. Logs: $1/build/atlas-configure.log and atlas-build.log.
lemonade_build() {
    local src=$1
    shift
    (cd "$ATLAS_ROOT" && cargo build --release --quiet) || die "cargo build of Atlas (libatlas, atlas) failed"
    mkdir -p "$src/build"
    local fetch_dirs=()
    read -r -a fetch_dirs <<<"${LEMONADE_FETCH_DIRS:-}"
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE="${LEMONADE_BUILD_TYPE:-Debug}" \
        -DBUILD_WEB_APP=OFF -DBUILD_TESTING=ON -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
        -DATLAS_SOURCE_DIR="$ATLAS_ROOT" "${fetch_dirs[@]}" >"$src/build/atlas-configure.log" 2>&1 \
        || { tail -30 "$src/build/atlas-configure.log"; die "cmake configure failed (log: $src/build/atlas-configure.log)"; }
    nice -n 10 cmake --build "$src/build" -j "${LEMONADE_JOBS:-$(nproc)}" --target "$@" >"$src/build/atlas-build.log" 2>&1 \
        || { tail -30 "$src/build/atlas-build.log"; die "build of $* failed (log: $src/build/atlas-build.log)"; }
}
