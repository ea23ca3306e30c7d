// Test helper: runs `fn(rank)` in `num_ranks` forked processes that share a FileKvStore directory (run_ranks), or in
// threads of this process that share a MemoryKvStore (run_rank_threads: for the fake NIC fabric, which lives in one
// address space), and returns the ranks' combined failure text ("" = all passed). Ranks report failures through
// CHILD_CHECK, never gtest: it exits a forked child and throws in a rank thread.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::test {

/// True in a rank run by run_rank_threads (CHILD_CHECK throws there instead of exiting the process).
inline thread_local bool g_rank_is_thread = false;

#define CHILD_CHECK(cond, ...)                                                                   \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      char child_msg_[1024];                                                                     \
      std::snprintf(child_msg_, sizeof child_msg_, __VA_ARGS__);                                 \
      std::fprintf(stderr, "[child] %s:%d check failed: %s: %s\n", __FILE__, __LINE__, #cond, child_msg_); \
      std::fflush(stderr);                                                                       \
      if (::uccl_moe::test::g_rank_is_thread) throw std::runtime_error(std::string(#cond) + ": " + child_msg_); \
      _exit(1);                                                                                  \
    }                                                                                            \
  } while (0)

inline std::string unique_job(const char* name) {
  static int n = 0;
  return std::string(name) + "." + std::to_string(getpid()) + "." + std::to_string(n++);
}

/// Forks the ranks; each child runs fn(rank, store, job) and exits 0 unless it throws or a CHILD_CHECK fails.
/// Returns a description of the failures, "" if none. Children are killed after `timeout_s`.
inline std::string run_ranks(int num_ranks, const std::function<void(int, std::shared_ptr<KvStore>, const std::string&)>& fn,
                             double timeout_s = 60) {
  char tmpl[] = "/tmp/uccl_moe_test_XXXXXX";
  if (!mkdtemp(tmpl)) return "mkdtemp failed";
  const std::string dir = tmpl, job = unique_job("t");
  std::vector<pid_t> pids;
  for (int r = 0; r < num_ranks; ++r) {
    std::fflush(nullptr);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(unsigned(timeout_s) + 1);
      try {
        fn(r, std::make_shared<FileKvStore>(dir), job);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[child rank %d] exception: %s\n", r, e.what());
        std::fflush(stderr);
        _exit(2);
      }
      std::fflush(nullptr);
      _exit(0);
    }
    pids.push_back(pid);
  }
  std::string failures;
  for (int r = 0; r < num_ranks; ++r) {
    int status = 0;
    waitpid(pids[size_t(r)], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      failures += "rank " + std::to_string(r) + (WIFSIGNALED(status) ? " killed by signal " + std::to_string(WTERMSIG(status))
                                                                    : " exited " + std::to_string(WEXITSTATUS(status))) + "; ";
  }
  std::system(("rm -rf " + dir).c_str());
  return failures;
}

/// The ranks as threads of this process sharing one MemoryKvStore; a rank fails by throwing (CHILD_CHECK included).
inline std::string run_rank_threads(int num_ranks,
                                    const std::function<void(int, std::shared_ptr<KvStore>, const std::string&)>& fn) {
  auto store = std::make_shared<MemoryKvStore>();
  const std::string job = unique_job("th");
  std::mutex mu;
  std::string failures;
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r)
    threads.emplace_back([&, r] {
      g_rank_is_thread = true;
      try {
        fn(r, store, job);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank thread %d] %s\n", r, e.what());
        std::lock_guard<std::mutex> l(mu);
        failures += "rank " + std::to_string(r) + ": " + e.what() + "; ";
      }
    });
  for (auto& t : threads) t.join();
  return failures;
}

}  // namespace uccl_moe::test
