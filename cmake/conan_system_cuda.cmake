# Included by the config files Conan's CMakeDeps generates for routing_replay: the CUDA Toolkit
# (with CCCL: libcu++, Thrust, CUB) comes from the system, not from Conan, so find it here and link
# it to the target, as routing_replayConfig.cmake does for the plain CMake package.
find_package(CUDAToolkit REQUIRED)
find_package(CCCL 3.0 CONFIG REQUIRED HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake")
set_property(TARGET routing_replay::routing_replay APPEND PROPERTY
             INTERFACE_LINK_LIBRARIES CCCL::CCCL CUDA::cudart)
