// Each part of the data path on its own (host backend), not through RoutingReplay: the request
// registry, the step planner's acceptance and rejection rules, the capture buffer's end-of-step
// kernel, the copy pipeline's slot reuse and drain order, and the row filer's claims.
#include "../support/small_replay.hpp"

#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/data_path/copy_pipeline.hpp>
#include <routing_replay/data_path/request_registry.hpp>
#include <routing_replay/data_path/row_filer.hpp>
#include <routing_replay/data_path/row_reader.hpp>
#include <routing_replay/data_path/step_planner.hpp>
#include <routing_replay/detail/host_storage/position_pages.hpp>
#include <routing_replay/host_backend.hpp>
#include <routing_replay/host_storage.hpp>

#include <doctest/doctest.h>

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace rr = routing_replay;

namespace {

using index_t = std::int16_t;

// small_config(): model layer 0 is dense, 1 and 2 are MoE; K = 2 plus one fused shared expert;
// E = 8; N_max = 8; 32 positions; 8 blocks of 4 slots.
rr::replay_config parts_config() { return rr_test::small_config(); }

using per_request_filer = rr::row_filer<index_t, rr::per_request_storage::store<index_t>, rr::scatter_site::host>;
using block_slot_filer  = rr::row_filer<index_t, rr::block_slot_storage::store<index_t>, rr::scatter_site::host>;
// per-request rows a kernel writes (device_scatter): claimed when the step begins
using scattered_filer = rr::row_filer<index_t, rr::host_store<rr::per_request_storage, rr::host_backend, index_t, true>,
                                      rr::scatter_site::device>;

// The planner, the registry and a filer, as RoutingReplay holds them.
template <class Filer>
struct planning {
  rr::replay_config config = parts_config();
  rr::layer_map layers{config};
  rr::request_registry requests;
  Filer filer{config, layers};
  rr::row_reader<index_t, typename Filer::store_type, Filer::claims_when_planned> reader{config, layers};
  rr::step_planner<index_t> planner{config};

  std::uint32_t add(rr::request_key id)
  {
    const std::uint32_t h = requests.add(id);
    filer.store().open(h);
    return h;
  }
  void plan(const rr::step_plan& p)
  {
    planner.validate(p, requests, filer);
    planner.open(p, requests, filer);
  }
};

template <class F>
rr::errc code_of(F&& f)
{
  try {
    f();
  } catch (const rr::error& e) {
    return e.code();
  }
  FAIL("no routing_replay::error thrown");
  return rr::errc::invalid_state;
}

}  // namespace

TEST_CASE("request_registry: dense handles, reused with a new generation")
{
  rr::request_registry r;
  const auto a = r.add("a");
  const auto b = r.add(7);
  CHECK(a != b);
  CHECK(r.size() == 2);
  CHECK(code_of([&] { r.add("a"); }) == rr::errc::duplicate_request);
  CHECK(code_of([&] { (void)r.find("zz"); }) == rr::errc::unknown_request);
  const auto generation = r[a].generation;
  r.remove(a);
  CHECK_FALSE(r.contains("a"));
  const auto c = r.add("c");
  CHECK(c == a);  // the freed handle is reused ...
  CHECK(r[c].generation == generation + 1);  // ... and rows in flight for its old use are told apart
  CHECK(r[c].recorded_rows == 0);
}

