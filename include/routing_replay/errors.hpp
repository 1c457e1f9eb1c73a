/// @file
/// The single exception type the library throws and the codes that classify it.
#pragma once

#include <stdexcept>
#include <string>

namespace routing_replay {

/// @brief What went wrong. Every host-side error maps to exactly one code so that engines can
/// react programmatically without parsing messages.
enum class errc {
  invalid_config,          ///< the replay_config is inconsistent (zero sizes, bad layer list, ...)
  index_type_too_narrow,   ///< the index type cannot hold every expert id plus the sentinel
  unknown_layer,           ///< a model layer that the layer map does not capture
  too_many_tokens,         ///< a step or capture larger than max_tokens_per_step
  unknown_request,         ///< a request id that was never added, or was already released
  duplicate_request,       ///< a request id added twice, or scheduled twice in one step
  position_out_of_range,   ///< a token position at or past max_model_len, or negative
  slot_out_of_range,       ///< a KV slot outside the block pool, or a malformed slot list
  invalid_plan,            ///< a step plan that is malformed in another way (counts, drafts)
  invalid_expert_id,       ///< an expert id outside [0, E) seen on the device during the step
  missing_routing,         ///< a captured layer left rows of the step unwritten
  host_memory_exhausted,   ///< storing the step would exceed the host memory limit
  invalid_state,           ///< a call out of order (end_step without begin_step, ...)
  draft_error,             ///< accept_draft without pending drafts, or extraction with unresolved drafts
  invalid_argument,        ///< a malformed call argument (null pointer, stride shorter than K, ...)
  backend_error,           ///< the CUDA runtime (or the host backend) reported a failure
  invalid_packet,          ///< a step packet that is truncated, corrupted, of another version or shape, or not this step's
  invalid_record,          ///< a route record that is truncated, corrupted, of an unknown version or codec, past the limits, or holds ids >= E
};

/// @brief Exception thrown by every host-side operation of the library.
///
/// Guarantee: when a member function of RoutingReplay throws, the object is in the state it was in
/// before the call (strong guarantee), except end_step, which discards the failed step as a whole
/// and leaves the object ready for the next begin_step. Rows stored before the error are never lost.
class error : public std::runtime_error {
 public:
  /// @brief Creates an error with a code and a message that names the offending value.
  error(errc code, const std::string& message) : std::runtime_error(message), code_(code) {}

  /// @brief The classification of this error.
  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  errc code_;
};

}  // namespace routing_replay
