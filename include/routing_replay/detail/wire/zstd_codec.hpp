/// @file
/// The compressing codecs of a chunk: zstd over the packed bytes, and zstd over the ids transposed
/// to columns. Routing is persistent along a column (one layer's k-th choice, token after token)
/// far more than along a row, and byte-aligned planes let zstd's matcher and entropy coder see that
/// persistence; the bit-packed stream hides it behind a 7-bit phase that shifts every byte.
/// Where libzstd is not compiled in (ROUTING_REPLAY_WIRE_HAS_ZSTD == 0) the same functions exist
/// and say so, so that callers need no #if of their own.
#pragma once

#include <routing_replay/detail/wire/abi.hpp>
#include <routing_replay/detail/wire/format.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#if ROUTING_REPLAY_WIRE_HAS_ZSTD
#include <zstd.h>
#endif

namespace routing_replay::detail::wire {
ROUTING_REPLAY_WIRE_ABI_BEGIN

/// @brief Whether this build compresses and decompresses zstd chunks.
inline constexpr bool zstd_available = ROUTING_REPLAY_WIRE_HAS_ZSTD != 0;

/// @brief Bytes of one id in the column form: one plane for E <= 256, two (low, high) past that.
[[nodiscard]] constexpr std::uint32_t column_planes(std::uint32_t num_experts) noexcept
{
  return num_experts <= 256 ? 1u : 2u;
}

/// @brief Transposes ids [tokens][columns] (columns = L * K) into byte planes [plane][column][token].
inline void to_columns(const std::uint16_t* ids, std::size_t tokens, std::size_t columns, std::uint32_t planes,
                       std::byte* out) noexcept
{
  const std::size_t plane = tokens * columns;
  for (std::size_t t = 0; t < tokens; ++t) {
    const std::uint16_t* row = ids + t * columns;
    for (std::size_t c = 0; c < columns; ++c) {
      out[c * tokens + t] = static_cast<std::byte>(row[c] & 0xff);
      if (planes == 2) { out[plane + c * tokens + t] = static_cast<std::byte>(row[c] >> 8); }
    }
  }
}

/// @brief The id of token t, column c in the column form of a chunk of `tokens` tokens.
[[nodiscard]] inline std::uint16_t column_id(const std::byte* planes_data, std::size_t tokens, std::size_t columns,
                                             std::uint32_t planes, std::size_t t, std::size_t c) noexcept
{
  auto v = static_cast<std::uint16_t>(planes_data[c * tokens + t]);
  if (planes == 2) { v |= static_cast<std::uint16_t>(static_cast<std::uint16_t>(planes_data[tokens * columns + c * tokens + t]) << 8); }
  return v;
}

#if ROUTING_REPLAY_WIRE_HAS_ZSTD
/// @brief A zstd compression context kept across chunks (creating one costs more than a chunk).
class zstd_compressor {
 public:
  explicit zstd_compressor(int level) : level_(level) {}

  /// @brief Compresses `size` bytes into `out` (resized to the frame); false where zstd fails.
  bool compress(const std::byte* in, std::size_t size, std::vector<std::byte>& out)
  {
    if (!ctx_) { ctx_.reset(ZSTD_createCCtx()); }
    out.resize(ZSTD_compressBound(size));
    const std::size_t n = ZSTD_compressCCtx(ctx_.get(), out.data(), out.size(), in, size, level_);
    if (ZSTD_isError(n)) { return false; }
    out.resize(n);
    return true;
  }

 private:
  struct free_ctx {
    void operator()(ZSTD_CCtx* c) const noexcept { ZSTD_freeCCtx(c); }
  };
  std::unique_ptr<ZSTD_CCtx, free_ctx> ctx_;
  int level_;
};

/// @brief Decompresses one chunk's frame into exactly `expected` bytes.
class zstd_decompressor {
 public:
  /// @throws error invalid_record where the frame is not one of exactly `expected` bytes
  void decompress(const std::byte* in, std::size_t size, std::size_t expected, std::byte* out, std::uint32_t chunk)
  {
    // The frame states its size: check it before decompressing anything, so that a forged frame
    // cannot make us produce (or allocate for) more than the chunk holds.
    const unsigned long long stated = ZSTD_getFrameContentSize(in, size);
    if (stated != expected) {
      bad_record("chunk " + std::to_string(chunk) + ": zstd frame of " +
                 (stated == ZSTD_CONTENTSIZE_ERROR || stated == ZSTD_CONTENTSIZE_UNKNOWN ? std::string{"unknown"}
                                                                                         : std::to_string(stated)) +
                 " bytes, the chunk has " + std::to_string(expected));
    }
    if (!ctx_) { ctx_.reset(ZSTD_createDCtx()); }
    const std::size_t n = ZSTD_decompressDCtx(ctx_.get(), out, expected, in, size);
    if (ZSTD_isError(n) || n != expected) {
      bad_record("chunk " + std::to_string(chunk) + ": zstd: " +
                 (ZSTD_isError(n) ? std::string{ZSTD_getErrorName(n)} : "short frame"));
    }
  }

 private:
  struct free_ctx {
    void operator()(ZSTD_DCtx* c) const noexcept { ZSTD_freeDCtx(c); }
  };
  std::unique_ptr<ZSTD_DCtx, free_ctx> ctx_;
};
#else
/// @brief Stand-in where libzstd is not compiled in: compresses nothing (chunks stay packed).
class zstd_compressor {
 public:
  explicit zstd_compressor(int) {}
  bool compress(const std::byte*, std::size_t, std::vector<std::byte>&) { return false; }
};

/// @brief Stand-in where libzstd is not compiled in: refuses every zstd chunk, saying why.
class zstd_decompressor {
 public:
  [[noreturn]] void decompress(const std::byte*, std::size_t, std::size_t, std::byte*, std::uint32_t chunk)
  {
    bad_record("chunk " + std::to_string(chunk) +
               " is zstd-compressed, and this build has no zstd (link routing_replay::zstd, or build the Python "
               "package where libzstd is installed)");
  }
};
#endif

ROUTING_REPLAY_WIRE_ABI_END
}  // namespace routing_replay::detail::wire
