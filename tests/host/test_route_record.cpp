// The route record (include/routing_replay/route_record.hpp, docs/wire.md): round trips of every
// model shape of the issue through every codec and both forms, missing rows, slices at and across
// chunk boundaries, the sizes it promises, and records that must be refused.
#include <routing_replay/route_record.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace rr = routing_replay;

namespace {

struct shape {
  std::uint32_t L, K, E;
};
// Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3, Kimi-K2, a 512-expert model
constexpr shape model_shapes[] = {{48, 8, 128}, {94, 8, 128}, {58, 8, 256}, {60, 8, 384}, {48, 10, 512}};

std::vector<rr::route_codec> codecs()
{
  std::vector<rr::route_codec> c{rr::route_codec::packed};
  if (rr::route_record_has_zstd) {
    c.push_back(rr::route_codec::zstd);
    c.push_back(rr::route_codec::zstd_columns);
  }
  return c;
}

// [T, L, K] rows, each entry K distinct ids; `persist` is the chance that a row repeats the
// previous one's entry (the token-to-token persistence of real routing, which zstd finds)
std::vector<std::int16_t> make_rows(std::uint32_t T, shape s, std::uint64_t seed, double persist = 0.0)
{
  std::mt19937_64 gen{seed};
  std::vector<std::int16_t> rows(std::size_t{T} * s.L * s.K);
  std::vector<std::int16_t> pool(s.E);
  std::iota(pool.begin(), pool.end(), std::int16_t{0});
  std::bernoulli_distribution same{persist};
  for (std::uint32_t t = 0; t < T; ++t) {
    for (std::uint32_t l = 0; l < s.L; ++l) {
      std::int16_t* e = rows.data() + (std::size_t{t} * s.L + l) * s.K;
      if (t > 0 && same(gen)) {
        std::copy_n(e - std::size_t{s.L} * s.K, s.K, e);
        continue;
      }
      for (std::uint32_t k = 0; k < s.K; ++k) {  // a partial Fisher-Yates: K distinct of E
        std::swap(pool[k], pool[k + gen() % (s.E - k)]);
        e[k] = pool[k];
      }
    }
  }
  return rows;
}

std::vector<std::byte> encode(const std::vector<std::int16_t>& rows, std::uint32_t T, shape s, rr::route_record_options o = {})
{
  rr::route_record_encoder enc{s.L, s.K, s.E, std::move(o)};
  enc.append(rows.data(), T, std::ptrdiff_t{s.L} * s.K, s.K);
  return enc.finish();
}

// the expected slice: rows [t0, t1), layers [l0, l1); sorted entries for order-free records
std::vector<std::int16_t> expected(const std::vector<std::int16_t>& rows, shape s, std::uint32_t t0, std::uint32_t t1,
                                   std::uint32_t l0, std::uint32_t l1, bool ordered)
{
  std::vector<std::int16_t> out;
  for (std::uint32_t t = t0; t < t1; ++t) {
    for (std::uint32_t l = l0; l < l1; ++l) {
      const auto* e = rows.data() + (std::size_t{t} * s.L + l) * s.K;
      std::vector<std::int16_t> entry(e, e + s.K);
      if (!ordered) { std::sort(entry.begin(), entry.end()); }
      out.insert(out.end(), entry.begin(), entry.end());
    }
  }
  return out;
}

std::vector<std::int16_t> slice(const rr::route_record_reader& r, std::uint32_t t0, std::uint32_t t1, std::uint32_t l0,
                                std::uint32_t l1)
{
  std::vector<std::int16_t> out(std::size_t{t1 - t0} * (l1 - l0) * r.top_k(), 7777);
  r.decode<std::int16_t>(t0, t1, l0, l1, out.data(), std::ptrdiff_t{l1 - l0} * r.top_k(), r.top_k(), -1);
  return out;
}

void expect_invalid(const std::vector<std::byte>& record, const std::string& fragment, bool decode = true)
{
  try {
    rr::route_record_reader r{record};
    if (decode) { r.verify(); }
    FAIL("accepted a record that should be refused (" << fragment << ")");
  } catch (const rr::error& e) {
    CHECK(e.code() == rr::errc::invalid_record);
    CHECK_MESSAGE(std::string{e.what()}.find(fragment) != std::string::npos, e.what());
  }
}

}  // namespace

