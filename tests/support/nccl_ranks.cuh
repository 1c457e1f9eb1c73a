/// @file
/// Several processes on one host, one GPU each, with a real NCCL communicator and no MPI: the
/// program started without rank arguments starts one copy of itself per rank (posix_spawn of
/// /proc/self/exe, so no CUDA state crosses a fork), waits for them with a time limit and reports
/// whether all passed. Rank 0 creates the ncclUniqueId and publishes it through a file (written,
/// then renamed, so the others never read half of it); every rank then joins the communicator.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace rr_test::ranks {

/// @brief What a rank process is told on its command line.
struct rank_args {
  int rank = -1;        ///< -1: this is the launcher
  int size = 0;         ///< ranks
  std::string id_file;  ///< where rank 0 publishes the ncclUniqueId
};

/// @brief Takes --rank R --size N --id-file PATH out of argv (the rest goes to doctest or the
/// benchmark).
inline rank_args take_rank_args(int& argc, char** argv)
{
  rank_args a;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 < argc && (arg == "--rank" || arg == "--size" || arg == "--id-file")) {
      const std::string value = argv[++i];
      if (arg == "--rank") { a.rank = std::stoi(value); }
      if (arg == "--size") { a.size = std::stoi(value); }
      if (arg == "--id-file") { a.id_file = value; }
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  return a;
}

/// @brief The environment variable `name` as seconds (`fallback` when unset or not a number).
inline long long env_seconds(const char* name, long long fallback)
{
  const char* v = std::getenv(name);
  char* end     = nullptr;
  const long long n = v != nullptr ? std::strtoll(v, &end, 10) : 0;
  return v != nullptr && end != v && n > 0 ? n : fallback;
}

/// @brief GPUs visible to this process (0 without a driver).
inline int gpu_count()
{
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

/// @brief Starts `size` ranks of this program (extra arguments passed on), their output to
/// `log_dir`/rank<R>.log when `log_dir` is set; returns 0 when every rank exits 0, 1 otherwise.
/// A rank still running `timeout_s` seconds after the start, or 60 s after another rank failed,
/// is killed (a failed rank leaves its peers waiting in NCCL).
inline int launch_ranks(int argc, char** argv, int size, const char* log_dir, int timeout_s)
{
  const std::string id_file = "/tmp/rr_nccl_id_" + std::to_string(::getpid());
  std::vector<char> exe(4096, '\0');
  if (::readlink("/proc/self/exe", exe.data(), exe.size() - 1) <= 0) {
    std::fprintf(stderr, "cannot read /proc/self/exe\n");
    return 1;
  }
  std::remove(id_file.c_str());
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> args{exe.data(), "--rank", std::to_string(r), "--size", std::to_string(size),
                                  "--id-file", id_file};
    for (int i = 1; i < argc; ++i) { args.emplace_back(argv[i]); }
    std::vector<char*> cargs;
    for (auto& a : args) { cargs.push_back(a.data()); }
    cargs.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    const std::string log = log_dir != nullptr ? std::string{log_dir} + "/rank" + std::to_string(r) + ".log" : "";
    if (!log.empty()) {
      posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&actions, 1, 2);
    }
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, exe.data(), &actions, nullptr, cargs.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      std::fprintf(stderr, "posix_spawn of rank %d failed: %s\n", r, std::strerror(rc));
      for (const pid_t p : pids) { ::kill(p, SIGKILL); }
      return 1;
    }
    pids.push_back(pid);
  }
  using clock   = std::chrono::steady_clock;
  auto deadline = clock::now() + std::chrono::seconds{timeout_s};
  int status    = 0;
  std::size_t running = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (running > 0) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      int ws = 0;
      if (done[r] || ::waitpid(pids[r], &ws, WNOHANG) != pids[r]) { continue; }
      done[r]       = true;
      --running;
      const bool ok = WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
      const std::string how = WIFEXITED(ws) ? "exit " + std::to_string(WEXITSTATUS(ws)) : "signal " + std::to_string(WTERMSIG(ws));
      std::printf("rank %zu: %s (%s)\n", r, ok ? "passed" : "failed", how.c_str());
      if (!ok) {
        status   = 1;
        deadline = std::min(deadline, clock::now() + std::chrono::seconds{60});
      }
    }
    if (running > 0 && clock::now() > deadline) {
      // the ranks' own watchdogs (deadline.hpp) should have ended them first, saying what they
      // waited for; this is the last resort
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) {
          std::printf("rank %zu: still running at the launcher's time limit: killed (its log says what it did last)\n", r);
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
        }
      }
      status = 1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  std::remove(id_file.c_str());
  return status;
}

/// @brief In a rank process: takes GPU `rank`, then joins the communicator (rank 0 publishes the
/// id; the others wait up to a minute for it).
inline ncclComm_t join_communicator(const rank_args& a)
{
  auto check = [](bool ok, const std::string& what) {
    if (!ok) { throw std::runtime_error{what}; }
  };
  check(cudaSetDevice(a.rank) == cudaSuccess, "cudaSetDevice(" + std::to_string(a.rank) + ")");
  ncclUniqueId id{};
  if (a.rank == 0) {
    check(ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId");
    const std::string tmp = a.id_file + ".tmp";
    std::ofstream{tmp, std::ios::binary}.write(reinterpret_cast<const char*>(&id), sizeof(id));
    check(std::rename(tmp.c_str(), a.id_file.c_str()) == 0, "publishing the NCCL id in " + a.id_file);
  } else {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds{60};
    for (;;) {
      std::ifstream in{a.id_file, std::ios::binary};
      if (in.read(reinterpret_cast<char*>(&id), sizeof(id))) { break; }
      check(std::chrono::steady_clock::now() < give_up, "no NCCL id in " + a.id_file + " after 60 s");
      std::this_thread::sleep_for(std::chrono::milliseconds{20});
    }
  }
  ncclComm_t comm = nullptr;
  const ncclResult_t rc = ncclCommInitRank(&comm, a.size, id, a.rank);
  check(rc == ncclSuccess, std::string{"ncclCommInitRank: "} + ncclGetErrorString(rc));
  return comm;
}

}  // namespace rr_test::ranks
