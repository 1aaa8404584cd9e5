#!/usr/bin/env bash
# Regenerates cpp_adapter/lemonade/patches/: the change that adds Atlas to a Lemonade tree, as a
# patch series against LEMONADE_COMMIT (scripts/lemonade_lib.sh), from the files of this
# repository. Run it after changing anything in cpp_adapter/lemonade/, server_models.json or
# backend_versions.json; scripts/lemonade_e2e.sh applies the series and checks it is current.
#
#   scripts/lemonade_patches.sh LEMONADE_SRC    # a git checkout of lemonade-sdk/lemonade
#
# It commits on a branch `atlas-patches` in LEMONADE_SRC (the checkout must be clean):
#   1. the backend (descriptor, server, test) and its CMake lines
#   2. the model entries and the version pin
#   3. Lemonade's config accepting the sections of in-process backends (`lemonade config set
#      atlas.backend=cpu`), which it refused because Atlas has no binary
#   4. the files Lemonade generates from the descriptors (docs/tools/gen_backend_boilerplate.py,
#      which boots the lemond built from 1-3: this step builds lemond, see lemonade_lib.sh)
# then writes them with `git format-patch`.
set -euo pipefail
source "$(dirname "$0")/lemonade_lib.sh"

[ $# -eq 1 ] || die "usage: $0 LEMONADE_SRC"
src=$(cd "$1" && pwd)
lemonade_checkout "$src" atlas-patches

say "1/4 the backend and its CMake lines"
glue=$ATLAS_ROOT/cpp_adapter/lemonade
mkdir -p "$src/src/cpp/include/lemon/backends/atlas" "$src/src/cpp/server/backends/atlas"
cp "$glue/include/lemon/backends/atlas/atlas.h" "$glue/include/lemon/backends/atlas/atlas_server.h" "$src/src/cpp/include/lemon/backends/atlas/"
cp "$glue/server/backends/atlas/atlas_server.cpp" "$src/src/cpp/server/backends/atlas/"
cp "$glue/test/test_atlas_backend.cpp" "$src/test/cpp/"
python3 - "$src/CMakeLists.txt" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()

def insert(anchor, addition, after=True):
    global text
    if text.count(anchor) != 1:
        sys.exit(f"CMakeLists.txt: expected one {anchor!r}")
    text = text.replace(anchor, anchor + addition if after else addition + anchor)

insert('    "openmoss|openmoss"\n', '    "atlas|atlas"\n')
insert('add_executable(${EXECUTABLE_NAME} src/cpp/server/main.cpp)\n',
       '# Atlas runs in-process: libatlas and its C++ wrapper are linked into lemonade-server-core.\n'
       'include("${ATLAS_SOURCE_DIR}/cpp_adapter/lemonade/AtlasLemonade.cmake")\n')
insert('# Job engine pure core:', '''# Atlas backend end to end: load the chat_tiny fixture in-process, chat, stream, cancel, unload.
set(_ATLAS_BACKEND_TEST_SRC "${CMAKE_CURRENT_SOURCE_DIR}/test/cpp/test_atlas_backend.cpp")
if(BUILD_TESTING AND EXISTS "${_ATLAS_BACKEND_TEST_SRC}")
    add_executable(test_atlas_backend ${_ATLAS_BACKEND_TEST_SRC})
    target_link_libraries(test_atlas_backend PRIVATE lemonade-server-core)
    add_cpp_ci_test(AtlasBackendTest CI OFF
        COMMAND test_atlas_backend "${ATLAS_SOURCE_DIR}/tests/fixtures/models/chat_tiny")
endif()

''', after=False)
open(path, "w").write(text)
EOF
git -C "$src" add -A
git -C "$src" commit -q -m "Add the Atlas backend (in-process: libatlas linked into lemond)" -m \
"The recipe \`atlas\` runs Qwen3-family and Llama models with Atlas (a Rust inference engine with
its own GPU kernels) inside lemond, through Atlas's C ABI and its C++ wrapper: no subprocess, no
port, nothing downloaded. ATLAS_SOURCE_DIR names the Atlas checkout whose
cpp_adapter/lemonade/AtlasLemonade.cmake finds libatlas (see Atlas's docs/lemonade.md)."

say "2/4 the model entries and the version pin"
python3 - "$src/src/cpp/resources" "$ATLAS_ROOT" <<'EOF'
import json, sys
resources, atlas = sys.argv[1], sys.argv[2]

def append(name, indent, entries):
    """Adds `entries` at the end of the top-level object, leaving every other line as it is."""
    path = f"{resources}/{name}"
    original = open(path).read()
    body = original.rstrip()
    if not body.endswith("}"):
        sys.exit(f"{name}: does not end with a JSON object")
    inner = json.dumps(entries, indent=indent, ensure_ascii=False)[1:-1].strip("\n")
    merged = body[:-1].rstrip() + ",\n" + inner + "\n}\n"
    if json.loads(merged) != {**json.loads(original), **entries}:
        sys.exit(f"{name}: the merge did not give the expected object")
    open(path, "w").write(merged)

append("server_models.json", 4, json.load(open(f"{atlas}/server_models.json")))
append("backend_versions.json", 2, {"atlas": json.load(open(f"{atlas}/backend_versions.json"))["atlas"]})
EOF
git -C "$src" commit -q -a -m "Atlas models and version pin" -m \
"server_models.json: the Atlas model entries (recipe atlas). backend_versions.json: the oldest
Atlas the glue supports, compared with the linked library's version (no checksum: nothing is
downloaded)."

