# AtlasConfig.cmake: the imported target atlas::atlas, i.e. the Atlas C ABI (include/atlas.h) and
# its shared library.
#
#   find_package(Atlas CONFIG REQUIRED PATHS <atlas repository>/cmake)
#   target_link_libraries(app PRIVATE atlas::atlas)
#
# Where the library comes from:
#   -DATLAS_BUILD_WITH_CARGO=ON  build it from this repository with `cargo build --release`, as a
#                                dependency of atlas::atlas (cargo from PATH, or -DCARGO_EXECUTABLE)
#   -DATLAS_LIBRARY=<file>       a prebuilt libatlas.so / libatlas.dylib; on Windows the import
#                                library, atlas.dll.lib (MSVC) or atlas.dll.a / libatlas.dll.a
#                                (MinGW), with atlas.dll beside it or in ../bin (or set ATLAS_DLL)
#   otherwise                    the first libatlas in ATLAS_ROOT, ATLAS_ROOT/lib or
#                                <repository>/target/release (on Windows also
#                                <repository>/target/<Windows target>/release, and the folder of
#                                the Windows zip whose cmake/ this file is)
# ATLAS_INCLUDE_DIR (the folder holding atlas.h) defaults to ATLAS_ROOT/include or <repository>/include.

if(TARGET atlas::atlas)  # found before, in this directory or a parent
  return()
endif()

