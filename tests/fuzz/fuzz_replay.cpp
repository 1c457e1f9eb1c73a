// libFuzzer harness: decodes its input into a configuration, a policy combination and a sequence of
// public calls on a host-backend RoutingReplay (requests, plans with arbitrary ids, positions,
// slots, draft counts and skips, writes through every capture path with ids in and out of range,
// end_step, accept_draft, abort, release, extraction with options, block transfers, drain, moves),
// and checks every call with rr_test::checked_replay: accepted calls against the reference model,
// refused calls for their code and for an unchanged state. A contract violation aborts, so
// libFuzzer keeps the input; so does any sanitizer report.
//
// Build and run: scripts/fuzz.sh SECONDS (clang, -fsanitize=fuzzer,address,undefined).
// The seed corpus is tests/fuzz/corpus; inputs that once failed are in tests/fuzz/regressions (bugs
// of the harness) and tests/fuzz/core_bugs (the core bugs it found, docs/reliability.md section 3),
// and run as CTest tests (label fuzz).
#include "../support/checked_replay.hpp"

#include <routing_replay/routing_replay.hpp>

#include <fuzzer/FuzzedDataProvider.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <string_view>
#include <tuple>
#include <vector>

namespace rr = routing_replay;

namespace {

// Every copy strategy, both storages, every index type and both layouts, each at least once.
using fuzzed_types =
  std::tuple<rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>,
             rr::RoutingReplay<rr::host_backend, std::uint8_t, rr::token_major, rr::sync_copy, rr::block_slot_storage>,
             rr::RoutingReplay<rr::host_backend, std::uint8_t, rr::token_major, rr::async_event, rr::per_request_storage>,
             rr::RoutingReplay<rr::host_backend, std::int32_t, rr::layer_major, rr::async_event, rr::block_slot_storage>,
             rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>, rr::block_slot_storage>,
             rr::RoutingReplay<rr::host_backend, std::int32_t, rr::token_major, rr::double_buffered<3>, rr::per_request_storage>,
             rr::RoutingReplay<rr::host_backend, std::uint16_t, rr::token_major, rr::device_scatter<2>, rr::block_slot_storage>,
             rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<1>, rr::block_slot_storage>,
             // added after the seed corpus and the regression inputs (see pick_type()): a device
             // scatter over per-request storage claims the common runs while it validates a plan
             rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>, rr::per_request_storage>>;

// The type an input runs: the seed corpus and the regression inputs were written when eight types
// were picked by their last byte modulo 8. Picking modulo 16 keeps each input's type (value v and
// v + 8 name type v), but for one value, unused by tests/fuzz/regressions and core_bugs, that names
// the type added since. RR_FUZZ_TYPE=N runs every input as type N instead: each seed input is then a
// new trace for that type (CORE-BUG-21 and 22 were found by running the seed corpus so).
std::size_t pick_type(FuzzedDataProvider& in)
{
  static_assert(std::tuple_size_v<fuzzed_types> == 9);
  constexpr std::size_t added = 13;  // type 5 before
  const auto v = in.ConsumeIntegralInRange<std::size_t>(0, 15);
  static const int forced = [] {
    const char* n = std::getenv("RR_FUZZ_TYPE");
    return n != nullptr ? std::atoi(n) : -1;
  }();
  if (forced >= 0 && static_cast<std::size_t>(forced) < std::tuple_size_v<fuzzed_types>) {
    return static_cast<std::size_t>(forced);
  }
  return v == added ? 8 : v % 8;
}

// Request ids: integers and strings, including the integer 7 and the string "7", which must never
// alias, and the empty string.
constexpr std::array<std::int64_t, 6> integer_ids = {0, 1, 2, 7, 42, -9};
constexpr std::array<std::string_view, 6> string_ids = {"a", "b", "7", "", "chat-7", "a-rather-long-request-name-0123456789"};

rr::request_key pick_key(FuzzedDataProvider& in)
{
  const auto i = in.ConsumeIntegralInRange<std::size_t>(0, 11);
  return i < 6 ? rr::request_key{integer_ids[i]} : rr::request_key{string_ids[i - 6]};
}

rr::replay_config decode_config(FuzzedDataProvider& in, bool slot_storage)
{
  rr::replay_config c;
  c.num_experts              = in.PickValueInArray({5, 40, 200});
  c.top_k                    = in.ConsumeIntegralInRange(1, 3);
  c.num_fused_shared_experts = in.ConsumeIntegralInRange(0, 1);
  c.max_tokens_per_step      = in.PickValueInArray({4, 8, 16});
  c.max_model_len            = in.PickValueInArray({12, 24, 40});
  switch (in.ConsumeIntegralInRange(0, 2)) {
    case 0: c.moe_layers = {1, 3}; c.num_model_layers = 4; break;  // dense layers 0 and 2
    case 1: c.moe_layers = {0}; break;
    default: c.moe_layers = {2, 0, 1}; break;                      // captured out of model order
  }
  c.block_size                = in.PickValueInArray({2, 4});
  c.num_blocks                = in.PickValueInArray({4, 8, 12});
  c.overwrite_recomputed_rows = in.ConsumeBool();
  // per-request storage: a tight limit exercises exact growth and host_memory_exhausted
  if (!slot_storage && in.ConsumeBool()) { c.host_memory_limit = in.ConsumeIntegralInRange<std::size_t>(64, 4096); }
  return c;
}

// The decoder: each call's arguments come from the input, biased towards calls that the contract
// accepts (positions at the request's cursor, slots of its own blocks) so that deep states are
// reached, with every kind of invalid argument reachable.
template <class RR>
class call_decoder {
 public:
  call_decoder(FuzzedDataProvider& in, rr_test::checked_replay<RR>& d) : in_(in), d_(d) {}

