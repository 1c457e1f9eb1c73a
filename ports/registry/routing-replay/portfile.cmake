# Registry port: a tagged release fetched from GitHub. Copy this folder to ports/routing-replay/
# of a vcpkg registry at release time (docs/install.md, "Publishing to a vcpkg registry") and fill
# in the two placeholders:
#   REPO    the GitHub owner/name that hosts the release tags;
#   SHA512  the hash of the tag's archive (vcpkg prints it on the first install with SHA512 0).
vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO OWNER/routing-replay
    REF "v${VERSION}"
    SHA512 0
    HEAD_REF main
)

# From here on, the same as the overlay port (ports/routing-replay/portfile.cmake); the options
# must stay equal to its options (scripts/packaging_check.sh checks it).
set(VCPKG_BUILD_TYPE release)
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
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include")

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
# A release ships a LICENSE.
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
