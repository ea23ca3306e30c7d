// Internode kernels: pack (per-node deduplicated staging), post (FIFO pushes to the proxy), wait (arrival counters
// applied by the proxy), rail barrier, and the final fixed-order reduction of combine. See internode.hpp.
#include "internode.hpp"

#include "../bf16.cuh"
#include "../intranode/intranode_device.cuh"
#include "uccl_moe/gpu_check.cuh"
#include "uccl_moe/transfer_cmd.hpp"

namespace uccl_moe::internode {

namespace {

constexpr int kThreads = 512;
constexpr int64_t kAlign = 256;

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

UCCL_DEVICE_INLINE DiagDeviceHandle diag_of(const RdmaContext& c) {
  return DiagDeviceHandle{c.diag_record, c.abort_flag, c.timeout_ns, c.rank};
}

__global__ void __launch_bounds__(kThreads) rdma_pack_kernel(RdmaContext ctx, PackArgs a) {
  const int lane = gpu::lane_id();
  const int warps = blockDim.x / gpu::kWarpSize;
  const int N = ctx.num_nodes, G = ctx.ranks_per_node, R = ctx.num_ranks;
  const RdmaLayout& l = a.layout;
  const int experts_per_node = a.num_experts / N;
  const int num_16 = l.row_bytes / 16;
  const int K = l.num_topk;
  for (int t = blockIdx.x * warps + gpu::warp_id(); t < a.num_tokens; t += gridDim.x * warps) {
    for (int n = 0; n < N; ++n) {
      const int32_t pos = a.send_pos[static_cast<int64_t>(t) * N + n];
      if (pos < 0) continue;
      const int64_t row = a.dst_row[n] + pos;
      if (row >= l.cap) {  // the backend checks counts on the host when it can; this guards num_worst_tokens calls
        if (lane == 0)
          report_timeout(diag_of(ctx), DiagPhase::kRdmaCapacity, DiagRole::kSender, -1, n, row + 1, l.cap, 0, 0.0);
        continue;
      }
      const Area& ar = n == ctx.node ? a.recv : a.send;
      intranode::warp_copy_row<4, false>(
          reinterpret_cast<int4*>(ar.x + row * l.row_bytes),
          reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + static_cast<int64_t>(t) * l.row_bytes), num_16);
      if (a.x_scales != nullptr) {
        const int32_t* scales = static_cast<const int32_t*>(a.x_scales);
        for (int j = lane; j < l.num_scales; j += gpu::kWarpSize)
          ar.scales[row * l.num_scales + j] = scales[t * a.scale_token_stride + j * a.scale_hidden_stride];
      }
      if (a.topk_idx == nullptr) continue;  // cached dispatch: the handle keeps masks, ids and sources
      if (lane < K) {
        const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + lane];
        const int64_t rel = e - static_cast<int64_t>(n) * experts_per_node;
        const bool here = e >= 0 && rel >= 0 && rel < experts_per_node;
        ar.topk[row * K + lane] = here ? rel : -1;  // node-relative; the forwarder's dispatch makes it local
        ar.weights[row * K + lane] = a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * K + lane] : 0.f;
      }
      const bool want = lane < G && a.is_token_in_rank[static_cast<int64_t>(t) * R + n * G + lane];
      const gpu::LaneMask bits = gpu::ballot(want);
      if (lane == 0) {
        ar.mask[row] = static_cast<int32_t>(bits & ((1ull << G) - 1));
        ar.src[row] = t;
      }
    }
  }
}

