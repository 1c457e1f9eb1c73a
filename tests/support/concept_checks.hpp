/// @file
/// Compile-time checks of every policy concept; included by a g++ and an nvcc translation unit so
/// both compilers agree (nvcc has had concept bugs).
#pragma once

#include <routing_replay/parallel/packet_worker.hpp>
#include <routing_replay/parallel/parallel_replay.hpp>
#include <routing_replay/parallel/scheduler_replay.hpp>
#include <routing_replay/parallel/thread_communicator.hpp>
#include <routing_replay/routing_replay.hpp>

#include <cstdint>
#include <type_traits>

namespace rr_test::concept_checks {

namespace rr = routing_replay;

static_assert(rr::expert_index<std::uint8_t> && rr::expert_index<std::uint16_t> &&
              rr::expert_index<std::int16_t> && rr::expert_index<std::int32_t>);
static_assert(!rr::expert_index<bool> && !rr::expert_index<std::int64_t> && !rr::expert_index<float>);
static_assert(rr::source_index<std::int64_t> && rr::source_index<std::int32_t> &&
              rr::source_index<std::int16_t> && !rr::source_index<double>);

static_assert(rr::buffer_layout<rr::layer_major> && rr::buffer_layout<rr::token_major>);
static_assert(!rr::buffer_layout<cuda::std::layout_left>);

static_assert(rr::copy_strategy<rr::sync_copy> && rr::copy_strategy<rr::async_event> &&
              rr::copy_strategy<rr::double_buffered<2>> && rr::copy_strategy<rr::double_buffered<5>> &&
              rr::copy_strategy<rr::device_scatter<1>> && rr::copy_strategy<rr::device_scatter<3>>);
static_assert(!rr::copy_strategy<int>);
// a kernel-side scatter runs after the copy's event, so it needs a side stream
struct device_scatter_on_compute_stream {
  static constexpr int ring_depth                   = 2;
  static constexpr bool uses_side_stream            = false;
  static constexpr rr::scatter_timing timing        = rr::scatter_timing::deferred;
  static constexpr rr::scatter_site site            = rr::scatter_site::device;
};
static_assert(!rr::copy_strategy<device_scatter_on_compute_stream>);

static_assert(rr::host_storage<rr::per_request_storage> && rr::host_storage<rr::block_slot_storage>);
// device scatter writes rows in place from a kernel: both storages keep row addresses fixed
static_assert(rr::block_slot_storage::stable_row_addresses && rr::per_request_storage::stable_row_addresses);
static_assert(!rr::host_storage<rr::sync_copy>);

static_assert(rr::backend<rr::host_backend>);
static_assert(!rr::backend<rr::per_request_storage>);
// a host stream's failure reaches the host through the next event recorded on that stream only,
// so the copy pipeline also queries the snapshot's event (CUDA's failures are sticky: test_cuda.cu)
static_assert(!rr::failures_are_sticky<rr::host_backend>);

// sentinels: a missing row never reads as a valid expert id, and every byte of one is 0xFF
static_assert(rr::index_traits<std::uint8_t>::sentinel == 255 && rr::index_traits<std::uint8_t>::max_experts == 255);
static_assert(rr::index_traits<std::uint16_t>::sentinel == 65535 && rr::index_traits<std::uint16_t>::max_experts == 65535);
static_assert(rr::index_traits<std::int16_t>::sentinel == -1 && rr::index_traits<std::int16_t>::max_experts == 32768);
static_assert(rr::index_traits<std::int32_t>::sentinel == -1);

// the device reference goes to kernels by value
static_assert(std::is_trivially_copyable_v<rr::device_ref<std::int16_t, rr::layer_major>>);
static_assert(std::is_trivially_copyable_v<rr::device_ref<std::uint8_t, rr::token_major>>);

// the owning object is move-only
using replay = rr::RoutingReplay<rr::host_backend>;
static_assert(std::is_nothrow_move_constructible_v<replay> && !std::is_copy_constructible_v<replay>);
using scattering = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major, rr::device_scatter<2>,
                                     rr::block_slot_storage>;
static_assert(std::is_nothrow_move_constructible_v<scattering> && !std::is_copy_constructible_v<scattering>);
// an engine may hand its own copy stream to strategies that copy on a side stream, and only to those
static_assert(std::is_constructible_v<scattering, rr::replay_config, rr::host_stream_ref>);
static_assert(!std::is_constructible_v<replay, rr::replay_config, rr::host_stream_ref>);

// the layer view meets FlashInfer's routing_replay_out contract with layer_major + int16
static_assert(std::is_same_v<replay::layer_view_type::layout_type, cuda::std::layout_right>);
static_assert(std::is_same_v<replay::layer_view_type::element_type, std::int16_t>);

// parallel engines: collectives are a policy; the output rank's side is a RoutingReplay or a worker
static_assert(rr::communicator<rr::thread_communicator, rr::host_stream_ref>);
static_assert(!rr::communicator<int, rr::host_stream_ref> && !rr::communicator<rr::thread_group, rr::host_stream_ref>);
static_assert(std::is_trivially_copyable_v<rr::thread_communicator> && std::is_trivially_copyable_v<rr::row_span>);
static_assert(rr::output_side<replay> && rr::output_side<scattering>);
static_assert(rr::output_side<rr::packet_worker<rr::host_backend, std::uint8_t, rr::token_major, rr::double_buffered<2>>>);
static_assert(!rr::output_side<rr::scheduler_replay<>>);  // no device: it files packets
// the scheduler side answers the same request calls as RoutingReplay
static_assert(std::is_same_v<rr::scheduler_replay<>::result_type, replay::result_type>);

}  // namespace rr_test::concept_checks
