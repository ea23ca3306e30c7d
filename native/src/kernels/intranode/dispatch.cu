// dispatch_intranode_kernel: moves token rows (BF16 or FP8 + scales) and their top-k metadata to the ranks
// that hold their experts. Grid = 2 * C blocks: block c < C is channel c's sender, block C + c its receiver.
// Sender warp (dst, w) walks lane l = c * W + w of our tokens and pushes the ones bound for dst into ring
// (lane, me) at dst; the receiver block's warps, a group per lane, copy ring (lane, src) of every remote src out
// into recv_x in order, each warp a slice of the columns. Rows a rank keeps (dst == me) skip the ring and go
// straight into the outputs: the first quarter (FP8-sized rows: three eighths; kept_split) of each lane's tokens by
// the sender's direct warp, which also releases the lane's tails (TailPublisher), the rest by the receiver group,
// which copies them while its rings are empty. An SM copies about as many bytes per second to local as to peer memory
// (native/bench/probes/nvlink_probe.cu), so this balances the sender SMs (peer rows + kept rows) against the receiver SMs
// (ring rows).
// See nvl_layout.hpp for the rings and the head/tail protocol.
#include "handshake.cuh"
#include "intranode_device.cuh"
#include "phase_trace.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

namespace {

constexpr int kSendUnroll = 8;  // 16-B words per lane in flight when copying a row we keep (4 KB per warp)
constexpr int kRecvUnroll = 8;  // 16-B words per lane in flight when copying a slot out (local)

/// The tokens of [chunk, chunk + warp width) below `end` that go to rank `dst`, as a lane mask. With `record`, also
/// stores each token's position in the lane's stream to dst (from `pos` on; -1 if not sent) in send_head.
UCCL_DEVICE_INLINE gpu::LaneMask select_tokens(const DispatchArgs& a, int N, int dst, int chunk, int end, int pos,
                                               bool record) {
  const int t = chunk + gpu::lane_id();
  const bool selected = t < end && a.is_token_in_rank[static_cast<int64_t>(t) * N + dst];
  const gpu::LaneMask mask = gpu::ballot(selected);
  if (record && a.send_head != nullptr && t < end)
    a.send_head[static_cast<int64_t>(t) * N + dst] = selected ? pos + gpu::popcount(mask & gpu::lanemask_lt()) : -1;
  return mask;
}

struct DispatchKernelArgs {
  DispatchArgs a;
  SlotLayout slot;
};

/// Writes token `tok`'s metadata for destination rank `owner` (whose experts become local ids 0..E/N-1, others
/// -1 with weight 0) where the pointers say: a ring slot (IdT = int32) or the output rows (IdT = int64). A null
/// pointer skips its field. Warp-collective. Every field's loads (the first two scales of each lane) are issued
/// before any store: as far as the compiler knows a store may alias the inputs, so in field order each field's
/// loads would wait for the previous field's stores, one memory round trip apiece (column-major scales: two more).
template <typename IdT>
UCCL_DEVICE_INLINE void write_token_meta(const DispatchArgs& a, int tok, int owner, int experts_per_rank,
                                         int32_t* src_idx, IdT* topk_idx, float* weights, int32_t* scales) {
  const int lane = gpu::lane_id(), K = a.num_topk, S = a.num_scales;
  const int64_t t = tok;
  const bool ids = a.topk_idx != nullptr && topk_idx != nullptr && lane < K;
  const bool with_scales = a.x_scales != nullptr && scales != nullptr;
  const int64_t e = ids ? a.topk_idx[t * K + lane] : -1;
  const float w = ids && weights != nullptr && a.topk_weights != nullptr ? a.topk_weights[t * K + lane] : 0.0f;
  const int32_t s0 = with_scales && lane < S ? scale_at(a, tok, lane) : 0;
  const int32_t s1 = with_scales && lane + gpu::kWarpSize < S ? scale_at(a, tok, lane + gpu::kWarpSize) : 0;
  const int32_t src = src_idx != nullptr && lane == 0 && a.src_tag != nullptr ? a.src_tag[tok] : tok;
  if (src_idx != nullptr && lane == 0) *src_idx = src;
  if (ids) {
    const int64_t local_e = e - static_cast<int64_t>(owner) * experts_per_rank;
    const bool mine = e >= 0 && local_e >= 0 && local_e < experts_per_rank;
    topk_idx[lane] = mine ? static_cast<IdT>(local_e) : IdT{-1};
    if (weights != nullptr) weights[lane] = mine ? w : 0.0f;
  }
  if (with_scales) {
    if (lane < S) scales[lane] = s0;
    if (lane + gpu::kWarpSize < S) scales[lane + gpu::kWarpSize] = s1;
    for (int j = lane + 2 * gpu::kWarpSize; j < S; j += gpu::kWarpSize) scales[j] = scale_at(a, tok, j);
  }
}

/// write_token_meta into output row `row` of a token this rank keeps (scales too if `with_scales`).
UCCL_DEVICE_INLINE void write_kept_meta(const DispatchArgs& a, int tok, int me, int experts_per_rank, int64_t row,
                                        bool with_scales) {
  write_token_meta<int64_t>(
      a, tok, me, experts_per_rank, a.recv_src_idx != nullptr ? a.recv_src_idx + row : nullptr,
      a.recv_topk_idx != nullptr ? a.recv_topk_idx + row * a.num_topk : nullptr,
      a.recv_topk_weights != nullptr ? a.recv_topk_weights + row * a.num_topk : nullptr,
      with_scales && a.recv_scales != nullptr ? static_cast<int32_t*>(a.recv_scales) + row * a.num_scales : nullptr);
}

/// num_worst_tokens: output rows past the ones rank `me` received carry source -1, expert ids -1 and weight 0 (as
/// DeepEP gives them). This thread writes rows received + first, + stride, ...; a null output is skipped.
UCCL_DEVICE_INLINE void pad_worst_rows(const DispatchArgs& a, int N, int me, int64_t first, int64_t stride) {
  if (a.recv_src_idx == nullptr) return;
  const int64_t received = a.rank_prefix[(N - 1) * N + me];
  const int K = a.recv_topk_idx != nullptr ? a.num_topk : 0;
  for (int64_t row = received + first; row < a.num_recv_rows; row += stride) {
    a.recv_src_idx[row] = -1;
    for (int j = 0; j < K; ++j) {
      a.recv_topk_idx[row * K + j] = -1;
      if (a.recv_topk_weights != nullptr) a.recv_topk_weights[row * K + j] = 0.0f;
    }
  }
}

/// Walks the tokens of [begin, end) that go to `dst`, in order, recording send_head, and calls row(tok, pos) for
/// each (pos: its place in the lane's stream to dst). Returns how many there were, or -1 once row returned false
/// (a failed wait). Warp-collective.
template <typename RowFn>
UCCL_DEVICE_INLINE int for_each_sent_token(const DispatchArgs& a, int N, int dst, int begin, int end, RowFn&& row) {
  int pos = 0;
  for (int chunk = begin; chunk < end; chunk += gpu::kWarpSize) {
    UCCL_MOE_TRACE(const long long t_sel = trace::now());
    gpu::LaneMask mask = select_tokens(a, N, dst, chunk, end, pos, true);
    UCCL_MOE_TRACE(trace::add(trace::kSelect, t_sel));
    while (mask != 0) {
      const int tok = chunk + gpu::lowest_bit(mask);
      mask &= mask - 1;
      if (!row(tok, pos)) return -1;
      ++pos;
    }
  }
  return pos;
}

/// Sender warp (me, w) of lane c * W + w, the lane's direct warp: the rows stay on this GPU, so they go straight into
/// the outputs (recv_x and the metadata, in the receiver's format) instead of through our own ring and a second
/// copy. It takes the first share of the lane's tokens (kept_split), the receiver group the rest (KeptRows), and
/// releases the tails the lane's remote warps post (TailPublisher) between its rows and after them.
UCCL_DEVICE_INLINE void dispatch_send_direct(const NvlContext& ctx, const Geometry& g, const DispatchKernelArgs& k,
                                             int c, int w, SendPosts* posts) {
  const DispatchArgs& a = k.a;
  const int64_t row_bytes = k.slot.row_bytes;
  const int N = ctx.num_ranks, me = ctx.rank;
  const int lane_idx = c * g.lanes_per_channel + w;
  TailPublisher pub(ctx, posts, g.lanes_per_channel, w, lane_idx);
  const int64_t row0 = self_row0(a, N, me, g.num_lanes, lane_idx);
  const int experts_per_rank = a.num_experts / N;
  int begin, end;
  lane_token_range(tokens_of(a), g.num_lanes, lane_idx, &begin, &end);
  for_each_sent_token(a, N, me, begin, kept_split(begin, end, a.row_bytes), [&](int tok, int pos) {
    const int64_t row = mapped_row(a, row0 + pos);
    UCCL_MOE_TRACE(const long long t_copy = trace::now());
    warp_copy_row<kSendUnroll, false>(reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * row_bytes),
                                      reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + tok * row_bytes),
                                      row_bytes / 16);
    UCCL_MOE_TRACE(trace::add(trace::kCopy, t_copy); const long long t_meta = trace::now());
    write_kept_meta(a, tok, me, experts_per_rank, row, true);
    UCCL_MOE_TRACE(trace::add(trace::kMeta, t_meta); const long long t_pub = trace::now());
    pub.poll();  // release what the lane's remote warps posted meanwhile
    UCCL_MOE_TRACE(trace::add(trace::kPublish, t_pub));
    return true;
  });
  UCCL_MOE_TRACE(const long long t_drain = trace::now());
  pub.drain(ctx, lane_idx);
  UCCL_MOE_TRACE(trace::add(trace::kWait, t_drain));
}