TEST_CASE("route record: every model shape, codec and form round-trips, whole and in slices")
{
  constexpr std::uint32_t T = 600;  // three chunks of 256, the last one short
  for (const shape s : model_shapes) {
    const auto rows = make_rows(T, s, s.E * 31 + s.L, 0.5);
    for (const rr::route_codec codec : codecs()) {
      for (const bool ordered : {true, false}) {
        if (!ordered && codec == rr::route_codec::zstd_columns) { continue; }
        CAPTURE(s.L); CAPTURE(s.K); CAPTURE(s.E); CAPTURE(rr::route_codec_name(codec)); CAPTURE(ordered);
        const auto record = encode(rows, T, s, {.token_start = 17, .codec = codec, .ordered = ordered});
        rr::route_record_reader r{record};
        CHECK(r.num_tokens() == T);
        CHECK(r.num_layers() == s.L);
        CHECK(r.top_k() == s.K);
        CHECK(r.num_experts() == s.E);
        CHECK(r.token_start() == 17);
        CHECK(r.ordered() == ordered);
        CHECK(r.codec() == codec);
        CHECK(r.num_chunks() == 3);
        CHECK(r.missing_rows() == 0);
        CHECK(slice(r, 0, T, 0, s.L) == expected(rows, s, 0, T, 0, s.L, ordered));
        // at and across chunk boundaries, whole rows and layer ranges
        const std::uint32_t cuts[][4] = {{0, 256, 0, s.L}, {255, 257, 0, s.L}, {256, 512, 3, 9}, {250, 600, 0, 1},
                                         {511, 513, s.L - 1, s.L}, {599, 600, 0, s.L}, {10, 11, 5, 6}, {300, 300, 0, s.L}};
        for (const auto& c : cuts) {
          CAPTURE(c[0]); CAPTURE(c[1]); CAPTURE(c[2]); CAPTURE(c[3]);
          CHECK(slice(r, c[0], c[1], c[2], c[3]) == expected(rows, s, c[0], c[1], c[2], c[3], ordered));
        }
        // never larger than its packed form (chunks compression does not shrink are stored packed)
        if (codec != rr::route_codec::packed) {
          const auto packed = encode(rows, T, s, {.token_start = 17, .ordered = ordered});
          CHECK(record.size() <= packed.size());
        }
        // zstd_columns keeps, chunk by chunk, the smaller of zstd over columns and over the packed form
        if (codec == rr::route_codec::zstd_columns) {
          const auto plain = encode(rows, T, s, {.token_start = 17, .codec = rr::route_codec::zstd});
          CHECK(record.size() <= plain.size());
        }
      }
    }
  }
}

TEST_CASE("route record: packed size is within 2% of ceil(log2 E) bits an id, order-free smaller")
{
  constexpr std::uint32_t T = 1024;
  for (const shape s : model_shapes) {
    const auto rows = make_rows(T, s, 5);
    const double ids = double{T} * s.L * s.K;
    const auto packed = encode(rows, T, s);
    const double ideal = ids * rr::detail::wire::bits_for_experts(s.E) / 8.0;
    CAPTURE(s.E);
    CHECK(double(packed.size()) <= ideal * 1.02);
    CHECK(double(packed.size()) >= ideal);
    const auto sets = encode(rows, T, s, {.ordered = false});
    CHECK(sets.size() < packed.size());
  }
}

TEST_CASE("route record: the layer map, missing rows and the sentinel")
{
  const shape s{4, 2, 16};
  const std::uint32_t T = 530;
  auto rows = make_rows(T, s, 9);
  std::vector<std::uint32_t> missing_at = {0, 255, 256, 257, 529};
  for (const std::uint32_t t : missing_at) { std::fill_n(rows.begin() + t * 8, 8, std::int16_t{-1}); }
  for (const rr::route_codec codec : codecs()) {
    for (const bool ordered : {true, false}) {
      if (!ordered && codec == rr::route_codec::zstd_columns) { continue; }
      rr::route_record_encoder enc{s.L, s.K, s.E, {.layer_map = {1, 3, 5, 9}, .codec = codec, .ordered = ordered}};
      enc.append(rows.data(), 100, 8, 2, std::optional<std::int16_t>{-1});  // in two calls: chunk staging spans them
      enc.append(rows.data() + 800, T - 100, 8, 2, std::optional<std::int16_t>{-1});
      enc.append_missing(3);
      const auto record = enc.finish();
      rr::route_record_reader r{record};
      CHECK(r.num_tokens() == T + 3);
      CHECK(r.missing_rows() == missing_at.size() + 3);
      CHECK(std::vector<std::uint32_t>(r.layer_map().begin(), r.layer_map().end()) == std::vector<std::uint32_t>{1, 3, 5, 9});
      CHECK_FALSE(r.row_present(256));
      CHECK(r.row_present(258));
      CHECK_FALSE(r.row_present(T + 2));
      auto all = slice(r, 0, T + 3, 0, s.L);
      auto want = expected(rows, s, 0, T, 0, s.L, ordered);
      want.resize(want.size() + 3 * 8, -1);
      for (const std::uint32_t t : missing_at) { std::fill_n(want.begin() + t * 8, 8, std::int16_t{-1}); }
      CHECK(all == want);
      // another output type, another missing value
      std::vector<std::uint8_t> u8(std::size_t{T + 3} * 8);
      r.decode<std::uint8_t>(0, T + 3, 0, s.L, u8.data(), 8, 2, 255);
      CHECK(u8[256 * 8] == 255);
      CHECK(u8[258 * 8] == static_cast<std::uint8_t>(want[258 * 8]));
    }
  }
}

