// slot_rows on the host backend: rows stored at KV slots the "device" holds, for every stored index
// type and every way a step reaches the pool (a scatter on a side stream or on the compute stream,
// the end-of-step kernel itself); reads widened and checked, base64 written in parts; layers never
// captured, a captured layer missing from a step, invalid ids, slots outside the pool, padded graph
// batches, the engine reusing its slot array, a ring that wraps, and steps still in flight at the end.
#include <routing_replay/host_backend.hpp>
#include <routing_replay/npy.hpp>
#include <routing_replay/slot_rows.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace rr = routing_replay;

namespace {

constexpr std::int32_t layers_total = 4;  // model layers 0..3; the tests capture 1..3 (0: dense)
constexpr std::int32_t top_k        = 2;
constexpr std::int32_t experts      = 100;
constexpr std::int64_t pool_slots   = 64;

rr::slot_rows_config small_config(bool on_compute = false)
{
  rr::slot_rows_config c;
  c.num_experts               = experts;
  c.top_k                     = top_k;
  c.num_fused_shared_experts  = 1;
  c.max_tokens_per_step       = 16;
  c.num_model_layers          = layers_total;
  c.num_slots                 = pool_slots;
  c.page_size                 = 4;
  c.steps_in_flight           = 2;
  c.scatter_on_compute_stream = on_compute;
  return c;
}

// the id of (slot, layer, column) in a step numbered `step`: a pure function, so any misplaced or
// stale row shows
std::int64_t id_of(std::int64_t slot, std::int32_t layer, std::int32_t column, std::int64_t step)
{
  return (slot * 7 + layer * 13 + column * 3 + step * 5) % experts;
}

// One engine: a compute stream, the step's router outputs ([rows, K + 1], the shared column last)
// and slot arrays kept alive until the stream has run what reads them.
template <class Index>
struct engine {
  explicit engine(rr::slot_rows_config c = small_config()) : rows(c) {}

  std::vector<std::vector<std::int64_t>> kept;  // router outputs and slots, alive to the end
  rr::host_stream compute;
  rr::slot_rows<rr::host_backend, Index> rows;  // destroyed first: it waits for its steps

  // captures `layers` for rows at `slots` (plus `padding` rows of -1) and ends the step
  std::uint64_t step(const std::vector<std::int64_t>& slots, std::int64_t step_no,
                     const std::vector<std::int32_t>& layers = {1, 2, 3}, std::int64_t padding = 0,
                     const rr::slot_step_options& options = {}, std::int64_t padding_id = -1)
  {
    const auto n = static_cast<std::int64_t>(slots.size());
    for (const std::int32_t layer : layers) {
      auto& ids = kept.emplace_back(static_cast<std::size_t>((n + padding) * (top_k + 1)), padding_id);
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int32_t c = 0; c < top_k; ++c) {
          ids[static_cast<std::size_t>(r * (top_k + 1) + c)] = id_of(slots[static_cast<std::size_t>(r)], layer, c, step_no);
        }
        ids[static_cast<std::size_t>(r * (top_k + 1) + top_k)] = experts + 5;  // the shared expert: dropped
      }
      rows.capture(layer, ids.data(), n + padding, compute.ref());
    }
    auto& s = kept.emplace_back(slots);
    return rows.end_step(s.data(), n, compute.ref(), options);
  }

  std::vector<std::int32_t> read(const std::vector<std::int64_t>& slots)
  {
    std::vector<std::int32_t> out(slots.size() * layers_total * top_k, -7);
    rows.template read<std::int32_t>(std::span<const std::int64_t>{slots}, out.data(),
                                     {.first_position = 10, .request = "request 3", .uncaptured_value = 0});
    return out;
  }
};

template <class Index>
void check_rows(const std::vector<std::int32_t>& out, const std::vector<std::int64_t>& slots, std::int64_t step_no)
{
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (std::int32_t layer = 0; layer < layers_total; ++layer) {
      for (std::int32_t c = 0; c < top_k; ++c) {
        const auto got = out[(i * layers_total + static_cast<std::size_t>(layer)) * top_k + static_cast<std::size_t>(c)];
        CHECK(got == (layer == 0 ? 0 : id_of(slots[i], layer, c, step_no)));
      }
    }
  }
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

