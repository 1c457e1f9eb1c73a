// step_snapshots on the host backend: captures into a token-major D, the end-of-step kernel (check,
// snapshot in the output type, reset), the copy to host memory and its event; invalid ids,
// unwritten rows of captured layers, dense layers read as 0, E = 256 narrowed from uint16 to uint8,
// rows written outside a step reset before the next, and the device path of the same kernel
// (its thread-per-word form, run as a loop) agreeing with the host pass; a report flagged by the
// kernel brings the status back once, and the slot starts clean on its next use; the word a direct
// harvest's kernel sets once its rows are in place.
#include <routing_replay/data_path/step_snapshots.hpp>
#include <routing_replay/host_backend.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace rr = routing_replay;

namespace {

template <class Index, class Out>
struct fixture {
  fixture(std::int32_t layers, std::int32_t k, std::int32_t experts, std::int32_t rows)
    : snapshots(layers, k, experts, rows, 2), L(layers), K(k)
  {
  }
  void capture_all(std::int64_t n, std::int64_t salt, std::int32_t skip_layer = -1)
  {
    for (std::int32_t l = 0; l < L; ++l) {
      if (l == skip_layer) { continue; }
      std::vector<std::int64_t> ids(static_cast<std::size_t>(n * K));
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int32_t k = 0; k < K; ++k) { ids[static_cast<std::size_t>(r * K + k)] = id(r, l, k, salt); }
      }
      snapshots.capture(l, ids.data(), n, stream.ref());
      stream.synchronize();  // ids is about to go
    }
  }
  static std::int64_t id(std::int64_t r, std::int32_t l, std::int32_t k, std::int64_t salt) { return (r * 7 + l * 3 + k + salt) % 200 + 50; }
  std::vector<Out> finish(std::int64_t n, std::int32_t& slot)
  {
    slot = snapshots.harvest(n, stream.ref());
    std::vector<Out> host(static_cast<std::size_t>(n * L * K));
    snapshots.copy_to_host(slot, host.data(), copy.ref());
    snapshots.wait(slot);
    return host;
  }
  rr::host_stream stream, copy;
  rr::step_snapshots<rr::host_backend, Index, Out> snapshots;
  std::int32_t L, K;
};

}  // namespace

TEST_CASE("step snapshots: a step's rows come back in the output type, and D is reset")
{
  fixture<std::uint16_t, std::uint8_t> f{3, 2, 256, 8};  // E = 256: uint16 inside, uint8 out
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(5, 0);
  std::int32_t slot = 0;
  const auto rows = f.finish(5, slot);
  CHECK(f.snapshots.status(slot).clean());
  for (std::int64_t r = 0; r < 5; ++r) {
    for (std::int32_t l = 0; l < 3; ++l) {
      for (std::int32_t k = 0; k < 2; ++k) { CHECK(rows[static_cast<std::size_t>((r * 3 + l) * 2 + k)] == f.id(r, l, k, 0)); }
    }
  }
  // the next step's rows are its own: a layer it skips is unwritten, not the last step's
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(5, 1, 2);
  f.finish(5, slot);
  CHECK(f.snapshots.status(slot).unwritten.count > 0);
  CHECK(f.snapshots.status(slot).unwritten.layer == 2);
}

TEST_CASE("step snapshots: on the host backend a harvest writes the rows where the copy would have")
{
  fixture<std::uint8_t, std::uint8_t> f{2, 2, 100, 8};
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(3, 5);
  std::vector<std::uint8_t> host(3 * 2 * 2, 0);
  const std::int32_t slot = f.snapshots.harvest(3, f.stream.ref(), -1, host.data());
  f.snapshots.copy_to_host(slot, host.data(), f.copy.ref());
  f.snapshots.wait(slot);
  CHECK(f.snapshots.status(slot).clean());
  CHECK(host[0] == f.id(0, 0, 0, 5));
  CHECK(host[11] == f.id(2, 1, 1, 5));
}

TEST_CASE("step snapshots: a layer never captured reads as 0; an invalid id is reported with its place")
{
  fixture<std::uint8_t, std::uint8_t> f{3, 2, 100, 8};
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(4, 0, 1);  // layer 1 is dense: never captured
  std::int32_t slot = 0;
  auto rows = f.finish(4, slot);
  CHECK(f.snapshots.status(slot).clean());
  CHECK(rows[2] == 0);
  CHECK(rows[3] == 0);
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(4, 0, 1);
  std::vector<std::int64_t> bad{1, 2, 3, 150};  // row 1, column 1: 150 >= E
  f.snapshots.capture(0, bad.data(), 2, f.stream.ref());
  f.stream.synchronize();
  rows = f.finish(4, slot);
  const auto& s = f.snapshots.status(slot);
  CHECK(s.invalid_id.count == 1);
  CHECK(s.invalid_id.value == 150);
  CHECK(s.invalid_id.row == 1);
  CHECK(s.invalid_id.column == 1);
}

