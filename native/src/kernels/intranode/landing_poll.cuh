// Polled landing areas (UCCL_MOE_CE_POLL): the copy-engine combine's sum (combine_sum.cuh) and the copy-engine
// dispatch's gather (dispatch_ce.cu) read a peer's rows from their landing area as each 16-byte word lands, rather
// than waiting for the chunk that holds it. The runtime sets every 32-bit word of the area to all ones before the
// peers' copies can reach it (NvlRuntime::begin_op), and each peer's engine and SMs write each word once per op.
// Include only from .cu files.
#pragma once

#include "intranode_device.cuh"

namespace uccl_moe::intranode {

/// A 16-B word of a polled landing area still holds the sentinel (all ones in one of its 32-bit words: a NaN in
/// float32, BF16 and FP8, which no row the op should move holds except as data) until its peer's copy lands there:
/// a word without it is final.
UCCL_DEVICE_INLINE bool landing_pending(const int4& w) {
  return w.x == -1 || w.y == -1 || w.z == -1 || w.w == -1;
}

/// Polls between two looks at the peer's flags (`peek`) while a word still reads as the sentinel, and polls after
/// which a lane waits for the flags instead (`settle`: a bounded wait that names the peer if they never come).
constexpr int kPollsPerPeek = 32;
constexpr int kPollsBeforeSettle = 1 << 16;

/// Whether peer d's whole copy of this op landed in our polled landing area: its engine's flag for its last chunk
/// (ce_ready, written after the copy) and its head word (ce_head, released after its SMs stored the head) both
/// reached the op's round. `peek` reads them relaxed, without waiting (the caller fences before it trusts a later
/// load); `settle` waits for them (bounded: false where a wait expired or the launch was aborted, the diagnostic
/// record naming peer d and `phase`).
struct CeLandedFlags {
  void* local;   // our buffer (its meta holds the words the peers write)
  int32_t round;
  int chunks;    // the op's chunks per peer (1 where polled)
  DiagPhase phase;
  const NvlContext* ctx;

  UCCL_DEVICE_INLINE bool peek(int d) const {
    return ring_diff(gpu::load_volatile(meta_ptr<const int32_t>(local, kOffCeReady) + d * kMaxCeChunks + chunks - 1),
                     round) >= 0 &&
           ring_diff(gpu::load_volatile(meta_ptr<const int32_t>(local, kOffCeHead) + d), round) >= 0;
  }
  UCCL_DEVICE_INLINE bool settle(int d) const {
    return wait_reached(diag_of(*ctx), meta_ptr<const int32_t>(local, kOffCeReady) + d * kMaxCeChunks + chunks - 1,
                        round, phase, DiagRole::kReceiver, d, chunks - 1) &&
           wait_reached(diag_of(*ctx), meta_ptr<const int32_t>(local, kOffCeHead) + d, round, phase,
                        DiagRole::kReceiver, d, -1);
  }
};

/// Makes `v`, a word loaded from `at` in peer d's part of a polled landing area, final (one lane; the lanes poll
/// their own words): while it still reads as the sentinel it is loaded again. Once d's whole copy landed
/// (`flags.peek(d)`, looked at every kPollsPerPeek polls, then a fence) a word still at the sentinel is the data's
/// own: it is loaded once more and taken, and bit d of `settled` (per lane) then takes any later word of d still at
/// the sentinel after one more load (words loaded before the fence may be stale, so never taken as they are). After
/// kPollsBeforeSettle polls the lane waits for the flags instead (`flags.settle(d)`). Returns false where that wait
/// gave up (an expiry or an abort).
template <class Flags>
UCCL_DEVICE_INLINE bool take_landed_word(int4& v, const int4* at, int d, uint32_t& settled, const Flags& flags) {
  for (int polls = 0; landing_pending(v); ++polls) {
    bool was_settled = ((settled >> d) & 1) != 0;
    if (!was_settled && polls % kPollsPerPeek == kPollsPerPeek - 1 && flags.peek(d)) {
      gpu::fence_sys();  // the flags' values were read relaxed: the reload below comes after them
      settled |= 1u << d;
      was_settled = true;
    }
    if (!was_settled && polls >= kPollsBeforeSettle) {
      if (!flags.settle(d)) return false;
      settled |= 1u << d;
      was_settled = true;
    }
    v = gpu::load_ring_128(at);
    if (was_settled) return true;
  }
  return true;
}

/// take_landed_word over one round of a warp copy (load_round's words [base, base + kUnroll * warp) below `end`).
template <int kUnroll, class Flags>
UCCL_DEVICE_INLINE bool take_landed_round(int4 (&v)[kUnroll], const int4* src, int base, int end, int d,
                                          uint32_t& settled, const Flags& flags) {
  bool ok = true;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int i = base + u * gpu::kWarpSize + gpu::lane_id();
    if (i < end && ok) ok = take_landed_word(v[u], src + i, d, settled, flags);
  }
  return ok;
}

/// warp_copy_row_pipelined (double-buffered rounds) of a row of peer d that lands in a polled landing area during
/// the copy: each round's words are taken as they land (take_landed_round) before they are stored. Warp-collective;
/// returns false (uniform) where a lane's wait for d's flags gave up.
template <int kUnroll, class Flags>
UCCL_DEVICE_INLINE bool warp_copy_row_polled(int4* __restrict__ dst, const int4* __restrict__ src, int num_16, int d,
                                             uint32_t& settled, const Flags& flags) {
  constexpr int kRound = kUnroll * gpu::kWarpSize;
  int4 a[kUnroll], b[kUnroll];  // two named buffers, so both stay in registers
  bool ok = true;
  load_round<kUnroll, true>(a, src, 0, num_16);
  for (int base = 0; base < num_16 && ok; base += 2 * kRound) {
    if (base + kRound < num_16) load_round<kUnroll, true>(b, src, base + kRound, num_16);
    ok = take_landed_round<kUnroll>(a, src, base, num_16, d, settled, flags);
    store_round<kUnroll>(dst, a, base, num_16);
    if (base + kRound >= num_16 || !ok) break;
    if (base + 2 * kRound < num_16) load_round<kUnroll, true>(a, src, base + 2 * kRound, num_16);
    ok = take_landed_round<kUnroll>(b, src, base + kRound, num_16, d, settled, flags);
    store_round<kUnroll>(dst, b, base + kRound, num_16);
  }
  return gpu::ballot(!ok) == 0;
}

}  // namespace uccl_moe::intranode
