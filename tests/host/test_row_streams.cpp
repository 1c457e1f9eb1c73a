// Row streams (routing_replay::row_streams) driven as vLLM 0.33 drives its worker connector:
// begin_step metadata, then prepare and commit per step. Rows are a function of (content, position,
// layer, k), so a request that shares a prefix with another gets the same rows back; every output
// is checked against that function. Scenarios: tails, whole blocks that bypass them, blocks waiting
// for their keys, prefix hits served from the tier, rejected drafts and the capture cursor's
// reattachment, deferred teardown, generation reset, a first step that starts mid-block, and each
// refusal; then randomized traces with prefix sharing, drafts and finishes, every output checked;
// and the filing worker running deferred tasks once waited for, and before it stops.
#include <routing_replay/row_streams.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace rr = routing_replay;

namespace {

constexpr std::int32_t L = 2, K = 3, BS = 4;
constexpr std::size_t ROW = L * K;

std::uint8_t value(int content, std::int64_t position, int layer, int k)
{
  return static_cast<std::uint8_t>((content * 37 + position * 11 + layer * 5 + k) % 251);
}

std::vector<std::uint8_t> rows_of(int content, std::int64_t first, std::int64_t count)
{
  std::vector<std::uint8_t> out;
  for (std::int64_t p = first; p < first + count; ++p) {
    for (int l = 0; l < L; ++l) {
      for (int k = 0; k < K; ++k) { out.push_back(value(content, p, l, k)); }
    }
  }
  return out;
}

std::string hash_of(int content, std::int64_t block) { return "h" + std::to_string(content) + ":" + std::to_string(block); }

struct output {
  std::int64_t token_start;
  std::vector<std::uint8_t> rows;
};

// Collects a step's outputs by batch index.
struct collecting_sink {
  std::map<std::size_t, output>* outputs;
  void view(std::size_t i, std::int64_t start, const std::byte* rows, std::int64_t count)
  {
    const auto* p = reinterpret_cast<const std::uint8_t*>(rows);
    (*outputs)[i] = {start, std::vector<std::uint8_t>(p, p + count * static_cast<std::int64_t>(ROW))};
  }
  std::byte* materialize(std::size_t i, std::int64_t start, std::int64_t count)
  {
    (*outputs)[i] = {start, std::vector<std::uint8_t>(static_cast<std::size_t>(count) * ROW)};
    return reinterpret_cast<std::byte*>((*outputs)[i].rows.data());
  }
};

// One scheduled request of a step.
struct scheduled {
  std::string id;
  int content;                // what its rows are a function of
  std::int64_t token_start;   // num_computed_tokens
  std::int64_t tokens;        // scheduled this step
  std::int64_t rejected = 0;  // rejected drafts
  std::int64_t sampled  = 1;
};

// The engine side: ids to handles, metadata and steps.
struct engine {
  explicit engine(std::size_t max_bytes = 1 << 20, std::int32_t max_num_seqs = 4, std::int32_t batches = 2)
    : streams({.num_layers = L, .top_k = K, .element_bytes = 1, .block_size = BS, .max_num_seqs = max_num_seqs,
               .max_num_batched_tokens = 16, .max_concurrent_batches = batches, .max_bytes = max_bytes,
               .filing_depth = 4},
              [this](rr::row_streams::handle h) {
                for (const auto& [id, handle] : ids) {
                  if (handle == h) { return "request " + id; }
                }
                return std::string{"request ?"};
              })
  {
  }

  struct hashes {
    std::string id;
    std::vector<std::string> list;
  };

