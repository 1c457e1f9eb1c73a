# Overlay port: builds the checkout this port lives in (ports/routing-replay/../..). For a tagged
# release fetched from GitHub, see ports/registry/routing-replay/.
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../..")

# Header-only: no debug tree to build.
set(VCPKG_BUILD_TYPE release)

# Installs the headers and the CMake package only, so no CUDA compiler is needed. These options are
# the ones tests/packaging/install_package.cmake reads and tests; keep the registry port's equal.
vcpkg_cmake_configure(
    SOURCE_PATH "${SOURCE_PATH}"
    OPTIONS
        -DROUTING_REPLAY_BUILD_TESTS=OFF
        -DROUTING_REPLAY_BUILD_EXAMPLES=OFF
        -DROUTING_REPLAY_BUILD_BENCHMARKS=OFF
        -DROUTING_REPLAY_ENABLE_CUDA=OFF
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME routing_replay CONFIG_PATH share/cmake/routing_replay)

# Release-only, so this is a no-op unless VCPKG_BUILD_TYPE above is dropped.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include")

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
if(EXISTS "${SOURCE_PATH}/LICENSE")
    vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
else()
    # The checkout declares no license yet; vcpkg still requires a copyright file.
    file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright"
         "routing-replay: no license file in this checkout.\n")
endif()
