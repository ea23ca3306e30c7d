// Milestones of the copy-engine dispatch's gather (dispatch_ce.cu), for kernel work only. Compiled in with
// -DUCCL_MOE_STAMP_GATHER (tools/device/gather_stamps.py says how to build it, into a separate build), nothing
// otherwise; CUDA only. Per launch, in global-timer ns, device-wide over the launch's warps: the first block's start,
// the rows' start (the latest warp to reach its first row), the first row done, the last own row done, the first
// peer row begun and the last one done, the last block's arrival, every peer's last copy flag seen, and the end after
// the done hand-shake. The last block prints them as one `gather-stamp` line, in us from the start, and clears them
// for the next launch; tools/device/gather_stamps.py summarizes the lines. Each rank prints its own lines (each rank
// is a process). The stamps' own waits only look: bounded, silent, they stop at the abort flag, so a failing op
// reports what its own waits name, as in the shipped build.
// With -DUCCL_MOE_STAMP_WAIT_ALL as well, every warp first waits for every peer's whole copy (its last flag and its
// head), so the rows' phases time the gather alone on landed data: an experiment, not the shipped order.
#pragma once

#include "handshake.cuh"
#include "landing_poll.cuh"

namespace uccl_moe::intranode::stamps {

#if defined(UCCL_MOE_STAMP_GATHER) && defined(UCCL_MOE_CUDA)
namespace {
enum Min { kStart, kFirstRow, kPeerBegin, kMins };
enum Max { kOwnEnd, kPeerEnd, kReady, kMaxes };
__device__ unsigned long long g_min[kMins] = {~0ull, ~0ull, ~0ull};
__device__ unsigned long long g_max[kMaxes];
__device__ unsigned int g_launch;

/// Spins until `seen()` holds, the abort flag is up or a second passed, reporting nothing (the op's own waits name
/// what never came).
template <class Seen>
UCCL_DEVICE_INLINE void look_for(const NvlContext& ctx, const Seen& seen) {
  const unsigned long long t0 = gpu::global_timer_ns();
  while (!seen() && gpu::load_volatile(ctx.abort_flag) == 0 && gpu::global_timer_ns() - t0 < 1000000000ull) {
  }
}

/// The launch's start, by thread 0 of each block.
UCCL_DEVICE_INLINE void begin() {
  if (threadIdx.x == 0) atomicMin(&g_min[kStart], gpu::global_timer_ns());
}

/// Before a warp's first row: under UCCL_MOE_STAMP_WAIT_ALL it waits for every peer's whole copy first (lane d for
/// peer d; a wait that gives up leaves the flags as they are: the rows' own waits then report it); either way the
/// latest warp to get here is the rows' start.
UCCL_DEVICE_INLINE void rows_ready(const NvlContext& ctx, void* local, int32_t round, int chunks) {
#if defined(UCCL_MOE_STAMP_WAIT_ALL)
  const int lane = gpu::lane_id();
  if (lane < ctx.num_ranks && lane != ctx.rank)
    look_for(ctx, [&] { return ce_landed_peek(local, lane, round, chunks); });
  gpu::sync_warp();
#else
  (void)ctx, (void)local, (void)round, (void)chunks;
#endif
  if (gpu::lane_id() == 0) atomicMax(&g_max[kReady], gpu::global_timer_ns());
}

/// A warp begins a row (peer: from a peer's landing area, else from x).
UCCL_DEVICE_INLINE void row_begins(bool peer) {
  if (peer && gpu::lane_id() == 0) atomicMin(&g_min[kPeerBegin], gpu::global_timer_ns());
}

/// A warp stored a row.
UCCL_DEVICE_INLINE void row_done(bool peer) {
  if (gpu::lane_id() != 0) return;
  const unsigned long long now = gpu::global_timer_ns();
  atomicMax(&g_max[peer ? kPeerEnd : kOwnEnd], now);
  atomicMin(&g_min[kFirstRow], now);
}

/// The last block, before ce_op_end: its arrival, then when every peer's last copy flag, which ce_op_end waits for
/// first, is seen (one thread per peer, look_for). Block-collective.
UCCL_DEVICE_INLINE void last_block_waits(const NvlContext& ctx, void* local, int32_t round, int chunks,
                                         unsigned long long (&t)[2]) {
  __shared__ unsigned long long flag_ns;
  const int d = static_cast<int>(threadIdx.x);
  if (d == 0) {
    t[0] = gpu::global_timer_ns();
    flag_ns = t[0];
  }
  __syncthreads();
  if (d < ctx.num_ranks && d != ctx.rank) {
    const int32_t* flag = ce_ready_words(local, d) + chunks - 1;
    look_for(ctx, [&] { return ring_diff(gpu::load_volatile(flag), round) >= 0; });
    atomicMax(&flag_ns, gpu::global_timer_ns());
  }
  __syncthreads();
  if (d == 0) t[1] = flag_ns;
}

/// The last block, after ce_op_end (thread 0): prints the launch's line and clears the stamps.
UCCL_DEVICE_INLINE void end(int rank, int row_bytes, int parts, const unsigned long long (&t)[2]) {
  if (threadIdx.x != 0) return;
  const unsigned long long now = gpu::global_timer_ns(), t0 = g_min[kStart];
  const auto us = [t0](unsigned long long v) {
    return v == 0 || v == ~0ull ? -1.0 : 1e-3 * (static_cast<double>(v) - static_cast<double>(t0));
  };
  printf("gather-stamp rank=%d launch=%u row_bytes=%d parts=%d ready=%.1f first_row=%.1f own_end=%.1f "
         "peer_begin=%.1f peer_end=%.1f rows_done=%.1f flag=%.1f end=%.1f\n",
         rank, g_launch++, row_bytes, parts, us(g_max[kReady]), us(g_min[kFirstRow]), us(g_max[kOwnEnd]),
         us(g_min[kPeerBegin]), us(g_max[kPeerEnd]), us(t[0]), us(t[1]), us(now));
  for (int i = 0; i < kMins; ++i) g_min[i] = ~0ull;
  for (int i = 0; i < kMaxes; ++i) g_max[i] = 0;
}
}  // namespace
#define UCCL_MOE_STAMP(stmt) stmt
#else
#define UCCL_MOE_STAMP(stmt)
#endif

}  // namespace uccl_moe::intranode::stamps