TEST_CASE("step_validator: every rejection rule leaves nothing changed; step_planner: an accepted plan becomes the record")
{
  planning<per_request_filer> p;
  const auto h = p.add("r");
  p.add("s");
  auto rejects = [&](const rr::step_plan& plan) {
    return code_of([&] { p.planner.validate(plan, p.requests, p.filer); });
  };
  rr::step_plan plan;
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = 9});
  CHECK(rejects(plan) == rr::errc::too_many_tokens);
  plan.clear();
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = -1});
  CHECK(rejects(plan) == rr::errc::invalid_plan);
  plan.clear();
  plan.schedule({.id = "nobody", .first_position = 0, .num_tokens = 1});
  CHECK(rejects(plan) == rr::errc::unknown_request);
  plan.clear();
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = 1});
  plan.schedule({.id = "r", .first_position = 1, .num_tokens = 1});
  CHECK(rejects(plan) == rr::errc::duplicate_request);
  plan.clear();
  plan.schedule({.id = "r", .first_position = 31, .num_tokens = 2});
  CHECK(rejects(plan) == rr::errc::position_out_of_range);
  plan.clear();
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = 2, .num_draft_tokens = 3});
  CHECK(rejects(plan) == rr::errc::invalid_plan);
  CHECK_FALSE(p.planner.is_open());
  CHECK(p.planner.latest_serial() == 0);
  CHECK(p.filer.store().bytes_in_use() == 0);

  plan.clear();
  plan.skip(2);
  plan.schedule({.id = "r", .first_position = 5, .num_tokens = 3, .num_draft_tokens = 1});
  plan.set_padded_rows(8);
  p.plan(plan);
  CHECK(p.planner.is_open());
  CHECK(p.planner.schedules(p.requests[h]));
  CHECK(code_of([&] { p.planner.validate(plan, p.requests, p.filer); }) == rr::errc::invalid_state);
  const rr::step_record<index_t>& record = *p.planner.open_step();
  CHECK(record.serial == 1);
  CHECK(record.num_rows == 5);
  CHECK(record.padded_rows == 8);
  REQUIRE(record.runs.size() == 1);
  CHECK(record.runs[0].handle == h);
  CHECK(record.runs[0].first_row == 2);
  CHECK(record.runs[0].first_position == 5);
  CHECK(record.runs[0].num_draft == 1);
  REQUIRE(p.requests[h].drafts.size() == 1);
  CHECK(p.requests[h].drafts[0].first_position == 7);
  CHECK(p.filer.store().bytes_in_use() > 0);  // reserved when the step opened, so filing never allocates
  CHECK(&p.planner.close() == &record);
  CHECK_FALSE(p.planner.is_open());
  CHECK(code_of([&] { (void)p.planner.close(); }) == rr::errc::invalid_state);
}

TEST_CASE("step_planner: host memory limit, exact growth when doubling would cross it")
{
  // rows of 4 ids (8 bytes) in segments of one page (4 KiB, 512 rows) up to 16 pages
  planning<per_request_filer> p;
  p.config.max_model_len     = 8192;
  p.config.host_memory_limit = 20 * 1024;
  p.filer                    = per_request_filer{p.config, p.layers};
  p.planner                  = rr::step_planner<index_t>{p.config};
  p.add("r");
  auto step = [&](std::int64_t first, std::int32_t count) {
    rr::step_plan plan;
    plan.schedule({.id = "r", .first_position = first, .num_tokens = count});
    p.plan(plan);
    (void)p.planner.close();
    return p.filer.store().bytes_in_use();
  };
  CHECK(step(0, 8) == 4096);        // the first segment
  CHECK(step(8, 8) == 4096);        // still room
  CHECK(step(900, 8) == 8192);      // a segment of the capacity: doubling
  CHECK(step(1400, 8) == 16384);    // doubling again
  CHECK(step(2100, 8) == 20480);    // doubling (16 KiB more) would cross the limit: exactly a page
  rr::step_plan plan;
  plan.schedule({.id = "r", .first_position = 2600, .num_tokens = 1});
  CHECK(code_of([&] { p.planner.validate(plan, p.requests, p.filer); }) == rr::errc::host_memory_exhausted);
}

