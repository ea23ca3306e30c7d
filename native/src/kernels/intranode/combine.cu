// combine_intranode_kernel: sends every received row back to the rank it came from and sums the copies of
// each token there in float32, in rank order 0..N-1 (bitwise deterministic), plus optional biases and the
// top-k weights. Grid = 2 * C blocks like dispatch and the same lanes (from the dispatch handle), split between
// the roles by CombineSplit (intranode.hpp; S sender and R receiver blocks, S + R = 2 * C):
//   a sender warp serves one remote pair (lane l, dst): the rows of lane l received from dst, pushed in order
//     into ring (lane, me) at dst (they are contiguous in x: recv_lane_start / rank_prefix_matrix say where);
//     the rows this rank received from itself are not pushed: its receiver reads them from x in place;
//   a receiver block serves a run of lanes with G warps per lane, each owning a 1/G slice of the hidden columns;
//     they walk the lane's tokens in order; send_head[t][r] is the slot position of token t's copy in ring
//     (lane, r).
// Heads: each receiver warp records how far it consumed each ring in shared memory; the minimum over the G
// warps of a lane is handed to the sender as a system-scope atomic add of the growth the publishing warp
// claimed in shared memory (so the head only moves forward whatever order the adds land in). A warp publishes
// before it blocks and every kPublishEvery tokens, so a sender can never wait on slots that were consumed but
// not handed back. Counters are relative to the round's bases (nvl_layout.hpp).
#include "combine_sum.cuh"
#include "phase_trace.cuh"
#include "uccl_moe/env.hpp"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

namespace {

constexpr int kSendUnroll = 8;
constexpr int kPublishEvery = 4;  // tokens between two head publications of a receiver warp

struct CombineKernelArgs {
  CombineArgs a;
  SlotLayout slot;     // row = hidden bf16; weights at off_weights
  CombineSplit split;  // which block serves which lane
};

UCCL_DEVICE_INLINE void combine_send(const NvlContext& ctx, const Geometry& g, const CombineKernelArgs& k,
                                     int lane_idx, int dst) {
  const CombineArgs& a = k.a;
  const SlotLayout& s = k.slot;
  const int N = ctx.num_ranks, me = ctx.rank, L = g.num_lanes, lane = gpu::lane_id();
  char* ring = lane_ring_of(ctx.buffers[dst], g, N, lane_idx, me);
  RingSender out(ctx, lane_idx, dst);
  // Rows we received from dst in this lane: contiguous in x.
  const int dst_begin = dst == 0 ? 0 : a.rank_prefix[(dst - 1) * N + me];
  const int dst_end = a.rank_prefix[dst * N + me];
  const int start = a.recv_lane_start[dst * L + lane_idx];
  const int next = lane_idx + 1 < L ? a.recv_lane_start[dst * L + lane_idx + 1] : dst_end - dst_begin;
  const int count = next - start;
  const int64_t row0 = dst_begin + start;
  for (int pos = 0; pos < count; ++pos) {
    UCCL_MOE_TRACE(const long long t_room = trace::now());
    if (!out.make_room(ctx, g, pos, DiagPhase::kCombineSendRoom, dst, lane_idx)) return;
    UCCL_MOE_TRACE(trace::add(trace::kWait, t_room); const long long t_copy = trace::now());
    char* slot = ring + static_cast<size_t>(pos % g.lane_slots) * s.bytes;
    const int64_t row = mapped_row(a, row0 + pos);
    const bool has_weight = a.topk_weights != nullptr && lane < a.num_topk;
    const float wgt = has_weight ? a.topk_weights[row * a.num_topk + lane] : 0.0f;  // loaded before the row
    warp_copy_row<kSendUnroll, false>(
        reinterpret_cast<int4*>(slot),
        reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + row * s.row_bytes), s.row_bytes / 16);
    if (has_weight) reinterpret_cast<float*>(slot + s.off_weights)[lane] = wgt;
    UCCL_MOE_TRACE(trace::add(trace::kCopy, t_copy); const long long t_pub = trace::now());
    if (pos + 1 - out.published >= g.chunk_tokens) out.publish(pos + 1);
    UCCL_MOE_TRACE(trace::add(trace::kPublish, t_pub));
  }
  UCCL_MOE_TRACE(const long long t_fin = trace::now());
  out.finish(count);
  UCCL_MOE_TRACE(trace::add(trace::kPublish, t_fin));
}

