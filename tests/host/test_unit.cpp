// Deterministic scenarios for each contract of DESIGN.md section 4, on the host backend.
#include "../support/error_checks.hpp"
#include "../support/small_replay.hpp"

#include <routing_replay/routing_replay.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

namespace rr = routing_replay;
using rr_test::plan_for;
using rr_test::small_replay;
using rr_test::small_row;

using per_request_replay = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major,
                                             rr::sync_copy, rr::per_request_storage>;
using block_slot_replay  = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major,
                                             rr::sync_copy, rr::block_slot_storage>;
// the same scenarios with rows filed a step later, and with rows placed by a "kernel"
using per_request_deferred = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major,
                                               rr::double_buffered<2>, rr::per_request_storage>;
using block_slot_deferred  = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::token_major,
                                               rr::async_event, rr::block_slot_storage>;
using block_slot_scattered = rr::RoutingReplay<rr::host_backend, std::int16_t, rr::layer_major,
                                               rr::device_scatter<2>, rr::block_slot_storage>;

namespace {

template <class T>
std::vector<T> concat(std::initializer_list<std::vector<T>> parts)
{
  std::vector<T> out;
  for (const auto& p : parts) { out.insert(out.end(), p.begin(), p.end()); }
  return out;
}

std::vector<std::int16_t> missing_row() { return std::vector<std::int16_t>(4, -1); }

}  // namespace

TEST_CASE("both layouts index (layer, token, k) as documented")
{
  std::vector<int> storage(2 * 3 * 4);
  rr::buffer_mdspan<int, rr::token_major> token{storage.data(), 2, 3, 4};
  rr::buffer_mdspan<int, rr::layer_major> layer{storage.data(), 2, 3, 4};
  CHECK(&token(1, 2, 3) - storage.data() == (2 * 2 + 1) * 4 + 3);  // token row contiguous
  CHECK(&layer(1, 2, 3) - storage.data() == (1 * 3 + 2) * 4 + 3);  // layer slab contiguous
  CHECK(token.mapping().stride(0) == 4);
  CHECK(token.mapping().stride(1) == 8);
  CHECK(token.mapping().stride(2) == 1);
  CHECK(token.mapping().required_span_size() == 24);
  CHECK(token.is_exhaustive());
}

TEST_CASE("request ids: integers and strings never alias")
{
  small_replay<per_request_replay> s;
  s.rr().add_request(7);
  s.rr().add_request("7");
  CHECK(s.rr().num_requests() == 2);
  CHECK(s.rr().contains(7));
  CHECK(s.rr().contains(std::string{"7"}));
  CHECK_FALSE(s.rr().contains(8));
}

TEST_CASE("request handles: plans and calls by handle equal plans by id; a stale handle is refused")
{
  small_replay<per_request_replay> by_id;
  small_replay<per_request_replay> by_handle;
  std::vector<std::int64_t> slots;
  by_id.rr().add_request("a");
  by_id.rr().add_request(7);
  const rr::request_handle a = by_handle.rr().add_request("a");
  const rr::request_handle b = by_handle.rr().add_request(7);
  CHECK(a != b);
  CHECK(by_handle.rr().handle("a") == a);
  CHECK(by_handle.rr().contains(b));
  CHECK(rr::request_handle::from_bits(b.bits()) == b);
  for (std::int64_t first : {0, 3}) {
    rr::step_plan ids;
    ids.schedule({"a", first, 3, 0, {}});
    ids.schedule({7, first, 2, 0, {}});
    by_id.step(ids, first);
    rr::step_plan handles;
    handles.schedule({a, first, 3, 0, {}});
    handles.schedule(b, first, 2);  // the columnar overload: the same entry, built in place
    const auto& built = handles.entries()[1];
    CHECK((built.request.id.is_handle() && built.request.id.handle() == b));
    CHECK((built.request.first_position == first && built.request.num_tokens == 2 &&
           built.request.num_draft_tokens == 0 && built.request.slots.empty()));
    CHECK((built.first_row == 3 && !built.skipped && handles.num_rows() == 5));
    by_handle.step(handles, first);
  }
  CHECK(by_handle.rows("a") == by_id.rows("a"));
  CHECK(by_handle.rows(7) == by_id.rows(7));
  CHECK(by_handle.rr().recorded_rows(a) == 6);
  // errors name the request by its id, also when the plan names it by handle
  rr::step_plan late;
  late.schedule({a, 31, 2, 0, {}});
  rr_test::expect_error([&] { by_handle.rr().begin_step(late, by_handle.stream()); }, rr::errc::position_out_of_range,
                        {"request 'a'", "[31, 33)"});
  // released: its handle is refused, also once a new request took its index
  by_handle.rr().release(a);
  const rr::request_handle c = by_handle.rr().add_request("c");
  CHECK(c.index == a.index);
  CHECK(c != a);
  CHECK_FALSE(by_handle.rr().contains(a));
  rr_test::expect_error([&] { (void)by_handle.rr().recorded_rows(a); }, rr::errc::unknown_request, {"handle"});
  rr::step_plan stale;
  stale.schedule({a, 6, 1, 0, {}});
  rr_test::expect_error([&] { by_handle.rr().begin_step(stale, by_handle.stream()); }, rr::errc::unknown_request,
                        {"released or aborted"});
  // a handle names a request; it is not an id to add
  rr_test::expect_error([&] { by_handle.rr().add_request(c); }, rr::errc::invalid_argument, {"not by a handle"});
}

