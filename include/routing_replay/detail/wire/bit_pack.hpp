/// @file
/// Bit packing of expert ids at B = 1..16 bits, LSB first, ids in their stored order. Eight ids of
/// B bits make exactly B bytes, so the hot loops move one group of eight at a time with constant
/// shifts (B is a template parameter, dispatched once a call): no branch per id, which is what keeps
/// encode and decode above 1 GB/s of ids on one core.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <algorithm>

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

__extension__ typedef unsigned __int128 uint128;  // g++ and clang; -Wpedantic wants the marker

/// Bytes a packing destination needs past its packed size: a group is stored as one 16-byte word.
inline constexpr std::size_t pack_slack = 16;

// One group of eight ids of B bits in two 64-bit words (the second only for B > 8): every shift
// and every choice of word is a constant, so a group is a handful of shifts and ORs.
template <unsigned B, unsigned J>
inline void put_id(std::uint64_t& lo, std::uint64_t& hi, std::uint64_t v) noexcept
{
  constexpr unsigned s = J * B;
  if constexpr (s + B <= 64) {
    lo |= v << s;
  } else if constexpr (s >= 64) {
    hi |= v << (s - 64);
  } else {
    lo |= v << s;
    hi |= v >> (64 - s);
  }
}

template <unsigned B, unsigned J>
[[nodiscard]] inline std::uint16_t get_id(std::uint64_t lo, std::uint64_t hi) noexcept
{
  constexpr unsigned s       = J * B;
  constexpr std::uint64_t m  = (std::uint64_t{1} << B) - 1;
  if constexpr (s + B <= 64) {
    return static_cast<std::uint16_t>((lo >> s) & m);
  } else if constexpr (s >= 64) {
    return static_cast<std::uint16_t>((hi >> (s - 64)) & m);
  } else {
    return static_cast<std::uint16_t>(((lo >> s) | (hi << (64 - s))) & m);
  }
}

template <unsigned B>
inline void pack_group(const std::uint16_t* ids, std::byte* out) noexcept
{
  std::uint64_t lo = 0, hi = 0;
  [&]<unsigned... J>(std::integer_sequence<unsigned, J...>) {
    (put_id<B, J>(lo, hi, ids[J]), ...);
  }(std::make_integer_sequence<unsigned, 8>{});
  std::memcpy(out, &lo, 8);  // B bytes are the group's; the rest is zero and overwritten next
  if constexpr (B > 8) { std::memcpy(out + 8, &hi, 8); }
}

template <unsigned B>
inline void pack_fixed(const std::uint16_t* ids, std::size_t count, std::byte* out) noexcept
{
  const std::size_t groups = count / 8;
  for (std::size_t g = 0; g < groups; ++g) { pack_group<B>(ids + 8 * g, out + B * g); }
  if (const std::size_t tail = count % 8; tail != 0) {
    std::uint16_t last[8] = {};
    std::copy_n(ids + 8 * groups, tail, last);
    pack_group<B>(last, out + B * groups);
  }
}

/// @brief Packs `count` ids (each < 2^bits) at `bits` bits each into `out`, which holds
/// ceil(count * bits / 8) + pack_slack bytes; the bits past the last id are zero.
inline void pack_ids(const std::uint16_t* ids, std::size_t count, unsigned bits, std::byte* out) noexcept
{
  switch (bits) {
#define RR_WIRE_PACK(b) case b: pack_fixed<b>(ids, count, out); break;
    RR_WIRE_PACK(1) RR_WIRE_PACK(2) RR_WIRE_PACK(3) RR_WIRE_PACK(4) RR_WIRE_PACK(5) RR_WIRE_PACK(6)
    RR_WIRE_PACK(7) RR_WIRE_PACK(8) RR_WIRE_PACK(9) RR_WIRE_PACK(10) RR_WIRE_PACK(11) RR_WIRE_PACK(12)
    RR_WIRE_PACK(13) RR_WIRE_PACK(14) RR_WIRE_PACK(15) RR_WIRE_PACK(16)
#undef RR_WIRE_PACK
    default: break;
  }
}

/// @brief The id at index `i` of a packed run of `size` bytes (never reads past it).
[[nodiscard]] inline std::uint16_t unpack_one(const std::byte* in, std::size_t size, unsigned bits,
                                              std::size_t i) noexcept
{
  const std::size_t bit  = i * bits;
  const std::size_t byte = bit / 8;
  std::uint32_t w        = 0;
  const std::size_t n    = size - byte < 3 ? size - byte : 3;  // 16 bits + a shift of 7 fit 3 bytes
  std::memcpy(&w, in + byte, n);
  return static_cast<std::uint16_t>((w >> (bit % 8)) & ((1u << bits) - 1u));
}

