// The per-token sum both intranode combines share (combine.cu: copies in ring slots and in x; combine_pull.cu:
// copies where they lie in each rank's buffer). Include only from .cu files.
#pragma once

#include "intranode_device.cuh"
#include "../bf16.cuh"

namespace uccl_moe::intranode {

/// One token's combine sum over the 16-B columns [col_begin, col_end), called by the whole warp: lane d < kNumRanks
/// holds in `copy` where rank d's copy of the row starts (bit d of `have`, warp-uniform, says whether there is one).
/// The copies are added in float32 in rank order 0..N-1, then row t of bias0 and of bias1 (either may be null), and
/// rounded once to BF16 into row t of `out`: a fixed order, so bitwise deterministic. kColUnroll column groups x
/// kNumRanks copies: every load is issued before the first add, so each lane keeps kColUnroll * kNumRanks 16-B loads
/// in flight. The copy of rank `stable` (-1: none) was written before the launch and may take non-coherent loads;
/// the others may have been written by a peer during it.
template <int kNumRanks, int kColUnroll>
UCCL_DEVICE_INLINE void sum_token_copies(const char* copy, gpu::LaneMask have, int stable, int col_begin, int col_end,
                                         const int4* bias0, const int4* bias1, int64_t t, int num_16, int4* out) {
  const int lane = gpu::lane_id();
  for (int col_base = col_begin; col_base < col_end; col_base += kColUnroll * gpu::kWarpSize) {
    int4 v[kColUnroll][kNumRanks];
#pragma unroll
    for (int d = 0; d < kNumRanks; ++d) {
      const int4* row = reinterpret_cast<const int4*>(gpu::shfl(reinterpret_cast<unsigned long long>(copy), d));
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u) {
        const int col = col_base + u * gpu::kWarpSize + lane;
        if (((have >> d) & 1) && col < col_end)
          v[u][d] = d == stable ? gpu::load_stream_128(row + col) : gpu::load_ring_128(row + col);
      }
    }
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
}

}  // namespace uccl_moe::intranode