  void begin(std::uint64_t generation, const std::vector<std::pair<std::string, std::int64_t>>& requests,
             const std::vector<hashes>& block_hashes = {}, const std::vector<std::string>& finished = {},
             const std::vector<std::string>& retained = {}, const std::vector<std::string>& released = {})
  {
    std::string r = pack(retained), x = pack(released);
    streams.open_step(generation, packed(r, retained.size()), packed(x, released.size()));
    try {
      for (const auto& [id, emit] : requests) {
        auto it = ids.find(id);
        ids[id] = streams.schedule(it == ids.end() ? rr::row_streams::new_request : it->second, emit);
      }
      for (const auto& h : block_hashes) {
        std::string bytes = pack(h.list);
        streams.add_block_hashes(ids.at(h.id), packed(bytes, h.list.size()));
      }
      for (const auto& id : finished) { streams.finish(ids.at(id)); }
    } catch (...) {
      streams.abandon_step();
      forget();
      throw;
    }
    streams.close_step();
    forget();
  }

  int prepare(const std::vector<scheduled>& batch)
  {
    std::vector<rr::row_streams::handle> handles;
    std::vector<std::int64_t> starts, qsl{0};
    for (const scheduled& s : batch) {
      handles.push_back(ids.at(s.id));
      starts.push_back(s.token_start);
      qsl.push_back(qsl.back() + s.tokens);
    }
    return streams.prepare(handles, starts.data(), qsl.data());
  }

  std::map<std::string, output> process(int step, const std::vector<scheduled>& batch)
  {
    std::vector<std::uint8_t> rows;
    std::vector<std::int64_t> sampled, rejected;
    for (const scheduled& s : batch) {
      const auto r = rows_of(s.content, s.token_start, s.tokens);
      rows.insert(rows.end(), r.begin(), r.end());
      sampled.push_back(s.sampled);
      rejected.push_back(s.rejected);
    }
    std::map<std::size_t, output> by_index;
    collecting_sink sink{&by_index};
    try {
      streams.commit(step, reinterpret_cast<const std::byte*>(rows.data()), sampled.data(), rejected.data(), nullptr, sink);
    } catch (...) {
      streams.drain();  // the rows live in this frame: filing must be done with them
      forget();
      throw;
    }
    streams.drain();
    forget();
    std::map<std::string, output> out;
    for (auto& [i, o] : by_index) { out[batch[i].id] = std::move(o); }
    return out;
  }

  std::map<std::string, output> step(const std::vector<scheduled>& batch) { return process(prepare(batch), batch); }

  static std::string pack(const std::vector<std::string>& list)
  {
    std::string s;
    for (const auto& h : list) { s += std::string(8 - std::min<std::size_t>(8, h.size()), '.') + h.substr(0, 8); }
    return s;
  }
  static rr::packed_hashes packed(const std::string& bytes, std::size_t count)
  {
    return {reinterpret_cast<const std::byte*>(bytes.data()), count, 8};
  }
  void forget()
  {
    for (const rr::row_streams::handle h : streams.forgotten()) {
      for (auto it = ids.begin(); it != ids.end(); ++it) {
        if (it->second == h) {
          ids.erase(it);
          break;
        }
      }
    }
  }

  std::map<std::string, rr::row_streams::handle> ids;
  rr::row_streams streams;
};

void check_rows(const output& o, int content, std::int64_t start, std::int64_t count)
{
  CHECK(o.token_start == start);
  CHECK(o.rows == rows_of(content, start, count));
}

std::vector<std::string> block_hashes(int content, std::int64_t first, std::int64_t last)
{
  std::vector<std::string> out;
  for (std::int64_t b = first; b < last; ++b) { out.push_back(hash_of(content, b)); }
  return out;
}

}  // namespace

TEST_CASE("row streams: prefill and decode stream rows from the emit cursor; blocks go to the tier once keyed")
{
  engine e;
  e.begin(0, {{"a", 0}}, {{"a", block_hashes(1, 0, 1)}});  // the scheduler keys blocks the step completes
  auto out = e.step({{"a", 1, 0, 6}});                        // one whole block [0, 4), a tail [4, 6)
  check_rows(out.at("a"), 1, 0, 6);
  CHECK(e.streams.tier().stored_blocks() == 1);
  for (std::int64_t p = 6; p < 9; ++p) {
    e.begin(0, {{"a", 0}}, p == 8 ? std::vector<engine::hashes>{{"a", block_hashes(1, 1, 2)}} : std::vector<engine::hashes>{});
    out = e.step({{"a", 1, p, 1}});
    check_rows(out.at("a"), 1, p, 1);
  }
  CHECK(e.streams.tier().stored_blocks() == 2);  // [4, 8) completed in the tail, keyed at position 8
}

