/// @file
/// A soak run: one RoutingReplay driven through an endless, realistic engine schedule (chunked
/// prefill, decode, drafts with random acceptance, preemption with recompute, prefix hits, aborts,
/// tokens of requests that did not opt in) for many steps, every finished request and many live ones
/// checked bit-exact against the reference model (replay_harness), and the process's memory
/// sampled as it goes: after warm-up it must stay flat.
#pragma once

#include "harness.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

namespace rr_test {

/// @brief Resident memory of this process in KiB (Linux: /proc/self/statm), 0 if unknown.
inline std::int64_t resident_kib()
{
  std::ifstream statm{"/proc/self/statm"};
  std::int64_t size = 0;
  std::int64_t resident = 0;
  if (!(statm >> size >> resident)) { return 0; }
  return resident * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE)) / 1024;
}

/// @brief What a soak run measured. Memory figures are KiB of the probe (resident memory, or device
/// memory in use on a GPU).
struct soak_result {
  std::int64_t steps        = 0;
  double seconds            = 0;
  std::int64_t rows_checked = 0;
  std::int64_t memory_after_warmup = 0;  ///< the probe when warm-up ended
  std::int64_t memory_end          = 0;
  std::int64_t memory_peak_after_warmup = 0;
  std::vector<std::int64_t> samples;     ///< the probe every `steps / 50` steps
  [[nodiscard]] std::int64_t growth() const noexcept { return memory_end - memory_after_warmup; }
  [[nodiscard]] double steps_per_second() const noexcept { return seconds > 0 ? steps / seconds : 0; }
};

/// @brief The realistic mix of a host soak: up to 32 requests running, prompts of up to ~300
/// tokens in chunks of up to 256 rows a step, outputs of up to 200, drafts, preemption on a pool
/// that reallocates blocks, prefix hits within families.
inline sim_config soak_schedule()
{
  return sim_config{.max_tokens_per_step = 256,
                    .max_model_len       = 512,
                    .block_size          = 16,
                    .num_blocks          = 640,
                    .num_requests        = 48,
                    .max_running         = 32,
                    .families            = 4,
                    .p_preempt           = 0.03,
                    .p_abort             = 0.01,
                    .prompt_extra        = 300,
                    .max_output          = 150,
                    .endless             = true};
}

/// @brief Runs `steps` steps of `sim` on a fresh RR; warm-up is the first fifth of the run (every
/// pool, ring and request table has reached its working size by then).
template <class RR>
soak_result run_soak(const sim_config& sim, const harness_shape& shape, std::int64_t steps, std::uint64_t seed,
                     const std::function<std::int64_t()>& memory_probe)
{
  soak_result r;
  replay_harness<RR> h{sim, shape, seed};
  const std::int64_t chunk   = std::max<std::int64_t>(steps / 50, 1);
  const std::int64_t warm_up = steps / 5;
  const auto start           = std::chrono::steady_clock::now();
  while (r.steps < steps) {
    const std::int64_t ran = h.run_steps(std::min(chunk, steps - r.steps));
    REQUIRE(ran > 0);  // an endless schedule never runs out of work
    r.steps += ran;
    const std::int64_t m = memory_probe();
    r.samples.push_back(m);
    if (r.steps <= warm_up || r.memory_after_warmup == 0) {
      r.memory_after_warmup = m;
    } else {
      r.memory_peak_after_warmup = std::max(r.memory_peak_after_warmup, m);
    }
  }
  r.seconds      = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.memory_end   = r.samples.back();
  r.rows_checked = h.rows_checked();
  h.finish();
  return r;
}

/// @brief One JSON line describing a soak run.
template <class RR>
std::string soak_json(const soak_result& r, const char* backend, const char* memory_kind)
{
  std::string samples;
  for (const auto m : r.samples) { samples += (samples.empty() ? "" : ", ") + std::to_string(m); }
  char line[2048];
  std::snprintf(line, sizeof line,
                "{\"soak\": \"%s\", \"copy\": \"%s\", \"storage\": \"%s\", \"index_bytes\": %zu, \"steps\": %lld, "
                "\"seconds\": %.2f, \"steps_per_s\": %.0f, \"rows_checked\": %lld, \"memory\": \"%s\", "
                "\"kib_after_warmup\": %lld, \"kib_end\": %lld, \"kib_peak\": %lld, \"growth_kib\": %lld, "
                "\"samples_kib\": [%s]}",
                backend, RR::copy_type::name, RR::storage_type::name, sizeof(typename RR::index_type),
                static_cast<long long>(r.steps), r.seconds, r.steps_per_second(),
                static_cast<long long>(r.rows_checked), memory_kind, static_cast<long long>(r.memory_after_warmup),
                static_cast<long long>(r.memory_end), static_cast<long long>(r.memory_peak_after_warmup),
                static_cast<long long>(r.growth()), samples.c_str());
  return line;
}

}  // namespace rr_test