__global__ void rdma_post_kernel(RdmaContext ctx, PostArgs a) {
  // Thread (n, s): stripe s of every array of node n's segment, through its own FIFO (FIFOs n*S .. n*S+S-1 belong
  // to S different proxy threads when there are at least S), then the stripe's arrival in the same FIFO.
  const int n = threadIdx.x / kStripes, s = threadIdx.x % kStripes;
  if (n >= ctx.num_nodes || n == ctx.node) return;
  const int dst = n * ctx.ranks_per_node + ctx.local;
  const FifoDeviceHandle fifo = ctx.fifos[(n * kStripes + s) % ctx.num_fifos];
  const DiagDeviceHandle diag = diag_of(ctx);
  const int64_t rows = a.rows[n];
  if (a.dst_row[n] + rows > a.peer_cap) {  // num_worst_tokens calls are checked here, the others on the host
    if (s == 0)
      report_timeout(diag, DiagPhase::kRdmaCapacity, DiagRole::kSender, dst, n, a.dst_row[n] + rows, a.peer_cap, 0,
                     0.0);
    return;
  }
  for (int i = 0; i < a.num_arrays; ++i) {
    const PostArray& arr = a.arrays[i];
    const int64_t total = rows * arr.row_bytes;
    const int64_t part = (total + kStripes * 16 - 1) / (kStripes * 16) * 16;  // 16-byte aligned stripes
    const int64_t lo = min(total, s * part), hi = min(total, lo + part);
    const int64_t src = arr.src_off + a.src_row[n] * arr.row_bytes;
    const int64_t dst_off = arr.dst_off + a.dst_row[n] * arr.row_bytes;
    for (int64_t off = lo; off < hi; off += kMaxCmdBytes) {
      TransferCmdFields f;
      f.op = CmdOp::kWrite;
      f.dst_rank = static_cast<uint32_t>(dst);
      f.bytes = static_cast<uint32_t>(min(static_cast<int64_t>(kMaxCmdBytes), hi - off));
      f.src_offset = static_cast<uint64_t>(src + off);
      f.dst_offset = static_cast<uint64_t>(dst_off + off);
      if (fifo.push(encode(f), diag) == ~0ull) return;
    }
  }
  // The arrival: applied at the receiver only after every earlier write of this FIFO to dst landed (HT order).
  TransferCmdFields f;
  f.op = CmdOp::kAtomic;
  f.dst_rank = static_cast<uint32_t>(dst);
  f.counter_slot = static_cast<uint8_t>(a.slot);
  f.counter_value = 1;
  fifo.push(encode(f), diag);
}

/// `count` arrivals of `slot` from rank `src`: waits until its counter passed what this rank consumed so far by
/// `count`. False on timeout (diagnostic written).
UCCL_DEVICE_INLINE bool wait_arrival(const RdmaContext& ctx, int src, int slot, int count) {
  const int64_t* counter = ctx.counters + static_cast<int64_t>(src) * kCountersPerSrc + slot;
  int64_t* epoch = ctx.epochs + slot * ctx.num_ranks + src;
  const int64_t want = *epoch + count;
  // released by the proxy's counter add (after the data landed)
  if (!wait_reached(diag_of(ctx), counter, want, DiagPhase::kRdmaRecvTokens, DiagRole::kReceiver, src, slot))
    return false;
  *epoch = want;
  return true;
}

__global__ void rdma_notify_kernel(RdmaContext ctx, int64_t offset, int row_bytes) {
  const DiagDeviceHandle diag = diag_of(ctx);
  for (int p = threadIdx.x; p < ctx.num_ranks; p += blockDim.x) {
    if (p == ctx.rank) continue;
    const FifoDeviceHandle fifo = ctx.fifos[p % ctx.num_fifos];
    TransferCmdFields f;
    f.op = CmdOp::kWrite;
    f.dst_rank = static_cast<uint32_t>(p);
    f.bytes = static_cast<uint32_t>(row_bytes);
    f.src_offset = f.dst_offset = static_cast<uint64_t>(offset + static_cast<int64_t>(ctx.rank) * row_bytes);
    if (fifo.push(encode(f), diag) == ~0ull) return;
    TransferCmdFields g;
    g.op = CmdOp::kAtomic;
    g.dst_rank = static_cast<uint32_t>(p);
    g.counter_slot = kSlotNotify;
    g.counter_value = 1;
    if (fifo.push(encode(g), diag) == ~0ull) return;
  }
  for (int s = threadIdx.x; s < ctx.num_ranks; s += blockDim.x)
    if (s != ctx.rank && !wait_arrival(ctx, s, kSlotNotify, 1)) return;
}

__global__ void rdma_wait_kernel(RdmaContext ctx, int slot) {
  const int m = threadIdx.x;
  if (m >= ctx.num_nodes || m == ctx.node) return;
  wait_arrival(ctx, m * ctx.ranks_per_node + ctx.local, slot, kStripes);  // one arrival per stripe
}

__global__ void rail_barrier_kernel(RdmaContext ctx) {
  if (threadIdx.x != 0) return;
  const DiagDeviceHandle diag = diag_of(ctx);
  TransferCmdFields f;
  f.op = CmdOp::kBarrier;
  f.flags = kCmdFlagSameRail;
  const FifoDeviceHandle& fifo = ctx.fifos[0];
  const uint64_t idx = fifo.push(encode(f), diag);
  if (idx == ~0ull) return;
  BoundedWait wait(diag);
  while (!fifo.check_completion(idx)) {
    if (wait.expired()) {
      report_timeout(diag, DiagPhase::kBarrier, DiagRole::kCoordinator, -1, fifo.channel,
                     static_cast<int64_t>(idx) + 1, gpu::load_acquire_sys(reinterpret_cast<const int64_t*>(fifo.tail)),
                     idx, wait.waited_s());
      return;
    }
  }
}

