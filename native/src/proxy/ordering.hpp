// Ordering engine: restores, at the receiving proxy, the order the kernels need on transports that reorder (EFA SRD,
// the loopback transport with fault injection). Also the single declaration of the 32-bit immediate (STYLE R3).
//
// Immediate layout (bit 31 = MSB), carried by every write-with-immediate a proxy posts:
//
//   [31:30] kind     0 = HT_WRITE    ordered write, no counter
//                    1 = HT_COUNTER  ordered write (possibly zero bytes) carrying a counter add
//                    2 = LL          LL group write or LL partial fence
//                    3 = CONTROL     proxy-to-proxy control message (barrier)
//   HT_WRITE / HT_COUNTER:
//     [29:27] channel  FIFO index within the proxy thread (< 8)
//     [26:16] seq      per (source, destination, thread, channel) sequence number, modulo 2^11
//     [15: 8] slot     counter slot (HT_COUNTER; 0 otherwise)
//     [ 7: 0] value    int8 counter add (HT_COUNTER; 0 otherwise)
//   LL:
//     [29]    fence    1 = partial fence, 0 = group write
//     [28]    phase    LL double-buffer phase
//     [27:20] slot     group = counter slot
//     [19: 0] expected fence: number of group writes to wait for (< 2^20); 0 for writes
//   CONTROL:
//     [29:26] op       1 = BARRIER
//     [25]    reserved
//     [24]    scope    BarrierScope: 0 = all peers, 1 = same-rail peers (separate epoch counters)
//     [23: 0] epoch    barrier epoch of the sending proxy thread for that scope, modulo 2^24
//
// Sequence-number wrap argument. The receiver resolves an 11-bit seq s to the absolute sequence number
// base + ((s - base) mod 2^11), where base is the oldest write of that channel that has not landed. This is exact as
// long as every arriving write is less than 2^11 ahead of base. The sender posts command i of a FIFO only while
// i - oldest_incomplete(FIFO) < W (UCCL_MOE_MAX_INFLIGHT_WRITES, a sliding window, see flow_control.hpp), and a
// receiver holds at most Q unprocessed arrivals (its receive queue / RQ / CQ depth), so an arrival is at most 2W + Q
// ahead of base; the proxy checks 2W + Q <= 2^11 at start.
#pragma once

#include <bitset>
#include <cstdint>
#include <functional>
#include <vector>