TEST_CASE("row streams: a block completed before its key waits in the pool, and is stored when the key comes")
{
  engine e;
  e.begin(0, {{"a", 0}});
  e.step({{"a", 1, 0, 8}});
  CHECK(e.streams.tier().stored_blocks() == 0);
  CHECK(e.streams.free_pool_slots() == e.streams.pool_slots() - 2);
  e.begin(0, {}, {{"a", block_hashes(1, 0, 2)}});  // a hash-only update
  e.streams.drain();
  CHECK(e.streams.tier().stored_blocks() == 2);
  CHECK(e.streams.free_pool_slots() == e.streams.pool_slots());
}

TEST_CASE("row streams: a prefix hit reads its rows back from the tier, and its tail from the step")
{
  engine e;
  e.begin(0, {{"a", 0}}, {{"a", block_hashes(7, 0, 2)}});
  e.step({{"a", 7, 0, 8}});
  e.begin(0, {}, {}, {"a"});  // finished: its keys are released, its blocks stay (unreferenced)
  CHECK(e.ids.empty());
  // b shares the first 8 positions: the KV cache hits them, the step computes [8, 11)
  e.begin(0, {{"b", 0}}, {{"b", block_hashes(7, 0, 2)}});
  auto out = e.step({{"b", 7, 8, 3}});
  check_rows(out.at("b"), 7, 0, 11);
  // emit start past the hit (a new turn): a view of the step's rows
  e.begin(0, {{"c", 9}}, {{"c", block_hashes(7, 0, 2)}});
  out = e.step({{"c", 7, 8, 3}});
  check_rows(out.at("c"), 7, 9, 2);
}

TEST_CASE("row streams: chunked prefill emits nothing until a token is sampled, then everything from the emit start")
{
  engine e;
  e.begin(0, {{"a", 2}}, {{"a", block_hashes(3, 0, 1)}});
  auto out = e.step({{"a", 3, 0, 5, 0, 0}});  // a chunk: nothing sampled
  CHECK(out.empty());
  e.begin(0, {{"a", 2}}, {{"a", block_hashes(3, 1, 2)}});
  out = e.step({{"a", 3, 5, 5}});  // the last chunk: [2, 10) from the tier and the tail
  check_rows(out.at("a"), 3, 2, 8);
}

TEST_CASE("row streams: rejected drafts are dropped, and the capture cursor reattaches behind an optimistic schedule")
{
  engine e;
  e.begin(0, {{"a", 0}});
  auto out = e.step({{"a", 1, 0, 3}});
  check_rows(out.at("a"), 1, 0, 3);
  // two steps in flight: the second was scheduled as if all 3 tokens of the first were accepted
  e.begin(0, {{"a", 0}});
  const std::vector<scheduled> first{{"a", 1, 3, 3, 2}};  // 1 accepted of 3
  const int s1 = e.prepare(first);
  e.begin(0, {{"a", 0}});
  const std::vector<scheduled> second{{"a", 1, 6, 2}};  // scheduled from 6; rows really from 4
  const int s2 = e.prepare(second);
  out = e.process(s1, first);
  check_rows(out.at("a"), 1, 3, 1);
  out = e.process(s2, {{"a", 1, 4, 2}});
  check_rows(out.at("a"), 1, 4, 2);
  CHECK(e.streams.request(e.ids.at("a")).capture_cursor == 6);
}

