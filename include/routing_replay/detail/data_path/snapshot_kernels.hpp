/// @file
/// The end-of-step kernel of step_snapshots: over a token-major D, it checks rows [0, N), writes
/// them narrowed to the output type into a ring slot's snapshot, and resets rows [0, R). One
/// definition, two ways to run: a CUDA kernel of one thread per 16 bytes of D (every access a
/// 16-byte word where the row range allows), and one pass over rows on a host stream (a memcpy, a
/// scan whose inner loops have fixed trip counts the compiler vectorizes, and a memset).
#pragma once

#include <routing_replay/detail/kernels.hpp>
#include <routing_replay/detail/macros.hpp>
#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/index_type.hpp>

#include <cuda/atomic>
#include <cuda/std/array>
#include <cuda/std/bit>
#include <cuda/std/type_traits>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace routing_replay::detail {

/// @brief The layers captured at least once since the buffer was made: a row's sentinel in one of
/// them is an unwritten row; in any other layer (dense, never routed) it reads as 0, as an engine
/// whose buffer starts zeroed reports it. Layers past the mask's 512 always count as captured.
struct captured_layers {
  /// @brief 64-bit words of the mask.
  static constexpr std::int32_t words = 8;
  cuda::std::array<std::uint64_t, words> bits{};  ///< bit l: layer l was captured

  /// @brief Marks `layer`.
  void add(std::int32_t layer) noexcept
  {
    if (layer >= 0 && layer < 64 * words) { bits[static_cast<std::size_t>(layer / 64)] |= std::uint64_t{1} << (layer % 64); }
  }
  /// @brief Whether `layer` was captured (or lies past the mask).
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE bool has(std::int32_t layer) const noexcept
  {
    return layer >= 64 * words || ((bits[static_cast<std::size_t>(layer / 64)] >> (layer % 64)) & 1u) != 0;
  }
  /// @brief Whether every layer in [0, layers) was captured.
  [[nodiscard]] bool all(std::int32_t layers) const noexcept
  {
    for (std::int32_t l = 0; l < layers && l < 64 * words; ++l) {
      if (!has(l)) { return false; }
    }
    return true;
  }
};

/// @brief End of step over a token-major D of `Index` into a snapshot of `Out` (as wide, or
/// narrower where every valid id fits: E = 256 keeps uint16 in D for its sentinel and hands out
/// uint8). Per id of rows [0, N): a sentinel in a captured layer is reported unwritten, a value
/// outside [0, E) (written around the capture path) out of range, and both read as 0; every other
/// id is copied. Ids of rows [0, R) are reset to the sentinel. Thread 0 moves what the capture paths
/// reported into the step's status (or drops it: `status` null) and zeroes it. Whenever the step's
/// status gains a report, `reported` (a word of pinned host memory, or null) is set to 1 with a
/// plain store: the host reads that word after the step instead of copying the status every step.
/// Where `landed` is given, the last block to finish (the host pass: the pass, at its end) stores
/// `sequence` there: the host learns that the rows are in place from that word alone.
///
/// The device form moves a 16-byte word of D and its narrowed word (out_word) of the snapshot per
/// thread: `buffer` must start on 16 bytes and `snapshot` on sizeof(out_word) (step_snapshots
/// allocates its ring slots so). The host pass has no such need.
template <class Index, class Out>
struct harvest_token_rows {
  /// @brief Ids a thread handles: one 16-byte word of D.
  static constexpr std::int32_t ids = static_cast<std::int32_t>(16 / sizeof(Index));
  /// @brief What a thread's word of D becomes in the snapshot: 16 bytes, or 8 where D is narrowed.
  using out_word = cuda::std::conditional_t<sizeof(Out) * ids == 16, word16, std::uint64_t>;
  static_assert(sizeof(Out) * ids == sizeof(out_word), "a word of D narrows to 16 or 8 bytes");

