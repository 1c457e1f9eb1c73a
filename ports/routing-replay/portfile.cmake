# Overlay port: builds the checkout this port lives in (ports/routing-replay/../..). The registry
# port, ports/registry/routing-replay/, fetches a tagged release instead.
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../..")

# ---- the same in the overlay and the registry port (scripts/packaging_check.sh checks it) ----
# Header-only: no debug tree to build.
set(VCPKG_BUILD_TYPE release)

# Headers and the CMake package only, so no CUDA compiler is needed. tests/packaging/
# install_package.cmake configures and installs with exactly these options.
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
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include")  # a no-op while release-only

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
# Apache-2.0: the LICENSE at the root of the sources is the copyright file vcpkg installs.
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
