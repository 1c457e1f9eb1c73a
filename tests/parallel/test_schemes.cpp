// Tensor, sequence and pipeline parallel on the host backend: ranks run as threads with the
// in-process stand-in for NCCL (thread_communicator), each on the same randomized schedule; the
// output rank's extractions are checked bit-exact against the reference model. Data parallel: each rank
// captures its span of an all-ranks router output, through one recorded forward.
#include "../support/data_parallel.hpp"
#include "../support/parallel_harness.hpp"
#include "../support/strategy_lists.hpp"

#include <routing_replay/parallel/thread_communicator.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace rr = routing_replay;

namespace {

using rr_test::harness_shape;
using rr_test::sim_config;

// Runs `ranks` threads, one rank each, on the schedule of `seed`; returns the output rank's rows.
template <class Output>
std::int64_t run_ranks(const rr::parallel_options& options, int ranks, std::uint64_t seed,
                       const rr_test::replication_map* map = nullptr)
{
  const sim_config sim = rr_test::schedule_for_seed(seed);
  harness_shape shape;
  shape.overwrite = seed == 3;
  rr::thread_group group{ranks, std::chrono::seconds{20}};
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  std::vector<std::int64_t> rows(static_cast<std::size_t>(ranks), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        rr::parallel_replay<Output, rr::thread_communicator> replay{rr_test::make_replay_config(sim, shape), options,
                                                                   group.communicator(r)};
        rr_test::rank_driver driver{replay, sim, shape, seed, map};
        driver.run(replay.is_output_rank() ? &replay.output() : static_cast<Output*>(nullptr));
        rows[static_cast<std::size_t>(r)] = driver.rows_checked();
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {  // a doctest assertion that failed (already reported)
        failures[static_cast<std::size_t>(r)] = "assertion failed";
      }
    });
  }
  for (auto& t : threads) { t.join(); }
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(failures[static_cast<std::size_t>(r)] == "");
  }
  return rows[static_cast<std::size_t>(options.output_rank)];
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("tensor parallel: only the output rank files; results match the reference model", RR,
                          tensor_parallel)
{
  for (const std::uint64_t seed : {1, 4}) {
    CAPTURE(seed);
    CHECK(run_ranks<RR>({rr::parallel_scheme::replicated, 1, {}}, 3, seed) > 0);
  }
}
TEST_CASE_TEMPLATE_APPLY(tensor_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("sequence parallel: shards gathered once per step match the reference model", RR,
                          sequence_parallel)
{
  for (const std::uint64_t seed : {2, 3, 8}) {
    CAPTURE(seed);
    CHECK(run_ranks<RR>({rr::parallel_scheme::sequence, 0, {}}, 2, seed) > 0);
    CHECK(run_ranks<RR>({rr::parallel_scheme::sequence, 2, {}}, 3, seed) > 0);
  }
}
TEST_CASE_TEMPLATE_APPLY(sequence_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("pipeline parallel: stages' slabs merged on the output rank match the reference model", RR,
                          pipeline_parallel)
{
  for (const std::uint64_t seed : {1, 4, 12}) {
    CAPTURE(seed);
    CHECK(run_ranks<RR>({rr::parallel_scheme::pipeline, 1, {2, 1}}, 2, seed) > 0);          // last stage files
    CHECK(run_ranks<RR>({rr::parallel_scheme::pipeline, 0, {0, 2, 1}}, 3, seed) > 0);       // a driver rank without layers
  }
}
TEST_CASE_TEMPLATE_APPLY(pipeline_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("expert parallel with EPLB: replicated physical experts are stored as logical ids", RR,
                          expert_parallel)
{
  const rr_test::replication_map map{harness_shape{}.num_experts, 20};
  for (const std::uint64_t seed : {1, 4}) {
    CAPTURE(seed);
    CHECK(run_ranks<RR>({rr::parallel_scheme::replicated, 0, {}}, 2, seed, &map) > 0);
  }
}
TEST_CASE_TEMPLATE_APPLY(expert_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("data parallel: one recorded forward replays correctly as the per-rank splits change", RR,
                          data_parallel)
{
  for (const std::uint64_t seed : {1, 4}) {
    for (int rank = 0; rank < 3; ++rank) {
      CAPTURE(seed);
      CAPTURE(rank);
      rr_test::dp_driver<RR> driver{rank, 3, rr_test::schedule_for_seed(seed), harness_shape{}, seed};
      rr_test::host_recorder recorder;
      driver.run(recorder);
      CHECK(driver.rows_checked() > 0);
    }
  }
}
TEST_CASE_TEMPLATE_APPLY(data_parallel, rr_test::one_per_strategy<rr::host_backend>);