  void run(int max_calls)
  {
    for (int i = 0; i < max_calls && in_.remaining_bytes() > 0; ++i) { one_call(); }
    d_.check_everything();
  }

 private:
  rr::request_key key()
  {
    const auto live = d_.live_keys();
    if (!live.empty() && in_.ConsumeIntegralInRange(0, 3) != 0) {
      return live[in_.ConsumeIntegralInRange<std::size_t>(0, live.size() - 1)];
    }
    return pick_key(in_);
  }

  std::int64_t position(rr::request_key id)
  {
    const std::int64_t at  = d_.cursor(id);
    const std::int64_t len = d_.config().max_model_len;
    switch (in_.ConsumeIntegralInRange(0, 7)) {
      case 0: return in_.ConsumeIntegralInRange<std::int64_t>(-2, len + 2);
      case 1: return std::max<std::int64_t>(at - in_.ConsumeIntegralInRange<std::int64_t>(1, 4), 0);  // recompute
      case 2:
        return in_.PickValueInArray({std::numeric_limits<std::int64_t>::max() - 2,
                                     std::numeric_limits<std::int64_t>::min() + 2, len - 1, len});
      default: return at;
    }
  }

  // A span of slots for `n` tokens at `first`, stored in `lists` (the plan refers to it).
  std::span<const std::int64_t> slots(rr::request_key id, std::int64_t first, std::int32_t n,
                                      std::deque<std::vector<std::int64_t>>& lists)
  {
    auto& s            = lists.emplace_back();
    const auto mode    = in_.ConsumeIntegralInRange(0, 9);
    if (first < 0 || first > d_.config().max_model_len) { first = 0; }  // positions the call refuses anyway
    const std::int64_t count = mode == 7 ? std::max(n - 1, 0) : mode == 8 ? n + 1 : std::max(n, 0);
    for (std::int64_t i = 0; i < count; ++i) {
      s.push_back(mode == 9 ? in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.slots())
                            : d_.natural_slot(id, first + i));
    }
    if (mode == 6 && !s.empty()) {  // one foreign slot: shared with another request, or out of the pool
      s[in_.ConsumeIntegralInRange<std::size_t>(0, s.size() - 1)] =
        in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.slots());
    }
    return s;
  }

  std::vector<std::int64_t> blocks(std::int64_t max_count)
  {
    std::vector<std::int64_t> out(in_.ConsumeIntegralInRange<std::size_t>(0, static_cast<std::size_t>(max_count)));
    for (auto& b : out) { b = in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.config().num_blocks); }
    return out;
  }

  void begin_step()
  {
    rr::step_plan plan;
    std::deque<std::vector<std::int64_t>> lists;
    std::vector<std::int64_t> fresh;
    const auto entries = in_.ConsumeIntegralInRange(0, 4);
    for (int e = 0; e < entries; ++e) {
      if (in_.ConsumeIntegralInRange(0, 4) == 0) {
        plan.skip(in_.ConsumeIntegralInRange(-1, 3));
        continue;
      }
      const auto id            = key();
      const std::int64_t first = position(id);
      const auto n             = in_.ConsumeIntegralInRange(-1, 6);
      const auto drafts        = in_.ConsumeIntegralInRange(0, 15) == 0 ? 33 : in_.ConsumeIntegralInRange(-1, 3);
      const auto s             = slots(id, first, n, lists);
      for (const auto slot : s) {  // natural plans declare the blocks they enter
        if (slot >= 0 && slot < d_.slots() && in_.ConsumeBool()) { fresh.push_back(slot / d_.config().block_size); }
      }
      plan.schedule({id, first, n, drafts, s});
    }
    const auto extra = blocks(2);
    fresh.insert(fresh.end(), extra.begin(), extra.end());
    plan.add_fresh_blocks(fresh);
    if (in_.ConsumeBool()) {
      plan.set_padded_rows(in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.config().max_tokens_per_step + 2));
    }
    d_.begin_step(plan);
  }

  void write()
  {
    rr_test::write_spec w;
    w.via      = static_cast<rr_test::write_spec::path>(in_.ConsumeIntegralInRange(0, 2));
    const auto& layers = d_.config().moe_layers;
    w.layer    = in_.ConsumeIntegralInRange(0, 5) == 0
                   ? in_.ConsumeIntegralInRange(-1, d_.config().num_model_layers)
                   : (w.via == rr_test::write_spec::path::device_ref
                        ? in_.ConsumeIntegralInRange<std::int32_t>(0, static_cast<std::int32_t>(layers.size()) - 1)
                        : layers[in_.ConsumeIntegralInRange<std::size_t>(0, layers.size() - 1)]);
    w.num_rows = in_.ConsumeIntegralInRange(0, 6) == 0
                   ? in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.config().max_tokens_per_step + 1)
                   : d_.open_rows();
    w.salt     = in_.ConsumeIntegral<std::uint32_t>();
    if (in_.ConsumeIntegralInRange(0, 3) == 0) {
      w.bad      = static_cast<rr_test::write_spec::defect>(in_.ConsumeIntegralInRange(1, 4));
      w.bad_cell = in_.ConsumeIntegralInRange<std::int64_t>(0, std::max<std::int64_t>(w.num_rows * d_.config().top_k, 1));
    }
    w.source_bits = in_.PickValueInArray({16, 32, 64});
    if (in_.ConsumeIntegralInRange(0, 7) == 0) {
      w.stride = in_.ConsumeIntegralInRange<std::int64_t>(d_.config().top_k - 1, d_.config().top_k + 3);
    }
    if (in_.ConsumeIntegralInRange(0, 7) == 0) { w.row_offset = in_.ConsumeIntegralInRange<std::int64_t>(-1, 3); }
    w.null_ids  = in_.ConsumeIntegralInRange(0, 31) == 0;
    w.physical  = in_.ConsumeIntegralInRange(0, 5) == 0;
    w.empty_map = in_.ConsumeIntegralInRange(0, 31) == 0;
    d_.write(w);
  }

  rr::extract_options extract_options(rr::request_key id)
  {
    rr::extract_options o;
    const std::int64_t rows = d_.model_rows(id);
    if (in_.ConsumeBool()) { o.start_position = in_.ConsumeIntegralInRange<std::int64_t>(-1, rows + 1); }
    if (in_.ConsumeBool()) { o.end_position = in_.ConsumeIntegralInRange<std::int64_t>(-1, rows + 1); }
    if (in_.ConsumeBool()) { o.prompt_length = in_.ConsumeIntegralInRange<std::int64_t>(-1, rows + 2); }
    o.include_dense_layers = in_.ConsumeIntegralInRange(0, 3) == 0;
    return o;
  }

  void one_call()
  {
    switch (in_.ConsumeIntegralInRange(0, 21)) {
      case 0: {
        const auto id = key();
        std::vector<std::int64_t> cached;
        if (in_.ConsumeBool()) {
          const auto n = in_.ConsumeIntegralInRange<std::int64_t>(0, d_.config().max_model_len + 1);
          for (std::int64_t p = 0; p < n; ++p) { cached.push_back(in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.slots())); }
        }
        d_.add_request(id, in_.ConsumeIntegralInRange<std::int64_t>(-1, 20), cached);
        break;
      }
      case 1: {
        const auto id = key();
        std::vector<std::int64_t> cached;
        const auto n = in_.ConsumeIntegralInRange<std::int64_t>(0, d_.config().max_model_len + 1);
        // a prefix hit on the blocks of a live request, or on arbitrary slots
        const auto from = key();
        const bool natural = in_.ConsumeBool();
        for (std::int64_t p = 0; p < n; ++p) {
          cached.push_back(natural ? d_.natural_slot(from, p) : in_.ConsumeIntegralInRange<std::int64_t>(-1, d_.slots()));
        }
        d_.add_cached_prefix(id, cached);
        break;
      }
      case 2: begin_step(); break;
      case 3:
      case 4: write(); break;
      case 5: d_.end_step(); break;
      case 6: d_.accept_draft(key(), in_.ConsumeIntegralInRange(-1, 4)); break;
      case 7: d_.release(key()); break;
      case 8: d_.abort(key()); break;
      case 9: {
        const auto id = key();
        d_.extract(id, extract_options(id));
        break;
      }
      case 10: {
        const auto id = key();
        d_.extract_into(id, extract_options(id), in_.ConsumeIntegralInRange<std::int64_t>(-1, 2));
        break;
      }
      case 11: d_.recorded_rows(key()); break;
      case 12: d_.drain(); break;
      case 13: d_.export_blocks(blocks(3), in_.ConsumeIntegralInRange<std::int64_t>(-1, 1)); break;
      case 14: d_.import_blocks(blocks(3), in_.ConsumeIntegralInRange<std::int64_t>(-1, 1), in_.ConsumeIntegral<std::uint32_t>()); break;
      case 15: {
        const auto source = blocks(2);
        auto destination  = blocks(2);
        if (in_.ConsumeBool()) { destination.resize(source.size(), 0); }
        d_.copy_blocks(source, destination);
        break;
      }
      case 16: d_.move_round_trip(); break;
      case 17: d_.replace(); break;
      case 18: d_.reset_device_buffer(); break;
      case 19: d_.layer_slot(in_.ConsumeIntegralInRange(-1, d_.config().num_model_layers)); break;
      case 20: d_.check_everything(); break;
      default:
        d_.natural_step(in_.ConsumeIntegralInRange(1, 4), in_.ConsumeIntegralInRange(1, 4),
                        in_.ConsumeIntegralInRange(0, 2), in_.ConsumeIntegral<std::uint32_t>());
        break;
    }
  }

  FuzzedDataProvider& in_;
  rr_test::checked_replay<RR>& d_;
};

