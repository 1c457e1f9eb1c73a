// Host soak: every copy strategy with both storages (rr_test::every_strategy_and_storage: eight
// combinations, four index types, both layouts between them) runs an endless realistic schedule
// against the reference model, --steps steps in all (default 100000, shared evenly by the runs),
// sampling resident memory; after warm-up each run's growth must stay under --max-growth-kib
// (default 2048). Prints one JSON line per run (with where its steps spent their time).
// scripts/soak.sh STEPS builds and runs it; CTest runs the default (label soak).
//
//   soak [--steps N] [--max-growth-kib K] [--scale] [--concurrent] [doctest options, e.g. -tc="*double_buffered*"]
//
// --scale runs the CUDA soak's engine and shape (N_max 8192, L 48, K 8: tests/gpu/scale.cuh) on the
// host backend, to measure what a step of it costs on the host. --concurrent runs the combinations
// at once, one thread each (as the CUDA soak does: rr_test::soak_all_at_once); the resident
// memory is then the process's, shared by the runs, and the limit is --max-growth-kib per run.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/soak.hpp"
#include "../support/strategy_lists.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace rr = routing_replay;

namespace {

std::int64_t soak_steps     = 100000;
std::int64_t max_growth_kib = 2048;
bool at_scale               = false;
bool concurrent             = false;

using combinations = rr_test::every_strategy_and_storage<rr::host_backend>;
constexpr auto runs = static_cast<std::int64_t>(std::tuple_size_v<combinations>);

// One run: `o.steps` steps, every row checked, resident memory flat; prints its JSON line.
template <class RR>
bool soak_run(const rr_test::soak_options& o)
{
  rr_test::harness_shape shape;
  shape.num_experts      = 128;
  shape.top_k            = 8;
  shape.moe_layers       = {1, 2, 3, 5, 6, 7};
  shape.num_model_layers = 8;
  const auto chunk = std::max<std::int64_t>(o.steps / 50, 1);
  const auto r     = rr_test::run_soak<RR>(at_scale ? rr_test::scale_schedule() : rr_test::soak_schedule(),
                                           at_scale ? rr_test::scale_shape() : shape, o.steps, 20261122, [&] {
                                             if (o.progress != nullptr) { *o.progress += chunk; }
                                             return rr_test::resident_kib();
                                           }, o.hooks);
  const std::int64_t limit = max_growth_kib * o.runs;
  const bool passed        = r.rows_checked > 0 && r.growth() <= limit;
  const std::string extra  = "\"scale\": " + std::string{at_scale ? "true" : "false"} +
                            ", \"runs_sharing_probes\": " + std::to_string(o.runs) + ", \"limit_kib\": " +
                            std::to_string(limit) + ", \"verdict\": \"" + (passed ? "PASS" : "FAIL") + "\"";
  std::printf("%s\n", rr_test::soak_json<RR>(r, "host", "rss", extra).c_str());
  std::fflush(stdout);
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= limit, "resident memory grew by " << r.growth() << " KiB after warm-up");
  return passed;
}

template <class... RR>
std::vector<rr_test::soak_entry> entries(std::tuple<RR...>* /*types*/)
{
  return {{std::string{RR::copy_type::name} + "/" + RR::storage_type::name, &soak_run<RR>}...};
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("soak: a realistic endless schedule, every row checked, memory flat after warm-up", RR,
                          soak_host)
{
  if (concurrent) { return; }  // the next test case runs them all at once
  soak_run<RR>(
    rr_test::soak_options{.steps = (soak_steps + runs - 1) / runs, .runs = 1, .hooks = {}, .progress = nullptr});
}
TEST_CASE_TEMPLATE_APPLY(soak_host, combinations);

TEST_CASE("soak: every combination at once, one thread each")
{
  if (!concurrent) { return; }
  rr_test::soak_all_at_once("host", entries(static_cast<combinations*>(nullptr)), (soak_steps + runs - 1) / runs, "",
                            0);
}

int main(int argc, char** argv)
{
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      soak_steps = std::strtoll(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--max-growth-kib") == 0 && i + 1 < argc) {
      max_growth_kib = std::strtoll(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--scale") == 0) {
      at_scale = true;
    } else if (std::strcmp(argv[i], "--concurrent") == 0) {
      concurrent = true;
    } else {
      rest.push_back(argv[i]);
    }
  }
  doctest::Context context{static_cast<int>(rest.size()), rest.data()};
  return context.run();
}
