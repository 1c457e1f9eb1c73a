// Word accesses at odd shapes on a GPU, the cases of tests/host/test_word_alignment.cpp: a 16- or
// 8-byte load or store at an address that is not a multiple of its size faults there
// ("misaligned address", a sticky error), so each case ends by checking that the device is still
// clean. step_snapshots (vLLM's path) with ring slots of an odd number of bytes and D narrowed to
// uint8; capture_buffer's end of step into snapshots at every offset within 16 bytes; slot_rows
// (SGLang's path) with rows of 1, 3, 6 and 16 bytes, its steps scattered and stored by the
// end-of-step kernel, and a refused one. Part of gpu_tests (its main returns 77 without a GPU).
#include "../support/word_shapes.hpp"

#include <routing_replay/cuda_backend.cuh>

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rr = routing_replay;

namespace {

void require_device_clean()
{
  const cudaError_t status = cudaDeviceSynchronize();
  INFO(cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

template <class Index, class Out>
void step_snapshot_shapes(std::int32_t experts)
{
  for (const std::int32_t layers : {1, 2, 3}) {
    for (const std::int32_t top_k : {1, 2, 3}) {
      for (const std::int32_t max_rows : {1, 5, 8, 9, 24}) {
        CAPTURE(layers);
        CAPTURE(top_k);
        CAPTURE(max_rows);
        CHECK(rr_test::step_snapshot_errors<rr::cuda_backend, Index, Out>(layers, top_k, experts, max_rows, 3) == 0);
        require_device_clean();
      }
    }
  }
  CHECK(rr_test::step_snapshot_errors<rr::cuda_backend, Index, Out>(48, 8, experts, 33, 2) == 0);
  require_device_clean();
}

}  // namespace

TEST_CASE("CUDA word alignment: step_snapshots with ring slots of any size")
{
  SUBCASE("uint8 ids, E = 128") { step_snapshot_shapes<std::uint8_t, std::uint8_t>(128); }
  SUBCASE("uint16 in D, uint8 out, E = 256") { step_snapshot_shapes<std::uint16_t, std::uint8_t>(256); }
  SUBCASE("uint16 ids, E = 257") { step_snapshot_shapes<std::uint16_t, std::uint16_t>(257); }
  SUBCASE("int32 in D, uint16 out, E = 65536") { step_snapshot_shapes<std::int32_t, std::uint16_t>(65536); }
}

TEST_CASE_TEMPLATE("CUDA word alignment: capture_buffer's end of step into a snapshot at any offset", Index,
                   std::uint8_t, std::uint16_t, std::int16_t, std::int32_t)
{
  for (const std::int32_t top_k : {1, 3, 4, 8, 16}) {
    for (const std::int32_t offset : {0, 1, 2, 3, 4, 8}) {
      CAPTURE(top_k);
      CAPTURE(offset);
      CHECK(rr_test::capture_buffer_errors<rr::cuda_backend, Index, rr::token_major>(3, top_k, 5, offset) == 0);
      require_device_clean();
      CHECK(rr_test::capture_buffer_errors<rr::cuda_backend, Index, rr::layer_major>(2, top_k, 5, offset) == 0);
      require_device_clean();
    }
  }
}

TEST_CASE_TEMPLATE("CUDA word alignment: slot_rows with rows of 1, 3, 6 and 16 bytes, scattered and stored by the "
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
      CHECK(rr_test::slot_rows_errors<rr::cuda_backend, Index>(layers, top_k, 7, fused_max_rows) == 0);
      require_device_clean();
    }
  }
}