template <class RR>
void run_one(FuzzedDataProvider& in)
{
  constexpr bool slot_storage = std::is_same_v<typename RR::storage_type, rr::block_slot_storage>;
  const auto config           = decode_config(in, slot_storage);
  try {
    rr_test::checked_replay<RR> d{config};
    d.set_full_snapshots(in.ConsumeBool());
    d.set_trace(std::getenv("RR_FUZZ_TRACE") != nullptr);
    call_decoder<RR>{in, d}.run(300);
  } catch (const rr_test::contract_violation& v) {
    std::fprintf(stderr, "\n%s\npolicies: %s index, %s, %s, %s\n", v.what(), sizeof(typename RR::index_type) == 1 ? "1-byte" : "wider",
                 rr::layout_traits<typename RR::layout_type>::name, RR::copy_type::name, RR::storage_type::name);
    std::abort();
  }
}

template <std::size_t... I>
void dispatch(std::size_t which, FuzzedDataProvider& in, std::index_sequence<I...>)
{
  ((which == I ? run_one<std::tuple_element_t<I, fuzzed_types>>(in) : void()), ...);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  FuzzedDataProvider in{data, size};
  dispatch(pick_type(in), in, std::make_index_sequence<std::tuple_size_v<fuzzed_types>>{});
  return 0;
}
