/// @file
/// engine_loop: the synthetic engine loop of DESIGN.md section 5 (L = 48, K = 8, E = 128,
/// N_max = 8192 by default) over routing-replay, one JSON line per (policy, scenario, mode).
/// This translation unit parses the command line; the runs live in one translation unit per
/// backend and layout, so that they build in parallel: engine_loop_host_*.cpp (g++) and
/// engine_loop_cuda_*.cu (nvcc). Run `engine_loop --help` for the flags.

#include "engine_loop.hpp"

#include <cstdio>
#include <exception>
#include <iostream>
#include <span>
#include <string>
#include <string_view>

namespace {

using namespace rr_bench;

constexpr std::string_view usage = R"(usage: engine_loop [options]

Synthetic MoE engine loop over routing-replay: per scenario, one JSON line per policy and mode
with the fields impl, policy, scenario, mode, layers, topk, experts, host_us, fwd_gpu_us,
fwd0_gpu_us, step_us, step0_us, extract_us, correct (medians over the measured steps; times in
microseconds; null where the backend has no such reading).

scenarios:
  decode_B<B>   B requests (decode_B1, decode_B64, decode_B256, decode_B1024): 1024-token prompts
                prefilled in steps of up to N_max tokens (not measured), then --decode-steps
                measured steps of one token for every request
  prefill_8k    8 measured steps, each with 4 new requests of 2048 tokens

options (LIST: comma-separated names, or all):
  --backend NAME        host | cuda (default: cuda when a GPU is present, else host)
  --scenarios LIST      default: decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k
  --mode NAME           eager | graph | both (default: both; graph needs cuda, the host skips it)
  --index LIST          int16 | uint8 | int32 (default: int16)
  --layout LIST         layer_major | token_major (default: layer_major)
  --copy LIST           copy strategies (default: sync); all sweeps every strategy built in
  --storage LIST        per_request | block_slot (default: per_request)
  --layers N            L, MoE layers (default: 48)
  --topk N              K (default: 8)
  --experts N           E (default: 128)
  --max-tokens N        N_max, tokens per step (default: 8192)
  --max-model-len N     positions per request (default: 4096)
  --decode-steps N      measured decode steps (default: 64)
  --hidden N            adds a bf16 GEMM [n, N] x [N, N] per layer (cuda only; default: none)
  --capture-path NAME   capture | record: capture() after each router (one kernel per layer), or
                        the router kernel recording through the device reference (no extra
                        launch) (default: capture)
  --host-memory-ahead N bytes of per-request row memory kept mapped ahead of need by the library's
                        worker (replay_config::host_memory_ahead; default -1: two steps' rows;
                        0: none). The prefill scenario keeps every request to the end, so each
                        step needs 6.3 MB of new rows: one step ahead cannot keep up with steps
                        shorter than mapping them takes
  --sync-forward        synchronize the forward before end_step(), so that host_us is the
                        library's host path alone (without it, sync_copy waits for the forward)
  --help                print this text

exit status: 0 every run correct, 1 a run incorrect or a failure, 2 bad usage or no GPU
)";

struct command_line {
  loop_options loop;
  std::string backend;  // empty: cuda when a GPU is present
  bool help = false;
};

std::vector<std::string> checked(rr_example::argument_reader& arg, const std::vector<std::string_view>& accepted)
{
  const std::string_view flag    = arg.flag();
  std::vector<std::string> names = arg.list();
  for (const auto& n : names) {
    if (n != "all" && std::find(accepted.begin(), accepted.end(), n) == accepted.end()) {
      std::string expected;
      for (const auto a : accepted) { expected += std::string{a} + " | "; }
      throw usage_error{std::string{flag} + ": '" + n + "' is not built into this binary (expected " +
                        expected + "all; the list lives in benchmarks/policies.hpp)"};
    }
  }
  return names;
}