TEST_CASE("capture narrows once, skips fused shared columns, maps physical ids, takes a DP span")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  // rows of 4 columns: 2 routed, 2 shared (garbage); this rank's rows start at row 1
  const std::vector<std::int64_t> physical = {-9, -9, -9, -9,  5, 6, 77, 77,  4, 3, 77, 77};
  const std::vector<std::int32_t> to_logical = {0, 7, 6, 5, 4, 3, 2};  // physical -> logical
  rr::capture_options o;
  o.source_row_stride    = 4;
  o.source_row_offset    = 1;
  o.physical_to_logical  = to_logical.data();
  o.num_physical_experts = static_cast<std::int64_t>(to_logical.size());
  s.rr().capture(1, physical.data(), 2, s.stream(), o);
  const std::vector<std::int32_t> logical = {1, 2, 99, 3, 4, 99};  // int32, K + 1 shared column
  s.rr().capture(2, logical.data(), 2, s.stream());
  s.end_step();
  CHECK(s.rows(1) == std::vector<std::int16_t>{3, 2, 1, 2, 4, 5, 3, 4});
}

TEST_CASE("rows of requests that did not opt in are not stored")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots = {0, 1};
  s.rr().add_request(1);
  rr::step_plan plan;
  plan.skip(3);
  plan.schedule({1, 0, 2, 0, slots});
  s.step(plan, 4);
  CHECK(s.rr().recorded_rows(1) == 2);
  CHECK(s.rows(1) == concat<std::int16_t>({small_row<std::int16_t>(3, 4), small_row<std::int16_t>(4, 4)}));
}

TEST_CASE("per-request storage: zero-copy views of rows that never move, growth in whole segments")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1, {3});
  for (std::int64_t first = 0; first < 32; first += 8) { s.step(plan_for(1, first, 8, slots), first); }
  const auto a = s.rr().extract(1);
  const auto b = s.rr().extract(1, {.start_position = 5});
  CHECK(a.is_view());
  CHECK(a.flat().data() + 5 * 4 == b.flat().data());  // both view the same storage
  CHECK(s.rr().host_bytes() == 4096);  // one page: 32 positions of 8 bytes fit the first segment
  CHECK(a.prompt_rows().extent(0) == 3);
  CHECK(a.generation_rows().extent(0) == 29);
  CHECK(b.prompt_rows().extent(0) == 0);
  CHECK(b.generation_rows().extent(0) == 27);
  CHECK(a.count_missing_rows() == 0);
}

TEST_CASE("extraction options: offsets, clipping, prompt split, dense layers")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1, {2});
  s.step(plan_for(1, 0, 4, slots), 0);
  const auto clipped = s.rr().extract(1, {.start_position = 1, .end_position = 3, .prompt_length = 2});
  CHECK(clipped.num_rows() == 2);
  CHECK(clipped.first_position() == 1);
  CHECK(clipped.prompt_rows().extent(0) == 1);
  CHECK(clipped.rows()(1, 1, 0) == small_row<std::int16_t>(2, 0)[2]);

  const auto dense = s.rr().extract(1, {.include_dense_layers = true});
  CHECK_FALSE(dense.is_view());
  CHECK(dense.num_layers() == 3);
  for (std::int64_t t = 0; t < 4; ++t) {
    const auto expected = small_row<std::int16_t>(t, 0);
    CHECK(dense.rows()(t, 0, 0) == -1);  // model layer 0 is dense
    CHECK(dense.rows()(t, 0, 1) == -1);
    CHECK(dense.rows()(t, 1, 0) == expected[0]);
    CHECK(dense.rows()(t, 2, 1) == expected[3]);
  }
}

