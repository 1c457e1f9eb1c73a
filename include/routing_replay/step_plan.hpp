/// @file
/// Request ids and the per-step plan an engine hands to begin_step().
#pragma once

#include <routing_replay/errors.hpp>

#include <concepts>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace routing_replay {

/// @brief A live request as add_request() returned it: its dense index in the library and the
/// generation of that index's use.
///
/// Engines that keep it (beside their own request object) schedule, extract and release without the
/// library hashing or comparing ids: a lookup by handle is an array access. A handle outlives its
/// request only as a stale value: once the request is released or aborted its index may serve a new
/// request, but with the next generation, so the stale handle is refused (unknown_request), never
/// taken for the new request.
struct request_handle {
  std::uint32_t index      = 0;  ///< dense index of the request's state
  std::uint32_t generation = 0;  ///< use of that index the handle was given for

  /// @brief The handle as one integer (generation in the high half), for bindings and arrays.
  [[nodiscard]] constexpr std::uint64_t bits() const noexcept
  {
    return (static_cast<std::uint64_t>(generation) << 32) | index;
  }
  /// @brief The handle bits() returned.
  [[nodiscard]] static constexpr request_handle from_bits(std::uint64_t bits) noexcept
  {
    return request_handle{static_cast<std::uint32_t>(bits), static_cast<std::uint32_t>(bits >> 32)};
  }
  /// @brief Equality of index and generation.
  friend constexpr bool operator==(const request_handle&, const request_handle&) = default;
};

/// @brief A non-owning request reference as engines have it: an integer or string id, or the
/// request_handle add_request() returned.
///
/// Plans and lookups take this view so that scheduling a string-id request allocates nothing, and
/// scheduling by handle hashes nothing.
class request_key {
 public:
  /// @brief An integer request id.
  template <std::integral Int>
    requires(!std::same_as<Int, bool>)
  request_key(Int id) noexcept : value_(static_cast<std::int64_t>(id))  // NOLINT: implicit by design
  {
  }
  /// @brief A string request id; the characters must outlive the key.
  request_key(std::string_view id) noexcept : value_(id) {}  // NOLINT: implicit by design
  /// @brief A string request id; the string must outlive the key.
  request_key(const std::string& id) noexcept : value_(std::string_view{id}) {}  // NOLINT
  /// @brief A string request id; the characters must outlive the key.
  request_key(const char* id) noexcept : value_(std::string_view{id}) {}  // NOLINT
  /// @brief A live request by the handle add_request() returned.
  request_key(request_handle handle) noexcept : value_(handle) {}  // NOLINT: implicit by design

  /// @brief Whether the key is an integer id.
  [[nodiscard]] bool is_integer() const noexcept { return value_.index() == 0; }
  /// @brief Whether the key is a string id.
  [[nodiscard]] bool is_string() const noexcept { return value_.index() == 1; }
  /// @brief Whether the key is a handle (not an id).
  [[nodiscard]] bool is_handle() const noexcept { return value_.index() == 2; }
  /// @brief The integer id; only valid when is_integer().
  [[nodiscard]] std::int64_t integer() const noexcept { return *std::get_if<0>(&value_); }
  /// @brief The string id; only valid when is_string().
  [[nodiscard]] std::string_view string() const noexcept { return *std::get_if<1>(&value_); }
  /// @brief The handle; only valid when is_handle().
  [[nodiscard]] request_handle handle() const noexcept { return *std::get_if<2>(&value_); }

  /// @brief The key as it appears in error messages: 42, 'chat-7' or handle 3.1 (index.generation).
  [[nodiscard]] std::string to_string() const
  {
    if (is_integer()) { return std::to_string(integer()); }
    if (is_handle()) { return "handle " + std::to_string(handle().index) + "." + std::to_string(handle().generation); }
    std::string quoted;
    quoted.reserve(string().size() + 2);
    quoted.append(1, '\'').append(string()).append(1, '\'');
    return quoted;
  }

  /// @brief Equality of kind and value.
  friend bool operator==(const request_key&, const request_key&) = default;

 private:
  std::variant<std::int64_t, std::string_view, request_handle> value_;
};

