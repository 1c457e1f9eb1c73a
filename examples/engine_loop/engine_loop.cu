/// @file
/// @brief engine_loop: routing-replay inside a (synthetic) inference engine's step loop.
///
/// The demo plays the engine. A made-up MoE model (48 MoE layers, top-8 of 128 experts) serves a
/// handful of requests with continuous batching: chunked prefill under a per-step token budget,
/// then one decode token per step, each request generating a different number of tokens. Every
/// step it
///
///   1. builds a routing_replay::step_plan saying which request and positions own each row of the
///      batch (plus, for block-slot storage, the KV slot of each token and the newly allocated KV
///      blocks),
///   2. brackets the forward with RoutingReplay::begin_step() / end_step(),
///   3. runs, per MoE layer, a "router kernel" that writes int64 top-k ids [n, K] exactly as
///      torch.topk would, and hands them to RoutingReplay::capture().
///
/// When a request finishes, the demo extracts its routing as a [T, L, K] array, checks every id
/// against the router's formula, writes `<out>/request_<id>.npy` and releases the request.
///
/// It shows that the capture path is backend-generic (the same router functor runs as a CUDA
/// kernel or as a host-stream loop), that the library's compile-time policies (index type, buffer
/// layout, host storage) are chosen by instantiation, and that T counts exactly the positions that
/// went through the model: prompt_len + generated - 1, since the last sampled token never does.
///
/// Run `engine_loop --help` for the flags. Exit status: 0 when every request matches, 1 on a
/// mismatch or a runtime failure, 2 on a bad command line or an unavailable backend.

#include "../common/synthetic_engine.hpp"

#include <routing_replay/npy.hpp>
#include <routing_replay/routing_replay.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace {

namespace rr = routing_replay;
namespace fs = std::filesystem;

// ---- the synthetic model ------------------------------------------------------------------------

constexpr std::int32_t num_moe_layers = 48;   // L: every model layer is MoE and captured
constexpr std::int32_t top_k          = 8;    // K
constexpr std::int32_t num_experts    = 128;  // E
constexpr std::int64_t max_model_len  = 4096;
constexpr std::int32_t kv_block_size  = 16;   // tokens per KV block (block-slot storage)

using rr_example::synthetic_router;
using rr_example::token_info;
using rr_example::usage_error;

/// @brief The expert the synthetic router ranks k-th for a token of a request in a model layer.
constexpr std::int64_t synthetic_expert(std::int64_t request, std::int64_t position, std::int64_t layer,
                                        std::int64_t k) noexcept
{
  return rr_example::synthetic_id(request, position, layer, k, num_experts);
}

// ---- the workload -------------------------------------------------------------------------------

/// @brief One request and the engine's progress on it.
struct engine_request {
  std::int64_t id             = 0;  // also `request` of the router formula
  std::int64_t prompt_length  = 0;
  std::int64_t max_new_tokens = 0;  // sampled tokens after which it finishes
  std::int64_t computed       = 0;  // positions [0, computed) went through the model
  std::int64_t generated      = 0;  // tokens sampled so far
  std::vector<std::int64_t> kv_blocks;  // block table: block of positions [16 b, 16 b + 16)
  bool admitted = false;
  bool finished = false;

  /// @brief Tokens it wants in the next step: the rest of its prompt, or one decode token.
  [[nodiscard]] std::int64_t tokens_wanted() const noexcept
  {
    return computed < prompt_length ? prompt_length - computed : 1;
  }
  /// @brief Rows the library must hand back: the last sampled token is never fed to the model.
  [[nodiscard]] std::int64_t expected_rows() const noexcept
  {
    return prompt_length + max_new_tokens - 1;
  }
};

/// @brief Distinct prompt and output lengths, so prefill is chunked across steps, several requests
/// share a step, and requests finish at different steps.
std::vector<engine_request> make_workload(std::int32_t num_requests)
{
  std::vector<engine_request> requests(static_cast<std::size_t>(num_requests));
  for (std::int32_t i = 0; i < num_requests; ++i) {
    auto& r          = requests[static_cast<std::size_t>(i)];
    r.id             = i;
    r.prompt_length  = 300 + 97 * std::int64_t{i};
    r.max_new_tokens = 8 + 5 * std::int64_t{i};
  }
  return requests;
}

