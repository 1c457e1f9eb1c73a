// kept_rows_pool: slices of pre-faulted memory (no page fault on the taking thread once the pool
// is filled), extents reused once their slices are let go, growth past the budget made by the
// filling thread, extents past the budget given back, a filling thread that fails, and releases
// from several threads at once (host_schedule_tests runs this file under ThreadSanitizer). And
// per-request storage's growth: superblocks made ahead, and counted where a step made its own.
#include <routing_replay/config.hpp>
#include <routing_replay/detail/host_storage/per_request_store.hpp>
#include <routing_replay/detail/host_storage/row_arena.hpp>
#include <routing_replay/detail/host_storage/row_memory.hpp>
#include <routing_replay/kept_rows_pool.hpp>

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

namespace rr = routing_replay;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

// Sanitizers map shadow memory for the pages a thread first writes: their faults are theirs.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool counts_faults = false;
#else
constexpr bool counts_faults = true;
#endif

// Minor page faults of the calling thread so far.
long thread_minflt()
{
  rusage u{};
  ::getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

// Waits (bounded) until `done()` holds.
template <class F>
bool eventually(F done)
{
  for (int i = 0; i < 2000; ++i) {
    if (done()) { return true; }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

// Memory whose allocation fails after `allowed` extents (the filling thread's, then the taker's).
struct failing_memory {
  std::atomic<int>* allowed = nullptr;
  [[nodiscard]] void* allocate(std::size_t bytes) const
  {
    if (allowed->fetch_sub(1) <= 0) { throw std::bad_alloc{}; }
    return rr::host_kept_memory{}.allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) const noexcept { rr::host_kept_memory{}.deallocate(p, bytes); }
  void enter_filling_thread() const noexcept {}
};

}  // namespace

TEST_CASE("kept_rows_pool: slices of a filled pool are aligned, disjoint and fault nothing on the taking thread")
{
  rr::kept_rows_pool<> pool{{.extent_bytes = 2 * mib, .budget_bytes = 8 * mib, .ahead_bytes = 2 * mib}};
  pool.wait_until_filled();
  const auto filled = pool.stats();
  CHECK(filled.size_bytes >= 8 * mib);
  CHECK(filled.extents_in_step == 0);

  std::vector<rr::kept_rows_pool<>::slice> slices;
  slices.reserve(8);  // the test's own memory, before counting
  const long before = thread_minflt();
  for (std::size_t bytes : {100u, 393216u, 1u, 700000u, 65536u, 1000000u, 3000u}) {
    slices.push_back(pool.take(bytes));
    std::memset(slices.back().data, 0x5a, bytes);  // every byte written: its pages were faulted in ahead
  }
  if (counts_faults) { CHECK(thread_minflt() - before == 0); }
  for (const auto& s : slices) { CHECK(reinterpret_cast<std::uintptr_t>(s.data) % rr::kept_rows_pool<>::alignment == 0); }
  std::vector<rr::kept_rows_pool<>::slice> sorted = slices;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.data < b.data; });
  for (std::size_t i = 1; i < sorted.size(); ++i) { CHECK(sorted[i - 1].data + sorted[i - 1].bytes <= sorted[i].data); }
  CHECK(pool.stats().extents_in_step == 0);
  CHECK(pool.stats().high_water_bytes >= 100 + 393216 + 700000 + 65536 + 1000000);
  for (const auto& s : slices) { pool.release(s); }
  CHECK(pool.stats().in_use_bytes == 0);
  CHECK(pool.take(0).data == nullptr);
}

TEST_CASE("kept_rows_pool: slices let go step by step keep the pool at its size (extents reused whole)")
{
  rr::kept_rows_pool<> pool{{.extent_bytes = mib, .budget_bytes = 3 * mib, .ahead_bytes = mib}};
  pool.wait_until_filled();
  const std::size_t size = pool.stats().size_bytes;
  std::vector<rr::kept_rows_pool<>::slice> in_flight;
  for (int step = 0; step < 500; ++step) {  // each step's slice held for two steps, as a filing task holds it
    in_flight.push_back(pool.take(300000));
    std::memset(in_flight.back().data, step, in_flight.back().bytes);
    if (in_flight.size() > 2) {
      pool.release(in_flight.front());
      in_flight.erase(in_flight.begin());
    }
  }
  for (const auto& s : in_flight) { pool.release(s); }
  const auto s = pool.stats();
  CHECK(s.size_bytes == size);
  CHECK(s.extents_in_step == 0);
  CHECK(s.extents_freed == 0);
  CHECK(s.slices == 500);
}

