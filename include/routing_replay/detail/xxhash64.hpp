/// @file
/// XXH64 (xxHash, 64-bit, by Yann Collet; specification at github.com/Cyan4973/xxHash,
/// doc/xxhash_spec.md), the checksum of step packets: fast on any CPU without special instructions,
/// and available to other languages (Python's `xxhash.xxh64`) that read packets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace routing_replay::detail {

/// @brief XXH64 of `data` with `seed`.
[[nodiscard]] inline std::uint64_t xxhash64(std::span<const std::byte> data, std::uint64_t seed = 0) noexcept
{
  constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ull, p2 = 0xC2B2AE3D27D4EB4Full, p3 = 0x165667B19E3779F9ull,
                          p4 = 0x85EBCA77C2B2AE63ull, p5 = 0x27D4EB2F165667C5ull;
  auto rotl  = [](std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  auto read8 = [](const std::byte* p) { std::uint64_t v; std::memcpy(&v, p, 8); return v; };  // little-endian hosts
  auto read4 = [](const std::byte* p) { std::uint32_t v; std::memcpy(&v, p, 4); return v; };
  auto round = [&](std::uint64_t acc, std::uint64_t input) { return rotl(acc + input * p2, 31) * p1; };
  auto merge = [&](std::uint64_t acc, std::uint64_t v) { return (acc ^ round(0, v)) * p1 + p4; };

  const std::byte* p   = data.data();
  const std::byte* end = p + data.size();
  std::uint64_t h      = 0;
  if (data.size() >= 32) {
    std::uint64_t v1 = seed + p1 + p2, v2 = seed + p2, v3 = seed, v4 = seed - p1;
    for (; end - p >= 32; p += 32) {
      v1 = round(v1, read8(p));
      v2 = round(v2, read8(p + 8));
      v3 = round(v3, read8(p + 16));
      v4 = round(v4, read8(p + 24));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4);
  } else {
    h = seed + p5;
  }
  h += static_cast<std::uint64_t>(data.size());
  for (; end - p >= 8; p += 8) { h = rotl(h ^ round(0, read8(p)), 27) * p1 + p4; }
  if (end - p >= 4) {
    h = rotl(h ^ (static_cast<std::uint64_t>(read4(p)) * p1), 23) * p2 + p3;
    p += 4;
  }
  for (; p < end; ++p) { h = rotl(h ^ (static_cast<std::uint64_t>(std::to_integer<unsigned char>(*p)) * p5), 11) * p1; }
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  h ^= h >> 32;
  return h;
}

}  // namespace routing_replay::detail