template <int kNumRanks, int kColUnroll = (kNumRanks <= 2 ? 4 : kNumRanks <= 4 ? 2 : 1)>
UCCL_DEVICE_INLINE void combine_recv(const NvlContext& ctx, const Geometry& g, const CombineKernelArgs& k,
                                     int lane_idx, int lane_local, int gw, int group, RecvSmem* sm) {
  const CombineArgs& a = k.a;
  const SlotLayout& s = k.slot;
  const int N = ctx.num_ranks, L = g.num_lanes, lane = gpu::lane_id();
  const int first_warp = lane_local * group;
  const int my_warp = first_warp + gw;
  // Lane d < N tracks ring (lane, d): its base, the tail seen, and what this warp consumed.
  const char* my_ring = lane < N ? lane_ring_of(ctx.buffers[ctx.rank], g, N, lane_idx, lane) : nullptr;
  const int32_t* my_tail = meta_ptr(ctx.buffers[ctx.rank], kOffTail) + lane_idx * N + (lane < N ? lane : 0);
  const int32_t my_base = lane < N ? *recv_base_word(ctx, lane_idx, lane) : 0;
  // Our own copies never went through a ring: lane `me` finds them in x (rows row0_self + p, as the sender of a
  // remote copy would have read them).
  const int me = ctx.rank;
  int32_t tail_seen = 0;
  const int num_16 = s.row_bytes / 16;
  const int per_warp = (num_16 + group - 1) / group;
  const int col_begin = min(num_16, gw * per_warp), col_end = min(num_16, col_begin + per_warp);
  int begin, end;
  lane_token_range(tokens_of(a), L, lane_idx, &begin, &end);
  const int4* bias0 = static_cast<const int4*>(a.bias0);
  const int4* bias1 = static_cast<const int4*>(a.bias1);
  int since_publish = 0;
  // send_head of the next token is loaded one token ahead (its latency hides behind this token's sum).
  int32_t p_next = (lane < N && begin < end) ? a.send_head[static_cast<int64_t>(begin) * N + lane] : -1;
  // Every copy of token t + 2 (this warp's columns) is prefetched into L2 at the end of token t, so the loads of
  // the sum find L2 instead of HBM: lane d < N loads its send_head two tokens ahead. The sum is latency-bound (80
  // registers per thread cap the loads in flight), so shorter loads are faster sums (docs/benchmarks.md). Only
  // here: prefetching our own copies alone, or in the dispatch receiver, did not pay.
  const bool prefetch = a.row_map == nullptr && lane < N;
  const int64_t own_row0 = prefetch && lane == me ? self_row0(a, N, me, L, lane_idx) : 0;
  for (int t = begin; t < end; ++t) {
    const int32_t p = p_next;
    if (lane < N && t + 1 < end) p_next = a.send_head[static_cast<int64_t>(t + 1) * N + lane];
    const int32_t p_ahead = prefetch && t + 2 < end ? a.send_head[static_cast<int64_t>(t + 2) * N + lane] : -1;
    // Wait until every rank holding a copy has published it.
    bool need = lane != me && p >= 0 && tail_seen <= p;
    UCCL_MOE_TRACE(const long long t_wait = trace::now());
    if (gpu::ballot(need) != 0) {
      publish_heads(ctx, sm, first_warp, group, lane_idx);
      since_publish = 0;
      DiagDeviceHandle diag = diag_of(ctx);
      BoundedWait wait(diag);
      while (true) {
        if (need) {
          tail_seen = ring_diff(gpu::load_acquire_sys(my_tail), my_base);  // released by rank `lane`'s sender
          need = tail_seen <= p;
        }
        const gpu::LaneMask waiting = gpu::ballot(need);
        if (waiting == 0) break;
        const int expired = gpu::shfl(wait.expired() ? 1 : 0, 0);
        if (expired) {
          const int who = gpu::lowest_bit(waiting);
          const int32_t want = gpu::shfl(p, who) + 1, seen = gpu::shfl(tail_seen, who);
          if (lane == 0)
            report_timeout(diag, DiagPhase::kCombineRecvTokens, DiagRole::kReceiver, who, lane_idx, want, seen, t,
                           wait.waited_s());
          return;
        }
      }
    }
    UCCL_MOE_TRACE(trace::add(trace::kWait, t_wait); const long long t_sum = trace::now());
    // Sum the copies in rank order 0..N-1 (fixed, so the result does not depend on arrival order).
    int64_t self_row = 0;
    const char* slot_ptr = nullptr;
    if (lane == me && p >= 0) {
      const int64_t r = self_row0(a, N, me, L, lane_idx) + p;  // L1-resident loads, not kept in registers
      self_row = mapped_row(a, r);
      slot_ptr = static_cast<const char*>(a.x) + self_row * s.row_bytes;
    } else if (lane < N && p >= 0) {
      slot_ptr = my_ring + static_cast<size_t>(p % g.lane_slots) * s.bytes;
    }
    const gpu::LaneMask have = gpu::ballot(lane < N && p >= 0);  // uniform
    sum_token_copies<kNumRanks, kColUnroll>(slot_ptr, have, -1, col_begin, col_end, bias0, bias1, t, num_16,
                                            static_cast<int4*>(a.out));
    UCCL_MOE_TRACE(trace::add(trace::kCopy, t_sum); const long long t_meta = trace::now());
    if (gw == 0 && a.out_topk_weights != nullptr) {
      float sum = 0.0f;
      const int64_t own = gpu::shfl(self_row, me);
      for (int d = 0; d < N; ++d) {
        const char* src = reinterpret_cast<const char*>(gpu::shfl(reinterpret_cast<unsigned long long>(slot_ptr), d));
        if (((have >> d) & 1) && lane < a.num_topk)
          sum += d == me ? (a.topk_weights != nullptr ? a.topk_weights[own * a.num_topk + lane] : 0.0f)
                         : __int_as_float(gpu::load_ring_32(reinterpret_cast<const int32_t*>(src + s.off_weights) + lane));
      }
      if (lane < a.num_topk) a.out_topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] = sum;
    }
    UCCL_MOE_TRACE(trace::add(trace::kMeta, t_meta); const long long t_pub = trace::now());
    if (p_ahead >= 0 && col_end > col_begin)
      gpu::prefetch_l2((lane == me ? static_cast<const char*>(a.x) + (own_row0 + p_ahead) * s.row_bytes
                                   : my_ring + static_cast<size_t>(p_ahead % g.lane_slots) * s.bytes) + col_begin * 16,
                       static_cast<uint32_t>(col_end - col_begin) * 16);
    gpu::sync_warp();  // the copies were summed and stored: the relaxed hand-back relies on it (see dispatch.cu)
    if (lane < N && lane != me && p >= 0) sm->set_consumed(my_warp, lane, p + 1);
    if (++since_publish >= kPublishEvery) {
      publish_heads(ctx, sm, first_warp, group, lane_idx);
      since_publish = 0;
    }
    UCCL_MOE_TRACE(trace::add(trace::kPublish, t_pub));
  }
  publish_heads(ctx, sm, first_warp, group, lane_idx);
}

