// Worker and scheduler apart: workers pack each step's rows into step packets, a scheduler files
// them into host storage. Randomized schedules bit-exact against the reference model (also with
// packets filed late, and with a tensor-parallel worker group); every kind of bad packet rejected
// with a clear error and no change.
#include "../support/error_checks.hpp"
#include "../support/parallel_harness.hpp"
#include "../support/thread_ranks.hpp"

#include <routing_replay/parallel/packet_worker.hpp>
#include <routing_replay/parallel/scheduler_replay.hpp>
#include <routing_replay/parallel/thread_communicator.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

namespace rr = routing_replay;
using rr_test::expect_error;

namespace {

using mailbox = std::deque<std::vector<std::byte>>;

// The scheduler's half of the split, as rank_driver's filing hooks: it plans each step as the
// workers begin it, and files packets `lag` steps late (they cross a network), all of them before
// anything reads rows.
template <class Scheduler, class Worker>
struct packet_filing {
  Scheduler& scheduler;
  Worker& worker;
  mailbox& packets;
  std::size_t lag;

  void planned(const rr::step_plan& plan) { scheduler.begin_step(plan); }
  void ended()
  {
    scheduler.end_step();
    file_while([&] { return packets.size() > lag; });
  }
  void before_read()
  {
    worker.drain();
    file_while([&] { return !packets.empty(); });
  }
  template <class More>
  void file_while(More more)
  {
    while (more()) {
      scheduler.file(packets.front());
      packets.pop_front();
    }
  }
};

template <class Worker>
typename Worker::deliver_type into(mailbox& box)
{
  return [&box](std::span<const std::byte> p) { box.emplace_back(p.begin(), p.end()); };
}

// `ranks` worker ranks (threads, tensor parallel); the output rank packs, and its thread also plays
// the scheduler process.
template <class Worker, class Scheduler>
void run_split(int ranks, std::uint64_t seed, std::size_t lag)
{
  const rr_test::sim_config sim = rr_test::schedule_for_seed(seed);
  rr_test::harness_shape shape;
  shape.overwrite   = seed == 3;
  const auto config = rr_test::make_replay_config(sim, shape);
  rr_test::on_thread_ranks(ranks, [&](int, rr::thread_communicator comm) {
    mailbox packets;
    rr::parallel_replay<Worker, rr::thread_communicator> replay{config, {}, comm, into<Worker>(packets)};
    rr_test::rank_driver driver{replay, sim, shape, seed};
    if (!replay.is_output_rank()) {
      driver.run(static_cast<Scheduler*>(nullptr));
      return;
    }
    Scheduler scheduler{config};
    driver.run(&scheduler, packet_filing<Scheduler, Worker>{scheduler, replay.output(), packets, lag});
    CHECK(driver.rows_checked() > 0);
    CHECK(scheduler.steps_in_flight() == 0);
  });
}

}  // namespace

TEST_CASE_TEMPLATE("a scheduler filing workers' packets matches the reference model", Pair,
                   std::pair<rr::packet_worker<rr::host_backend, std::int16_t, rr::layer_major, rr::sync_copy>,
                             rr::scheduler_replay<std::int16_t, rr::per_request_storage>>,
                   std::pair<rr::packet_worker<rr::host_backend, std::uint8_t, rr::token_major, rr::double_buffered<3>>,
                             rr::scheduler_replay<std::uint8_t, rr::block_slot_storage>>,
                   std::pair<rr::packet_worker<rr::host_backend, std::int32_t, rr::token_major, rr::async_event>,
                             rr::scheduler_replay<std::int32_t, rr::block_slot_storage>>,
                   std::pair<rr::packet_worker<rr::host_backend, std::uint16_t, rr::layer_major, rr::double_buffered<2>>,
                             rr::scheduler_replay<std::uint16_t, rr::per_request_storage>>)
{
  using worker    = typename Pair::first_type;
  using scheduler = typename Pair::second_type;
  for (const std::uint64_t seed : {1, 3, 4, 8}) {
    CAPTURE(seed);
    run_split<worker, scheduler>(1, seed, 0);
    run_split<worker, scheduler>(1, seed, 2);  // packets arrive two steps late
    run_split<worker, scheduler>(2, seed, 1);  // a tensor-parallel worker group
  }
}

namespace {

using worker    = rr::packet_worker<rr::host_backend, std::int16_t, rr::layer_major, rr::sync_copy>;
using scheduler = rr::scheduler_replay<std::int16_t, rr::block_slot_storage>;

// One request, one step of 3 prefill rows on a worker (ids from small_id, or `bad` at row 1 of
// layer slot 0): returns the packet.
std::vector<std::byte> one_packet(const rr::replay_config& config, rr::request_key id, std::int64_t bad = -1,
                                  const std::vector<std::int64_t>& slots = {0, 1, 2})
{
  mailbox box;
  worker w{config, into<worker>(box)};
  rr::host_stream stream;
  rr::step_plan plan;
  plan.schedule({id, 0, 3, 0, slots});
  std::vector<std::int64_t> ids;
  for (std::int32_t slot = 0; slot < 2; ++slot) {
    for (std::int64_t r = 0; r < 3; ++r) {
      for (std::int32_t k = 0; k < 3; ++k) {  // K = 2 plus one fused shared expert
        ids.push_back(k == 2 ? 99 : (slot == 0 && r == 1 && k == 0 && bad >= 0 ? bad : rr_test::small_id(slot, r, k, 0)));
      }
    }
  }
  w.begin_step(plan, stream.ref());
  w.capture(1, ids.data(), 3, stream.ref());
  w.capture(2, ids.data() + 9, 3, stream.ref());
  w.end_step(stream.ref());
  stream.synchronize();
  REQUIRE(box.size() == 1);
  return box.front();
}

// A scheduler with request 'chat-7' whose step 1 (prefill of positions 0..2 at slots 0..2) waits for
// its packet.
struct waiting_scheduler {
  explicit waiting_scheduler(const rr::replay_config& config) : s{config}
  {
    s.add_request("chat-7");
    plan.schedule({"chat-7", 0, 3, 0, slots});
    s.begin_step(plan);
    REQUIRE(s.end_step() == 1);
  }
  std::vector<std::int64_t> slots{0, 1, 2};
  rr::step_plan plan;
  scheduler s;
};

void rehash(std::vector<std::byte>& p)
{
  const std::uint64_t h = rr::detail::xxhash64(std::span<const std::byte>{p}.first(p.size() - 8));
  std::memcpy(p.data() + p.size() - 8, &h, 8);
}

}  // namespace

