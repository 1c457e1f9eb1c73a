/// @file
/// Stores that go around the cache, for metadata a step writes in bulk and nobody reads soon.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>  // _mm_stream_si64 (SSE2), _mm_sfence (SSE)
#define ROUTING_REPLAY_STREAMING_STORES 1
#else
#define ROUTING_REPLAY_STREAMING_STORES 0
#endif

namespace routing_replay::detail {

/// @brief Writes the object representation `words` (8-byte words, in memory order) to `dst` with
/// non-temporal stores where the processor has them (x86-64: MOVNTI, a word at a time), else with
/// plain stores.
///
/// A plain store to a line not in the cache first reads the line from memory (read for ownership).
/// A prefill chunk writes thousands of position entries in pages not touched since they were
/// made, none of which is read before the request is extracted: written around the cache, they
/// cost neither that read nor the cache lines they would evict. The caller builds the words in
/// registers: an object built in memory and reloaded as words stalls each load on the narrower
/// stores it waits for (store forwarding fails). Follow a run of these stores with
/// streaming_stores_done() before anything else could read them from another thread.
/// @tparam T trivially copyable, a whole number of 8-byte words, 8-byte aligned
template <class T>
[[gnu::always_inline]] inline void store_streaming(T& dst, const std::array<std::uint64_t, sizeof(T) / 8>& words) noexcept
{
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 8 == 0 && alignof(T) >= 8);
#if ROUTING_REPLAY_STREAMING_STORES
  auto* const out = reinterpret_cast<long long*>(&dst);
  for (std::size_t w = 0; w < words.size(); ++w) { _mm_stream_si64(out + w, static_cast<long long>(words[w])); }
#else
  std::memcpy(static_cast<void*>(&dst), words.data(), sizeof(T));
#endif
}

/// @brief Copies `bytes` from `src` to `dst` around the cache where the processor can (x86-64, both
/// 16-byte aligned, a whole number of 16-byte words: MOVNTDQ), else with memcpy. For rows written
/// now and read later by another thread (a request's tail, stored when its block is full): a plain
/// store reads each destination line first. Follow with streaming_stores_done().
inline void copy_streaming(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept
{
#if ROUTING_REPLAY_STREAMING_STORES
  if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) | bytes) & 15u) == 0) {
    auto* out      = reinterpret_cast<__m128i*>(dst);
    const auto* in = reinterpret_cast<const __m128i*>(src);
    for (std::size_t w = 0; w < bytes / 16; ++w) { _mm_stream_si128(out + w, _mm_load_si128(in + w)); }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

/// @brief Orders the non-temporal stores made so far before every later store (x86-64: SFENCE),
/// so that a thread that synchronizes with this one afterwards sees them. The writing thread
/// sees its own stores in any case.
[[gnu::always_inline]] inline void streaming_stores_done() noexcept
{
#if ROUTING_REPLAY_STREAMING_STORES
  _mm_sfence();
#endif
}

}  // namespace routing_replay::detail