TEST_CASE("row streams: a request finished while a step covers it goes when that step is processed")
{
  engine e;
  e.begin(0, {{"a", 0}}, {{"a", block_hashes(1, 0, 1)}});
  e.step({{"a", 1, 0, 4}});
  e.begin(0, {{"a", 0}});
  const std::vector<scheduled> batch{{"a", 1, 4, 1}};
  const int step = e.prepare(batch);
  e.begin(0, {}, {}, {"a"});
  CHECK(e.streams.num_requests() == 1);  // deferred
  const auto out = e.process(step, batch);
  check_rows(out.at("a"), 1, 4, 1);
  CHECK(e.streams.num_requests() == 0);
  CHECK(e.ids.empty());
  CHECK(e.streams.tier().evictable_blocks() == 1);  // its key was released
}

TEST_CASE("row streams: a generation change releases every key and forgets every request and tail")
{
  engine e;
  e.begin(0, {{"a", 0}}, {{"a", block_hashes(1, 0, 1)}});
  e.step({{"a", 1, 0, 6}});
  const std::int32_t free_before = e.streams.free_pool_slots();
  CHECK(free_before == e.streams.pool_slots() - 1);  // a's tail
  e.begin(1, {{"b", 0}});
  CHECK(e.streams.generation() == 1);
  CHECK(e.streams.num_requests() == 1);
  CHECK(e.ids.count("a") == 0);
  CHECK(e.streams.free_pool_slots() == e.streams.pool_slots());
  e.streams.drain();
  CHECK(e.streams.tier().evictable_blocks() == 1);  // a's block of generation 0: released, evictable
  CHECK_THROWS_AS(e.begin(0, {}), rr::stream_input_error);  // backwards
  e.begin(1, {{"b", 0}});
  const std::vector<scheduled> batch{{"b", 2, 0, 1}};
  const int step = e.prepare(batch);
  CHECK_THROWS_AS(e.begin(2, {}), rr::error);  // a step in flight
  e.process(step, batch);
}

TEST_CASE("row streams: a first step that starts mid-block keeps that partial block out of the tier")
{
  engine e;
  // positions [0, 6) were computed on another instance; this one starts at 6 (block [4, 8))
  e.begin(0, {{"r", 6}}, {{"r", block_hashes(5, 0, 1)}});
  auto out = e.step({{"r", 5, 6, 1}});
  check_rows(out.at("r"), 5, 6, 1);
  e.begin(0, {{"r", 6}});
  out = e.step({{"r", 5, 7, 2}});
  check_rows(out.at("r"), 5, 7, 2);
  e.begin(0, {{"r", 6}}, {{"r", block_hashes(5, 1, 2)}});  // [4, 8): keyed, never stored here
  out = e.step({{"r", 5, 9, 3}});                          // completes [8, 12)
  check_rows(out.at("r"), 5, 9, 3);
  e.begin(0, {{"r", 6}}, {{"r", block_hashes(5, 2, 3)}});
  out = e.step({{"r", 5, 12, 1}});
  CHECK(e.streams.tier().stored_blocks() == 1);  // [8, 12) alone
  // a request emitting from before its first step here is told why the rows are not here
  e.begin(0, {{"s", 0}}, {{"s", block_hashes(9, 0, 1)}});
  CHECK_THROWS_WITH_AS(e.step({{"s", 9, 2, 3}}), doctest::Contains("another instance"), rr::error);
}

