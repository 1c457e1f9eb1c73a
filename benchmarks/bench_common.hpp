/// @file
/// Shared by the Google Benchmark programs (host_path.cpp with g++, device_bench.cu with nvcc): the
/// DESIGN.md shape, a replay configuration, a kernel that records every layer of a step through
/// the device reference, and the "swap one policy at a time" walk over policies.hpp.
#pragma once

#include "policies.hpp"

#include <routing_replay/detail/macros.hpp>
#include <routing_replay/routing_replay.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace rr_bench {

constexpr std::int32_t bench_layers  = 48;   ///< L
constexpr std::int32_t bench_topk    = 8;    ///< K
constexpr std::int32_t bench_experts = 128;  ///< E
constexpr std::int64_t bench_model_len = 4096;

/// @brief A replay of the DESIGN.md shape for steps of up to `max_rows` rows and `requests`
/// requests of up to bench_model_len positions (block-slot storage: one KV region per request).
/// Recomputed positions overwrite, so a benchmark may wrap its positions and still file every row.
inline rr::replay_config bench_config(std::int32_t max_rows, std::int64_t requests)
{
  rr::replay_config c;
  c.num_experts         = bench_experts;
  c.top_k               = bench_topk;
  c.max_tokens_per_step = max_rows;
  c.max_model_len       = bench_model_len;
  c.moe_layers.resize(bench_layers);
  std::iota(c.moe_layers.begin(), c.moe_layers.end(), 0);
  c.block_size                = 16;
  c.num_blocks                = requests * bench_model_len / 16;
  c.overwrite_recomputed_rows = true;
  return c;
}

/// @brief The router of every layer, as one pass over (layer, row, k): what a fused in-kernel
/// recorder writes through ref().
template <class Ref>
struct record_all_layers {
  Ref ref;
  std::int32_t rows;
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const
  {
    const auto layer = static_cast<std::int32_t>(i / (std::int64_t{rows} * bench_topk));
    const auto row   = static_cast<std::int32_t>((i / bench_topk) % rows);
    const auto k     = static_cast<std::int32_t>(i % bench_topk);
    ref.record(layer, row, k, (row * 31 + layer * 131 + k * 17) % bench_experts);
  }
};

/// @brief An engine step of `batch` requests (0 .. batch-1) with `tokens` tokens each, at
/// positions that advance every step and wrap at bench_model_len; slots per request region.
class step_driver {
 public:
  step_driver(std::int32_t batch, std::int32_t tokens) : batch_(batch), tokens_(tokens)
  {
    slots_.resize(static_cast<std::size_t>(batch) * static_cast<std::size_t>(tokens));
  }

  template <class Replay>
  void add_requests(Replay& replay) const
  {
    for (std::int32_t r = 0; r < batch_; ++r) { replay.add_request(r); }
  }

  /// @brief The next step's plan (the spans it holds stay valid until the next call).
  const rr::step_plan& next()
  {
    plan_.clear();
    if (position_ + tokens_ > bench_model_len) { position_ = 0; }
    for (std::int32_t r = 0; r < batch_; ++r) {
      std::int64_t* s = slots_.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(tokens_);
      for (std::int32_t t = 0; t < tokens_; ++t) { s[t] = std::int64_t{r} * bench_model_len + position_ + t; }
      plan_.schedule({r, position_, tokens_, 0, std::span<const std::int64_t>{s, static_cast<std::size_t>(tokens_)}});
    }
    position_ += tokens_;
    return plan_;
  }

  [[nodiscard]] std::int32_t rows() const noexcept { return batch_ * tokens_; }

 private:
  std::int32_t batch_;
  std::int32_t tokens_;
  std::int64_t position_ = 0;
  std::vector<std::int64_t> slots_;
  rr::step_plan plan_;
};

/// @brief The first type of a list.
template <class List>
struct first_of;
template <class T, class... Rest>
struct first_of<type_list<T, Rest...>> {
  using type = T;
};

/// @brief Calls `f(index, layout, copy, storage)` (type_tags) for the baseline combination (the
/// first type of each list in policies.hpp) and for every combination that differs from it in
/// exactly one policy. A copy strategy that cannot pair with the baseline storage is paired with
/// block_slot_storage.
template <class F>
void for_each_single_swap(F&& f)
{
  using I0 = typename first_of<index_types>::type;
  using L0 = typename first_of<layout_types>::type;
  using C0 = typename first_of<copy_types>::type;
  using S0 = typename first_of<storage_types>::type;
  f(type_tag<I0>{}, type_tag<L0>{}, type_tag<C0>{}, type_tag<S0>{});
  for_each_type(index_types{}, [&](auto i) {
    if constexpr (!std::is_same_v<typename decltype(i)::type, I0>) { f(i, type_tag<L0>{}, type_tag<C0>{}, type_tag<S0>{}); }
  });
  for_each_type(layout_types{}, [&](auto l) {
    if constexpr (!std::is_same_v<typename decltype(l)::type, L0>) { f(type_tag<I0>{}, l, type_tag<C0>{}, type_tag<S0>{}); }
  });
  for_each_type(copy_types{}, [&](auto c) {
    using C = typename decltype(c)::type;
    if constexpr (!std::is_same_v<C, C0>) { f(type_tag<I0>{}, type_tag<L0>{}, c, type_tag<S0>{}); }
  });
  for_each_type(storage_types{}, [&](auto s) {
    if constexpr (!std::is_same_v<typename decltype(s)::type, S0>) { f(type_tag<I0>{}, type_tag<L0>{}, type_tag<C0>{}, s); }
  });
}

}  // namespace rr_bench
