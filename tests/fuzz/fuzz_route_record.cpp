// libFuzzer harness of the route record's decoder (include/routing_replay/route_record.hpp). The
// first byte picks what the rest is:
//   0: a record as it arrives from the wire: the reader must refuse it with invalid_record or read
//      it; what it reads, every slice of it, must hold ids < E and missing rows as the sentinel;
//   1: a record the encoder makes from the input (shape, codec, form, rows, missing rows), then
//      mutated at the input's offsets and resealed (checksums recomputed), so that mutations reach
//      the checks behind the checksums: index tiling, bitmap, zstd frames, ids >= E, ranks;
//   2: the same record unmutated: decoding every slice must give back the rows appended.
// Anything else (a crash, a sanitizer report, another error code, a wrong id) aborts.
//
// Build and run: scripts/fuzz.sh SECONDS (it gives this harness a share of the time).
#include <routing_replay/route_record.hpp>

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <span>
#include <vector>

namespace rr = routing_replay;
namespace w  = rr::detail::wire;

namespace {

[[noreturn]] void violation(const char* what)
{
  std::fprintf(stderr, "route record contract violation: %s\n", what);
  std::abort();
}

// Reads the record and decodes it whole and in a few slices, checking every id.
void read_all(std::span<const std::byte> bytes, FuzzedDataProvider& in)
{
  try {
    const rr::route_record_reader r{bytes};
    const std::uint32_t T = r.num_tokens(), L = r.num_layers(), K = r.top_k();
    if (std::uint64_t{T} * L * K > (1u << 22)) { return; }  // a valid header of a huge record: the size checks are done
    std::vector<std::int32_t> out(std::size_t{T} * L * K);
    for (int round = 0; round < 3; ++round) {
      const std::uint32_t t0 = round == 0 ? 0 : in.ConsumeIntegralInRange<std::uint32_t>(0, T);
      const std::uint32_t t1 = round == 0 ? T : in.ConsumeIntegralInRange<std::uint32_t>(t0, T);
      const std::uint32_t l0 = round == 0 ? 0 : in.ConsumeIntegralInRange<std::uint32_t>(0, L);
      const std::uint32_t l1 = round == 0 ? L : in.ConsumeIntegralInRange<std::uint32_t>(l0, L);
      const std::uint32_t nl = l1 - l0;
      r.decode<std::int32_t>(t0, t1, l0, l1, out.data(), std::ptrdiff_t{nl} * K, K, -1);
      for (std::uint32_t t = t0; t < t1; ++t) {
        for (std::size_t i = 0; i < std::size_t{nl} * K; ++i) {
          const std::int32_t v = out[(t - t0) * std::size_t{nl} * K + i];
          if (r.row_present(t) ? (v < 0 || static_cast<std::uint32_t>(v) >= r.num_experts()) : v != -1) {
            violation("a decoded id outside [0, E), or a missing row not the sentinel");
          }
        }
      }
    }
  } catch (const rr::error& e) {
    if (e.code() != rr::errc::invalid_record) { violation("a malformed record raised another error than invalid_record"); }
  }
}

struct made {
  std::vector<std::byte> record;
  std::vector<std::int32_t> rows;  // as decode returns them: sorted entries order-free, -1 missing
  std::uint32_t T, L, K;
};

made make_record(FuzzedDataProvider& in)
{
  const std::uint32_t E = in.ConsumeBool() ? in.PickValueInArray({2u, 100u, 128u, 256u, 384u, 512u, 65536u})
                                           : in.ConsumeIntegralInRange<std::uint32_t>(1, 1024);
  const std::uint32_t K = in.ConsumeIntegralInRange<std::uint32_t>(1, std::min(E, 10u));
  const std::uint32_t L = in.ConsumeIntegralInRange<std::uint32_t>(1, 6);
  const std::uint32_t T = in.ConsumeIntegralInRange<std::uint32_t>(0, 600);
  rr::route_record_options o;
  o.chunk_tokens = in.PickValueInArray({1u, 7u, 64u, 256u});
  o.ordered      = in.ConsumeIntegralInRange<int>(0, 3) != 0;
  const auto codec = static_cast<rr::route_codec>(in.ConsumeIntegralInRange<int>(0, 2));
  if (rr::route_record_has_zstd && !(codec == rr::route_codec::zstd_columns && !o.ordered)) { o.codec = codec; }
  if (!o.ordered && w::rank_bits(E, K, w::max_order_free_table) == 0) { o.ordered = true; }
  o.token_start = in.ConsumeIntegralInRange<std::int64_t>(0, 1 << 20);
  rr::route_record_encoder enc{L, K, E, o};
  made m{{}, {}, T, L, K};
  std::vector<std::int32_t> row(std::size_t{L} * K);
  for (std::size_t i = 0; i < row.size(); ++i) { row[i] = static_cast<std::int32_t>(i % K); }  // a set per entry
  const bool persistent = in.ConsumeBool();  // long runs of one row: what zstd shrinks
  for (std::uint32_t t = 0; t < T; ++t) {
    if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
      enc.append_missing(1);
      m.rows.insert(m.rows.end(), row.size(), -1);
      continue;
    }
    if (!persistent || t == 0 || in.ConsumeIntegralInRange<int>(0, 7) == 0) {
      for (std::uint32_t e = 0; e < L; ++e) {  // K distinct ids an entry: any K of E for order-free
        std::int32_t* ids = row.data() + std::size_t{e} * K;
        const std::uint32_t base = in.ConsumeIntegralInRange<std::uint32_t>(0, E - 1);
        const std::uint32_t step = in.ConsumeIntegralInRange<std::uint32_t>(1, 5);
        for (std::uint32_t k = 0; k < K; ++k) { ids[k] = static_cast<std::int32_t>((base + std::uint64_t{k} * step) % E); }
        std::sort(ids, ids + K);
        if (std::adjacent_find(ids, ids + K) != ids + K) { std::iota(ids, ids + K, 0); }
        if (o.ordered && in.ConsumeBool()) { std::reverse(ids, ids + K); }
      }
    }
    enc.append(row.data(), 1, 0, K);
    m.rows.insert(m.rows.end(), row.begin(), row.end());
  }
  if (!o.ordered) {
    for (std::size_t e = 0; e + K <= m.rows.size(); e += K) { std::sort(m.rows.begin() + e, m.rows.begin() + e + K); }
  }
  m.record = enc.finish();
  return m;
}