TEST_CASE("route record: the encoder refuses what it cannot store, naming it")
{
  const shape s{2, 2, 8};
  std::vector<std::int16_t> rows = {1, 2, 3, 4, 5, 6, 7, 0};
  auto code_of = [](auto&& f) {
    try { f(); } catch (const rr::error& e) { return std::pair{e.code(), std::string{e.what()}}; }
    return std::pair{rr::errc::invalid_state, std::string{"no error"}};
  };
  rows[5] = 8;
  auto [c1, m1] = code_of([&] { encode(rows, 2, s); });
  CHECK(c1 == rr::errc::invalid_expert_id);
  CHECK(m1.find("row 1 of the call, layer 0, column 1: expert id 8 outside [0, 8)") != std::string::npos);
  rows[5] = -1;  // a partly missing row
  auto [c2, m2] = code_of([&] {
    rr::route_record_encoder enc{2, 2, 8};
    enc.append(rows.data(), 2, 4, 2, std::optional<std::int16_t>{-1});
  });
  CHECK(c2 == rr::errc::invalid_expert_id);
  CHECK(m2.find("only partly missing") != std::string::npos);
  rows[5] = 5;  // a repeated id, order-free
  auto [c3, m3] = code_of([&] { encode(rows, 2, s, {.ordered = false}); });
  CHECK(c3 == rr::errc::invalid_argument);
  CHECK(m3.find("row 1 of the call, layer 0: an id repeats") != std::string::npos);
  // a narrowing never makes an id valid: -1 of int8 is not expert 255, 65539 of int64 not expert 3
  for (const std::ptrdiff_t layer_stride : {2, 3}) {  // contiguous rows, and strided ones
    const std::int8_t narrow[] = {1, -1, 3, 4, 5, 6};
    CHECK(code_of([&] { rr::route_record_encoder{2, 2, 300}.append(narrow, 1, 6, layer_stride); }).first ==
          rr::errc::invalid_expert_id);
    const std::int64_t wide[] = {1, 65539, 3, 4, 5, 6};
    CHECK(code_of([&] { rr::route_record_encoder{2, 2, 8}.append(wide, 1, 6, layer_stride); }).second.find("65539") !=
          std::string::npos);
  }
  CHECK(code_of([] { rr::route_record_encoder{0, 8, 128}; }).first == rr::errc::invalid_argument);
  CHECK(code_of([] { rr::route_record_encoder{4, 8, 70000}; }).first == rr::errc::invalid_argument);
  CHECK(code_of([] { rr::route_record_encoder{4, 9, 8}; }).first == rr::errc::invalid_argument);
  CHECK(code_of([] { rr::route_record_encoder{2, 2, 8, {.layer_map = {1}}}; }).first == rr::errc::invalid_argument);
  CHECK(code_of([] { rr::route_record_encoder{2, 2, 8, {.layer_map = {3, 3}}}; }).second.find("twice") != std::string::npos);
  CHECK(code_of([] { rr::route_record_encoder{2, 2, 8, {.token_start = -1}}; }).first == rr::errc::invalid_argument);
  CHECK(code_of([] { rr::route_record_encoder{2, 60, 65536, {.ordered = false}}; }).second.find("order-free") != std::string::npos);
  if (!rr::route_record_has_zstd) {
    CHECK(code_of([] { rr::route_record_encoder{2, 2, 8, {.codec = rr::route_codec::zstd}}; }).second.find("libzstd") !=
          std::string::npos);
  }
}

