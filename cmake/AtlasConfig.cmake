# AtlasConfig.cmake: the imported target atlas::atlas, i.e. the Atlas C ABI (include/atlas.h) and
# its shared library.
#
#   find_package(Atlas CONFIG REQUIRED PATHS <atlas repository>/cmake)
#   target_link_libraries(app PRIVATE atlas::atlas)
#
# Where the library comes from:
#   -DATLAS_BUILD_WITH_CARGO=ON  build it from this repository with `cargo build --release`, as a
#                                dependency of atlas::atlas (cargo from PATH, or -DCARGO_EXECUTABLE)
#   -DATLAS_LIBRARY=<file>       a prebuilt libatlas.so / libatlas.dylib, or atlas.dll.lib with
#                                atlas.dll beside it (Windows, MSVC; or set ATLAS_DLL)
#   otherwise                    the first libatlas in ATLAS_ROOT/lib or <repository>/target/release
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
if(ATLAS_ROOT)
  list(PREPEND _atlas_include_dirs "${ATLAS_ROOT}/include")
  list(PREPEND _atlas_lib_dirs "${ATLAS_ROOT}/lib" "${ATLAS_ROOT}/bin" "${ATLAS_ROOT}")
endif()
find_path(ATLAS_INCLUDE_DIR atlas.h PATHS ${_atlas_include_dirs} NO_DEFAULT_PATH)

if(ATLAS_BUILD_WITH_CARGO)
  find_program(CARGO_EXECUTABLE cargo HINTS "$ENV{HOME}/.cargo/bin")
  if(NOT CARGO_EXECUTABLE)
    message(FATAL_ERROR "ATLAS_BUILD_WITH_CARGO is ON but cargo was not found: set CARGO_EXECUTABLE")
  endif()
  set(_atlas_out "${_atlas_repo}/target/release")
  if(WIN32)
    set(_atlas_lib "${_atlas_out}/atlas.dll")
    set(_atlas_implib "${_atlas_out}/atlas.dll.lib")
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
else()
  find_library(ATLAS_LIBRARY NAMES atlas atlas.dll  # atlas.dll.lib: the import library Rust writes on MSVC
    PATHS ${_atlas_lib_dirs} NO_DEFAULT_PATH)
  set(_atlas_lib "${ATLAS_LIBRARY}")
  set(_atlas_implib "")
  if(WIN32 AND ATLAS_LIBRARY)  # that is the import library; the DLL is what runs
    string(REGEX REPLACE "\\.lib$" "" _atlas_dll "${ATLAS_LIBRARY}")
    set(ATLAS_DLL "${_atlas_dll}" CACHE FILEPATH "atlas.dll (default: beside its import library)")
    set(_atlas_lib "${ATLAS_DLL}")
    set(_atlas_implib "${ATLAS_LIBRARY}")
  endif()
endif()

if(NOT ATLAS_INCLUDE_DIR OR NOT (ATLAS_BUILD_WITH_CARGO OR EXISTS "${_atlas_lib}"))
  set(Atlas_FOUND FALSE)
  set(Atlas_NOT_FOUND_MESSAGE "libatlas or atlas.h not found (ATLAS_LIBRARY=${ATLAS_LIBRARY}, \
ATLAS_INCLUDE_DIR=${ATLAS_INCLUDE_DIR}): run `cargo build --release` in ${_atlas_repo}, set \
ATLAS_LIBRARY and ATLAS_INCLUDE_DIR or ATLAS_ROOT, or pass -DATLAS_BUILD_WITH_CARGO=ON")
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
