/// @file
/// Step packets: how a worker process hands one step's rows to the scheduler process that keeps the
/// host storage (engines such as vLLM; the processes may be on different nodes). A packet is
/// compact (only the rows of requests that opted in), versioned, self-describing and checked.
/// Plain C++20: the scheduler side needs no device. The format (docs/parallelism.md) is:
///
/// | offset | bytes | field |
/// |---|---|---|
/// | 0 | 4 | magic `RRSP` |
/// | 4 | 2 | format version (step_packet_version) |
/// | 6 | 2 | byte-order mark 0x0102 (every integer is little-endian) |
/// | 8 | 1 | index kind: `i` (signed) or `u` (unsigned) |
/// | 9 | 1 | index bytes: 1, 2 or 4 |
/// | 10 | 1 | flags: bit 0 = the worker lost the step (no rows follow) |
/// | 11 | 1 | reserved, 0 |
/// | 12 | 4 | L (u32) |
/// | 16 | 4 | K (u32) |
/// | 20 | 4 | runs (u32) |
/// | 24 | 8 | step serial (u64) |
/// | 32 | 8 | N, rows of the step including skipped ones (u64) |
/// | 40 | 8 | payload rows: the runs' rows that follow (u64) |
/// | 48 | 8 | total bytes of the packet, checksum included (u64) |
/// | 56 | | per run: id kind (u8: 0 integer, 1 string), 3 reserved bytes, id length (u32), the id (an i64, or the string's bytes), first row (i64), first position (i64), tokens (i32), draft tokens (i32), slots (u32), the slots (i64 each) |
/// | | 112 | the step status: 4 problem reports (invalid id, out of bounds, unwritten, out of range), each count (u64), value (i64), layer slot, row, column (i32 each) |
/// | | | the rows of the runs in order, payload rows x L x K ids |
/// | end - 8 | 8 | XXH64 (seed 0) of every byte before it |
#pragma once

#include <routing_replay/detail/step_status.hpp>
#include <routing_replay/detail/xxhash64.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/step_plan.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace routing_replay {

static_assert(std::endian::native == std::endian::little, "step packets are written and read as little-endian");

/// @brief The packet format version this library writes, and the only one it reads.
inline constexpr std::uint16_t step_packet_version = 1;

/// @brief One scheduled request of a packet, as the worker planned it.
struct packet_run {
  request_key id{std::int64_t{0}};  ///< a view into the packet's bytes (string ids)
  std::int64_t first_row = 0;     ///< first row of the step
  std::int64_t first_position = 0;  ///< position of that row
  std::int32_t num_tokens = 0;    ///< rows
  std::int32_t num_draft_tokens = 0;  ///< trailing draft rows
  std::span<const std::byte> slot_bytes;  ///< the run's KV slots, i64 each (read with slot())
  const std::byte* rows = nullptr;  ///< its rows in the payload (unaligned: read with memcpy)

  /// @brief The run's `i`-th KV slot.
  [[nodiscard]] std::int64_t slot(std::size_t i) const noexcept
  {
    std::int64_t v;
    std::memcpy(&v, slot_bytes.data() + i * 8, 8);
    return v;
  }
  /// @brief Slots the run carries (0 where the worker's plan had none).
  [[nodiscard]] std::size_t num_slots() const noexcept { return slot_bytes.size() / 8; }
};

/// @brief A packet whose framing and checksum have been verified: a non-owning view of its bytes.
class step_packet_view {
 public:
  /// @brief Verifies and reads a packet: size, magic, version, byte order, checksum, then every
  /// field against the packet's own size.
  /// @throws error invalid_packet, naming what is wrong
  [[nodiscard]] static step_packet_view parse(std::span<const std::byte> bytes)
  {
    step_packet_view v;
    v.bytes_ = bytes;
    if (bytes.size() < header_bytes + 8) { bad("truncated: " + std::to_string(bytes.size()) + " bytes, less than a header"); }
    if (std::memcmp(bytes.data(), magic, 4) != 0) { bad("not a routing-replay step packet (magic)"); }
    if (const auto version = v.get<std::uint16_t>(4); version != step_packet_version) {
      bad("format version " + std::to_string(version) + ", this library reads version " + std::to_string(step_packet_version));
    }
    if (v.get<std::uint16_t>(6) != 0x0102) { bad("byte-order mark does not read as little-endian"); }
    if (const auto total = v.get<std::uint64_t>(48); total != bytes.size()) {
      bad("truncated or padded: " + std::to_string(bytes.size()) + " bytes, the header says " + std::to_string(total));
    }
    if (detail::xxhash64(bytes.first(bytes.size() - 8)) != v.get<std::uint64_t>(bytes.size() - 8)) {
      bad("corrupted: the checksum does not match the contents");
    }
    v.read_body();
    return v;
  }