TEST_CASE("step_planner: a device scatter's common step is planned while it is validated, any other the long way")
{
  static_assert(scattered_filer::plans_fresh_runs && !per_request_filer::plans_fresh_runs);
  // rows of 4 ids (8 bytes): a request's first segment is one page, 512 rows
  planning<scattered_filer> p;
  p.config.max_model_len = 1024;
  p.filer                = scattered_filer{p.config, p.layers};
  p.planner              = rr::step_planner<index_t>{p.config};
  const auto a = p.add("a");
  const auto b = p.add("b");
  auto step = [&](const rr::step_plan& plan) {
    p.plan(plan);
    const rr::step_record<index_t> record = *p.planner.open_step();
    (void)p.planner.close();
    p.filer.retired(record);
    return record;
  };
  // both requests grow in the first step (the long way), decode in the next (planned)
  rr::step_plan plan;
  plan.schedule(rr::request_handle{a, 0}, 0, 3);
  plan.schedule(rr::request_handle{b, 0}, 0, 2);
  const auto first = step(plan);
  REQUIRE(first.ops.size() == 2);
  plan.clear();
  plan.schedule(rr::request_handle{a, 0}, 3, 1);
  plan.skip(1);
  plan.schedule(rr::request_handle{b, 0}, 2, 1);
  const auto decode = step(plan);
  REQUIRE(decode.runs.size() == 2);
  REQUIRE(decode.ops.size() == 2);
  CHECK(decode.runs[1].handle == b);
  CHECK(decode.runs[1].first_row == 2);
  CHECK(decode.runs[1].recorded_before == 2);
  CHECK(decode.runs[1].recorded_after == 3);
  CHECK(decode.ops[1].src == 2 * p.filer.row_elems());
  CHECK(decode.ops[1].elems == p.filer.row_elems());
  // the rows follow those of the first step in each request's segment
  CHECK(decode.ops[0].dst == first.ops[0].dst + 3 * p.filer.row_elems());
  CHECK(decode.ops[1].dst == first.ops[1].dst + 2 * p.filer.row_elems());
  CHECK(p.requests[a].recorded_rows == 4);
  CHECK(p.requests[b].recorded_rows == 3);

  // a plan refused after runs were planned leaves nothing changed, and the next is planned anew
  plan.clear();
  plan.schedule(rr::request_handle{a, 0}, 4, 1);
  plan.schedule({.id = "nobody", .first_position = 0, .num_tokens = 1});
  CHECK(code_of([&] { p.planner.validate(plan, p.requests, p.filer); }) == rr::errc::unknown_request);
  CHECK(p.requests[a].recorded_rows == 4);
  CHECK(p.planner.open_step() == nullptr);
  // a plan accepted, then given up (what fails between validate() and open()), also
  plan.clear();
  plan.schedule(rr::request_handle{a, 0}, 4, 1);
  p.planner.validate(plan, p.requests, p.filer);
  CHECK(p.requests[a].recorded_rows == 5);  // claimed for the step open() would open
  p.planner.abandon(p.requests, p.filer);
  CHECK(p.requests[a].recorded_rows == 4);
  CHECK(p.requests[a].open_step == p.planner.latest_serial());
  CHECK(p.planner.open_step() == nullptr);
  // a recomputed position of b (claimed already) goes the long way; a's run was planned first
  plan.clear();
  plan.schedule(rr::request_handle{a, 0}, 4, 1);
  plan.schedule(rr::request_handle{b, 0}, 1, 2);
  const auto recompute = step(plan);
  REQUIRE(recompute.runs.size() == 2);
  CHECK(recompute.runs[0].recorded_after == 5);
  CHECK(recompute.runs[1].recorded_after == 3);
  CHECK(recompute.ops.size() == 1);  // b's rows stay (first write wins): a's piece alone
  // the refused and abandoned plans gave a's claims back: its row lies right after the last
  CHECK(recompute.ops[0].dst == decode.ops[0].dst + p.filer.row_elems());
  CHECK(recompute.runs[0].recorded_before == 4);
  // drafts go the long way too, and open their group; b's run beside them is planned
  plan.clear();
  plan.schedule(rr::request_handle{a, 0}, 5, 2, 1);
  plan.schedule(rr::request_handle{b, 0}, 3, 1);
  const auto drafted = step(plan);
  REQUIRE(drafted.runs.size() == 2);
  CHECK(drafted.runs[0].handle == a);  // batch order, whichever way each run went
  CHECK(drafted.runs[0].num_draft == 1);
  CHECK(drafted.ops.size() == 2);
  CHECK(p.requests[a].drafts.size() == 1);
  CHECK(p.requests[b].recorded_rows == 4);
  // a request that grows (past its first segment's 512 rows) goes the long way in a step whose
  // other run is planned
  p.filer.accept_draft("a", a, 1, p.requests, p.planner.ended_serial());
  plan.clear();
  plan.schedule(rr::request_handle{b, 0}, 4, 1);
  plan.schedule(rr::request_handle{a, 0}, 509, 7);
  const auto bytes_before = p.filer.store().bytes_in_use();
  const auto grows        = step(plan);
  CHECK(p.filer.store().bytes_in_use() > bytes_before);
  REQUIRE(grows.runs.size() == 2);
  CHECK(grows.runs[0].handle == b);
  CHECK(grows.runs[1].recorded_before == 7);
  CHECK(grows.runs[1].recorded_after == 516);
  REQUIRE(grows.ops.size() == 3);  // b's planned piece first, then a's rows on both sides of its new segment
  CHECK(grows.ops[0].dst == decode.ops[1].dst + 2 * p.filer.row_elems());
  CHECK(grows.ops[1].elems + grows.ops[2].elems == 7 * p.filer.row_elems());
  CHECK(grows.ops[1].dst == first.ops[0].dst + 509 * p.filer.row_elems());
  CHECK(p.requests[a].recorded_rows == 516);
  CHECK(p.requests[b].recorded_rows == 5);
}