get_filename_component(_atlas_repo "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
option(ATLAS_BUILD_WITH_CARGO "Build libatlas with cargo as part of this build" OFF)

# Only these places (NO_DEFAULT_PATH): the unrelated ATLAS linear-algebra library installs a
# /usr/lib/.../libatlas.so of its own.
set(_atlas_include_dirs "${_atlas_repo}/include")
set(_atlas_lib_dirs "${_atlas_repo}/target/release")
if(WIN32)  # cross-built with cargo build --target; the unpacked Windows zip, whose cmake/ this is
  list(APPEND _atlas_lib_dirs "${_atlas_repo}/target/x86_64-pc-windows-msvc/release"
       "${_atlas_repo}/target/x86_64-pc-windows-gnu/release" "${_atlas_repo}")
endif()
if(ATLAS_ROOT)
  list(PREPEND _atlas_include_dirs "${ATLAS_ROOT}/include")
  list(PREPEND _atlas_lib_dirs "${ATLAS_ROOT}/lib" "${ATLAS_ROOT}/bin" "${ATLAS_ROOT}")
endif()
# These are paths on the build machine: a cross-compiling toolchain's CMAKE_FIND_ROOT_PATH must
# not re-root them.
find_path(ATLAS_INCLUDE_DIR atlas.h PATHS ${_atlas_include_dirs} NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)

if(ATLAS_BUILD_WITH_CARGO)
  find_program(CARGO_EXECUTABLE cargo HINTS "$ENV{HOME}/.cargo/bin")
  if(NOT CARGO_EXECUTABLE)
    message(FATAL_ERROR "ATLAS_BUILD_WITH_CARGO is ON but cargo was not found: set CARGO_EXECUTABLE")
  endif()
  set(_atlas_out "${_atlas_repo}/target/release")
  if(WIN32)
    set(_atlas_lib "${_atlas_out}/atlas.dll")
    if(MINGW)  # Rust's -gnu targets
      set(_atlas_implib "${_atlas_out}/libatlas.dll.a")
    else()
      set(_atlas_implib "${_atlas_out}/atlas.dll.lib")
    endif()
  else()
    set(_atlas_lib "${_atlas_out}/${CMAKE_SHARED_LIBRARY_PREFIX}atlas${CMAKE_SHARED_LIBRARY_SUFFIX}")
    set(_atlas_implib "")
  endif()
  if(NOT TARGET atlas_cargo_build)
    # Always runs; cargo itself decides whether anything changed. --target-dir pins the output
    # against a CARGO_TARGET_DIR in the environment. BYPRODUCTS tells Ninja who makes the library.
    add_custom_target(atlas_cargo_build
      COMMAND "${CARGO_EXECUTABLE}" build --release --manifest-path "${_atlas_repo}/Cargo.toml"
              --target-dir "${_atlas_repo}/target"
      BYPRODUCTS ${_atlas_lib} ${_atlas_implib}
      WORKING_DIRECTORY "${_atlas_repo}"
      COMMENT "Building libatlas with cargo"
      USES_TERMINAL)
  endif()
elseif(WIN32)
  # The import library is what links, the DLL what runs. Rust names the import library atlas.dll.lib
  # (MSVC targets) or libatlas.dll.a (GNU targets); the Windows zip holds atlas.dll.lib and
  # atlas.dll.a. find_library's own prefixes and suffixes differ between MSVC and MinGW, so the
  # names are spelled out, the toolchain's own format first.
  if(MINGW)
    set(_atlas_implib_names libatlas.dll.a atlas.dll.a atlas.dll.lib atlas.lib)
  else()
    set(_atlas_implib_names atlas.dll.lib atlas.lib)
  endif()
  find_library(ATLAS_LIBRARY NAMES ${_atlas_implib_names} NAMES_PER_DIR
    PATHS ${_atlas_lib_dirs} NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)
  set(_atlas_dll_dirs "")
  if(ATLAS_LIBRARY)
    get_filename_component(_atlas_implib_dir "${ATLAS_LIBRARY}" DIRECTORY)
    set(_atlas_dll_dirs "${_atlas_implib_dir}" "${_atlas_implib_dir}/../bin")
  endif()
  find_file(ATLAS_DLL atlas.dll PATHS ${_atlas_dll_dirs} ${_atlas_lib_dirs} NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH
    DOC "atlas.dll (default: beside its import library, or in ../bin)")
  set(_atlas_lib "${ATLAS_DLL}")
  set(_atlas_implib "${ATLAS_LIBRARY}")
else()
  find_library(ATLAS_LIBRARY NAMES atlas PATHS ${_atlas_lib_dirs} NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)
  set(_atlas_lib "${ATLAS_LIBRARY}")
  set(_atlas_implib "")
endif()

if(NOT ATLAS_INCLUDE_DIR OR NOT (ATLAS_BUILD_WITH_CARGO OR (EXISTS "${_atlas_lib}"
   AND (NOT WIN32 OR EXISTS "${_atlas_implib}"))))
  set(Atlas_FOUND FALSE)
  set(Atlas_NOT_FOUND_MESSAGE "libatlas or atlas.h not found (ATLAS_LIBRARY=${ATLAS_LIBRARY}, \
ATLAS_INCLUDE_DIR=${ATLAS_INCLUDE_DIR}): run `cargo build --release` in ${_atlas_repo}, set \
ATLAS_LIBRARY and ATLAS_INCLUDE_DIR or ATLAS_ROOT, or pass -DATLAS_BUILD_WITH_CARGO=ON")
  if(WIN32)
    string(APPEND Atlas_NOT_FOUND_MESSAGE "; on Windows ATLAS_LIBRARY is the import library \
(atlas.dll.lib or atlas.dll.a) and ATLAS_DLL (${ATLAS_DLL}) atlas.dll")
  endif()
  return()
endif()

add_library(atlas::atlas SHARED IMPORTED)
set_target_properties(atlas::atlas PROPERTIES
  IMPORTED_LOCATION "${_atlas_lib}"
  INTERFACE_INCLUDE_DIRECTORIES "${ATLAS_INCLUDE_DIR}")
if(WIN32)
  set_target_properties(atlas::atlas PROPERTIES IMPORTED_IMPLIB "${_atlas_implib}")
elseif(NOT APPLE)
  # Rust writes no SONAME into libatlas.so: without this the full build path would be recorded in
  # every binary that links it, instead of "libatlas.so" found through the RPATH.
  set_target_properties(atlas::atlas PROPERTIES IMPORTED_NO_SONAME TRUE)
endif()
if(ATLAS_BUILD_WITH_CARGO)
  add_dependencies(atlas::atlas atlas_cargo_build)
endif()
set(Atlas_FOUND TRUE)
