"""Conan 2 recipe for routing-replay: header-only, C++20; CUDA (libcu++, Thrust, CUB) comes from
the system CUDA Toolkit, not from Conan. `conan create .` packages this checkout and runs
test_package/."""

import os
import re

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load, rmdir


class RoutingReplayConan(ConanFile):
    name = "routing-replay"
    description = ("Capture, move, file and replay the experts a Mixture-of-Experts router chose, "
                   "per token and layer")
    topics = ("cuda", "mixture-of-experts", "inference", "header-only")
    license = "Apache-2.0"
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    # The license travels with the recipe and with the sources (package() copies it to licenses/).
    exports = "LICENSE"
    # The package is made by the project's own install rules (CMakeLists.txt, cmake/).
    exports_sources = "include/*", "CMakeLists.txt", "cmake/*", "LICENSE"
    no_copy_source = True

    def set_version(self):
        # One version: the one CMakeLists.txt declares.
        cmakelists = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        self.version = re.search(r"project\(routing_replay VERSION ([0-9.]+)", cmakelists).group(1)

    def validate(self):
        check_min_cppstd(self, 20)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        # Headers and the CMake package only: no tests, no CUDA compiler.
        tc = CMakeToolchain(self)
        for option in ("BUILD_TESTS", "BUILD_EXAMPLES", "BUILD_BENCHMARKS", "ENABLE_CUDA"):
            tc.cache_variables[f"ROUTING_REPLAY_{option}"] = False
        tc.generate()

    def build(self):
        CMake(self).configure()

    def package(self):
        CMake(self).install()
        # CMakeDeps generates the consumer's config files from package_info() instead.
        rmdir(self, os.path.join(self.package_folder, "share"))
        copy(self, "conan_system_cuda.cmake", os.path.join(self.source_folder, "cmake"),
             os.path.join(self.package_folder, "lib", "cmake"))
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))

    def package_id(self):
        self.info.clear()

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "routing_replay")
        self.cpp_info.set_property("cmake_target_name", "routing_replay::routing_replay")
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        # Links the system CUDA Toolkit's CCCL and runtime to the target, as the CMake package does.
        self.cpp_info.set_property("cmake_build_modules",
                                   [os.path.join("lib", "cmake", "conan_system_cuda.cmake")])