TEST_CASE("row streams: refusals name the request, the range and the block")
{
  SUBCASE("capture moving backwards")
  {
    engine e;
    e.begin(0, {{"a", 0}});
    e.step({{"a", 1, 0, 3}});
    e.begin(0, {{"a", 0}});
    CHECK_THROWS_WITH_AS(e.step({{"a", 1, 1, 1}}), doctest::Contains("request a: capture moved backwards"),
                         rr::stream_input_error);
  }
  SUBCASE("an unbacked gap")
  {
    engine e;
    e.begin(0, {{"a", 0}});
    e.step({{"a", 1, 0, 3}});
    e.begin(0, {{"a", 0}});
    CHECK_THROWS_WITH_AS(e.step({{"a", 1, 5, 1}}), doctest::Contains("[3, 5)"), rr::stream_input_error);
  }
  SUBCASE("emit cursor ahead")
  {
    engine e;
    e.begin(0, {{"a", 0}});
    e.step({{"a", 1, 0, 3}});
    CHECK_THROWS_WITH_AS(e.begin(0, {{"a", 5}}), doctest::Contains("emit start 5"), rr::stream_input_error);
  }
  SUBCASE("unknown requests in metadata")
  {
    engine e;
    e.ids["ghost"] = 3;
    CHECK_THROWS_AS(e.begin(0, {}, {{"ghost", {"x"}}}), rr::stream_input_error);
  }
  SUBCASE("too many steps in flight")
  {
    engine e;
    e.begin(0, {{"a", 0}});
    e.prepare({{"a", 1, 0, 1}});
    e.prepare({{"a", 1, 1, 1}});
    CHECK_THROWS_AS(e.prepare({{"a", 1, 2, 1}}), rr::error);
  }
  SUBCASE("rejected count out of range, zero tokens")
  {
    engine e;
    e.begin(0, {{"a", 0}});
    CHECK_THROWS_AS(e.step({{"a", 1, 0, 2, 3}}), rr::stream_input_error);
    e.begin(0, {{"b", 0}});
    CHECK_THROWS_AS(e.step({{"b", 1, 0, 0}}), rr::stream_input_error);
    CHECK(e.streams.steps_in_flight() == 0);  // refused steps are retired
  }
  SUBCASE("an evicted block")
  {
    engine e{2 * BS * ROW};  // a budget of two blocks
    e.begin(0, {{"a", 0}}, {{"a", block_hashes(1, 0, 2)}});
    e.step({{"a", 1, 0, 8}});
    e.begin(0, {}, {}, {"a"});
    e.begin(0, {{"c", 0}}, {{"c", block_hashes(2, 0, 2)}});
    e.step({{"c", 2, 0, 8}});  // a's blocks, unreferenced and oldest, make room
    e.begin(0, {{"b", 0}}, {{"b", block_hashes(1, 0, 2)}});
    CHECK_THROWS_WITH_AS(e.step({{"b", 1, 8, 1}}), doctest::Contains("need block 0 (positions [0, 4))"),
                         rr::block_store_error);
  }
  SUBCASE("an exhausted tail pool")
  {
    engine e{1 << 20, 1, 1};  // 1 * (16 / 4 + 1) + 1 = 6 slots
    e.begin(0, {{"a", 0}});
    e.step({{"a", 1, 0, 16}});  // four blocks wait for keys
    e.begin(0, {{"a", 0}});
    e.step({{"a", 1, 16, 5}});  // a fifth waits, a tail takes the sixth
    e.begin(0, {{"a", 0}});
    CHECK_THROWS_WITH_AS(e.step({{"a", 1, 21, 7}}), doctest::Contains("tail-pool slot"), rr::error);
  }
}

