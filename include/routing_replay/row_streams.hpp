/// @file
/// Row streams: each request's routing rows arrive step by step (chunked prefill, decode, accepted
/// drafts), go out step by step from the request's emit cursor, and are filed in full blocks into a
/// block_tier under the engine's block keys, so that a later request whose prefix hits those blocks
/// gets its rows back from the tier. The semantics are those of vLLM 0.33's auxiliary-output
/// worker connector (each call below names the method it stands for), with its assertions as
/// exceptions, and two additions: a request whose first step starts mid-block (its first tokens were
/// computed on another instance) keeps that partial block out of the tier instead of failing, and a
/// range that cannot be served names the request, the range and the block.
///
/// Threads: the engine's thread calls everything here (one at a time) and keeps the cursors; it
/// reads and writes no rows of a step (outputs are views of them). A filing thread
/// (detail::filing_worker) runs what each call hands it, in order: it copies rows into the tail
/// pool (request tails, full blocks waiting for their keys), copies full blocks into the tier,
/// retains, releases and evicts; a read of the tier or of a tail waits for it first. A tail-pool
/// slot whose block a filing task still reads is reused only after that task ran. A failed tier
/// update fails the calls that update or read the tier after it.
///
/// This file declares the calls; they are defined in detail/row_streams/row_stream_begin.hpp
/// (construction, begin_step's half), detail/row_streams/row_stream_steps.hpp (the step's half) and
/// detail/row_streams/row_stream_staging.hpp (the tail pool and the hand-over to the filing
/// thread).
#pragma once

#include <routing_replay/block_tier.hpp>
#include <routing_replay/detail/row_streams/filing_worker.hpp>
#include <routing_replay/detail/row_streams/row_stream_filing.hpp>
#include <routing_replay/detail/row_streams/row_stream_requests.hpp>
#include <routing_replay/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

namespace routing_replay {

/// @brief Sizes of a set of row streams (vLLM: the model's and the scheduler's configuration).
struct row_streams_config {
  std::int32_t num_layers             = 0;  ///< L: layers per row
  std::int32_t top_k                  = 0;  ///< K: ids per layer
  std::int32_t element_bytes          = 1;  ///< bytes of one id (1: uint8, 2: uint16)
  std::int32_t block_size             = 16; ///< rows per block (the engine's KV hash block)
  std::int32_t max_num_seqs           = 0;  ///< most requests in one step
  std::int32_t max_num_batched_tokens = 0;  ///< most rows in one step
  std::int32_t max_concurrent_batches = 1;  ///< most steps prepared and not yet processed
  std::size_t max_bytes               = 0;  ///< the tier's budget
  std::size_t filing_depth            = 16; ///< task slots of the filing thread
  block_tier_options tier_options{};        ///< the tier's options
};

/// @brief `count` block hashes of `item_size` bytes each, back to back (vLLM's PackedBlockHashes).
struct packed_hashes {
  const std::byte* data = nullptr;  ///< the hashes
  std::size_t count     = 0;        ///< how many
  std::size_t item_size = 0;        ///< bytes each
};

/// @brief A call whose arguments contradict the streams' state (what vLLM asserts): a cursor moving
/// backwards or ahead, a count out of range, an unknown request.
class stream_input_error : public error {
 public:
  /// @brief An error naming the request, the range and the block.
  explicit stream_input_error(const std::string& message) : error(errc::invalid_plan, message) {}
};

/// @brief Rows a request needs are not in the tier (evicted, or never stored), or a tier update
/// failed earlier (vLLM: BlockObjectStoreError).
class block_store_error : public error {
 public:
  /// @brief An error naming the request and the block, or the failed update.
  explicit block_store_error(const std::string& message) : error(errc::missing_routing, message) {}
};

/// @brief The per-request row streams of one engine (one per output rank).
///
/// Handles are dense request numbers this object hands out (schedule()); callers map their own ids
/// to them and drop the mapping for each handle forgotten() lists after a call. Errors name requests
/// through the `describe` function given at construction (default: "request #handle").
class row_streams {
 public:
  /// @brief A request handle.
  using handle = std::int32_t;
  /// @brief schedule()'s argument for a request it does not know yet.
  static constexpr handle new_request = detail::none;
  /// @brief How error messages name a request.
  using describe_fn = std::function<std::string(handle)>;