/// Sender warp (dst, w) of lane c * W + w, dst != me: the rows go into ring (lane, me) at dst; the warp posts its
/// positions for the lane's direct warp to release (RingSender::post_to).
UCCL_DEVICE_INLINE void dispatch_send_remote(const NvlContext& ctx, const Geometry& g, const DispatchKernelArgs& k,
                                             int c, int dst, int w, SendPosts* posts) {
  const DispatchArgs& a = k.a;
  const SlotLayout& s = k.slot;
  const int N = ctx.num_ranks, me = ctx.rank;
  const int lane_idx = c * g.lanes_per_channel + w;
  char* ring = lane_ring(ctx.buffers[dst], g, N, c, me, w);
  RingSender out(ctx, lane_idx, dst);
  out.post_to(posts, dst * g.lanes_per_channel + w);
  const int experts_per_rank = a.num_experts / N;
  int begin, end;
  lane_token_range(tokens_of(a), g.num_lanes, lane_idx, &begin, &end);
  const int count = for_each_sent_token(a, N, dst, begin, end, [&](int tok, int pos) {
    UCCL_MOE_TRACE(const long long t_room = trace::now());
    if (!out.make_room(ctx, g, pos, DiagPhase::kDispatchSendRoom, dst, lane_idx)) return false;
    UCCL_MOE_TRACE(trace::add(trace::kWait, t_room); const long long t_copy = trace::now());
    char* slot = ring + static_cast<size_t>(pos % g.lane_slots) * s.bytes;
    warp_copy_row<kSendUnroll, false>(reinterpret_cast<int4*>(slot),
                                      reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + static_cast<int64_t>(tok) * s.row_bytes),
                                      s.row_bytes / 16);
    UCCL_MOE_TRACE(trace::add(trace::kCopy, t_copy); const long long t_meta = trace::now());
    write_token_meta<int32_t>(a, tok, dst, experts_per_rank, reinterpret_cast<int32_t*>(slot + s.off_src_idx),
                              reinterpret_cast<int32_t*>(slot + s.off_topk_idx),
                              reinterpret_cast<float*>(slot + s.off_weights),
                              reinterpret_cast<int32_t*>(slot + s.off_scales));
    UCCL_MOE_TRACE(trace::add(trace::kMeta, t_meta); const long long t_pub = trace::now());
    if (pos + 1 - out.published >= g.chunk_tokens) out.publish(pos + 1);
    UCCL_MOE_TRACE(trace::add(trace::kPublish, t_pub));
    return true;
  });
  if (count < 0)
    out.mark_finished();  // the publisher stops waiting for us; our wait's record names the peer
  else
    out.finish(count);
}

