#include "proxy/ordering.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>

#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {
namespace {

TEST(Immediate, HtRoundTrip) {
  for (uint32_t ch = 0; ch < 8; ++ch)
    for (uint32_t seq : {0u, 1u, 1000u, 2047u, 2048u + 5u})
      for (int value : {-128, -1, 0, 1, 127}) {
        const uint32_t imm = encode_imm_ht(true, ch, seq, 255, value);
        const Imm m = decode_imm(imm);
        EXPECT_EQ(m.kind, ImmKind::kHtCounter);
        EXPECT_EQ(m.channel, ch);
        EXPECT_EQ(m.seq, seq % kImmSeqSpace);
        EXPECT_EQ(m.slot, 255u);
        EXPECT_EQ(m.value, value);
      }
  const Imm w = decode_imm(encode_imm_ht(false, 3, 9, 200, 5));
  EXPECT_EQ(w.kind, ImmKind::kHtWrite);
  EXPECT_EQ(w.slot, 0u);
  EXPECT_EQ(w.value, 0);
}

TEST(Immediate, BarrierScopeRoundTrip) {
  for (BarrierScope scope : {BarrierScope::kAll, BarrierScope::kSameRail})
    for (uint32_t epoch : {0u, 1u, 12345u, kImmEpochMask, kImmEpochMask + 7u}) {
      const uint32_t imm = encode_imm_control(ImmControlOp::kBarrier, epoch, scope);
      const Imm m = decode_imm(imm);
      EXPECT_EQ(m.kind, ImmKind::kControl);
      EXPECT_EQ(m.control, ImmControlOp::kBarrier);
      EXPECT_EQ(m.scope, scope);
      EXPECT_EQ(m.epoch, epoch & kImmEpochMask);  // the epoch wraps without touching the scope bit
      EXPECT_EQ((imm >> 24) & 1u, uint32_t(scope)) << "bit 24 is the scope (layout in ordering.hpp)";
    }
}

TEST(Immediate, LLAndControlRoundTrip) {
  Imm m = decode_imm(encode_imm_ll(true, true, 255, kImmLLMaxExpected));
  EXPECT_EQ(m.kind, ImmKind::kLL);
  EXPECT_TRUE(m.fence);
  EXPECT_TRUE(m.phase);
  EXPECT_EQ(m.slot, 255u);
  EXPECT_EQ(m.expected, kImmLLMaxExpected);
  m = decode_imm(encode_imm_ll(false, false, 17, 0));
  EXPECT_FALSE(m.fence);
  EXPECT_FALSE(m.phase);
  EXPECT_EQ(m.slot, 17u);
  m = decode_imm(encode_imm_control(ImmControlOp::kBarrier, kImmEpochMask));
  EXPECT_EQ(m.kind, ImmKind::kControl);
  EXPECT_EQ(m.control, ImmControlOp::kBarrier);
  EXPECT_EQ(m.epoch, kImmEpochMask);
  EXPECT_THROW(encode_imm_ht(true, 8, 0, 0, 0), Error);
  EXPECT_THROW(encode_imm_ht(true, 0, 0, 0, 128), Error);
  EXPECT_THROW(encode_imm_ll(true, false, 0, kImmLLMaxExpected + 1), Error);
}

/// One HT channel as a test oracle sees it: absolute sequence numbers, landed set, expected counter adds.
struct HtOracle {
  std::vector<bool> landed;             // by absolute seq
  uint64_t first_missing = 0;           // lowest seq not landed
  std::deque<std::pair<uint64_t, int>> counters;  // (abs seq, value) in seq order, not yet applied
  uint64_t violations = 0, applied = 0;
};

// >= 10^6 random schedules on persistent channels (sequence numbers wrap every 2048 writes): each schedule sends a
// random batch of writes (some carrying counter adds) over 3 channels and delivers them in a random order. Every
// applied add must find all earlier writes of its channel landed, adds apply in sequence order, and none is lost.
TEST(OrderingProperty, HtMillionRandomSchedulesZeroViolations) {
  constexpr int kChannels = 3;
  constexpr int kSchedules = 1000000;
  std::mt19937_64 rng(12345);
  OrderingEngine engine(/*num_ranks=*/2, kChannels);
  HtOracle oracle[kChannels];
  uint64_t next_seq[kChannels] = {0, 0, 0};
  struct Msg {
    int ch;
    uint64_t seq;
    bool counter;
    int value;
  };
  std::vector<Msg> batch;
  int current_ch = -1;
  CounterApplyFn apply = [&](int src, uint32_t slot, int64_t value) {
    EXPECT_EQ(src, 1);
    HtOracle& o = oracle[slot];
    if (o.counters.empty()) {
      ++o.violations;
      return;
    }
    auto [seq, want] = o.counters.front();
    o.counters.pop_front();
    if (value != want) ++o.violations;
    while (o.first_missing < o.landed.size() && o.landed[o.first_missing]) ++o.first_missing;
    if (o.first_missing <= seq) ++o.violations;  // an earlier (or this) write has not landed
    ++o.applied;
    (void)current_ch;
  };
  uint64_t reorders = 0, total = 0;
  for (int sched = 0; sched < kSchedules; ++sched) {
    batch.clear();
    const int n = 1 + int(rng() % 8);
    for (int i = 0; i < n; ++i) {
      Msg m;
      m.ch = int(rng() % kChannels);
      m.seq = next_seq[m.ch]++;
      m.counter = (rng() % 3) == 0;
      m.value = int(rng() % 256) - 128;
      oracle[m.ch].landed.push_back(false);
      if (m.counter) oracle[m.ch].counters.emplace_back(m.seq, m.value);
      batch.push_back(m);
    }
    std::shuffle(batch.begin(), batch.end(), rng);
    for (const Msg& m : batch) {
      oracle[m.ch].landed[m.seq] = true;
      bool reordered = false;
      // slot = channel so the oracle knows which channel an add belongs to.
      engine.on_imm(1, encode_imm_ht(m.counter, uint32_t(m.ch), uint32_t(m.seq), uint32_t(m.ch), m.value), apply,
                    &reordered);
      reorders += reordered;
      ++total;
    }
  }
  uint64_t violations = 0, applied = 0, pending = 0;
  for (auto& o : oracle) {
    violations += o.violations;
    applied += o.applied;
    pending += o.counters.size();
  }
  EXPECT_EQ(violations, 0u);
  EXPECT_EQ(pending, 0u) << "every add must be applied once all writes landed";
  EXPECT_EQ(engine.num_held(), 0u);
  EXPECT_GT(reorders, total / 10) << "the schedules must actually reorder";
  EXPECT_GT(next_seq[0], 4u * kImmSeqSpace) << "sequence numbers must wrap several times";
  (void)applied;
}

// Sliding-window stress at the limit of the wrap argument: the sender keeps up to W writes in flight (window over
// the oldest undelivered) and the receiver may lag; deliveries are random within the window. 2*10^6 writes.
TEST(OrderingProperty, HtWindowLimitStress) {
  constexpr uint64_t kWindow = 1000;  // < 2^11: the largest lead an arrival can have over base
  constexpr uint64_t kTotal = 2000000;
  std::mt19937_64 rng(99);
  HtChannelOrder ch;
  std::vector<char> landed(kTotal, 0);
  std::vector<uint64_t> inflight;  // seqs sent, not delivered
  uint64_t sent = 0, oldest = 0, applied = 0, violations = 0, expect_next_counter = 0;
  CounterApplyFn apply = [&](int, uint32_t, int64_t value) {
    // value encodes (seq % 100); counters are on every 7th write.
    const uint64_t seq = expect_next_counter;
    expect_next_counter += 7;
    if (int64_t(seq % 100) != value) ++violations;
    for (uint64_t s = (seq > kWindow ? seq - kWindow : 0); s <= seq; ++s) violations += landed[s] ? 0 : 1;
    ++applied;
  };
  while (sent < kTotal || !inflight.empty()) {
    while (oldest < sent && landed[oldest]) ++oldest;
    if (sent < kTotal && sent - oldest < kWindow && (inflight.empty() || rng() % 2)) {
      inflight.push_back(sent++);
      continue;
    }
    const size_t i = rng() % inflight.size();
    const uint64_t s = inflight[i];
    inflight[i] = inflight.back();
    inflight.pop_back();
    landed[s] = 1;
    const bool counter = s % 7 == 0;
    ch.on_arrival(uint32_t(s), counter, 0, counter ? int32_t(s % 100) : 0, 0, apply);
  }
  EXPECT_EQ(violations, 0u);
  EXPECT_EQ(applied, (kTotal + 6) / 7);
  EXPECT_EQ(ch.base(), kTotal);
  EXPECT_EQ(ch.num_held(), 0u);
}

// LL partial fence: per group, E writes and one fence (expected = E) arrive in a random order; the fence applies
// -(E)-1 exactly when the E-th write of the round landed, never earlier. Groups are reused round after round.
TEST(OrderingProperty, LLMillionRandomSchedulesZeroViolations) {
  constexpr int kSchedules = 1000000;
  constexpr int kGroups = 4;
  std::mt19937_64 rng(4242);
  OrderingEngine engine(/*num_ranks=*/1, 1);
  int landed_this_round[kGroups * 2] = {0};
  int expected_this_round[kGroups * 2] = {0};
  uint64_t violations = 0, applied = 0;
  CounterApplyFn apply = [&](int, uint32_t slot, int64_t value) {
    // The apply callback does not know the phase; check both candidates of the slot.
    bool ok = false;
    for (int ph = 0; ph < 2; ++ph) {
      const int g = int(slot) * 2 + ph;
      if (expected_this_round[g] >= 0 && value == -int64_t(expected_this_round[g]) - 1 &&
          landed_this_round[g] == expected_this_round[g]) {
        ok = true;
        expected_this_round[g] = -1;  // consumed
        break;
      }
    }
    violations += ok ? 0 : 1;
    ++applied;
  };
  struct Msg {
    int group;
    bool fence;
    int expected;
  };
  std::vector<Msg> msgs;
  uint64_t fences = 0;
  for (int sched = 0; sched < kSchedules; ++sched) {
    msgs.clear();
    const int used = 1 + int(rng() % 3);
    for (int k = 0; k < used; ++k) {
      const int g = int(rng() % (kGroups * 2));
      bool dup = false;
      for (const Msg& m : msgs) dup |= m.group == g;
      if (dup) continue;
      const int e = int(rng() % 5);  // 0 writes is legal: the fence applies at once
      landed_this_round[g] = 0;
      expected_this_round[g] = e;
      for (int i = 0; i < e; ++i) msgs.push_back({g, false, 0});
      msgs.push_back({g, true, e});
      ++fences;
    }
    std::shuffle(msgs.begin(), msgs.end(), rng);
    for (const Msg& m : msgs) {
      const uint32_t slot = uint32_t(m.group / 2);
      const bool phase = m.group % 2;
      if (!m.fence) ++landed_this_round[m.group];
      bool reordered;
      engine.on_imm(0, encode_imm_ll(m.fence, phase, slot, uint32_t(m.expected)), apply, &reordered);
    }
  }
  EXPECT_EQ(violations, 0u);
  EXPECT_EQ(applied, fences);
  EXPECT_EQ(engine.num_held(), 0u);
}

TEST(Ordering, HeldUpdateIsDescribedAndSecondLLFenceRejected) {
  OrderingEngine engine(2, 2);
  std::vector<int64_t> applied;
  CounterApplyFn apply = [&](int, uint32_t, int64_t v) { applied.push_back(v); };
  bool reordered;
  // seq 1 (with counter) arrives before seq 0: held.
  engine.on_imm(1, encode_imm_ht(true, 1, 1, 3, 5), apply, &reordered);
  EXPECT_TRUE(reordered);
  EXPECT_TRUE(applied.empty());
  EXPECT_EQ(engine.num_held(), 1u);
  int src, channel;
  uint64_t want, held;
  ASSERT_TRUE(engine.describe_held(&src, &channel, &want, &held));
  EXPECT_EQ(src, 1);
  EXPECT_EQ(channel, 1);
  EXPECT_EQ(want, 0u);
  EXPECT_EQ(held, 1u);
  engine.on_imm(1, encode_imm_ht(false, 1, 0, 0, 0), apply, &reordered);
  ASSERT_EQ(applied.size(), 1u);
  EXPECT_EQ(applied[0], 5);
  EXPECT_EQ(engine.num_held(), 0u);
  // LL: a second fence for the same group while the first is held is a protocol error.
  engine.on_imm(0, encode_imm_ll(true, false, 9, 2), apply, &reordered);
  EXPECT_THROW(engine.on_imm(0, encode_imm_ll(true, false, 9, 2), apply, &reordered), Error);
}

}  // namespace
}  // namespace uccl_moe::detail
