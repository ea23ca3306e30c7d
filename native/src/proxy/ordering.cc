#include "ordering.hpp"

#include <algorithm>

#include "uccl_moe/error.hpp"
#include "uccl_moe/transfer_cmd.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kSeqMask = kImmSeqSpace - 1;
}

uint32_t encode_imm_ht(bool has_counter, uint32_t channel, uint32_t seq, uint32_t slot, int32_t value) {
  UCCL_CHECK_INTERNAL(channel < uint32_t(kImmMaxChannels) && slot < uint32_t(kCountersPerSrc) && value >= -128 &&
                          value <= 127,
                      "HT immediate fields out of range: channel=%u slot=%u value=%d", channel, slot, value);
  return (uint32_t(has_counter ? ImmKind::kHtCounter : ImmKind::kHtWrite) << 30) | (channel << 27) |
         ((seq & kSeqMask) << 16) | ((has_counter ? slot : 0u) << 8) | (has_counter ? uint32_t(uint8_t(int8_t(value))) : 0u);
}

uint32_t encode_imm_ll(bool fence, bool phase, uint32_t slot, uint32_t expected) {
  UCCL_CHECK_INTERNAL(slot < uint32_t(kCountersPerSrc) && expected <= kImmLLMaxExpected,
                      "LL immediate fields out of range: slot=%u expected=%u", slot, expected);
  return (uint32_t(ImmKind::kLL) << 30) | (uint32_t(fence) << 29) | (uint32_t(phase) << 28) | (slot << 20) |
         (fence ? expected : 0u);
}

uint32_t encode_imm_control(ImmControlOp op, uint32_t epoch, BarrierScope scope) {
  return (uint32_t(ImmKind::kControl) << 30) | ((uint32_t(op) & 0xFu) << 26) | ((uint32_t(scope) & 1u) << 24) |
         (epoch & kImmEpochMask);
}

Imm decode_imm(uint32_t v) {
  Imm m;
  m.kind = ImmKind(v >> 30);
  switch (m.kind) {
    case ImmKind::kHtWrite:
    case ImmKind::kHtCounter:
      m.channel = (v >> 27) & 0x7u;
      m.seq = (v >> 16) & kSeqMask;
      m.slot = (v >> 8) & 0xFFu;
      m.value = int8_t(uint8_t(v & 0xFFu));
      break;
    case ImmKind::kLL:
      m.fence = (v >> 29) & 1u;
      m.phase = (v >> 28) & 1u;
      m.slot = (v >> 20) & 0xFFu;
      m.expected = v & kImmLLMaxExpected;
      break;
    case ImmKind::kControl:
      m.control = ImmControlOp((v >> 26) & 0xFu);
      m.scope = BarrierScope((v >> 24) & 1u);
      m.epoch = v & kImmEpochMask;
      break;
  }
  return m;
}

bool HtChannelOrder::on_arrival(uint32_t seq, bool has_counter, uint32_t slot, int32_t value, int src_rank,
                                const CounterApplyFn& apply) {
  // Resolve the 11-bit seq against base_ (exact under the window argument in ordering.hpp).
  const uint64_t abs = base_ + ((seq - uint32_t(base_)) & kSeqMask);
  const bool reordered = abs != base_;
  if (landed_.test(abs & kSeqMask))
    UCCL_THROW(kTransport,
               "ordering: duplicate or out-of-window write from rank %d (seq %u, expected seq %llu..%llu): the "
               "sequence window (2*UCCL_MOE_MAX_INFLIGHT_WRITES + receive depth <= %u) was exceeded",
               src_rank, seq, (unsigned long long)base_, (unsigned long long)(base_ + kSeqMask), kImmSeqSpace);
  landed_.set(abs & kSeqMask);
  if (has_counter) {
    Held h{abs, slot, value};
    auto it = held_.end();
    while (it != held_.begin() && std::prev(it)->seq > abs) --it;  // usually appends
    held_.insert(it, h);
  }
  while (landed_.test(base_ & kSeqMask)) {
    landed_.reset(base_ & kSeqMask);
    ++base_;
  }
  // Every write with seq < base_ landed: release the adds up to there, in sequence order.
  size_t n = 0;
  while (n < held_.size() && held_[n].seq < base_) {
    apply(src_rank, held_[n].slot, held_[n].value);
    ++n;
  }
  if (n) held_.erase(held_.begin(), held_.begin() + long(n));
  return reordered;
}