TEST_CASE("route record: edge shapes: one expert bit, 16 bits, no rows, one row")
{
  for (const shape s : {shape{1, 1, 1}, shape{1, 2, 2}, shape{3, 4, 65536}, shape{2, 64, 64}, shape{5, 3, 3}}) {
    for (const std::uint32_t T : {0u, 1u, 7u, 513u}) {
      const auto rows = make_rows(T, s, T + s.E);
      for (const bool ordered : {true, false}) {
        CAPTURE(s.E); CAPTURE(s.K); CAPTURE(T); CAPTURE(ordered);
        if (!ordered && rr::detail::wire::rank_bits(s.E, s.K, rr::detail::wire::max_order_free_table) == 0) { continue; }
        std::vector<std::int32_t> wide(rows.begin(), rows.end());
        for (auto& v : wide) { v = static_cast<std::uint16_t>(v); }  // 65536 experts: ids past int16
        rr::route_record_encoder enc{s.L, s.K, s.E, {.ordered = ordered}};
        enc.append(wide.data(), T, std::ptrdiff_t{s.L} * s.K, s.K);
        const auto record = enc.finish();
        rr::route_record_reader r{record};
        std::vector<std::int32_t> back(wide.size());
        r.decode<std::int32_t>(0, T, 0, s.L, back.data(), std::ptrdiff_t{s.L} * s.K, s.K, -1);
        if (!ordered) {
          for (std::size_t e = 0; e < std::size_t{T} * s.L; ++e) { std::sort(wide.begin() + e * s.K, wide.begin() + (e + 1) * s.K); }
        }
        CHECK(back == wide);
      }
    }
  }
}

TEST_CASE("route record: an encoder makes the next record after finish_into, from the same buffer")
{
  const shape s{3, 2, 32};
  rr::route_record_encoder enc{s.L, s.K, s.E};
  std::vector<std::byte> buffer;
  for (std::uint32_t T : {300u, 5u}) {
    const auto rows = make_rows(T, s, T);
    enc.append(rows.data(), T, 6, 2);
    const std::size_t size = enc.finish_into(buffer);
    CHECK(size == buffer.size());
    rr::route_record_reader r{buffer};
    CHECK(r.num_tokens() == T);
    CHECK(slice(r, 0, T, 0, 3) == expected(rows, s, 0, T, 0, 3, true));
  }
}

TEST_CASE("route record: write_into packs into the caller's buffer, the same bytes as finish_into")
{
  for (const shape s : {shape{48, 8, 128}, shape{60, 8, 384}, shape{3, 2, 32}}) {
    rr::route_record_encoder enc{s.L, s.K, s.E, {.token_start = 9}};
    rr::route_record_encoder ordered_free{s.L, s.K, s.E, {.ordered = false}};
    for (std::uint32_t T : {0u, 1u, 255u, 256u, 257u, 600u, 1024u}) {
      const auto rows = make_rows(T, s, T + s.E);
      const std::ptrdiff_t stride = std::ptrdiff_t{s.L} * s.K;
      for (rr::route_record_encoder* e : {&enc, &ordered_free}) {
        e->append(rows.data(), T, stride, s.K);
        const std::vector<std::byte> copied = e->finish();
        std::vector<std::byte> direct(e->packed_record_size(T), std::byte{0xAB});
        CHECK(direct.size() == copied.size());
        e->write_into(direct, T);
        e->append(rows.data(), T / 2, stride, s.K);  // in two calls: chunks do not follow calls
        e->append(rows.data() + std::size_t{T / 2} * stride, T - T / 2, stride, s.K);
        CHECK(e->finished_size() == direct.size());
        CHECK(e->finish_into(std::span<std::byte>{direct}) == direct.size());
        CHECK(direct == copied);
      }
    }
    // the plan fails: a missing row (a bitmap before the payload), fewer rows, more rows
    const auto rows = make_rows(600, s, 1);
    const std::ptrdiff_t stride = std::ptrdiff_t{s.L} * s.K;
    for (const int variant : {0, 1, 2}) {
      std::vector<std::byte> direct(enc.packed_record_size(600));
      enc.write_into(direct, 600);
      const std::uint32_t n = variant == 1 ? 599 : 600;
      enc.append(rows.data(), 300, stride, s.K);
      if (variant == 0) { enc.append_missing(1); }
      enc.append(rows.data() + 300 * stride, n - 300 - (variant == 0 ? 1 : 0), stride, s.K);
      if (variant == 2) { enc.append(rows.data(), 1, stride, s.K); }
      const std::size_t size = enc.finished_size();
      CHECK(size != direct.size());
      CHECK_THROWS_AS(enc.finish_into(std::span<std::byte>{direct}), rr::error);
      std::vector<std::byte> exact(size);
      enc.finish_into(std::span<std::byte>{exact});
      rr::route_record_reader r{exact};
      r.verify();
      CHECK(r.missing_rows() == (variant == 0 ? 1u : 0u));
      CHECK(r.num_tokens() == (variant == 2 ? 601u : n));
      CHECK(slice(r, 0, 300, 0, s.L) == expected(rows, s, 0, 300, 0, s.L, true));
    }
    std::vector<std::byte> wrong(enc.packed_record_size(10) + 1);
    CHECK_THROWS_AS(enc.write_into(wrong, 10), rr::error);
    enc.set_token_start(4);
    CHECK_THROWS_AS(enc.set_token_start(-1), rr::error);
  }
  if (rr::route_record_has_zstd) {
    rr::route_record_encoder z{48, 8, 128, {.codec = rr::route_codec::zstd}};
    std::vector<std::byte> buffer(z.packed_record_size(4));
    CHECK_THROWS_AS(z.write_into(buffer, 4), rr::error);
  }
}