  /// @brief The step's serial on the worker (1 for its first step).
  [[nodiscard]] std::uint64_t serial() const noexcept { return get<std::uint64_t>(24); }
  /// @brief N: rows of the step, skipped ones included.
  [[nodiscard]] std::int64_t num_rows() const noexcept { return static_cast<std::int64_t>(get<std::uint64_t>(32)); }
  /// @brief L.
  [[nodiscard]] std::int32_t num_layers() const noexcept { return static_cast<std::int32_t>(get<std::uint32_t>(12)); }
  /// @brief K.
  [[nodiscard]] std::int32_t top_k() const noexcept { return static_cast<std::int32_t>(get<std::uint32_t>(16)); }
  /// @brief Whether the ids are signed.
  [[nodiscard]] bool index_signed() const noexcept { return get<char>(8) == 'i'; }
  /// @brief Bytes per id.
  [[nodiscard]] std::size_t index_bytes() const noexcept { return get<std::uint8_t>(9); }
  /// @brief Whether the worker lost the step (its copy failed): no rows.
  [[nodiscard]] bool lost() const noexcept { return (get<std::uint8_t>(10) & 1u) != 0; }
  /// @brief The runs, in batch order.
  [[nodiscard]] std::span<const packet_run> runs() const noexcept { return runs_; }
  /// @brief The step's verdict, as the worker's device reported it.
  [[nodiscard]] const detail::step_status& status() const noexcept { return status_; }

  /// @brief Whether the ids are of type `Index`.
  template <class Index>
  [[nodiscard]] bool holds() const noexcept
  {
    return index_bytes() == sizeof(Index) && index_signed() == std::is_signed_v<Index>;
  }

  /// @brief Bytes of the fixed header.
  static constexpr std::size_t header_bytes = 56;
  /// @brief The magic the packet starts with.
  static constexpr char magic[4] = {'R', 'R', 'S', 'P'};

 private:
  template <class T>
  [[nodiscard]] T get(std::size_t at) const noexcept
  {
    T v;
    std::memcpy(&v, bytes_.data() + at, sizeof(T));
    return v;
  }

  [[noreturn]] static void bad(const std::string& what) { throw error{errc::invalid_packet, "step packet: " + what}; }

  // Walks the runs, the status and the payload, never reading past the checksum.
  void read_body()
  {
    const std::size_t end = bytes_.size() - 8;
    std::size_t at        = header_bytes;
    auto need             = [&](std::size_t n) {
      if (n > end - at) { bad("malformed: a field runs past the end of the packet"); }
    };
    const std::uint32_t count = get<std::uint32_t>(20);
    if (count > end / 36) { bad("malformed: " + std::to_string(count) + " runs cannot fit"); }
    runs_.resize(count);
    std::uint64_t rows = 0;
    for (auto& run : runs_) {
      need(8);
      const auto kind = get<std::uint8_t>(at);
      const auto len  = get<std::uint32_t>(at + 4);
      at += 8;
      need(len);
      if (kind == 0 && len == 8) {
        run.id = request_key{get<std::int64_t>(at)};
      } else if (kind == 1) {
        run.id = request_key{std::string_view{reinterpret_cast<const char*>(bytes_.data() + at), len}};
      } else {
        bad("malformed: request id of kind " + std::to_string(kind) + " and length " + std::to_string(len));
      }
      at += len;
      need(28);
      run.first_row        = get<std::int64_t>(at);
      run.first_position   = get<std::int64_t>(at + 8);
      run.num_tokens       = get<std::int32_t>(at + 16);
      run.num_draft_tokens = get<std::int32_t>(at + 20);
      const std::uint32_t slots = get<std::uint32_t>(at + 24);
      at += 28;
      need(std::size_t{slots} * 8);
      run.slot_bytes = bytes_.subspan(at, std::size_t{slots} * 8);
      at += std::size_t{slots} * 8;
      if (run.num_tokens < 0) { bad("malformed: negative token count"); }
      rows += static_cast<std::uint64_t>(run.num_tokens);
    }
    need(status_bytes);
    for (detail::problem_report* r : {&status_.invalid_id, &status_.out_of_bounds, &status_.unwritten, &status_.out_of_range}) {
      r->count  = get<std::uint64_t>(at);
      r->value  = get<std::int64_t>(at + 8);
      r->layer  = get<std::int32_t>(at + 16);
      r->row    = get<std::int32_t>(at + 20);
      r->column = get<std::int32_t>(at + 24);
      at += 28;
    }
    const std::uint64_t payload_rows = get<std::uint64_t>(40);
    const std::size_t row_bytes      = std::size_t{get<std::uint32_t>(12)} * get<std::uint32_t>(16) * index_bytes();
    if (payload_rows != (lost() ? 0 : rows) || (row_bytes != 0 && payload_rows > (end - at) / row_bytes) ||
        payload_rows * row_bytes != end - at) {
      bad("malformed: " + std::to_string(payload_rows) + " payload rows of " + std::to_string(row_bytes) +
          " bytes for runs of " + std::to_string(rows) + " rows in " + std::to_string(end - at) + " bytes");
    }
    for (auto& run : runs_) {
      run.rows = lost() ? nullptr : bytes_.data() + at;
      at += lost() ? 0 : static_cast<std::size_t>(run.num_tokens) * row_bytes;
    }
  }

  static constexpr std::size_t status_bytes = 4 * 28;