bool LlGroupOrder::try_release(int src_rank, uint32_t slot, const CounterApplyFn& apply) {
  if (fence_expected_ < 0 || landed_ < fence_expected_) return false;
  apply(src_rank, slot, -fence_expected_ - 1);
  landed_ -= fence_expected_;
  fence_expected_ = -1;
  return true;
}

bool LlGroupOrder::on_write(int src_rank, uint32_t slot, const CounterApplyFn& apply) {
  ++landed_;
  return try_release(src_rank, slot, apply);
}

bool LlGroupOrder::on_fence(uint32_t expected, int src_rank, uint32_t slot, const CounterApplyFn& apply) {
  if (fence_expected_ >= 0)
    UCCL_THROW(kTransport,
               "ordering: LL fence for group %u from rank %d arrived while the previous fence (expected %lld, %lld "
               "landed) is still held; a group (slot, phase) must not be reused before its fence is consumed",
               slot, src_rank, (long long)fence_expected_, (long long)landed_);
  fence_expected_ = expected;
  return !try_release(src_rank, slot, apply);
}

OrderingEngine::OrderingEngine(int num_ranks, int num_channels)
    : num_ranks_(num_ranks),
      num_channels_(num_channels),
      ht_(size_t(num_ranks) * num_channels),
      ll_(size_t(num_ranks) * kCountersPerSrc * 2) {
  UCCL_ASSERT(num_channels >= 1 && num_channels <= kImmMaxChannels, "num_channels=%d must be in [1, %d]",
              num_channels, kImmMaxChannels);
}

bool OrderingEngine::on_imm(int src_rank, uint32_t imm, const CounterApplyFn& apply, bool* reordered) {
  UCCL_CHECK_INTERNAL(src_rank >= 0 && src_rank < num_ranks_, "immediate from rank %d of %d", src_rank, num_ranks_);
  const Imm m = decode_imm(imm);
  *reordered = false;
  switch (m.kind) {
    case ImmKind::kHtWrite:
    case ImmKind::kHtCounter: {
      if (int(m.channel) >= num_channels_)
        UCCL_THROW(kTransport, "ordering: immediate 0x%08x from rank %d names channel %u of %d", imm, src_rank,
                   m.channel, num_channels_);
      HtChannelOrder& ch = ht_[size_t(src_rank) * num_channels_ + m.channel];
      const size_t before = ch.num_held();
      *reordered = ch.on_arrival(m.seq, m.kind == ImmKind::kHtCounter, m.slot, m.value, src_rank, apply);
      held_ = held_ + ch.num_held() - before;
      return true;
    }
    case ImmKind::kLL: {
      LlGroupOrder& g = ll_[(size_t(src_rank) * kCountersPerSrc + m.slot) * 2 + (m.phase ? 1 : 0)];
      const bool before = g.holding();
      if (m.fence)
        g.on_fence(m.expected, src_rank, m.slot, apply);
      else
        g.on_write(src_rank, m.slot, apply);
      held_ = held_ + size_t(g.holding()) - size_t(before);
      return true;
    }
    case ImmKind::kControl: return false;
  }
  return false;
}


bool OrderingEngine::describe_held(int* src_rank, int* channel, uint64_t* waiting_for_seq, uint64_t* held_seq) const {
  for (size_t i = 0; i < ht_.size(); ++i)
    if (ht_[i].num_held()) {
      *src_rank = int(i / num_channels_);
      *channel = int(i % num_channels_);
      *waiting_for_seq = ht_[i].base();
      *held_seq = ht_[i].oldest_held_seq();
      return true;
    }
  for (size_t i = 0; i < ll_.size(); ++i)
    if (ll_[i].holding()) {
      *src_rank = int(i / 2 / kCountersPerSrc);
      *channel = -1 - int((i / 2) % kCountersPerSrc);  // LL: -1 - group slot
      *waiting_for_seq = uint64_t(ll_[i].fence_expected());
      *held_seq = uint64_t(ll_[i].landed());
      return true;
    }
  return false;
}

}  // namespace uccl_moe::detail
