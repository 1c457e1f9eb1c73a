/// @file
/// A soak run: one RoutingReplay driven through an endless, realistic engine schedule (chunked
/// prefill, decode, drafts with random acceptance, preemption with recompute, prefix hits, aborts,
/// tokens of requests that did not opt in) for many steps, every finished request and many live ones
/// checked bit-exact against the reference model (replay_harness), and the process's memory
/// sampled as it goes: after warm-up it must stay flat.
#pragma once

#include "harness.hpp"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
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
  step_phases phases;                    ///< where the steps spent their time
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

/// @brief The host soak's engine at scale: prompts of up to ~2000 tokens in chunks of up to 8192 rows a
/// step, outputs of up to 256, on a pool for 32 running requests.
inline sim_config scale_schedule()
{
  auto c                = soak_schedule();
  c.max_tokens_per_step = 8192;
  c.max_model_len       = 4096;
  c.num_blocks          = 6144;
  c.num_requests        = 64;
  c.prompt_extra        = 2000;
  c.max_output          = 256;
  return c;
}

/// @brief L = 48 MoE layers of 49 (model layer 0 is dense), K = 8 of E = 128.
inline harness_shape scale_shape()
{
  harness_shape s;
  s.num_experts              = 128;
  s.top_k                    = 8;
  s.num_fused_shared_experts = 0;
  s.moe_layers.resize(48);
  std::iota(s.moe_layers.begin(), s.moe_layers.end(), 1);
  s.num_model_layers = 49;
  return s;
}

/// @brief Called by run_soak when its replay has been built (before the first step) and when its
/// last step has been checked (before the replay is destroyed): runs sharing one process (or one
/// GPU) wait for each other there, so that every probe sample of every run sees all of them built.
struct soak_hooks {
  std::function<void()> built;
  std::function<void()> finished;
};

/// @brief How a soak run is driven.
struct soak_options {
  std::int64_t steps = 100000;  ///< steps of this run
  int runs           = 1;       ///< runs sharing this process and GPU (each probe sees all of them)
  soak_hooks hooks;             ///< where runs sharing the process wait for each other
  std::atomic<std::int64_t>* progress = nullptr;  ///< steps done so far, for a deadline's report
};

/// @brief ROUTING_REPLAY_SOAK_STEPS (default 100000).
inline std::int64_t soak_steps_from_env()
{
  const char* env = std::getenv("ROUTING_REPLAY_SOAK_STEPS");
  return env != nullptr ? std::strtoll(env, nullptr, 10) : 100000;
}

/// @brief Runs `steps` steps of `sim` on a fresh RR; warm-up is the first fifth of the run (every
/// pool, ring and request table has reached its working size by then).
template <class RR>
soak_result run_soak(const sim_config& sim, const harness_shape& shape, std::int64_t steps, std::uint64_t seed,
                     const std::function<std::int64_t()>& memory_probe, const soak_hooks& hooks = {})
{
  soak_result r;
  replay_harness<RR> h{sim, shape, seed};
  if (hooks.built) { hooks.built(); }
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
  r.phases       = h.phases();
  h.finish();
  if (hooks.finished) { hooks.finished(); }
  return r;
}

/// @brief One JSON line describing a soak run; `extra` (`"key": value, ...`, or empty) is added
/// before the samples.
template <class RR>
std::string soak_json(const soak_result& r, const char* backend, const char* memory_kind, const std::string& extra = "")
{
  std::string samples;
  for (const auto m : r.samples) { samples += (samples.empty() ? "" : ", ") + std::to_string(m); }
  const auto& p = r.phases;
  const double us = r.steps > 0 ? 1e6 / static_cast<double>(r.steps) : 0;  // seconds in all -> us per step
  char phases[512];
  std::snprintf(phases, sizeof phases,
                "{\"plan\": %.1f, \"begin\": %.1f, \"forward\": %.1f, \"end_step\": %.1f, \"sync\": %.1f, "
                "\"model\": %.1f, \"outcome\": %.1f, \"check\": %.1f}",
                p.plan * us, p.begin * us, p.forward * us, p.end * us, p.sync * us, p.model * us, p.outcome * us,
                p.check * us);
  char line[4096];
  std::snprintf(line, sizeof line,
                "{\"soak\": \"%s\", \"copy\": \"%s\", \"storage\": \"%s\", \"index_bytes\": %zu, \"steps\": %lld, "
                "\"seconds\": %.2f, \"steps_per_s\": %.0f, \"rows_checked\": %lld, \"memory\": \"%s\", "
                "\"kib_after_warmup\": %lld, \"kib_end\": %lld, \"kib_peak\": %lld, \"growth_kib\": %lld, "
                "\"rows_filed\": %lld, \"us_per_step\": %s, %s%s\"samples_kib\": [%s]}",
                backend, RR::copy_type::name, RR::storage_type::name, sizeof(typename RR::index_type),
                static_cast<long long>(r.steps), r.seconds, r.steps_per_second(),
                static_cast<long long>(r.rows_checked), memory_kind, static_cast<long long>(r.memory_after_warmup),
                static_cast<long long>(r.memory_end), static_cast<long long>(r.memory_peak_after_warmup),
                static_cast<long long>(r.growth()), static_cast<long long>(p.rows_filed), phases, extra.c_str(),
                extra.empty() ? "" : ", ", samples.c_str());
  return line;
}

