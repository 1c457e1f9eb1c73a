/// @file
/// row_streams' construction (the checked configuration, the tail pool's size) and the begin_step
/// half of a step: open_step, schedule, add_block_hashes, finish, close_step (or abandon_step).
/// Included by row_streams.hpp.
#pragma once

#include <routing_replay/row_streams.hpp>

#include <new>
#include <string>
#include <utility>

namespace routing_replay {

namespace detail {

/// @brief The checked configuration.
/// @throws error invalid_config
inline row_streams_config checked_streams_config(row_streams_config c)
{
  auto positive = [](std::int64_t v, const char* what) {
    if (v <= 0) { throw error{errc::invalid_config, std::string{"row streams: "} + what + " must be positive, got " + std::to_string(v)}; }
  };
  positive(c.num_layers, "num_layers");
  positive(c.top_k, "top_k");
  positive(c.block_size, "block_size");
  positive(c.max_num_seqs, "max_num_seqs");
  positive(c.max_num_batched_tokens, "max_num_batched_tokens");
  positive(c.max_concurrent_batches, "max_concurrent_batches");
  if (c.element_bytes != 1 && c.element_bytes != 2 && c.element_bytes != 4) {
    throw error{errc::invalid_config, "row streams: ids are 1, 2 or 4 bytes, got " + std::to_string(c.element_bytes)};
  }
  return c;
}

/// @brief Tail-pool slots: every step in flight may complete a block per request plus one per
/// block of its rows, and every request holds one tail (vLLM's RoutedExpertsBuffer sizing).
inline std::int32_t pool_slots_for(const row_streams_config& c)
{
  const std::int64_t step_blocks = (c.max_num_batched_tokens + c.block_size - 1) / c.block_size + c.max_num_seqs;
  return static_cast<std::int32_t>(c.max_concurrent_batches * step_blocks + c.max_num_seqs);
}

}  // namespace detail

inline row_streams::row_streams(const row_streams_config& config, describe_fn describe)
  : config_(detail::checked_streams_config(config)),
    row_bytes_(static_cast<std::size_t>(config_.num_layers) * static_cast<std::size_t>(config_.top_k) *
               static_cast<std::size_t>(config_.element_bytes)),
    block_bytes_(row_bytes_ * static_cast<std::size_t>(config_.block_size)),
    describe_(std::move(describe)),
    pool_(detail::pool_slots_for(config_)),
    pool_memory_(new (std::align_val_t{64}) std::byte[static_cast<std::size_t>(pool_.size()) * block_bytes_]()),
    filing_(std::make_unique<detail::filing_state>(block_bytes_, config_.max_bytes, config_.tier_options)),
    worker_(config_.filing_depth, [filing = filing_.get()](detail::filing_task& task) { filing->run(task); })
{
  // value-initialized above: every page of the pool is touched now, not in a step
  steps_.resize(static_cast<std::size_t>(config_.max_concurrent_batches));
  completed_.reserve(static_cast<std::size_t>(pool_.size()));
  freed_slots_.reserve(static_cast<std::size_t>(pool_.size()));
}

// ---- begin_step -----------------------------------------------------------------------------------

inline void row_streams::open_step(std::uint64_t generation, packed_hashes retained, packed_hashes released)
{
  forgotten_.clear();
  if (closed_) { throw error{errc::invalid_state, "begin_step after close(): the block tier is closed"}; }
  if (generation < generation_) {
    throw stream_input_error{"metadata generation moved backwards, from " + std::to_string(generation_) + " to " +
                             std::to_string(generation)};
  }
  if (generation > generation_ && in_flight_ > 0) {
    throw error{errc::invalid_state, "metadata generation changed from " + std::to_string(generation_) + " to " +
                                       std::to_string(generation) + " with " + std::to_string(in_flight_) +
                                       " step(s) in flight: a prefix-cache reset waits for every step's output"};
  }
  requests_.release_quarantine();  // everything the filing thread will see about them is submitted
  detail::filing_task& task = worker_.next();
  task.clear();
  building_ = &task;
  finished_now_.clear();
  with_keys_.clear();
  // the hashes the scheduler retains and releases are keys of the generation before a reset
  for (const auto& [hashes, list] : {std::pair{retained, &task.retains}, std::pair{released, &task.releases}}) {
    for (std::size_t i = 0; i < hashes.count; ++i) {
      const std::size_t offset = task.hashes.size();
      task.hashes.insert(task.hashes.end(), hashes.data + i * hashes.item_size, hashes.data + (i + 1) * hashes.item_size);
      list->push_back({.request = -1, .generation = generation_, .offset = offset,
                       .size = static_cast<std::uint32_t>(hashes.item_size)});
    }
  }
  if (generation > generation_) {  // a prefix-cache reset: every request's keys go, and every request
    for (handle h = requests_.oldest(); h != detail::none; h = requests_[h].newer) { release_all_keys(h, task); }
    while (requests_.oldest() != detail::none) {
      const handle h = requests_.oldest();
      requests_.remove(h);
      task.dropped.push_back(h);
      forgotten_.push_back(h);
    }
    pool_.reset();
    generation_ = generation;
  }
}

inline row_streams::handle row_streams::schedule(handle h, std::int64_t emit_start)
{
  if (building_ == nullptr) { throw error{errc::invalid_state, "schedule() outside open_step() ... close_step()"}; }
  if (h == new_request) { return requests_.add(emit_start); }
  if (!requests_.live(h)) { throw stream_input_error{"schedule(): " + name(h) + " is not a live request"}; }
  const detail::stream_request& r = requests_[h];
  // steps in flight leave the cursor behind the scheduler's optimistic view: only settled ones are checked
  if (r.in_flight == 0 && emit_start > r.emit_cursor) {
    throw stream_input_error{name(h) + ": the scheduler's emit start " + std::to_string(emit_start) +
                             " is ahead of the rows handed out so far (emit cursor " + std::to_string(r.emit_cursor) +
                             ", no step in flight)"};
  }
  return h;
}

inline void row_streams::add_block_hashes(handle h, packed_hashes hashes)
{
  if (building_ == nullptr) { throw error{errc::invalid_state, "add_block_hashes() outside open_step() ... close_step()"}; }
  if (!requests_.live(h)) {
    throw stream_input_error{"block hashes for " + name(h) + ", which is neither scheduled nor known"};
  }
  detail::filing_task& task = *building_;
  detail::stream_request& r = requests_[h];
  with_keys_.push_back(h);
  if (hashes.count == 0) { return; }
  const std::size_t offset = task.hashes.size();
  task.hashes.insert(task.hashes.end(), hashes.data, hashes.data + hashes.count * hashes.item_size);
  task.appends.push_back({h, generation_, offset, static_cast<std::uint32_t>(hashes.count),
                          static_cast<std::uint32_t>(hashes.item_size)});
  task.retains.push_back({.request = h, .first = r.num_keys, .count = static_cast<std::int64_t>(hashes.count)});
  r.num_keys += static_cast<std::int64_t>(hashes.count);
}

inline void row_streams::finish(handle h)
{
  if (building_ == nullptr) { throw error{errc::invalid_state, "finish() outside open_step() ... close_step()"}; }
  if (!requests_.live(h)) { throw stream_input_error{"finished " + name(h) + ", which is not a live request"}; }
  detail::stream_request& r = requests_[h];
  r.finished                = true;
  if (r.in_flight > 0) { return; }  // it goes when the last step covering it is processed
  finished_now_.push_back(h);
  release_all_keys(h, *building_);
}

inline void row_streams::close_step()
{
  if (building_ == nullptr) { throw error{errc::invalid_state, "close_step() without open_step()"}; }
  detail::filing_task& task = *building_;
  building_                 = nullptr;
  batches_.clear();
  completed_.clear();
  for (const handle h : with_keys_) { batches_.push_back({h, 0, 0}); }
  rows_used_ = false;
  try {
    publish(task);
  } catch (...) {
    task.update = false;
    submit(task);
    throw;
  }
  const bool failed = task.update && filing_->failed();
  if (!failed) {
    for (const handle h : finished_now_) { teardown(h, task); }
  }
  // The metadata's update waits for the step's commit to wake the filing thread, which runs both in
  // order: a sleeping thread's wake is a system call on this thread, one a step rather than two. What
  // reads the tier or the tails before then waits for the thread, which wakes it; the deferral is
  // bounded (filing_worker wakes it once a quarter of its slots hold tasks).
  submit(task, /*wake_later=*/true);
  if (!failed) { give_back_after_filing(); }
  check_filing_if(failed);
}

inline void row_streams::abandon_step() noexcept
{
  if (building_ == nullptr) { return; }
  detail::filing_task& task = *building_;
  building_                 = nullptr;
  task.update               = false;
  task.objects.clear();
  task.retains.clear();
  task.releases.clear();
  submit(task);
}

}  // namespace routing_replay
