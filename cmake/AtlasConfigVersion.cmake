# The Atlas package version is the crate's, read from Cargo.toml so that it has one source.
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/../Cargo.toml" _atlas_version REGEX "^version *=" LIMIT_COUNT 1)
string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" PACKAGE_VERSION "${_atlas_version}")

# Cargo's semver rule: compatible within one major version, or one minor version before 1.0.
string(REPLACE "." ";" _atlas_parts "${PACKAGE_VERSION}")
list(GET _atlas_parts 0 _atlas_major)
list(GET _atlas_parts 1 _atlas_minor)
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION OR NOT PACKAGE_FIND_VERSION_MAJOR EQUAL _atlas_major
   OR (_atlas_major EQUAL 0 AND NOT PACKAGE_FIND_VERSION_MINOR EQUAL _atlas_minor))
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