  Index* buffer;                 ///< D: rows [0, R) token-major from here
  Out* snapshot;                 ///< [N, L, K]
  step_status* status;           ///< the step's status (nullptr: reports are dropped)
  step_status* capture_status;   ///< what capture paths reported; zeroed here
  std::int64_t num_experts;      ///< E
  std::int32_t layers;           ///< L
  std::int32_t top_k;            ///< K
  std::int64_t check_elems;      ///< N * L * K
  std::int64_t reset_elems;      ///< R * L * K (>= check_elems)
  captured_layers captured;      ///< layers whose sentinels are unwritten rows
  std::uint32_t* reported = nullptr;  ///< set to 1 when `status` gains a report (nullptr: not kept)
  std::uint32_t* landed   = nullptr;  ///< pinned word set to `sequence` once every block is done (nullptr: none)
  std::uint32_t* arrivals = nullptr;  ///< device counter of blocks done, back to 0 by the last one
  std::uint32_t sequence  = 0;        ///< what `landed` becomes

  /// @brief Blocks of the device form (cuda_backend::launch_async of num_items() threads).
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int32_t num_blocks() const noexcept { return blocks_for(num_items()); }

  /// @brief Threads: one per word of rows [0, R), at least one.
  [[nodiscard]] ROUTING_REPLAY_HOST_DEVICE std::int64_t num_items() const noexcept
  {
    const std::int64_t items = (reset_elems + ids - 1) / ids;
    return items > 0 ? items : 1;
  }

  /// @brief The device's thread for word block * threads + thread.
  ROUTING_REPLAY_HOST_DEVICE void operator()(std::int32_t block, std::int32_t thread) const noexcept
  {
    const auto i = item_of(block, thread);
    if (i == 0) { absorb_capture_reports(); }
    const std::int64_t first = i * ids;
    if (first >= reset_elems) { return; }
    const bool whole_word = first + ids <= check_elems && first + ids <= reset_elems;
    if (!whole_word) {  // the last, partial word of a range
      for (std::int64_t e = first; e < first + ids && e < reset_elems; ++e) {
        if (e < check_elems) { snapshot[e] = checked(buffer[e], e); }
        buffer[e] = index_traits<Index>::sentinel;
      }
      return;
    }
    const auto in = cuda::std::bit_cast<cuda::std::array<Index, ids>>(load_word(reinterpret_cast<const word16*>(buffer + first)));
    cuda::std::array<Out, ids> out{};
    for (std::int32_t j = 0; j < ids; ++j) { out[j] = checked(in[j], first + j); }
    store_word(reinterpret_cast<out_word*>(snapshot + first), cuda::std::bit_cast<out_word>(out));
    store_word(reinterpret_cast<word16*>(buffer + first), sentinel_word<Index, word16>());
  }

  /// @brief After each block of the device form: the last one sets `landed`, so the host sees the
  /// rows in place by reading one word of pinned memory rather than querying an event. Each block
  /// counts itself with a release at GPU scope (after the block's barrier: every store of the
  /// block, rows, status and report flag); the last one acquires them all and publishes them to the
  /// host with one release at system scope. One system-scope fence per kernel, not one per block:
  /// about 1 us of GPU time at 384 B to 128 KiB of rows on an H200, where a fence in every block
  /// costs twice that.
  ROUTING_REPLAY_HOST_DEVICE void block_done(std::int32_t) const noexcept
  {
    if (landed == nullptr) { return; }
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> count{*arrivals};
    if (count.fetch_add(1u, cuda::std::memory_order_acq_rel) + 1u != static_cast<std::uint32_t>(num_blocks())) { return; }
    *arrivals = 0u;  // for the slot's next harvest, later on the same stream
    publish_landed();
  }

  /// @brief The same, as one pass on the host: copy, scan, and the id-by-id path only for rows
  /// where the scan found something.
  void run_on_host() const noexcept
  {
    absorb_capture_reports();
    const std::int64_t row = static_cast<std::int64_t>(layers) * top_k;
    for (std::int64_t first = 0; first < check_elems; first += row) {  // a row at a time: the scan reads it from L1
      if constexpr (std::is_same_v<Index, Out>) {
        std::memcpy(snapshot + first, buffer + first, static_cast<std::size_t>(row) * sizeof(Index));
      } else {
        narrow(buffer + first, snapshot + first, row);
      }
      if (any_outside(buffer + first, row)) {
        for (std::int64_t e = first; e < first + row; ++e) { snapshot[e] = checked(buffer[e], e); }
      }
    }
    std::memset(static_cast<void*>(buffer), index_traits<Index>::sentinel_byte,
                static_cast<std::size_t>(reset_elems) * sizeof(Index));
    if (landed != nullptr) { publish_landed(); }
  }