TEST_CASE("step_planner: block-slot plans check slots and blocks, then claim every row when the step opens")
{
  planning<block_slot_filer> p;
  p.add("r");
  const std::vector<std::int64_t> slots{4, 5, 6};
  const std::vector<std::int64_t> short_slots{4, 5};
  const std::vector<std::int64_t> twice{4, 4, 5};
  const std::vector<std::int64_t> outside{4, 5, 32};
  auto rejects = [&](std::span<const std::int64_t> s, std::span<const std::int64_t> fresh = {}) {
    rr::step_plan plan;
    plan.schedule({.id = "r", .first_position = 0, .num_tokens = 3, .slots = s});
    plan.add_fresh_blocks(fresh);
    return code_of([&] { p.planner.validate(plan, p.requests, p.filer); });
  };
  CHECK(rejects(short_slots) == rr::errc::slot_out_of_range);
  CHECK(rejects(twice) == rr::errc::slot_out_of_range);
  CHECK(rejects(outside) == rr::errc::slot_out_of_range);
  const std::vector<std::int64_t> bad_block{8};
  CHECK(rejects(slots, bad_block) == rr::errc::slot_out_of_range);

  const std::vector<std::int64_t> fresh{1};
  rr::step_plan plan;
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = 3, .slots = slots});
  plan.add_fresh_blocks(fresh);
  const auto generation = p.filer.store().generation_of(4);
  p.plan(plan);
  CHECK(p.filer.store().generation_of(4) == generation + 1);  // fresh before the step's own claims
  const auto& record = *p.planner.open_step();
  REQUIRE(record.ops.size() == 1);  // claimed when planned: three rows to consecutive slots, one piece
  CHECK(record.ops[0].src == 0);
  CHECK(record.ops[0].elems == 3 * 4);
  CHECK(record.runs[0].recorded_before == 0);
  CHECK(record.runs[0].recorded_after == 3);
}

TEST_CASE("capture_buffer: capture, then the end-of-step kernel checks, snapshots token-major and resets")
{
  const rr::replay_config config = parts_config();
  const rr::layer_map layers{config};
  rr::capture_buffer<rr::host_backend, index_t, rr::layer_major> buffer{config, layers};
  rr::host_stream stream;
  // 3 rows of [K + 1 shared] ids per layer (the shared column is skipped); layer 2 leaves row 2
  // unwritten
  const std::vector<std::int64_t> ids1{1, 2, 9, 3, 4, 9, 5, 6, 9};
  const std::vector<std::int64_t> ids2{7, 0, 9, 1, 2, 9};
  buffer.begin_step(3, stream.ref());
  buffer.capture(1, ids1.data(), 3, stream.ref());
  buffer.capture(2, ids2.data(), 2, stream.ref());
  CHECK(code_of([&] { buffer.capture(0, ids1.data(), 3, stream.ref()); }) == rr::errc::unknown_layer);
  CHECK(code_of([&] { (void)buffer.ref(9); }) == rr::errc::too_many_tokens);
  std::vector<index_t> snapshot(3 * 4, 0);
  rr::detail::step_status status{};
  buffer.end_step(snapshot.data(), &status, 3, -1, stream.ref());
  stream.synchronize();
  CHECK(snapshot == std::vector<index_t>{1, 2, 7, 0, 3, 4, 1, 2, 5, 6, -1, -1});
  CHECK(status.unwritten.count == 1);
  CHECK(status.unwritten.layer == 1);
  CHECK(status.unwritten.row == 2);
  // D was reset: a step that writes nothing reports every (layer, row) unwritten
  buffer.begin_step(3, stream.ref());
  rr::detail::step_status empty{};
  buffer.end_step(snapshot.data(), &empty, 3, -1, stream.ref());
  stream.synchronize();
  CHECK(empty.unwritten.count == 6);
}

namespace {

// A sink that records what the copy pipeline hands it, and what arrived.
struct recording_sink {
  std::vector<std::string> calls;
  std::vector<std::vector<index_t>> rows;
  template <class Slot>
  void file(Slot& slot)
  {
    calls.push_back("file " + std::to_string(slot.step.serial));
    rows.emplace_back(slot.staging.begin(), slot.staging.begin() + slot.step.num_rows * 4);
  }
  void discard(const rr::step_record<index_t>& s) { calls.push_back("discard " + std::to_string(s.serial)); }
  void retired(const rr::step_record<index_t>& s) { calls.push_back("retired " + std::to_string(s.serial)); }
};

// Pushes step `serial` of 2 rows whose ids all equal `serial`; the "kernel" runs on `compute`.
template <class Pipeline>
void push_step(Pipeline& pipeline, std::uint64_t serial, rr::host_stream& compute, recording_sink& sink)
{
  rr::step_record<index_t> step;
  step.serial   = serial;
  step.num_rows = 2;
  pipeline.push(
    step,
    [](const rr::step_record<index_t>& s, index_t* snapshot, rr::detail::step_status*, rr::host_stream_ref c) {
      rr::host_backend::bulk_async(
        8, [snapshot, v = static_cast<index_t>(s.serial)](std::int64_t i) { snapshot[i] = v; }, c);
    },
    compute.ref(),
    sink);
}

}  // namespace

