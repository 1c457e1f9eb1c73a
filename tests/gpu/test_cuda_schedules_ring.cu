// Randomized engine schedules on the CUDA backend, bit-exact against the reference model: every
// combination with double_buffered and device_scatter (see test_cuda_schedules.cu), and the same at
// realistic scale (scale.cuh).
#include "../support/harness.hpp"
#include "../support/policy_combinations.hpp"
#include "scale.cuh"

#include <routing_replay/routing_replay.cuh>

#include <doctest/doctest.h>

namespace rr = routing_replay;

TEST_CASE_TEMPLATE_DEFINE("CUDA: randomized schedules match the reference model (ring strategies)", RR,
                          schedules_cuda_ring)
{
  rr_test::check_randomized_schedules<RR>({1, 2, 3, 4});
}
TEST_CASE_TEMPLATE_APPLY(schedules_cuda_ring,
                         rr_test::concat<rr_test::all_combinations<rr::cuda_backend, rr::double_buffered<2>>,
                                         rr_test::all_combinations<rr::cuda_backend, rr::device_scatter<2>>>);

using scale_types_ring =
  std::tuple<rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>,
                               rr::per_request_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::double_buffered<2>,
                               rr::block_slot_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                               rr::block_slot_storage>,
             rr::RoutingReplay<rr::cuda_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                               rr::per_request_storage>>;

TEST_CASE_TEMPLATE_DEFINE("CUDA at scale (N_max 8192, L 48, K 8): randomized schedules match the reference model (ring strategies)",
                          RR, scale_cuda_ring)
{
  rr_test::check_at_scale<RR>();
}
TEST_CASE_TEMPLATE_APPLY(scale_cuda_ring, scale_types_ring);

TEST_CASE_TEMPLATE_DEFINE("CUDA soak: device and host memory flat after warm-up (ring strategies)" * doctest::skip(),
                          RR, soak_cuda_ring)
{
  rr_test::soak_at_scale<RR>();
}
TEST_CASE_TEMPLATE_APPLY(soak_cuda_ring, scale_types_ring);

namespace {
[[maybe_unused]] const bool soaks_registered = rr_test::register_soaks(static_cast<scale_types_ring*>(nullptr));
}  // namespace