/// @brief A minimal KV block allocator. Freed blocks join the back of the queue, as in vLLM, so
/// that cached contents survive as long as possible.
class block_allocator {
 public:
  explicit block_allocator(std::int64_t num_blocks)
  {
    for (std::int64_t b = 0; b < num_blocks; ++b) { free_.push_back(b); }
  }

  /// @brief Grows a block table to hold `positions` positions; new blocks are appended to `fresh`
  /// too, because the library must learn that their previous rows (if any) are stale.
  void cover(std::vector<std::int64_t>& table, std::int64_t positions, std::vector<std::int64_t>& fresh)
  {
    while (static_cast<std::int64_t>(table.size()) * kv_block_size < positions) {
      if (free_.empty()) { throw std::runtime_error{"the KV block pool is exhausted"}; }
      table.push_back(free_.front());
      fresh.push_back(free_.front());
      free_.pop_front();
    }
  }

  /// @brief Returns a finished request's blocks.
  void release(std::vector<std::int64_t>& table)
  {
    free_.insert(free_.end(), table.begin(), table.end());
    table.clear();
  }

  /// @brief The KV slot of a position: block_id * block_size + offset, as engines define it.
  [[nodiscard]] static std::int64_t slot_of(std::span<const std::int64_t> table, std::int64_t position)
  {
    return table[static_cast<std::size_t>(position / kv_block_size)] * kv_block_size +
           position % kv_block_size;
  }

  /// @brief Blocks that hold every request at once, so the demo never has to preempt.
  [[nodiscard]] static std::int64_t blocks_for(std::span<const engine_request> requests)
  {
    std::int64_t blocks = 0;
    for (const auto& r : requests) { blocks += (r.expected_rows() + kv_block_size - 1) / kv_block_size; }
    return blocks;
  }

 private:
  std::deque<std::int64_t> free_;
};

// ---- command line -------------------------------------------------------------------------------

/// @brief A type carried as a value, so runtime choices can name template arguments.
template <class T>
struct type_tag {
  using type = T;
};

// The first alternative of each variant is the default.
using backend_choice = std::variant<type_tag<rr::host_backend>, type_tag<rr::cuda_backend>>;
using index_choice   = std::variant<type_tag<std::int16_t>, type_tag<std::uint8_t>,
                                    type_tag<std::uint16_t>, type_tag<std::int32_t>>;
using layout_choice  = std::variant<type_tag<rr::layer_major>, type_tag<rr::token_major>>;
using storage_choice = std::variant<type_tag<rr::per_request_storage>, type_tag<rr::block_slot_storage>>;

template <class Choice>
struct named_choice {
  std::string_view name;
  Choice value;
};

const std::array backend_names = {named_choice<backend_choice>{"host", type_tag<rr::host_backend>{}},
                                  named_choice<backend_choice>{"cuda", type_tag<rr::cuda_backend>{}}};
const std::array index_names   = {named_choice<index_choice>{"uint8", type_tag<std::uint8_t>{}},
                                  named_choice<index_choice>{"uint16", type_tag<std::uint16_t>{}},
                                  named_choice<index_choice>{"int16", type_tag<std::int16_t>{}},
                                  named_choice<index_choice>{"int32", type_tag<std::int32_t>{}}};
const std::array layout_names  = {named_choice<layout_choice>{"layer_major", type_tag<rr::layer_major>{}},
                                  named_choice<layout_choice>{"token_major", type_tag<rr::token_major>{}}};
const std::array storage_names = {
  named_choice<storage_choice>{"per_request", type_tag<rr::per_request_storage>{}},
  named_choice<storage_choice>{"block_slot", type_tag<rr::block_slot_storage>{}}};

constexpr std::string_view usage = R"(usage: engine_loop [options]

Runs a synthetic MoE engine (48 MoE layers, top-8 of 128 experts) through chunked prefill and
decode, captures every router's choices with routing-replay, and writes each finished request's
routing to <out>/request_<id>.npy with shape [T, 48, 8].