TEST_CASE("copy_pipeline: sync_copy files each step in its own push")
{
  rr::copy_pipeline<rr::host_backend, index_t, rr::sync_copy> pipeline{8, 4};
  rr::host_stream compute;
  recording_sink sink;
  push_step(pipeline, 1, compute, sink);
  CHECK(pipeline.size() == 0);
  push_step(pipeline, 2, compute, sink);
  CHECK(sink.calls == std::vector<std::string>{"retired 1", "file 1", "retired 2", "file 2"});
  CHECK(sink.rows == std::vector<std::vector<index_t>>{std::vector<index_t>(8, 1), std::vector<index_t>(8, 2)});
}

TEST_CASE("copy_pipeline: a full ring retires its oldest step before reusing the slot; drains go oldest first")
{
  rr::host_stream compute;
  rr::host_stream copies;
  rr::copy_pipeline<rr::host_backend, index_t, rr::double_buffered<2>> pipeline{8, 4, copies.ref()};
  recording_sink sink;
  // hold the copy stream shut so that nothing completes behind the test's back
  std::atomic<bool> open{false};
  copies.enqueue([&] { while (!open.load()) { std::this_thread::yield(); } });
  push_step(pipeline, 1, compute, sink);
  push_step(pipeline, 2, compute, sink);
  CHECK(pipeline.size() == 2);
  CHECK(sink.calls.empty());
  open = true;
  push_step(pipeline, 3, compute, sink);  // the ring is full: step 1 is retired first, its slot reused
  REQUIRE(sink.calls.size() >= 2);
  CHECK(sink.calls[0] == "retired 1");
  CHECK(sink.calls[1] == "file 1");
  pipeline.drain(sink, 2);  // up to step 2, and no later one
  pipeline.drain(sink);
  CHECK(pipeline.size() == 0);
  std::vector<std::string> files;
  for (const auto& c : sink.calls) {
    if (c.rfind("file", 0) == 0) { files.push_back(c); }
  }
  CHECK(files == std::vector<std::string>{"file 1", "file 2", "file 3"});
  for (std::size_t i = 0; i < sink.rows.size(); ++i) {  // every step's own rows, never another's
    CHECK(sink.rows[i] == std::vector<index_t>(8, static_cast<index_t>(i + 1)));
  }
}

TEST_CASE("copy_pipeline: async_event files the previous step at the next push; a failed forward discards its step")
{
  rr::host_stream compute;
  rr::copy_pipeline<rr::host_backend, index_t, rr::async_event> pipeline{8, 4};
  recording_sink sink;
  push_step(pipeline, 1, compute, sink);
  CHECK(pipeline.size() == 1);
  CHECK(sink.calls.empty());
  compute.enqueue([] { throw std::runtime_error("the forward failed"); });
  push_step(pipeline, 2, compute, sink);
  CHECK(sink.calls == std::vector<std::string>{"retired 1", "file 1"});
  CHECK(code_of([&] { pipeline.drain(sink); }) == rr::errc::backend_error);
  CHECK(sink.calls == std::vector<std::string>{"retired 1", "file 1", "discard 2", "retired 2"});
  CHECK(pipeline.size() == 0);
}

TEST_CASE("row_claimer: first write wins; row_filer: rows of a released request in flight are dropped, drafts resolve")
{
  planning<per_request_filer> p;
  const auto h = p.add("r");
  rr::step_plan plan;
  plan.schedule({.id = "r", .first_position = 0, .num_tokens = 2, .num_draft_tokens = 1});
  p.plan(plan);
  const rr::step_record<index_t> first = p.planner.close();
  const std::vector<index_t> staging{1, 1, 1, 1, 2, 2, 2, 2};
  rr::detail::step_status clean{};
  p.filer.retired(first);
  p.filer.file(first, clean, staging.data(), p.requests);
  CHECK(p.reader.readable_rows(h, p.requests, nullptr) == 1);  // the draft is tentative
  p.filer.accept_draft("r", h, 1, p.requests, p.planner.latest_serial());
  CHECK(p.reader.readable_rows(h, p.requests, nullptr) == 2);

  plan.clear();
  plan.schedule({.id = "r", .first_position = 1, .num_tokens = 1});  // recompute of position 1
  p.plan(plan);
  const rr::step_record<index_t> second = p.planner.close();
  const std::vector<index_t> later{9, 9, 9, 9};
  p.filer.retired(second);
  p.filer.file(second, clean, later.data(), p.requests);
  std::vector<index_t> out(8);
  p.reader.copy_rows(p.filer.store(), h, 0, 2, {}, out.data());
  CHECK(out == staging);  // the first routing recorded for a position wins

  rr::detail::step_status dirty{};
  dirty.unwritten.count = 1;
  CHECK(code_of([&] { p.filer.file(second, dirty, later.data(), p.requests); }) == rr::errc::missing_routing);
  p.filer.close(h, p.requests);
  CHECK(p.requests.size() == 0);
}

