/// @file
/// What the step planner makes of a step_plan, and what every later part of the data path reads:
/// the step's rows, which request and position each run of rows belongs to, their KV slots, the
/// draft tokens, and (where rows are claimed when the step begins) every row's place.
#pragma once

#include <routing_replay/detail/data_path/default_init_allocator.hpp>
#include <routing_replay/detail/scatter_op.hpp>

#include <cstdint>
#include <memory_resource>
#include <vector>

namespace routing_replay {

/// @brief One scheduled request of a step, resolved to its registry handle.
struct step_run {
  std::uint32_t handle;              ///< request handle (request_registry)
  std::uint32_t generation;          ///< handle generation when planned (moved on: the request is gone)
  std::int64_t first_row;            ///< first row of the step
  std::int64_t first_position;       ///< position of that row
  std::int32_t num_tokens;           ///< rows
  std::int32_t num_draft;            ///< trailing draft rows
  std::int64_t slots_begin;          ///< index into step_record::slots, -1 without slots
  std::int64_t recorded_before = 0;  ///< claims when planned: the request's T before the step
  std::int64_t recorded_after  = 0;  ///< ... and after it (a discard restores T if unchanged)
};

/// @brief A row a step re-claimed (claims when planned): the claim it took over, given back if the
/// step is discarded.
struct replaced_claim {
  std::uint32_t handle;   ///< request handle
  std::int64_t position;  ///< the row's position
  std::int64_t slot;      ///< its slot (-1 without slots)
  std::uint64_t prior;    ///< the step whose claim was taken over
};

/// @brief A tentative draft row a step took over (claims when planned): ownership goes back to the
/// draft group if the step is discarded.
struct taken_draft {
  std::uint32_t handle;       ///< request handle
  std::uint64_t group_step;   ///< the draft group's step
  std::int64_t position;      ///< the row's position
};

/// @brief Everything filing needs, copied out of the step_plan when the step begins. Records are
/// recycled (swapped between the planner and the copy pipeline's ring), so steady-state steps
/// allocate nothing. With device scatter the op list lives in pinned memory, where the scatter
/// kernel reads it as the planner wrote it (copy_pipeline::make_record()).
template <class Index>
struct step_record {
  /// @brief The op list's type: its memory comes from the resource the record was made with.
  using op_list = std::pmr::vector<detail::scatter_op<Index>>;

  /// @brief A record whose op list is allocated from the heap.
  step_record() = default;
  /// @brief A record whose op list is allocated from `ops_memory`.
  explicit step_record(std::pmr::memory_resource* ops_memory) : ops(ops_memory) {}

  std::uint64_t serial  = 0;                      ///< step serial (1, 2, ...)
  std::int64_t num_rows = 0;                      ///< N
  std::int64_t padded_rows = -1;                  ///< rows the forward writes, if declared
  std::vector<step_run> runs;                     ///< scheduled requests in batch order
  /// @brief KV slots of every run, flat: a run's are sized when it is planned and written as its
  /// rows are claimed (resizing writes nothing). 32 bits: a slot-indexed pool holds fewer than
  /// 2^31 slots, and every slot was checked against it.
  std::vector<std::int32_t, detail::default_init_allocator<std::int32_t>> slots;
  std::vector<std::int64_t> fresh_blocks;         ///< blocks declared fresh
  /// @brief Claims when planned: every claimed row's place.
  op_list ops{std::pmr::new_delete_resource()};
  std::vector<replaced_claim> replaced;           ///< claims when planned: rows re-claimed
  std::vector<taken_draft> taken;                 ///< claims when planned: draft rows taken over
};

}  // namespace routing_replay