__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(ReduceArgs a) {
  const int lane = gpu::lane_id();
  const int warps = blockDim.x / gpu::kWarpSize;
  const int N = a.num_nodes, K = a.num_topk;
  const int num_16 = a.hidden * 2 / 16;
  const int4* bias0 = static_cast<const int4*>(a.bias0);
  const int4* bias1 = static_cast<const int4*>(a.bias1);
  for (int t = blockIdx.x * warps + gpu::warp_id(); t < a.num_tokens; t += gridDim.x * warps) {
    const int32_t* pos = a.send_pos + static_cast<int64_t>(t) * N;
    for (int col = lane; col < num_16; col += gpu::kWarpSize) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int n = 0; n < N; ++n) {  // node order: bitwise deterministic
        const int32_t p = pos[n];
        if (p < 0) continue;
        const int4* row = reinterpret_cast<const int4*>(a.part_x[n]) + static_cast<int64_t>(p) * num_16;
        kernels::add_bf16x8(acc, row[col]);
      }
      if (bias0 != nullptr) kernels::add_bf16x8(acc, bias0[static_cast<int64_t>(t) * num_16 + col]);
      if (bias1 != nullptr) kernels::add_bf16x8(acc, bias1[static_cast<int64_t>(t) * num_16 + col]);
      static_cast<int4*>(a.out)[static_cast<int64_t>(t) * num_16 + col] = kernels::pack_bf16x8(acc);
    }
    if (a.out_topk_weights != nullptr && lane < K) {
      float sum = 0.f;
      for (int n = 0; n < N; ++n) {
        const int32_t p = pos[n];
        if (p >= 0) sum += reinterpret_cast<const float*>(a.part_w[n])[static_cast<int64_t>(p) * K + lane];
      }
      a.out_topk_weights[static_cast<int64_t>(t) * K + lane] = sum;
    }
  }
}

int grid_for(int64_t items, int per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1024)));
}

}  // namespace

RdmaLayout dispatch_layout(int64_t num_rdma_bytes, int row_bytes, int num_scales, int num_topk, int ranks_per_node) {
  UCCL_ASSERT(row_bytes > 0 && row_bytes % 16 == 0, "row bytes %d must be a positive multiple of 16", row_bytes);
  UCCL_ASSERT(ranks_per_node >= 1 && ranks_per_node <= 8, "ranks_per_node=%d must be in [1, 8]", ranks_per_node);
  RdmaLayout l{};
  l.half_bytes = std::max<int64_t>(0, num_rdma_bytes - kNotifyReserveBytes) / 2 / kAlign * kAlign;
  const int64_t per_row = row_bytes + 4LL * num_scales + 8LL * num_topk + 4LL * num_topk + 4 + 4;
  l.cap = std::max<int64_t>(0, (l.half_bytes - 6 * kAlign) / per_row) / 16 * 16;
  l.off_x = 0;
  l.off_scales = align_up(l.off_x + l.cap * row_bytes, kAlign);
  l.off_topk = align_up(l.off_scales + l.cap * 4 * num_scales, kAlign);
  l.off_weights = align_up(l.off_topk + l.cap * 8 * num_topk, kAlign);
  l.off_mask = align_up(l.off_weights + l.cap * 4 * num_topk, kAlign);
  l.off_src = align_up(l.off_mask + l.cap * 4, kAlign);
  UCCL_CHECK_INTERNAL(l.off_src + l.cap * 4 <= l.half_bytes, "dispatch RDMA layout overflows its half");
  l.row_bytes = row_bytes;
  l.num_scales = num_scales;
  l.num_topk = num_topk;
  l.ranks_per_node = ranks_per_node;
  return l;
}