TEST_CASE_TEMPLATE("preemption with recompute: first write wins unless overwrite", RR,
                   per_request_replay, block_slot_replay, per_request_deferred,
                   block_slot_deferred, block_slot_scattered)
{
  for (const bool overwrite : {false, true}) {
    CAPTURE(overwrite);
    small_replay<RR> s{rr_test::small_config(overwrite)};
    std::vector<std::int64_t> slots;
    s.rr().add_request(1);
    s.step(plan_for(1, 0, 3, slots), 1);
    // recompute positions 0..2 (same slots) with a new salt
    s.step(plan_for(1, 0, 3, slots), 2);
    const auto salt = overwrite ? 2 : 1;
    CHECK(s.rows(1) == concat<std::int16_t>({small_row<std::int16_t>(0, salt), small_row<std::int16_t>(1, salt),
                                             small_row<std::int16_t>(2, salt)}));
  }
}

TEST_CASE_TEMPLATE("speculative drafts: accepted prefix kept, rejected rows gone", RR, per_request_replay,
                   block_slot_replay, per_request_deferred,
                   block_slot_deferred, block_slot_scattered)
{
  small_replay<RR> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.step(plan_for(1, 0, 2, slots), 1);
  s.step(plan_for(1, 2, 4, slots, 3), 2);  // token 2 + drafts 3, 4, 5
  CHECK(s.rr().recorded_rows(1) == 3);
  rr_test::expect_error([&] { (void)s.rr().extract(1); }, rr::errc::draft_error,
                        {"3 unresolved draft token(s)"});
  rr_test::expect_error([&] { s.rr().accept_draft(1, 4); }, rr::errc::draft_error, {"accepted 4 of 3"});
  s.rr().accept_draft(1, 1);  // draft 3 accepted; 4 and 5 rejected
  CHECK(s.rr().recorded_rows(1) == 4);
  // the rejected positions are recomputed later with other routing, which must land
  s.step(plan_for(1, 4, 2, slots), 3);
  const auto r = s.rows(1);
  CHECK(r == concat<std::int16_t>({small_row<std::int16_t>(0, 1), small_row<std::int16_t>(1, 1),
                                   small_row<std::int16_t>(0, 2), small_row<std::int16_t>(1, 2),
                                   small_row<std::int16_t>(0, 3), small_row<std::int16_t>(1, 3)}));
}

TEST_CASE_TEMPLATE("a tentative draft row yields to a later write of its position", RR, per_request_replay,
                   block_slot_replay, per_request_deferred,
                   block_slot_deferred, block_slot_scattered)
{
  for (const bool overwrite : {false, true}) {  // ownership moves under either preemption policy
    CAPTURE(overwrite);
    small_replay<RR> s{rr_test::small_config(overwrite)};
    std::vector<std::int64_t> slots;
    s.rr().add_request(1);
    s.step(plan_for(1, 0, 3, slots, 2), 1);  // token 0 + drafts 1, 2; acceptance not known yet
    s.step(plan_for(1, 1, 1, slots), 2);     // an engine that rescheduled position 1 meanwhile
    s.rr().accept_draft(1, 0);               // both drafts rejected: position 1 keeps the later row
    CHECK(s.rr().recorded_rows(1) == 2);
    CHECK(s.rows(1) == concat<std::int16_t>({small_row<std::int16_t>(0, 1), small_row<std::int16_t>(0, 2)}));
  }
}