/// Receiver group's share of the rows this rank keeps: tokens [kept_split(begin, end), end) of the lane, walked in
/// order by every warp of the group (each copies its column slice; the first warp also writes the metadata and
/// send_head), one row per step() so that the receive loop can fill its waits with them. Warp-collective.
struct KeptRows {
  int chunk, end, pos = 0;      // next 32-token chunk, end of the range, output position of the next kept row
  gpu::LaneMask mask = 0;       // kept tokens of the current chunk not yet copied
  int64_t row0;

  UCCL_DEVICE_INLINE KeptRows(const DispatchArgs& a, const Geometry& g, int N, int me, int lane_idx) {
    int begin;
    lane_token_range(tokens_of(a), g.num_lanes, lane_idx, &begin, &end);
    chunk = kept_split(begin, end, a.row_bytes);
    row0 = self_row0(a, N, me, g.num_lanes, lane_idx);
    for (int t0 = begin; t0 < chunk; t0 += gpu::kWarpSize)  // the sender's direct warp keeps these
      pos += gpu::popcount(select_tokens(a, N, me, t0, chunk, 0, false));
  }
  UCCL_DEVICE_INLINE bool done() const { return mask == 0 && chunk >= end; }

  /// Copies the next kept row (nothing once done()).
  UCCL_DEVICE_INLINE void step(const DispatchArgs& a, const SlotLayout& s, int N, int me, int gw, int group,
                               int col_begin, int col_end) {
    while (mask == 0 && chunk < end) {
      mask = select_tokens(a, N, me, chunk, end, pos, gw == 0);
      chunk += gpu::kWarpSize;
    }
    if (mask == 0) return;
    const int tok = chunk - gpu::kWarpSize + gpu::lowest_bit(mask);
    mask &= mask - 1;
    const int64_t row = mapped_row(a, row0 + pos);
    ++pos;
    const char* src_row = static_cast<const char*>(a.x) + static_cast<int64_t>(tok) * s.row_bytes;
    warp_copy_cols<kRecvUnroll, false>(reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * s.row_bytes),
                                       reinterpret_cast<const int4*>(src_row), col_begin, col_end);
    if (gw == 0) write_kept_meta(a, tok, me, a.num_experts / N, row, false);  // scales: below, split
    if (a.recv_scales != nullptr)  // scales: split over the group's warps
      for (int j = gw * gpu::kWarpSize + gpu::lane_id(); j < a.num_scales; j += group * gpu::kWarpSize)
        static_cast<int32_t*>(a.recv_scales)[row * a.num_scales + j] = scale_at(a, tok, j);
  }
};

