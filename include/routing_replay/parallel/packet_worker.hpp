/// @file
/// The worker side of an engine whose host storage lives in another process: the same capture paths
/// and end-of-step kernel as RoutingReplay, the same copy pipeline, but each step's rows, once on
/// the host, are packed into a step packet (parallel/step_packet.hpp) and handed to the engine,
/// which sends it to its scheduler (parallel/scheduler_replay.hpp). The worker keeps no requests
/// and no host storage.
#pragma once

#include <routing_replay/backend.hpp>
#include <routing_replay/buffer_layout.hpp>
#include <routing_replay/copy_strategy.hpp>
#include <routing_replay/data_path/capture_buffer.hpp>
#include <routing_replay/data_path/capture_paths.hpp>
#include <routing_replay/data_path/copy_pipeline.hpp>
#include <routing_replay/data_path/step_record.hpp>
#include <routing_replay/detail/thread_check.hpp>
#include <routing_replay/detail/validate_config.hpp>
#include <routing_replay/errors.hpp>
#include <routing_replay/layer_map.hpp>
#include <routing_replay/parallel/step_packet.hpp>
#include <routing_replay/step_plan.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace routing_replay {

/// @brief Captures on a worker and delivers one packet per step, in step order, to `deliver`.
///
/// Steps are counted from 1 (the serial a packet carries); its scheduler counts the same steps. A
/// step's verdict travels in its packet: the scheduler reports a device-detected problem, naming the
/// request. Packets are delivered from end_step() or drain(), as the copy strategy files steps
/// (sync_copy: in the step's own end_step()). The bytes are valid during the call only.
/// The capture paths (capture(), layer_view(), ref()) are RoutingReplay's (capture_paths). A usable
/// output side of parallel_replay (a tensor-, sequence- or pipeline-parallel worker group
/// whose output rank packs).
template <backend Backend, expert_index Index = std::int16_t, buffer_layout Layout = layer_major,
          copy_strategy Copy = sync_copy>
class packet_worker : public capture_paths<packet_worker<Backend, Index, Layout, Copy>, Backend, Index, Layout> {
  friend capture_paths<packet_worker, Backend, Index, Layout>;  // calls capture_target(), enter()
  static_assert(Copy::site == scatter_site::host,
                "a worker packs rows from a pinned staging; device_scatter writes host storage, which lives "
                "in the scheduler process: use sync_copy, async_event or double_buffered");

 public:
  using backend_type    = Backend;                                 ///< the backend policy
  using index_type      = Index;                                   ///< the id type of the packets
  using layout_type     = Layout;                                  ///< the device-buffer layout
  using copy_type       = Copy;                                    ///< the copy strategy
  using stream_ref      = typename Backend::stream_ref;            ///< stream handle taken by every call
  using buffer_type     = capture_buffer<Backend, Index, Layout>;  ///< D and the capture paths
  /// @brief Receives each step's packet (e.g. sends it to the scheduler).
  using deliver_type = std::function<void(std::span<const std::byte>)>;

  /// @brief Validates the configuration (its storage fields are the scheduler's business) and
  /// allocates D and the ring; packets go to `deliver`.
  /// @throws error invalid_config, index_type_too_narrow, backend_error
  packet_worker(replay_config config, deliver_type deliver) : packet_worker(std::move(config), std::move(deliver), std::nullopt) {}
  /// @brief As above, with copies on the engine's `copy_stream` (strategies with a side stream).
  packet_worker(replay_config config, deliver_type deliver, stream_ref copy_stream)
    requires(Copy::uses_side_stream)
    : packet_worker(std::move(config), std::move(deliver), std::optional<stream_ref>{copy_stream})
  {
  }

  /// @brief L.
  [[nodiscard]] std::int32_t num_layers() const noexcept { return buffer_.layers().num_layers(); }
  /// @brief Steps whose packets have not been delivered yet (copies in flight).
  [[nodiscard]] std::size_t steps_in_flight() const noexcept { return pipeline_.size(); }
  /// @brief The layer slot of a model layer.
  /// @throws error unknown_layer
  [[nodiscard]] std::int32_t layer_slot(std::int32_t model_layer) const { return buffer_.layers().slot(model_layer); }

