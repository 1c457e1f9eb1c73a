/// @file
/// A small simulated inference engine that produces randomized but realistic schedules: arrivals,
/// chunked prefill, decode, speculative drafts with random acceptance, preemption with recompute,
/// a KV block allocator with a prefix cache (hits, evictions, the recomputed last prompt token),
/// finishes, aborts, and tokens of requests that did not ask for routing.
#pragma once

#include "synthetic_router.hpp"

#include <routing_replay/step_plan.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace rr_test {

/// @brief Knobs of the simulated engine.
struct sim_config {
  std::int32_t max_tokens_per_step = 48;
  std::int64_t max_model_len       = 160;
  std::int32_t block_size          = 4;
  std::int64_t num_blocks          = 96;
  std::int32_t num_requests        = 18;
  std::int32_t max_running         = 6;
  std::int32_t max_drafts          = 3;
  std::int32_t families            = 3;     ///< requests of a family share a prompt prefix
  double p_spec                    = 0.35;  ///< a decode step carries drafts
  double p_preempt                 = 0.04;  ///< per step: preempt one running request
  double p_abort                   = 0.02;  ///< per step: abort one live request
  double p_skip                    = 0.25;  ///< per step: tokens of a request that did not opt in
  double p_string_id               = 0.4;   ///< a request is named by a string
  bool random_eviction             = false; ///< allocate any free block, not the least recent
  std::int64_t prompt_extra        = 40;    ///< prompt tokens past the family prefix: up to this
  std::int64_t max_output          = 24;    ///< output tokens: 2 to this
  bool endless                     = false; ///< finished and aborted requests come back as new
                                            ///< ones (new ids): a soak never runs out of work
};

/// @brief The schedule mix of a seed: seeds divisible by 4 run a small, contended KV pool with
/// frequent preemption, so blocks are reallocated under live requests and stale rows must show;
/// seeds 2 mod 4 use KV blocks of 3 slots.
inline sim_config schedule_for_seed(std::uint64_t seed)
{
  sim_config c;
  if (seed % 4 == 0) {
    c.num_blocks   = 40;
    c.p_preempt    = 0.25;
    c.max_running  = 8;
    c.num_requests = 24;
    c.random_eviction = true;
  }
  if (seed % 4 == 2) {  // a block size that is not a power of two (a division, not a shift), the same pool
    c.block_size = 3;
    c.num_blocks = 128;
  }
  return c;
}

/// @brief One simulated request.
struct sim_request {
  enum class state { pending, waiting, running, finished, aborted };

  std::int32_t number = 0;  ///< the `request` of the synthetic router
  std::int32_t incarnation = 0;  ///< endless runs: how often this entry came back as a new request
  bool named          = false;
  std::string name;
  std::int32_t family       = 0;
  std::int64_t shared_len   = 0;  ///< prompt prefix shared with its family
  std::int64_t prompt_len   = 0;
  std::int64_t total_len    = 0;  ///< prompt + output tokens; positions [0, total_len - 1) run
  std::int64_t arrival_step = 0;
  state st                  = state::pending;
  bool added                = false;
  std::int64_t computed     = 0;  ///< positions [0, computed) hold KV
  std::vector<std::int64_t> blocks;

  [[nodiscard]] routing_replay::request_key key() const
  {
    return named ? routing_replay::request_key{name}
                 : routing_replay::request_key{(std::int64_t{incarnation} * 1'000'000 + number) * 1000 + 7};
  }
};

/// @brief The simulated engine. Call next_step(), run the step, then complete_step().
class engine_sim {
 public:
  /// @brief What happens before the forward of a step.
  struct step {
    std::vector<std::int32_t> added;                                    ///< new requests
    std::vector<std::pair<std::int32_t, std::vector<std::int64_t>>> prefixes;  ///< cached slots
    routing_replay::step_plan plan;
    std::vector<row_meta> rows;  ///< one per row of the plan
    std::deque<std::vector<std::int64_t>> slots;  ///< backing store of the plan's slot spans
    std::vector<std::int64_t> fresh_blocks;
    struct scheduled {
      std::int32_t number, num_tokens, num_draft;
    };
    std::vector<scheduled> scheduled_requests;
  };

