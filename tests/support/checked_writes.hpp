/// @file
/// What the contract checker (checked_replay.hpp) hands the library besides plans and ids: one
/// write of a forward through a capture path (write_spec), with the kernels that prepare its rows;
/// the backend an engine uses for its own buffers; and contract_violation, what a broken contract
/// raises.
#pragma once

#include "synthetic_router.hpp"

#include <routing_replay/detail/macros.hpp>

#include <cstdint>
#include <stdexcept>

namespace rr_test {

/// @brief The library broke its contract. Never a routing_replay::error, so nothing mistakes it for
/// an expected refusal; doctest reports it as a failure, the fuzzer as a crash.
class contract_violation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// @brief The backend an engine uses for its own buffers and kernels: a fault-injecting backend
/// names the backend it wraps as `base_backend`, so the engine's work never counts as the library's.
template <class Backend>
struct engine_backend {
  using type = Backend;
};
template <class Backend>
  requires requires { typename Backend::base_backend; }
struct engine_backend<Backend> {
  using type = typename Backend::base_backend;
};
template <class Backend>
using engine_backend_t = typename engine_backend<Backend>::type;

/// @brief One write of a forward, as an engine issues it, with at most one bad cell.
struct write_spec {
  enum class path : std::uint8_t { capture, layer_view, device_ref };
  enum class defect : std::uint8_t {
    none,
    above_range,    ///< the id E (capture, record: invalid id; view: a value outside [0, E))
    negative,       ///< the id -2 (for a view: -2 cast to Index, outside [0, E) for every type)
    wide,           ///< an id wider than 16 bits (a 16-bit source narrows it, as the engine's would)
    out_of_bounds,  ///< device_ref: one more record, one row past the reference
  };

  path via = path::capture;
  std::int32_t layer   = 0;  ///< model layer (capture, layer_view) or layer slot (device_ref)
  std::int64_t num_rows = 0;
  std::uint32_t salt   = 0;  ///< ids are a pure function of (salt, layer, row, column)
  defect bad           = defect::none;
  std::int64_t bad_cell = 0;  ///< row * K + column of the bad id
  // capture() only
  std::int32_t source_bits = 64;  ///< source id type: 64, 32 or 16 bits
  std::int64_t stride      = 0;   ///< source_row_stride passed (0: the default, K + S)
  std::int64_t extra_columns = 0; ///< with the default stride: 0; else the buffer's row is this much wider than K
  std::int64_t row_offset  = 0;   ///< source_row_offset (at most 3)
  bool null_ids            = false;
  bool physical            = false;  ///< physical ids mapped through a device map
  bool empty_map           = false;  ///< a map pointer with num_physical_experts 0
};

namespace detail_checked {

/// @brief Fills the rows' metadata of one write: row i is "request" `salt`, position i, so its ids
/// are a pure function of (salt, layer, row, column) that the prediction evaluates on the host.
struct salted_rows {
  row_meta* meta;
  std::uint32_t salt;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t row) const noexcept
  {
    meta[row] = row_meta{static_cast<std::int64_t>(salt), row, 0};
  }
};

/// @brief Fills the physical-to-logical map: every entry valid but the last, which maps to -1.
struct fill_physical_map {
  std::int32_t* map;
  std::int64_t entries;
  std::int64_t num_experts;

  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t p) const noexcept
  {
    map[p] = p + 1 < entries ? static_cast<std::int32_t>((p * 7 + 3) % num_experts) : -1;
  }
};

}  // namespace detail_checked

}  // namespace rr_test
