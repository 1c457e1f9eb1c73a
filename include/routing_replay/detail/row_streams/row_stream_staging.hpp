/// @file
/// row_streams' tail pool and its hand-over to the filing thread: the staging of a step's rows
/// into tails and full blocks, the publication of full blocks whose keys are known, teardown, and
/// the submission of each call's filing task. Included by row_streams.hpp.
#pragma once

#include <routing_replay/row_streams.hpp>

#include <algorithm>
#include <string>

namespace routing_replay {

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

inline void row_streams::submit(detail::filing_task& task, bool wake_later)
{
  if (task.empty()) { return; }
  // Every copy goes to the filing thread, even a decode step's few rows: made here they would pull
  // the tails' cold lines into the engine's caches, which on an H200 cost the step's calls more than
  // the wake they save. A task of row copies alone is deferred (one wake serves several steps): what
  // reads the tails waits for the thread first, and the copies' rows stay held until they ran.
  // `wake_later`: the caller knows a task that wakes the thread follows soon (see close_step()).
  const bool copies_only = task.appends.empty() && !task.update && task.dropped.empty() && task.objects.empty();
  worker_.submit(wake_later || copies_only);
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

}  // namespace routing_replay