TEST_CASE("block-slot storage: prefix hits, stale rows after block reuse, shared-block recompute")
{
  small_replay<block_slot_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.step(plan_for(1, 0, 8, slots), 1);  // blocks 0 and 1 hold positions 0..7
  s.rr().release(1);

  // request 2 hits block 0 as a cached prefix of 4 positions, then recomputes position 4 in block 1
  const std::int64_t cached[] = {0, 1, 2, 3};
  s.rr().add_request(2, {.cached_slots = cached});
  std::vector<std::int64_t> slot4 = {4};
  rr::step_plan plan;
  plan.schedule({2, 4, 1, 0, slot4});
  s.step(plan, 2);
  // position 4's slot already held request 1's row in this block generation: the first row stays
  CHECK(s.rows(2) == concat<std::int16_t>({small_row<std::int16_t>(0, 1), small_row<std::int16_t>(1, 1),
                                           small_row<std::int16_t>(2, 1), small_row<std::int16_t>(3, 1),
                                           small_row<std::int16_t>(4, 1)}));

  // block 0 is reallocated to request 3: request 2's cached rows there become stale, not foreign
  s.rr().add_request(3);
  const std::int64_t fresh[] = {0};
  rr::step_plan plan3 = plan_for(3, 0, 2, slots);
  plan3.add_fresh_blocks(fresh);
  s.step(plan3, 3);
  const auto stale = s.rr().extract(2);
  CHECK(stale.count_missing_rows() == 4);
  CHECK(std::vector<std::int16_t>(stale.flat().begin(), stale.flat().begin() + 4) == missing_row());
  CHECK(std::vector<std::int16_t>(stale.flat().begin() + 16, stale.flat().end()) == small_row<std::int16_t>(4, 1));
  CHECK(s.rows(3) == concat<std::int16_t>({small_row<std::int16_t>(0, 3), small_row<std::int16_t>(1, 3)}));
}

TEST_CASE("block-slot storage: a first row follows its position to a new slot after preemption")
{
  small_replay<block_slot_replay> s;
  std::vector<std::int64_t> slots = {8, 9};
  s.rr().add_request(1);
  rr::step_plan first;
  first.schedule({1, 0, 2, 0, slots});
  s.step(first, 1);
  // preempted; recomputed into block 3 (slots 12, 13) while block 2 still holds the first rows
  std::vector<std::int64_t> moved = {12, 13};
  const std::int64_t fresh[]      = {3};
  rr::step_plan again;
  again.schedule({1, 0, 2, 0, moved});
  again.add_fresh_blocks(fresh);
  s.step(again, 2);
  // block 2 is then reused: the rows live on at their new slots
  s.rr().add_request(2);
  const std::int64_t fresh2[] = {2};
  const std::int64_t slot8[]  = {8};
  rr::step_plan other;
  other.schedule({2, 0, 1, 0, slot8});
  other.add_fresh_blocks(fresh2);
  s.step(other, 3);
  CHECK(s.rows(1) == concat<std::int16_t>({small_row<std::int16_t>(0, 1), small_row<std::int16_t>(1, 1)}));
}

TEST_CASE("block-slot storage: rows follow their KV blocks (copy, export, import)")
{
  small_replay<block_slot_replay> prefill;
  std::vector<std::int64_t> slots;
  prefill.rr().add_request(1);
  prefill.step(plan_for(1, 0, 8, slots), 1);  // blocks 0 and 1
  const auto expected = prefill.rows(1);

  // offload and reload under new block ids: a request hitting the reloaded blocks sees the rows
  const std::int64_t from[] = {0, 1};
  const std::int64_t to[]   = {5, 6};
  prefill.rr().copy_blocks(from, to);
  const std::int64_t reloaded[] = {20, 21, 22, 23, 24, 25, 26, 27};
  prefill.rr().add_request(2, {.cached_slots = reloaded});
  CHECK(prefill.rows(2) == expected);

  // prefill/decode disaggregation: export here, import into another instance's blocks 3 and 4
  std::vector<std::int16_t> wire(2 * 4 * 4);
  prefill.rr().export_blocks(from, wire);
  small_replay<block_slot_replay> decode;
  const std::int64_t there[] = {3, 4};
  decode.rr().import_blocks(there, wire);
  const std::int64_t cached[] = {12, 13, 14, 15, 16, 17, 18, 19};
  decode.rr().add_request("r", {.cached_slots = cached});
  CHECK(decode.rows("r") == expected);

  // importing over a block makes older mappings to it stale, never foreign
  const std::int64_t over[] = {5};
  const std::vector<std::int16_t> other(16, 3);
  prefill.rr().import_blocks(over, other);
  CHECK(prefill.rr().extract(2).count_missing_rows() == 4);

  rr_test::expect_error([&] { prefill.rr().export_blocks(std::vector<std::int64_t>{8}, wire); },
                        rr::errc::slot_out_of_range, {"block 8", "[0, 8)"});
  rr_test::expect_error([&] { prefill.rr().export_blocks(from, std::span{wire}.first(5)); },
                        rr::errc::invalid_argument, {"need 32 ids", "has 5"});
  rr_test::expect_error([&] { prefill.rr().copy_blocks(from, std::vector<std::int64_t>{1, 2}); },
                        rr::errc::invalid_argument, {"block 1 is both"});
}