  std::span<const std::byte> bytes_;
  std::vector<packet_run> runs_;
  detail::step_status status_{};
};

/// @brief Writes packets on the worker side: the head (everything known from the plan) when a step
/// begins, the status and rows once they have arrived on the host.
template <expert_index Index>
class step_packet_writer {
 public:
  /// @brief A packet for rows of `num_layers` x `top_k` ids.
  step_packet_writer(std::int32_t num_layers, std::int32_t top_k) : layers_(num_layers), top_k_(top_k) {}

  /// @brief Starts the packet of step `serial` planned by `plan` (the plan's ids are copied).
  /// @throws error invalid_argument if the plan names a request by handle: a handle is local to the
  /// replay that returned it, and the scheduler files packets by id
  void begin(const step_plan& plan, std::uint64_t serial)
  {
    for (const auto& entry : plan.entries()) {
      if (!entry.skipped && entry.request.id.is_handle()) {
        throw error{errc::invalid_argument, "step packet: the plan names " + entry.request.id.to_string() +
                                              "; packets carry request ids (a handle is local to one replay)"};
      }
    }
    bytes_.assign(step_packet_view::header_bytes, std::byte{0});
    std::memcpy(bytes_.data(), step_packet_view::magic, 4);
    put_at<std::uint16_t>(4, step_packet_version);
    put_at<std::uint16_t>(6, 0x0102);
    put_at<char>(8, std::is_signed_v<Index> ? 'i' : 'u');
    put_at<std::uint8_t>(9, sizeof(Index));
    put_at<std::uint32_t>(12, static_cast<std::uint32_t>(layers_));
    put_at<std::uint32_t>(16, static_cast<std::uint32_t>(top_k_));
    put_at<std::uint64_t>(24, serial);
    put_at<std::uint64_t>(32, static_cast<std::uint64_t>(plan.num_rows()));
    spans_.clear();
    for (const auto& entry : plan.entries()) {
      if (entry.skipped) { continue; }
      const scheduled_request& s = entry.request;
      const bool integer         = s.id.is_integer();
      put<std::uint8_t>(integer ? 0 : 1);
      put<std::uint8_t>(0);
      put<std::uint16_t>(0);
      put<std::uint32_t>(integer ? 8u : static_cast<std::uint32_t>(s.id.string().size()));
      if (integer) {
        put<std::int64_t>(s.id.integer());
      } else {
        const auto* p = reinterpret_cast<const std::byte*>(s.id.string().data());
        bytes_.insert(bytes_.end(), p, p + s.id.string().size());
      }
      put<std::int64_t>(entry.first_row);
      put<std::int64_t>(s.first_position);
      put<std::int32_t>(s.num_tokens);
      put<std::int32_t>(s.num_draft_tokens);
      put<std::uint32_t>(static_cast<std::uint32_t>(s.slots.size()));
      for (const std::int64_t slot : s.slots) { put<std::int64_t>(slot); }
      spans_.push_back({entry.first_row, s.num_tokens});
    }
    put_at<std::uint32_t>(20, static_cast<std::uint32_t>(spans_.size()));
  }

  /// @brief Completes the packet begun last with the step's verdict and its rows, `rows` being the
  /// step's [N, L, K] token-major rows on the host (nullptr: the worker lost the step; no rows), and
  /// returns its bytes (valid until the next begin()).
  [[nodiscard]] std::span<const std::byte> finish(const detail::step_status& status, const Index* rows)
  {
    for (const detail::problem_report* r : {&status.invalid_id, &status.out_of_bounds, &status.unwritten, &status.out_of_range}) {
      put<std::uint64_t>(r->count);
      put<std::int64_t>(r->value);
      put<std::int32_t>(r->layer);
      put<std::int32_t>(r->row);
      put<std::int32_t>(r->column);
    }
    const std::int64_t row_elems = static_cast<std::int64_t>(layers_) * top_k_;
    std::uint64_t payload_rows   = 0;
    if (rows == nullptr) {
      put_at<std::uint8_t>(10, 1);
    } else {
      for (const auto& [first_row, count] : spans_) {
        const auto* p = reinterpret_cast<const std::byte*>(rows + first_row * row_elems);
        bytes_.insert(bytes_.end(), p, p + static_cast<std::size_t>(count * row_elems) * sizeof(Index));
        payload_rows += static_cast<std::uint64_t>(count);
      }
    }
    put_at<std::uint64_t>(40, payload_rows);
    put_at<std::uint64_t>(48, bytes_.size() + 8);
    put<std::uint64_t>(detail::xxhash64(bytes_));
    return bytes_;
  }

 private:
  template <class T>
  void put(T v)
  {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_at(std::size_t at, T v) noexcept
  {
    std::memcpy(bytes_.data() + at, &v, sizeof(T));
  }

  struct span {
    std::int64_t first_row;
    std::int32_t count;
  };
  std::int32_t layers_;
  std::int32_t top_k_;
  std::vector<std::byte> bytes_;
  std::vector<span> spans_;  // the runs' rows of the step
};

}  // namespace routing_replay