/// @brief A combination soak_all_at_once can run: its name ("copy/storage") and its run (true: passed).
struct soak_entry {
  std::string name;
  bool (*run)(const soak_options&);
};

/// @brief The soak of every entry at once (or of those named in `only`, comma-separated
/// "copy/storage"), one thread each, in this process: on CUDA their kernels share one context, so
/// they run side by side on the GPU instead of being time-sliced between processes. Every replay is
/// built before any run steps, and destroyed after every run has finished, so each memory probe
/// sees all of them. Past `deadline_s` seconds (0: none) a watchdog
/// prints each run's progress and aborts. Prints one JSON line per run and `soak: P/N PASS`.
inline void soak_all_at_once(const char* backend, const std::vector<soak_entry>& entries, std::int64_t steps,
                             const std::string& only, std::int64_t deadline_s)
{
  std::vector<const soak_entry*> chosen;
  for (const auto& e : entries) {
    if (only.empty() || ("," + only + ",").find("," + e.name + ",") != std::string::npos) { chosen.push_back(&e); }
  }
  REQUIRE_MESSAGE(!chosen.empty(), "no registered combination matches '" << only << "'");
  const auto n = static_cast<std::ptrdiff_t>(chosen.size());
  std::barrier built{n};
  std::barrier finished{n};
  std::vector<std::atomic<std::int64_t>> progress(chosen.size());
  std::vector<int> passed(chosen.size(), 0);
  std::mutex m;
  std::condition_variable cv;
  bool all_done = false;
  std::thread watchdog{[&] {
    std::unique_lock lock{m};
    if (deadline_s <= 0) { return; }
    if (!cv.wait_for(lock, std::chrono::seconds{deadline_s}, [&] { return all_done; })) {
      std::fprintf(stderr, "soak: deadline of %llds exceeded; steps done of %lld:\n",
                   static_cast<long long>(deadline_s), static_cast<long long>(steps));
      for (std::size_t i = 0; i < chosen.size(); ++i) {
        std::fprintf(stderr, "  %s: %lld\n", chosen[i]->name.c_str(), static_cast<long long>(progress[i].load()));
      }
      std::abort();
    }
  }};
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    threads.emplace_back([&, i] {
      bool at_built    = false;
      bool at_finished = false;
      soak_options o{steps, static_cast<int>(n),
                     {[&] { built.arrive_and_wait(); at_built = true; },
                      [&] { finished.arrive_and_wait(); at_finished = true; }},
                     &progress[i]};
      try {
        passed[i] = chosen[i]->run(o) ? 1 : 0;
      } catch (const std::exception& e) {
        std::string what = e.what();
        std::replace(what.begin(), what.end(), '"', '\'');  // stays one JSON string
        std::printf("{\"soak\": \"%s\", \"combination\": \"%s\", \"verdict\": \"FAIL\", \"error\": \"%s\"}\n",
                    backend, chosen[i]->name.c_str(), what.c_str());
      } catch (...) {  // a failed REQUIRE or FAIL (doctest reported it above)
        std::printf("{\"soak\": \"%s\", \"combination\": \"%s\", \"verdict\": \"FAIL\", "
                    "\"error\": \"a check failed (see above)\"}\n",
                    backend, chosen[i]->name.c_str());
      }
      std::fflush(stdout);
      // a run that failed early leaves the barriers, so the others neither wait for it nor hang
      if (!at_built) { built.arrive_and_drop(); }
      if (!at_finished) { finished.arrive_and_drop(); }
    });
  }
  for (auto& t : threads) { t.join(); }
  {
    std::lock_guard lock{m};
    all_done = true;
  }
  cv.notify_all();
  watchdog.join();
  const auto good = std::count(passed.begin(), passed.end(), 1);
  std::printf("soak: %lld/%lld %s\n", static_cast<long long>(good), static_cast<long long>(n),
              good == n ? "PASS" : "FAIL");
  std::fflush(stdout);
  CHECK(good == n);
}

}  // namespace rr_test
