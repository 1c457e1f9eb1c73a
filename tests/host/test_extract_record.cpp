// Route records written straight from storage (extract_record.hpp): for every index type, layout
// and host storage, and for slot_rows pools, the record from storage is byte for byte the record
// encoded from the extracted array (sentinel rows as missing) with the first position and layer map
// of the read; slices, missing rows (prefix hits, stale blocks, slots no step wrote), chunk
// boundaries, the order-free form, the zstd codecs (where libzstd is linked), and what a record from
// storage refuses.
#include "../support/policy_combinations.hpp"
#include "../support/small_replay.hpp"

#include <routing_replay/extract_record.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/route_record.hpp>
#include <routing_replay/slot_rows.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace rr = routing_replay;

namespace {

using rr_test::small_replay;

template <class Index>
std::vector<std::byte> encode_array(const rr::routed_experts<Index>& rows, std::uint32_t layers, std::uint32_t k,
                                    std::uint32_t experts, rr::route_record_options options)
{
  rr::route_record_encoder encoder{layers, k, experts, std::move(options)};
  encoder.append(rows.flat().data(), static_cast<std::size_t>(rows.num_rows()), static_cast<std::ptrdiff_t>(layers * k),
                 static_cast<std::ptrdiff_t>(k), std::optional<Index>{rr::index_traits<Index>::sentinel});
  return encoder.finish();
}

// Request 1: positions 0, 1 a prefix hit (no rows here), 2..13 computed in three steps at slots
// that jump from block 1 to block 3; with block-slot storage request 2 then takes block 3 afresh,
// so positions 8..11 of request 1 go stale.
template <class RR>
void run_schedule(small_replay<RR>& s)
{
  const std::vector<std::int64_t> cached{0, 1};
  s.rr().add_request(1, {.prompt_length = 6, .cached_slots = cached});
  const std::vector<std::vector<std::int64_t>> slots{{2, 3, 4, 5}, {6, 7, 12, 13, 14, 15}, {16, 17}};
  std::int64_t position = 2;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    rr::step_plan plan;
    plan.schedule({.id = 1, .first_position = position, .num_tokens = static_cast<std::int32_t>(slots[i].size()),
                   .slots = slots[i]});
    s.step(plan, static_cast<std::int64_t>(i));
    position += static_cast<std::int64_t>(slots[i].size());
  }
  if constexpr (RR::storage_type::name == std::string_view{"block_slot"}) {
    s.rr().add_request(2);
    const std::vector<std::int64_t> fresh{3};
    const std::vector<std::int64_t> other{12, 13};
    rr::step_plan plan;
    plan.schedule({.id = 2, .first_position = 0, .num_tokens = 2, .slots = other});
    plan.add_fresh_blocks(fresh);
    s.step(plan, 9);
  }
  s.rr().drain();
}

template <class RR>
void check_records_equal_encoded_extractions()
{
  using index = typename RR::index_type;
  small_replay<RR> s;
  run_schedule(s);
  const bool block_slot = RR::storage_type::name == std::string_view{"block_slot"};
  struct slice {
    std::int64_t start, end;
  };
  for (const slice sl : {slice{0, -1}, slice{3, 9}, slice{0, 2}, slice{5, 5}, slice{8, 14}, slice{13, -1}, slice{1, 7}}) {
    struct form {
      bool ordered;
      std::uint32_t chunk;
      rr::route_codec codec;
    };
    std::vector<form> forms{{true, 256, rr::route_codec::packed}, {true, 3, rr::route_codec::packed},
                            {false, 4, rr::route_codec::packed}};
    if constexpr (rr::route_record_has_zstd) {  // the compressing codecs, where the build links libzstd
      forms.push_back({true, 5, rr::route_codec::zstd});
      forms.push_back({true, 256, rr::route_codec::zstd_columns});
    }
    for (const auto& [ordered, chunk, codec] : forms) {
      CAPTURE(sl.start);
      CAPTURE(sl.end);
      CAPTURE(chunk);
      const rr::extract_options options{.start_position = sl.start, .end_position = sl.end};
      const rr::route_record_options record{.codec = codec, .ordered = ordered, .chunk_tokens = chunk};
      const auto rows = s.rr().extract(1, options);
      rr::route_record_options expected_options = record;
      expected_options.token_start             = sl.start;
      expected_options.layer_map               = {1, 2};
      const std::vector<std::byte> expected    = encode_array(rows, 2, 2, 8, expected_options);
      std::vector<std::byte> got{std::byte{7}};  // overwritten whole
      const std::size_t size = rr::extract_record_into(s.rr(), 1, got, options, record);
      CHECK(size == got.size());
      CHECK(got == expected);
      CHECK(rr::extract_record(s.rr(), 1, options, record) == expected);

      const rr::route_record_reader reader{got};
      CHECK(reader.token_start() == sl.start);
      CHECK(reader.num_tokens() == static_cast<std::uint32_t>(rows.num_rows()));
      CHECK(reader.layer_map()[0] == 1);
      CHECK(reader.layer_map()[1] == 2);
      CHECK(reader.missing_rows() == static_cast<std::uint32_t>(rows.count_missing_rows()));
      if (ordered) {
        const auto decoded = reader.template decode_all<index>(rr::index_traits<index>::sentinel);
        CHECK(std::vector<index>(rows.flat().begin(), rows.flat().end()) == decoded);
      }
    }
  }
  // positions 0, 1 are missing in both storages; 8..11 are stale with block-slot storage
  const std::vector<std::byte> record = rr::extract_record(s.rr(), 1);
  const rr::route_record_reader whole{record};
  CHECK(whole.missing_rows() == (block_slot ? 6u : 2u));
  CHECK_FALSE(whole.row_present(0));
  CHECK(whole.row_present(2));
  CHECK(whole.row_present(8) == !block_slot);
}