TEST_CASE_TEMPLATE("block-slot storage: requests longer than a page of position metadata (runs, prefix hits, reuse)",
                   RR, block_slot_replay, block_slot_deferred, block_slot_scattered)
{
  // position metadata comes in pages of 512 positions, the first 8 of a request reached through its
  // entry and the rest through a list: runs, a cached prefix and reads cross them
  for (const std::int64_t ready : {std::int64_t{0}, std::int64_t{-1}}) {  // pages made on demand, or some ready
    CAPTURE(ready);
    auto config                = rr_test::small_config();
    config.max_tokens_per_step = 300;
    config.max_model_len       = 4800;
    config.block_size          = 16;
    config.num_blocks          = 400;
    config.host_memory_ahead   = ready;
    small_replay<RR> s{config};
    const auto slots_from = [](std::int64_t first, std::int64_t n) {
      std::vector<std::int64_t> v(static_cast<std::size_t>(n));
      std::iota(v.begin(), v.end(), first);
      return v;
    };
    // a step of `n` positions of request `id` from `first`, in KV block `block` (fresh), ids salted
    const auto step_in_fresh_block = [&](std::int64_t id, std::int64_t first, std::int32_t n, std::int64_t block,
                                         std::int64_t salt) {
      const auto slots            = slots_from(block * config.block_size, n);
      const std::int64_t fresh[] = {block};
      rr::step_plan plan;
      plan.schedule({id, first, n, 0, slots});
      plan.add_fresh_blocks(fresh);
      s.step(plan, salt);
    };
    // request 1: 4600 positions (9 pages) in chunks of 300 at slots equal to their positions
    s.rr().add_request(1);
    std::vector<std::int16_t> expected;
    for (std::int64_t chunk = 0; chunk < 16; ++chunk) {
      const std::int64_t first = 300 * chunk;
      const std::int64_t n     = std::min<std::int64_t>(300, 4600 - first);
      const auto slots         = slots_from(first, n);
      rr::step_plan plan;
      plan.schedule({1, first, static_cast<std::int32_t>(n), 0, slots});
      s.step(plan, chunk + 1);
      for (std::int64_t row = 0; row < n; ++row) {
        const auto r = small_row<std::int16_t>(row, chunk + 1);
        expected.insert(expected.end(), r.begin(), r.end());
      }
    }
    CHECK(s.rows(1) == expected);
    // request 2 hits 600 of those positions as a cached prefix, then computes two in its own block
    const auto cached = slots_from(0, 600);
    s.rr().add_request(2, {.cached_slots = cached});
    step_in_fresh_block(2, 600, 2, 300, 9);
    auto expected2 = std::vector<std::int16_t>(expected.begin(), expected.begin() + 600 * 4);
    for (std::int64_t row = 0; row < 2; ++row) {
      const auto r = small_row<std::int16_t>(row, 9);
      expected2.insert(expected2.end(), r.begin(), r.end());
    }
    CHECK(s.rows(2) == expected2);
    // both go; request 3 takes their pages back as they are (nothing refills a page): its
    // unwritten positions read as missing, not as request 1's rows (their slots still hold them)
    s.rr().release(1);
    s.rr().release(2);
    s.rr().add_request(3);
    step_in_fresh_block(3, 4300, 5, 350, 11);  // on its ninth page
    const auto rows3 = s.rr().extract(3);
    CHECK(rows3.count_missing_rows() == 4300);
    CHECK(std::vector<std::int16_t>(rows3.flat().end() - 4, rows3.flat().end()) == small_row<std::int16_t>(4, 11));
  }
}

