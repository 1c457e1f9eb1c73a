// The block tier against the plain model of its contract (tests/support/block_tier_model.hpp):
// scenarios for each rule (deduplication, references, eviction order, touch on read, growth, the
// failure of an unbalanced release), then randomized sequences of puts, retains, releases and
// reads under small budgets, compared after every call, the LRU order included.
#include "../support/block_tier_model.hpp"

#include <routing_replay/block_tier.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace rr = routing_replay;

namespace {

std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span{s.data(), s.size()}); }

rr::block_key key_of(const std::string& s) { return rr::block_key_of(bytes_of(s)); }

// One call applied to the tier and to the model.
struct tier_and_model {
  tier_and_model(std::size_t block_bytes, std::size_t max_bytes)
    : block_bytes(block_bytes), tier(block_bytes, max_bytes, {.fault_ahead_blocks = 2, .expected_keys = 4}),
      model(block_bytes, max_bytes)
  {
  }

  bool put(const std::vector<std::pair<std::string, std::string>>& objects, const std::vector<std::string>& retain,
           const std::vector<std::string>& release)
  {
    std::vector<rr::block_object> o;
    for (const auto& [key, payload] : objects) {
      REQUIRE(payload.size() == block_bytes);
      o.push_back({key_of(key), reinterpret_cast<const std::byte*>(payload.data())});
    }
    std::vector<rr::block_key> r, x;
    for (const auto& k : retain) { r.push_back(key_of(k)); }
    for (const auto& k : release) { x.push_back(key_of(k)); }
    bool tier_ok = true;
    try {
      tier.put(o, r, x);
    } catch (const rr::error& e) {
      CHECK(e.code() == rr::errc::invalid_state);
      tier_ok = false;
    }
    const bool model_ok = model.put(objects, retain, release);
    CHECK(tier_ok == model_ok);
    return model_ok;
  }

  void read(const std::vector<std::string>& keys)
  {
    std::vector<rr::block_key> k;
    for (const auto& s : keys) { k.push_back(key_of(s)); }
    std::string out(keys.size() * block_bytes, '\0');
    const auto missing           = tier.read(k, reinterpret_cast<std::byte*>(out.data()));
    const auto [model_missing, model_out] = model.read(keys);
    REQUIRE(missing == model_missing);
    if (!missing) { CHECK(out == model_out); }
  }

  void check_same(const std::vector<std::string>& universe)
  {
    CHECK(tier.stored_blocks() == model.stored_blocks());
    CHECK(tier.limit_blocks() == model.limit_blocks());
    CHECK(tier.arena_bytes() == model.arena_bytes());
    CHECK(tier.growths() == model.growths());
    std::vector<std::string> order;
    tier.for_each_evictable([&](std::span<const std::byte> key) {
      order.emplace_back(reinterpret_cast<const char*>(key.data()), key.size());
    });
    CHECK(order == std::vector<std::string>(model.lru().begin(), model.lru().end()));
    for (const std::string& key : universe) {
      CHECK(tier.contains(key_of(key)) == model.contains(key));
      CHECK(tier.references(key_of(key)) == model.references(key));
    }
  }

  std::size_t block_bytes;
  rr::block_tier tier;
  rr_test::block_tier_model model;
};

std::string block(char c, std::size_t n = 4) { return std::string(n, c); }

}  // namespace

TEST_CASE("block tier: refuses a budget below one block")
{
  CHECK_THROWS_AS(rr::block_tier(8, 7), rr::error);
  CHECK_THROWS_AS(rr::block_tier(0, 7), rr::error);
}

TEST_CASE("block tier: a key is stored once, and an unreferenced copy is replaced by a later put")
{
  tier_and_model t{4, 4 * 4};
  const std::vector<std::string> keys{"a", "b"};
  t.put({{"a", block('1')}, {"a", block('2')}}, {}, {});  // last bytes of a key named twice
  t.read({"a"});
  t.put({{"a", block('3')}}, {}, {});  // unreferenced: replaced
  t.read({"a"});
  t.put({}, {"a"}, {});
  t.put({{"a", block('4')}}, {}, {});  // referenced: kept
  t.read({"a"});
  t.check_same(keys);
}

TEST_CASE("block tier: eviction takes the oldest unreferenced blocks, never this put's own")
{
  tier_and_model t{4, 2 * 4};
  const std::vector<std::string> keys{"a", "b", "c", "d"};
  t.put({{"a", block('a')}, {"b", block('b')}}, {}, {});
  t.read({"a"});  // a becomes the newest: b goes first
  t.put({{"c", block('c')}}, {}, {});
  t.check_same(keys);
  CHECK_FALSE(t.tier.contains(key_of("b")));
  t.put({{"d", block('d')}}, {"a"}, {});  // a referenced: c goes
  t.check_same(keys);
  CHECK(t.tier.contains(key_of("a")));
  CHECK_FALSE(t.tier.contains(key_of("c")));
}