options:
  --out DIR          output directory (default: routing_out)
  --backend NAME     host | cuda (default: cuda when a GPU is present, else host)
  --index NAME       uint8 | uint16 | int16 | int32: stored id type (default: int16)
  --layout NAME      layer_major | token_major: device buffer order (default: layer_major)
  --storage NAME     per_request | block_slot: host storage (default: per_request)
  --requests N       number of requests (default: 6)
  --max-tokens N     token budget per step, also max_tokens_per_step (default: 512)
  --help             print this text

exit status: 0 all requests match, 1 mismatch or failure, 2 bad usage or backend unavailable
)";

struct options {
  fs::path out_dir = "routing_out";
  std::optional<backend_choice> backend;  // empty: decided once we know whether a GPU is present
  index_choice index;
  layout_choice layout;
  storage_choice storage;
  std::int32_t num_requests = 6;
  std::int32_t max_tokens   = 512;
  bool help                 = false;
};

template <class Choice, std::size_t N>
Choice parse_choice(std::string_view flag,
                    std::string_view value,
                    const std::array<named_choice<Choice>, N>& table)
{
  std::string accepted;
  for (const auto& entry : table) {
    if (entry.name == value) { return entry.value; }
    accepted += (accepted.empty() ? "" : " | ") + std::string{entry.name};
  }
  throw usage_error{std::string{flag} + ": unknown value '" + std::string{value} + "' (expected " +
                    accepted + ")"};
}

/// @brief Accepts `--flag value` and `--flag=value`.
options parse_options(std::span<char* const> args)
{
  options o;
  rr_example::argument_reader arg{args};
  while (arg.next()) {
    const std::string_view flag = arg.flag();
    if (flag == "--help" || flag == "-h") {
      o.help = true;
    } else if (flag == "--out") {
      o.out_dir = fs::path{std::string{arg.value()}};
    } else if (flag == "--backend") {
      o.backend = parse_choice(flag, arg.value(), backend_names);
    } else if (flag == "--index") {
      o.index = parse_choice(flag, arg.value(), index_names);
    } else if (flag == "--layout") {
      o.layout = parse_choice(flag, arg.value(), layout_names);
    } else if (flag == "--storage") {
      o.storage = parse_choice(flag, arg.value(), storage_names);
    } else if (flag == "--requests") {
      o.num_requests = arg.number<std::int32_t>(1);
    } else if (flag == "--max-tokens") {
      o.max_tokens = arg.number<std::int32_t>(1);
    } else {
      arg.unknown();
    }
  }
  // Later requests have longer prompts and outputs: refuse up front what cannot fit the model.
  const auto workload = make_workload(o.num_requests);
  if (workload.back().expected_rows() > max_model_len) {
    throw usage_error{"--requests: request " + std::to_string(workload.back().id) + " would need " +
                      std::to_string(workload.back().expected_rows()) + " positions, over max_model_len " +
                      std::to_string(max_model_len)};
  }
  return o;
}

// ---- the engine loop ----------------------------------------------------------------------------

template <class Index>
constexpr const char* index_name() noexcept
{
  if constexpr (std::is_same_v<Index, std::uint8_t>) { return "uint8"; }
  if constexpr (std::is_same_v<Index, std::uint16_t>) { return "uint16"; }
  if constexpr (std::is_same_v<Index, std::int16_t>) { return "int16"; }
  if constexpr (std::is_same_v<Index, std::int32_t>) { return "int32"; }
}

/// @brief Ids of an extraction that differ from the router's formula; rows missing or in excess
/// count as all their ids.
template <class Index>
std::int64_t count_mismatches(const rr::routed_experts<Index>& routed, const engine_request& r)
{
  constexpr std::int64_t row_ids = std::int64_t{num_moe_layers} * top_k;
  const std::int64_t expected    = r.expected_rows();
  if (routed.num_layers() != num_moe_layers || routed.top_k() != top_k) { return expected * row_ids; }
  const std::int64_t rows = std::min(routed.num_rows(), expected);
  std::int64_t mismatches = std::abs(routed.num_rows() - expected) * row_ids;
  const auto view = routed.rows();
  for (std::int64_t t = 0; t < rows; ++t) {
    const std::int64_t position = routed.first_position() + t;
    for (std::int32_t layer = 0; layer < num_moe_layers; ++layer) {
      for (std::int32_t k = 0; k < top_k; ++k) {
        const auto want = static_cast<Index>(synthetic_expert(r.id, position, layer, k));
        mismatches += view(t, layer, k) != want ? 1 : 0;
      }
    }
  }
  return mismatches;
}

