// Host soak: every copy strategy (with both storages between them: rr_test::one_per_strategy)
// runs an endless realistic schedule against the reference model, --steps steps in all (default
// 100000, shared evenly by the strategies), sampling resident memory; after warm-up each run's
// growth must stay under --max-growth-kib (default 2048). Prints one JSON line per run.
// scripts/soak.sh STEPS builds and runs it; CTest runs the default (label soak).
//
//   soak [--steps N] [--max-growth-kib K] [doctest options, e.g. -tc="*double_buffered*"]
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

std::int64_t soak_steps      = 100000;
std::int64_t max_growth_kib  = 2048;

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("soak: a realistic endless schedule, every row checked, memory flat after warm-up", RR,
                          soak_host)
{
  rr_test::harness_shape shape;
  shape.num_experts      = 128;
  shape.top_k            = 8;
  shape.moe_layers       = {1, 2, 3, 5, 6, 7};
  shape.num_model_layers = 8;
  constexpr auto runs = std::tuple_size_v<rr_test::one_per_strategy<rr::host_backend>>;
  const auto per_run = (soak_steps + static_cast<std::int64_t>(runs) - 1) / static_cast<std::int64_t>(runs);
  const auto r = rr_test::run_soak<RR>(rr_test::soak_schedule(), shape, per_run, 20261122, rr_test::resident_kib);
  std::printf("%s\n", rr_test::soak_json<RR>(r, "host", "rss").c_str());
  std::fflush(stdout);
  CHECK(r.rows_checked > 0);
  CHECK_MESSAGE(r.growth() <= max_growth_kib, "resident memory grew by " << r.growth() << " KiB after warm-up");
}
TEST_CASE_TEMPLATE_APPLY(soak_host, rr_test::one_per_strategy<rr::host_backend>);

int main(int argc, char** argv)
{
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      soak_steps = std::strtoll(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--max-growth-kib") == 0 && i + 1 < argc) {
      max_growth_kib = std::strtoll(argv[++i], nullptr, 10);
    } else {
      rest.push_back(argv[i]);
    }
  }
  doctest::Context context{static_cast<int>(rest.size()), rest.data()};
  return context.run();
}
