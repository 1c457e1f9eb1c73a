// libFuzzer harness of the block tier: decodes its input into a block size, a byte budget and a
// sequence of puts (objects with repeated keys, retains, releases), reads and checks, applies each to
// routing_replay::block_tier and to the plain model of its contract (tests/support/block_tier_model.hpp),
// and aborts on the first difference: a result, a stored key, a reference count, the budget, the
// arena, or the eviction order. A release that the model refuses must fail in the tier too; the
// input ends there (the store it mirrors is unusable after a failed update).
//
// Build and run: scripts/fuzz.sh SECONDS (beside fuzz_replay, within the same time).
#include "../support/block_tier_model.hpp"

#include <routing_replay/block_tier.hpp>

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace rr = routing_replay;

namespace {

[[noreturn]] void violation(const char* what)
{
  std::fprintf(stderr, "block tier contract violation: %s\n", what);
  std::abort();
}

rr::block_key key_of(const std::string& s)
{
  return rr::block_key_of(std::as_bytes(std::span{s.data(), s.size()}));
}

// Keys: short ones, the empty key, and long ones past what an index entry holds inline, some sharing
// a long prefix.
std::string pick_key(FuzzedDataProvider& in)
{
  const auto i = in.ConsumeIntegralInRange<int>(0, 11);
  if (i < 8) { return "k" + std::to_string(i); }
  if (i == 8) { return {}; }
  return std::string(60, 'L') + std::to_string(i);
}

void check_same(const rr::block_tier& tier, const rr_test::block_tier_model& model)
{
  if (tier.stored_blocks() != model.stored_blocks()) { violation("stored blocks"); }
  if (tier.limit_blocks() != model.limit_blocks()) { violation("limit"); }
  if (tier.arena_bytes() != model.arena_bytes()) { violation("arena bytes"); }
  std::vector<std::string> order;
  tier.for_each_evictable([&](std::span<const std::byte> key) {
    order.emplace_back(reinterpret_cast<const char*>(key.data()), key.size());
  });
  if (order != std::vector<std::string>(model.lru().begin(), model.lru().end())) { violation("eviction order"); }
  for (int i = 0; i < 12; ++i) {
    const std::string key = i < 8 ? "k" + std::to_string(i) : (i == 8 ? std::string{} : std::string(60, 'L') + std::to_string(i));
    if (tier.contains(key_of(key)) != model.contains(key)) { violation("stored key"); }
    if (tier.references(key_of(key)) != model.references(key)) { violation("references"); }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  FuzzedDataProvider in{data, size};
  const std::size_t block_bytes = in.ConsumeIntegralInRange<std::size_t>(1, 24);
  const std::size_t max_bytes   = block_bytes * in.ConsumeIntegralInRange<std::size_t>(1, 6) +
                                in.ConsumeIntegralInRange<std::size_t>(0, block_bytes - 1);
  rr::block_tier tier{block_bytes, max_bytes, {.fault_ahead_blocks = in.ConsumeIntegralInRange<std::size_t>(0, 4),
                                               .expected_keys      = in.ConsumeIntegralInRange<std::size_t>(1, 8)}};
  rr_test::block_tier_model model{block_bytes, max_bytes};
  while (in.remaining_bytes() > 0) {
    if (in.ConsumeBool()) {
      std::vector<std::pair<std::string, std::string>> objects;
      std::vector<std::string> retain, release;
      for (int n = in.ConsumeIntegralInRange(0, 4); n > 0; --n) {
        objects.emplace_back(pick_key(in), std::string(block_bytes, static_cast<char>(in.ConsumeIntegral<std::uint8_t>())));
      }
      for (int n = in.ConsumeIntegralInRange(0, 3); n > 0; --n) { retain.push_back(pick_key(in)); }
      for (int n = in.ConsumeIntegralInRange(0, 3); n > 0; --n) { release.push_back(pick_key(in)); }
      std::vector<rr::block_object> o;
      std::vector<rr::block_key> r, x;
      for (const auto& [key, bytes] : objects) { o.push_back({key_of(key), reinterpret_cast<const std::byte*>(bytes.data())}); }
      for (const auto& key : retain) { r.push_back(key_of(key)); }
      for (const auto& key : release) { x.push_back(key_of(key)); }
      bool tier_ok = true;
      try {
        tier.put(o, r, x);
      } catch (const rr::error& e) {
        if (e.code() != rr::errc::invalid_state) { violation("a put failed with an unexpected code"); }
        tier_ok = false;
      }
      const bool model_ok = model.put(objects, retain, release);
      if (tier_ok != model_ok) { violation("a put succeeded on one side only"); }
      if (!model_ok) { return 0; }
    } else {
      std::vector<std::string> keys;
      for (int n = in.ConsumeIntegralInRange(1, 4); n > 0; --n) { keys.push_back(pick_key(in)); }
      std::vector<rr::block_key> k;
      for (const auto& key : keys) { k.push_back(key_of(key)); }
      std::string out(keys.size() * block_bytes, '\0');
      const auto missing             = tier.read(k, reinterpret_cast<std::byte*>(out.data()));
      const auto [model_missing, expected] = model.read(keys);
      if (missing != model_missing) { violation("read: the missing key"); }
      if (!missing && out != expected) { violation("read: the bytes"); }
    }
    check_same(tier, model);
  }
  return 0;
}