TEST_CASE("step snapshots: rows written outside a step are reset before the next step")
{
  fixture<std::uint8_t, std::uint8_t> f{2, 2, 100, 8};
  f.capture_all(8, 0);  // a warm-up forward: no step open
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(2, 1, 1);  // layer 1 skipped in the real step
  std::int32_t slot = 0;
  f.finish(2, slot);
  CHECK(f.snapshots.status(slot).unwritten.layer == 1);
}

TEST_CASE("step snapshots: the device form of the end-of-step kernel agrees with the host pass")
{
  for (const std::int64_t rows : {0, 1, 3, 7}) {
    const std::int32_t L = 3, K = 3;  // 9 ids a row: words straddle rows and the range's end
    std::vector<std::uint16_t> d1(static_cast<std::size_t>(8 * L * K)), d2;
    for (std::size_t e = 0; e < d1.size(); ++e) { d1[e] = static_cast<std::uint16_t>(e % 11 == 0 ? 0xFFFF : (e * 5) % 300); }
    d2 = d1;
    std::vector<std::uint8_t> s1(d1.size()), s2(d1.size());
    rr::detail::step_status st1{}, st2{}, cap1{}, cap2{};
    rr::detail::captured_layers captured;
    captured.add(0);
    captured.add(2);
    using kernel = rr::detail::harvest_token_rows<std::uint16_t, std::uint8_t>;
    const kernel host{d1.data(), s1.data(), &st1, &cap1, 256, L, K, rows * L * K, (rows + 1) * L * K, captured};
    const kernel device{d2.data(), s2.data(), &st2, &cap2, 256, L, K, rows * L * K, (rows + 1) * L * K, captured};
    host.run_on_host();
    for (std::int64_t i = 0; i < device.num_items(); ++i) {
      device(static_cast<std::int32_t>(i / rr::detail::kernel_block_threads), static_cast<std::int32_t>(i % rr::detail::kernel_block_threads));
    }
    CHECK(d1 == d2);
    CHECK(s1 == s2);
    CHECK(st1.unwritten.count == st2.unwritten.count);
    CHECK(st1.out_of_range.count == st2.out_of_range.count);
  }
}

TEST_CASE("step snapshots: a reported step's status comes back once, and the next step on its slot starts clean")
{
  fixture<std::uint8_t, std::uint8_t> f{2, 2, 100, 8};
  std::vector<std::int64_t> bad{1, 2, 3, 150};
  std::int32_t slot = 0;
  for (const bool direct : {false, true}) {
    CAPTURE(direct);
    std::vector<std::uint8_t> host(4 * 2 * 2, 0);
    f.snapshots.open_step(f.stream.ref());
    f.capture_all(4, 0);
    f.snapshots.capture(1, bad.data(), 2, f.stream.ref());
    f.stream.synchronize();
    slot = f.snapshots.harvest(4, f.stream.ref(), -1, direct ? host.data() : nullptr);
    CHECK(f.snapshots.wrote_host(slot) == direct);
    f.snapshots.copy_to_host(slot, host.data(), f.copy.ref());
    f.snapshots.wait(slot);
    CHECK(f.snapshots.status(slot).invalid_id.count == 1);
    CHECK(f.snapshots.status(slot).invalid_id.layer == 1);
    // the ring comes round to the same slot: its status was reset on the device
    for (std::int32_t step = 0; step < f.snapshots.ring_depth(); ++step) {
      f.snapshots.open_step(f.stream.ref());
      f.capture_all(4, step);
      slot = f.snapshots.harvest(4, f.stream.ref(), -1, direct ? host.data() : nullptr);
      f.snapshots.copy_to_host(slot, host.data(), f.copy.ref());
      f.snapshots.wait(slot);
      CHECK(f.snapshots.status(slot).clean());
    }
    CHECK(host[0] == f.id(0, 0, 0, f.snapshots.ring_depth() - 1));
  }
}

