/// @file
/// The engine loop's command-line options and scenarios: what benchmarks/engine_loop runs
/// (decode_B<B>: B requests decoding after their prompts; prefill_8k: steps of new 2048-token
/// prompts), as the steps and requests the loop (engine_loop.hpp) plays. Plain C++, no backend.
#pragma once

#include "../examples/common/synthetic_engine.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rr_bench {

// ---- options ------------------------------------------------------------------------------------

using rr_example::usage_error;

/// @brief Everything the command line decides.
struct loop_options {
  std::vector<std::string> scenarios = {"decode_B1", "decode_B64", "decode_B256", "decode_B1024",
                                        "prefill_8k"};
  bool eager = true;  ///< run the measured steps eagerly
  bool graph = true;  ///< run the measured steps as CUDA-graph replays (CUDA only)
  std::vector<std::string> indexes  = {"int16"};
  std::vector<std::string> layouts  = {"layer_major"};
  std::vector<std::string> copies   = {"sync"};
  std::vector<std::string> storages = {"per_request"};
  std::int32_t layers        = 48;
  std::int32_t topk          = 8;
  std::int32_t experts       = 128;
  std::int32_t max_tokens    = 8192;  ///< N_max
  std::int64_t max_model_len = 4096;
  std::int32_t hidden        = 0;     ///< stand-in GEMM [n, H] x [H, H] per layer; 0: none
  std::int32_t decode_steps  = 64;
  /// @brief replay_config::host_memory_ahead (-1: the library's default, two steps' rows).
  std::int64_t host_memory_ahead = -1;
  bool sync_forward          = false; ///< synchronize the forward before end_step()
  /// @brief How the forward hands routing to the library: "capture" (capture() after each router,
  /// one kernel per layer) or "record" (the router kernel records through the device reference
  /// itself: no extra launch).
  std::string capture_path = "capture";
};

/// @brief Whether `name` is selected by a list of names ("all" selects everything).
inline bool selected(const std::vector<std::string>& list, std::string_view name)
{
  return std::find(list.begin(), list.end(), name) != list.end() ||
         std::find(list.begin(), list.end(), "all") != list.end();
}

// ---- scenarios ----------------------------------------------------------------------------------

/// @brief One scheduled request of a step.
struct run_spec {
  std::int64_t request;
  std::int64_t first_position;
  std::int32_t num_tokens;
};

/// @brief One engine step; only measured steps enter the medians.
struct step_spec {
  std::vector<run_spec> runs;
  std::int64_t rows = 0;
  bool measured     = false;
};

/// @brief A scenario: its requests (ids 0 .. num_requests-1), their prompts, and the steps.
struct scenario {
  std::string name;
  std::int64_t num_requests  = 0;
  std::int64_t prompt_length = 0;
  std::int64_t expected_rows = 0;  ///< rows every request must hand back
  std::vector<step_spec> steps;
};

/// @brief Prompts of `count` requests, in arrival order, packed into steps of at most `budget`
/// tokens (chunked prefill: a prompt that does not fit is continued in the next step).
inline void pack_prompts(scenario& s, std::int64_t budget, bool measured)
{
  step_spec step;
  step.measured = measured;
  for (std::int64_t r = 0; r < s.num_requests; ++r) {
    std::int64_t done = 0;
    while (done < s.prompt_length) {
      const std::int64_t n = std::min(s.prompt_length - done, budget - step.rows);
      step.runs.push_back({r, done, static_cast<std::int32_t>(n)});
      step.rows += n;
      done += n;
      if (step.rows == budget) {
        s.steps.push_back(std::move(step));
        step          = step_spec{};
        step.measured = measured;
      }
    }
  }
  if (step.rows > 0) { s.steps.push_back(std::move(step)); }
}

/// @brief decode_B<B>: B prompts of 1024 tokens prefilled in steps of up to N_max tokens (not
/// measured), then `decode_steps` measured steps of one token for every request.
/// prefill_8k: 8 measured steps, each with 4 new requests of 2048 tokens.
inline scenario make_scenario(std::string_view name, const loop_options& o)
{
  scenario s;
  s.name = std::string{name};
  if (name == "prefill_8k") {
    s.num_requests  = 32;
    s.prompt_length = 2048;
    s.expected_rows = s.prompt_length;  // the token sampled after the prompt never goes through
    pack_prompts(s, std::min<std::int64_t>(o.max_tokens, 4 * 2048), true);
  } else if (name.starts_with("decode_B")) {
    std::int64_t batch = 0;
    for (const char c : name.substr(8)) {
      if (c < '0' || c > '9' || batch > o.max_tokens) { batch = -1; break; }
      batch = batch * 10 + (c - '0');
    }
    if (batch <= 0 || batch > o.max_tokens) {
      throw usage_error{"--scenarios: '" + s.name + "' needs a batch in [1, --max-tokens = " +
                        std::to_string(o.max_tokens) + "] after decode_B"};
    }
    s.num_requests  = batch;
    s.prompt_length = 1024;
    s.expected_rows = s.prompt_length + o.decode_steps;
    pack_prompts(s, o.max_tokens, false);
    for (std::int32_t d = 0; d < o.decode_steps; ++d) {
      step_spec step;
      step.measured = true;
      step.rows     = batch;
      step.runs.reserve(static_cast<std::size_t>(batch));
      for (std::int64_t r = 0; r < batch; ++r) { step.runs.push_back({r, s.prompt_length + d, 1}); }
      s.steps.push_back(std::move(step));
    }
  } else {
    throw usage_error{"--scenarios: unknown scenario '" + s.name +
                      "' (expected decode_B<batch>, e.g. decode_B1024, or prefill_8k)"};
  }
  if (s.expected_rows > o.max_model_len) {
    throw usage_error{"--scenarios: '" + s.name + "' needs " + std::to_string(s.expected_rows) +
                      " positions per request, more than --max-model-len " +
                      std::to_string(o.max_model_len)};
  }
  return s;
}

}  // namespace rr_bench
