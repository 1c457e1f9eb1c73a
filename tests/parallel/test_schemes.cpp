// Tensor, sequence and pipeline parallel on the host backend: ranks run as threads with the
// in-process stand-in for NCCL (thread_communicator), each on the same randomized schedule; the
// output rank's extractions are checked bit-exact against the reference model. Data parallel: each rank
// captures its span of an all-ranks router output, through one recorded forward.
#include "../support/data_parallel.hpp"
#include "../support/parallel_harness.hpp"
#include "../support/strategy_lists.hpp"
#include "../support/thread_ranks.hpp"

#include <routing_replay/parallel/thread_communicator.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace rr = routing_replay;

namespace {

using rr_test::harness_shape;

// One layout of an engine: its options and how many ranks it has.
struct ranks_of {
  rr::parallel_options options;
  int ranks;
};

// Every layout on the schedule of every seed, its ranks as threads; the output rank must have
// checked rows.
template <class Output>
void check_ranks(std::initializer_list<std::uint64_t> seeds, std::initializer_list<ranks_of> layouts,
                 const rr_test::replication_map* map = nullptr)
{
  for (const std::uint64_t seed : seeds) {
    for (const ranks_of& layout : layouts) {
      CAPTURE(seed);
      CAPTURE(layout.ranks);
      const rr_test::sim_config sim = rr_test::schedule_for_seed(seed);
      harness_shape shape;
      shape.overwrite   = seed == 3;
      std::int64_t rows = 0;
      std::vector<std::int64_t> steps(static_cast<std::size_t>(layout.ranks), -1);  // -1: the rank failed
      rr_test::on_thread_ranks(layout.ranks, [&](int r, rr::thread_communicator comm) {
        rr::parallel_replay<Output, rr::thread_communicator> replay{rr_test::make_replay_config(sim, shape),
                                                                   layout.options, comm};
        rr_test::rank_driver driver{replay, sim, shape, seed, map};
        driver.run(replay.is_output_rank() ? &replay.output() : static_cast<Output*>(nullptr));
        if (replay.is_output_rank()) { rows = driver.rows_checked(); }
        steps[static_cast<std::size_t>(r)] = driver.steps();
      });
      std::string steps_run;  // each rank's, -1 where it failed: a rank that ran fewer steps diverged
      for (const std::int64_t n : steps) { steps_run += std::to_string(n) + " "; }
      CAPTURE(steps_run);
      CHECK(rows > 0);
    }
  }
}

constexpr auto replicated = rr::parallel_scheme::replicated;
constexpr auto sequence   = rr::parallel_scheme::sequence;
constexpr auto pipeline   = rr::parallel_scheme::pipeline;

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("tensor parallel: only the output rank files; results match the reference model", RR,
                          tensor_parallel)
{
  check_ranks<RR>({1, 4}, {{{replicated, 1, {}}, 3}});
}
TEST_CASE_TEMPLATE_APPLY(tensor_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("sequence parallel: shards gathered once per step match the reference model", RR,
                          sequence_parallel)
{
  check_ranks<RR>({2, 3, 8}, {{{sequence, 0, {}}, 2}, {{sequence, 2, {}}, 3}});
}
TEST_CASE_TEMPLATE_APPLY(sequence_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("pipeline parallel: stages' slabs merged on the output rank match the reference model", RR,
                          pipeline_parallel)
{
  // the last stage files; a driver rank without layers files
  check_ranks<RR>({1, 4, 12}, {{{pipeline, 1, {2, 1}}, 2}, {{pipeline, 0, {0, 2, 1}}, 3}});
}
TEST_CASE_TEMPLATE_APPLY(pipeline_parallel, rr_test::one_per_strategy<rr::host_backend>);

TEST_CASE_TEMPLATE_DEFINE("expert parallel with EPLB: replicated physical experts are stored as logical ids", RR,
                          expert_parallel)
{
  const rr_test::replication_map map{harness_shape{}.num_experts, 20};
  check_ranks<RR>({1, 4}, {{{replicated, 0, {}}, 2}}, &map);
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