TEST_CASE_TEMPLATE("slot_rows: rows land at their slots, widened; dense layers read 0", Index, std::uint8_t,
                   std::uint16_t, std::int32_t)
{
  for (const bool on_compute : {false, true}) {
    engine<Index> e{small_config(on_compute)};
    const std::vector<std::int64_t> slots{5, 9, 33, 4};
    const std::uint64_t serial = e.step(slots, 1);
    CHECK(serial == 1);
    e.rows.wait(serial);
    CHECK_NOTHROW(e.rows.throw_failure(serial));
    check_rows<Index>(e.read(slots), slots, 1);
    CHECK(e.rows.layer_captured(1));
    CHECK_FALSE(e.rows.layer_captured(0));
    CHECK(e.rows.pinned_bytes() >= static_cast<std::size_t>(pool_slots * layers_total * top_k) * sizeof(Index));
  }
}

TEST_CASE("slot_rows: base64 written in groups of rows equals the encoding of the read")
{
  engine<std::uint8_t> e;
  for (std::size_t count : {0u, 1u, 2u, 3u, 4u, 7u}) {
    std::vector<std::int64_t> slots;
    for (std::size_t i = 0; i < count; ++i) { slots.push_back(static_cast<std::int64_t>(40 + i)); }
    e.rows.wait(e.step(slots, 2));
    const auto out = e.read(slots);
    std::string field(e.rows.base64_chars<std::int32_t>(static_cast<std::int64_t>(count)), '?');
    e.rows.read_base64<std::int32_t>(std::span<const std::int64_t>{slots}, field.data());
    CHECK(field == rr::base64_encode(std::string_view{reinterpret_cast<const char*>(out.data()), out.size() * 4}));
  }
}

TEST_CASE("slot_rows: a captured layer missing from a step refuses the step; its rows read as missing")
{
  engine<std::uint8_t> e;
  e.rows.wait(e.step({1, 2}, 1));
  const std::uint64_t serial = e.step({3, 4}, 2, {1, 3});  // layer 2 was captured before
  e.rows.wait(serial);
  try {
    e.rows.throw_failure(serial);
    FAIL("no error");
  } catch (const rr::error& err) {
    CHECK(err.code() == rr::errc::missing_routing);
    CHECK(std::string{err.what()}.find("step 2: layer 2 (slot 2), row 0 holds no valid expert id") != std::string::npos);
  }
  CHECK_NOTHROW(e.rows.throw_failure(serial));  // once
  try {
    (void)e.read({2, 3});
    FAIL("no error");
  } catch (const rr::error& err) {
    CHECK(err.code() == rr::errc::missing_routing);
    CHECK(std::string{err.what()} ==
          "request 3, position 11 (KV slot 3) holds no routing for layer 1 (slot 1): no step wrote it, or the step "
          "that did was refused");
  }
  check_rows<std::uint8_t>(e.read({1, 2}), {1, 2}, 1);  // rows before the failure stay
}

TEST_CASE("slot_rows: a slot outside the pool refuses the step, and reads check slots too")
{
  engine<std::uint16_t> e;
  const std::uint64_t serial = e.step({7, pool_slots + 3}, 1);
  e.rows.wait(serial);
  CHECK(code_of([&] { e.rows.throw_failure(serial); }) == rr::errc::slot_out_of_range);
  CHECK(code_of([&] { (void)e.read({7}); }) == rr::errc::missing_routing);
  CHECK(code_of([&] { (void)e.read({-1}); }) == rr::errc::slot_out_of_range);
}

TEST_CASE("slot_rows: an invalid id in a step's row is refused, padding rows of a replayed graph are not checked")
{
  engine<std::uint8_t> e;
  std::vector<std::int64_t> ids{1, 2, 3, experts};  // row 1's second id is E
  std::vector<std::int64_t> slots{20, 21};
  for (std::int32_t layer : {1, 2, 3}) { e.rows.capture(layer, ids.data(), 2, e.compute.ref(), 2); }
  const std::uint64_t bad = e.rows.end_step(slots.data(), 2, e.compute.ref());
  e.rows.wait(bad);
  CHECK(code_of([&] { e.rows.throw_failure(bad); }) == rr::errc::missing_routing);
  // a graph replay wrote 6 rows, the step has 2: rows 2..5 hold -1 (SGLang's padding) and are not checked
  const std::uint64_t good = e.step({22, 23}, 3, {1, 2, 3}, 4, {.graph_replayed = true, .padded_rows = 6});
  e.rows.wait(good);
  CHECK_NOTHROW(e.rows.throw_failure(good));
  check_rows<std::uint8_t>(e.read({22, 23}), {22, 23}, 3);
}