  /// @brief Streams for `config` (sizes checked); starts the filing thread.
  /// @throws error invalid_config
  explicit row_streams(const row_streams_config& config, describe_fn describe = {});
  row_streams(const row_streams&)            = delete;
  row_streams& operator=(const row_streams&) = delete;
  /// @brief Waits for the filing thread, then stops it.
  ~row_streams() = default;

  /// @brief Bytes of one row (L * K ids).
  [[nodiscard]] std::size_t row_bytes() const noexcept { return row_bytes_; }
  /// @brief Rows per block.
  [[nodiscard]] std::int32_t block_size() const noexcept { return config_.block_size; }
  /// @brief Slots of the tail pool (vLLM: RoutedExpertsBuffer's blocks).
  [[nodiscard]] std::int32_t pool_slots() const noexcept { return pool_.size(); }
  /// @brief Free slots of the tail pool.
  [[nodiscard]] std::int32_t free_pool_slots() const noexcept { return pool_.free(); }
  /// @brief The key generation (vLLM: the prefix cache's).
  [[nodiscard]] std::uint64_t generation() const noexcept { return generation_; }
  /// @brief Live requests.
  [[nodiscard]] std::size_t num_requests() const noexcept { return requests_.size(); }
  /// @brief Steps prepared and not yet processed.
  [[nodiscard]] std::int32_t steps_in_flight() const noexcept { return in_flight_; }
  /// @brief Whether `h` names a live request.
  [[nodiscard]] bool live(handle h) const noexcept { return requests_.live(h); }
  /// @brief The cursors of request `h` (for tests and diagnostics).
  [[nodiscard]] const detail::stream_request& request(handle h) const noexcept { return requests_[h]; }
  /// @brief Handles the last call forgot (their requests were torn down).
  [[nodiscard]] std::span<const handle> forgotten() const noexcept { return forgotten_; }

  // ---- begin_step(metadata), in this order ------------------------------------------------------

  /// @brief Opens a step's metadata: `retained` and `released` hashes (keys of the current
  /// generation) join the step's tier update; a larger `generation` (a prefix-cache reset) first
  /// releases every request's keys and forgets every request and tail.
  /// @throws stream_input_error if `generation` moved backwards; error invalid_state if it moved
  /// while steps are in flight, or after close()
  void open_step(std::uint64_t generation, packed_hashes retained, packed_hashes released);
  /// @brief A request scheduled this step, with its emit start (new_request: one not known yet).
  /// @return its handle
  /// @throws stream_input_error if, with no step of it in flight, the emit start is past its cursor
  handle schedule(handle h, std::int64_t emit_start);
  /// @brief Keys of the request's next full blocks (retained by this step's update).
  void add_block_hashes(handle h, packed_hashes hashes);
  /// @brief The engine finished the request: it goes now, or when the last step covering it is
  /// processed; its keys are released then.
  void finish(handle h);
  /// @brief Closes the step's metadata: waiting blocks whose keys arrived are stored; the tier
  /// update is handed to the filing thread.
  /// @throws block_store_error if an earlier tier update failed
  void close_step();
  /// @brief Ends a step whose metadata was refused midway: what it changed stays, its tier update
  /// is dropped.
  void abandon_step() noexcept;

  // ---- a step's rows ---------------------------------------------------------------------------

  /// @brief prepare_output: a step covering `handles` (batch order), whose request i computed
  /// positions from `token_starts[i]` over rows [query_start_loc[i], query_start_loc[i + 1]).
  /// @return the step's number, for commit()
  /// @throws error invalid_state when max_concurrent_batches steps are in flight already
  int prepare(std::span<const handle> handles, const std::int64_t* token_starts, const std::int64_t* query_start_loc);

