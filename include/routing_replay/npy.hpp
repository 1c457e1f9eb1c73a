/// @file
/// Output formats: NumPy .npy files and base64(.npy), the wire format of vLLM's OpenAI API field
/// `routed_experts`. numpy.load reads both back bit-exact, shape and dtype included.
#pragma once

#include <routing_replay/errors.hpp>
#include <routing_replay/index_type.hpp>
#include <routing_replay/routed_experts.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace routing_replay {

namespace detail {

/// @brief The numpy dtype descriptor of an expert_index type: '|u1', '<i2', '<u2', '<i4'...
template <expert_index Index>
[[nodiscard]] constexpr std::string_view npy_descr() noexcept
{
  static_assert(std::endian::native == std::endian::little,
                "the .npy writer emits little-endian descriptors");
  constexpr bool s = std::is_signed_v<Index>;
  if constexpr (sizeof(Index) == 1) { return s ? "|i1" : "|u1"; }
  if constexpr (sizeof(Index) == 2) { return s ? "<i2" : "<u2"; }
  if constexpr (sizeof(Index) == 4) { return s ? "<i4" : "<u4"; }
}

}  // namespace detail

/// @brief Serializes a C-order array of the given shape as a .npy file (format version 1.0).
///
/// The header is padded so the data starts at a multiple of 64 bytes, as numpy itself writes.
/// @throws error invalid_argument if `data` does not hold the product of `shape` elements
template <expert_index Index>
[[nodiscard]] std::string to_npy(std::span<const Index> data, std::span<const std::int64_t> shape)
{
  std::int64_t elems = 1;
  std::string dims;  // Python tuple syntax: "(T, L, K)", and "(T,)" for one dimension
  for (std::size_t i = 0; i < shape.size(); ++i) {
    elems *= shape[i];
    dims += (i == 0 ? "" : ", ") + std::to_string(shape[i]);
  }
  if (shape.size() == 1) { dims += ","; }
  if (static_cast<std::int64_t>(data.size()) != elems) {
    throw error{errc::invalid_argument,
                "to_npy: " + std::to_string(data.size()) + " elements do not fill shape (" + dims + ")"};
  }
  std::string header = "{'descr': '" + std::string{detail::npy_descr<Index>()} +
                       "', 'fortran_order': False, 'shape': (" + dims + "), }";
  constexpr std::size_t preamble = 10;  // magic (6) + version (2) + header length (2)
  const std::size_t unpadded     = preamble + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');

  std::string out;
  out.reserve(preamble + header.size() + data.size_bytes());
  out.append("\x93NUMPY", 6);
  out.push_back('\x01');
  out.push_back('\x00');
  out.push_back(static_cast<char>(header.size() & 0xFF));
  out.push_back(static_cast<char>((header.size() >> 8) & 0xFF));
  out.append(header);
  out.append(reinterpret_cast<const char*>(data.data()), data.size_bytes());
  return out;
}

/// @brief Serializes an extraction as a .npy file of shape [T, layers, K].
template <expert_index Index>
[[nodiscard]] std::string to_npy(const routed_experts<Index>& rows)
{
  const std::int64_t shape[3] = {rows.num_rows(), rows.num_layers(), rows.top_k()};
  return to_npy<Index>(rows.flat(), shape);
}

/// @brief Characters of the base64 (RFC 4648, padded) of `bytes` bytes.
[[nodiscard]] constexpr std::size_t base64_size(std::size_t bytes) noexcept { return (bytes + 2) / 3 * 4; }

/// @brief Writes standard base64 (RFC 4648, with padding) of `bytes` bytes at `in` to `out`
/// (base64_size(bytes) characters, no terminator). Pieces of a byte stream whose sizes, but the
/// last, are multiples of 3 encode to the pieces of its encoding, so a stream can be written in parts.
inline void base64_encode_to(const unsigned char* in, std::size_t bytes, char* out) noexcept
{
  static constexpr char alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::size_t i = 0;
  for (; i + 3 <= bytes; i += 3) {
    const auto b = (std::uint32_t{in[i]} << 16) | (std::uint32_t{in[i + 1]} << 8) | std::uint32_t{in[i + 2]};
    *out++ = alphabet[(b >> 18) & 63];
    *out++ = alphabet[(b >> 12) & 63];
    *out++ = alphabet[(b >> 6) & 63];
    *out++ = alphabet[b & 63];
  }
  if (const std::size_t rest = bytes - i; rest != 0) {
    std::uint32_t b = std::uint32_t{in[i]} << 16;
    if (rest == 2) { b |= std::uint32_t{in[i + 1]} << 8; }
    *out++ = alphabet[(b >> 18) & 63];
    *out++ = alphabet[(b >> 12) & 63];
    *out++ = rest == 2 ? alphabet[(b >> 6) & 63] : '=';
    *out   = '=';
  }
}

/// @brief Standard base64 (RFC 4648, with padding) of arbitrary bytes.
[[nodiscard]] inline std::string base64_encode(std::string_view bytes)
{
  std::string out(base64_size(bytes.size()), '\0');
  base64_encode_to(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), out.data());
  return out;
}

/// @brief The `routed_experts` field of vLLM's OpenAI-compatible API: base64 of the .npy file.
template <expert_index Index>
[[nodiscard]] std::string to_base64_npy(const routed_experts<Index>& rows)
{
  return base64_encode(to_npy(rows));
}

/// @brief Writes an extraction to a .npy file.
/// @throws error invalid_argument if the file cannot be written
template <expert_index Index>
void write_npy(const std::string& path, const routed_experts<Index>& rows)
{
  const std::string bytes = to_npy(rows);
  std::ofstream file{path, std::ios::binary | std::ios::trunc};
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) { throw error{errc::invalid_argument, "write_npy: cannot write " + path}; }
}

}  // namespace routing_replay
