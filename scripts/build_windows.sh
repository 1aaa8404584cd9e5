#!/usr/bin/env bash
# Cross-builds Atlas for Windows x86_64 (x86_64-pc-windows-gnu, with Debian's mingw-w64) and packs
# dist/atlas-<version>-windows-x86_64.zip, one folder of that name holding:
#   atlas.exe, atlas.dll    the command-line tool and the C-ABI library (stripped; they import only
#                           Windows system DLLs: no MinGW runtime DLL to ship beside them)
#   atlas.dll.a             import library for MinGW (GNU ld, clang)
#   atlas.dll.lib           import library for MSVC's link.exe (short import format, as `lib /def`
#                           writes it; named as Rust's MSVC target names it, which
#                           cmake/AtlasConfig.cmake looks for)
#   atlas.def               the exports, for making another import library (`lib /def:atlas.def`)
#   include/atlas.h         the C header, the same as on Linux
#   cmake/                  AtlasConfig.cmake and AtlasConfigVersion.cmake (find_package(Atlas),
#                           with -DAtlas_DIR=<this folder>/cmake or -DATLAS_ROOT=<this folder>)
#   LICENSE-MIT, LICENSE-APACHE, licenses/   Atlas's licence and those of what is linked into it
# The import libraries are checked: every export of atlas.dll is in both, and atlas.dll.lib holds
# only COFF short-import members for atlas.dll on x86-64.
#
# Usage: scripts/build_windows.sh [--no-zip]. Installs what is missing (rustup target; apt-get:
# gcc-mingw-w64-x86-64, zip, llvm for llvm-dlltool; as CI, root on Debian 12). Prints the zip path.
set -euo pipefail
cd "$(dirname "$0")/.."

target=x86_64-pc-windows-gnu
zip=1
[[ ${1:-} == --no-zip ]] && zip=0

say() { echo "build_windows: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# Tools.
rustup target list --installed 2>/dev/null | grep -qx "$target" || rustup target add "$target"
find_tool() { # first of the names that exists
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null && {
            echo "$t"
            return
        }
    done
}
missing=()
command -v x86_64-w64-mingw32-gcc >/dev/null || missing+=(gcc-mingw-w64-x86-64)
command -v zip >/dev/null || missing+=(zip)
[[ -n $(find_tool llvm-dlltool llvm-dlltool-19 llvm-dlltool-16 llvm-dlltool-14) ]] || missing+=(llvm)
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
dlltool=$(find_tool llvm-dlltool llvm-dlltool-19 llvm-dlltool-16 llvm-dlltool-14)
llvm_nm=$(find_tool llvm-nm llvm-nm-19 llvm-nm-16 llvm-nm-14)
readobj=$(find_tool llvm-readobj llvm-readobj-19 llvm-readobj-16 llvm-readobj-14)
[[ -n $dlltool && -n $llvm_nm && -n $readobj ]] || die "llvm-dlltool, llvm-nm and llvm-readobj are needed"
objdump=x86_64-w64-mingw32-objdump
strip=x86_64-w64-mingw32-strip

cargo build --release --locked --target "$target"
tdir=${CARGO_TARGET_DIR:-target}
out=$tdir/$target/release
for f in atlas.exe atlas.dll libatlas.dll.a; do
    [[ -f $out/$f ]] || die "$out/$f was not built"
done

version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml | head -n1)
name=atlas-$version-windows-x86_64
stage=$tdir/windows-dist/$name
rm -rf "$stage"
mkdir -p "$stage/include" "$stage/cmake" "$stage/licenses" dist
[[ -f dist/.gitignore ]] || echo '*' >dist/.gitignore # dist/ is never committed

cp "$out/atlas.exe" "$out/atlas.dll" "$stage/"
"$strip" --strip-unneeded "$stage/atlas.exe" "$stage/atlas.dll"
cp include/atlas.h "$stage/include/"
scripts/stage_cmake.sh "$stage/cmake" "$version"

# Only system DLLs may be imported: anything else would have to ship in the zip.
imports=$("$objdump" -p "$stage/atlas.dll" "$stage/atlas.exe" | sed -n 's/^\tDLL Name: //p' | tr 'A-Z' 'a-z' | sort -u)
for dll in $imports; do
    case $dll in
    kernel32.dll | ntdll.dll | msvcrt.dll | userenv.dll | ws2_32.dll | advapi32.dll | bcrypt.dll | bcryptprimitives.dll | \
        shell32.dll | ole32.dll | api-ms-win-*.dll) ;;
    *) die "atlas.dll/atlas.exe import $dll, which is not part of Windows" ;;
    esac