/// Receiver lane `lane_local` of channel c, served by `group` warps (>= N): every warp copies its slice of the
/// columns of every row from every remote source's ring (lane, src), so the warps that a per-source split would
/// leave idle (our own rows never enter a ring) add loads in flight. Lane d < N of each warp tracks source d.
UCCL_DEVICE_INLINE void dispatch_recv(const NvlContext& ctx, const Geometry& g, const DispatchKernelArgs& k, int c,
                                      int lane_local, int gw, int group, RecvSmem* sm) {
  const DispatchArgs& a = k.a;
  const SlotLayout& s = k.slot;
  const int N = ctx.num_ranks, me = ctx.rank, L = g.num_lanes, lane = gpu::lane_id();
  const int lane_idx = c * g.lanes_per_channel + lane_local;
  const int first_warp = lane_local * group, my_warp = first_warp + gw;
  const bool remote = lane < N && lane != me;
  const int32_t* tail = meta_ptr(ctx.buffers[me], kOffTail) + lane_idx * N + (lane < N ? lane : 0);
  int32_t base = 0, count = 0, done = 0;
  int64_t row0 = 0;
  if (remote) {
    base = *recv_base_word(ctx, lane_idx, lane);
    const int src_begin = lane == 0 ? 0 : a.rank_prefix[(lane - 1) * N + me];
    const int src_end = a.rank_prefix[lane * N + me];
    const int start = a.recv_lane_start[lane * L + lane_idx];
    const int next = lane_idx + 1 < L ? a.recv_lane_start[lane * L + lane_idx + 1] : src_end - src_begin;
    count = next - start;
    row0 = src_begin + start;
  }
  const int num_16 = s.row_bytes / 16;
  const int per_warp = (num_16 + group - 1) / group;
  const int col_begin = min(num_16, gw * per_warp), col_end = min(num_16, col_begin + per_warp);
  KeptRows kept(a, g, N, me, lane_idx);
  while (true) {
    UCCL_MOE_TRACE(const long long t_poll = trace::now());
    const bool pending = remote && done < count;
    if (gpu::ballot(pending) == 0) break;
    int32_t avail = pending ? min(count, ring_diff(gpu::load_acquire_sys(tail), base)) : done;
    gpu::LaneMask ready = gpu::ballot(avail > done);
    UCCL_MOE_TRACE(trace::add(trace::kWait, t_poll));
    if (ready == 0 && !kept.done()) {  // nothing in the rings yet: copy a row we keep meanwhile
      UCCL_MOE_TRACE(const long long t_kept = trace::now());
      kept.step(a, s, N, me, gw, group, col_begin, col_end);
      UCCL_MOE_TRACE(trace::add(trace::kKept, t_kept));
      continue;
    }
    if (ready == 0) {
      UCCL_MOE_TRACE(const long long t_wait = trace::now());
      // Nothing new anywhere: hand back what we consumed (a sender may wait for it), then wait, bounded.
      publish_heads(ctx, sm, first_warp, group, lane_idx);
      DiagDeviceHandle diag = diag_of(ctx);
      BoundedWait wait(diag);
      while (gpu::ballot(pending && ring_diff(gpu::load_acquire_sys(tail), base) > done) == 0) {
        if (gpu::shfl(wait.expired() ? 1 : 0, 0)) {
          const int who = gpu::lowest_bit(gpu::ballot(pending));
          const int32_t want = gpu::shfl(done, who) + 1;
          const int32_t* who_tail = meta_ptr(ctx.buffers[me], kOffTail) + lane_idx * N + who;
          const int32_t seen = ring_diff(gpu::load_acquire_sys(who_tail), gpu::shfl(base, who));
          if (lane == 0)
            report_timeout(diag, DiagPhase::kDispatchRecvTokens, DiagRole::kReceiver, who, lane_idx, want, seen, 0,
                           wait.waited_s());
          return;
        }
      }
      UCCL_MOE_TRACE(trace::add(trace::kWait, t_wait));
      continue;
    }
    while (ready != 0) {
      const int src = gpu::lowest_bit(ready);
      ready &= ready - 1;
      const char* ring = lane_ring(ctx.buffers[me], g, N, c, src, lane_local);
      const int from = gpu::shfl(done, src), to = gpu::shfl(avail, src);
      const int64_t r0 = gpu::shfl(row0, src);
      for (int j = from; j < to; ++j) {
        const char* slot = ring + static_cast<size_t>(j % g.lane_slots) * s.bytes;
        const int64_t row = mapped_row(a, r0 + j);
        UCCL_MOE_TRACE(const long long t_copy = trace::now());
        warp_copy_cols<kRecvUnroll, true>(reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * s.row_bytes),
                                          reinterpret_cast<const int4*>(slot), col_begin, col_end);
        UCCL_MOE_TRACE(trace::add(trace::kCopy, t_copy); const long long t_meta = trace::now());
        if (gw == 0) {  // metadata: the group's first warp
          if (a.recv_src_idx != nullptr && lane == 0)
            a.recv_src_idx[row] = gpu::load_ring_32(reinterpret_cast<const int32_t*>(slot + s.off_src_idx));
          if (a.recv_topk_idx != nullptr && lane < a.num_topk) {
            const int32_t e = gpu::load_ring_32(reinterpret_cast<const int32_t*>(slot + s.off_topk_idx) + lane);
            a.recv_topk_idx[row * a.num_topk + lane] = e;
            if (a.recv_topk_weights != nullptr)
              a.recv_topk_weights[row * a.num_topk + lane] =
                  __int_as_float(gpu::load_ring_32(reinterpret_cast<const int32_t*>(slot + s.off_weights) + lane));
          }
        }
        if (a.recv_scales != nullptr)  // scales: split over the group's warps
          for (int j2 = gw * gpu::kWarpSize + lane; j2 < a.num_scales; j2 += group * gpu::kWarpSize)
            static_cast<int32_t*>(a.recv_scales)[row * a.num_scales + j2] =
                gpu::load_ring_32(reinterpret_cast<const int32_t*>(slot + s.off_scales) + j2);
        UCCL_MOE_TRACE(trace::add(trace::kMeta, t_meta));
      }
    }
    UCCL_MOE_TRACE(const long long t_pub = trace::now());
    done = avail;
    // Every slot word read above was already stored to an output: the relaxed hand-back relies on it (a value
    // loaded but not yet used could still be in flight when the sender overwrites the slot).
    gpu::sync_warp();
    if (remote) sm->set_consumed(my_warp, lane, done);
    publish_heads(ctx, sm, first_warp, group, lane_idx);
    UCCL_MOE_TRACE(trace::add(trace::kPublish, t_pub));
  }
  publish_heads(ctx, sm, first_warp, group, lane_idx);
  UCCL_MOE_TRACE(const long long t_kept = trace::now());
  while (!kept.done()) kept.step(a, s, N, me, gw, group, col_begin, col_end);
  UCCL_MOE_TRACE(trace::add(trace::kKept, t_kept));
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    dispatch_intranode_kernel(NvlContext ctx, Geometry g, DispatchKernelArgs k) {
  UCCL_MOE_TRACE(const long long t0 = trace::now(); const unsigned long long t0_ns = gpu::global_timer_ns();
                 trace::begin());
  const int C = g.num_channels, W = g.lanes_per_channel;
  const bool sender = static_cast<int>(blockIdx.x) < C;
  const int c = sender ? blockIdx.x : blockIdx.x - C;
  if (!sender)  // num_worst_tokens' padding rows, over the receiver blocks
    pad_worst_rows(k.a, ctx.num_ranks, ctx.rank, static_cast<int64_t>(c) * blockDim.x + threadIdx.x,
                   static_cast<int64_t>(C) * blockDim.x);
  const int warp = gpu::warp_id();
  if (sender) {
    __shared__ SendPosts posts;
    posts.reset();
    const int peer = warp / W, w = warp % W;
    if (peer >= ctx.num_ranks) {  // spare warps when the ranks do not divide the warps
      UCCL_MOE_TRACE(trace::finish(trace::kRoles, t0, t0_ns, "dispatch", ctx.rank, k.a.row_bytes));
      return;
    }
    if (peer == ctx.rank)
      dispatch_send_direct(ctx, g, k, c, w, &posts);  // our own rows, and the lane's tails
    else
      dispatch_send_remote(ctx, g, k, c, peer, w, &posts);
    UCCL_MOE_TRACE(trace::finish(peer == ctx.rank ? trace::kSendDirect : trace::kSendRemote, t0, t0_ns, "dispatch",
                                 ctx.rank, k.a.row_bytes));
    return;
  }
  __shared__ RecvSmem sm;
  sm.reset();
  const int group = kWarpsPerBlock / W;  // warps per lane (>= N)
  const int lane_local = warp / group, gw = warp % group;
  if (lane_local < W) dispatch_recv(ctx, g, k, c, lane_local, gw, group, &sm);
  sm.finish(ctx, c * W, W, group);
  UCCL_MOE_TRACE(trace::finish(lane_local < W ? trace::kRecv : trace::kRoles, t0, t0_ns, "dispatch", ctx.rank,
                               k.a.row_bytes));
}

