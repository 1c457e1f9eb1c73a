// Word accesses at odd shapes on the host backend: step_snapshots (vLLM's path) for every pair of
// index and output types with rows of 1 to 24 ids, ring slots of an odd number of bytes and D
// narrowed to uint8; capture_buffer's end-of-step kernel into snapshots at every offset within 16
// bytes; slot_rows (SGLang's path) with rows of 1, 3, 6 and 16 bytes, its steps scattered and stored
// by the end-of-step kernel, and a refused one. Every word a kernel moves is checked for the
// alignment a GPU needs (detail::require_word_aligned() aborts the run otherwise), and every id must
// come back.
#include "../support/word_shapes.hpp"

#include <routing_replay/host_backend.hpp>

#include <doctest/doctest.h>

#include <cstdint>

namespace rr = routing_replay;

namespace {

// the shapes of routing_replay.vllm's traces (L 1-3, K 1-3, N_max from 1 to a block multiple)
// and a production one (L 48, K 8)
template <class Index, class Out>
void step_snapshot_shapes(std::int32_t experts)
{
  for (const std::int32_t layers : {1, 2, 3}) {
    for (const std::int32_t top_k : {1, 2, 3}) {
      for (const std::int32_t max_rows : {1, 5, 8, 9, 24}) {
        CAPTURE(layers);
        CAPTURE(top_k);
        CAPTURE(max_rows);
        CHECK(rr_test::step_snapshot_errors<rr::host_backend, Index, Out>(layers, top_k, experts, max_rows, 3) == 0);
      }
    }
  }
  CHECK(rr_test::step_snapshot_errors<rr::host_backend, Index, Out>(48, 8, experts, 33, 2) == 0);
}

}  // namespace

TEST_CASE("word alignment: step_snapshots with ring slots of any size")
{
  SUBCASE("uint8 ids, E = 128") { step_snapshot_shapes<std::uint8_t, std::uint8_t>(128); }
  SUBCASE("uint16 in D, uint8 out, E = 256") { step_snapshot_shapes<std::uint16_t, std::uint8_t>(256); }
  SUBCASE("uint16 ids, E = 257") { step_snapshot_shapes<std::uint16_t, std::uint16_t>(257); }
  SUBCASE("int32 in D, uint16 out, E = 65536") { step_snapshot_shapes<std::int32_t, std::uint16_t>(65536); }
}

TEST_CASE_TEMPLATE("word alignment: capture_buffer's end of step into a snapshot at any offset", Index, std::uint8_t,
                   std::uint16_t, std::int16_t, std::int32_t)
{
  for (const std::int32_t top_k : {1, 3, 4, 8, 16}) {
    for (const std::int32_t offset : {0, 1, 2, 3, 4, 8}) {
      CAPTURE(top_k);
      CAPTURE(offset);
      CHECK(rr_test::capture_buffer_errors<rr::host_backend, Index, rr::token_major>(3, top_k, 5, offset) == 0);
      CHECK(rr_test::capture_buffer_errors<rr::host_backend, Index, rr::layer_major>(2, top_k, 5, offset) == 0);
    }
  }
}

TEST_CASE_TEMPLATE("word alignment: slot_rows with rows of 1, 3, 6 and 16 bytes, scattered and stored by the "
                   "end-of-step kernel",
                   Index, std::uint8_t, std::uint16_t, std::int32_t)
{
  for (const auto& [layers, top_k] : {std::pair{1, 1}, std::pair{3, 1}, std::pair{1, 3}, std::pair{2, 8}, std::pair{48, 8}}) {
    CAPTURE(layers);
    CAPTURE(top_k);
    // every step scattered; steps of 7 rows scattered and of 3 stored by the end-of-step kernel; every
    // step stored by it
    for (const std::int32_t fused_max_rows : {0, 3, 64}) {
      CAPTURE(fused_max_rows);
      CHECK(rr_test::slot_rows_errors<rr::host_backend, Index>(layers, top_k, 7, fused_max_rows) == 0);
    }
  }
}