say "3/4 config sections of in-process backends"
python3 - "$src/src/cpp/server/runtime_config.cpp" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = '''// A valid config.json backend section is the config_section of any descriptor
// that runs a local subprocess (binary != ""). Cloud has no binary, so it is not
// a backend section.
static bool is_backend_name(const std::string& key) {
    for (const auto* desc : lemon::backends::all_descriptors()) {
        if (!desc->binary.empty() && desc->effective_config_section() == key) {'''
new = '''// A valid config.json backend section is the config_section of any descriptor
// with settings of its own: one that runs a local subprocess (binary != ""), or
// an in-process one whose backend is selectable or that takes args (Atlas).
// Cloud has none of these, so it is not a backend section.
static bool is_backend_name(const std::string& key) {
    for (const auto* desc : lemon::backends::all_descriptors()) {
        const bool has_settings = !desc->binary.empty() || desc->selectable_backend || desc->takes_args;
        if (has_settings && desc->effective_config_section() == key) {'''
if text.count(old) != 1:
    sys.exit("runtime_config.cpp: is_backend_name() is not the one this patch was written for")
open(path, "w").write(text.replace(old, new))
EOF
git -C "$src" commit -q -a -m "config: accept the sections of in-process backends" -m \
"\`lemonade config set atlas.backend=cpu\` (and POST /internal/set) failed with \"Unknown config
key: 'atlas'\" although defaults.json and \`lemonade config\` list the section: is_backend_name()
only accepted descriptors with a binary. An in-process backend with a selectable backend or args
has a section too."

say "4/4 regenerated boilerplate (builds lemond first: see $src/build/atlas-build.log)"
lemonade_build "$src" lemond
(cd "$src" && python3 docs/tools/gen_backend_boilerplate.py --lemond "$src/build/lemond")
git -C "$src" commit -q -a -m "Regenerate the backend boilerplate for Atlas" -m \
"docs/tools/gen_backend_boilerplate.py: the atlas rows of the generated docs and the atlas block
of src/cpp/resources/defaults.json."

rm -f "$PATCH_DIR"/*.patch
mkdir -p "$PATCH_DIR"
git -C "$src" format-patch -q --zero-commit --no-signature --no-stat -o "$PATCH_DIR" "$LEMONADE_COMMIT..atlas-patches"
say "wrote $(ls "$PATCH_DIR"/*.patch | wc -l) patches to ${PATCH_DIR#"$ATLAS_ROOT"/}:"
ls "$PATCH_DIR"