 private:
  // Every store before this one (the caller's, and those it acquired) is visible to the host that
  // reads `landed` with acquire and finds `sequence`.
  ROUTING_REPLAY_HOST_DEVICE void publish_landed() const noexcept
  {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>{*landed}.store(sequence, cuda::std::memory_order_release);
  }

  using unsigned_index = std::make_unsigned_t<Index>;

  ROUTING_REPLAY_HOST_DEVICE void absorb_capture_reports() const noexcept
  {
    if (status != nullptr) {
      status->invalid_id.absorb(capture_status->invalid_id);
      status->out_of_bounds.absorb(capture_status->out_of_bounds);
      if (capture_status->invalid_id.count != 0ull || capture_status->out_of_bounds.count != 0ull) { mark_reported(); }
    }
    capture_status->invalid_id    = problem_report{};
    capture_status->out_of_bounds = problem_report{};
  }

  // Every reporting thread stores the same value: no atomic needed, and the host reads it only after
  // the kernel completed (its event) or published its stores (`landed`).
  ROUTING_REPLAY_HOST_DEVICE void mark_reported() const noexcept
  {
    if (reported != nullptr) { *static_cast<volatile std::uint32_t*>(reported) = 1u; }
  }
  // The output of id `v` at element `e`, reporting what is wrong with it.
  ROUTING_REPLAY_HOST_DEVICE Out checked(Index v, std::int64_t e) const noexcept
  {
    // one unsigned compare: the sentinel (-1 or the type's maximum) and every negative id are >= E
    if (static_cast<std::uint64_t>(static_cast<unsigned_index>(v)) < static_cast<std::uint64_t>(num_experts)) {
      return static_cast<Out>(v);
    }
    if (status != nullptr) {
      const std::int64_t row_elems = static_cast<std::int64_t>(layers) * top_k;
      const auto row               = static_cast<std::int32_t>(e / row_elems);
      const auto within            = static_cast<std::int32_t>(e - row * row_elems);
      const std::int32_t layer     = within / top_k;
      const std::int32_t column    = within - layer * top_k;
      if (v == index_traits<Index>::sentinel) {
        if (captured.has(layer)) {
          status->unwritten.report(0, layer, row, column);
          mark_reported();
        }
      } else {
        status->out_of_range.report(static_cast<std::int64_t>(v), layer, row, column);
        mark_reported();
      }
    }
    return Out{0};
  }

  // Whether any of `n` ids is outside [0, E): fixed-size inner loops, which the compiler vectorizes.
  bool any_outside(const Index* in, std::int64_t n) const noexcept
  {
    const auto limit = static_cast<unsigned_index>(num_experts > static_cast<std::int64_t>(static_cast<unsigned_index>(-1))
                                                     ? static_cast<unsigned_index>(-1)
                                                     : num_experts);
    constexpr std::int64_t chunk = 64;
    unsigned_index worst         = 0;
    std::int64_t e               = 0;
    for (; e + chunk <= n; e += chunk) {
      unsigned_index m = 0;
      for (std::int64_t j = 0; j < chunk; ++j) {
        const auto v = static_cast<unsigned_index>(in[e + j]);
        m            = v > m ? v : m;
      }
      worst = m > worst ? m : worst;
    }
    for (; e < n; ++e) {
      const auto v = static_cast<unsigned_index>(in[e]);
      worst        = v > worst ? v : worst;
    }
    return worst >= limit;
  }

  static void narrow(const Index* in, Out* out, std::int64_t n) noexcept
  {
    for (std::int64_t e = 0; e < n; ++e) { out[e] = static_cast<Out>(in[e]); }
  }
};

}  // namespace routing_replay::detail