RdmaLayout combine_layout(int64_t num_rdma_bytes, int hidden, int num_topk) {
  UCCL_ASSERT(hidden > 0 && (hidden * 2) % 16 == 0, "combine hidden=%d: hidden * 2 bytes must be a multiple of 16",
              hidden);
  RdmaLayout l{};
  l.half_bytes = std::max<int64_t>(0, num_rdma_bytes - kNotifyReserveBytes) / 2 / kAlign * kAlign;
  const int64_t per_row = 2LL * hidden + 4LL * num_topk;
  l.cap = std::max<int64_t>(0, (l.half_bytes - 2 * kAlign) / per_row) / 16 * 16;
  l.off_x = 0;
  l.off_weights = align_up(l.cap * 2LL * hidden, kAlign);
  l.off_scales = l.off_topk = l.off_mask = l.off_src = l.off_weights;  // unused
  UCCL_CHECK_INTERNAL(l.off_weights + l.cap * 4 * num_topk <= l.half_bytes, "combine RDMA layout overflows its half");
  l.row_bytes = 2 * hidden;
  l.num_topk = num_topk;
  return l;
}

Area area_of(char* base, const RdmaLayout& l) {
  return Area{base + l.off_x, reinterpret_cast<int32_t*>(base + l.off_scales), reinterpret_cast<int64_t*>(base + l.off_topk),
              reinterpret_cast<float*>(base + l.off_weights), reinterpret_cast<int32_t*>(base + l.off_mask),
              reinterpret_cast<int32_t*>(base + l.off_src)};
}

void launch_rdma_pack(const RdmaContext& ctx, const PackArgs& a, void* stream) {
  UCCL_ASSERT(ctx.num_nodes >= 2 && ctx.num_nodes <= kMaxNodes, "num_nodes=%d must be in [2, %d]", ctx.num_nodes,
              kMaxNodes);
  UCCL_ASSERT(a.layout.num_topk <= gpu::kWarpSize, "num_topk=%d exceeds the warp width", a.layout.num_topk);
  UCCL_ASSERT(a.num_experts % ctx.num_nodes == 0, "num_experts=%d must be a multiple of the %d nodes", a.num_experts,
              ctx.num_nodes);
  if (a.num_tokens == 0) return;
  const int warps = kThreads / gpu::kWarpSize;
  rdma_pack_kernel<<<grid_for(a.num_tokens, warps), kThreads, 0, static_cast<gpu::Stream>(stream)>>>(ctx, a);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_rdma_post(const RdmaContext& ctx, const PostArgs& a, void* stream) {
  UCCL_ASSERT(a.num_arrays >= 0 && a.num_arrays <= 6, "num_arrays=%d", a.num_arrays);
  for (int i = 0; i < a.num_arrays; ++i)
    UCCL_ASSERT(a.arrays[i].row_bytes % 4 == 0 && a.arrays[i].src_off % 4 == 0 && a.arrays[i].dst_off % 4 == 0,
                "post array %d is not 4-byte aligned (the command carries offsets in 4-byte units)", i);
  rdma_post_kernel<<<1, kMaxNodes * kStripes, 0, static_cast<gpu::Stream>(stream)>>>(ctx, a);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_rdma_notify(const RdmaContext& ctx, int64_t offset, int row_bytes, void* stream) {
  UCCL_ASSERT(row_bytes > 0 && row_bytes % 4 == 0 && offset % 4 == 0, "notify rows of %d bytes at %lld", row_bytes,
              static_cast<long long>(offset));
  UCCL_ASSERT(offset >= ctx.num_rdma_bytes - kNotifyReserveBytes &&
                  offset + static_cast<int64_t>(ctx.num_ranks) * row_bytes <= ctx.num_rdma_bytes,
              "notify rows (%d ranks x %d bytes at %lld) leave the notify region of the RDMA buffer", ctx.num_ranks,
              row_bytes, static_cast<long long>(offset));
  rdma_notify_kernel<<<1, 256, 0, static_cast<gpu::Stream>(stream)>>>(ctx, offset, row_bytes);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_rdma_wait(const RdmaContext& ctx, int slot, void* stream) {
  UCCL_ASSERT(slot >= 0 && slot < kNumSlots, "slot=%d", slot);
  rdma_wait_kernel<<<1, kMaxNodes, 0, static_cast<gpu::Stream>(stream)>>>(ctx, slot);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_rail_barrier(const RdmaContext& ctx, void* stream) {
  rail_barrier_kernel<<<1, gpu::kWarpSize, 0, static_cast<gpu::Stream>(stream)>>>(ctx);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_combine_reduce(const ReduceArgs& a, void* stream) {
  UCCL_ASSERT(a.num_topk <= gpu::kWarpSize, "num_topk=%d exceeds the warp width", a.num_topk);
  if (a.num_tokens == 0) return;
  const int warps = kThreads / gpu::kWarpSize;
  combine_reduce_kernel<<<grid_for(a.num_tokens, warps), kThreads, 0, static_cast<gpu::Stream>(stream)>>>(a);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

}  // namespace uccl_moe::internode
