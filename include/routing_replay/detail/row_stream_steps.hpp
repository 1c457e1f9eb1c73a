/// @file
/// row_streams' calls: the begin_step half (open_step ... close_step) and the step half (prepare,
/// commit, retire), with the staging of rows into tails, the publication of full blocks whose keys
/// are known, and the read-back of rows from the tier. Included by row_streams.hpp.
#pragma once

#include <routing_replay/row_streams.hpp>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

namespace routing_replay {

namespace detail {

/// @brief "[a, b)".
inline std::string range_text(std::int64_t a, std::int64_t b)
{
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

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
  submit(task);
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

// ---- a step's rows ---------------------------------------------------------------------------------

inline int row_streams::prepare(std::span<const handle> handles, const std::int64_t* token_starts,
                                const std::int64_t* query_start_loc)
{
  forgotten_.clear();
  if (in_flight_ >= config_.max_concurrent_batches) {
    throw error{errc::invalid_state, std::to_string(in_flight_) + " step(s) in flight already (max_concurrent_batches " +
                                       std::to_string(config_.max_concurrent_batches) +
                                       "): each step's output must be processed, in order, before more are prepared"};
  }
  for (const handle h : handles) {
    if (!requests_.live(h)) { throw stream_input_error{"prepare(): " + name(h) + " is not a live request"}; }
  }
  int step = 0;
  while (steps_[static_cast<std::size_t>(step)].used) { ++step; }
  prepared_step& s = steps_[static_cast<std::size_t>(step)];
  s.used           = true;
  s.handles.assign(handles.begin(), handles.end());
  s.token_starts.assign(token_starts, token_starts + handles.size());
  s.query_start_loc.assign(query_start_loc, query_start_loc + handles.size() + 1);
  ++in_flight_;
  for (const handle h : handles) { ++requests_[h].in_flight; }
  return step;
}

template <class Sink>
void row_streams::commit(int step, const std::byte* rows, const std::int64_t* num_sampled,
                         const std::int64_t* num_rejected, step_rows_owner* owner, Sink& sink)
{
  forgotten_.clear();
  if (step < 0 || step >= static_cast<int>(steps_.size()) || !steps_[static_cast<std::size_t>(step)].used) {
    throw error{errc::invalid_state, "commit(): step " + std::to_string(step) + " is not in flight"};
  }
  try {
    if (closed_) { throw error{errc::invalid_state, "process_output after close(): the block tier is closed"}; }
    const prepared_step& s = steps_[static_cast<std::size_t>(step)];
    const std::int64_t bs  = config_.block_size;
    completed_.clear();
    batches_.clear();
    reads_.clear();
    rows_used_                = false;
    detail::filing_task& task = worker_.next();
    task.clear();
    try {
      for (std::size_t i = 0; i < s.handles.size(); ++i) {
        const handle h            = s.handles[i];
        detail::stream_request& r = requests_[h];
        const std::int64_t begin = s.query_start_loc[i], tokens = s.query_start_loc[i + 1] - begin;
        if (tokens <= 0) {
          throw stream_input_error{name(h) + ": rows " + detail::range_text(begin, begin + tokens) +
                                   " of the step: a request's token count must be positive"};
        }
        const std::int64_t rejected = num_rejected[i];
        if (rejected < 0 || rejected > tokens) {
          throw stream_input_error{name(h) + ": " + std::to_string(rejected) + " rejected tokens of " +
                                   std::to_string(tokens) + " scheduled"};
        }
        const std::int64_t count   = tokens - rejected;  // capture precedes acceptance: the rejected suffix goes
        const std::byte* own_rows  = rows + static_cast<std::size_t>(begin) * row_bytes_;
        std::int64_t capture_start = s.token_starts[i];
        const std::int64_t cursor  = r.captured ? r.capture_cursor : capture_start;
        if (capture_start < cursor) {
          throw stream_input_error{name(h) + ": capture moved backwards: this step's rows start at position " +
                                   std::to_string(capture_start) + ", but positions up to " + std::to_string(cursor) +
                                   " were captured already"};
        }
        if (capture_start > cursor) {  // reattach after an optimistically scheduled suffix was rejected
          if (cursor >= r.scheduled_cursor) {
            throw stream_input_error{name(h) + ": positions " + detail::range_text(cursor, capture_start) +
                                     " were never scheduled (an unbacked gap before this step's rows)"};
          }
          capture_start = cursor;
        }
        if (!r.captured && capture_start % bs != 0) {
          r.skip_until = (capture_start / bs + 1) * bs;  // a partial first block: computed elsewhere before it
        }
        const std::int64_t emit_start = r.emit_cursor;
        const std::size_t first       = completed_.size();
        stage(h, capture_start, own_rows, count, task);
        const std::int64_t token_end = capture_start + count;
        r.capture_cursor             = token_end;
        r.captured                   = true;
        r.scheduled_cursor           = s.token_starts[i] + tokens;
        batches_.push_back({h, first, completed_.size()});
        if (num_sampled[i] > 0 && emit_start <= token_end) {
          if (emit_start >= capture_start) {
            sink.view(i, emit_start, own_rows + static_cast<std::size_t>(emit_start - capture_start) * row_bytes_,
                      token_end - emit_start);
            r.emit_cursor = token_end;
          } else {
            reads_.push_back({i, emit_start, token_end});
          }
        }
      }
      publish(task);  // before any read-back: a request may read a block another stored in this step
    } catch (...) {
      task.update = false;
      attach_rows(task, owner);
      submit(task);
      throw;
    }
    const bool failed = task.update && filing_->failed();
    attach_rows(task, owner);
    submit(task);
    if (!failed) { give_back_after_filing(); }
    check_filing_if(failed);
    for (const pending_read& m : reads_) { read_back(s.handles[m.index], m, sink); }
  } catch (...) {
    retire(step);
    throw;
  }
  retire(step);
}

inline void row_streams::retire(int step)
{
  if (step < 0 || step >= static_cast<int>(steps_.size()) || !steps_[static_cast<std::size_t>(step)].used) { return; }
  prepared_step& s = steps_[static_cast<std::size_t>(step)];
  s.used           = false;
  --in_flight_;
  finished_now_.clear();
  detail::filing_task& task = worker_.next();
  task.clear();
  for (const handle h : s.handles) {
    detail::stream_request& r = requests_[h];
    if (--r.in_flight == 0 && r.finished) {
      finished_now_.push_back(h);
      release_all_keys(h, task);
    }
  }
  if (finished_now_.empty()) { return; }
  task.update       = !task.releases.empty();
  const bool failed = task.update && filing_->failed();
  if (!failed) {
    for (const handle h : finished_now_) { teardown(h, task); }
  }
  submit(task);
  check_filing_if(failed);
}

// ---- parts ---------------------------------------------------------------------------------------

inline std::int32_t row_streams::take_slot(handle h, std::int64_t block_start)
{
  const std::int32_t slot = pool_.take(worker_.completed(), [&](std::uint64_t task) { worker_.wait_for(task); });
  if (slot == detail::none) {
    throw error{errc::invalid_state, name(h) + ": block " + detail::range_text(block_start, block_start + config_.block_size) +
                                       " needs a tail-pool slot, but all " + std::to_string(pool_.size()) +
                                       " hold incomplete blocks or full blocks still waiting for their keys"};
  }
  return slot;
}

inline void row_streams::stage(handle h, std::int64_t token_start, const std::byte* rows, std::int64_t count,
                               detail::filing_task& task)
{
  if (token_start < 0) {
    throw stream_input_error{name(h) + ": token start " + std::to_string(token_start) + " is negative"};
  }
  detail::stream_request& r = requests_[h];
  const std::int64_t bs     = config_.block_size;
  std::int64_t offset       = 0;
  if (token_start < r.skip_until) { offset = std::min(count, r.skip_until - token_start); }  // not kept here
  while (offset < count) {
    const std::int64_t position    = token_start + offset;
    const std::int64_t block_start = position / bs * bs;
    const std::int64_t local       = position - block_start;
    const std::byte* from          = rows + static_cast<std::size_t>(offset) * row_bytes_;
    if (r.tail_slot == detail::none && local == 0 && count - offset >= bs) {  // a whole block: no tail
      completed_.push_back({block_start, detail::none, from});
      offset += bs;
      continue;
    }
    if (r.tail_slot == detail::none) {
      r.tail_slot   = take_slot(h, block_start);
      r.tail_start  = block_start;
      r.tail_length = 0;
    } else if (r.tail_start != block_start) {
      throw stream_input_error{name(h) + ": rows at position " + std::to_string(position) + " skip the incomplete block " +
                               detail::range_text(r.tail_start, r.tail_start + bs) + " (it holds " +
                               std::to_string(r.tail_length) + " rows)"};
    }
    if (local != r.tail_length) {
      throw stream_input_error{name(h) + ": rows are not contiguous: expected position " +
                               std::to_string(r.tail_start + r.tail_length) + ", got " + std::to_string(position)};
    }
    const std::int64_t n = std::min(bs - local, count - offset);
    // by the filing thread, which reads the tail when its block is full: the engine's thread neither
    // reads the step's rows (a device's copy: not in its cache) nor writes the tail (a miss a row)
    task.copies.push_back({pool_rows(r.tail_slot) + static_cast<std::size_t>(local) * row_bytes_, from,
                           static_cast<std::size_t>(n) * row_bytes_});
    rows_used_ = true;
    r.tail_length += static_cast<std::int32_t>(n);
    offset += n;
    if (r.tail_length == bs) {
      completed_.push_back({block_start, r.tail_slot, pool_rows(r.tail_slot)});
      r.tail_slot = detail::none;
    }
  }
}

inline void row_streams::publish(detail::filing_task& task)
{
  const std::int64_t bs = config_.block_size;
  freed_slots_.clear();
  for (const batch& b : batches_) {
    detail::stream_request& r  = requests_[b.request];
    const std::int64_t keyed   = r.num_keys * bs;
    std::int32_t needed        = 0;  // slots for full blocks of the step's rows that must wait
    for (std::size_t i = b.first; i < b.last; ++i) {
      needed += completed_[i].start >= keyed && completed_[i].slot == detail::none ? 1 : 0;
    }
    if (needed > pool_.free()) {
      const completed_block& c = *std::find_if(completed_.begin() + static_cast<std::ptrdiff_t>(b.first),
                                               completed_.end(), [&](const completed_block& x) {
                                                 return x.start >= keyed && x.slot == detail::none;
                                               });
      static_cast<void>(take_slot(b.request, c.start));  // throws, naming the block
    }
    std::int32_t keep_first = detail::none, keep_last = detail::none;
    auto keep = [&](std::int32_t slot, std::int64_t start) {
      pool_.start(slot) = start;
      pool_.next(slot)  = detail::none;
      if (keep_last == detail::none) { keep_first = slot; } else { pool_.next(keep_last) = slot; }
      keep_last = slot;
    };
    for (std::int32_t slot = r.waiting_first; slot != detail::none;) {  // blocks that waited first
      const std::int32_t next  = pool_.next(slot);
      const std::int64_t start = pool_.start(slot);
      if (start < keyed) {
        task.objects.push_back({b.request, start / bs, pool_rows(slot)});
        freed_slots_.push_back(slot);
      } else {
        keep(slot, start);
      }
      slot = next;
    }
    for (std::size_t i = b.first; i < b.last; ++i) {
      const completed_block& c = completed_[i];
      if (c.start < keyed) {
        task.objects.push_back({b.request, c.start / bs, c.rows});
        if (c.slot != detail::none) { freed_slots_.push_back(c.slot); } else { rows_used_ = true; }
        continue;
      }
      std::int32_t slot = c.slot;
      if (slot == detail::none) {  // a block of the step's rows waits in the pool for its key
        slot = take_slot(b.request, c.start);
        task.copies.push_back({pool_rows(slot), c.rows, block_bytes_});
        rows_used_ = true;
      }
      keep(slot, c.start);
    }
    r.waiting_first = keep_first;
    r.waiting_last  = keep_last;
  }
  task.update = !task.objects.empty() || !task.retains.empty() || !task.releases.empty();
}

inline void row_streams::teardown(handle h, detail::filing_task& task)
{
  detail::stream_request& r = requests_[h];
  for (std::int32_t slot = r.waiting_first; slot != detail::none;) {
    const std::int32_t next = pool_.next(slot);
    pool_.give(slot);
    slot = next;
  }
  if (r.tail_slot != detail::none) { pool_.give(r.tail_slot); }
  requests_.remove(h);
  task.dropped.push_back(h);
  forgotten_.push_back(h);
}

inline void row_streams::release_all_keys(handle h, detail::filing_task& task)
{
  const std::int64_t keys = requests_[h].num_keys;
  if (keys > 0) { task.releases.push_back({.request = h, .first = 0, .count = keys, .reversed = true}); }
}

inline void row_streams::attach_rows(detail::filing_task& task, step_rows_owner* owner) noexcept
{
  if (rows_used_ && owner != nullptr) {
    owner->retain_rows();
    task.rows = owner;
  }
}

inline void row_streams::submit(detail::filing_task& task)
{
  if (!task.empty()) { worker_.submit(); }
}

inline void row_streams::give_back_after_filing()
{
  // the task just submitted stores these slots' blocks: they are reused once it ran
  for (const std::int32_t slot : freed_slots_) { pool_.give_after(slot, worker_.submitted()); }
  freed_slots_.clear();
}

inline void row_streams::check_filing_if(bool failed) const
{
  if (failed) { throw block_store_error{"publication to the block tier failed earlier: " + filing_->failure()}; }
}

template <class Sink>
void row_streams::read_back(handle h, const pending_read& m, Sink& sink)
{
  const detail::stream_request& r = requests_[h];
  const std::int64_t bs           = config_.block_size;
  const std::int64_t stored_end   = std::min(m.end / bs, r.num_keys) * bs;
  std::int64_t tail_from          = m.start;
  auto unavailable_note = [&] {
    return m.start < r.skip_until ? std::string{" (its rows before position "} + std::to_string(r.skip_until) +
                                      " were computed on another instance and are not kept here)"
                                  : std::string{};
  };
  if (m.start < stored_end) {
    worker_.drain();  // the tier as every earlier task left it
    check_filing_if(filing_->failed());
    const std::int64_t first = m.start / bs, last = stored_end / bs;
    const detail::request_keys& keys = filing_->keys_of(h);
    key_scratch_.clear();
    for (std::int64_t b = first; b < last; ++b) { key_scratch_.push_back(keys.key(b)); }
    read_scratch_.resize(static_cast<std::size_t>(last - first) * block_bytes_);
    block_tier& tier = filing_->tier();
    if (const auto missing = tier.read(key_scratch_, read_scratch_.data())) {
      const std::int64_t block = first + static_cast<std::int64_t>(*missing);
      throw block_store_error{name(h) + ": rows " + detail::range_text(m.start, m.end) + " need block " +
                              std::to_string(block) + " (positions " + detail::range_text(block * bs, block * bs + bs) +
                              "), which is not in the block tier: evicted or never stored (" +
                              std::to_string(tier.stored_blocks()) + " of " + std::to_string(tier.limit_blocks()) +
                              " blocks stored)" + unavailable_note()};
    }
    tail_from = stored_end;
  }
  if (tail_from < m.end) {
    worker_.drain();  // the filing thread writes tails
    if (r.tail_slot == detail::none || tail_from < r.tail_start || m.end > r.tail_start + r.tail_length) {
      throw error{errc::missing_routing,
                  name(h) + ": rows " + detail::range_text(tail_from, m.end) + " are neither stored nor in its tail (" +
                    (r.tail_slot == detail::none ? std::string{"no tail"}
                                                 : "tail " + detail::range_text(r.tail_start, r.tail_start + r.tail_length)) +
                    ")" + unavailable_note()};
    }
  }
  std::byte* out = sink.materialize(m.index, m.start, m.end - m.start);
  const std::size_t stored_bytes = static_cast<std::size_t>(tail_from - m.start) * row_bytes_;
  if (stored_bytes > 0) {
    std::memcpy(out, read_scratch_.data() + static_cast<std::size_t>(m.start % bs) * row_bytes_, stored_bytes);
  }
  if (tail_from < m.end) {
    std::memcpy(out + stored_bytes, pool_rows(r.tail_slot) + static_cast<std::size_t>(tail_from - r.tail_start) * row_bytes_,
                static_cast<std::size_t>(m.end - tail_from) * row_bytes_);
  }
  requests_[h].emit_cursor = m.end;
}

}  // namespace routing_replay