/// @brief An owning request id (integer or string), as stored by the library.
class request_id {
 public:
  /// @brief Copies the id a key refers to.
  /// @throws error invalid_argument for a handle: a handle names a request, it is not an id
  explicit request_id(request_key key)
  {
    if (key.is_integer()) {
      value_ = key.integer();
    } else if (key.is_string()) {
      value_ = std::string{key.string()};
    } else {
      throw error{errc::invalid_argument, "a request is added by its id, not by a handle (" + key.to_string() + ")"};
    }
  }
  /// @brief A non-owning view of this id.
  [[nodiscard]] request_key key() const noexcept
  {
    if (value_.index() == 0) { return request_key{*std::get_if<0>(&value_)}; }
    return request_key{std::string_view{*std::get_if<1>(&value_)}};
  }
  /// @brief The id as it appears in error messages.
  [[nodiscard]] std::string to_string() const { return key().to_string(); }

 private:
  std::variant<std::int64_t, std::string> value_;
};

/// @brief Heterogeneous hash over request_id and request_key, so lookups never build a request_id.
struct request_hash {
  using is_transparent = void;  ///< enables heterogeneous lookup in unordered containers
  /// @brief Hash of a key.
  [[nodiscard]] std::size_t operator()(request_key key) const noexcept
  {
    // distinct salts keep the integer 7, the string "7" and a handle apart
    if (key.is_integer()) { return std::hash<std::int64_t>{}(key.integer()) * 0x9E3779B97F4A7C15ull; }
    if (key.is_string()) { return std::hash<std::string_view>{}(key.string()) ^ 0x5bd1e995ull; }
    return std::hash<std::uint64_t>{}(key.handle().bits()) ^ 0xC2B2AE3D27D4EB4Full;
  }
  /// @brief Hash of an owning id.
  [[nodiscard]] std::size_t operator()(const request_id& id) const noexcept
  {
    return (*this)(id.key());
  }
};

/// @brief Heterogeneous equality over request_id and request_key.
struct request_equal {
  using is_transparent = void;  ///< enables heterogeneous lookup in unordered containers
  /// @brief Equality of two ids in any combination of owning and non-owning forms.
  template <class A, class B>
  [[nodiscard]] bool operator()(const A& a, const B& b) const noexcept
  {
    return as_key(a) == as_key(b);
  }

 private:
  static request_key as_key(request_key k) noexcept { return k; }
  static request_key as_key(const request_id& id) noexcept { return id.key(); }
};

/// @brief One scheduled request of a step, in batch order.
///
/// Its tokens occupy the next num_tokens rows of the step and sit at positions
/// first_position .. first_position + num_tokens - 1 of the request. Positions come from the engine
/// and are never derived from counters, so engines that schedule ahead of the GPU stay exact.
struct scheduled_request {
  /// @brief The request: its id as given to add_request(), or the handle add_request() returned
  /// (no hashing per step).
  request_key id;
  /// @brief Position of the first token of this request in this step.
  std::int64_t first_position = 0;
  /// @brief Tokens of this request in this step (chunk of a prefill, 1 for decode, 1 + drafts...).
  std::int32_t num_tokens = 0;
  /// @brief How many of the trailing tokens are speculative drafts awaiting verification; their
  /// rows stay tentative until accept_draft() says how many were accepted.
  std::int32_t num_draft_tokens = 0;
  /// @brief Block-slot storage: the KV slot of each token (block_id * block_size + offset); one
  /// per token. Ignored by per-request storage. Must stay valid until begin_step() returns.
  std::span<const std::int64_t> slots{};
};

/// @brief The plan of one engine step: what each row of the device buffer belongs to.
///
/// Rows are numbered in batch order: the first scheduled request's tokens come first. Build one plan
/// object and reuse it (clear()) so that steady-state steps allocate nothing.
class step_plan {
 public:
  /// @brief One run of consecutive rows: a scheduled request, or tokens that are not recorded.
  struct entry {
    scheduled_request request;  ///< the request (unused when skipped)
    std::int64_t first_row;     ///< row of the step where this run starts
    bool skipped;               ///< rows of requests that did not opt in: never stored