TEST_CASE("slot_rows: padding rows are reset, so a later step's unwritten row is never taken for one")
{
  engine<std::uint8_t> e;
  // a replayed graph wrote 6 rows of valid ids; the step has 2
  const std::uint64_t padded = e.step({1, 2}, 1, {1, 2, 3}, 4, {.graph_replayed = true, .padded_rows = 6}, 7);
  // the next step has 4 rows, but layer 3 is captured for 2 of them
  std::vector<std::int64_t> slots{3, 4, 5, 6};
  for (const std::int32_t layer : {1, 2, 3}) {
    auto& ids = e.kept.emplace_back(static_cast<std::size_t>(4 * (top_k + 1)), 1);
    e.rows.capture(layer, ids.data(), layer == 3 ? 2 : 4, e.compute.ref());
  }
  const std::uint64_t short_capture = e.rows.end_step(slots.data(), 4, e.compute.ref());
  e.rows.wait(short_capture);
  CHECK_NOTHROW(e.rows.throw_failure(padded));
  CHECK(code_of([&] { e.rows.throw_failure(short_capture); }) == rr::errc::missing_routing);
}

TEST_CASE("slot_rows: the engine may reuse its slot array once the compute stream ran the end of step")
{
  engine<std::uint8_t> e;
  std::vector<std::int64_t> slots{11, 12, 13};
  for (std::int32_t layer : {1, 2, 3}) {
    auto& ids = e.kept.emplace_back(static_cast<std::size_t>(3 * (top_k + 1)));
    for (std::int64_t r = 0; r < 3; ++r) {
      for (std::int32_t c = 0; c <= top_k; ++c) {
        ids[static_cast<std::size_t>(r * (top_k + 1) + c)] = id_of(slots[static_cast<std::size_t>(r)], layer, c, 1);
      }
    }
    e.rows.capture(layer, ids.data(), 3, e.compute.ref());
  }
  const std::uint64_t serial = e.rows.end_step(slots.data(), 3, e.compute.ref());
  e.compute.enqueue([&slots] { std::fill(slots.begin(), slots.end(), 60); });  // the next step's
  e.rows.wait(serial);
  e.compute.synchronize();
  check_rows<std::uint8_t>(e.read({11, 12, 13}), {11, 12, 13}, 1);
  CHECK(code_of([&] { (void)e.read({60}); }) == rr::errc::missing_routing);
}

TEST_CASE("slot_rows: randomized steps through a wrapping ring equal a plain model of the pool")
{
  for (const bool on_compute : {false, true}) {
    engine<std::uint8_t> e{small_config(on_compute)};
    std::mt19937_64 rng{on_compute ? 7u : 3u};
    std::vector<std::int64_t> step_of(pool_slots, -1);  // the model: which step last wrote a slot
    std::vector<std::uint64_t> serials;
    for (std::int64_t step = 1; step <= 40; ++step) {
      std::vector<std::int64_t> slots;
      const auto n = static_cast<std::int64_t>(rng() % 9);
      for (std::int64_t i = 0; i < n; ++i) {
        const auto s = static_cast<std::int64_t>(rng() % pool_slots);
        if (std::find(slots.begin(), slots.end(), s) == slots.end()) { slots.push_back(s); }
      }
      serials.push_back(e.step(slots, step));
      for (const std::int64_t s : slots) { step_of[static_cast<std::size_t>(s)] = step; }
      CHECK(e.rows.steps_in_flight() <= 2);
      if (rng() % 5 == 0) {
        e.rows.wait(serials.back());
        for (std::int64_t s = 0; s < pool_slots; ++s) {
          if (step_of[static_cast<std::size_t>(s)] < 0) { continue; }
          check_rows<std::uint8_t>(e.read({s}), {s}, step_of[static_cast<std::size_t>(s)]);
        }
      }
    }
    e.rows.wait(serials.back());
    CHECK_NOTHROW(e.rows.throw_failure(serials.back()));
    CHECK(e.rows.poll() == serials.back());
  }
}