// ---- The ring-free dispatch (launch_dispatch_direct) --------------------------------------------------------------
// Every row goes straight to where it ends up: rows this rank keeps into the outputs, the others into the receiver's
// landing area (DirectLanding: compacted, our rows at d from our_rows_at, our lane's inside them from lane_prefix, the
// token at its place in the lane's stream), with their metadata in the receiver's format. Three hand-shakes, no
// per-chunk ones: enter (a rank writes into a peer's buffer only once the peer began this launch, so its earlier ops
// are done with that memory), landed (every rank's rows are in; then each rank unpacks its landing area into its
// outputs) and done (nobody reads a landing area any more; the next op may write it). Two kernels: the push on the
// op's num_sms blocks, then the unpack, an HBM-bound copy, on the whole GPU (as a staged combine's stage).

/// Rank d's landing area, as pointers.
struct LandingAt {
  char* rows;
  int32_t* src;
  int32_t* topk;
  float* weights;
  int32_t* scales;
  UCCL_DEVICE_INLINE LandingAt(void* buffer, const DirectLanding& l) {
    char* b = static_cast<char*>(buffer);
    rows = b + kOffCombineInput;
    src = reinterpret_cast<int32_t*>(b + l.src_off);
    topk = reinterpret_cast<int32_t*>(b + l.topk_off);
    weights = reinterpret_cast<float*>(b + l.weights_off);
    scales = reinterpret_cast<int32_t*>(b + l.scales_off);
  }
};