template <class F>
rr::errc code_of(F&& f)
{
  try {
    f();
  } catch (const rr::error& e) {
    return e.code();
  }
  FAIL("no error");
  return rr::errc::invalid_state;
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("extract_record: the record from storage is the encoded extraction", RR, records_from_storage)
{
  check_records_equal_encoded_extractions<RR>();
}
TEST_CASE_TEMPLATE_APPLY(records_from_storage, rr_test::all_combinations<rr::host_backend, rr::sync_copy>);
// rows a kernel writes (device scatter) live in pinned memory: the same reads
TEST_CASE_TEMPLATE_APPLY(records_from_storage,
                         rr_test::storages<rr::host_backend, rr::device_scatter<2>, std::uint16_t, rr::token_major>);

TEST_CASE("extract_record: what a record from storage refuses")
{
  using replay = rr::RoutingReplay<rr::host_backend, std::int16_t>;
  small_replay<replay> s;
  run_schedule(s);
  std::vector<std::byte> out;
  CHECK(code_of([&] { rr::extract_record_into(s.rr(), 1, out, {.include_dense_layers = true}); }) ==
        rr::errc::invalid_argument);
  CHECK(code_of([&] { rr::extract_record_into(s.rr(), 1, out, {}, {.token_start = 3}); }) == rr::errc::invalid_argument);
  CHECK(code_of([&] { rr::extract_record_into(s.rr(), 1, out, {}, {.layer_map = {1, 2}}); }) ==
        rr::errc::invalid_argument);
  CHECK(code_of([&] { rr::extract_record_into(s.rr(), 1, out, {.start_position = 3, .end_position = 20}); }) ==
        rr::errc::position_out_of_range);
  CHECK(code_of([&] { rr::extract_record_into(s.rr(), 7, out); }) == rr::errc::unknown_request);
  CHECK(out.empty());
}

TEST_CASE("extract_record: for_each_row_run hands rows over where they lie, missing runs as counts")
{
  using replay = rr::RoutingReplay<rr::host_backend, std::uint8_t, rr::layer_major, rr::sync_copy, rr::block_slot_storage>;
  small_replay<replay> s;
  run_schedule(s);
  std::vector<std::string> runs;
  const auto range = s.rr().for_each_row_run(
    1, {.start_position = 1},
    [&](const std::uint8_t* rows, std::int64_t n) {
      CHECK(rows != nullptr);
      runs.push_back("rows " + std::to_string(n));
    },
    [&](std::int64_t n) { runs.push_back("missing " + std::to_string(n)); });
  CHECK(range.first_position == 1);
  CHECK(range.end_position == 14);
  // 1 missing, 2..7 at slots 2..7 (one run), 8..11 stale, 12..13 at slots 16..17
  CHECK(runs == std::vector<std::string>{"missing 1", "rows 6", "missing 4", "rows 2"});
}

namespace {

constexpr std::int32_t pool_layers = 5;  // model layers 0..4
constexpr std::int32_t pool_k      = 2;
constexpr std::int32_t pool_e      = 300;

std::int64_t pool_id(std::int64_t slot, std::int32_t layer, std::int32_t column)
{
  return (slot * 7 + layer * 13 + column * 3) % pool_e;
}

// A slot_rows pool of 64 slots with `captured` layers written at `written` slots.
template <class Index>
struct pool {
  pool(const std::vector<std::int32_t>& captured, const std::vector<std::int64_t>& written) : rows(config())
  {
    const auto n = static_cast<std::int64_t>(written.size());
    for (const std::int32_t layer : captured) {
      auto& ids = kept.emplace_back(static_cast<std::size_t>(n * pool_k));
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int32_t c = 0; c < pool_k; ++c) {
          ids[static_cast<std::size_t>(r * pool_k + c)] = pool_id(written[static_cast<std::size_t>(r)], layer, c);
        }
      }
      rows.capture(layer, ids.data(), n, compute.ref());
    }
    auto& s = kept.emplace_back(written);
    const std::uint64_t serial = rows.end_step(s.data(), n, compute.ref());
    rows.wait(serial);
    rows.throw_failure(serial);
  }

  static rr::slot_rows_config config()
  {
    rr::slot_rows_config c;
    c.num_experts         = pool_e;
    c.top_k               = pool_k;
    c.max_tokens_per_step = 16;
    c.num_model_layers    = pool_layers;
    c.num_slots           = 64;
    c.steps_in_flight     = 2;
    return c;
  }

  std::vector<std::vector<std::int64_t>> kept;
  rr::host_stream compute;
  rr::slot_rows<rr::host_backend, Index> rows;
};