template <int kNumRanks>
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    combine_intranode_kernel(NvlContext ctx, Geometry g, CombineKernelArgs k) {
  UCCL_MOE_TRACE(const long long t0 = trace::now(); const unsigned long long t0_ns = gpu::global_timer_ns();
                 trace::begin());
  __shared__ RecvSmem sm;
  const CombineSplit& sp = k.split;
  const int b = blockIdx.x, warp = gpu::warp_id();
  if (b < sp.senders) {
    const int pair = sp.pair_of(b, warp);  // own rows are not pushed: their receiver reads them in place
    if (pair < sp.num_pairs()) combine_send(ctx, g, k, sp.pair_lane(pair), sp.pair_dst(pair, ctx.rank));
    UCCL_MOE_TRACE(trace::finish(pair < sp.num_pairs() ? trace::kSendRemote : trace::kRoles, t0, t0_ns, "combine",
                                 ctx.rank, k.slot.row_bytes));
    return;
  }
  const int r = b - sp.senders;
  const int lane0 = sp.first_lane(r), lanes = sp.lanes_of(r), group = sp.group(r, kWarpsPerBlock);
  sm.reset();
  const int lane_local = warp / group, gw = warp % group;
  if (lane_local < lanes) combine_recv<kNumRanks>(ctx, g, k, lane0 + lane_local, lane_local, gw, group, &sm);
  sm.finish(ctx, lane0, lanes, group);
  UCCL_MOE_TRACE(trace::finish(lane_local < lanes ? trace::kRecv : trace::kRoles, t0, t0_ns, "combine", ctx.rank,
                               k.slot.row_bytes));
}

}  // namespace

void launch_combine_intranode(const NvlContext& ctx, const Geometry& g, const CombineArgs& a, void* stream) {
  UCCL_ASSERT(a.hidden > 0 && (a.hidden * 2) % 16 == 0, "combine hidden=%d: hidden * 2 bytes must be a multiple of 16",
              a.hidden);
  UCCL_ASSERT(a.num_topk <= kMaxTopk && a.num_topk <= gpu::kWarpSize, "num_topk=%d exceeds %d", a.num_topk, kMaxTopk);
  check_geometry(ctx, g, "combine");
  CombineKernelArgs k{a, SlotLayout::make(a.hidden * 2, a.num_topk, 0),
                      combine_split(g, ctx.num_ranks, static_cast<int>(env::COMBINE_SENDER_SMS()))};
  UCCL_ASSERT(g.lane_region_bytes >= static_cast<int64_t>(g.lane_slots) * k.slot.bytes,
              "lane ring of %lld bytes cannot hold %d slots of %d bytes", static_cast<long long>(g.lane_region_bytes),
              g.lane_slots, k.slot.bytes);
  const int64_t need = required_nvl_bytes(g, ctx.num_ranks, k.slot);
  UCCL_ASSERT(need <= ctx.num_nvl_bytes,
              "combine needs %lld NVL bytes but the Buffer has %lld: create it with num_nvl_bytes >= "
              "Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)",
              static_cast<long long>(need), static_cast<long long>(ctx.num_nvl_bytes));
  const dim3 grid(2 * g.num_channels), block(kThreadsPerBlock);
  const gpu::Stream st = static_cast<gpu::Stream>(stream);
  // One instantiation per local rank count (the per-rank copies of a column live in registers).
  with_num_ranks(ctx.num_ranks, "combine", [&](auto n) {
    combine_intranode_kernel<decltype(n)::value><<<grid, block, 0, st>>>(ctx, g, k);
  });
  UCCL_CHECK_GPU(gpu::get_last_error());
}

}  // namespace uccl_moe::intranode
