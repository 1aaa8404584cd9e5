#!/usr/bin/env bash
# Puts the CMake package files into DEST for an archive of Atlas VERSION: AtlasConfig.cmake as it
# is, and AtlasConfigVersion.cmake with the version written in (in the repository it reads
# ../Cargo.toml, which an archive does not hold). Used by scripts/release.sh and build_windows.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: $0 DEST VERSION" >&2; exit 1; }
dest=$1 version=$2
mkdir -p "$dest"
cp cmake/AtlasConfig.cmake "$dest/"
sed "s|^file(STRINGS .*Cargo\.toml.*|set(_atlas_version \"$version\")  # written in when packed|" \
    cmake/AtlasConfigVersion.cmake >"$dest/AtlasConfigVersion.cmake"
grep -q "^set(_atlas_version \"$version\")" "$dest/AtlasConfigVersion.cmake" ||
    { echo "stage_cmake: could not write the version into AtlasConfigVersion.cmake" >&2; exit 1; }