TEST_CASE("slot_pool: slots and blocks are checked; a fresh block's rows go stale; whole blocks go out and in")
{
  using store_type = rr::block_slot_storage::store<index_t>;  // a block_slot_store: its slot_pool's calls
  store_type store{parts_config(), 4};                        // 8 blocks of 4 slots, rows of 4 ids
  CHECK(store.num_blocks() == 8);
  CHECK(store.block_elems() == 4 * 4);
  store.begin_validation();
  const std::vector<std::int64_t> slots{4, 5};
  const std::vector<std::int64_t> again{5};
  store.check_slots(slots, 2);
  CHECK(code_of([&] { store.check_slots(again, 1); }) == rr::errc::slot_out_of_range);  // twice in one plan
  store.begin_validation();
  store.check_slots(again, 1);  // a new plan
  const std::vector<std::int64_t> outside{32};
  const std::vector<std::int64_t> no_block{8};
  CHECK(code_of([&] { store.check_slot_range(outside); }) == rr::errc::slot_out_of_range);
  CHECK(code_of([&] { store.check_blocks(no_block, "fresh"); }) == rr::errc::slot_out_of_range);

  store.open(0);
  store.reserve(0, 1, false);
  const std::uint32_t generation = store.generation_of(4);
  const auto claim               = store.claim(0, 0, 4, generation, 1, false);
  REQUIRE(claim.dst != nullptr);
  std::fill_n(claim.dst, 4, index_t{3});
  store.set_filed_through(1);
  std::vector<index_t> row(4);
  CHECK(store.read(0, 0, row.data()));
  CHECK(row == std::vector<index_t>(4, 3));
  const std::vector<std::int64_t> block_1{1};
  const std::vector<std::int64_t> block_2{2};
  std::vector<index_t> out(16);
  store.export_blocks(block_1, out.data());
  CHECK(out[0] == 3);
  CHECK(out[4] == -1);  // a slot never recorded holds the sentinel
  store.refresh_blocks(block_1);
  CHECK(store.generation_of(4) == generation + 1);
  CHECK(!store.read(0, 0, row.data()));  // stale: it reads as missing, never as another request's row
  store.import_blocks(block_2, out.data());
  std::vector<index_t> back(16);
  store.export_blocks(block_2, back.data());
  CHECK(back == out);
}

TEST_CASE("position_pages: entries are written up to a request's size; a page comes back from the pool as it was")
{
  // a Ref whose value-initialized form is not all zero bytes, as block_slot_store's
  struct ref {
    std::int32_t slot = -1;
    std::uint32_t step = 0;
  };
  using pages = rr::detail::position_pages<ref>;
  constexpr std::int64_t per_page = pages::page_positions;
  pages map{1};  // one page ready
  map.open(0);
  map.open(1);
  CHECK(map.size(0) == 0);
  map.reserve(0, 2 * per_page);
  CHECK(map.pooled() == 0);
  CHECK(map.size(0) == 0);  // room only
  // new positions, written without being read: [0, 10)
  map.for_each_new(0, 0, 10, [](std::size_t i, ref& at) { at = {static_cast<std::int32_t>(100 + i), 1}; });
  CHECK(map.size(0) == 10);
  CHECK(map.at(0, 9).slot == 109);
  // after a gap, across a page: [10, first) is written value-initialized
  const std::int64_t first = per_page - 3;
  map.for_each_new(0, first, 6, [&](std::size_t i, ref& at) { at = {static_cast<std::int32_t>(first + i), 2}; });
  CHECK(map.size(0) == first + 6);
  CHECK(map.at(0, 10).slot == -1);
  CHECK(map.at(0, first - 1).slot == -1);
  CHECK(map.at(0, per_page + 2).slot == per_page + 2);
  // for_each() and entry() past the size write the entries on the way value-initialized first
  int seen_unset = 0;
  map.for_each(0, first + 4, 10, [&](std::size_t, ref& at) { seen_unset += at.slot == -1 ? 1 : 0; });
  CHECK(seen_unset == 8);  // two were written above
  CHECK(map.size(0) == first + 14);
  CHECK(map.entry(0, 2 * per_page - 1).slot == -1);
  CHECK(map.size(0) == 2 * per_page);
  // the pages go back unrefilled; request 1 takes them, and sees none of request 0's entries
  map.close(0);
  CHECK(map.pooled() == 2);
  map.reserve(1, 2 * per_page);
  CHECK(map.size(1) == 0);
  map.for_each_new(1, per_page + 1, 1, [](std::size_t, ref& at) { at = {7, 3}; });
  CHECK(map.size(1) == per_page + 2);
  for (std::int64_t position = 0; position <= per_page; ++position) { REQUIRE(map.at(1, position).slot == -1); }
  CHECK(map.at(1, per_page + 1).slot == 7);
}

