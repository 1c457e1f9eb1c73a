/// @file
/// routing_replay._core._wire: the route record (include/routing_replay/route_record.hpp) for
/// numpy. encode() reads any integer [T, L, K] array through its strides, with the GIL released,
/// straight into the encoder (no [T, L, K] copy); decode_into() writes a token and layer range into
/// the caller's array; info() reads the header. The Python layer (routing_replay/wire.py) turns
/// positions into rows, picks dtypes and converts the engines' own fields.
#include "../bindings.hpp"

#include <routing_replay/route_record.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {
namespace {

using record_bytes = nb::ndarray<nb::ro, const std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

route_codec codec_of(const std::string& name)
{
  for (const route_codec c : {route_codec::packed, route_codec::zstd, route_codec::zstd_columns}) {
    if (name == route_codec_name(c)) { return c; }
  }
  throw nb::value_error(("unknown codec '" + name + "': want packed, zstd or zstd_columns").c_str());
}

std::span<const std::byte> span_of(const record_bytes& b)
{
  return {reinterpret_cast<const std::byte*>(b.data()), b.shape(0)};
}

/// Calls f(static_cast<T*>(nullptr)) with the C++ integer type of `code`.
template <class F>
decltype(auto) with_integer(dtype_code code, F&& f)
{
  switch (code) {
    case dtype_code::i8: return f(static_cast<std::int8_t*>(nullptr));
    case dtype_code::u8: return f(static_cast<std::uint8_t*>(nullptr));
    case dtype_code::i16: return f(static_cast<std::int16_t*>(nullptr));
    case dtype_code::u16: return f(static_cast<std::uint16_t*>(nullptr));
    case dtype_code::i32: return f(static_cast<std::int32_t*>(nullptr));
    case dtype_code::u32: return f(static_cast<std::uint32_t*>(nullptr));
    case dtype_code::i64: return f(static_cast<std::int64_t*>(nullptr));
    case dtype_code::u64: return f(static_cast<std::uint64_t*>(nullptr));
  }
  throw nb::type_error("routing ids must be integers");
}

/// The sentinel of a dtype as the library defines it: -1 signed, the maximum unsigned.
template <class T>
T sentinel_of() noexcept
{
  return std::is_signed_v<T> ? static_cast<T>(-1) : std::numeric_limits<T>::max();
}

// Each thread keeps the encoder of its last shape and options (the zstd context, the chunk staging
// and the payload buffer with it), so that a record costs no allocation but its bytes object: an
// encoder made and dropped every call handed glibc ~1.7 MB to free per record, which pushed the
// top of its heap past the trim threshold (twice the ~1.4 MB mmap threshold a record's first
// buffers set), so every call trimmed and faulted its buffers in again (~700 page faults a record
// of Qwen3-30B-A3B's shape, more time in the kernel than in the encoder).
struct encoder_key {
  std::uint32_t layers = 0, top_k = 0, experts = 0;
  route_codec codec = route_codec::packed;
  bool ordered      = true;
  int zstd_level    = 3;
  std::vector<std::uint32_t> layer_map;
  bool operator==(const encoder_key&) const = default;
};

struct cached_encoder {
  encoder_key key;
  std::optional<route_record_encoder> enc;
};

/// An encoder past this much memory is not kept for the next record.
constexpr std::size_t kept_encoder_bytes = std::size_t{64} << 20;

route_record_encoder& encoder_for(cached_encoder& cache, const encoder_key& key, std::int64_t token_start)
{
  if (!cache.enc || !(cache.key == key)) {
    cache.enc.reset();
    route_record_options options;
    options.layer_map  = key.layer_map;
    options.codec      = key.codec;
    options.ordered    = key.ordered;
    options.zstd_level = key.zstd_level;
    cache.enc.emplace(key.layers, key.top_k, key.experts, std::move(options));
    cache.key = key;
  }
  cache.enc->set_token_start(token_start);
  return *cache.enc;
}

nb::bytes new_bytes(std::size_t size)
{
  PyObject* bytes = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
  if (bytes == nullptr) { throw nb::python_error(); }
  return nb::steal<nb::bytes>(bytes);
}

std::span<std::byte> span_of(nb::bytes& b)
{
  return {reinterpret_cast<std::byte*>(PyBytes_AS_STRING(b.ptr())), static_cast<std::size_t>(PyBytes_GET_SIZE(b.ptr()))};
}

template <class Append>
nb::bytes encode_with(cached_encoder& cache, const encoder_key& key, std::int64_t token_start, std::uint32_t tokens,
                      Append& append);

nb::bytes encode(nb::ndarray<nb::ro, nb::ndim<3>, nb::device::cpu> rows, std::uint32_t num_experts,
                 std::int64_t token_start, std::optional<std::vector<std::uint32_t>> layer_map, const std::string& codec,
                 bool ordered, bool missing_rows, int zstd_level)
{
  const auto code = integer_dtype_code(rows.dtype());
  if (!code) { throw nb::type_error("encode: rows must be an integer array (int8 to int64, uint8 to uint64)"); }
  if (rows.shape(0) > 0x7fffffffu) { throw nb::value_error("encode: more than 2^31 - 1 rows"); }
  if (rows.size() > 0 && rows.shape(2) > 1 && rows.stride(2) != 1) {
    throw nb::value_error("encode: the K ids of an entry must be contiguous (rows.strides[2] == itemsize)");
  }
  encoder_key key{static_cast<std::uint32_t>(rows.shape(1)), static_cast<std::uint32_t>(rows.shape(2)), num_experts,
                  codec_of(codec), ordered, zstd_level, layer_map ? std::move(*layer_map) : std::vector<std::uint32_t>{}};
  thread_local cached_encoder cache;
  const auto tokens = static_cast<std::uint32_t>(rows.shape(0));
  auto append = [&](route_record_encoder& enc) {
    with_integer(*code, [&]<class T>(T*) {
      const auto* base = static_cast<const T*>(rows.data());
      enc.append<T>(base, rows.shape(0), rows.stride(0), rows.stride(1),
                    missing_rows ? std::optional<T>{sentinel_of<T>()} : std::nullopt);
    });
  };
  // whatever throws, the kept encoder goes: it may hold rows of this call
  try {
    return encode_with(cache, key, token_start, tokens, append);
  } catch (...) {
    cache.enc.reset();
    throw;
  }
}

template <class Append>
nb::bytes encode_with(cached_encoder& cache, const encoder_key& key, std::int64_t token_start, std::uint32_t tokens,
                      Append& append)
{
  route_record_encoder* enc = nullptr;
  {
    nb::gil_scoped_release release;
    enc = &encoder_for(cache, key, token_start);
  }
  // The packed codec's size is known before the rows are read (unless a row is missing): the
  // record is packed straight into the bytes object returned, at its final place, never copied.
  // Other codecs (and a record with missing rows) finish from the encoder's buffers into it.
  nb::bytes result;
  std::size_t size = 0;
  if (key.codec == route_codec::packed) {
    result = new_bytes(enc->packed_record_size(tokens));
    nb::gil_scoped_release release;
    enc->write_into(span_of(result), tokens);
    append(*enc);
    size = enc->finished_size();
    if (size == span_of(result).size()) { enc->finish_into(span_of(result)); }
  } else {
    nb::gil_scoped_release release;
    enc->reserve(tokens);
    append(*enc);
    size = enc->finished_size();
  }
  if (!result.is_valid() || size != span_of(result).size()) {
    nb::bytes exact = new_bytes(size);  // (a missing row: the encoder took the chunks back)
    nb::gil_scoped_release release;
    enc->finish_into(span_of(exact));
    result = std::move(exact);
  }
  if (enc->capacity_bytes() > kept_encoder_bytes) { cache.enc.reset(); }
  return result;
}

nb::dict info(const record_bytes& record)
{
  const route_record_reader r{span_of(record)};
  nb::dict d;
  d["version"]       = r.version();
  d["num_tokens"]    = r.num_tokens();
  d["num_layers"]    = r.num_layers();
  d["top_k"]         = r.top_k();
  d["num_experts"]   = r.num_experts();
  d["token_start"]   = r.token_start();
  d["bits_per_id"]   = r.bits_per_id();
  d["entry_bits"]    = r.entry_bits();
  d["ordered"]       = r.ordered();
  d["codec"]         = route_codec_name(r.codec());
  d["chunk_tokens"]  = r.chunk_tokens();
  d["num_chunks"]    = r.num_chunks();
  d["missing_rows"]  = r.missing_rows();
  d["record_bytes"]  = r.size_bytes();
  d["payload_bytes"] = r.payload_bytes();
  d["layer_map"]     = std::vector<std::uint32_t>(r.layer_map().begin(), r.layer_map().end());
  nb::list codecs;
  for (std::uint32_t c = 0; c < r.num_chunks(); ++c) { codecs.append(route_codec_name(r.chunk(c).codec)); }
  d["chunk_codecs"] = codecs;
  return d;
}

void decode_into(const record_bytes& record, nb::ndarray<nb::ndim<3>, nb::device::cpu> out, std::uint32_t token_begin,
                 std::uint32_t token_end, std::uint32_t layer_begin, std::uint32_t layer_end)
{
  const auto code = integer_dtype_code(out.dtype());
  if (!code) { throw nb::type_error("decode: out must be an integer array"); }
  const route_record_reader r{span_of(record)};
  if (out.shape(0) != token_end - token_begin || out.shape(1) != layer_end - layer_begin || out.shape(2) != r.top_k()) {
    throw nb::value_error(("decode: out has shape (" + std::to_string(out.shape(0)) + ", " + std::to_string(out.shape(1)) +
                           ", " + std::to_string(out.shape(2)) + "), the range needs (" +
                           std::to_string(token_end - token_begin) + ", " + std::to_string(layer_end - layer_begin) +
                           ", " + std::to_string(r.top_k()) + ")")
                            .c_str());
  }
  if (out.size() == 0) { return; }  // an empty range (whose strides DLPack may not state)
  if (out.shape(2) > 1 && out.stride(2) != 1) { throw nb::value_error("decode: out's last axis must be contiguous"); }
  nb::gil_scoped_release release;
  with_integer(*code, [&]<class T>(T*) {
    r.decode<T>(token_begin, token_end, layer_begin, layer_end, static_cast<T*>(out.data()), out.stride(0), out.stride(1),
                sentinel_of<T>());
  });
}

void verify(const record_bytes& record)
{
  const route_record_reader r{span_of(record)};
  nb::gil_scoped_release release;
  r.verify();
}

}  // namespace

void bind_wire(nb::module_& m)
{
  nb::module_ w = m.def_submodule("_wire", "the route record's native code (routing_replay.wire is its interface)");
  w.def("encode", &encode, "rows"_a, "num_experts"_a, "token_start"_a, "layer_map"_a.none(), "codec"_a, "ordered"_a,
        "missing_rows"_a, "zstd_level"_a,
        "A route record of an integer [T, L, K] array; missing_rows: rows all of the dtype's sentinel are missing");
  w.def("info", &info, "record"_a, "The header's fields of a record (checked: header, index, bitmap, checksum)");
  w.def("decode_into", &decode_into, "record"_a, "out"_a, "token_begin"_a, "token_end"_a, "layer_begin"_a,
        "layer_end"_a, "Rows [token_begin, token_end) (from row 0) and layers [layer_begin, layer_end) into out");
  w.def("verify", &verify, "record"_a, "Checks every chunk: checksum, frame, ids < E");
  nb::list codecs;
  codecs.append("packed");
  if (route_record_has_zstd) {
    codecs.append("zstd");
    codecs.append("zstd_columns");
  }
  w.attr("CODECS")  = nb::tuple(codecs);
  w.attr("VERSION") = route_record_version;
}

}  // namespace routing_replay::python