/// Pair (lane l, destination d), served by `group` warps: each copies its slice of the columns of every row the
/// lane sends d, in the lane's order; warp gw == 0 also writes each row's metadata and the lane's send_head column.
UCCL_DEVICE_INLINE void direct_push(const NvlContext& ctx, const Geometry& g, const DispatchArgs& a,
                                   const DirectLanding& land, int l, int d, int gw, int group) {
  const int N = ctx.num_ranks, me = ctx.rank, L = g.num_lanes, K = a.num_topk, S = a.num_scales;
  const int64_t row_bytes = a.row_bytes;
  const int num_16 = a.row_bytes / 16, per_warp = (num_16 + group - 1) / group;
  const int col_begin = min(num_16, gw * per_warp), col_end = min(num_16, col_begin + per_warp);
  const int experts_per_rank = a.num_experts / N;
  const bool self = d == me;
  const int64_t row0 = self ? self_row0(a, N, me, L, l)
                            : our_rows_at(a.rank_prefix, N, me, d, true) + (l > 0 ? a.lane_prefix[d * L + l - 1] : 0);
  const LandingAt at(ctx.buffers[d], land);
  char* out_rows = self ? static_cast<char*>(a.recv_x) : at.rows;
  int begin, end;
  lane_token_range(tokens_of(a), L, l, &begin, &end);
  int pos = 0;
  for (int chunk = begin; chunk < end; chunk += gpu::kWarpSize) {
    gpu::LaneMask mask = select_tokens(a, N, d, chunk, end, pos, gw == 0);
    while (mask != 0) {
      const int tok = chunk + gpu::lowest_bit(mask);
      mask &= mask - 1;
      const int64_t row = row0 + pos;
      if (!self && row >= land.rows) {  // never past the landing area (the host sized it: a layout bug)
        if (gw == 0 && gpu::lane_id() == 0)
          report_timeout(diag_of(ctx), DiagPhase::kDispatchDirectArgs, DiagRole::kSender, d, l, land.rows, row + 1, 0,
                         0.0);
        return;  // the op failed (the abort flag withholds landed); nothing more of this pair is written
      }
      warp_copy_cols<kSendUnroll, false>(reinterpret_cast<int4*>(out_rows + row * row_bytes),
                                         reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + tok * row_bytes),
                                         col_begin, col_end);
      if (gw == 0) {
        if (self)
          write_kept_meta(a, tok, me, experts_per_rank, row, true);
        else
          write_token_meta<int32_t>(a, tok, d, experts_per_rank, at.src + row, at.topk + row * K,
                                    at.weights + row * K, at.scales + row * S);
      }
      ++pos;
    }
  }
  gpu::fence_sys();  // this warp's stores into peers, before its block counts itself (landed)
}