TEST_CASE("row_arena: buddy blocks split, merge and come back at the same arena address")
{
  rr::detail::row_arena<rr::detail::host_written_rows> arena{4096, 2};  // blocks of 4, 8, 16 KiB
  const auto a = arena.allocate(0);
  const auto b = arena.allocate(0);
  const auto c = arena.allocate(1);
  CHECK(a.offset == 0);
  CHECK(b.offset == 4096);  // a's buddy
  CHECK(c.offset == 8192);  // the other half of the superblock
  CHECK(arena.bytes_in_use() == 16384);
  std::memset(arena.address(c.offset), 7, 8192);  // the arena address is writable memory
  arena.release(a);
  arena.release(b);  // merges with a into an 8 KiB block
  CHECK(arena.bytes_in_use() == 8192);
  const auto d = arena.allocate(1);
  CHECK(d.offset == 0);
  const auto e = arena.allocate(2);  // no 16 KiB block left: a new superblock
  CHECK(e.offset == 16384);
  CHECK(arena.address(e.offset) != nullptr);
  arena.release(c);
  arena.release(d);
  arena.release(e);
  CHECK(arena.bytes_in_use() == 0);
}

TEST_CASE("row_arena: superblocks made ahead by the worker are taken first, at their own addresses")
{
  rr::detail::row_arena<rr::detail::host_written_rows> arena{4096, 1, /*ahead=*/8192};  // superblocks of 8 KiB: 2 ready
  std::vector<rr::detail::row_arena<rr::detail::host_written_rows>::block> blocks;
  for (int i = 0; i < 6; ++i) {  // three superblocks' worth: some made ahead, some made here
    blocks.push_back(arena.allocate(1));
    std::memset(arena.address(blocks.back().offset), i + 1, 8192);
  }
  std::vector<std::uint64_t> offsets;
  for (const auto& b : blocks) { offsets.push_back(b.offset); }
  std::sort(offsets.begin(), offsets.end());
  CHECK(std::adjacent_find(offsets.begin(), offsets.end()) == offsets.end());  // no superblock handed out twice
  for (std::size_t i = 0; i < blocks.size(); ++i) {  // every block kept what was written to it
    CHECK(*arena.address(blocks[i].offset) == static_cast<std::byte>(i + 1));
    CHECK(*(arena.address(blocks[i].offset) + 8191) == static_cast<std::byte>(i + 1));
  }
  CHECK(arena.bytes_in_use() == 6 * 8192);
  auto moved = std::move(arena);  // the worker's state moves with the arena
  CHECK(*moved.address(blocks[0].offset) == std::byte{1});
  for (const auto& b : blocks) { moved.release(b); }
  CHECK(moved.bytes_in_use() == 0);
}

TEST_CASE("row_arena: wait_until_ahead() returns once the worker holds every superblock it keeps ahead")
{
  auto file_bytes = [](int fd) {
    struct stat st{};
    REQUIRE(::fstat(fd, &st) == 0);
    return static_cast<std::size_t>(st.st_size);
  };
  rr::detail::row_arena<rr::detail::host_written_rows> none{4096, 1};
  none.wait_until_ahead();  // no worker: nothing to wait for
  CHECK(file_bytes(none.fd()) == 0);

  // 24 KiB ahead in superblocks of 8 KiB: three, plus the one for a step's partial superblock
  rr::detail::row_arena<rr::detail::host_written_rows> arena{4096, 1, /*ahead=*/3 * 8192};
  arena.wait_until_ahead();
  CHECK(file_bytes(arena.fd()) == 4 * 8192);  // made, and no more than asked for
  std::vector<rr::detail::row_arena<rr::detail::host_written_rows>::block> blocks;
  for (int i = 0; i < 3; ++i) { blocks.push_back(arena.allocate(1)); }  // taken from those made ahead
  CHECK(file_bytes(arena.fd()) <= 7 * 8192);
  arena.wait_until_ahead();  // the worker made three more
  CHECK(file_bytes(arena.fd()) == 7 * 8192);
  for (const auto& b : blocks) { arena.release(b); }
}

