// Ranks and their roles on the host backend: a problem found on any rank reaches the output rank
// and fails the step there (sequence parallel: a bad id in another rank's shard; pipeline: a stage
// that recorded nothing, or a bad id); a capture-only rank's host memory does not grow with the KV
// pool or the requests.
#include "../support/allocation_counter.hpp"
#include "../support/error_checks.hpp"
#include "../support/thread_ranks.hpp"

#include <routing_replay/parallel/parallel_replay.hpp>
#include <routing_replay/parallel/thread_communicator.hpp>
#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

namespace rr = routing_replay;
using rr_test::expect_error;

namespace {

using output  = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::sync_copy, rr::per_request_storage>;
using replica = rr::parallel_replay<output, rr::thread_communicator>;

// Router output of model layers 1 and 2 for the step rows [first, first + rows): small_id(salt),
// except `bad` at (layer slot `bad_slot`, step row `bad_row`); K = 2 plus a fused shared expert.
std::vector<std::int64_t> router_rows(std::int64_t first, std::int64_t rows, std::int64_t salt, std::int32_t bad_slot = -1,
                                      std::int64_t bad_row = -1, std::int64_t bad = 0)
{
  std::vector<std::int64_t> ids;
  for (std::int32_t slot = 0; slot < 2; ++slot) {
    for (std::int64_t r = first; r < first + rows; ++r) {
      for (std::int32_t k = 0; k < 3; ++k) {
        ids.push_back(k == 2 ? 99 : (slot == bad_slot && r == bad_row && k == 0 ? bad : rr_test::small_id(slot, r, k, salt)));
      }
    }
  }
  return ids;
}

// One step of a rank: capture model layers `layers` (1 and/or 2) of `ids` (router_rows layout).
void forward(replica& rank, const std::vector<std::int64_t>& ids, std::int64_t rows, std::vector<std::int32_t> layers,
             rr::host_stream& stream)
{
  for (const std::int32_t layer : layers) {
    rank.capture(layer, ids.data() + (layer - 1) * rows * 3, rows, stream.ref());
  }
}

std::vector<std::int16_t> expected_rows(std::int64_t rows, std::int64_t salt)
{
  std::vector<std::int16_t> out;
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto row = rr_test::small_row<std::int16_t>(r, salt);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

}  // namespace

TEST_CASE("sequence parallel: a problem in another rank's shard fails the step on the output rank")
{
  bool skip_layer = false;
  SUBCASE("a bad id") { skip_layer = false; }
  SUBCASE("a layer left out") { skip_layer = true; }
  rr_test::on_thread_ranks(2, [&](int r, rr::thread_communicator comm) {
    replica rank{rr_test::small_config(), {rr::parallel_scheme::sequence, 0, {}}, comm};
    rr::host_stream stream;
    if (rank.is_output_rank()) { rank.output().add_request("chat-7"); }
    rr::step_plan plan;
    plan.schedule({"chat-7", 0, 6});
    const auto shard = rank.shard(plan);  // 3 rows each: rank 1 holds step rows 3, 4, 5
    CHECK(shard.shard_rows == 3);
    // step 1: rank 1 records expert 42 at step row 5 of model layer 2, or leaves model layer 2 out
    rank.begin_step(plan, stream.ref());
    const auto bad = router_rows(shard.first_row, 3, 0, r == 1 && !skip_layer ? 1 : -1, 5, 42);
    forward(rank, bad, 3, r == 1 && skip_layer ? std::vector<std::int32_t>{1} : std::vector<std::int32_t>{1, 2}, stream);
    if (!rank.is_output_rank()) {
      rank.end_step(stream.ref());  // capture-only ranks never see the verdict
    } else if (skip_layer) {
      expect_error([&] { rank.end_step(stream.ref()); }, rr::errc::missing_routing,
                   {"step 1", "layer 2 (slot 1)", "row 3 (request 'chat-7', position 3)", "3 (layer, row)", "discarded"});
    } else {
      expect_error([&] { rank.end_step(stream.ref()); }, rr::errc::invalid_expert_id,
                   {"step 1", "expert id 42", "layer 2 (slot 1)", "row 5 (request 'chat-7', position 5)", "discarded"});
    }
    stream.synchronize();
    if (rank.is_output_rank()) { CHECK(rank.output().recorded_rows("chat-7") == 0); }
    // step 2 is clean and filed whole
    rank.begin_step(plan, stream.ref());
    const auto good = router_rows(shard.first_row, 3, 1);
    forward(rank, good, 3, {1, 2}, stream);
    rank.end_step(stream.ref());
    stream.synchronize();
    if (rank.is_output_rank()) {
      const auto got = rank.output().extract("chat-7");
      CHECK(std::vector<std::int16_t>(got.flat().begin(), got.flat().end()) == expected_rows(6, 1));
    }
  });
}

TEST_CASE("pipeline parallel: a stage that recorded nothing leaves the sentinel, never a valid id")
{
  bool bad_id = false;
  SUBCASE("nothing recorded") { bad_id = false; }
  SUBCASE("a bad id") { bad_id = true; }
  rr_test::on_thread_ranks(2, [&](int r, rr::thread_communicator comm) {
    // stage 0 owns model layer 1 (slot 0), stage 1 owns model layer 2 and files
    replica rank{rr_test::small_config(), {rr::parallel_scheme::pipeline, 1, {1, 1}}, comm};
    rr::host_stream stream;
    if (rank.is_output_rank()) { rank.output().add_request(7); }
    rr::step_plan plan;
    plan.schedule({7, 0, 4});
    const std::vector<std::int32_t> mine{r == 0 ? 1 : 2};
    rank.begin_step(plan, stream.ref());
    const auto ids = router_rows(0, 4, 0, bad_id ? 0 : -1, 1, 42);
    if (r == 1 || bad_id) { forward(rank, ids, 4, mine, stream); }  // stage 0 delivers nothing, or a bad id
    if (!rank.is_output_rank()) {
      rank.end_step(stream.ref());
    } else if (bad_id) {
      expect_error([&] { rank.end_step(stream.ref()); }, rr::errc::invalid_expert_id,
                   {"expert id 42", "layer 1 (slot 0)", "row 1 (request 7, position 1)"});
    } else {
      expect_error([&] { rank.end_step(stream.ref()); }, rr::errc::missing_routing,
                   {"layer 1 (slot 0)", "4 (layer, row) pair(s) unwritten"});
    }
    stream.synchronize();
    if (rank.is_output_rank()) {
      CHECK(rank.output().recorded_rows(7) == 0);
      const auto none = rank.output().extract(7, {.start_position = 0, .end_position = 0});
      CHECK(none.num_rows() == 0);
    }
    rank.begin_step(plan, stream.ref());
    const auto good = router_rows(0, 4, 1);
    forward(rank, good, 4, mine, stream);
    rank.end_step(stream.ref());
    stream.synchronize();
    if (rank.is_output_rank()) {
      const auto got = rank.output().extract(7);
      CHECK(std::vector<std::int16_t>(got.flat().begin(), got.flat().end()) == expected_rows(4, 1));
    }
  });
}

TEST_CASE("a capture-only rank's host memory does not grow with the KV pool or the requests")
{
  using pooled = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>,
                                   rr::block_slot_storage>;
  // bytes operator new hands out while rank 1 of 2 (capture-only) is built, and while it runs 50 steps
  struct bytes { std::size_t built, steps; };
  auto capture_only_bytes = [](std::int64_t num_blocks, std::int64_t max_model_len) {
    rr::replay_config c;
    c.num_experts         = 128;
    c.top_k               = 8;
    c.max_tokens_per_step = 256;
    c.max_model_len       = max_model_len;
    c.moe_layers          = {0, 1, 2, 3};
    c.block_size          = 16;
    c.num_blocks          = num_blocks;
    rr::thread_group group{2};
    rr::host_stream stream;
    std::vector<std::int32_t> ids(256 * 8, 5);
    rr::step_plan plan;
    plan.schedule({"req", max_model_len - 200, 128});  // never looked up: capture-only ranks keep no requests
    bytes out{};
    rr_test::count_allocations(true);
    (void)rr_test::allocated_bytes_taken();
    rr::parallel_replay<pooled, rr::thread_communicator> rank{c, {}, group.communicator(1)};
    out.built = rr_test::allocated_bytes_taken();
    for (std::int64_t step = 0; step < 50; ++step) {
      rank.begin_step(plan, stream.ref());
      for (std::int32_t layer = 0; layer < 4; ++layer) { rank.capture(layer, ids.data(), 128, stream.ref()); }
      rank.end_step(stream.ref());
      stream.synchronize();
    }
    out.steps = rr_test::allocated_bytes_taken();
    rr_test::count_allocations(false);
    CHECK(!rank.is_output_rank());
    return out;
  };
  const bytes small = capture_only_bytes(64, 1024);
  const bytes large = capture_only_bytes(1 << 20, 1 << 20);
  // On the host backend D (256 x 4 x 8 int16 = 16 KiB) is host memory and counted: O(N_max L K).
  // Steps allocate only the host backend's task closures (a CUDA stream takes none of these).
  MESSAGE("capture-only rank, host backend: built with " << small.built << " bytes (64 blocks, max_model_len 1024) vs "
                                                          << large.built << " bytes (1M blocks, max_model_len 1M); 50 steps "
                                                          << small.steps << " vs " << large.steps << " bytes");
  CHECK(small.built == large.built);
  CHECK(small.built < 64 * 1024);  // nowhere near a pool of 1M blocks (1 GiB of rows)
  CHECK(large.steps < 1024 * 1024);
}
