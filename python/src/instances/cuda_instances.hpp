/// @file
/// What the CUDA translation units (cuda_*.cu) offer the CUDA module's bindings.
#pragma once

#include "replay_impl.hpp"

#include <cstdint>
#include <string>

namespace routing_replay::python {

/// @brief Registers the compiled CUDA instantiations.
void register_cuda(factory_table& table);
/// @brief Whether a usable CUDA device is present.
bool cuda_available() noexcept;
/// @brief Visible CUDA devices (0 without a driver).
std::int32_t cuda_device_count() noexcept;
/// @brief The calling thread's current CUDA device.
/// @throws error backend_error
std::int32_t cuda_current_device();
/// @brief Makes `device` current for the calling thread.
/// @throws error backend_error
void cuda_set_device(std::int32_t device);
/// @brief The CUDA runtime version this module was built with, "13.0".
std::string cuda_runtime_version();

}  // namespace routing_replay::python
