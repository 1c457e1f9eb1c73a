/// @file
/// Portability macros shared by every header of the library.
#pragma once

/// @brief Marks a function callable from host and device code under nvcc; vanishes under a plain
/// host compiler so the policy headers stay valid C++20 for g++ and clang.
#if defined(__CUDACC__)
#define ROUTING_REPLAY_HOST_DEVICE __host__ __device__
#else
#define ROUTING_REPLAY_HOST_DEVICE
#endif