// Recomputes the chunks' and the header's checksums where the (mutated) fields still point inside
// the buffer, so that the mutation, not a checksum, is what the reader meets.
void reseal(std::vector<std::byte>& b)
{
  if (b.size() < w::header_bytes) { return; }
  const auto L = w::load_le<std::uint32_t>(b.data() + 20), chunks = w::load_le<std::uint32_t>(b.data() + 44);
  const auto T = w::load_le<std::uint32_t>(b.data() + 16), flags = w::load_le<std::uint32_t>(b.data() + 12);
  const std::uint64_t index = w::header_bytes + std::uint64_t{L} * 4;
  const std::uint64_t payload = index + std::uint64_t{chunks} * w::chunk_entry_bytes +
                                ((flags & w::flag_has_missing) ? (std::uint64_t{T} + 7) / 8 : 0);
  if (payload > b.size()) { return; }
  for (std::uint32_t c = 0; c < chunks; ++c) {
    std::byte* e = b.data() + index + std::uint64_t{c} * w::chunk_entry_bytes;
    const auto offset = w::load_le<std::uint64_t>(e);
    const auto size   = w::load_le<std::uint32_t>(e + 8);
    if (offset <= b.size() - payload && size <= b.size() - payload - offset) {
      w::store_le<std::uint64_t>(e + 16, rr::detail::xxhash64({b.data() + payload + offset, size}));
    }
  }
  w::store_le<std::uint64_t>(b.data() + w::checksum_offset, rr::route_record_encoder::meta_checksum(b.data(), payload));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  FuzzedDataProvider in{data, size};
  const int mode = in.ConsumeIntegralInRange<int>(0, 2);
  if (mode == 0) {
    const auto bytes = in.ConsumeBytes<std::byte>(in.ConsumeIntegralInRange<std::size_t>(0, in.remaining_bytes()));
    read_all(bytes, in);
    return 0;
  }
  made m = make_record(in);
  if (mode == 2) {
    const rr::route_record_reader r{m.record};
    std::vector<std::int32_t> out(m.rows.size());
    r.decode<std::int32_t>(0, m.T, 0, m.L, out.data(), std::ptrdiff_t{m.L} * m.K, m.K, -1);
    if (out != m.rows) { violation("a record decoded to other rows than were appended"); }
    const std::uint32_t t0 = in.ConsumeIntegralInRange<std::uint32_t>(0, m.T), t1 = in.ConsumeIntegralInRange<std::uint32_t>(t0, m.T);
    const std::uint32_t l0 = in.ConsumeIntegralInRange<std::uint32_t>(0, m.L), l1 = in.ConsumeIntegralInRange<std::uint32_t>(l0, m.L);
    std::vector<std::int32_t> part(std::size_t{t1 - t0} * (l1 - l0) * m.K);
    r.decode<std::int32_t>(t0, t1, l0, l1, part.data(), std::ptrdiff_t{l1 - l0} * m.K, m.K, -1);
    for (std::uint32_t t = t0; t < t1; ++t) {
      for (std::size_t i = 0; i < std::size_t{l1 - l0} * m.K; ++i) {
        if (part[(t - t0) * std::size_t{l1 - l0} * m.K + i] != m.rows[(t * std::size_t{m.L} + l0) * m.K + i]) {
          violation("a slice decoded to other rows than were appended");
        }
      }
    }
    return 0;
  }
  // mode 1: mutate at the input's offsets (bytes, then a cut or an extension), reseal, read
  const int edits = in.ConsumeIntegralInRange<int>(1, 8);
  for (int i = 0; i < edits && !m.record.empty(); ++i) {
    const std::size_t at = in.ConsumeIntegralInRange<std::size_t>(0, m.record.size() - 1);
    m.record[at] = static_cast<std::byte>(in.ConsumeIntegral<std::uint8_t>());
  }
  if (in.ConsumeBool()) { m.record.resize(in.ConsumeIntegralInRange<std::size_t>(0, m.record.size() + 16)); }
  if (in.ConsumeIntegralInRange<int>(0, 3) != 0) { reseal(m.record); }
  read_all(m.record, in);
  return 0;
}
