// A plain model of the block tier's contract, written from the semantics of vLLM 0.33's block store
// (a dict of stored keys, an ordered dict as the LRU order, a dict of reference counts), with no
// attention to speed: the tests and the fuzzer run routing_replay::block_tier beside it and compare
// every result, the eviction order included.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace rr_test {

class block_tier_model {
 public:
  block_tier_model(std::size_t block_bytes, std::size_t max_bytes)
    : block_bytes_(block_bytes), limit_(max_bytes / block_bytes), arena_bytes_(limit_ * block_bytes)
  {
  }

  // false: a released key held no reference (the store's put fails there; the model is then dead)
  bool put(const std::vector<std::pair<std::string, std::string>>& objects, const std::vector<std::string>& retain,
           const std::vector<std::string>& release)
  {
    // unique = {key: payload} in first-occurrence order, last payload wins
    std::vector<std::string> unique;
    std::map<std::string, std::string> payload;
    for (const auto& [key, bytes] : objects) {
      if (!payload.count(key)) { unique.push_back(key); }
      payload[key] = bytes;
    }
    for (const std::string& key : unique) {
      if (in_lru(key)) {
        lru_erase(key);
        stored_.erase(key);
      }
    }
    for (const std::string& key : retain) {
      const int refs = refs_.count(key) ? refs_[key] : 0;
      if (refs == 0) { lru_erase(key); }
      refs_[key] = refs + 1;
    }
    std::vector<std::string> terminal;
    for (const std::string& key : release) {
      if (!refs_.count(key)) { return false; }
      if (--refs_[key] > 0) { continue; }
      refs_.erase(key);
      if (stored_.count(key) && !in_lru(key)) { lru_push(key); }
      terminal.push_back(key);
    }
    std::set<std::string> written;  // keys given a fresh (unallocated) slot in this put
    for (const std::string& key : unique) {
      if (!stored_.count(key)) {
        stored_[key] = std::nullopt;
        written.insert(key);
      }
      if (!refs_.count(key)) {
        lru_erase(key);
        lru_push(key);
      }
    }
    for (const std::string& key : terminal) {
      if (in_lru(key)) {
        lru_erase(key);
        lru_push(key);
      }
    }
    const std::set<std::string> terminal_set(terminal.begin(), terminal.end());
    if (stored_.size() > limit_) {
      std::size_t excess = stored_.size() - limit_;
      std::vector<std::string> victims;
      for (const std::string& key : lru_) {
        const bool is_protected = payload.count(key) && !terminal_set.count(key);
        if (!is_protected) {
          victims.push_back(key);
          if (victims.size() == excess) { break; }
        }
      }
      for (const std::string& key : victims) {
        lru_erase(key);
        stored_.erase(key);
      }
    }
    if (stored_.size() * block_bytes_ > arena_bytes_) {
      arena_bytes_ = std::max(stored_.size() * block_bytes_, 2 * arena_bytes_);
      limit_       = arena_bytes_ / block_bytes_;
      ++growths_;
    }
    for (const std::string& key : unique) {
      auto it = stored_.find(key);
      if (it == stored_.end() || it->second.has_value()) { continue; }
      it->second = payload[key];
    }
    return true;
  }

  // the bytes of `keys` concatenated, or the position of the first missing key
  std::pair<std::optional<std::size_t>, std::string> read(const std::vector<std::string>& keys)
  {
    std::string out;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      auto it = stored_.find(keys[i]);
      if (it == stored_.end()) { return {i, {}}; }
      out += *it->second;
    }
    for (const std::string& key : keys) {
      if (in_lru(key)) {
        lru_erase(key);
        lru_push(key);
      }
    }
    return {std::nullopt, out};
  }

  [[nodiscard]] bool contains(const std::string& key) const { return stored_.count(key) > 0; }
  [[nodiscard]] int references(const std::string& key) const
  {
    auto it = refs_.find(key);
    return it == refs_.end() ? 0 : it->second;
  }
  [[nodiscard]] std::size_t stored_blocks() const { return stored_.size(); }
  [[nodiscard]] std::size_t limit_blocks() const { return limit_; }
  [[nodiscard]] std::size_t arena_bytes() const { return arena_bytes_; }
  [[nodiscard]] std::size_t growths() const { return growths_; }
  [[nodiscard]] const std::list<std::string>& lru() const { return lru_; }

 private:
  bool in_lru(const std::string& key) const { return std::find(lru_.begin(), lru_.end(), key) != lru_.end(); }
  void lru_erase(const std::string& key) { lru_.remove(key); }
  void lru_push(const std::string& key) { lru_.push_back(key); }

  std::size_t block_bytes_;
  std::size_t limit_;
  std::size_t arena_bytes_;
  std::size_t growths_ = 0;
  std::map<std::string, std::optional<std::string>> stored_;  // nullopt: slot not yet written
  std::map<std::string, int> refs_;
  std::list<std::string> lru_;  // oldest first
};

}  // namespace rr_test