done

# The exports, as the DLL's export table lists them: every function of the header, and besides
# them only llguidance's own C API (llg_*), which rustc exports from a dependency of a cdylib and
# which PE has no way to hide (on Linux, build.rs keeps it inside). The .def and the import
# libraries name the header's functions alone.
all_exports=$("$objdump" -p "$stage/atlas.dll" | sed -n '/^\[Ordinal\/Name Pointer\] Table/,/^$/p' | sed -n 's/^\t\[ *[0-9]*\] //p' | sort)
declared=$(grep -o '\batlas_[a-z_]*(' include/atlas.h | tr -d '(' | sort -u)
exports=$(grep '^atlas_' <<<"$all_exports" || true)
others=$(grep -v '^atlas_' <<<"$all_exports" | grep -v '^llg_' || true)
[[ -n $exports && $exports == "$declared" && -z $others ]] ||
    die "atlas.dll exports [$(echo $all_exports)], include/atlas.h declares [$(echo $declared)]"
{
    echo "LIBRARY atlas.dll"
    echo "EXPORTS"
    for e in $exports; do echo "    $e"; done
} >"$stage/atlas.def"

# Import libraries: GNU's from the Rust build, MSVC's from the .def.
cp "$out/libatlas.dll.a" "$stage/atlas.dll.a"
"$dlltool" -m i386:x86-64 -d "$stage/atlas.def" -D atlas.dll -l "$stage/atlas.dll.lib"
for lib in atlas.dll.a atlas.dll.lib; do
    syms=$("$llvm_nm" "$stage/$lib" 2>/dev/null)
    for e in $exports; do
        grep -qE "^[0-9a-f ]* T $e\$" <<<"$syms" && grep -qE "^[0-9a-f ]* [TDIS] __imp_$e\$" <<<"$syms" ||
            die "$lib lacks $e or __imp_$e"
    done
done
members=$("$readobj" "$stage/atlas.dll.lib" | grep -E '^(File|Format|Type|Name type|Symbol|Export name):' || true)
n_import=$(grep -c "^Format: COFF-import-file" <<<"$members" || true)
n_exports=$(wc -w <<<"$exports")
# One short-import member per export, plus the import descriptor objects.
((n_import == n_exports)) || die "atlas.dll.lib: $n_import COFF short-import members for $n_exports exports"
grep -q "^Format: COFF-x86-64" <<<"$members" || die "atlas.dll.lib: no x86-64 import descriptor"

# Licences: Atlas's (MIT OR Apache-2.0, the repository's own files), then everything linked into the
# binaries: the crates (normal dependencies for this target, from cargo metadata, with their licence
# and NOTICE files: scripts/third_party.py) and the MinGW-w64 runtime objects.
cp LICENSE-MIT LICENSE-APACHE "$stage/"
python3 scripts/third_party.py --target "$target" --out "$stage/licenses/THIRD-PARTY-CRATES.txt"
for f in mingw-w64-x86-64-dev gcc-mingw-w64-base; do
    [[ -f /usr/share/doc/$f/copyright ]] && cp "/usr/share/doc/$f/copyright" "$stage/licenses/$f.copyright.txt"
done
cat >"$stage/licenses/README.txt" <<'EOF'
THIRD-PARTY-CRATES.txt: the Rust crates compiled into atlas.dll and atlas.exe.
mingw-w64-x86-64-dev.copyright.txt: the MinGW-w64 runtime startup code linked into both (ZPL-2.1 and others).
gcc-mingw-w64-base.copyright.txt: GCC's support library (libgcc), under the GCC Runtime Library Exception.
EOF

if ((zip)); then
    rm -f "dist/$name.zip"
    zipfile=$PWD/dist/$name.zip
    (cd "$tdir/windows-dist" && zip -q -r -X "$zipfile" "$name")
    say "dist/$name.zip: $(zip -sf "dist/$name.zip" | tail -n1)"
    echo "dist/$name.zip"
else
    echo "$stage"
fi
