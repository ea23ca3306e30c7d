#include "proxy/flow_control.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <deque>
#include <random>

#include "uccl_moe/env.hpp"

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

// A command larger than the byte limit is posted in pieces of at most the limit, one at a time: the limit holds for
// every command (the old admit() let an oversized command in whole whenever the thread was idle).
TEST(FlowControl, OversizedCommandGoesInPiecesWithinTheLimit) {
  FlowControl fc(1, 100, 4);
  EXPECT_EQ(fc.piece_bytes(1000), 100u);
  EXPECT_EQ(fc.piece_bytes(40), 40u);
  uint64_t left = 1000;
  int pieces = 0;
  while (left > 0) {
    const uint64_t p = fc.piece_bytes(left);
    ASSERT_TRUE(fc.admit_piece(p));
    fc.on_post(0, p);
    ASSERT_LE(fc.inflight_bytes(), 100);
    EXPECT_FALSE(fc.admit_piece(fc.piece_bytes(left - p > 0 ? left - p : 1))) << "one full piece fills the limit";
    fc.on_complete(0, p);
    left -= p;
    ++pieces;
  }
  EXPECT_EQ(pieces, 10);
  EXPECT_EQ(fc.peak_bytes(), 100);
  fc.on_post(0, 60);
  EXPECT_FALSE(fc.admit(0, 1, 1, 1000)) << "the first piece (100) does not fit next to 60 in flight";
  EXPECT_TRUE(fc.admit(0, 1, 1, 40));
  FlowControl unlimited(1, 0, 4);
  EXPECT_EQ(unlimited.piece_bytes(1ull << 40), 1ull << 40);
}

TEST(FlowControl, NicFamilyDefaultsAndWhoWins) {
  const FlowLimits thor = nic_flow_defaults("bnxt_re", 4);
  EXPECT_EQ(thor.max_inflight_bytes, 1572864 / 4) << "1.5 MiB per GPU over 4 proxy threads";
  EXPECT_EQ(thor.max_inflight_writes, 1);
  const FlowLimits cx = nic_flow_defaults("mlx5", 4);
  EXPECT_EQ(cx.max_inflight_bytes, -1);
  EXPECT_EQ(cx.max_inflight_writes, 8);
  EXPECT_EQ(nic_flow_defaults("", 4).max_inflight_writes, -1);

  unsetenv("UCCL_MOE_MAX_INFLIGHT_BYTES");
  unsetenv("UCCL_MOE_MAX_INFLIGHT_WRITES");
  env::reset_cache();
  FlowLimits f = resolve_flow_limits(-1, -1, "bnxt_re", 2);
  EXPECT_EQ(f.max_inflight_bytes, 786432);
  EXPECT_EQ(f.max_inflight_writes, 1);
  EXPECT_EQ(f.bytes_source, "bnxt_re default");
  f = resolve_flow_limits(-1, -1, "", 2);  // loopback: the knob defaults
  EXPECT_EQ(f.max_inflight_bytes, 0);
  EXPECT_EQ(f.max_inflight_writes, 32);
  EXPECT_EQ(f.writes_source, "knob default");
  setenv("UCCL_MOE_MAX_INFLIGHT_WRITES", "3", 1);
  env::reset_cache();
  f = resolve_flow_limits(-1, -1, "bnxt_re", 2);
  EXPECT_EQ(f.max_inflight_writes, 3) << "the user's knob overrides the NIC default";
  EXPECT_EQ(f.writes_source, "UCCL_MOE_MAX_INFLIGHT_WRITES");
  EXPECT_EQ(f.max_inflight_bytes, 786432);
  f = resolve_flow_limits(5000, 2, "bnxt_re", 2);
  EXPECT_EQ(f.max_inflight_bytes, 5000) << "an explicit option wins";
  EXPECT_EQ(f.max_inflight_writes, 2);
  unsetenv("UCCL_MOE_MAX_INFLIGHT_WRITES");
  env::reset_cache();
}

}  // namespace
}  // namespace uccl_moe