TEST_CASE("slot_rows: steps stored by the end-of-step kernel alone and scattered ones interleave in one ring")
{
  // fused_scatter_max_rows 0: every step scattered; 4: steps of 0..8 rows both ways; 16: every step fused
  for (const std::int32_t fused_rows : {0, 4, 16}) {
    for (const bool on_compute : {false, true}) {
      CAPTURE(fused_rows);
      CAPTURE(on_compute);
      rr::slot_rows_config c  = small_config(on_compute);
      c.fused_scatter_max_rows = fused_rows;
      engine<std::uint16_t> e{c};
      std::mt19937_64 rng{static_cast<std::uint64_t>(fused_rows * 2 + (on_compute ? 1 : 0))};
      std::vector<std::int64_t> step_of(pool_slots, -1);
      std::uint64_t last = 0;
      for (std::int64_t step = 1; step <= 40; ++step) {
        std::vector<std::int64_t> slots;
        const auto n = static_cast<std::int64_t>(rng() % 9);
        for (std::int64_t i = 0; i < n; ++i) {
          const auto s = static_cast<std::int64_t>(rng() % 8);  // few slots: steps keep rewriting them
          if (std::find(slots.begin(), slots.end(), s) == slots.end()) { slots.push_back(s); }
        }
        if (step % 7 == 0 && !slots.empty()) {  // a refused step: a slot outside the pool
          slots.push_back(pool_slots + step);
          last = e.step(slots, step);
          e.rows.wait(last);
          CHECK(code_of([&] { e.rows.throw_failure(last); }) == rr::errc::slot_out_of_range);
          slots.pop_back();
          for (const std::int64_t s : slots) {
            step_of[static_cast<std::size_t>(s)] = -1;
            CHECK(code_of([&] { (void)e.read({s}); }) == rr::errc::missing_routing);
          }
          continue;
        }
        last = e.step(slots, step);
        for (const std::int64_t s : slots) { step_of[static_cast<std::size_t>(s)] = step; }
        if (rng() % 3 == 0) {
          e.rows.wait(last);
          for (std::int64_t s = 0; s < 8; ++s) {
            if (step_of[static_cast<std::size_t>(s)] >= 0) {
              check_rows<std::uint16_t>(e.read({s}), {s}, step_of[static_cast<std::size_t>(s)]);
            }
          }
        }
      }
      e.rows.wait(last);
      CHECK_NOTHROW(e.rows.throw_failure(last));
      CHECK(e.rows.steps_in_flight() == 0);
    }
  }
}

TEST_CASE("slot_rows: a layer map keeps only its layers; others read as uncaptured, capturing them is an error")
{
  rr::slot_rows_config c = small_config();
  c.layers               = {2, 3};
  engine<std::uint8_t> e{c};
  std::vector<std::int64_t> ids(6, 1);
  CHECK(code_of([&] { e.rows.capture(1, ids.data(), 2, e.compute.ref()); }) == rr::errc::unknown_layer);
  e.rows.wait(e.step({8, 9}, 1, {2, 3}));
  const auto out = e.read({8});
  for (std::int32_t layer = 0; layer < layers_total; ++layer) {
    CHECK(out[static_cast<std::size_t>(layer * top_k)] == (layer < 2 ? 0 : id_of(8, layer, 0, 1)));
  }
  const engine<std::uint8_t> every_layer;  // two layers more: two rows of K ids more a slot
  CHECK(e.rows.pinned_bytes() + static_cast<std::size_t>(pool_slots * 2 * top_k) == every_layer.rows.pinned_bytes());
}

TEST_CASE("slot_rows: configuration and argument errors")
{
  rr::slot_rows_config c = small_config();
  c.num_slots            = 0;
  CHECK(code_of([&] { rr::slot_rows<rr::host_backend, std::uint8_t> r{c}; }) == rr::errc::invalid_config);
  c            = small_config();
  c.num_experts = 300;
  CHECK(code_of([&] { rr::slot_rows<rr::host_backend, std::uint8_t> r{c}; }) == rr::errc::index_type_too_narrow);
  engine<std::uint8_t> e;
  std::vector<std::int64_t> slots(17, 1);
  CHECK(code_of([&] { (void)e.rows.end_step(slots.data(), 17, e.compute.ref()); }) == rr::errc::too_many_tokens);
  CHECK(code_of([&] { (void)e.rows.end_step(static_cast<const std::int64_t*>(nullptr), 2, e.compute.ref()); }) ==
        rr::errc::invalid_argument);
}

TEST_CASE("slot_rows: destroyed with steps in flight")
{
  for (int i = 0; i < 5; ++i) {
    engine<std::int32_t> e;
    (void)e.step({1, 2, 3}, 1);
    (void)e.step({4}, 2);
  }
}