  /// @brief Opens a step: only the plan's rows and runs are read (the scheduler validates the plan).
  /// @throws error invalid_state, too_many_tokens
  void begin_step(const step_plan& plan, stream_ref compute)
  {
    [[maybe_unused]] const auto inside = enter("begin_step");
    if (open_) { throw error{errc::invalid_state, "begin_step: a step is still open; call end_step first"}; }
    if (plan.num_rows() > config_.max_tokens_per_step) {
      throw error{errc::too_many_tokens, "step plan has " + std::to_string(plan.num_rows()) +
                                           " tokens, more than max_tokens_per_step " +
                                           std::to_string(config_.max_tokens_per_step)};
    }
    buffer_.begin_step(plan.num_rows(), compute);
    if (spare_.empty()) {
      pending_.emplace_back(num_layers(), config_.top_k);
    } else {
      pending_.push_back(std::move(spare_.back()));
      spare_.pop_back();
    }
    pending_.back().begin(plan, ++serial_);
    record_.serial      = serial_;
    record_.num_rows    = plan.num_rows();
    record_.padded_rows = plan.padded_rows();
    open_               = true;
  }

  /// @brief Closes the step (RoutingReplay::end_step()); packets of the steps filed are delivered.
  /// @throws error invalid_state, backend_error, whatever `deliver` throws
  void end_step(stream_ref compute)
  {
    end_step(compute, [](buffer_type& d, const step_record<Index>& step, Index* snapshot, detail::step_status* status,
                         stream_ref s) { d.end_step(snapshot, status, step.num_rows, step.padded_rows, s); });
  }

  /// @brief end_step() with the end-of-step work enqueued by `harvest` (RoutingReplay::end_step()).
  template <class Harvest>
  void end_step(stream_ref compute, Harvest&& harvest)
  {
    [[maybe_unused]] const auto inside = enter("end_step");
    if (!open_) { throw error{errc::invalid_state, "end_step without an open step; call begin_step first"}; }
    open_ = false;
    packing_sink sink{*this};
    auto enqueue = [&](const step_record<Index>& step, Index* snapshot, detail::step_status* status, stream_ref s) {
      harvest(buffer_, step, snapshot, status, s);
    };
    pipeline_.push(record_, enqueue, compute, sink);
  }

  /// @brief Delivers the packets of every step still in flight, waiting for their copies.
  void drain()
  {
    [[maybe_unused]] const auto inside = enter("drain");
    packing_sink sink{*this};
    pipeline_.drain(sink);
  }

 private:
  using slot_type = typename copy_pipeline<Backend, Index, Copy>::slot_type;

  [[nodiscard]] buffer_type& capture_target() noexcept { return buffer_; }
  [[nodiscard]] auto enter(const char* what) { return threads_.enter(what); }

  // The copy pipeline's sink: a step's rows arrived (or never will): pack and deliver its packet.
  struct packing_sink {
    packet_worker& worker;
    void file(slot_type& slot) { worker.deliver_next(*Backend::data(slot.status), Backend::data(slot.staging)); }
    void discard(const step_record<Index>&) { worker.deliver_next(detail::step_status{}, nullptr); }
    void retired(const step_record<Index>&) noexcept {}
  };

  packet_worker(replay_config config, deliver_type deliver, std::optional<stream_ref> copy_stream)
    : config_(detail::validated_config<Index>(std::move(config))),
      deliver_(std::move(deliver)),
      buffer_(config_, layer_map{config_}),
      pipeline_(static_cast<std::size_t>(config_.max_tokens_per_step),
                static_cast<std::size_t>(buffer_.layers().num_layers()) * static_cast<std::size_t>(config_.top_k),
                copy_stream)
  {
  }

  // Steps leave the pipeline oldest first, so the oldest pending packet is theirs.
  void deliver_next(const detail::step_status& status, const Index* rows)
  {
    spare_.push_back(std::move(pending_.front()));  // reused by a later step, whatever deliver_ does
    pending_.pop_front();
    deliver_(spare_.back().finish(status, rows));
  }

  replay_config config_;
  detail::thread_check threads_;  // debug builds: one thread at a time inside
  deliver_type deliver_;
  buffer_type buffer_;
  std::deque<step_packet_writer<Index>> pending_;  // packets of the steps not yet delivered, oldest first
  std::vector<step_packet_writer<Index>> spare_;   // delivered ones, reused
  std::uint64_t serial_      = 0;
  bool open_                 = false;
  step_record<Index> record_;  // the open step (serial and rows: all the pipeline reads)
  copy_pipeline<Backend, Index, Copy> pipeline_;  // last: destroyed first, waiting for its copies
};

}  // namespace routing_replay
