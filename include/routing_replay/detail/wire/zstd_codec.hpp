/// @file
/// The compressing codecs of a chunk: zstd over the packed bytes, and zstd over the ids transposed
/// to columns, one per captured layer (its entries token after token). Routing persists along a
/// layer's column (an entry repeats the previous token's) and each layer has its own popular
/// experts; in a layer's column those repeats are short-distance matches and the popular ids sit
/// together, both of which zstd codes cheaply, in whole bytes that the packed stream's 7-bit phase
/// would hide from its entropy coder.
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

/// @brief Bytes of one id in the column form: one for E <= 256, two (little-endian) past that.
[[nodiscard]] constexpr std::uint32_t column_bytes(std::uint32_t num_experts) noexcept
{
  return num_experts <= 256 ? 1u : 2u;
}

/// @brief Transposes a chunk's ids [tokens][L][K] to the column form [L][tokens][K]: each captured
/// layer's entries token after token, at column_bytes bytes an id. An entry that repeats the
/// previous token's is then K equal ids one entry back, and a layer's popular experts sit together:
/// the two structures routing has.
inline void to_columns(const std::uint16_t* ids, std::size_t tokens, std::size_t layers, std::size_t top_k,
                       std::uint32_t width, std::byte* out) noexcept
{
  for (std::size_t t = 0; t < tokens; ++t) {
    for (std::size_t l = 0; l < layers; ++l) {
      const std::uint16_t* entry = ids + (t * layers + l) * top_k;
      std::byte* dst             = out + (l * tokens + t) * top_k * width;
      for (std::size_t k = 0; k < top_k; ++k) {
        if (width == 1) {
          dst[k] = static_cast<std::byte>(entry[k]);
        } else {
          dst[2 * k]     = static_cast<std::byte>(entry[k] & 0xff);
          dst[2 * k + 1] = static_cast<std::byte>(entry[k] >> 8);
        }
      }
    }
  }
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