TEST_CASE("route record: the reader refuses corrupted, truncated and foreign records")
{
  const shape s{6, 4, 100};
  const auto rows = make_rows(700, s, 3);
  const auto good = encode(rows, 700, s);
  rr::route_record_reader{good}.verify();
  namespace w = rr::detail::wire;

  expect_invalid({good.begin(), good.begin() + 50}, "truncated");
  expect_invalid({good.begin(), good.end() - 1}, "truncated");
  auto longer = good;
  longer.push_back(std::byte{0});
  expect_invalid(longer, "past the record's end");
  auto bad = good;
  bad[0] = std::byte{'X'};
  expect_invalid(bad, "bad magic");
  bad = good;
  bad[8] = std::byte{2};
  expect_invalid(bad, "unknown version 2");
  bad = good;
  bad[31] = std::byte{9};
  expect_invalid(bad, "unknown codec 9");
  bad = good;
  w::store_le<std::uint32_t>(bad.data() + 24, 70000);
  expect_invalid(bad, "num_experts 70000 outside");
  bad = good;
  w::store_le<std::uint32_t>(bad.data() + 20, 5000);
  expect_invalid(bad, "num_layers 5000 outside");
  bad = good;
  bad[90] ^= std::byte{1};  // the layer map
  expect_invalid(bad, "header checksum mismatch");
  bad = good;
  bad[bad.size() - 3] ^= std::byte{0x10};  // the last chunk's payload
  expect_invalid(bad, "chunk 2: checksum mismatch");
  {  // the corrupted chunk does not stop slices elsewhere: only the chunks a range needs are read
    rr::route_record_reader r{bad};
    CHECK(slice(r, 0, 512, 0, 6) == expected(rows, s, 0, 512, 0, 6, true));
    CHECK(r.chunks_of(100, 513) == std::pair<std::uint32_t, std::uint32_t>{0, 3});
    CHECK_THROWS_AS(slice(r, 500, 513, 0, 6), rr::error);
  }
  // an id >= E with consistent checksums: what a buggy encoder would write
  bad = good;
  {
    rr::route_record_reader r{good};
    const std::size_t payload = good.size() - r.payload_bytes();
    bad[payload] = std::byte{0x7f};  // the first id's 7 bits: 127 >= 100
    const std::uint64_t sum = rr::detail::xxhash64({bad.data() + payload, r.chunk(0).stored_bytes});
    const std::size_t entry0 = 80 + 6 * 4;
    w::store_le<std::uint64_t>(bad.data() + entry0 + 16, sum);
    w::store_le<std::uint64_t>(bad.data() + 72, rr::route_record_encoder::meta_checksum(bad.data(), payload));
  }
  expect_invalid(bad, "expert id 127 >= 100");
  // ranges outside the record and too narrow an output are the caller's errors
  rr::route_record_reader r{good};
  std::vector<std::int16_t> out(1000);
  CHECK_THROWS_WITH_AS(r.decode<std::int16_t>(0, 701, 0, 6, out.data(), 24, 4, -1), doctest::Contains("outside 700 rows"),
                       rr::error);
  auto wide = encode(make_rows(3, {2, 2, 300}, 1), 3, {2, 2, 300});
  std::vector<std::int8_t> narrow(12);
  CHECK_THROWS_WITH_AS(rr::route_record_reader{wide}.decode<std::int8_t>(0, 3, 0, 2, narrow.data(), 4, 2, -1),
                       doctest::Contains("300 experts do not fit"), rr::error);
}