/// @brief Runs the whole workload with one instantiation of the library's policies.
template <class Backend, class Index, class Layout, class Storage>
int run(const options& opt)
{
  using replay_type = rr::RoutingReplay<Backend, Index, Layout, rr::sync_copy, Storage>;
  const std::int64_t max_rows = opt.max_tokens;

  std::vector<engine_request> requests = make_workload(opt.num_requests);
  fs::create_directories(opt.out_dir);

  rr::replay_config config;
  config.num_experts         = num_experts;
  config.top_k               = top_k;
  config.max_tokens_per_step = opt.max_tokens;
  config.max_model_len       = max_model_len;
  config.moe_layers.resize(num_moe_layers);
  std::iota(config.moe_layers.begin(), config.moe_layers.end(), 0);
  // The engine keeps a block table whatever the storage; only block_slot_storage files rows by it.
  config.block_size = kv_block_size;
  config.num_blocks = block_allocator::blocks_for(requests);
  replay_type replay{config};

  // Router inputs and outputs, sized once for the largest step, as an engine preallocates.
  typename Backend::template pinned_vector<token_info> tokens_staging(static_cast<std::size_t>(max_rows));
  typename Backend::template device_vector<token_info> tokens(static_cast<std::size_t>(max_rows));
  typename Backend::template device_vector<std::int64_t> topk_ids(static_cast<std::size_t>(max_rows * top_k));
  token_info* staged          = Backend::data(tokens_staging);
  token_info* tokens_on_device = Backend::data(tokens);
  std::int64_t* ids            = Backend::data(topk_ids);
  // Declared after every buffer its work touches, so it is destroyed (drained) before them.
  typename Backend::stream stream;
  const auto compute = stream.ref();

  std::cout << "routing-replay engine_loop: " << requests.size() << " requests, " << num_moe_layers
            << " MoE layers, top-" << top_k << " of " << num_experts << " experts, token budget "
            << opt.max_tokens << " per step\n"
            << "policies: backend " << Backend::name;
  if constexpr (std::is_same_v<Backend, rr::cuda_backend>) {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, 0) == cudaSuccess) { std::cout << " (" << properties.name << ")"; }
  }
  std::cout << ", index " << index_name<Index>() << ", layout " << rr::layout_traits<Layout>::name
            << ", copy " << rr::sync_copy::name << ", storage " << Storage::name << "\n\n"
            << "request  prompt  generated  rows T  finished at step  file\n";

  block_allocator kv{config.num_blocks};
  rr::step_plan plan;
  std::vector<std::int64_t> slots;
  slots.reserve(static_cast<std::size_t>(max_rows));  // never reallocates: the plan holds spans into it
  std::vector<std::int64_t> fresh_blocks;
  std::vector<std::pair<engine_request*, std::int64_t>> scheduled;  // request, tokens this step

  std::int64_t steps = 0, captured_rows = 0, mismatched_ids = 0;
  std::size_t finished = 0;
  while (finished < requests.size()) {
    // Schedule first come, first served: earlier requests are decoding by the time later ones
    // prefill, so decode tokens go first and prefills take chunks of what the budget leaves.
    plan.clear();
    slots.clear();
    fresh_blocks.clear();
    scheduled.clear();
    std::int64_t budget = max_rows;
    for (auto& r : requests) {
      if (budget == 0) { break; }
      if (r.finished) { continue; }
      const std::int64_t n = std::min(r.tokens_wanted(), budget);
      if (!r.admitted) {
        replay.add_request(r.id, {.prompt_length = r.prompt_length});
        r.admitted = true;
      }
      kv.cover(r.kv_blocks, r.computed + n, fresh_blocks);
      const std::size_t first_slot = slots.size();
      for (std::int64_t p = r.computed; p < r.computed + n; ++p) {
        staged[plan.num_rows() + (p - r.computed)] = token_info{r.id, p};
        slots.push_back(block_allocator::slot_of(r.kv_blocks, p));
      }
      plan.schedule({.id               = r.id,
                     .first_position   = r.computed,
                     .num_tokens       = static_cast<std::int32_t>(n),
                     .num_draft_tokens = 0,
                     .slots            = std::span<const std::int64_t>{slots}.subspan(first_slot)});
      scheduled.emplace_back(&r, n);
      budget -= n;
    }
    plan.add_fresh_blocks(fresh_blocks);
    const std::int64_t n = plan.num_rows();

    // The forward: begin_step validates the plan before anything is enqueued.
    replay.begin_step(plan, compute);
    Backend::copy_async(tokens_on_device, staged, static_cast<std::size_t>(n) * sizeof(token_info), compute);
    for (std::int32_t layer = 0; layer < num_moe_layers; ++layer) {
      // One buffer serves every layer: stream order puts each capture before the next overwrite.
      Backend::bulk_async(n * top_k, synthetic_router{tokens_on_device, ids, layer, top_k, num_experts}, compute);
      replay.capture(layer, ids, n, compute);
    }
    replay.end_step(compute);
    // Stands for reading back the sampled tokens; after it the staging may be refilled.
    Backend::synchronize(compute);
    ++steps;
    captured_rows += n;

    // Sampling: a step that reaches the end of a prompt, or decodes, yields one token.
    for (auto [r, tokens_run] : scheduled) {
      r->computed += tokens_run;
      if (r->computed >= r->prompt_length) { ++r->generated; }
      if (r->generated < r->max_new_tokens) { continue; }

      r->finished = true;
      ++finished;
      const auto routed             = replay.extract(r->id);
      const std::int64_t mismatches = count_mismatches(routed, *r);
      const fs::path file           = opt.out_dir / ("request_" + std::to_string(r->id) + ".npy");
      rr::write_npy(file.string(), routed);  // before release: per-request extraction is a view
      replay.release(r->id);
      kv.release(r->kv_blocks);
      mismatched_ids += mismatches;

      std::cout << std::setw(7) << r->id << std::setw(8) << r->prompt_length << std::setw(11)
                << r->generated << std::setw(8) << routed.num_rows() << std::setw(18) << steps << "  "
                << file.string();
      if (mismatches != 0) { std::cout << "  (" << mismatches << " ids differ)"; }
      std::cout << '\n';
    }
  }

  std::cout << "\nsteps run: " << steps << ", tokens captured: " << captured_rows << " ("
            << captured_rows * num_moe_layers * top_k << " expert ids)\n"
            << "all " << requests.size() << " requests match the synthetic router: ";
  if (mismatched_ids == 0) {
    std::cout << "yes\n";
    return 0;
  }
  std::cout << "no, " << mismatched_ids << " ids differ\n";
  return 1;
}

