#!/usr/bin/env bash
# Release archives a host (Lemonade's backend_versions.json above all) can pin, into dist/:
#   atlas-<version>-linux-x86_64.tar.gz    one folder of that name: lib/libatlas.so, bin/atlas,
#                                          include/atlas.h, cmake/ (find_package(Atlas) with
#                                          -DATLAS_ROOT=<folder>), LICENSE-MIT, LICENSE-APACHE,
#                                          licenses/THIRD-PARTY-CRATES.txt, the SBOM, README.txt
#   atlas-<version>-windows-x86_64.zip     scripts/build_windows.sh's zip, with its SBOM added
#   atlas-<version>-SHA256SUMS             `sha256sum -c` format, both archives
#   atlas-<version>-checksums.json         the block to merge into Lemonade's backend_versions.json:
#                                          checksums.github.<repo>.v<version>.<archive> = "sha256:<hex>"
# Checks before packing: `atlas --version` and the library's atlas_version() both report Cargo.toml's
# version, which the archive names carry. The same commit gives the same archives, byte for byte
# (file times from the commit, sorted names, the SBOM's serial number from its content, PE
# timestamps from SOURCE_DATE_EPOCH). Not in CI: it needs cargo-cyclonedx (scripts/sbom.sh). The Linux build needs the glibc of the machine it runs
# on or newer (printed; build releases on the oldest distribution they should run on).
#
#   scripts/release.sh                     # ATLAS_RELEASE_REPO=owner/name (where the archives are
#                                          # published; default atlas-engine/atlas)
set -euo pipefail
cd "$(dirname "$0")/.."

repo=${ATLAS_RELEASE_REPO:-atlas-engine/atlas}
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml | head -n1)
say() { echo "release: $*" >&2; }
die() {
    say "$*"
    exit 1
}
mkdir -p dist
[[ -f dist/.gitignore ]] || echo '*' >dist/.gitignore # dist/ is never committed

cargo build --release --locked
reported=$(target/release/atlas --version | awk '{print $NF}')
[[ $reported == "$version" ]] || die "atlas --version says $reported, Cargo.toml $version"
# The library's own answer, through the C ABI.
probe=$(mktemp -d)
printf '#include <stdio.h>\n#include "atlas.h"\nint main(void) { puts(atlas_version()); return 0; }\n' >"$probe/v.c"
cc -Iinclude "$probe/v.c" -Ltarget/release -latlas -Wl,-rpath,"$PWD/target/release" -o "$probe/v"
library=$("$probe/v")
rm -rf "$probe"
[[ $library == "$version" ]] || die "atlas_version() says $library, Cargo.toml $version"

scripts/sbom.sh >/dev/null

linux=atlas-$version-linux-x86_64
stage=target/release-dist/$linux
rm -rf "$stage"
mkdir -p "$stage/lib" "$stage/bin" "$stage/include" "$stage/licenses"
cp target/release/libatlas.so "$stage/lib/"
cp target/release/atlas "$stage/bin/"
strip --strip-unneeded "$stage/lib/libatlas.so" "$stage/bin/atlas"
cp include/atlas.h "$stage/include/"
scripts/stage_cmake.sh "$stage/cmake" "$version"
cp LICENSE-MIT LICENSE-APACHE "$stage/"
cp "dist/THIRD-PARTY-x86_64-unknown-linux-gnu.txt" "$stage/licenses/THIRD-PARTY-CRATES.txt"
cp "dist/atlas-$version-x86_64-unknown-linux-gnu.cdx.json" "$stage/$linux.cdx.json"
# Weak references (resolved as absent on an older glibc) do not count.
glibc=$(objdump -T "$stage/lib/libatlas.so" "$stage/bin/atlas" | grep -v ' w  ' | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n1)
needed=$(objdump -p "$stage/lib/libatlas.so" | awk '/NEEDED/ {print $2}' | tr '\n' ' ')
cat >"$stage/README.txt" <<EOF
Atlas $version for Linux x86_64: LLM inference with its own GPU kernels, as a C-ABI library.
lib/libatlas.so   the library (include/atlas.h); needs ${glibc/_/ } or newer and: $needed
bin/atlas         the command-line tool (atlas --help)
cmake/            find_package(Atlas CONFIG) with -DATLAS_ROOT=<this folder>: target atlas::atlas
$linux.cdx.json   the software bill of materials (CycloneDX 1.5): every crate compiled in
licenses/         the licences of those crates; Atlas itself: LICENSE-MIT or LICENSE-APACHE
GPU runtimes (CUDA driver, HIP) are opened at run time when present; none is needed for the CPU.
EOF
rm -f "dist/$linux.tar.gz"
# Sorted names, fixed owner and times: the same tree gives the same archive.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$(git log -1 --format=%ct)" \
    -C target/release-dist -cf - "$linux" | gzip -n -9 >"dist/$linux.tar.gz"

windows=atlas-$version-windows-x86_64
# SOURCE_DATE_EPOCH: binutils writes it (not the time of day) into the stripped PE headers.
stage_win=$(SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) scripts/build_windows.sh --no-zip)
cp "dist/atlas-$version-x86_64-pc-windows-gnu.cdx.json" "$stage_win/$windows.cdx.json"
rm -f "dist/$windows.zip"
(cd "$(dirname "$stage_win")" && TZ=UTC find "$windows" -exec touch -h -d "@$(git -C "$OLDPWD" log -1 --format=%ct)" {} + &&
    find "$windows" | LC_ALL=C sort | zip -q -X -D "$OLDPWD/dist/$windows.zip" -@)

(cd dist && sha256sum "$linux.tar.gz" "$windows.zip" >"atlas-$version-SHA256SUMS")
python3 - "$repo" "$version" "dist/atlas-$version-SHA256SUMS" >"dist/atlas-$version-checksums.json" <<'EOF'
import json, sys
repo, version, sums = sys.argv[1:]
assets = {}
for line in open(sums):
    digest, name = line.split()
    assets[name] = f"sha256:{digest}"
print(json.dumps({"checksums": {"github": {repo: {f"v{version}": assets}}}}, indent=2))
EOF
say "Linux build needs ${glibc/_/ }+; archives and checksums:"
(cd dist && ls -l "$linux.tar.gz" "$windows.zip" "atlas-$version-SHA256SUMS" "atlas-$version-checksums.json" >&2)
