/// @file
/// Loads an instantiation unit compiled on first use (routing_replay/_jit.py) into a module's
/// factory table. The module loads it itself, rather than Python's ctypes, so that the table it
/// fills is the one create() reads, and the library's code runs with the module's C++ runtime.
#pragma once

#include "replay_impl.hpp"

#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace routing_replay::python {

/// @brief Loads the shared library at `path` and lets it register its instantiations into `table`
/// (entries of the same key are replaced by equal ones). The library stays loaded for the process:
/// the table's factories are its code.
/// @throws std::runtime_error when it does not load or lacks the entry point
inline void load_instances(factory_table& table, const std::string& path)
{
  // RTLD_LOCAL: its inline functions and statics stay its own, as the modules' are (hidden)
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error("routing_replay: cannot load " + path + ": " + (why != nullptr ? why : "unknown error"));
  }
  using entry = void (*)(void*);
  auto* registers = reinterpret_cast<entry>(dlsym(library, "routing_replay_register_instances"));  // NOLINT
  if (registers == nullptr) {
    throw std::runtime_error("routing_replay: " + path + " has no routing_replay_register_instances");
  }
  registers(&table);
}

}  // namespace routing_replay::python