TEST_CASE("row streams: randomized traces with prefix sharing, chunked prefill, drafts and finishes")
{
  std::mt19937 rng{1127};
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  for (int trace = 0; trace < 60; ++trace) {
    engine e{1 << 22, 4, 2};
    struct live_request {
      std::string id;
      int content;
      std::int64_t prompt, emit, computed, keys_sent, end, emitted;
      bool done = false;
    };
    std::vector<live_request> live;
    std::map<int, std::int64_t> stored_prefix;  // content -> positions stored in the tier (block aligned)
    int next_id = 0;
    for (int step = 0; step < 40; ++step) {
      while (live.size() < 3 && pick(0, 2) == 0) {
        live_request r;
        r.id      = "r" + std::to_string(next_id++);
        r.content = static_cast<int>(pick(0, 2));
        r.prompt  = pick(1, 14);
        const std::int64_t hit = std::min(stored_prefix[r.content], (r.prompt - 1) / BS * BS);
        r.computed  = pick(0, 1) ? hit : 0;
        r.keys_sent = 0;
        r.emit      = pick(0, 1) ? 0 : pick(0, r.prompt - 1);
        r.end       = r.prompt + pick(1, 10);
        r.emitted   = r.emit;
        live.push_back(r);
      }
      std::vector<std::pair<std::string, std::int64_t>> meta;
      std::vector<engine::hashes> hashes;
      std::vector<scheduled> batch;
      std::int64_t budget = 16;
      for (live_request& r : live) {
        if (budget == 0) { break; }
        std::int64_t tokens = 0, drafts = 0;
        if (r.computed < r.prompt) {
          tokens = std::min({r.prompt - r.computed, budget, pick(1, 8)});
        } else {
          drafts = pick(0, 2);
          tokens = std::min(1 + drafts, budget);
          drafts = tokens - 1;
        }
        budget -= tokens;
        meta.emplace_back(r.id, r.emit);
        // keys of blocks made of known tokens: the prompt's, and settled positions
        const std::int64_t known = std::min(r.computed + tokens, std::max(r.prompt, r.computed));
        const std::int64_t keyed = known / BS;
        if (keyed > r.keys_sent) {
          hashes.push_back({r.id, block_hashes(r.content, r.keys_sent, keyed)});
          r.keys_sent = keyed;
        }
        const bool samples = r.computed + tokens >= r.prompt;
        const std::int64_t rejected = drafts > 0 ? pick(0, drafts) : 0;
        batch.push_back({r.id, r.content, r.computed, tokens, rejected, samples ? 1 : 0});
      }
      std::vector<std::string> finished;
      for (live_request& r : live) {
        if (r.computed >= r.end && std::none_of(batch.begin(), batch.end(), [&](const scheduled& s) { return s.id == r.id; })) {
          finished.push_back(r.id);
          r.done = true;
        }
      }
      e.begin(0, meta, hashes, finished);
      for (const live_request& r : live) {
        if (r.done) { stored_prefix[r.content] = std::max(stored_prefix[r.content], std::min(r.keys_sent, r.computed / BS) * BS); }
      }
      std::erase_if(live, [](const live_request& r) { return r.done; });
      if (batch.empty()) { continue; }
      const auto out = e.step(batch);
      for (const scheduled& s : batch) {
        live_request& r = *std::find_if(live.begin(), live.end(), [&](const live_request& x) { return x.id == s.id; });
        const std::int64_t accepted = s.tokens - s.rejected;
        const auto it = out.find(s.id);
        if (s.sampled > 0 && r.emitted <= s.token_start + accepted) {
          REQUIRE(it != out.end());
          CHECK(it->second.token_start == r.emitted);
          const auto n = static_cast<std::int64_t>(it->second.rows.size() / ROW);
          CHECK(r.emitted + n == s.token_start + accepted);
          check_rows(it->second, r.content, r.emitted, n);
          r.emitted += n;
        } else {
          CHECK(it == out.end());
        }
        r.computed += accepted;
      }
    }
  }
}

TEST_CASE("filing worker: deferred tasks run when waited for, and before the worker stops")
{
  std::atomic<int> ran{0};
  {
    rr::detail::filing_worker<int> worker{16, [&](int& task) { ran.fetch_add(task); }};
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // past its idle spin: asleep
    for (int i = 0; i < 3; ++i) {  // fewer than a quarter of the slots: no wake
      worker.next() = 1;
      worker.submit(true);
    }
    worker.wait_for(2);  // waiting wakes it
    CHECK(ran.load() >= 2);
    worker.drain();
    CHECK(ran.load() == 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    worker.next() = 10;
    worker.submit(true);
  }  // stopping runs what was deferred
  CHECK(ran.load() == 13);
}