/// This rank's landing area into its outputs (every thread of the grid): compacted row c is received row
/// staged_to_received(c, ...) (the rows before our own block, then those after it); rows past the received ones
/// (num_worst_tokens) get source -1, ids -1 and weight 0, as the ring dispatch gives them.
UCCL_DEVICE_INLINE void direct_unpack(const NvlContext& ctx, const DispatchArgs& a, const DirectLanding& land) {
  const int N = ctx.num_ranks, me = ctx.rank, K = a.num_topk, S = a.num_scales;
  const OwnBlock own(a.rank_prefix, N, me);
  const int64_t rows = min(buffer_rows(a.rank_prefix, N, me, true), land.rows);
  const LandingAt at(ctx.buffers[me], land);
  const int64_t words = a.row_bytes / 16, total = rows * words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int4* src = reinterpret_cast<const int4*>(at.rows);
  int4* dst = static_cast<int4*>(a.recv_x);
  for (int64_t base = tid; base < total; base += stride * kRecvUnroll) {
    int4 v[kRecvUnroll];
#pragma unroll
    for (int u = 0; u < kRecvUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < total) v[u] = gpu::load_ring_128(src + i);  // written by peers in this launch: no .nc loads
    }
#pragma unroll
    for (int u = 0; u < kRecvUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < total) gpu::store_stream_128(dst + staged_to_received(i, own.begin * words, own.count * words), v[u]);
    }
  }
  if (a.recv_src_idx != nullptr)
    for (int64_t c = tid; c < rows; c += stride)
      a.recv_src_idx[staged_to_received(c, own.begin, own.count)] = gpu::load_ring_32(at.src + c);
  if (a.recv_topk_idx != nullptr)
    for (int64_t i = tid; i < rows * K; i += stride) {
      const int64_t r = staged_to_received(i / K, own.begin, own.count) * K + i % K;
      a.recv_topk_idx[r] = gpu::load_ring_32(at.topk + i);
      if (a.recv_topk_weights != nullptr)
        a.recv_topk_weights[r] = __int_as_float(gpu::load_ring_32(reinterpret_cast<const int32_t*>(at.weights) + i));
    }
  if (a.recv_scales != nullptr)
    for (int64_t i = tid; i < rows * S; i += stride)
      static_cast<int32_t*>(a.recv_scales)[staged_to_received(i / S, own.begin, own.count) * S + i % S] =
          gpu::load_ring_32(at.scales + i);
  pad_worst_rows(a, N, me, tid, stride);
}

constexpr int kUnpackThreads = 512;

/// The push: enter, every (lane, destination) pair's rows, landed. Only the last block waits for the peers' landed
/// release, so the kernel ends once every rank's rows are in and the whole-GPU unpack kernel needs no wait (a
/// whole-GPU grid of spinning blocks could keep a peer sharing the GPU from starting its push; the num_sms blocks
/// spinning at enter need what the ring kernels need: every rank's blocks resident at once).
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    dispatch_direct_kernel(NvlContext ctx, Geometry g, DispatchArgs a, DirectLanding land) {
  __shared__ PullSmem sm;
  const int N = ctx.num_ranks;
  void* local = ctx.buffers[ctx.rank];
  const int32_t round = gpu::load_volatile(meta_ptr(local, kOffPullRound)) + 1;  // the unpack sets it
  // Enter: our earlier ops are done with our buffer (stream order), so peers may write into it from now on. A code
  // of the landing area's layout goes with it (its size in 16-byte units, mixed with the top-k and scale counts,
  // non-negative): a peer that lays it out otherwise would land rows where we do not look, so every rank checks it
  // (an InvalidUsage record, dispatch/direct-args).
  const int32_t layout = static_cast<int32_t>(((land.end >> 4) ^ (static_cast<int64_t>(a.num_topk) << 24) ^
                                               (static_cast<int64_t>(a.num_scales) << 12)) & 0x7fffffff);
  if (blockIdx.x == 0) release_to_peers(ctx, kOffDirectEnter, round, layout);
  const bool entered = wait_peers(ctx, kOffDirectEnter, round, DiagPhase::kDispatchDirectEnter, &sm, layout,
                                  DiagPhase::kDispatchDirectArgs);
  if (entered) {
    const int warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
    const int gwarp = static_cast<int>(blockIdx.x) * kWarpsPerBlock + gpu::warp_id();
    const int pairs = g.num_lanes * N;  // pair p: lane p / N, destination p % N
    if (warps >= pairs) {
      const int group = warps / pairs, p = gwarp / group;
      if (p < pairs) direct_push(ctx, g, a, land, p / N, p % N, gwarp % group, group);
    } else {
      for (int p = gwarp; p < pairs; p += warps) direct_push(ctx, g, a, land, p / N, p % N, 0, 1);
    }
  }
  // Landed: every block's rows are out (each warp fenced its own, before its block counted itself), then
  // every peer's are in. Not released after a failed wait: peers would unpack rows that never came.
  if (last_block(meta_ptr(local, kOffPullArrive), &sm)) {
    if (gpu::load_volatile(ctx.abort_flag) == 0) release_to_peers(ctx, kOffPullStart, round);
    wait_peers(ctx, kOffPullStart, round, DiagPhase::kDispatchDirectLanded, &sm);
  }
}

