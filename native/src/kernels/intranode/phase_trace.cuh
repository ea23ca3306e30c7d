// Phase timing of the intranode kernels, for kernel work only: the ring dispatch and combine, and the staged
// combine's two kernels (`stage`: the whole-GPU copy, all `copy`; `pull_staged` / `pull_view`: kept = staging the
// weights, wait = the start hand-shake, copy = summing the rows, meta = summing the weights, publish = the end
// hand-shake, the rest of each token's index work in `other`). Compiled in with
// -DUCCL_MOE_TRACE_DISPATCH (tools/device/device_2gpu.sh's `trace` stage builds it into a separate build), nothing
// otherwise. Each kernel's .cu has its own copy of the sums (internal linkage). Lane 0 of each
// warp adds the SM cycles it spends in each phase to its row in shared memory; when the warp ends, it adds the row
// and its own span (cycles and ns) to device-wide sums per role, and the last warp of the launch prints one line per
// role (the mean per warp, in us: cycles scaled by that role's own cycles per ns) and clears the sums for the next
// launch. tools/device/trace_summary.py averages the lines over launches. Sums in shared memory cost no registers, so
// the traced kernel keeps the shipped one's register allocation as far as the compiler allows; its times still
// include the clock reads and the final atomics. Only rank UCCL_MOE_TRACE_RANK (default 0) prints: the ranks'
// processes share one stdout, and device printf from two of them interleaves within lines.
#pragma once

#include "uccl_moe/platform.cuh"

#ifndef UCCL_MOE_TRACE_RANK
#define UCCL_MOE_TRACE_RANK 0
#endif

namespace uccl_moe::intranode::trace {

enum Role { kSendRemote, kSendDirect, kRecv, kRoles };                    // kRoles: a warp with no work
enum Phase { kCopy, kMeta, kWait, kKept, kPublish, kSelect, kPhases };

#if defined(UCCL_MOE_TRACE_DISPATCH) && defined(UCCL_MOE_CUDA)
namespace {
constexpr int kMaxWarps = 32;
__shared__ unsigned long long s_cycles[kMaxWarps][kPhases];
__device__ unsigned long long g_cycles[kRoles][kPhases];
__device__ unsigned long long g_span_cycles[kRoles];
__device__ unsigned long long g_span_ns[kRoles];
__device__ unsigned int g_warps[kRoles];
__device__ unsigned int g_done;

/// Start of a launch, by every warp: clears its row.
UCCL_DEVICE_INLINE void begin() {
  if (gpu::lane_id() == 0)
    for (int p = 0; p < kPhases; ++p) s_cycles[gpu::warp_id()][p] = 0;
}
UCCL_DEVICE_INLINE long long now() { return clock64(); }
/// Adds the cycles since `since` to phase `p` of this warp.
UCCL_DEVICE_INLINE void add(Phase p, long long since) {
  if (gpu::lane_id() == 0) s_cycles[gpu::warp_id()][p] += clock64() - since;
}
/// End of this warp (every warp of the launch calls it once): its sums into role `r`'s; the last warp prints them,
/// labelled `op` (dispatch, combine).
UCCL_DEVICE_INLINE void finish(Role r, long long t0_cycles, unsigned long long t0_ns, const char* op, int rank,
                               int row_bytes) {
  if (gpu::lane_id() != 0) return;
  if (r < kRoles) {
    for (int p = 0; p < kPhases; ++p) atomicAdd(&g_cycles[r][p], s_cycles[gpu::warp_id()][p]);
    atomicAdd(&g_span_cycles[r], static_cast<unsigned long long>(clock64() - t0_cycles));
    atomicAdd(&g_span_ns[r], gpu::global_timer_ns() - t0_ns);
    atomicAdd(&g_warps[r], 1u);
  }
  __threadfence();
  const unsigned int total = gridDim.x * (blockDim.x / gpu::kWarpSize);
  if (atomicAdd(&g_done, 1u) != total - 1) return;
  __threadfence();
  const char* names[kRoles] = {"send_remote", "send_direct", "recv"};
  for (int role = 0; role < kRoles; ++role) {
    const unsigned int w = g_warps[role];
    if (w > 0 && g_span_ns[role] > 0 && rank == UCCL_MOE_TRACE_RANK) {
      const double per_ns = static_cast<double>(g_span_cycles[role]) / static_cast<double>(g_span_ns[role]);
      const double us = 1e-3 / per_ns / w;  // cycles summed over warps -> us per warp
      printf("uccl-trace %s rank=%d row_bytes=%d role=%s warps=%u span=%.2f copy=%.2f meta=%.2f wait=%.2f "
             "kept=%.2f publish=%.2f select=%.2f\n",
             op, rank, row_bytes, names[role], w, 1e-3 * g_span_ns[role] / w, us * g_cycles[role][kCopy],
             us * g_cycles[role][kMeta], us * g_cycles[role][kWait], us * g_cycles[role][kKept],
             us * g_cycles[role][kPublish], us * g_cycles[role][kSelect]);
    }
    for (int p = 0; p < kPhases; ++p) g_cycles[role][p] = 0;
    g_span_cycles[role] = g_span_ns[role] = 0;
    g_warps[role] = 0;
  }
  g_done = 0;
}
}  // namespace
#define UCCL_MOE_TRACE(stmt) stmt
#else
#define UCCL_MOE_TRACE(stmt)
#endif

}  // namespace uccl_moe::intranode::trace
