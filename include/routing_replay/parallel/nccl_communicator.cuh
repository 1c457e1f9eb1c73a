/// @file
/// The `communicator` over NCCL for the CUDA backend: a non-owning handle on the engine's
/// `ncclComm_t`. The library never creates, splits or destroys communicators, and never enables
/// NVLink multicast (NVLS) itself. Include only where NCCL is available (nccl.h, libnccl).
#pragma once

#include <routing_replay/errors.hpp>

#include <cuda/stream_ref>

#include <nccl.h>

#include <cstddef>
#include <string>

namespace routing_replay {

/// @brief The engine's NCCL communicator as a `communicator` over CUDA streams. Trivially
/// copyable; the communicator must outlive it and every operation it enqueued.
///
/// Every operation moves bytes (ncclUint8) on the stream it is given, so it is CUDA-graph
/// capturable as NCCL's own calls are; point-to-point calls of one step may be grouped by the
/// engine (ncclGroupStart/End) or not: each recv matches its peer's send in order.
class nccl_communicator {
 public:
  /// @brief Wraps the engine's communicator; its rank and size are read once.
  /// @throws error backend_error if NCCL cannot report them
  explicit nccl_communicator(ncclComm_t comm) : comm_(comm)
  {
    check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check(ncclCommCount(comm_, &size_), "ncclCommCount");
  }

  /// @brief This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// @brief Ranks in the communicator.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// @brief The raw handle.
  [[nodiscard]] ncclComm_t get() const noexcept { return comm_; }

  /// @brief ncclAllGather of `bytes` per rank on `stream`.
  void all_gather_async(const void* send, void* recv, std::size_t bytes, cuda::stream_ref stream)
  {
    check(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream.get()), "ncclAllGather");
  }
  /// @brief ncclSend of `bytes` to `peer` on `stream`.
  void send_async(const void* data, std::size_t bytes, int peer, cuda::stream_ref stream)
  {
    check(ncclSend(data, bytes, ncclUint8, peer, comm_, stream.get()), "ncclSend");
  }
  /// @brief ncclRecv of `bytes` from `peer` on `stream`.
  void recv_async(void* data, std::size_t bytes, int peer, cuda::stream_ref stream)
  {
    check(ncclRecv(data, bytes, ncclUint8, peer, comm_, stream.get()), "ncclRecv");
  }

 private:
  static void check(ncclResult_t result, const char* what)
  {
    if (result != ncclSuccess) {
      throw error{errc::backend_error, std::string{what} + " failed: " + ncclGetErrorString(result)};
    }
  }

  ncclComm_t comm_;
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace routing_replay