  /// @brief What happens after the step's rows are filed.
  struct outcome {
    std::vector<std::pair<std::int32_t, std::int32_t>> accepts;  ///< (request, drafts accepted)
    std::vector<std::int32_t> finished;
    std::vector<std::int32_t> aborted;
  };

  engine_sim(const sim_config& config, std::uint64_t seed) : cfg_(config), rng_(seed)
  {
    kv_.resize(static_cast<std::size_t>(cfg_.num_blocks));
    for (std::int64_t b = 0; b < cfg_.num_blocks; ++b) {
      free_.push_back(b);
    }
    for (std::int32_t f = 0; f < cfg_.families; ++f) {
      family_prefix_.push_back(uniform(cfg_.block_size, 3 * cfg_.block_size + 2));
    }
    for (std::int32_t i = 0; i < cfg_.num_requests; ++i) {
      sim_request r;
      r.number = i;
      r.name   = "req-" + std::to_string(i) + "-" + std::to_string(seed);
      draw(r, 0);
      requests_.push_back(r);
    }
  }

  /// @brief The requests, indexed by number.
  [[nodiscard]] const std::vector<sim_request>& requests() const noexcept { return requests_; }

  /// @brief Whether every request has finished or been aborted.
  [[nodiscard]] bool done() const
  {
    return std::all_of(requests_.begin(), requests_.end(), [](const sim_request& r) {
      return r.st == sim_request::state::finished || r.st == sim_request::state::aborted;
    });
  }