TEST_CASE_TEMPLATE("block-slot storage: a long run of new positions over slots held in the same generation",
                   RR, block_slot_replay, block_slot_deferred, block_slot_scattered)
{
  // A run this long writes its position entries with streaming stores, and the store gathers its
  // rows into ranges as it claims: slots another request claimed in the same block generation break
  // the ranges (first write wins, or the row is replaced), and both kinds of row must read back.
  for (const bool overwrite : {false, true}) {
    CAPTURE(overwrite);
    auto config                      = rr_test::small_config();
    config.max_tokens_per_step       = 128;
    config.max_model_len             = 256;
    config.block_size                = 16;
    config.num_blocks                = 16;
    config.overwrite_recomputed_rows = overwrite;
    small_replay<RR> s{config};
    const auto slots_from = [](std::int64_t first, std::int64_t n) {
      std::vector<std::int64_t> v(static_cast<std::size_t>(n));
      std::iota(v.begin(), v.end(), first);
      return v;
    };
    // request 1: positions [0, 100) at slots 0..99, then it goes (its rows stay at their slots)
    s.rr().add_request(1);
    const auto slots1 = slots_from(0, 100);
    rr::step_plan plan1;
    plan1.schedule({1, 0, 100, 0, slots1});
    s.step(plan1, 1);
    s.rr().release(1);
    // request 2: a cached prefix of 40 positions, then [40, 140) at slots 40..139: 40..99 are held
    const auto cached = slots_from(0, 40);
    s.rr().add_request(2, {.cached_slots = cached});
    const auto slots2 = slots_from(40, 100);
    rr::step_plan plan2;
    plan2.schedule({2, 40, 100, 0, slots2});
    s.step(plan2, 2);
    std::vector<std::int16_t> expected;
    for (std::int64_t p = 0; p < 140; ++p) {
      const bool held = p < 100;  // request 1's row at this slot, unless overwritten
      const auto r    = held && !(overwrite && p >= 40) ? small_row<std::int16_t>(p, 1) : small_row<std::int16_t>(p - 40, 2);
      expected.insert(expected.end(), r.begin(), r.end());
    }
    CHECK(s.rows(2) == expected);
  }
}

TEST_CASE("per-request storage reads prefix-cache positions as missing")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  const std::int64_t cached[] = {0, 1, 2};
  s.rr().add_request(1, {.prompt_length = 5, .cached_slots = cached});
  CHECK(s.rr().recorded_rows(1) == 3);
  s.step(plan_for(1, 3, 2, slots), 1);
  const auto r = s.rr().extract(1);
  CHECK(r.count_missing_rows() == 3);
  CHECK(std::vector<std::int16_t>(r.flat().begin() + 12, r.flat().end()) ==
        concat<std::int16_t>({small_row<std::int16_t>(0, 1), small_row<std::int16_t>(1, 1)}));
}

TEST_CASE("CUDA-graph padding rows past N are reset, so they never pass for a later step's rows")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  s.forward(6, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 5; });  // 4 pad rows
  s.end_step();
  // next step: 5 rows, but layer 2 writes only 2 of them; rows 2..4 held padding last step
  s.rr().begin_step(plan_for(1, 2, 5, slots), s.stream());
  s.forward(5, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 5; }, 1);
  auto view = s.rr().layer_view(2, 2);
  per_request_replay::backend_type::bulk_async(
    4, [view](std::int64_t i) { view(i / 2, i % 2) = 1; }, s.stream());
  rr_test::expect_error([&] { s.end_step(); }, rr::errc::missing_routing, {"layer 2", "position 4"});
}

TEST_CASE("a forward run outside any step cannot pass for the next step's rows")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  // a warm-up forward writes every layer with no step open
  s.forward(4, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 2; });
  per_request_replay::backend_type::synchronize(s.stream());
  // the first real step forgets layer 2: its warm-up rows must not be stored
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; }, 1);
  rr_test::expect_error([&] { s.end_step(); }, rr::errc::missing_routing, {"layer 2"});
  CHECK(s.rr().recorded_rows(1) == 0);
}

