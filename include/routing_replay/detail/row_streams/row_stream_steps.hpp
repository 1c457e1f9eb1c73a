/// @file
/// row_streams' step half: prepare (prepare_output), commit (process_output: cursors, outputs as
/// views of the step's rows or read back from the tier and the request's tail) and retire.
/// Included by row_streams.hpp.
#pragma once

#include <routing_replay/row_streams.hpp>

#include <algorithm>
#include <cstring>
#include <string>

namespace routing_replay {

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