  /// @brief A live request, for mid-flight extraction (-1 if none); half the time a preempted
  /// one, whose freed blocks other requests may be refilling.
  [[nodiscard]] std::int32_t some_running()
  {
    std::vector<std::int32_t> live;
    const bool preempted_only = chance(0.5);
    for (const auto& r : requests_) {
      if (r.added && (r.st == sim_request::state::waiting ||
                      (!preempted_only && r.st == sim_request::state::running))) {
        live.push_back(r.number);
      }
    }
    return live.empty() ? -1 : live[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(live.size()) - 1))];
  }

  /// @brief Admits and schedules the next step.
  step next_step()
  {
    ++step_index_;
    step s;
    if (cfg_.endless) { reincarnate_gone(); }
    for (auto& r : requests_) {
      if (r.st == sim_request::state::pending && r.arrival_step <= step_index_) {
        r.st = sim_request::state::waiting;
        waiting_.push_back(r.number);
      }
    }
    while (!waiting_.empty() && static_cast<std::int32_t>(running_.size()) < cfg_.max_running) {
      admit(waiting_.front(), s);
      waiting_.pop_front();
    }

    std::int64_t budget = cfg_.max_tokens_per_step;
    std::set<std::int64_t> step_slots;  // a KV slot is written once per step
    for (const std::int32_t number : running_) {
      auto& r = requests_[static_cast<std::size_t>(number)];
      std::int64_t n = 0;
      std::int32_t drafts = 0;
      if (r.computed < r.prompt_len) {
        n = std::min(r.prompt_len - r.computed, budget);  // chunked prefill
      } else {
        const std::int64_t remaining = r.total_len - 1 - r.computed;
        if (remaining <= 0) { continue; }
        const std::int64_t max_d = std::min<std::int64_t>(cfg_.max_drafts, remaining - 1);
        if (max_d > 0 && chance(cfg_.p_spec)) { drafts = static_cast<std::int32_t>(uniform(1, max_d)); }
        n = 1 + drafts;
        if (n > budget) { continue; }
      }
      if (n <= 0 || !ensure_blocks(r, r.computed + n, s)) { continue; }
      // two requests whose prompts are the same fully cached blocks both recompute their last
      // prompt token into the same shared slot: the second waits for the next step
      bool collides = false;
      for (std::int64_t p = r.computed; p < r.computed + n; ++p) { collides |= step_slots.count(slot_of(r, p)) != 0; }
      if (collides) { continue; }
      for (std::int64_t p = r.computed; p < r.computed + n; ++p) { step_slots.insert(slot_of(r, p)); }
      if (chance(cfg_.p_skip) && budget - n >= 3) {
        const auto k = static_cast<std::int32_t>(uniform(1, 3));
        s.plan.skip(k);
        for (std::int32_t i = 0; i < k; ++i) { s.rows.push_back(row_meta{-1, i, step_index_}); }
        budget -= k;
      }
      auto& slots = s.slots.emplace_back();
      for (std::int64_t p = r.computed; p < r.computed + n; ++p) {
        slots.push_back(slot_of(r, p));
        s.rows.push_back(row_meta{r.number, p, step_index_});
      }
      s.plan.schedule({r.key(), r.computed, static_cast<std::int32_t>(n), drafts, slots});
      s.scheduled_requests.push_back({r.number, static_cast<std::int32_t>(n), drafts});
      budget -= n;
      if (budget <= 0) { break; }
    }
    s.plan.add_fresh_blocks(s.fresh_blocks);
    return s;
  }

  /// @brief Samples the step's outcome: draft acceptance, progress, finishes, preemption, aborts.
  outcome complete_step(const step& s)
  {
    outcome o;
    for (const auto& sched : s.scheduled_requests) {
      auto& r = requests_[static_cast<std::size_t>(sched.number)];
      if (r.st != sim_request::state::running) { continue; }
      if (sched.num_draft > 0) {
        const auto accepted = static_cast<std::int32_t>(uniform(0, sched.num_draft));
        o.accepts.emplace_back(r.number, accepted);
        r.computed += 1 + accepted;
      } else {
        r.computed += sched.num_tokens;
      }
      cache_full_blocks(r);
      if (r.computed >= r.total_len - 1) {
        r.st = sim_request::state::finished;
        free_blocks(r);
        std::erase(running_, r.number);
        o.finished.push_back(r.number);
      }
    }
    if (!running_.empty() && chance(cfg_.p_preempt)) {
      const std::int32_t victim = running_.back();
      auto& r                   = requests_[static_cast<std::size_t>(victim)];
      free_blocks(r);
      r.computed = 0;
      r.st       = sim_request::state::waiting;
      running_.pop_back();
      if (chance(0.5)) {
        waiting_.push_front(victim);
      } else {
        waiting_.push_back(victim);  // comes back later, after others reused its blocks
      }
    }
    if (chance(cfg_.p_abort)) {
      const std::int32_t victim = some_running();
      if (victim >= 0) {
        auto& r = requests_[static_cast<std::size_t>(victim)];
        free_blocks(r);
        r.st = sim_request::state::aborted;
        std::erase(running_, victim);
        std::erase(waiting_, victim);
        o.aborted.push_back(victim);
      }
    }
    return o;
  }

  /// @brief Aborts everything still live (end of a bounded run).
  std::vector<std::int32_t> abort_all()
  {
    std::vector<std::int32_t> out;
    for (auto& r : requests_) {
      if (r.st == sim_request::state::running || r.st == sim_request::state::waiting) {
        free_blocks(r);
        if (r.added) { out.push_back(r.number); }
        r.st = sim_request::state::aborted;
      }
    }
    running_.clear();
    waiting_.clear();
    return out;
  }

  /// @brief Uniform integer in [lo, hi].
  std::int64_t uniform(std::int64_t lo, std::int64_t hi)
  {
    return std::uniform_int_distribution<std::int64_t>{lo, hi}(rng_);
  }
  /// @brief True with probability p.
  bool chance(double p) { return std::bernoulli_distribution{p}(rng_); }

 private:
  struct kv_block {
    std::int32_t refs = 0;
    bool cached       = false;
    std::pair<std::int64_t, std::int64_t> content{};
  };

  // A new request's prompt, output length, family and arrival (after `first_arrival`).
  void draw(sim_request& r, std::int64_t first_arrival)
  {
    r.named      = chance(cfg_.p_string_id);
    r.family     = static_cast<std::int32_t>(uniform(0, cfg_.families - 1));
    r.shared_len = family_prefix_[static_cast<std::size_t>(r.family)];
    // some prompts are exactly the shared prefix: a full prefix hit then recomputes the last
    // prompt token into a block another request filled
    r.prompt_len   = r.shared_len + (chance(0.2) ? 0 : uniform(1, cfg_.prompt_extra));
    r.total_len    = std::min<std::int64_t>(r.prompt_len + uniform(2, cfg_.max_output), cfg_.max_model_len);
    r.arrival_step = first_arrival + uniform(0, 25);
  }

  // Endless runs: entries whose request finished or was aborted (the caller has released it by
  // now) come back as a new request with a new id, so the table, and the simulator's memory, stay
  // the same size however long the run.
  void reincarnate_gone()
  {
    for (auto& r : requests_) {
      if (r.st != sim_request::state::finished && r.st != sim_request::state::aborted) { continue; }
      ++r.incarnation;
      r.name  = "req-" + std::to_string(r.number) + "-" + std::to_string(r.incarnation) + "-soak";
      r.st    = sim_request::state::pending;
      r.added = false;
      r.computed = 0;
      draw(r, step_index_);
    }
  }

  [[nodiscard]] std::pair<std::int64_t, std::int64_t> content_of(const sim_request& r,
                                                                 std::int64_t block) const
  {
    const bool shared = (block + 1) * cfg_.block_size <= r.shared_len;
    return shared ? std::pair{-1 - std::int64_t{r.family}, block} : std::pair{std::int64_t{r.number}, block};
  }

  [[nodiscard]] std::int64_t slot_of(const sim_request& r, std::int64_t position) const
  {
    return r.blocks[static_cast<std::size_t>(position / cfg_.block_size)] * cfg_.block_size +
           position % cfg_.block_size;
  }

  void admit(std::int32_t number, step& s)
  {
    auto& r = requests_[static_cast<std::size_t>(number)];
    r.blocks.clear();
    for (std::int64_t b = 0; (b + 1) * cfg_.block_size <= r.prompt_len; ++b) {
      const auto hit = cache_.find(content_of(r, b));
      if (hit == cache_.end()) { break; }
      take(hit->second);
      r.blocks.push_back(hit->second);
    }
    // a fully cached prompt still recomputes its last token (into the shared block), as vLLM does
    r.computed = std::min<std::int64_t>(static_cast<std::int64_t>(r.blocks.size()) * cfg_.block_size,
                                        r.prompt_len - 1);
    std::vector<std::int64_t> cached;
    for (std::int64_t p = 0; p < r.computed; ++p) { cached.push_back(slot_of(r, p)); }
    if (!r.added) {
      r.added = true;
      s.added.push_back(number);
    }
    s.prefixes.emplace_back(number, std::move(cached));
    r.st = sim_request::state::running;
    running_.push_back(number);
  }

  bool ensure_blocks(sim_request& r, std::int64_t positions, step& s)
  {
    while (static_cast<std::int64_t>(r.blocks.size()) * cfg_.block_size < positions) {
      if (free_.empty()) { return false; }
      const auto pick = cfg_.random_eviction
                          ? static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(free_.size()) - 1))
                          : std::size_t{0};
      const std::int64_t b = free_[pick];
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(pick));
      auto& blk = kv_[static_cast<std::size_t>(b)];
      if (blk.cached) {  // evict its prefix-cache entry: the block gets new content
        cache_.erase(blk.content);
        blk.cached = false;
      }
      blk.refs = 1;
      r.blocks.push_back(b);
      s.fresh_blocks.push_back(b);
    }
    return true;
  }

  void take(std::int64_t b)
  {
    auto& blk = kv_[static_cast<std::size_t>(b)];
    if (blk.refs++ == 0) { std::erase(free_, b); }
  }

  void free_blocks(sim_request& r)
  {
    for (const std::int64_t b : r.blocks) {
      if (--kv_[static_cast<std::size_t>(b)].refs == 0) { free_.push_back(b); }
    }
    r.blocks.clear();
  }

  void cache_full_blocks(const sim_request& r)
  {
    for (std::int64_t b = 0; (b + 1) * cfg_.block_size <= r.computed; ++b) {
      const auto blk_id = r.blocks[static_cast<std::size_t>(b)];
      auto& blk         = kv_[static_cast<std::size_t>(blk_id)];
      if (blk.cached) { continue; }
      const auto content = content_of(r, b);
      if (cache_.emplace(content, blk_id).second) {
        blk.cached  = true;
        blk.content = content;
      }
    }
  }

  sim_config cfg_;
  std::mt19937_64 rng_;
  std::vector<sim_request> requests_;
  std::vector<std::int64_t> family_prefix_;  ///< shared prompt prefix length of each family
  std::vector<kv_block> kv_;
  std::deque<std::int64_t> free_;
  std::map<std::pair<std::int64_t, std::int64_t>, std::int64_t> cache_;
  std::vector<std::int32_t> running_;
  std::deque<std::int32_t> waiting_;
  std::int64_t step_index_ = 0;
};

}  // namespace rr_test
