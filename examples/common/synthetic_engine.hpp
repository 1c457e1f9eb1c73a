/// @file
/// What the demo (examples/engine_loop) and the engine-loop benchmark (benchmarks/engine_loop)
/// share: the synthetic MoE router whose ids are a pure function of (request, position, layer, k),
/// so that every extracted row can be checked, and the command-line reading both programs use.
#pragma once

#include <routing_replay/detail/macros.hpp>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace rr_example {

// ---- the synthetic model ------------------------------------------------------------------------

/// @brief The expert the synthetic router ranks k-th for a token of a request in a layer. The
/// router kernel and the verification both use it, so a match proves the round trip.
ROUTING_REPLAY_HOST_DEVICE constexpr std::int64_t synthetic_id(std::int64_t request,
                                                               std::int64_t position,
                                                               std::int64_t layer,
                                                               std::int64_t k,
                                                               std::int64_t experts) noexcept
{
  return (request * 7919 + position * 31 + layer * 131 + k * 17) % experts;
}

/// @brief Whose token one row of the batch is, and where.
struct token_info {
  std::int64_t request;   ///< the request (the router formula's `request`)
  std::int64_t position;  ///< the token's position in its request
};

/// @brief One MoE layer's router as a bulk kernel body over (row, k): writes the step's top-k ids
/// as a row-major [rows, K] int64 array, the dtype and shape torch.topk returns.
struct synthetic_router {
  const token_info* tokens;  ///< [rows] on the device
  std::int64_t* topk_ids;    ///< [rows, topk] on the device
  std::int32_t layer;        ///< the layer routed
  std::int32_t topk;         ///< K
  std::int32_t experts;      ///< E

  /// @brief Writes element i = row * K + k.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int64_t i) const noexcept
  {
    const token_info t = tokens[i / topk];
    topk_ids[i]        = synthetic_id(t.request, t.position, layer, i % topk, experts);
  }
};

// ---- command line -------------------------------------------------------------------------------

/// @brief A command-line mistake: reported with a hint, exit status 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// @brief Walks `--flag value` and `--flag=value` arguments.
class argument_reader {
 public:
  /// @brief Reads `args` (argv without the program name).
  explicit argument_reader(std::span<char* const> args) noexcept : args_(args) {}

  /// @brief Moves to the next flag; false when none is left.
  bool next()
  {
    if (++at_ >= args_.size()) { return false; }
    flag_ = args_[at_];
    inline_value_.reset();
    if (const auto eq = flag_.find('='); flag_.starts_with("--") && eq != std::string_view::npos) {
      inline_value_ = flag_.substr(eq + 1);
      flag_         = flag_.substr(0, eq);
    }
    return true;
  }

  /// @brief The current flag, without an inline value.
  [[nodiscard]] std::string_view flag() const noexcept { return flag_; }

  /// @brief The current flag's value: inline, or the next argument.
  /// @throws usage_error when it has none
  std::string_view value()
  {
    if (inline_value_) { return *inline_value_; }
    if (at_ + 1 >= args_.size()) { throw usage_error{std::string{flag_} + ": missing value"}; }
    return args_[++at_];
  }

  /// @brief The current flag's value as an integer of at least `minimum`.
  /// @throws usage_error otherwise
  template <class Int>
  Int number(Int minimum)
  {
    const std::string_view text = value();
    Int n                       = 0;
    const auto* end             = text.data() + text.size();
    const auto [ptr, ec]        = std::from_chars(text.data(), end, n);
    if (ec != std::errc{} || ptr != end || n < minimum) {
      throw usage_error{std::string{flag_} + ": expected an integer >= " + std::to_string(minimum) + ", got '" +
                        std::string{text} + "'"};
    }
    return n;
  }

  /// @brief The current flag's value as a comma-separated list of names.
  /// @throws usage_error for an empty list
  std::vector<std::string> list()
  {
    std::string_view text = value();
    std::vector<std::string> names;
    while (!text.empty()) {
      const auto comma = text.find(',');
      names.emplace_back(text.substr(0, comma));
      text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    }
    if (names.empty()) { throw usage_error{std::string{flag_} + ": empty list"}; }
    return names;
  }

  /// @brief Refuses the current flag.
  [[noreturn]] void unknown() const
  {
    throw usage_error{"unknown option '" + std::string{args_[at_]} + "'"};
  }

 private:
  std::span<char* const> args_;
  std::size_t at_ = static_cast<std::size_t>(-1);
  std::string_view flag_;
  std::optional<std::string_view> inline_value_;
};

}  // namespace rr_example
