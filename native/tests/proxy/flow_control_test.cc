#include "proxy/flow_control.hpp"

#include <gtest/gtest.h>

#include <deque>
#include <random>

#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

// Random post/complete simulation: the limits are never exceeded (bytes: unless a single command is larger than
// the limit and nothing else is in flight).
TEST(FlowControl, RandomSimulationNeverExceedsLimits) {
  constexpr int kFifos = 4;
  constexpr int64_t kMaxBytes = 10000, kMaxWrites = 8;
  FlowControl fc(kFifos, kMaxBytes, kMaxWrites);
  std::mt19937_64 rng(1);
  struct Cmd {
    uint64_t idx, bytes;
    bool done;
  };
  std::deque<Cmd> q[kFifos];
  uint64_t next[kFifos] = {0}, stalls = 0, posts = 0;
  for (int step = 0; step < 200000; ++step) {
    const int f = int(rng() % kFifos);
    if (rng() % 2) {
      const uint64_t bytes = rng() % 4000;
      const uint64_t oldest = q[f].empty() ? next[f] : q[f].front().idx;
      if (fc.admit(f, next[f], oldest, bytes)) {
        fc.on_post(f, bytes);
        q[f].push_back({next[f]++, bytes, false});
        ++posts;
        ASSERT_LE(fc.inflight_bytes(), kMaxBytes);
        ASSERT_LT(q[f].back().idx - q[f].front().idx, uint64_t(kMaxWrites));
      } else {
        ++stalls;
      }
    } else if (!q[f].empty()) {
      // Complete a random in-flight command (out of order), retire from the front.
      auto& c = q[f][rng() % q[f].size()];
      if (!c.done) {
        c.done = true;
        fc.on_complete(f, c.bytes);
      }
      while (!q[f].empty() && q[f].front().done) q[f].pop_front();
    }
  }
  EXPECT_GT(stalls, 1000u);
  EXPECT_GT(posts, 10000u);
  EXPECT_LE(fc.peak_bytes(), kMaxBytes);
}

TEST(FlowControl, WindowIsSlidingNotACount) {
  FlowControl fc(1, 0, 4);
  // Commands 0..3 posted; 1..3 completed but 0 not: command 4 must still wait (window over the oldest).
  EXPECT_TRUE(fc.admit(0, 3, 0, 0));
  EXPECT_FALSE(fc.admit(0, 4, 0, 0));
  EXPECT_TRUE(fc.admit(0, 4, 1, 0));
}

TEST(FlowControl, OversizedCommandAdmittedWhenIdle) {
  FlowControl fc(1, 100, 4);
  EXPECT_TRUE(fc.admit(0, 0, 0, 1000));
  fc.on_post(0, 1000);
  EXPECT_FALSE(fc.admit(0, 1, 0, 1));
  fc.on_complete(0, 1000);
  EXPECT_TRUE(fc.admit(0, 1, 1, 50));
}

TEST(FlowControl, RejectsBadLimits) {
  EXPECT_THROW(FlowControl(1, -1, 4), Error);
  EXPECT_THROW(FlowControl(1, 0, 0), Error);
}

}  // namespace
}  // namespace uccl_moe