command_line parse(std::span<char* const> args)
{
  command_line c;
  auto& o = c.loop;
  rr_example::argument_reader arg{args};
  while (arg.next()) {
    const std::string_view flag = arg.flag();
    if (flag == "--help" || flag == "-h") {
      c.help = true;
    } else if (flag == "--sync-forward") {
      o.sync_forward = true;
    } else if (flag == "--capture-path") {
      o.capture_path = std::string{arg.value()};
      if (o.capture_path != "capture" && o.capture_path != "record") {
        throw usage_error{"--capture-path: expected capture | record, got '" + o.capture_path + "'"};
      }
    } else if (flag == "--backend") {
      c.backend = std::string{arg.value()};
      if (c.backend != "host" && c.backend != "cuda") {
        throw usage_error{"--backend: expected host | cuda, got '" + c.backend + "'"};
      }
    } else if (flag == "--scenarios") {
      o.scenarios = arg.list();
      if (o.scenarios == std::vector<std::string>{"all"}) { o.scenarios = loop_options{}.scenarios; }
    } else if (flag == "--mode") {
      const std::string_view m = arg.value();
      if (m != "eager" && m != "graph" && m != "both") {
        throw usage_error{"--mode: expected eager | graph | both, got '" + std::string{m} + "'"};
      }
      o.eager = m != "graph";
      o.graph = m != "eager";
    } else if (flag == "--index") {
      o.indexes = checked(arg, names_of(index_types{}));
    } else if (flag == "--layout") {
      o.layouts = checked(arg, names_of(layout_types{}));
    } else if (flag == "--copy") {
      o.copies = checked(arg, names_of(copy_types{}));
    } else if (flag == "--storage") {
      o.storages = checked(arg, names_of(storage_types{}));
    } else if (flag == "--layers") {
      o.layers = arg.number<std::int32_t>(1);
    } else if (flag == "--topk") {
      o.topk = arg.number<std::int32_t>(1);
    } else if (flag == "--experts") {
      o.experts = arg.number<std::int32_t>(1);
    } else if (flag == "--max-tokens") {
      o.max_tokens = arg.number<std::int32_t>(1);
    } else if (flag == "--max-model-len") {
      o.max_model_len = arg.number<std::int64_t>(1);
    } else if (flag == "--host-memory-ahead") {
      o.host_memory_ahead = arg.number<std::int64_t>(-1);
    } else if (flag == "--decode-steps") {
      o.decode_steps = arg.number<std::int32_t>(1);
    } else if (flag == "--hidden") {
      o.hidden = arg.number<std::int32_t>(0);
    } else {
      arg.unknown();
    }
  }
  for (const auto& name : o.scenarios) { (void)make_scenario(name, o); }  // refuse bad names up front
  return c;
}

}  // namespace

int main(int argc, char** argv)
{
  command_line c;
  try {
    c = parse(std::span<char* const>{argv + 1, static_cast<std::size_t>(argc - 1)});
  } catch (const usage_error& e) {
    std::cerr << "engine_loop: " << e.what() << "\n(run engine_loop --help for usage)\n";
    return 2;
  }
  if (c.help) {
    std::cout << usage;
    return 0;
  }

  std::string device;
  const bool gpu = cuda_device_available(device);
  if (c.backend.empty()) { c.backend = gpu ? "cuda" : "host"; }
  if (c.backend == "cuda" && !gpu) {
    std::cerr << "engine_loop: --backend cuda asked for, but no usable CUDA device is present ("
              << device << "); use --backend host\n";
    return 2;
  }
  if (c.backend == "host" && c.loop.hidden != 0) {
    std::cerr << "engine_loop: --hidden needs --backend cuda (the host backend has no stand-in GEMM)\n";
    return 2;
  }
  std::cerr << "engine_loop: backend " << c.backend << (c.backend == "cuda" ? " (" + device + ")" : "")
            << ", L = " << c.loop.layers << ", K = " << c.loop.topk << ", E = " << c.loop.experts
            << ", N_max = " << c.loop.max_tokens << ", hidden = " << c.loop.hidden << '\n';
  if (c.backend == "host" && c.loop.graph) {
    std::cerr << "engine_loop: the host backend has no CUDA graphs: graph mode is skipped\n";
    if (!c.loop.eager) { return 0; }
  }

  try {
    int incorrect = 0;
    if (c.backend == "cuda") {
      incorrect += run_cuda_layer_major(c.loop);
      incorrect += run_cuda_token_major(c.loop);
    } else {
      incorrect += run_host_layer_major(c.loop);
      incorrect += run_host_token_major(c.loop);
    }
    if (incorrect != 0) {
      std::cerr << "engine_loop: " << incorrect << " run(s) extracted rows that differ from the synthetic ids\n";
      return 1;
    }
    return 0;
  } catch (const usage_error& e) {
    std::cerr << "engine_loop: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "engine_loop: " << e.what() << '\n';
  }
  return 1;
}