// The record of the rows at `slots` as an encoder reads them from an array: `captured` layers of
// slots in `written`, missing rows elsewhere.
std::vector<std::byte> expected_pool_record(const std::vector<std::int32_t>& captured, const std::vector<std::int64_t>& written,
                                            const std::vector<std::int64_t>& slots, std::int64_t first, std::uint32_t chunk)
{
  rr::route_record_options options{.token_start = first, .chunk_tokens = chunk};
  options.layer_map.assign(captured.begin(), captured.end());
  rr::route_record_encoder encoder{static_cast<std::uint32_t>(captured.size()), pool_k, pool_e, options};
  for (const std::int64_t slot : slots) {
    if (std::find(written.begin(), written.end(), slot) == written.end()) {
      encoder.append_missing(1);
      continue;
    }
    std::vector<std::int32_t> row;
    for (const std::int32_t layer : captured) {
      for (std::int32_t c = 0; c < pool_k; ++c) { row.push_back(static_cast<std::int32_t>(pool_id(slot, layer, c))); }
    }
    encoder.append(row.data(), 1, static_cast<std::ptrdiff_t>(row.size()), pool_k);
  }
  return encoder.finish();
}

}  // namespace

TEST_CASE_TEMPLATE("read_record_into: a slot pool's rows at a request's slots, captured layers only", Index,
                   std::uint16_t, std::int32_t)
{
  const std::vector<std::int64_t> written{4, 5, 6, 7, 20, 21, 40};
  const std::vector<std::int64_t> slots{4, 5, 6, 7, 30, 20, 21, 22, 40, 6};
  // evenly spaced layers (read in place through a stride) and uneven ones (gathered a row at a time)
  for (const auto& captured : {std::vector<std::int32_t>{1, 2, 3, 4}, std::vector<std::int32_t>{0, 2, 4},
                               std::vector<std::int32_t>{1, 2, 4}, std::vector<std::int32_t>{3}}) {
    pool<Index> p{captured, written};
    CHECK(p.rows.run_layers() == captured);
    for (const std::uint32_t chunk : {256u, 3u}) {
      std::vector<std::byte> got;
      rr::read_record_into(p.rows, std::span<const std::int64_t>{slots}, got,
                           {.first_position = 17, .request = "request pool index 2"}, {.chunk_tokens = chunk});
      CHECK(got == expected_pool_record(captured, written, slots, 17, chunk));
      const rr::route_record_reader reader{got};
      CHECK(reader.missing_rows() == 2);
      CHECK(reader.token_start() == 17);
    }
  }
}

TEST_CASE("read_record_into: slots outside the pool and rows written for some layers only are refused")
{
  pool<std::uint16_t> p{{1, 2}, {3, 4}};
  std::vector<std::byte> out;
  const std::vector<std::int64_t> outside{3, 64};
  CHECK(code_of([&] { rr::read_record_into(p.rows, std::span<const std::int64_t>{outside}, out); }) ==
        rr::errc::slot_out_of_range);
  // layer 3 captured later, at slot 9 only: slots 3 and 4 hold routing for layers 1 and 2, not 3
  std::vector<std::int64_t> ids(pool_k, 5);
  std::vector<std::int64_t> nine{9};
  for (const std::int32_t layer : {1, 2, 3}) { p.rows.capture(layer, ids.data(), 1, p.compute.ref()); }
  p.rows.wait(p.rows.end_step(nine.data(), 1, p.compute.ref()));
  const std::vector<std::int64_t> partial{9, 3};
  try {
    rr::read_record_into(p.rows, std::span<const std::int64_t>{partial}, out, {.first_position = 4, .request = "request 8"});
    FAIL("no error");
  } catch (const rr::error& e) {
    CHECK(e.code() == rr::errc::missing_routing);
    CHECK(std::string{e.what()} ==
          "request 8, position 5 (KV slot 3) holds no routing for layer 3 (slot 3), and routing for 2 other layer(s): "
          "a step wrote part of the row");
  }
  CHECK(code_of([&] { rr::read_record_into(p.rows, std::span<const std::int64_t>{partial}, out, {}, {.token_start = 1}); }) ==
        rr::errc::invalid_argument);
}