/// @brief Turns the runtime choices into one instantiation of run<>.
int dispatch(const options& opt, const backend_choice& backend)
{
  return std::visit(
    [&](auto b, auto index, auto layout, auto storage) {
      return run<typename decltype(b)::type, typename decltype(index)::type,
                 typename decltype(layout)::type, typename decltype(storage)::type>(opt);
    },
    backend, opt.index, opt.layout, opt.storage);
}

}  // namespace

int main(int argc, char** argv)
{
  options opt;
  try {
    opt = parse_options(std::span<char* const>{argv + 1, static_cast<std::size_t>(argc - 1)});
  } catch (const usage_error& e) {
    std::cerr << "engine_loop: " << e.what() << "\n(run engine_loop --help for usage)\n";
    return 2;
  }
  if (opt.help) {
    std::cout << usage;
    return 0;
  }

  const bool gpu = rr::cuda_backend::available();
  if (opt.backend && std::holds_alternative<type_tag<rr::cuda_backend>>(*opt.backend) && !gpu) {
    std::cerr << "engine_loop: --backend cuda asked for, but no usable CUDA device is present "
                 "(no GPU, or no driver); use --backend host\n";
    return 2;
  }
  const backend_choice backend =
    opt.backend.value_or(gpu ? backend_choice{type_tag<rr::cuda_backend>{}}
                             : backend_choice{type_tag<rr::host_backend>{}});

  try {
    return dispatch(opt, backend);
  } catch (const rr::error& e) {
    std::cerr << "engine_loop: routing_replay error: " << e.what() << '\n';
  } catch (const std::exception& e) {
    std::cerr << "engine_loop: " << e.what() << '\n';
  }
  return 1;
}