TEST_CASE("block tier: a put that releases its own object may evict it")
{
  tier_and_model t{4, 1 * 4};
  const std::vector<std::string> keys{"a", "b"};
  t.put({}, {"a"}, {});
  t.put({{"a", block('a')}}, {}, {});
  t.put({{"b", block('b')}, {"a", block('z')}}, {}, {"a"});  // a released here: evictable
  t.check_same(keys);
}

TEST_CASE("block tier: grows when every stored block is referenced, and the budget grows with it")
{
  tier_and_model t{4, 2 * 4};
  const std::vector<std::string> keys{"a", "b", "c", "d", "e"};
  t.put({{"a", block('a')}, {"b", block('b')}}, {"a", "b"}, {});
  t.put({{"c", block('c')}}, {"c"}, {});
  t.check_same(keys);
  CHECK(t.tier.growths() == 1);
  CHECK(t.tier.limit_blocks() == 4);
  t.read({"a", "b", "c"});
  t.put({{"d", block('d')}, {"e", block('e')}}, {}, {"a", "b", "c"});
  t.check_same(keys);
  t.read({"c", "d", "e"});
}

TEST_CASE("block tier: a read of a missing key copies and touches nothing")
{
  tier_and_model t{4, 3 * 4};
  t.put({{"a", block('a')}, {"b", block('b')}}, {}, {});
  t.read({"a", "x", "b"});
  t.check_same({"a", "b", "x"});
}

TEST_CASE("block tier: an unbalanced release fails")
{
  tier_and_model t{4, 3 * 4};
  CHECK_FALSE(t.put({}, {}, {"a"}));
  tier_and_model u{4, 3 * 4};
  u.put({{"a", block('a')}}, {}, {});
  CHECK_FALSE(u.put({}, {}, {"a"}));  // stored, but nobody references it
}

TEST_CASE("block tier: keys of any length, longer than the entry holds inline")
{
  tier_and_model t{4, 8 * 4};
  const std::string long_key(200, 'k');
  const std::string other_long = std::string(199, 'k') + "x";
  t.put({{long_key, block('1')}, {other_long, block('2')}, {"", block('3')}}, {long_key}, {});
  t.read({other_long, long_key, ""});
  t.check_same({long_key, other_long, ""});
}

TEST_CASE("block tier: randomized puts, retains, releases and reads against the model")
{
  std::mt19937 rng{20261127};
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(std::uniform_int_distribution<std::size_t>(0, n - 1)(rng)); };
  std::vector<std::string> universe;
  for (int i = 0; i < 14; ++i) { universe.push_back("key-" + std::to_string(i)); }
  universe.push_back(std::string(60, 'L'));  // spilled past the inline bytes
  universe.push_back(std::string(60, 'L') + "2");
  for (int sequence = 0; sequence < 300; ++sequence) {
    const std::size_t block_bytes = 1 + pick(6);
    const std::size_t budget      = block_bytes * (1 + pick(6)) + pick(block_bytes);
    tier_and_model t{block_bytes, budget};
    std::vector<std::string> held;  // keys with a reference, as many times as held
    for (int op = 0; op < 60; ++op) {
      const std::size_t kind = pick(10);
      if (kind < 6) {
        std::vector<std::pair<std::string, std::string>> objects;
        std::vector<std::string> retain, release;
        for (std::size_t i = pick(4); i > 0; --i) {
          objects.emplace_back(universe[pick(universe.size())], std::string(block_bytes, static_cast<char>('a' + pick(26))));
        }
        for (std::size_t i = pick(3); i > 0; --i) { retain.push_back(universe[pick(universe.size())]); }
        std::vector<std::string> can_release = held;
        can_release.insert(can_release.end(), retain.begin(), retain.end());
        for (std::size_t i = pick(3); i > 0 && !can_release.empty(); --i) {
          const std::size_t at = pick(can_release.size());
          release.push_back(can_release[at]);
          can_release.erase(can_release.begin() + static_cast<std::ptrdiff_t>(at));
        }
        const bool unbalanced = pick(40) == 0;
        if (unbalanced) { release.push_back(universe[pick(universe.size())]); }
        const bool ok = t.put(objects, retain, release);
        if (!ok) {
          REQUIRE(unbalanced);
          break;  // the store is unusable after a failed put; so is the sequence
        }
        if (unbalanced) {  // it held a reference after all
          auto it = std::find(can_release.begin(), can_release.end(), release.back());
          REQUIRE(it != can_release.end());
          can_release.erase(it);
        }
        held = can_release;
      } else {
        std::vector<std::string> keys;
        for (std::size_t i = 1 + pick(3); i > 0; --i) { keys.push_back(universe[pick(universe.size())]); }
        t.read(keys);
      }
      t.check_same(universe);
    }
  }
}