TEST_CASE("step snapshots: reports of a harvest never waited for do not leak into the next step on its slot")
{
  fixture<std::uint8_t, std::uint8_t> f{2, 2, 100, 8};
  std::vector<std::int64_t> bad{1, 2, 3, 150};
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(4, 0);
  f.snapshots.capture(0, bad.data(), 2, f.stream.ref());
  f.stream.synchronize();
  const std::int32_t dropped = f.snapshots.harvest(4, f.stream.ref());  // its output is never copied nor waited for
  std::int32_t slot          = dropped;
  for (std::int32_t step = 1; step <= f.snapshots.ring_depth(); ++step) {
    f.snapshots.open_step(f.stream.ref());
    f.capture_all(4, step);
    f.finish(4, slot);
    CHECK(f.snapshots.status(slot).clean());
  }
  CHECK(slot == dropped);
}

TEST_CASE("step snapshots: only steps within the direct-write size are written into host memory by the kernel")
{
  fixture<std::uint8_t, std::uint8_t> f{2, 2, 100, 8};
  CHECK(f.snapshots.direct_write_bytes() == rr::step_snapshots<rr::host_backend, std::uint8_t, std::uint8_t>::default_direct_write_bytes);
  f.snapshots.set_direct_write_bytes(0);  // the host backend writes host memory directly whatever the size
  std::vector<std::uint8_t> host(4 * 2 * 2, 0);
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(4, 3);
  const std::int32_t slot = f.snapshots.harvest(4, f.stream.ref(), -1, host.data());
  CHECK(f.snapshots.wrote_host(slot));
  f.snapshots.copy_to_host(slot, host.data(), f.copy.ref());  // enqueues nothing
  f.snapshots.wait(slot);
  CHECK(f.snapshots.ready(slot));
  CHECK(f.snapshots.status(slot).clean());
  CHECK(host[15] == f.id(3, 1, 1, 3));
}

TEST_CASE("step snapshots: the kernel's last block, and the host pass, set the landed word to the harvest's number")
{
  const std::int32_t L = 4, K = 8;  // 32 ids a row of uint8: 2 words; 300 rows: 600 threads, 3 blocks
  const std::int64_t rows = 300;
  std::vector<std::uint8_t> d(static_cast<std::size_t>(rows * L * K), 7), out(d.size());
  rr::detail::step_status status{}, captures{};
  std::uint32_t landed = 0, arrivals = 0;
  rr::detail::harvest_token_rows<std::uint8_t, std::uint8_t> kernel{
    d.data(), out.data(), &status, &captures, 100, L, K, rows * L * K, rows * L * K, rr::detail::captured_layers{}};
  kernel.landed   = &landed;
  kernel.arrivals = &arrivals;
  kernel.sequence = 5;
  REQUIRE(kernel.num_blocks() == 3);
  for (std::int32_t block = 0; block < kernel.num_blocks(); ++block) {
    CHECK(landed == 0);  // not before every block is done
    for (std::int32_t t = 0; t < rr::detail::kernel_block_threads; ++t) { kernel(block, t); }
    kernel.block_done(block);
  }
  CHECK(landed == 5);
  CHECK(arrivals == 0);  // ready for the slot's next harvest
  CHECK(out[0] == 7);
  kernel.sequence = 6;
  kernel.buffer   = out.data();  // any rows: the host pass sets the word at its end
  kernel.run_on_host();
  CHECK(landed == 6);
}

TEST_CASE("step snapshots: a slot's direct harvest is not ready while its kernel waits, though the slot's last one landed")
{
  fixture<std::uint8_t, std::uint8_t> f{2, 2, 100, 8};
  std::vector<std::uint8_t> host(4 * 2 * 2, 0);
  std::int32_t slot = 0;
  for (std::int32_t step = 0; step < f.snapshots.ring_depth(); ++step) {  // every slot landed once
    f.snapshots.open_step(f.stream.ref());
    f.capture_all(4, step);
    slot = f.snapshots.harvest(4, f.stream.ref(), -1, host.data());
    f.snapshots.wait(slot);
  }
  f.snapshots.open_step(f.stream.ref());
  f.capture_all(4, 9);
  std::atomic<bool> open{false};
  f.stream.ref().queue().enqueue([&] { open.wait(false); });  // the stream stalls before the next kernel
  slot = f.snapshots.harvest(4, f.stream.ref(), -1, host.data());
  CHECK(slot == 0);
  CHECK_FALSE(f.snapshots.ready(slot));  // slot 0's word still holds its first harvest's number
  open = true;
  open.notify_one();
  f.snapshots.wait(slot);
  CHECK(f.snapshots.ready(slot));
  CHECK(host[15] == f.id(3, 1, 1, 9));
}
