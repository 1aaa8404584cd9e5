# AtlasLemonade.cmake: links the Atlas backend into Lemonade's lemond. Lemonade's top-level
# CMakeLists.txt includes it once, after add_library(lemonade-server-core ...) and before the tests:
#
#   include("${ATLAS_SOURCE_DIR}/cpp_adapter/lemonade/AtlasLemonade.cmake")
#
# The backend's own sources are found by Lemonade itself, from the "atlas|atlas" entry of
# LEMON_BACKENDS (src/cpp/include/lemon/backends/atlas/, src/cpp/server/backends/atlas/*.cpp). What
# this file adds is the library they call: the Atlas C ABI (imported target atlas::atlas, from
# cmake/AtlasConfig.cmake) and its C++ wrapper (atlas::cpp, cpp_adapter/). See docs/lemonade.md.
#
# Where libatlas comes from is AtlasConfig.cmake's business, set on Lemonade's cmake command line:
#   -DATLAS_BUILD_WITH_CARGO=ON   build it with `cargo build --release` as part of Lemonade's build
#   -DATLAS_LIBRARY=<file>        a prebuilt libatlas.so / atlas.dll.lib (with ATLAS_INCLUDE_DIR)
#   -DATLAS_ROOT=<prefix>         <prefix>/lib and <prefix>/include
#   otherwise                     <Atlas repository>/target/release and <Atlas repository>/include

if(NOT TARGET lemonade-server-core)
  message(FATAL_ERROR "AtlasLemonade.cmake: include it after add_library(lemonade-server-core ...)")
endif()

get_filename_component(_atlas_lemonade_repo "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
set(ATLAS_SOURCE_DIR "${_atlas_lemonade_repo}" CACHE PATH "The Atlas repository (cmake/AtlasConfig.cmake, cpp_adapter/)")

find_package(Atlas CONFIG REQUIRED PATHS "${ATLAS_SOURCE_DIR}/cmake" NO_DEFAULT_PATH)
if(NOT TARGET atlas::cpp)
  # Its own tests stay off: they are on only when cpp_adapter is the top-level project.
  add_subdirectory("${ATLAS_SOURCE_DIR}/cpp_adapter" "${CMAKE_BINARY_DIR}/atlas_cpp" EXCLUDE_FROM_ALL)
endif()
target_link_libraries(lemonade-server-core PUBLIC atlas::cpp)

# lemond finds libatlas at run time beside itself (Windows: atlas.dll next to lemond.exe) or in
# ../lib (the Linux packages install lemond to bin/).
if(DEFINED EXECUTABLE_NAME AND TARGET ${EXECUTABLE_NAME})
  set(_atlas_lemond ${EXECUTABLE_NAME})
else()
  set(_atlas_lemond lemond)
endif()
if(TARGET ${_atlas_lemond})
  if(WIN32)
    add_custom_command(TARGET ${_atlas_lemond} POST_BUILD
      COMMAND "${CMAKE_COMMAND}" -E copy_if_different "$<TARGET_FILE:atlas::atlas>" "$<TARGET_FILE_DIR:${_atlas_lemond}>"
      COMMENT "Copying atlas.dll beside ${_atlas_lemond}")
    install(FILES "$<TARGET_FILE:atlas::atlas>" DESTINATION bin)
  elseif(APPLE)
    set_property(TARGET ${_atlas_lemond} APPEND PROPERTY INSTALL_RPATH "@executable_path/../lib")
    install(FILES "$<TARGET_FILE:atlas::atlas>" DESTINATION lib)
  else()
    include(GNUInstallDirs)
    set_property(TARGET ${_atlas_lemond} APPEND PROPERTY INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
    install(FILES "$<TARGET_FILE:atlas::atlas>" DESTINATION ${CMAKE_INSTALL_LIBDIR})
  endif()
endif()
