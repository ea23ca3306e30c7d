// The per-token sum both intranode combines share (combine.cu: copies in ring slots and in x; combine_pull.cu:
// copies where they lie in each rank's buffer). Include only from .cu files.
#pragma once

#include "intranode_device.cuh"
#include "landing_poll.cuh"
#include "../bf16.cuh"

namespace uccl_moe::intranode {

/// Loads one column group of a token's copies (the 16-B columns col_base + u * 32 + lane, u < kColUnroll, below
/// col_end): lane d < kNumRanks of the warp holds in `copy` where rank d's copy of the row starts (bit d of `have`,
/// warp-uniform, says whether there is one). Every load is issued before any is used, so each lane keeps
/// kColUnroll * kNumRanks 16-B loads in flight. The copy of rank `stable` (-1: none) was written before the launch
/// and may take non-coherent loads; the others may have been written by a peer during it.
template <int kNumRanks, int kColUnroll>
UCCL_DEVICE_INLINE void load_token_copies(int4 (&v)[kColUnroll][kNumRanks], const int4* (&rows)[kNumRanks],
                                          const char* copy, gpu::LaneMask have, int stable, int col_base,
                                          int col_end) {
  const int lane = gpu::lane_id();
#pragma unroll
  for (int d = 0; d < kNumRanks; ++d) {
    rows[d] = reinterpret_cast<const int4*>(gpu::shfl(reinterpret_cast<unsigned long long>(copy), d));
#pragma unroll
    for (int u = 0; u < kColUnroll; ++u) {
      const int col = col_base + u * gpu::kWarpSize + lane;
      if (((have >> d) & 1) && col < col_end)
        v[u][d] = d == stable ? gpu::load_stream_128(rows[d] + col) : gpu::load_ring_128(rows[d] + col);
    }
  }
}

/// The sum of one column group load_token_copies loaded: the copies added in float32 in rank order 0..N-1, then
/// row t of bias0 and of bias1 (either may be null), rounded once to BF16 into row t of `out`: a fixed order, so
/// bitwise deterministic.
template <int kNumRanks, int kColUnroll>
UCCL_DEVICE_INLINE void store_token_sum(const int4 (&v)[kColUnroll][kNumRanks], gpu::LaneMask have, int col_base,
                                        int col_end, const int4* bias0, const int4* bias1, int64_t t, int num_16,
                                        int4* out) {
  const int lane = gpu::lane_id();
#pragma unroll
  for (int u = 0; u < kColUnroll; ++u) {
    const int col = col_base + u * gpu::kWarpSize + lane;
    if (col >= col_end) continue;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int d = 0; d < kNumRanks; ++d)
      if ((have >> d) & 1) kernels::add_bf16x8(acc, v[u][d]);
    if (bias0 != nullptr) kernels::add_bf16x8(acc, gpu::load_stream_128(bias0 + t * num_16 + col));
    if (bias1 != nullptr) kernels::add_bf16x8(acc, gpu::load_stream_128(bias1 + t * num_16 + col));
    out[t * num_16 + col] = kernels::pack_bf16x8(acc);
  }
}

/// One token's combine sum over the 16-B columns [col_begin, col_end), called by the whole warp (the copies as
/// load_token_copies takes them, the sum as store_token_sum makes it).
template <int kNumRanks, int kColUnroll>
UCCL_DEVICE_INLINE void sum_token_copies(const char* copy, gpu::LaneMask have, int stable, int col_begin, int col_end,
                                         const int4* bias0, const int4* bias1, int64_t t, int num_16, int4* out) {
  for (int col_base = col_begin; col_base < col_end; col_base += kColUnroll * gpu::kWarpSize) {
    int4 v[kColUnroll][kNumRanks];
    const int4* rows[kNumRanks];
    load_token_copies<kNumRanks, kColUnroll>(v, rows, copy, have, stable, col_base, col_end);
    store_token_sum<kNumRanks, kColUnroll>(v, have, col_base, col_end, bias0, bias1, t, num_16, out);
  }
}

/// sum_token_copies over copies that land during the sum in a polled landing area: each peer's 16-B word is taken
/// once none of its 32-bit words holds the sentinel. A word still at the sentinel once peer d's whole copy landed
/// (`peek(d)`: its copy flag and its head word both reached this round, read without waiting, then a fence) is the
/// data's own: it is loaded once more and taken; bit d of `settled` (per lane) then takes any later word of d
/// still at the sentinel after one more load (words loaded before the fence may be stale). After
/// kPollsBeforeSettle polls `settle(d)` waits for the same flags (bounded). Returns false (warp-uniform) where settle
/// gave up (an expiry or an abort).
/// The per-word loop is take_landed_word's (landing_poll.cuh, the dispatch's gather) written out here on purpose:
/// the sum calling that helper compiled to a measurably slower kernel, with the same semantics (docs/intranode.md,
/// session 43). A change to one is a change to both. As in take_landed_round, a lane first tests all its words of a
/// column round once and enters the per-word loops only where one still holds the sentinel (per lane, not a warp
/// vote: docs/intranode.md, "Session 48").
template <int kNumRanks, int kColUnroll, class Peek, class Settle>
UCCL_DEVICE_INLINE bool sum_token_copies_polled(const char* copy, gpu::LaneMask have, int stable, int col_begin,
                                                int col_end, const int4* bias0, const int4* bias1, int64_t t,
                                                int num_16, int4* out, uint32_t& settled, const Peek& peek,
                                                const Settle& settle) {
  const int lane = gpu::lane_id();
  bool ok = true;
  for (int col_base = col_begin; col_base < col_end; col_base += kColUnroll * gpu::kWarpSize) {
    int4 v[kColUnroll][kNumRanks];
    const int4* rows[kNumRanks];
    load_token_copies<kNumRanks, kColUnroll>(v, rows, copy, have, stable, col_base, col_end);
    bool pending = false;  // a word of this lane's round still holds the sentinel
#pragma unroll
    for (int d = 0; d < kNumRanks; ++d) {
      if (d == stable || !((have >> d) & 1)) continue;
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u)
        pending |= col_base + u * gpu::kWarpSize + lane < col_end && landing_pending(v[u][d]);
    }
#pragma unroll
    for (int d = 0; d < kNumRanks && pending; ++d) {
      if (d == stable || !((have >> d) & 1)) continue;
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u) {
        const int col = col_base + u * gpu::kWarpSize + lane;
        if (col >= col_end) continue;
        for (int polls = 0; ok && landing_pending(v[u][d]); ++polls) {
          // Settled (here or for an earlier word): a load after the flags' acquire is final. The loads above may
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
            v[u][d] = gpu::load_ring_128(rows[d] + col);
            break;
          }
          v[u][d] = gpu::load_ring_128(rows[d] + col);
        }
      }
    }
    if (gpu::ballot(!ok) != 0) return false;
    store_token_sum<kNumRanks, kColUnroll>(v, have, col_base, col_end, bias0, bias1, t, num_16, out);
  }
  return true;
}

}  // namespace uccl_moe::intranode