TEST_CASE("kept_rows_pool: a consumer that keeps past the budget makes the filling thread grow the pool, and it shrinks back")
{
  rr::kept_rows_pool<> pool{{.extent_bytes = mib, .budget_bytes = 2 * mib, .ahead_bytes = 2 * mib}};
  pool.wait_until_filled();
  std::vector<rr::kept_rows_pool<>::slice> kept;
  for (int step = 0; step < 40; ++step) {  // 20 MiB kept, ten times the budget
    kept.push_back(pool.take(mib / 2));
    std::memset(kept.back().data, 1, kept.back().bytes);
    pool.wait_until_filled();  // a step long enough for the filling thread to catch up
  }
  auto s = pool.stats();
  CHECK(s.size_bytes >= 20 * mib);
  CHECK(s.extents_over_budget > 0);
  CHECK(s.extents_in_step == 0);  // the filling thread kept ahead
  CHECK(s.high_water_bytes >= 20 * mib);
  for (const auto& k : kept) { pool.release(k); }
  CHECK(eventually([&] { return pool.stats().size_bytes <= 4 * mib; }));  // the budget and what is kept ahead
  s = pool.stats();
  CHECK(s.extents_freed > 0);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.size_high_water_bytes >= 20 * mib);

  pool.set_budget(8 * mib);  // the engine raises the budget: filled ahead again
  pool.wait_until_filled();
  CHECK(pool.stats().size_bytes >= 8 * mib);
}

TEST_CASE("kept_rows_pool: without give_back, extents emptied past the budget stay (pinned memory of a CUDA backend)")
{
  rr::kept_rows_pool<> pool{{.extent_bytes = mib, .budget_bytes = mib, .ahead_bytes = mib, .give_back = false}};
  pool.wait_until_filled();
  std::vector<rr::kept_rows_pool<>::slice> kept;
  for (int i = 0; i < 8; ++i) {
    kept.push_back(pool.take(mib));
    pool.wait_until_filled();
  }
  const std::size_t grown = pool.stats().size_bytes;
  CHECK(grown >= 8 * mib);
  kept.push_back(pool.take(3 * mib));  // larger than an extent: one of its own, kept too
  pool.wait_until_filled();
  const std::size_t with_large = pool.stats().size_bytes;
  CHECK(with_large >= grown + 3 * mib);
  for (const auto& k : kept) { pool.release(k); }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(pool.stats().size_bytes == with_large);
  CHECK(pool.stats().extents_freed == 0);
  CHECK(pool.stats().in_use_bytes == 0);
}

TEST_CASE("kept_rows_pool: a burst past what is ready makes the taking thread make an extent, never wait or fail")
{
  rr::kept_rows_pool<> pool{{.extent_bytes = mib, .budget_bytes = mib, .ahead_bytes = mib}};
  pool.wait_until_filled();
  std::vector<rr::kept_rows_pool<>::slice> kept;
  for (int i = 0; i < 64; ++i) { kept.push_back(pool.take(mib)); }  // 64 MiB at once
  for (const auto& k : kept) { CHECK(k.data != nullptr); }
  const auto s = pool.stats();
  CHECK(s.size_bytes >= 64 * mib);
  CHECK(s.extents_made + s.extents_in_step >= 64);
  auto big = pool.take(3 * mib);  // larger than an extent: one of its own
  std::memset(big.data, 2, big.bytes);
  pool.release(big);
  for (const auto& k : kept) { pool.release(k); }
  CHECK(pool.stats().in_use_bytes == 0);
}