template <unsigned B, class Out>
inline void unpack_fixed(const std::byte* in, std::size_t size, std::size_t first, std::size_t count,
                         Out* out) noexcept
{
  constexpr std::size_t load = B > 8 ? 16 : 8;  // bytes one group's load reads
  std::size_t i         = first;
  const std::size_t end = first + count;
  for (; i < end && i % 8 != 0; ++i) { *out++ = static_cast<Out>(unpack_one(in, size, B, i)); }
  // whole groups while the load stays inside the run; the last ones go one id at a time
  for (; i + 8 <= end && (i / 8) * B + load <= size; i += 8, out += 8) {
    std::uint64_t lo, hi = 0;
    std::memcpy(&lo, in + (i / 8) * B, 8);
    if constexpr (B > 8) { std::memcpy(&hi, in + (i / 8) * B + 8, 8); }
    [&]<unsigned... J>(std::integer_sequence<unsigned, J...>) {
      ((out[J] = static_cast<Out>(get_id<B, J>(lo, hi))), ...);
    }(std::make_integer_sequence<unsigned, 8>{});
  }
  for (; i < end; ++i) { *out++ = static_cast<Out>(unpack_one(in, size, B, i)); }
}

/// @brief Unpacks ids [first, first + count) of a packed run of `size` bytes into `out`. The caller
/// has checked that the run holds them (ceil((first + count) * bits / 8) <= size). `Out` is any
/// integer type that holds 2^bits - 1 (decoding straight into the caller's array saves a pass).
template <class Out>
inline void unpack_ids(const std::byte* in, std::size_t size, unsigned bits, std::size_t first, std::size_t count,
                       Out* out) noexcept
{
  switch (bits) {
#define RR_WIRE_UNPACK(b) case b: unpack_fixed<b, Out>(in, size, first, count, out); break;
    RR_WIRE_UNPACK(1) RR_WIRE_UNPACK(2) RR_WIRE_UNPACK(3) RR_WIRE_UNPACK(4) RR_WIRE_UNPACK(5)
    RR_WIRE_UNPACK(6) RR_WIRE_UNPACK(7) RR_WIRE_UNPACK(8) RR_WIRE_UNPACK(9) RR_WIRE_UNPACK(10)
    RR_WIRE_UNPACK(11) RR_WIRE_UNPACK(12) RR_WIRE_UNPACK(13) RR_WIRE_UNPACK(14) RR_WIRE_UNPACK(15)
    RR_WIRE_UNPACK(16)
#undef RR_WIRE_UNPACK
    default: break;
  }
}

/// @brief Writes values of up to 128 bits LSB first (the order-free form's ranks).
class bit_writer {
 public:
  /// @param out holds the run's bytes, zeroed, plus pack_slack
  explicit bit_writer(std::byte* out) noexcept : out_(out) {}

  void put(uint128 v, unsigned bits) noexcept
  {
    while (bits > 0) {
      const unsigned room = 64 - fill_;
      const unsigned n    = bits < room ? bits : room;
      const std::uint64_t part = static_cast<std::uint64_t>(v) & (n == 64 ? ~0ull : ((1ull << n) - 1));
      acc_ |= part << fill_;
      fill_ += n;
      v = n == 128 ? 0 : v >> n;
      bits -= n;
      if (fill_ == 64) { flush_word(); }
    }
  }

  /// @brief Writes what is left of the last word.
  void finish() noexcept
  {
    if (fill_ > 0) { std::memcpy(out_, &acc_, 8); }
  }

 private:
  void flush_word() noexcept
  {
    std::memcpy(out_, &acc_, 8);
    out_ += 8;
    acc_  = 0;
    fill_ = 0;
  }
  std::byte* out_;
  std::uint64_t acc_ = 0;
  unsigned fill_     = 0;
};

/// @brief Reads the value of `bits` (up to 128) at bit `bit` of a run of `size` bytes (never past it).
[[nodiscard]] inline uint128 read_bits(const std::byte* in, std::size_t size, std::size_t bit, unsigned bits) noexcept
{
  uint128 v      = 0;
  unsigned done  = 0;
  while (done < bits) {
    const std::size_t byte = (bit + done) / 8;
    const unsigned shift   = static_cast<unsigned>((bit + done) % 8);
    std::uint64_t w        = 0;
    const std::size_t n    = size - byte < 8 ? size - byte : 8;
    std::memcpy(&w, in + byte, n);
    w >>= shift;
    unsigned take = 64 - shift < bits - done ? 64 - shift : bits - done;
    if (take > 56) { take = 56; }  // a whole byte may be missing from w past the run's end
    const std::uint64_t part = take == 64 ? w : (w & ((1ull << take) - 1));
    v |= static_cast<uint128>(part) << done;
    done += take;
  }
  return v;
}

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