  /// @brief process_output: the rows of a prepared step arrived (row-major [N, L, K] in `rows`,
  /// held by `owner` until filing read them); the rejected draft suffix of each request is dropped,
  /// the rest captured, and each request with sampled tokens whose emit cursor lies within its rows
  /// gets them: sink.view(i, token_start, rows, count) with the step's rows where they start at or
  /// after the step's first captured position, else sink.materialize(i, token_start, count) (a
  /// buffer to fill) with rows read back from the tier and the request's tail. Then the step is
  /// retired (retire()), also when this throws.
  /// @throws stream_input_error, block_store_error, error invalid_state (the tail pool is exhausted)
  template <class Sink>
  void commit(int step, const std::byte* rows, const std::int64_t* num_sampled, const std::int64_t* num_rejected,
              step_rows_owner* owner, Sink& sink);

  /// @brief The end of process_output alone (a step whose rows were refused): the step is no longer
  /// in flight, and finished requests it covered go.
  void retire(int step);

  /// @brief Waits until the filing thread has run everything handed to it.
  void drain() { worker_.drain(); }
  /// @brief The tier (call drain() first; for tests and diagnostics).
  [[nodiscard]] const block_tier& tier() const noexcept { return filing_->tier(); }
  /// @brief close(): waits for filing; later calls that update the tier throw.
  void close()
  {
    worker_.drain();
    closed_ = true;
  }
  /// @brief Whether close() was called.
  [[nodiscard]] bool closed() const noexcept { return closed_; }

 private:
  struct prepared_step {
    bool used = false;
    std::vector<handle> handles;
    std::vector<std::int64_t> token_starts;
    std::vector<std::int64_t> query_start_loc;
  };
  struct completed_block {
    std::int64_t start;       // first position
    std::int32_t slot;        // pool slot, or none: rows of the step
    const std::byte* rows;
  };
  struct batch {
    handle request;
    std::size_t first, last;  // into completed_
  };
  struct pending_read {
    std::size_t index;
    std::int64_t start, end;
  };

  [[nodiscard]] std::string name(handle h) const { return describe_ ? describe_(h) : "request #" + std::to_string(h); }
  [[nodiscard]] std::byte* pool_rows(std::int32_t slot) const noexcept
  {
    return pool_memory_.get() + static_cast<std::size_t>(slot) * block_bytes_;
  }
  [[nodiscard]] std::int32_t take_slot(handle h, std::int64_t block_start);
  void stage(handle h, std::int64_t token_start, const std::byte* rows, std::int64_t count, detail::filing_task& task);
  void give_back_after_filing();
  void publish(detail::filing_task& task);
  void teardown(handle h, detail::filing_task& task);
  void release_all_keys(handle h, detail::filing_task& task);
  void attach_rows(detail::filing_task& task, step_rows_owner* owner) noexcept;
  void submit(detail::filing_task& task, bool wake_later = false);
  void check_filing_if(bool failed) const;
  template <class Sink>
  void read_back(handle h, const pending_read& m, Sink& sink);

  row_streams_config config_;
  std::size_t row_bytes_;
  std::size_t block_bytes_;
  describe_fn describe_;
  detail::stream_requests requests_;
  detail::block_slot_pool pool_;
  struct aligned_free {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte[], aligned_free> pool_memory_;  // cache-line aligned: blocks copied whole
  std::unique_ptr<detail::filing_state> filing_;
  detail::filing_worker<detail::filing_task> worker_;  // after filing_: stops before it goes
  std::uint64_t generation_ = 0;
  bool closed_              = false;
  detail::filing_task* building_ = nullptr;  // the step metadata's task, between open_step and close_step
  std::vector<handle> finished_now_;
  std::vector<handle> with_keys_;  // requests whose keys arrived this step
  std::vector<handle> forgotten_;
  std::vector<prepared_step> steps_;
  std::int32_t in_flight_ = 0;
  std::vector<completed_block> completed_;  // scratch of commit()
  std::vector<batch> batches_;
  std::vector<pending_read> reads_;
  std::vector<std::int32_t> freed_slots_;  // slots of blocks publish() stored, given back after it
  bool rows_used_ = false;                 // the task being built reads the step's rows
  std::vector<std::byte> read_scratch_;
  std::vector<block_key> key_scratch_;
};

}  // namespace routing_replay

#include <routing_replay/detail/row_streams/row_stream_begin.hpp>
#include <routing_replay/detail/row_streams/row_stream_steps.hpp>
#include <routing_replay/detail/row_streams/row_stream_staging.hpp>
