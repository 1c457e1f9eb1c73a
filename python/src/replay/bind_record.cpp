/// @file
/// The binding's route records from storage (include/routing_replay/extract_record.hpp): a replay's
/// request (NativeReplay.extract_record) and the rows a SlotRows pool holds at a request's slots
/// (SlotRows.read_record), each encoded from the rows where they lie, no [T, L, K] array made. The
/// instantiations hand rows over through row_run_sink, so the encoder is compiled here, by the host
/// compiler, whichever compiler built them.
#include "bindings.hpp"
#include "slot_rows/slot_rows_bindings.hpp"

#include <routing_replay/errors.hpp>
#include <routing_replay/extract_record.hpp>
#include <routing_replay/route_record.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {
namespace {

/// Runs of one index type (erased) fed to an encoder through detail::record_feed.
class record_sink final : public row_run_sink {
 public:
  record_sink(route_record_encoder& encoder, dtype_code index, std::int64_t first_position, std::string who)
    : feed_(encoder, first_position, std::move(who)), index_(index)
  {
  }

  void rows(const void* first, std::int64_t n, std::int64_t token_stride, std::int64_t layer_stride) override
  {
    visit_dtype(index_, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (expert_index<T>) {
        feed_.rows(static_cast<const T*>(first), n, token_stride, layer_stride);
      } else {
        throw error{errc::invalid_argument, std::string{"route record: "} + dtype_name(index_) + " is not an index type"};
      }
    });
  }
  void missing(std::int64_t n) override { feed_.missing(n); }

 private:
  detail::record_feed feed_;
  dtype_code index_;
};

/// The codec of a name as routing_replay.wire spells it.
route_codec codec_of(const std::string& name)
{
  for (const route_codec c : {route_codec::packed, route_codec::zstd, route_codec::zstd_columns}) {
    if (name == route_codec_name(c)) { return c; }
  }
  throw nb::value_error(("route record: unknown codec '" + name + "' (packed, zstd, zstd_columns)").c_str());
}

route_record_options options_of(const std::string& codec, bool ordered, std::uint32_t chunk_tokens, int zstd_level)
{
  route_record_options o;
  o.codec        = codec_of(codec);
  o.ordered      = ordered;
  o.chunk_tokens = chunk_tokens;
  o.zstd_level   = zstd_level;
  return o;
}

/// The record as bytes, or as a 1-D uint8 numpy array that owns it (no copy).
nb::object record_object(std::vector<std::byte>&& record, bool as_array)
{
  if (!as_array) { return nb::bytes(reinterpret_cast<const char*>(record.data()), record.size()); }
  auto owned         = std::make_unique<std::vector<std::byte>>(std::move(record));
  const void* data   = owned->data();
  const std::size_t n = owned->size();
  nb::capsule owner(owned.release(), [](void* p) noexcept { delete static_cast<std::vector<std::byte>*>(p); });
  return make_array<nb::ndarray<nb::numpy>>(data, {n}, owner, dtype_code::u8);
}

nb::object extract_record(replay_handle& h, nb::handle id, std::int64_t start, std::int64_t end, const std::string& codec,
                          bool ordered, std::uint32_t chunk_tokens, int zstd_level, bool as_array)
{
  const request_key key = key_of(id);
  extract_options o;
  o.start_position = start;
  o.end_position   = end;
  route_record_options record_options = options_of(codec, ordered, chunk_tokens, zstd_level);
  std::vector<std::byte> record;
  {
    nb::gil_scoped_release unlocked;  // may wait for copies in flight
    const replay_config& c = h.impl->config();
    route_record_encoder encoder{static_cast<std::uint32_t>(h.impl->num_layers()), static_cast<std::uint32_t>(c.top_k),
                                 static_cast<std::uint32_t>(c.num_experts),
                                 detail::record_options_from(std::move(record_options), c.moe_layers, start,
                                                             "extract_record")};
    record_sink sink{encoder, h.impl->index_dtype(), start, "request " + key.to_string()};
    h.impl->for_each_row_run(key, o, sink);
    encoder.finish_into(record);
  }
  return record_object(std::move(record), as_array);
}

nb::object read_record(const slot_rows_handle& h, nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> slots,
                       std::int64_t first_position, std::string request, std::uint64_t wait_through,
                       const std::string& codec, bool ordered, std::uint32_t chunk_tokens, int zstd_level, bool as_array)
{
  if (slots.shape(0) > 1 && slots.stride(0) != 1) { throw nb::value_error("KV slots: expected a contiguous 1-D array"); }
  const void* data                    = slots.data();
  const dtype_code slot_dtype         = dtype_from_dlpack(slots.dtype());
  const std::size_t count             = slots.shape(0);
  route_record_options record_options = options_of(codec, ordered, chunk_tokens, zstd_level);
  slot_read_options o;
  o.first_position = first_position;
  o.request        = std::move(request);
  std::vector<std::byte> record;
  {
    nb::gil_scoped_release unlocked;
    h.impl->wait(wait_through);
    const slot_rows_config& c              = h.impl->config();
    const std::vector<std::int32_t> layers = h.impl->run_layers();
    route_record_encoder encoder{static_cast<std::uint32_t>(layers.size()), static_cast<std::uint32_t>(c.top_k),
                                 static_cast<std::uint32_t>(c.num_experts),
                                 detail::record_options_from(std::move(record_options), layers, first_position,
                                                             "read_record")};
    record_sink sink{encoder, h.impl->index_dtype(), first_position, o.request.empty() ? "the read" : o.request};
    h.impl->for_each_run(data, slot_dtype, count, sink, o);
    encoder.finish_into(record);
  }
  return record_object(std::move(record), as_array);
}

}  // namespace

void bind_records(nb::class_<replay_handle>& native)
{
  native.def("extract_record", &extract_record, "id"_a, "start"_a, "end"_a, "codec"_a, "ordered"_a, "chunk_tokens"_a,
             "zstd_level"_a, "as_array"_a,
             "The request's rows [start, end) (end -1: all recorded) as a route record, encoded from host storage "
             "where the rows lie: bytes, or a uint8 array that owns them.");
  // SlotRows is bound by bind_slot_rows(): its record read joins the class here, where the encoder is
  nb::handle slot_rows_type = nb::type<slot_rows_handle>();
  nb::setattr(slot_rows_type, "read_record",
              nb::cpp_function(&read_record, nb::scope(slot_rows_type), nb::name("read_record"), nb::is_method(),
                               "slots"_a, "first_position"_a, "request"_a, "wait_through"_a, "codec"_a, "ordered"_a,
                               "chunk_tokens"_a, "zstd_level"_a, "as_array"_a,
                               "Waits for the steps up to `wait_through`, then writes the rows at host `slots` as a "
                               "route record (the pool layers captured; slots no step wrote as missing rows), read "
                               "where they lie: bytes, or a uint8 array that owns them."));
}

}  // namespace routing_replay::python