TEST_CASE("a failing task on a host stream surfaces as backend_error from end_step, once")
{
  small_replay<per_request_replay> s;
  std::vector<std::int64_t> slots;
  s.rr().add_request(1);
  s.rr().begin_step(plan_for(1, 0, 2, slots), s.stream());
  s.forward(2, [](std::int32_t, std::int64_t, std::int32_t) -> std::int64_t { return 3; });
  per_request_replay::backend_type::bulk_async(
    1, [](std::int64_t) { throw std::runtime_error{"router kernel fault"}; }, s.stream());
  rr_test::expect_error([&] { s.end_step(); }, rr::errc::backend_error, {"router kernel fault"});
  CHECK(s.rr().recorded_rows(1) == 0);
  s.step(plan_for(1, 0, 2, slots), 1);  // reported once: the next step is clean
  CHECK(s.rr().recorded_rows(1) == 2);
}

TEST_CASE("host backend: streams run in order, asynchronously; events order streams")
{
  rr::host_stream a;
  rr::host_stream b;
  rr::host_event done;
  std::atomic<int> value{0};
  std::atomic<bool> release{false};
  rr::host_backend::bulk_async(1, [&](std::int64_t) {
    while (!release.load()) { std::this_thread::yield(); }
    value = 1;
  }, a.ref());
  rr::host_backend::record(done, a.ref());
  rr::host_backend::wait(b.ref(), done);
  int seen = -1;
  rr::host_backend::bulk_async(1, [&](std::int64_t) { seen = value.load(); }, b.ref());
  CHECK_FALSE(rr::host_backend::ready(done));  // the caller was not blocked: work is in flight
  release = true;
  rr::host_backend::synchronize(b.ref());
  CHECK(seen == 1);  // b's task ran after a's, through the event
  CHECK(rr::host_backend::ready(done));
}

TEST_CASE("host_inline_scope: an idle stream runs the holder's work at once, in order, failures reported as usual")
{
  rr::host_stream s;
  rr::host_event done;
  const auto caller = std::this_thread::get_id();
  {
    rr::host_inline_scope scope{s.ref()};
    REQUIRE(scope.active());
    std::thread::id ran_on{};
    int order = 0;
    rr::host_backend::bulk_async(1, [&](std::int64_t) { ran_on = std::this_thread::get_id(); order = 1; }, s.ref());
    CHECK(ran_on == caller);  // before the launch returned, on this thread
    rr::host_backend::bulk_async(1, [&](std::int64_t) { order = order == 1 ? 2 : -1; }, s.ref());
    CHECK(order == 2);
    rr::host_backend::record(done, s.ref());
    CHECK(rr::host_backend::ready(done));
    rr::host_backend::bulk_async(1, [](std::int64_t) { throw std::runtime_error{"inline fault"}; }, s.ref());
  }
  rr_test::expect_error([&] { s.synchronize(); }, rr::errc::backend_error, {"inline fault"});
  s.synchronize();  // reported once
}

TEST_CASE("host_inline_scope: holds nothing on a busy stream; other threads' work waits for it")
{
  rr::host_stream s;
  std::atomic<bool> release{false};
  rr::host_backend::bulk_async(1, [&](std::int64_t) {
    while (!release.load()) { std::this_thread::yield(); }
  }, s.ref());
  {
    rr::host_inline_scope busy{s.ref()};
    CHECK_FALSE(busy.active());  // work is running: the launch below is queued behind it
    std::thread::id ran_on{};
    rr::host_backend::bulk_async(1, [&](std::int64_t) { ran_on = std::this_thread::get_id(); }, s.ref());
    release = true;
    s.synchronize();
    CHECK(ran_on != std::this_thread::get_id());
  }
  std::vector<int> order;
  std::mutex order_mutex;
  auto note = [&](int v) {
    const std::lock_guard lock{order_mutex};
    order.push_back(v);
  };
  std::atomic<bool> other_started{false};
  std::thread other;
  {
    rr::host_inline_scope scope{s.ref()};
    REQUIRE(scope.active());
    other = std::thread{[&] {
      other_started = true;
      rr::host_backend::bulk_async(1, [&](std::int64_t) { note(2); }, s.ref());  // waits for the scope
    }};
    while (!other_started.load()) { std::this_thread::yield(); }
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
    rr::host_backend::bulk_async(1, [&](std::int64_t) { note(1); }, s.ref());
  }
  other.join();
  s.synchronize();
  CHECK(order == std::vector<int>{1, 2});
}
