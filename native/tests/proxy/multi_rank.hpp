// Test helper: runs `fn(rank)` in `num_ranks` forked processes that share a FileKvStore directory, and returns the
// children's combined failure text ("" = all passed). Children report failures through CHILD_CHECK, never gtest.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::test {

#define CHILD_CHECK(cond, ...)                                                  \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "[child] %s:%d check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                        \
      std::fprintf(stderr, "\n");                                               \
      std::fflush(stderr);                                                      \
      _exit(1);                                                                 \
    }                                                                           \
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

}  // namespace uccl_moe::test
