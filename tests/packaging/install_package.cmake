# Installs routing_replay the way the vcpkg port does, then checks what it installed.
#
#   cmake -DSOURCE_DIR=<checkout> -DBINARY_DIR=<scratch build> -DPREFIX=<install prefix>
#         [-DGENERATOR=<generator>] -P install_package.cmake
#
# The configure options are read from the overlay port (ports/routing-replay/portfile.cmake), so
# this is exactly the port's configuration; and no CUDA compiler is reachable: nvcc is taken off
# PATH and CMAKE_CUDA_COMPILER names a file that does not exist, so any enable_language(CUDA)
# would fail. The result must have the layout vcpkg_cmake_config_fixup expects.
cmake_minimum_required(VERSION 3.25)
foreach(var SOURCE_DIR BINARY_DIR PREFIX)
  if(NOT ${var})
    message(FATAL_ERROR "install_package.cmake: -D${var}=... is required")
  endif()
endforeach()

# ---- the port's options: every -D<name>=<value> in its vcpkg_cmake_configure() call
file(READ "${SOURCE_DIR}/ports/routing-replay/portfile.cmake" portfile)
string(REGEX MATCH "vcpkg_cmake_configure\\(([^)]*)\\)" configure_call "${portfile}")
string(REGEX MATCHALL "-D[A-Za-z0-9_]+(:[A-Z]+)?=[^ \t\r\n)]*" port_options "${configure_call}")
if(NOT port_options)
  message(FATAL_ERROR "no -D options found in the port's vcpkg_cmake_configure() call")
endif()
message(STATUS "port options: ${port_options}")

# ---- no CUDA compiler
set(path "")
string(REPLACE ":" ";" path_dirs "$ENV{PATH}")
foreach(dir IN LISTS path_dirs)
  if(NOT EXISTS "${dir}/nvcc")
    list(APPEND path "${dir}")
  endif()
endforeach()
string(REPLACE ";" ":" path "${path}")
set(ENV{PATH} "${path}")
unset(ENV{CUDACXX})

set(generator_args "")
if(GENERATOR)
  set(generator_args -G "${GENERATOR}")
endif()
file(REMOVE_RECURSE "${BINARY_DIR}" "${PREFIX}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}" ${generator_args}
          -DCMAKE_BUILD_TYPE=Release "-DCMAKE_INSTALL_PREFIX=${PREFIX}"
          -DCMAKE_CUDA_COMPILER=/nonexistent/nvcc ${port_options}
  COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BINARY_DIR}" COMMAND_ERROR_IS_FATAL ANY)

# ---- the layout
set(cmakedir "${PREFIX}/share/cmake/routing_replay")
foreach(file IN ITEMS
    "${cmakedir}/routing_replayConfig.cmake"
    "${cmakedir}/routing_replayConfigVersion.cmake"
    "${cmakedir}/routing_replayTargets.cmake"
    "${PREFIX}/include/routing_replay/routing_replay.hpp")
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "not installed: ${file}")
  endif()
endforeach()

# Every public and detail header, and nothing but headers and the package files.
file(GLOB_RECURSE source_headers RELATIVE "${SOURCE_DIR}/include" "${SOURCE_DIR}/include/*")
file(GLOB_RECURSE installed_headers RELATIVE "${PREFIX}/include" "${PREFIX}/include/*")
if(NOT source_headers STREQUAL installed_headers)
  message(FATAL_ERROR "installed headers differ from include/:\n"
                      "  source:    ${source_headers}\n  installed: ${installed_headers}")
endif()
file(GLOB top_level RELATIVE "${PREFIX}" "${PREFIX}/*")
if(NOT top_level STREQUAL "include;share")
  message(FATAL_ERROR "the prefix should hold include/ and share/ only, holds: ${top_level}")
endif()

# No CUDA architectures on the exported target; a version file that fits any architecture.
file(READ "${cmakedir}/routing_replayTargets.cmake" targets)
if(targets MATCHES "CUDA_ARCHITECTURES")
  message(FATAL_ERROR "the exported target sets CUDA architectures")
endif()
set(CMAKE_SIZEOF_VOID_P 4)  # as a 32-bit consumer sees it
include("${cmakedir}/routing_replayConfigVersion.cmake")
if(PACKAGE_VERSION_UNSUITABLE)
  message(FATAL_ERROR "the version file is not architecture-independent")
endif()
message(STATUS "installed to ${PREFIX}: layout ok")