/// The unpack (any grid; after the push kernel, so every peer's rows are in): this rank's landing area into its
/// outputs (skipped after a failed wait), then done.
__global__ void __launch_bounds__(kUnpackThreads) dispatch_unpack_kernel(NvlContext ctx, DispatchArgs a,
                                                                         DirectLanding land) {
  __shared__ PullSmem sm;
  void* local = ctx.buffers[ctx.rank];
  const int32_t round = gpu::load_volatile(meta_ptr(local, kOffPullRound)) + 1;  // the push's round
  if (gpu::load_volatile(ctx.abort_flag) == 0) direct_unpack(ctx, a, land);
  // Done: nobody reads a landing area any more.
  if (last_block(meta_ptr(local, kOffPullLeave), &sm)) {
    release_to_peers(ctx, kOffPullDone, round);
    wait_peers(ctx, kOffPullDone, round, DiagPhase::kDispatchDirectDone, &sm);
    if (threadIdx.x == 0) *meta_ptr(local, kOffPullRound) = round;
    record_if_aborted(ctx, DiagPhase::kDispatchDirectDone);
  }
}

}  // namespace

void launch_dispatch_intranode(const NvlContext& ctx, const Geometry& g, const DispatchArgs& a, void* stream) {
  UCCL_ASSERT(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row bytes %d must be a positive multiple of 16 (hidden * "
              "element size)", a.row_bytes);
  UCCL_ASSERT(a.num_topk <= kMaxTopk, "num_topk=%d exceeds %d", a.num_topk, kMaxTopk);
  UCCL_ASSERT(a.num_topk <= gpu::kWarpSize, "num_topk=%d exceeds the warp width", a.num_topk);
  check_geometry(ctx, g, "dispatch");
  DispatchKernelArgs k{a, SlotLayout::make(a.row_bytes, a.num_topk, a.num_scales)};
  UCCL_ASSERT(g.lane_region_bytes >= static_cast<int64_t>(g.lane_slots) * k.slot.bytes,
              "lane ring of %lld bytes cannot hold %d slots of %d bytes", static_cast<long long>(g.lane_region_bytes),
              g.lane_slots, k.slot.bytes);
  const int64_t need = required_nvl_bytes(g, ctx.num_ranks, k.slot);
  UCCL_ASSERT(need <= ctx.num_nvl_bytes,
              "dispatch needs %lld NVL bytes (%d channels x %d ranks x %d slots of %d bytes + meta) but the Buffer has "
              "%lld: create it with num_nvl_bytes >= Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) or "
              "lower num_sms / num_max_nvl_chunked_recv_tokens", static_cast<long long>(need), g.num_channels,
              ctx.num_ranks, g.channel_slots, k.slot.bytes, static_cast<long long>(ctx.num_nvl_bytes));
  dispatch_intranode_kernel<<<2 * g.num_channels, kThreadsPerBlock, 0, static_cast<gpu::Stream>(stream)>>>(ctx, g, k);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

int64_t direct_landing_bytes(int64_t rows, int row_bytes, int num_topk, int num_scales) {
  UCCL_ASSERT(rows >= 0 && row_bytes > 0 && num_topk >= 0 && num_scales >= 0,
              "direct landing of %lld rows of %d bytes, %d ids, %d scales", static_cast<long long>(rows), row_bytes,
              num_topk, num_scales);
  return DirectLanding::make(rows, row_bytes, num_topk, num_scales).end;
}

void launch_dispatch_direct(const NvlContext& ctx, const Geometry& g, const DispatchArgs& a, int unpack_blocks,
                            void* stream) {
  UCCL_ASSERT(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row bytes %d must be a positive multiple of 16 (hidden * "
              "element size)", a.row_bytes);
  UCCL_ASSERT(a.num_topk <= kMaxTopk && a.num_topk <= gpu::kWarpSize, "num_topk=%d exceeds %d", a.num_topk, kMaxTopk);
  UCCL_ASSERT(a.lane_prefix != nullptr, "the ring-free dispatch needs the handle's lane_prefix");
  UCCL_ASSERT(a.row_map == nullptr && a.num_tokens_ptr == nullptr && a.src_tag == nullptr,
              "the ring-free dispatch runs inside one node only (no internode forwarding)");
  check_geometry(ctx, g, "dispatch");
  const DirectLanding land = DirectLanding::make(a.landing_rows, a.row_bytes, a.num_topk, a.num_scales);
  UCCL_ASSERT(a.landing_rows >= 0 && land.end <= ctx.num_nvl_bytes,
              "the ring-free dispatch of %lld landed rows of %d bytes needs %lld NVL bytes but the Buffer has %lld",
              static_cast<long long>(a.landing_rows), a.row_bytes, static_cast<long long>(land.end),
              static_cast<long long>(ctx.num_nvl_bytes));
  UCCL_ASSERT(unpack_blocks > 0, "the ring-free dispatch's unpack needs blocks, got %d", unpack_blocks);
  const gpu::Stream st = static_cast<gpu::Stream>(stream);
  dispatch_direct_kernel<<<2 * g.num_channels, kThreadsPerBlock, 0, st>>>(ctx, g, a, land);
  UCCL_CHECK_GPU(gpu::get_last_error());
  dispatch_unpack_kernel<<<unpack_blocks, kUnpackThreads, 0, st>>>(ctx, a, land);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

}  // namespace uccl_moe::intranode
