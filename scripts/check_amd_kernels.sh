#!/usr/bin/env bash
# Compiles every Atlas kernel for AMD GPUs, without AMD hardware, so that CI catches AMD breakage.
#
# Toolchains (Debian 12 packages, installed with apt-get when missing; run as root):
#   - hipcc (ROCm 5.2, clang 15) with libamdhip64-dev and rocm-device-libs: gfx1100, gfx1030, gfx90a
#   - clang-19 `-x hip --cuda-device-only` over the same HIP headers: gfx1151, gfx942, gfx1200
# ROCm 5.2's device libraries stop at gfx1036/gfx940: the oclc_isa_version_<N>.bc files of the
# newer targets are derived from the gfx1036 one (only its ISA-version constant differs) into a
# private copy of the device-library folder passed with --rocm-device-lib-path.
#
# Where apt refuses bookworm's ROCm runtime (a machine whose glibc came from Debian testing:
# libc6 >= 2.41 Breaks libamdhip64-5 < 5.7.1-5+b1, and libclang-common-15-dev needs bookworm's
# libc6-i386), the same two ROCm 5.2 packages are fetched with `apt-get download` and unpacked
# into the work folder, and clang-19 compiles every target, hipcc's included.
#
# Two kinds of translation unit:
#   - runtime: the exact source HipRuntime hands to hipRTC (kernel_source(): the common headers,
#     then each op file of src/backend/gpu/runtime.rs's list, #include lines removed), compiled the way
#     hipRTC compiles it (__HIPCC_RTC__ defined, HIP's device headers pre-included, no std headers,
#     -O3 -std=c++17); every kernel name HipRuntime looks up must be in the code object. For
#     every target.
#   - each kernels/*.hip alone with -I kernels and <hip/hip_runtime.h> pre-included (the
#     ahead-of-time hipcc route), for gfx1100 (wave32) and gfx90a (wave64), through the front end
#     (-fsyntax-only: every include, declaration and template instantiation, no code generation).
# For gfx1151 and gfx942 the runtime unit is checked once more (front end) without
# __AMDGCN_WAVEFRONT_SIZE, which ROCm 7.2's compiler no longer defines.
# Any compile error fails the script. Outputs (code objects) go to $ATLAS_AMD_WORK
# (default target/amd-kernels). Safe to run again: installed tools are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=${ATLAS_AMD_WORK:-$repo/target/amd-kernels}
mkdir -p "$work"
work=$(cd "$work" && pwd)
export DEBIAN_FRONTEND=noninteractive

say() { echo "check_amd_kernels: $*"; }
die() {
    echo "check_amd_kernels: error: $*" >&2
    exit 1
}

# --- 1. Tools ---------------------------------------------------------------------------------
apt_updated=0
apt_install() { # apt_install PKG...: installs quietly; returns apt's status, keeps its log
    if ((!apt_updated)); then
        apt-get update -qq >"$work/apt-update.log" 2>&1 || {
            cat "$work/apt-update.log" >&2
            die "apt-get update failed"
        }
        apt_updated=1
    fi
    apt-get install -y -q --no-install-recommends "$@" >"$work/apt-install.log" 2>&1
}

if ! command -v clang-19 >/dev/null || ! command -v llvm-as-19 >/dev/null || ! command -v ld.lld-19 >/dev/null; then
    say "installing clang-19, lld-19, llvm-19"
    apt_install clang-19 lld-19 llvm-19 || {
        cat "$work/apt-install.log" >&2
        die "could not install clang-19"
    }
fi

have_system_rocm() {
    command -v hipcc >/dev/null && command -v llvm-as-15 >/dev/null && [[ -f /usr/include/hip/hip_runtime.h ]] &&
        dpkg -s rocm-device-libs >/dev/null 2>&1
}
rocm=$work/rocm-5.2
mode=system
if ! have_system_rocm; then
    if [[ -f $rocm/usr/include/hip/hip_runtime.h ]]; then
        mode=unpacked # apt refused on an earlier run
    else
        say "installing hipcc, libamdhip64-dev, rocm-device-libs (ROCm 5.2)"
        if ! apt_install hipcc libamdhip64-dev rocm-device-libs; then
            mode=unpacked
            say "apt cannot install ROCm 5.2 here ($(grep -m1 -E 'Breaks|Depends' "$work/apt-install.log" | sed 's/^ *//' || true))"
        fi
    fi
fi

if [[ $mode == system ]]; then
    hip_prefix=/usr
    devlib_src=$(dirname "$(dpkg -L rocm-device-libs | grep '/oclc_isa_version_1036\.bc$' | head -n1)")