TEST_CASE("bad packets are rejected with a clear error and change nothing")
{
  const auto config = rr_test::small_config();
  waiting_scheduler waiting{config};
  scheduler& s    = waiting.s;
  const auto good = one_packet(config, "chat-7");

  auto rejected = [&](std::vector<std::byte> p, std::initializer_list<std::string_view> fragments) {
    expect_error([&] { s.file(p); }, rr::errc::invalid_packet, fragments);
    CHECK(s.steps_in_flight() == 1);
    CHECK(s.waiting_for() == 1);
  };
  SUBCASE("truncated") { rejected({good.begin(), good.end() - 3}, {"truncated", std::to_string(good.size() - 3)}); }
  SUBCASE("not a packet") { rejected(std::vector<std::byte>(good.size(), std::byte{7}), {"magic"}); }
  SUBCASE("another format version")
  {
    auto p = good;
    p[4]   = std::byte{2};
    rejected(p, {"format version 2", "version 1"});
  }
  SUBCASE("a corrupted payload")
  {
    auto p           = good;
    p[p.size() - 12] ^= std::byte{1};
    rejected(p, {"corrupted", "checksum"});
  }
  SUBCASE("a shape mismatch")
  {
    auto wider  = config;
    wider.top_k = 3;
    waiting_scheduler other{wider};
    expect_error([&] { other.s.file(good); }, rr::errc::invalid_packet, {"shape mismatch", "x 2 ids", "x 3 of 2"});
    CHECK(other.s.steps_in_flight() == 1);
  }
  SUBCASE("another index type")
  {
    auto p = good;
    p[8]   = std::byte{'u'};
    rehash(p);
    rejected(p, {"shape mismatch"});
  }
  SUBCASE("an unknown request") { rejected(one_packet(config, "ghost"), {"unknown request 'ghost'", "'chat-7'"}); }
  SUBCASE("slots that differ from the plan") { rejected(one_packet(config, "chat-7", -1, {4, 5, 6}), {"KV slots"}); }
  SUBCASE("a packet of another step")
  {
    auto p = good;
    p[24]  = std::byte{2};  // serial
    rehash(p);
    rejected(p, {"of step 2", "step 1 is waited for"});
  }
  SUBCASE("malformed runs")
  {
    auto p = good;
    p[20]  = std::byte{9};  // nine runs
    rehash(p);
    rejected(p, {"malformed"});
  }
  // after any rejection the good packet files, and the rows are the worker's
  s.file(good);
  CHECK(s.steps_in_flight() == 0);
  const auto got = s.extract("chat-7");
  std::vector<std::int16_t> expected;
  for (std::int64_t r = 0; r < 3; ++r) {
    const auto row = rr_test::small_row<std::int16_t>(r, 0);
    expected.insert(expected.end(), row.begin(), row.end());
  }
  CHECK(std::vector<std::int16_t>(got.flat().begin(), got.flat().end()) == expected);
}

TEST_CASE("a problem the worker's device found is reported by the scheduler, naming the request")
{
  const auto config = rr_test::small_config();
  waiting_scheduler waiting{config};
  scheduler& s = waiting.s;
  expect_error([&] { (void)s.recorded_rows("chat-7"); }, rr::errc::invalid_state, {"waiting for its packet"});
  expect_error([&] { s.file(one_packet(config, "chat-7", 42)); }, rr::errc::invalid_expert_id,
               {"step 1", "expert id 42", "request 'chat-7', position 1", "discarded"});
  CHECK(s.steps_in_flight() == 0);
  CHECK(s.recorded_rows("chat-7") == 0);

  SUBCASE("a plan naming a request by handle makes no packet: handles are local to one replay")
  {
    rr::step_plan by_handle;
    by_handle.schedule({rr::request_handle{0, 1}, 0, 1, 0, {}});
    rr::step_packet_writer<std::int16_t> w{2, 2};
    expect_error([&] { w.begin(by_handle, 3); }, rr::errc::invalid_argument, {"handle 0.1", "request ids"});
  }

  SUBCASE("a step the worker lost is discarded")
  {
    s.begin_step(waiting.plan);
    s.end_step();
    rr::step_packet_writer<std::int16_t> w{2, 2};
    w.begin(waiting.plan, 2);
    const auto lost = w.finish({}, nullptr);
    expect_error([&] { s.file(lost); }, rr::errc::backend_error, {"step 2", "lost"});
    CHECK(s.recorded_rows("chat-7") == 0);
  }
}
