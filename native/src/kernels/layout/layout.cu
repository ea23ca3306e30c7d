// get_dispatch_layout: per-rank / per-node / per-expert token counts and is_token_in_rank from top-k ids.
// One thread per token; counts go through shared memory (one global atomic per block and counter).
// A token counts once per rank (and per node) however many of its experts live there. An id outside [-1, E) is a
// usage error: it is skipped as if it were -1 (never used as an index) and the first one is recorded in the
// host-mapped TopkFault (diag.hpp), which the host raises as InvalidUsageError without a device sync.
#include "../intranode/intranode.hpp"
#include "uccl_moe/diag_device.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

namespace {

constexpr int kLayoutThreads = 256;
constexpr int kMaxSmemCounters = 12 * 1024;  // 48 KB of int counters; beyond that count in global memory

__global__ void __launch_bounds__(kLayoutThreads) get_dispatch_layout_kernel(LayoutArgs a, bool use_smem) {
  extern __shared__ int32_t s_counts[];  // [E | R | nodes]
  const int num_nodes = a.num_ranks / a.ranks_per_node;
  const int n_counters = a.num_experts + a.num_ranks + (a.num_tokens_per_node != nullptr ? num_nodes : 0);
  int32_t* expert_c = use_smem ? s_counts : a.num_tokens_per_expert;
  int32_t* rank_c = use_smem ? s_counts + a.num_experts : a.num_tokens_per_rank;
  int32_t* node_c = use_smem ? s_counts + a.num_experts + a.num_ranks : a.num_tokens_per_node;
  if (use_smem) {
    for (int i = threadIdx.x; i < n_counters; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
  }
  const int experts_per_rank = a.num_experts / a.num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < a.num_tokens) {
    bool* row = a.is_token_in_rank + static_cast<int64_t>(t) * a.num_ranks;
    for (int r = 0; r < a.num_ranks; ++r) row[r] = false;
    const int64_t* idx = a.topk_idx + static_cast<int64_t>(t) * a.num_topk;
    for (int k = 0; k < a.num_topk; ++k) {
      const int64_t e = idx[k];
      if (e < 0 || e >= a.num_experts) {
        if (e != -1) report_bad_topk(a.topk_fault, t, k, e, a.num_experts);
        continue;
      }
      atomicAdd(expert_c + e, 1);
      const int r = static_cast<int>(e / experts_per_rank);
      bool seen_rank = false, seen_node = false;
      for (int k2 = 0; k2 < k; ++k2) {
        const int64_t e2 = idx[k2];
        if (e2 < 0 || e2 >= a.num_experts) continue;
        const int r2 = static_cast<int>(e2 / experts_per_rank);
        seen_rank |= r2 == r;
        seen_node |= r2 / a.ranks_per_node == r / a.ranks_per_node;
      }
      if (!seen_rank) {
        row[r] = true;
        atomicAdd(rank_c + r, 1);
      }
      if (!seen_node && node_c != nullptr) atomicAdd(node_c + r / a.ranks_per_node, 1);
    }
  }
  if (use_smem) {
    __syncthreads();
    for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x)
      if (expert_c[i] != 0) atomicAdd(a.num_tokens_per_expert + i, expert_c[i]);
    for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x)
      if (rank_c[i] != 0) atomicAdd(a.num_tokens_per_rank + i, rank_c[i]);
    if (a.num_tokens_per_node != nullptr)
      for (int i = threadIdx.x; i < num_nodes; i += blockDim.x)
        if (node_c[i] != 0) atomicAdd(a.num_tokens_per_node + i, node_c[i]);
  }
}

__global__ void __launch_bounds__(kLayoutThreads) check_topk_idx_kernel(const int64_t* topk_idx, int64_t n,
                                                                         int num_topk, int num_experts,
                                                                         TopkFault* fault) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = topk_idx[i];
    if (e < -1 || e >= num_experts)
      report_bad_topk(fault, static_cast<int>(i / num_topk), static_cast<int>(i % num_topk), e, num_experts);
  }
}

}  // namespace

void launch_check_topk_idx(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, TopkFault* fault,
                           void* stream) {
  const int64_t n = static_cast<int64_t>(num_tokens) * num_topk;
  if (n == 0 || fault == nullptr) return;
  const int64_t want = (n + kLayoutThreads - 1) / kLayoutThreads;
  const int blocks = static_cast<int>(want < 1024 ? want : 1024);
  check_topk_idx_kernel<<<blocks, kLayoutThreads, 0, static_cast<gpu::Stream>(stream)>>>(topk_idx, n, num_topk,
                                                                                         num_experts, fault);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_get_dispatch_layout(const LayoutArgs& a, void* stream) {
  UCCL_ASSERT(a.num_ranks >= 1 && a.num_experts % a.num_ranks == 0,
              "num_experts=%d must be a positive multiple of num_ranks=%d", a.num_experts, a.num_ranks);
  UCCL_ASSERT(a.ranks_per_node >= 1 && a.num_ranks % a.ranks_per_node == 0, "ranks_per_node=%d must divide %d",
              a.ranks_per_node, a.num_ranks);
  const gpu::Stream st = static_cast<gpu::Stream>(stream);
  const int num_nodes = a.num_ranks / a.ranks_per_node;
  UCCL_CHECK_GPU(gpu::memset_async(a.num_tokens_per_expert, 0, sizeof(int32_t) * a.num_experts, st));
  UCCL_CHECK_GPU(gpu::memset_async(a.num_tokens_per_rank, 0, sizeof(int32_t) * a.num_ranks, st));
  if (a.num_tokens_per_node != nullptr)
    UCCL_CHECK_GPU(gpu::memset_async(a.num_tokens_per_node, 0, sizeof(int32_t) * num_nodes, st));
  if (a.num_tokens == 0) return;
  const int n_counters = a.num_experts + a.num_ranks + num_nodes;
  const bool use_smem = n_counters <= kMaxSmemCounters;
  const int blocks = (a.num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  get_dispatch_layout_kernel<<<blocks, kLayoutThreads, use_smem ? n_counters * sizeof(int32_t) : 0, st>>>(a, use_smem);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

}  // namespace uccl_moe::intranode