TEST_CASE("per_request_store: new positions are claimed as one range; a claimed one sends the run row by row")
{
  using store_type = rr::per_request_storage::store<index_t>;
  store_type store{parts_config(), 4};
  store.open(0);
  store.reserve(0, 8, false);
  index_t* first = store.claim_fresh(0, 0, 4, 1);
  REQUIRE(first != nullptr);
  CHECK(first + 3 * 4 == store.claim(0, 5, -1, 0, 2, false).dst - 2 * 4);  // contiguous rows
  CHECK(store.claim_fresh(0, 3, 3, 2) == nullptr);  // position 3 (step 1) and 5 (step 2) are taken
  CHECK(store.claim(0, 4, -1, 0, 2, false).dst != nullptr);  // ... and nothing changed: 4 is free
  CHECK(store.claim(0, 3, -1, 0, 2, false).dst == nullptr);   // first write wins
}

TEST_CASE("request_ranges: a view stays valid as the request grows; a closed request's segments wait for its steps")
{
  using store_type = rr::per_request_storage::store<index_t>;
  rr::replay_config config = parts_config();
  config.max_model_len     = 4096;  // rows of 8 bytes: segments of 4 KiB (512 rows) up to 32 KiB
  store_type store{config, 4};
  store.open(0);
  store.reserve(0, 8, false);
  auto* row = const_cast<index_t*>(store.contiguous(0, 0, 1));  // unclaimed rows read as sentinel
  REQUIRE(row != nullptr);
  CHECK(row[0] == -1);
  auto claim = store.claim(0, 0, -1, 0, 1, false);
  std::fill_n(claim.dst, 4, index_t{5});
  store.set_filed_through(1);
  const index_t* view = store.contiguous(0, 0, 1);
  store.reserve(0, 3000, false);  // grows by segments: nothing moves
  CHECK(store.contiguous(0, 0, 1) == view);
  CHECK(view[3] == 5);
  claim = store.claim(0, 2999, -1, 0, 2, false);  // a position in a later segment
  REQUIRE(claim.dst != nullptr);
  std::int64_t pieces = 0;
  store.device_pieces(0, claim.dst, 4, [&](index_t* dst, std::int64_t elems) {
    pieces += elems;
    std::fill_n(dst, elems, index_t{9});  // written at the arena address, as a kernel would
  });
  CHECK(pieces == 4);
  CHECK(claim.dst[0] == 9);  // ... and seen at the request's address
  const auto bytes = store.bytes_in_use();
  store.close(0);  // parked: no longer in use, but step 2 claimed rows of it and is not filed
  CHECK(store.bytes_in_use() == 0);
  store.open(1);
  store.reserve(1, 8, false);  // so a new request cannot take the range over yet
  CHECK(store.contiguous(1, 0, 1) != view);
  store.set_filed_through(2);
  store.open(2);
  CHECK(store.reserve(2, 3000, false));  // now it can, whole: no segment is mapped or allocated
  CHECK(store.contiguous(2, 0, 1) == view);
  CHECK(view[0] == -1);  // the old rows are not the new request's: unclaimed rows read as sentinel
  CHECK(store.bytes_in_use() == bytes + 4096);
  store.undo_reserve(2);  // parked again
  CHECK(store.bytes_in_use() == 4096);
  store.close(1);
  store.close(2);
  CHECK(store.bytes_in_use() == 0);
}

TEST_CASE("request_ranges: parked ranges go back to the arena when growth would cross the limit")
{
  using store_type = rr::per_request_storage::store<index_t>;
  rr::replay_config config = parts_config();
  config.max_model_len     = 4096;  // segments of 4 KiB (512 rows of 8 bytes) up to 32 KiB
  config.host_memory_limit = 3 * 4096;
  store_type store{config, 4};
  for (std::uint32_t h = 0; h < 3; ++h) {
    store.open(h);
    REQUIRE(store.reserve(h, 8, false));
  }
  store.close(0);
  store.close(1);  // two parked ranges: 8 KiB mapped, none of it in use
  CHECK(store.bytes_in_use() == 4096);
  store.open(0);
  // 12 KiB more than request 2's segment: does not fit in a parked range, and only fits under the
  // limit once both parked ranges are given back
  CHECK(store.reserve(0, 1024, true));
  CHECK(store.bytes_in_use() == 3 * 4096);
}