TEST_CASE("kept_rows_pool: a filling thread that cannot allocate leaves takes to make their own")
{
  std::atomic<int> allowed{1};
  rr::kept_rows_pool<failing_memory> pool{{.extent_bytes = mib, .budget_bytes = 4 * mib}, failing_memory{&allowed}};
  pool.wait_until_filled();
  CHECK(pool.stats().filling_failed);
  auto a = pool.take(mib / 2);  // the one extent made
  auto b = pool.take(mib / 2);
  CHECK(a.data != nullptr);
  CHECK(b.data != nullptr);
  CHECK_THROWS_AS(static_cast<void>(pool.take(mib / 2)), std::bad_alloc);  // no memory at all: the caller hears
  pool.release(a);
  pool.release(b);
}

TEST_CASE("kept_rows_pool: slices let go on other threads while the taking thread goes on")
{
  rr::kept_rows_pool<> pool{{.extent_bytes = mib, .budget_bytes = 2 * mib}};
  pool.wait_until_filled();
  constexpr int steps = 2000;
  constexpr int consumers = 3;
  std::vector<rr::kept_rows_pool<>::slice> slots(static_cast<std::size_t>(steps));
  std::atomic<int> published{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < consumers; ++c) {
    threads.emplace_back([&, c] {  // each consumer lets go of the steps of its residue, in order
      for (int i = c; i < steps; i += consumers) {
        while (published.load(std::memory_order_acquire) <= i) { std::this_thread::yield(); }
        const auto& s = slots[static_cast<std::size_t>(i)];
        CHECK(static_cast<unsigned char>(s.data[0]) == static_cast<unsigned char>(i));
        pool.release(s);
        if (i % 97 == 0) { static_cast<void>(pool.stats()); }
      }
    });
  }
  for (int i = 0; i < steps; ++i) {
    auto s = pool.take(static_cast<std::size_t>(1000 + (i % 7) * 20000));
    std::memset(s.data, i, s.bytes);
    slots[static_cast<std::size_t>(i)] = s;
    published.store(i + 1, std::memory_order_release);
  }
  for (auto& t : threads) { t.join(); }
  const auto s = pool.stats();
  CHECK(s.in_use_bytes == 0);
  CHECK(s.slices == steps);
}

// Per-request storage's growth (detail::row_arena, what request_ranges grows from): superblocks made
// ahead by its worker are what a step of new requests takes; one with nothing ready maps its own,
// and host_memory_growth() says so.

TEST_CASE("row_arena: a step of new requests takes superblocks made ahead, and growth() counts where each came from")
{
  const std::size_t page = rr::detail::kept_pool::page_bytes();
  rr::detail::row_arena<rr::detail::host_written_rows> arena{4 * page, 4, 2 * (4 * page << 4)};
  arena.wait_until_ahead();
  const auto a = arena.allocate(4);
  const auto b = arena.allocate(4);
  auto g = arena.growth();
  CHECK(g.superblock_bytes == (4 * page << 4));
  CHECK(g.superblocks_ahead == 2);
  CHECK(g.superblocks_in_step == 0);
  std::vector<rr::detail::row_arena<rr::detail::host_written_rows>::block> burst;
  for (int i = 0; i < 16; ++i) { burst.push_back(arena.allocate(4)); }  // faster than the worker makes them
  g = arena.growth();
  CHECK(g.superblocks_ahead + g.superblocks_in_step == 18);
  for (const auto& s : burst) { arena.release(s); }
  arena.release(a);
  arena.release(b);
  CHECK(arena.bytes_in_use() == 0);
}

TEST_CASE("per-request storage keeps two full steps of new rows ahead by default")
{
  rr::replay_config c;
  c.max_tokens_per_step = 64;
  c.max_model_len       = 256;
  c.moe_layers          = {0, 1};
  c.top_k               = 2;
  c.num_experts         = 8;
  rr::detail::per_request_store<std::int16_t> store{c, 4};
  store.wait_until_ahead();
  const auto g = store.growth();
  CHECK(g.superblock_bytes > 0);
  CHECK(g.superblocks_in_step == 0);
}
