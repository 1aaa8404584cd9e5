# CMake toolchain file: cross-compile for Windows x86_64 with Debian's MinGW-w64 (g++-mingw-w64-x86-64),
# as scripts/test_windows.sh builds cpp_adapter/ against the zip's atlas.dll:
#
#   cmake -S cpp_adapter -B build-win --toolchain $PWD/cmake/mingw-w64-x86_64.cmake \
#         -DAtlas_DIR=<unpacked zip folder>/cmake       (or -DATLAS_ROOT=<unpacked zip folder>)
#
# Searches are re-rooted into the MinGW sysroot (CMAKE_FIND_ROOT_PATH): a package outside it is found
# through <Package>_DIR or a find_package(... NO_CMAKE_FIND_ROOT_PATH), as cpp_adapter/ does.
# The posix thread model is preferred (std::thread and std::mutex, through winpthreads); the MinGW
# runtime is linked statically, so what is built needs no libstdc++-6.dll, libgcc_s_seh-1.dll or
# libwinpthread-1.dll beside it: only atlas.dll and Windows' own DLLs.
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_SYSTEM_PROCESSOR AMD64)

set(_mingw x86_64-w64-mingw32)
foreach(_lang C CXX)
  if(_lang STREQUAL "C")
    set(_tool gcc)
  else()
    set(_tool g++)
  endif()
  find_program(_mingw_${_lang} NAMES ${_mingw}-${_tool}-posix ${_mingw}-${_tool})
  if(NOT _mingw_${_lang})
    message(FATAL_ERROR "${_mingw}-${_tool} not found: apt-get install ${_tool}-mingw-w64-x86-64")
  endif()
  set(CMAKE_${_lang}_COMPILER "${_mingw_${_lang}}")
endforeach()
find_program(CMAKE_RC_COMPILER NAMES ${_mingw}-windres)

# Headers and libraries from the MinGW sysroot only; programs (cargo, python) from the host.
set(CMAKE_FIND_ROOT_PATH /usr/${_mingw})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# -static: libstdc++, libgcc and winpthreads linked in. Import libraries (atlas.dll.a, kernel32's)
# still link their DLLs.
foreach(_kind EXE SHARED MODULE)
  set(CMAKE_${_kind}_LINKER_FLAGS_INIT "-static")
endforeach()

# ctest runs the test programs through Wine when it is there (or -DCMAKE_CROSSCOMPILING_EMULATOR=...).
if(NOT CMAKE_CROSSCOMPILING_EMULATOR)
  find_program(_mingw_wine NAMES wine64 wine)
  if(_mingw_wine)
    set(CMAKE_CROSSCOMPILING_EMULATOR "${_mingw_wine}")
  endif()
endif()