    /// @brief A run of `request` from row `row`, skipped or not.
    entry(const scheduled_request& request, std::int64_t row, bool skip) noexcept
      : request(request), first_row(row), skipped(skip)
    {
    }
    /// @brief A run of the request `handle` names, built in place: its fields are written where
    /// the entry lives, never assembled elsewhere and copied (a copy's wide loads of fields just
    /// stored narrow stall on store forwarding, about half of a columnar plan's time per request).
    entry(request_handle handle,
          std::int64_t first_position,
          std::int32_t num_tokens,
          std::int32_t num_draft_tokens,
          std::int64_t row) noexcept
      : request{handle, first_position, num_tokens, num_draft_tokens, {}}, first_row(row), skipped(false)
    {
    }
  };

  /// @brief Appends a request's tokens to the step.
  void schedule(const scheduled_request& request)
  {
    entries_.emplace_back(request, num_rows_, false);
    num_rows_ += request.num_tokens;
  }

  /// @brief Appends the tokens of the request `handle` names (no slots): schedule() for the
  /// columnar plans of engines and bindings, which name every request by handle, one entry per
  /// request per step, built in place.
  void schedule(request_handle handle,
                std::int64_t first_position,
                std::int32_t num_tokens,
                std::int32_t num_draft_tokens = 0)
  {
    entries_.emplace_back(handle, first_position, num_tokens, num_draft_tokens, num_rows_);
    num_rows_ += num_tokens;
  }

  /// @brief Appends tokens of requests that did not ask for routing: they occupy rows of the
  /// forward but cost nothing on the host.
  void skip(std::int32_t num_tokens)
  {
    entries_.emplace_back(scheduled_request{request_key{std::int64_t{0}}, 0, num_tokens, 0, {}}, num_rows_, true);
    num_rows_ += num_tokens;
  }

  /// @brief Block-slot storage: KV blocks newly allocated for this step. Their previous rows
  /// (from an evicted prefix or a finished request) become stale before this step's rows land.
  /// Engines know these ids from their block allocator (vLLM's new_block_ids, for instance).
  void add_fresh_blocks(std::span<const std::int64_t> block_ids)
  {
    fresh_blocks_.insert(fresh_blocks_.end(), block_ids.begin(), block_ids.end());
  }

  /// @brief Declares how many rows the forward writes, padding included (a CUDA graph recorded
  /// for a padded batch writes all of its rows). The rows past N are reset after the step; without
  /// a declaration the library resets the most rows any capture path was handed outside a step,
  /// which is always safe but may reset more than this step wrote.
  void set_padded_rows(std::int64_t rows) noexcept { padded_rows_ = rows; }

  /// @brief Empties the plan, keeping its capacity.
  void clear() noexcept
  {
    entries_.clear();
    fresh_blocks_.clear();
    num_rows_    = 0;
    padded_rows_ = -1;
  }

  /// @brief N: rows (tokens) of the step.
  [[nodiscard]] std::int64_t num_rows() const noexcept { return num_rows_; }
  /// @brief The runs of the step, in batch order.
  [[nodiscard]] std::span<const entry> entries() const noexcept { return entries_; }
  /// @brief Blocks declared freshly allocated for this step.
  [[nodiscard]] std::span<const std::int64_t> fresh_blocks() const noexcept { return fresh_blocks_; }
  /// @brief Rows the forward writes including padding, -1 if not declared.
  [[nodiscard]] std::int64_t padded_rows() const noexcept { return padded_rows_; }

 private:
  std::vector<entry> entries_;
  std::vector<std::int64_t> fresh_blocks_;
  std::int64_t num_rows_    = 0;
  std::int64_t padded_rows_ = -1;
};

/// @brief Options of add_request().
struct request_options {
  /// @brief Prompt length, used to split extraction into prompt and generation rows; -1 if unknown.
  std::int64_t prompt_length = -1;
  /// @brief Prefix-cache hit: the KV slots that already hold positions [0, cached_slots.size()).
  /// Block-slot storage serves those rows from the slots; per-request storage has no rows for
  /// them, so they read as missing (sentinel).
  std::span<const std::int64_t> cached_slots{};
};

}  // namespace routing_replay
