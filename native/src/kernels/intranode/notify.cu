// notify_dispatch: exchange of token counts between local ranks before a non-cached dispatch, and
// prepare_round: the ring reset when the channel count changed. Both are one block (counts are tiny) and reset
// the ring counters between two barriers.
#include "intranode_device.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

namespace {

/// Zeroes this rank's tail, head, send_base and recv_base words for the lanes in use. Called between two
/// barriers: after the first no peer still reads or writes them (previous kernels are done everywhere),
/// before the second no peer starts writing them.
UCCL_DEVICE_INLINE void reset_ring_counters(const NvlContext& ctx, int num_lanes) {
  void* local = ctx.buffers[ctx.rank];
  const int n = num_lanes * ctx.num_ranks;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    meta_ptr(local, kOffTail)[i] = 0;
    meta_ptr(local, kOffHead)[i] = 0;
    meta_ptr(local, kOffSendBase)[i] = 0;
    meta_ptr(local, kOffRecvBase)[i] = 0;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    notify_dispatch_kernel(NvlContext ctx, Geometry g, NotifyArgs a) {
  __shared__ int s_failed;
  const int N = ctx.num_ranks, me = ctx.rank, L = g.num_lanes;
  const int warp = gpu::warp_id(), lane = gpu::lane_id(), num_warps = blockDim.x / gpu::kWarpSize;
  if (!barrier_block(ctx, &s_failed)) return;

  // 1) Tokens per (dst, lane): lane l owns tokens [l * ceil(T/L), ...) of this rank.
  for (int pair = warp; pair < N * L; pair += num_warps) {
    const int dst = pair / L, l = pair % L;
    int begin, end;
    lane_token_range(tokens_of(a), L, l, &begin, &end);
    int count = 0;
    for (int t = begin + lane; t < end; t += gpu::kWarpSize) count += a.is_token_in_rank[static_cast<int64_t>(t) * N + dst];
    for (int m = gpu::kWarpSize / 2; m > 0; m >>= 1) count += gpu::shfl_xor(count, m);
    if (lane == 0) a.lane_prefix[dst * L + l] = count;
  }
  __syncthreads();
  // 2) Inclusive prefix over lanes, one warp per destination.
  for (int dst = warp; dst < N; dst += num_warps) {
    int running = 0;
    for (int base = 0; base < L; base += gpu::kWarpSize) {
      const int l = base + lane;
      int v = l < L ? a.lane_prefix[dst * L + l] : 0;
      for (int d = 1; d < gpu::kWarpSize; d <<= 1) {
        const int up = gpu::shfl_up(v, d);
        if (lane >= d) v += up;
      }
      if (l < L) a.lane_prefix[dst * L + l] = running + v;
      running += gpu::shfl(v, gpu::kWarpSize - 1);
    }
  }
  __syncthreads();
  // 3) Publish our row of counts, our per-expert counts and our lane prefix into every rank's meta.
  const int experts_per_rank = a.num_experts / N;
  for (int dst = 0; dst < N; ++dst) {
    void* peer = ctx.buffers[dst];
    for (int i = threadIdx.x; i < N; i += blockDim.x)
      meta_ptr(peer, kOffRankCounts)[me * kMaxLocalRanks + i] = a.num_tokens_per_rank[i];
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x)
      meta_ptr(peer, kOffExpertCounts)[me * kMaxExpertsPerRank + e] = a.num_tokens_per_expert[dst * experts_per_rank + e];
    for (int l = threadIdx.x; l < L; l += blockDim.x)
      meta_ptr(peer, kOffLanePrefix)[me * kMaxLanes + l] = a.lane_prefix[dst * L + l];
    if (threadIdx.x == 0) meta_ptr(peer, kOffRankTokens)[me] = tokens_of(a);
    if (threadIdx.x == 0) {
      meta_ptr<int64_t>(peer, kOffNotifyRows)[me] = a.rows_code;
      meta_ptr(peer, kOffNotifyExperts)[me] = a.num_experts;
    }
  }
  reset_ring_counters(ctx, L);
  if (!barrier_block(ctx, &s_failed)) return;  // its fence publishes step 3 before peers read it

  // 4) Read what every source wrote to us.
  void* local = ctx.buffers[me];
  const int32_t* counts = meta_ptr(local, kOffRankCounts);
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    int running = 0;
    for (int i = 0; i < N; ++i) {
      running += gpu::load_volatile(counts + i * kMaxLocalRanks + j);
      a.rank_prefix[i * N + j] = running;
    }
  }
  // Every rank compares every peer's rows with its own, so all of them raise (a mismatch between two ranks makes
  // every rank differ from one of them); notify itself runs to its end, its counts are sound. Where the host waits
  // for the counts (write_host_counters) it raises before the dispatch moves a row; with num_worst_tokens nothing
  // waits, the dispatch runs on and the Buffer's next call raises (the record says so: command 1).
  if (const int src = static_cast<int>(threadIdx.x); src < N && src != me && a.rows_code != 0) {
    const uint64_t ran_on = a.write_host_counters ? 0 : kDispatchArgsRanOn;
    const int64_t theirs = *reinterpret_cast<const volatile int64_t*>(meta_ptr<int64_t>(local, kOffNotifyRows) + src);
    const int32_t their_experts = gpu::load_volatile(meta_ptr(local, kOffNotifyExperts) + src);
    if (their_experts != a.num_experts)  // first: the counts exchanged above are then not sound either
      report_invalid(diag_of(ctx), DiagPhase::kDispatchArgs, DiagRole::kCoordinator, src, -1, a.num_experts,
                     their_experts, ran_on | kDispatchArgsExperts);
    else if (theirs != 0 && theirs != a.rows_code)
      report_invalid(diag_of(ctx), DiagPhase::kDispatchArgs, DiagRole::kCoordinator, src, -1, a.rows_code, theirs,
                     ran_on);
  }
  for (int i = threadIdx.x; i < N * L; i += blockDim.x) {
    const int src = i / L, l = i % L;
    a.recv_lane_start[i] = l == 0 ? 0 : gpu::load_volatile(meta_ptr(local, kOffLanePrefix) + src * kMaxLanes + l - 1);
  }
  if (a.write_host_counters) {
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
      int sum = 0;
      for (int src = 0; src < N; ++src) sum += gpu::load_volatile(meta_ptr(local, kOffExpertCounts) + src * kMaxExpertsPerRank + e);
      const int align = a.expert_alignment > 0 ? a.expert_alignment : 1;
      ctx.expert_counters[e] = (sum + align - 1) / align * align;
    }
    gpu::fence_sys();
    __syncthreads();
    if (threadIdx.x == 0) {
      // recv_counter[1]: the most rows any rank of the node receives (the same on every rank, so host code can
      // take a group-wide decision on it without a collective: Buffer.combine_buffer_fits).
      // recv_counter[2]: the most rows any rank receives from other ranks (a staged combine's rows; same on every
      // rank).
      int largest = 0, largest_remote = 0;
      for (int dst = 0; dst < N; ++dst) {
        largest = max(largest, static_cast<int>(buffer_rows(a.rank_prefix, N, dst, false)));
        largest_remote = max(largest_remote, static_cast<int>(buffer_rows(a.rank_prefix, N, dst, true)));
      }
      ctx.recv_counter[1] = largest;
      ctx.recv_counter[2] = largest_remote;
      for (int i = 0; i < N * N; ++i) ctx.recv_counter[kRecvCounterRankPrefix + i] = a.rank_prefix[i];
      for (int s = 0; s < N; ++s)
        ctx.recv_counter[kRecvCounterRankTokens + s] = gpu::load_volatile(meta_ptr(local, kOffRankTokens) + s);
      gpu::store_release_sys(ctx.recv_counter, a.rank_prefix[(N - 1) * N + me]);  // pairs with wait_recv_counts
    }
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) prepare_round_kernel(NvlContext ctx, Geometry g) {
  __shared__ int s_failed;
  if (!barrier_block(ctx, &s_failed)) return;
  reset_ring_counters(ctx, g.num_lanes);
  barrier_block(ctx, &s_failed);
}

}  // namespace

void launch_notify_dispatch(const NvlContext& ctx, const Geometry& g, const NotifyArgs& a, void* stream) {
  check_geometry(ctx, g, "notify");
  UCCL_ASSERT(a.num_experts % ctx.num_ranks == 0 && a.num_experts / ctx.num_ranks <= kMaxExpertsPerRank,
              "num_experts=%d must be a multiple of the %d ranks with at most %d experts per rank", a.num_experts,
              ctx.num_ranks, kMaxExpertsPerRank);
  notify_dispatch_kernel<<<1, kThreadsPerBlock, 0, static_cast<gpu::Stream>(stream)>>>(ctx, g, a);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_prepare_round(const NvlContext& ctx, const Geometry& g, void* stream) {
  check_geometry(ctx, g, "prepare_round");
  prepare_round_kernel<<<1, kThreadsPerBlock, 0, static_cast<gpu::Stream>(stream)>>>(ctx, g);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

}  // namespace uccl_moe::intranode
