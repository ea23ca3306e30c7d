// Polled landing areas (UCCL_MOE_CE_POLL, UCCL_MOE_DISPATCH_CE_POLL): the copy-engine combine's sum (combine_sum.cuh)
// and the copy-engine dispatch's gather (dispatch_ce.cu) read a peer's rows from their landing area as each 16-byte
// word lands, rather than waiting for the chunk that holds it. The runtime sets every 32-bit word of the area to all
// ones before the peers' copies can reach it (NvlRuntime::begin_op), and each peer's engine and SMs write each word
// once per op. Include only from .cu files.
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

/// Makes `v`, a word loaded from `at` in peer d's part of a polled landing area, final (one lane; the lanes poll
/// their own words): while it still reads as the sentinel it is loaded again. Once d's whole copy landed (`peek(d)`:
/// d's engine flag for its last chunk, ce_ready, and its head word, ce_head, both reached the op's round, read
/// without waiting; looked at every kPollsPerPeek polls, then a fence) a word still at the sentinel is the data's
/// own: it is loaded once more and taken, and bit d of `settled` (per lane) then takes any later word of d still at
/// the sentinel after one more load (words loaded before the fence may be stale, so never taken as they are). After
/// kPollsBeforeSettle polls the lane waits for the same flags instead (`settle(d)`, bounded); where that wait gives
/// up (an expiry or an abort) `ok` turns false, and stays so (no later word is polled).
/// peek and settle are callables that compute their words' addresses from values the caller keeps anyway (a struct
/// holding them measured slower in the combine's sum). The combine's sum has its own copy of this loop
/// (sum_token_copies_polled, combine_sum.cuh: see there why); a change to one is a change to both.
template <class Peek, class Settle>
UCCL_DEVICE_INLINE void take_landed_word(int4& v, const int4* at, int d, uint32_t& settled, bool& ok, const Peek& peek,
                                         const Settle& settle) {
  for (int polls = 0; ok && landing_pending(v); ++polls) {
    // Settled (here or for an earlier word): a load after the flags' acquire is final. The loads before may
    // predate it, so a word still at the sentinel is loaded once more, not taken.
    bool was_settled = ((settled >> d) & 1) != 0;
    if (!was_settled && polls % kPollsPerPeek == kPollsPerPeek - 1 && peek(d)) {
      gpu::fence_sys();  // the flags' values were read relaxed: the reload below comes after them
      settled |= 1u << d;
      was_settled = true;
    }
    if (was_settled || polls >= kPollsBeforeSettle) {
      if (!was_settled) {
        ok = settle(d);
        if (ok) settled |= 1u << d;
      }
      v = gpu::load_ring_128(at);
      break;
    }
    v = gpu::load_ring_128(at);
  }
}

/// The peek and settle of take_landed_word for a copy-engine op's polled landing area in our buffer `local` (this
/// op's `round`, `chunks` per peer; a wait that gives up names the peer and `phase`).
UCCL_DEVICE_INLINE bool ce_landed_peek(void* local, int d, int32_t round, int chunks) {
  return ring_diff(gpu::load_volatile(ce_ready_words(local, d) + chunks - 1), round) >= 0 &&
         ring_diff(gpu::load_volatile(meta_ptr<const int32_t>(local, kOffCeHead) + d), round) >= 0;
}
UCCL_DEVICE_INLINE bool ce_landed_settle(const NvlContext& ctx, void* local, int d, int32_t round, int chunks,
                                          DiagPhase phase) {
  return wait_reached(diag_of(ctx), ce_ready_words(local, d) + chunks - 1, round, phase, DiagRole::kReceiver, d,
                      chunks - 1) &&
         wait_reached(diag_of(ctx), meta_ptr<const int32_t>(local, kOffCeHead) + d, round, phase, DiagRole::kReceiver,
                      d, -1);
}

/// take_landed_word over one round of a warp copy (load_round's words [base, base + kUnroll * warp) below `end`).
/// A lane none of whose words of the round still reads as the sentinel (the common case: the copy ran ahead of the
/// gather) takes them at once, after one test, without entering each word's poll loop. Per lane, not a warp vote: a
/// lane whose wait gave up leaves its warp's copy loop early (warp_copy_row_polled).
template <int kUnroll, class Peek, class Settle>
UCCL_DEVICE_INLINE void take_landed_round(int4 (&v)[kUnroll], const int4* src, int base, int end, int d,
                                          uint32_t& settled, bool& ok, const Peek& peek, const Settle& settle) {
  bool pending = false;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    pending |= base + u * gpu::kWarpSize + gpu::lane_id() < end && landing_pending(v[u]);
  if (!pending) return;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int i = base + u * gpu::kWarpSize + gpu::lane_id();
    if (i < end) take_landed_word(v[u], src + i, d, settled, ok, peek, settle);
  }
}

/// warp_copy_row_pipelined (double-buffered rounds) of a row of peer d that lands in a polled landing area during
/// the copy: each round's words are taken as they land (take_landed_round) before they are stored. Warp-collective;
/// returns false (uniform) where a lane's wait for d's flags gave up.
template <int kUnroll, class Peek, class Settle>
UCCL_DEVICE_INLINE bool warp_copy_row_polled(int4* __restrict__ dst, const int4* __restrict__ src, int num_16, int d,
                                             uint32_t& settled, const Peek& peek, const Settle& settle) {
  constexpr int kRound = kUnroll * gpu::kWarpSize;
  int4 a[kUnroll], b[kUnroll];  // two named buffers, so both stay in registers
  bool ok = true;
  load_round<kUnroll, true>(a, src, 0, num_16);
  for (int base = 0; base < num_16; base += 2 * kRound) {
    if (base + kRound < num_16) load_round<kUnroll, true>(b, src, base + kRound, num_16);
    take_landed_round<kUnroll>(a, src, base, num_16, d, settled, ok, peek, settle);
    if (!ok) break;  // (this lane: a wait gave up, the op is aborted) nothing it did not take goes into the outputs
    store_round<kUnroll>(dst, a, base, num_16);
    if (base + kRound >= num_16) break;
    if (base + 2 * kRound < num_16) load_round<kUnroll, true>(a, src, base + 2 * kRound, num_16);
    take_landed_round<kUnroll>(b, src, base + kRound, num_16, d, settled, ok, peek, settle);
    if (!ok) break;
    store_round<kUnroll>(dst, b, base + kRound, num_16);
  }
  return gpu::ballot(!ok) == 0;
}

}  // namespace uccl_moe::intranode