namespace uccl_moe::detail {

enum class ImmKind : uint32_t { kHtWrite = 0, kHtCounter = 1, kLL = 2, kControl = 3 };
enum class ImmControlOp : uint32_t { kBarrier = 1 };
/// Which peers a BARRIER meets; each scope counts its own epochs.
enum class BarrierScope : uint32_t { kAll = 0, kSameRail = 1 };
constexpr int kNumBarrierScopes = 2;

constexpr int kImmBitsChannel = 3;
constexpr int kImmBitsSeq = 11;
constexpr uint32_t kImmSeqSpace = 1u << kImmBitsSeq;
constexpr int kImmMaxChannels = 1 << kImmBitsChannel;
constexpr int kImmLLBitsExpected = 20;
constexpr uint32_t kImmLLMaxExpected = (1u << kImmLLBitsExpected) - 1;
constexpr int kImmBitsEpoch = 24;
constexpr uint32_t kImmEpochMask = (1u << kImmBitsEpoch) - 1;

/// Decoded immediate.
struct Imm {
  ImmKind kind = ImmKind::kHtWrite;
  uint32_t channel = 0;  ///< HT
  uint32_t seq = 0;      ///< HT, modulo kImmSeqSpace
  uint32_t slot = 0;     ///< HT_COUNTER, LL
  int32_t value = 0;     ///< HT_COUNTER (int8 range)
  bool fence = false;    ///< LL
  bool phase = false;    ///< LL
  uint32_t expected = 0; ///< LL fence
  ImmControlOp control = ImmControlOp::kBarrier;  ///< CONTROL
  BarrierScope scope = BarrierScope::kAll;        ///< CONTROL (BARRIER)
  uint32_t epoch = 0;    ///< CONTROL
};

uint32_t encode_imm_ht(bool has_counter, uint32_t channel, uint32_t seq, uint32_t slot, int32_t value);
uint32_t encode_imm_ll(bool fence, bool phase, uint32_t slot, uint32_t expected);
uint32_t encode_imm_control(ImmControlOp op, uint32_t epoch, BarrierScope scope = BarrierScope::kAll);
Imm decode_imm(uint32_t imm);

/// Applies a counter add at the receiver: (source rank, slot, value).
using CounterApplyFn = std::function<void(int src_rank, uint32_t slot, int64_t value)>;

/// Receiver-side HT ordering state of one (source rank, proxy thread, channel).
class HtChannelOrder {
 public:
  /// A write with sequence `seq` (mod 2^11) landed; when it carries a counter, the add is held until every write of
  /// the channel with a smaller sequence number landed. Applies every add that became ready, in sequence order.
  /// Returns true if the write arrived out of order (a write with a smaller seq is still missing).
  bool on_arrival(uint32_t seq, bool has_counter, uint32_t slot, int32_t value, int src_rank,
                  const CounterApplyFn& apply);
  uint64_t base() const { return base_; }              ///< absolute seq of the oldest write not landed
  size_t num_held() const { return held_.size(); }     ///< counter adds waiting for earlier writes
  uint64_t oldest_held_seq() const { return held_.empty() ? 0 : held_.front().seq; }

 private:
  struct Held {
    uint64_t seq;
    uint32_t slot;
    int32_t value;
  };
  uint64_t base_ = 0;
  std::bitset<kImmSeqSpace> landed_;  ///< landed_[s mod 2^11] for base_ < s < base_ + 2^11
  std::vector<Held> held_;            ///< sorted by seq
};

/// Receiver-side LL partial-fence state of one (source rank, group slot, phase).
class LlGroupOrder {
 public:
  /// A group write landed. Returns true if it released a held fence.
  bool on_write(int src_rank, uint32_t slot, const CounterApplyFn& apply);
  /// The fence for `expected` writes arrived; applies -(expected)-1 once that many writes landed.
  /// Returns true if the fence had to be held (writes still missing).
  bool on_fence(uint32_t expected, int src_rank, uint32_t slot, const CounterApplyFn& apply);
  int64_t landed() const { return landed_; }
  bool holding() const { return fence_expected_ >= 0; }
  int64_t fence_expected() const { return fence_expected_; }

 private:
  bool try_release(int src_rank, uint32_t slot, const CounterApplyFn& apply);
  int64_t landed_ = 0;
  int64_t fence_expected_ = -1;
};

/// All receiver ordering state of one proxy thread: [source rank][channel] and [source rank][slot][phase].
class OrderingEngine {
 public:
  OrderingEngine(int num_ranks, int num_channels);
  /// Handles one immediate from `src_rank` except CONTROL ones (returned false; the caller handles them).
  /// `reordered` is set when an HT write arrived ahead of an earlier one.
  bool on_imm(int src_rank, uint32_t imm, const CounterApplyFn& apply, bool* reordered);
  size_t num_held() const { return held_; }  ///< HT adds + LL fences currently held
  /// Describes the oldest held update (for a timeout diagnostic); false if nothing is held.
  bool describe_held(int* src_rank, int* channel, uint64_t* waiting_for_seq, uint64_t* held_seq) const;

 private:
  int num_ranks_, num_channels_;
  std::vector<HtChannelOrder> ht_;  ///< [src * num_channels + channel]
  std::vector<LlGroupOrder> ll_;    ///< [(src * 256 + slot) * 2 + phase]
  size_t held_ = 0;
};

}  // namespace uccl_moe::detail