else
    say "using libamdhip64-dev and rocm-device-libs unpacked from their packages, clang-19 for every target"
    if [[ ! -f $rocm/usr/include/hip/hip_runtime.h ]] || ! compgen -G "$rocm/usr/lib/*/amdgcn/bitcode/ockl.bc" >/dev/null; then
        rm -rf "$work/debs" "$rocm"
        mkdir -p "$work/debs" "$rocm"
        # apt's sandbox user must be able to write the download folder.
        chown _apt "$work/debs" 2>/dev/null || true
        (cd "$work/debs" && apt-get download -q libamdhip64-dev/bookworm rocm-device-libs/bookworm >"$work/apt-download.log" 2>&1) || {
            cat "$work/apt-download.log" >&2
            die "apt-get download of libamdhip64-dev and rocm-device-libs failed"
        }
        for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$rocm"; done
    fi
    hip_prefix=$rocm/usr
    devlib_src=$(dirname "$(compgen -G "$rocm/usr/lib/*/amdgcn/bitcode/oclc_isa_version_1036.bc" | head -n1)")
fi
say "toolchains ready after $SECONDS s ($mode ROCm 5.2 headers and device libraries)"
[[ -f $devlib_src/oclc_isa_version_1036.bc ]] || die "no ROCm device libraries (oclc_isa_version_1036.bc) found"
[[ -f $hip_prefix/include/hip/hip_runtime.h ]] || die "no HIP headers under $hip_prefix/include"

# --- 2. Device libraries with the missing ISA-version files -------------------------------------
# make_devlibs LLVM_VERSION: a copy of the device libraries whose bitcode that LLVM reads back.
make_devlibs() {
    local v=$1 dir=$work/devlibs-$1 name value
    rm -rf "$dir"
    mkdir -p "$dir"
    cp "$devlib_src"/*.bc "$dir"/
    # ISA version = major * 1000 + minor * 100 + stepping (gfx1036 -> 10306, gfx90a -> 9010).
    for pair in 1100:11000 1151:11501 1200:12000 942:9402; do
        name=${pair%%:*} value=${pair##*:}
        [[ -f $dir/oclc_isa_version_$name.bc ]] && continue
        "llvm-dis-$v" -o - "$devlib_src/oclc_isa_version_1036.bc" |
            sed "s/constant i32 10306, align/constant i32 $value, align/" >"$dir/isa_$name.ll"
        grep -q "constant i32 $value, align" "$dir/isa_$name.ll" || die "could not derive oclc_isa_version_$name.bc"
        "llvm-as-$v" -o "$dir/oclc_isa_version_$name.bc" "$dir/isa_$name.ll"
        rm "$dir/isa_$name.ll"
    done
    echo "$dir"
}
devlibs19=$(make_devlibs 19)
if [[ $mode == system ]]; then devlibs15=$(make_devlibs 15); fi

# --- 3. Translation units ------------------------------------------------------------------------
# The runtime's source, built like kernel_source() in src/backend/gpu/runtime.rs: every file it
# include_str!s, in that order (common headers first), with the `#include "..."` lines dropped.
mapfile -t files < <(grep -o 'include_str!("[./]*kernels/[^"]*")' src/backend/gpu/runtime.rs | sed 's|.*"[./]*\(kernels/[^"]*\)")|\1|')
((${#files[@]})) || die "no kernel files found in src/backend/gpu/runtime.rs"
for f in kernels/*.hip kernels/common/*.h; do
    [[ " ${files[*]} " == *" $f "* ]] || say "warning: $f is not in kernel_source() (runtime.rs): the runtime never compiles it"
done
tu=$work/atlas_kernels.hip
for f in "${files[@]}"; do
    grep -v '^#include "' "$f" || true
done >"$tu"
# The names HipRuntime (and CudaRuntime) look up in the module.
mapfile -t kernel_names < <(sed -n '/const KERNELS: \[&str; [0-9]*\] = \[/,/\];/p' src/backend/gpu/cuda.rs | grep -o '"[A-Za-z0-9_]*"' | tr -d '"')
((${#kernel_names[@]})) || die "no KERNELS list found in src/backend/gpu/cuda.rs"

# --- 4. Compile ----------------------------------------------------------------------------------
common=(-x hip --cuda-device-only -O3 -std=c++17)
# A code object, or the front end alone.
object=(--no-gpu-bundle-output -c)
syntax=(-fsyntax-only)
# hipRTC's pre-included header is HIP's device headers preprocessed with __HIPCC_RTC__ defined,
# plus the warp functions (which HIP's headers skip under __HIPCC_RTC__).
rtc=(-Wno-pragma-once-outside-header -D__HIPCC_RTC__ -include hip/hip_runtime.h -include hip/amd_detail/amd_warp_functions.h)
aot=(-include hip/hip_runtime.h -I kernels)
# ROCm 7.2's compiler no longer defines __AMDGCN_WAVEFRONT_SIZE: check the runtime unit once more
# without it (after HIP's own headers, which still use it in 5.2) for a wave32 and a wave64 target
# (-fsyntax-only: the same front end without the code generation, which the full compile above
# already did for the target).
printf '#undef __AMDGCN_WAVEFRONT_SIZE\n#undef __AMDGCN_WAVEFRONT_SIZE__\n' >"$work/no_wave_macro.h"
no_wave_targets=" gfx1151 gfx942 "
aot_targets=" gfx1100 gfx90a "

# compile TOOL TARGET: every translation unit for one target; prints one line, or the errors.
compile() {
    local tool=$1 arch=$2 out=$work/out/$2 f
    local -a cc
    rm -rf "$out"
    mkdir -p "$out"
    if [[ $tool == hipcc ]]; then
        cc=(env DEVICE_LIB_PATH="$devlibs15" hipcc "--offload-arch=$arch")
    else
        cc=(clang++-19 "--offload-arch=$arch" "--hip-path=$hip_prefix" "--rocm-device-lib-path=$devlibs19")
    fi
    nice -n 19 "${cc[@]}" "${common[@]}" "${object[@]}" "${rtc[@]}" "$tu" -o "$out/atlas_kernels.co" ||
        die "$arch ($tool): the runtime translation unit does not compile"
    if [[ $no_wave_targets == *" $arch "* ]]; then
        nice -n 19 "${cc[@]}" "${common[@]}" "${syntax[@]}" "${rtc[@]}" -include "$work/no_wave_macro.h" "$tu" ||
            die "$arch ($tool): the runtime translation unit does not compile without __AMDGCN_WAVEFRONT_SIZE (ROCm >= 7.2)"
    fi
    local syms
    syms=$(llvm-nm-19 --defined-only "$out/atlas_kernels.co" | awk '{print $3}')
    for k in "${kernel_names[@]}"; do
        grep -qx "$k" <<<"$syms" || die "$arch ($tool): kernel $k is missing from the code object"
    done
    # Each file alone shows it includes what it uses: one wave32 and one wave64 target say so, in
    # the front end (-fsyntax-only; the runtime unit above, what actually runs, is compiled in full
    # for every target).
    local files_note=""
    if [[ $aot_targets == *" $arch "* ]]; then
        for f in kernels/*.hip; do
            nice -n 19 "${cc[@]}" "${common[@]}" "${syntax[@]}" "${aot[@]}" "$f" ||
                die "$arch ($tool): $f does not compile"
        done
        files_note=" + $(ls kernels/*.hip | wc -l) files"
    fi
    local mma
    mma=$(llvm-objdump-19 -d "--mcpu=$arch" "$out/atlas_kernels.co" | grep -oE 'v_(wmma|mfma)_[a-z0-9_]+' | sort -u | tr '\n' ' ' || true)
    local extra=""
    [[ $no_wave_targets != *" $arch "* ]] || extra=" (also as ROCm 7.2 sees it)"
    say "$arch: runtime unit (${#kernel_names[@]} kernels)$extra$files_note compiled with $tool; matrix cores: ${mma:-none}"
    touch "$out/.ok"
}

start=$SECONDS
if [[ $mode == system ]]; then hip_tool=hipcc; else hip_tool=clang-19; fi
targets=(gfx1100 gfx1030 gfx90a gfx1151 gfx942 gfx1200)
tools=("$hip_tool" "$hip_tool" "$hip_tool" clang-19 clang-19 clang-19)
# One target per core at a time; each writes its own log.
for i in "${!targets[@]}"; do
    while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
    compile "${tools[$i]}" "${targets[$i]}" >"$work/log-${targets[$i]}.txt" 2>&1 &
done
wait || true
failed=()
for arch in "${targets[@]}"; do
    if [[ -f $work/out/$arch/.ok ]]; then
        grep '^check_amd_kernels: ' "$work/log-$arch.txt" || true
    else
        cat "$work/log-$arch.txt" >&2
        failed+=("$arch")
    fi
done
((${#failed[@]} == 0)) || die "AMD kernels failed to compile for: ${failed[*]}"
# Warnings once each, not once per target.
warnings=$(cat "$work"/log-*.txt | grep -E '^[^ ]+:[0-9]+:[0-9]+: warning: ' | sed "s|^$work/||" | sort -u || true)
[[ -z $warnings ]] || printf 'check_amd_kernels: compiler warnings (all targets):\n%s\n' "$warnings"
echo "AMD kernels: ${#targets[@]} targets compiled (${targets[*]}) in $((SECONDS - start)) s"
