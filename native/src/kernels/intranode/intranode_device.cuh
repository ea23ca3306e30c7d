// Device helpers shared by the intranode kernels: the cross-rank barrier, warp-collective bounded waits on
// ring counters, and the warp row copy. Include only from .cu files.
#pragma once

#include <type_traits>

#include "intranode.hpp"
#include "nvl_layout.hpp"
#include "uccl_moe/diag_device.cuh"
#include "uccl_moe/error.hpp"
#include "uccl_moe/platform.cuh"

namespace uccl_moe::intranode {

constexpr int kWarpsPerBlock = kThreadsPerBlock / gpu::kWarpSize;

/// Calls f(std::integral_constant<int, N>{}) for N = num_ranks in 1..8 (kernels keep one register copy per rank,
/// so each rank count is its own instantiation); throws InvalidUsage naming `op` otherwise.
template <typename F>
void with_num_ranks(int num_ranks, const char* op, F&& f) {
  switch (num_ranks) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: UCCL_THROW(kInvalidUsage, "%s supports 1..8 local ranks (1, 2, 3, 4, 5, 6, 7, 8), got %d", op, num_ranks);
  }
}

UCCL_DEVICE_INLINE DiagDeviceHandle diag_of(const NvlContext& ctx) {
  return DiagDeviceHandle{ctx.diag_record, ctx.abort_flag, ctx.timeout_ns, ctx.diag_rank};
}

template <typename T = int32_t>
UCCL_DEVICE_INLINE T* meta_ptr(void* buffer, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(buffer) + offset);
}

/// Wrapping distance a - b of two ring counters (they count modulo 2^32 across rounds).
UCCL_DEVICE_INLINE int32_t ring_diff(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b));
}

/// Barrier of all local ranks, called by every thread of one block. Thread p < N bumps our word in rank p's
/// signal array (after a system fence that publishes every write this block made before the call) and waits
/// until rank p bumped ours as often as we did. Pairs with the same call on every peer. Returns false
/// (block-uniform) if a wait expired or the buffer was already aborted.
UCCL_DEVICE_INLINE bool barrier_block(const NvlContext& ctx, int* s_failed) {
  gpu::fence_sys();
  __syncthreads();
  void* local = ctx.buffers[ctx.rank];
  const int32_t target = gpu::load_volatile(meta_ptr(local, kOffBarrierEpoch)) + 1;
  if (threadIdx.x == 0) *s_failed = 0;
  __syncthreads();
  const int p = static_cast<int>(threadIdx.x);
  if (p < ctx.num_ranks) {
    gpu::atomic_add_sys(meta_ptr(ctx.buffers[p], kOffBarrierSignal) + ctx.rank, 1);
    // released by peer p's atomic after its fence
    if (!wait_reached(diag_of(ctx), meta_ptr<const int32_t>(local, kOffBarrierSignal) + p, target, DiagPhase::kBarrier,
                      DiagRole::kCoordinator, p, -1))
      *s_failed = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) *meta_ptr(local, kOffBarrierEpoch) = target;
  const bool ok = *s_failed == 0;
  __syncthreads();
  return ok;
}

/// Warp-collective wait until `*counter` (polled with acquire) reached base + want (wrapping compare). Stores
/// counter - base in *seen (warp-uniform) and returns true, or returns false (uniform) once the wait expired
/// or another waiter aborted; the first expiry writes the diagnostic record, with counts relative to base.
UCCL_DEVICE_INLINE bool warp_wait_at_least(const NvlContext& ctx, const int32_t* counter, int32_t base, int32_t want,
                                           DiagPhase phase, DiagRole role, int peer, int channel, int32_t* seen) {
  int32_t v = ring_diff(gpu::shfl(gpu::load_acquire_sys(counter), 0), base);
  if (v >= want) {
    *seen = v;
    return true;
  }
  DiagDeviceHandle diag = diag_of(ctx);
  BoundedWait wait(diag);
  while (true) {
    v = ring_diff(gpu::shfl(gpu::load_acquire_sys(counter), 0), base);
    if (v >= want) {
      *seen = v;
      return true;
    }
    const int expired = gpu::shfl(wait.expired() ? 1 : 0, 0);
    if (expired) {
      if (gpu::lane_id() == 0) report_timeout(diag, phase, role, peer, channel, want, v, 0, wait.waited_s());
      return false;
    }
  }
}

/// One round of a warp copy: words [base, base + kUnroll * warp) below `end` into / out of `v`, kUnroll per lane.
template <int kUnroll, bool kSrcIsRing>
UCCL_DEVICE_INLINE void load_round(int4 (&v)[kUnroll], const int4* __restrict__ src, int base, int end) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int i = base + u * gpu::kWarpSize + gpu::lane_id();
    if (i < end) v[u] = kSrcIsRing ? gpu::load_ring_128(src + i) : gpu::load_stream_128(src + i);
  }
}
template <int kUnroll>
UCCL_DEVICE_INLINE void store_round(int4* __restrict__ dst, const int4 (&v)[kUnroll], int base, int end) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int i = base + u * gpu::kWarpSize + gpu::lane_id();
    if (i < end) gpu::store_stream_128(dst + i, v[u]);
  }
}
/// Copies 16-byte words [begin, end) from src to dst with the whole warp, kUnroll words per lane in flight.
/// `kSrcIsRing`: src was written by a peer in this launch (no non-coherent loads).
template <int kUnroll, bool kSrcIsRing>
UCCL_DEVICE_INLINE void warp_copy_cols(int4* __restrict__ dst, const int4* __restrict__ src, int begin, int end) {
  for (int base = begin; base < end; base += kUnroll * gpu::kWarpSize) {
    int4 v[kUnroll];
    load_round<kUnroll, kSrcIsRing>(v, src, base, end);
    store_round<kUnroll>(dst, v, base, end);
  }
}
/// The whole row: `num_16` 16-byte words.
template <int kUnroll, bool kSrcIsRing>
UCCL_DEVICE_INLINE void warp_copy_row(int4* __restrict__ dst, const int4* __restrict__ src, int num_16) {
  warp_copy_cols<kUnroll, kSrcIsRing>(dst, src, 0, num_16);
}
/// The whole row as warp_copy_row, double-buffered: each round's loads are issued before the previous round's
/// stores, so a row waits for about one load latency rather than one per round (the loads and stores are ordered
/// asm statements, so a single buffer exposes every round's latency).
template <int kUnroll, bool kSrcIsRing>
UCCL_DEVICE_INLINE void warp_copy_row_pipelined(int4* __restrict__ dst, const int4* __restrict__ src, int num_16) {
  constexpr int kRound = kUnroll * gpu::kWarpSize;
  int4 a[kUnroll], b[kUnroll];  // two named buffers, so both stay in registers
  load_round<kUnroll, kSrcIsRing>(a, src, 0, num_16);
  for (int base = 0; base < num_16; base += 2 * kRound) {
    if (base + kRound < num_16) load_round<kUnroll, kSrcIsRing>(b, src, base + kRound, num_16);
    store_round<kUnroll>(dst, a, base, num_16);
    if (base + kRound >= num_16) break;
    if (base + 2 * kRound < num_16) load_round<kUnroll, kSrcIsRing>(a, src, base + 2 * kRound, num_16);
    store_round<kUnroll>(dst, b, base + kRound, num_16);
  }
}

/// Ring positions a sender block's remote warps hand to their lane's direct warp, which publishes them
/// (TailPublisher): per sender warp, indexed by its warp id in the block.
struct SendPosts {
  int32_t written[kWarpsPerBlock];   // ring positions stored, posted with a block-scope release
  int32_t finished[kWarpsPerBlock];  // 1 once the warp posted its last position (or gave up)

  /// Zeroes both tables; all threads of the block call it.
  UCCL_DEVICE_INLINE void reset() {
    for (int i = threadIdx.x; i < kWarpsPerBlock; i += blockDim.x) written[i] = finished[i] = 0;
    __syncthreads();
  }
};

/// A sender warp's end of ring (lane, me) at rank dst, for one round: positions count from the round's base
/// (our send_base word), `published` is the tail released so far, `head_seen` the head last read (< 0 before
/// the first write, which waits until the receiver drained the previous round: see nvl_layout.hpp).
/// Warp-collective; lane 0 does the stores. With post_to(), the warp only posts its positions in shared memory and
/// its lane's direct warp releases them to the tail and moves send_base at the end (TailPublisher).
struct RingSender {
  int32_t* tail;          ///< in dst's meta: what we published
  const int32_t* head;    ///< in our meta: what dst consumed
  int32_t* base_word;     ///< our send_base for (lane, dst)
  int32_t base;
  int published = 0, head_seen = -1;
  int32_t* post = nullptr;      ///< SendPosts::written of this warp, when posting
  int32_t* finished = nullptr;  ///< SendPosts::finished of this warp, when posting

  UCCL_DEVICE_INLINE RingSender(const NvlContext& ctx, int lane_idx, int dst)
      : tail(meta_ptr(ctx.buffers[dst], kOffTail) + lane_idx * ctx.num_ranks + ctx.rank),
        head(meta_ptr(ctx.buffers[ctx.rank], kOffHead) + lane_idx * ctx.num_ranks + dst),
        base_word(meta_ptr(ctx.buffers[ctx.rank], kOffSendBase) + lane_idx * ctx.num_ranks + dst),
        base(gpu::shfl(*base_word, 0)) {}

  /// Post positions to `posts` (entry `warp`) instead of releasing the tail.
  UCCL_DEVICE_INLINE void post_to(SendPosts* posts, int warp) {
    post = &posts->written[warp];
    finished = &posts->finished[warp];
  }
  /// Rows [0, done) are stored: release them (every lane's slot stores happen before lane 0's release, which
  /// pairs with the receiver's acquire of the tail), or post them with a block-scope release, which the
  /// publisher's system-scope release of the tail extends to the receiver.
  UCCL_DEVICE_INLINE void publish(int done) {
    if (done <= published) return;
    gpu::sync_warp();
    if (gpu::lane_id() == 0) {
      if (post != nullptr)
        gpu::store_release_block(post, done);
      else
        gpu::store_release_sys(tail, base + done);
    }
    published = done;
  }
  /// Before writing position `pos` of a ring of g.lane_slots: re-reads a head that looks full, and only if the
  /// ring is still full publishes what was written (the receiver may wait for it) and waits, bounded. False
  /// (warp-uniform) once the wait expired or the launch aborted.
  UCCL_DEVICE_INLINE bool make_room(const NvlContext& ctx, const Geometry& g, int pos, DiagPhase phase, int dst,
                                    int lane_idx) {
    if (head_seen >= 0 && pos - head_seen < g.lane_slots) return true;
    if (head_seen >= 0) {
      head_seen = ring_diff(gpu::shfl(gpu::load_acquire_sys(head), 0), base);
      if (pos - head_seen < g.lane_slots) return true;
    }
    publish(pos);
    return warp_wait_at_least(ctx, head, base, max(0, pos - g.lane_slots + 1), phase, DiagRole::kSender, dst, lane_idx,
                              &head_seen);
  }
  /// End of the round after `count` rows: publish them all; the next round on this stream starts there (when
  /// posting, the publisher moves send_base once it released them).
  UCCL_DEVICE_INLINE void finish(int count) {
    publish(count);
    if (post != nullptr)
      mark_finished();
    else if (gpu::lane_id() == 0)
      *base_word = base + count;
  }
  /// Only when posting (post_to): tells the publisher this warp posts nothing more (its last post, or it left on a
  /// failed wait).
  UCCL_DEVICE_INLINE void mark_finished() {
    gpu::sync_warp();
    if (gpu::lane_id() == 0) gpu::store_release_block(finished, 1);
  }
};

/// The direct warp (dst == me) of a dispatch lane publishes the lane's rings for the lane's remote sender warps,
/// which only post their positions (RingSender::post_to): lane d < N of this warp serves ring (lane, me) at rank
/// d != me. A system-scope release waits until the slot stores it covers crossed NVLink; here that wait stalls
/// this warp, between the kept rows it copies, instead of the warps that push the rows.
struct TailPublisher {
  int32_t* written = nullptr;  // not const: the acquire loads are atomic read-modify-writes (platform.cuh)
  int32_t* finished = nullptr;
  int32_t* tail = nullptr;
  int32_t* base_word = nullptr;
  int32_t base = 0, published = 0;
  bool sender_done = true;  // false until this lane's sender finished (lanes that serve no ring: always true)

  UCCL_DEVICE_INLINE TailPublisher(const NvlContext& ctx, SendPosts* posts, int W, int w, int lane_idx) {
    const int d = gpu::lane_id();
    if (d < ctx.num_ranks && d != ctx.rank) {
      written = &posts->written[d * W + w];
      finished = &posts->finished[d * W + w];
      tail = meta_ptr(ctx.buffers[d], kOffTail) + lane_idx * ctx.num_ranks + ctx.rank;
      base_word = meta_ptr(ctx.buffers[ctx.rank], kOffSendBase) + lane_idx * ctx.num_ranks + d;
      base = *base_word;
      sender_done = false;
    }
  }
  /// Releases what was posted since the last call. True (warp-uniform) once every ring's sender finished and
  /// all it posted is released.
  UCCL_DEVICE_INLINE bool poll() {
    if (written != nullptr) {
      sender_done = gpu::load_acquire_block(finished) != 0;  // first: a finished sender's count is final
      const int32_t now = gpu::load_acquire_block(written);
      if (now > published) {
        gpu::store_release_sys(tail, base + now);
        published = now;
      }
    }
    return gpu::ballot(!sender_done) == 0;
  }
  /// After the lane's own rows: releases until every sender finished, then moves send_base to where the round
  /// ended (the next round on these rings starts there). Bounded like the senders' own waits: the limit restarts
  /// whenever a sender posts or finishes, so only a lane that made no progress for UCCL_MOE_TIMEOUT_S gives up (a
  /// stuck sender's own wait has expired by then and reported first).
  UCCL_DEVICE_INLINE void drain(const NvlContext& ctx, int lane_idx) {
    DiagDeviceHandle diag = diag_of(ctx);
    BoundedWait wait(diag);
    int32_t last = -1;  // this lane's progress when the limit last restarted
    while (!poll()) {
      const int32_t now = 2 * published + (sender_done ? 1 : 0);
      if (gpu::ballot(now != last) != 0) {
        last = now;
        wait = BoundedWait(diag);
        continue;
      }
      if (gpu::shfl(wait.expired() ? 1 : 0, 0)) {
        const int who = gpu::lowest_bit(gpu::ballot(!sender_done));
        // also where another waiter aborted first: a peer may have raised our flag, and then only a drained record
        // tells our host (report_timeout: the first claim wins)
        if (gpu::lane_id() == 0)
          report_timeout(diag, DiagPhase::kDispatchPublish, DiagRole::kSender, who, lane_idx, 1, 0, 0, wait.waited_s());
        return;
      }
    }
    if (base_word != nullptr) *base_word = base + published;
  }
};

/// recv_base word of receiver lane `lane_idx` for source rank `src` (in our meta).
UCCL_DEVICE_INLINE int32_t* recv_base_word(const NvlContext& ctx, int lane_idx, int src) {
  return meta_ptr(ctx.buffers[ctx.rank], kOffRecvBase) + lane_idx * ctx.num_ranks + src;
}

/// Progress of a receiver block whose lanes are served by groups of G warps (each warp a slice of the columns):
/// what each warp consumed from each source's ring, and what each lane handed back (the group minimum).
struct RecvSmem {
  int32_t consumed[kWarpsPerBlock][kMaxLocalRanks];   // per warp: ring positions consumed, per source rank
  int32_t published[kWarpsPerBlock][kMaxLocalRanks];  // per lane (indexed by its first warp): head published

  /// Zeroes both tables; all threads of the block call it.
  UCCL_DEVICE_INLINE void reset() {
    for (int i = threadIdx.x; i < kWarpsPerBlock * kMaxLocalRanks; i += blockDim.x) {
      (&consumed[0][0])[i] = 0;
      (&published[0][0])[i] = 0;
    }
    __syncthreads();
  }
  /// What warp `warp` consumed from source `src` (set by that warp, read by the lane's other warps in
  /// publish_heads). No barrier orders the two: a stale read only delays a hand-back, since counts only grow.
  /// Both sides are shared-memory atomics so the sharing is explicit (compute-sanitizer racecheck: no hazard).
  UCCL_DEVICE_INLINE void set_consumed(int warp, int src, int32_t count) { atomicExch(&consumed[warp][src], count); }
  UCCL_DEVICE_INLINE int32_t consumed_by(int warp, int src) { return atomicAdd(&consumed[warp][src], 0); }
  /// After every warp's last publication: the final count of each of the block's lanes [lane0, lane0 + lanes)
  /// moves its recv_base (the next round on this stream starts there). All threads of the block call it.
  UCCL_DEVICE_INLINE void finish(const NvlContext& ctx, int lane0, int lanes, int group) {
    __syncthreads();
    const int warp = gpu::warp_id(), lane = gpu::lane_id();
    const int lane_local = warp / group;
    if (lane_local < lanes && warp % group == 0 && lane < ctx.num_ranks)
      *recv_base_word(ctx, lane0 + lane_local, lane) += published[warp][lane];
  }
};

/// Lane d < N of the warp: min over the lane's G warps of what they consumed from rank d; publishes it to rank
/// d's head word if it grew. Called by all lanes.
UCCL_DEVICE_INLINE void publish_heads(const NvlContext& ctx, RecvSmem* sm, int first_warp, int group, int lane_idx) {
  const int lane = gpu::lane_id();
  gpu::fence_block();
  if (lane < ctx.num_ranks) {
    int32_t m = INT32_MAX;
    for (int gw = 0; gw < group; ++gw)
      m = min(m, sm->consumed_by(first_warp + gw, lane));
    const int32_t old = atomicMax(&sm->published[first_warp][lane], m);
    if (m > old) {  // this warp claimed the growth old -> m; every claim is disjoint, so adding them is exact
      int32_t* head = meta_ptr(ctx.buffers[lane], kOffHead) + lane_idx * ctx.num_ranks + ctx.rank;
      gpu::atomic_add_relaxed_sys(head, m - old);  // the slots' values are summed already: no release needed
    }
  }
}

/// Scale j of token `tok` (row- or column-major x_scales, 4 bytes copied bit-exact).
UCCL_DEVICE_INLINE int32_t scale_at(const DispatchArgs& a, int tok, int j) {
  return static_cast<const int32_t*>(a.x_scales)[tok * a.scale_token_stride + j * a.scale_hidden_stride];
}

/// Token count of a launch: the host value, or the device one when an internode forwarder passes it.
template <typename Args>
UCCL_DEVICE_INLINE int tokens_of(const Args& a) {
  return a.num_tokens_ptr != nullptr ? *a.num_tokens_ptr : a.num_tokens;
}

/// Token range [begin, end) of lane `lane_idx` out of `num_lanes` over `num_tokens` tokens.
UCCL_DEVICE_INLINE void lane_token_range(int num_tokens, int num_lanes, int lane_idx, int* begin, int* end) {
  const int per_lane = (num_tokens + num_lanes - 1) / num_lanes;
  *begin = min(num_tokens, lane_idx * per_lane);
  *end = min(num_tokens, *begin + per_lane);
}

/// Row `r` of the lane order as stored: through row_map where an internode forwarder passes one.
template <typename Args>
UCCL_DEVICE_INLINE int64_t mapped_row(const Args& a, int64_t r) {
  return a.row_map != nullptr ? a.row_map[r] : r;
}

/// First output row of this rank's own tokens in lane `lane_idx` (rows from rank `me` start at its rank-prefix
/// offset, lanes at recv_lane_start): where the direct path writes and where combine finds its own copies.
template <typename Args>
UCCL_DEVICE_INLINE int64_t self_row0(const Args& a, int N, int me, int L, int lane_idx) {
  const int64_t src_begin = me == 0 ? 0 : a.rank_prefix[(me - 1) * N + me];
  return src_begin + a.recv_lane_start[me * L + lane_idx];
}

/// Ring of (channel, src) lane `w` inside `buffer` (the receiver's NVL buffer); g.lane_region_bytes apart.
UCCL_DEVICE_INLINE char* lane_ring(void* buffer, const Geometry& g, int num_ranks, int channel, int src, int w) {
  const int64_t ring = (static_cast<int64_t>(channel) * num_ranks + src) * g.lanes_per_channel + w;
  return static_cast<char*>(buffer) + kNvlMetaBytes + ring * g.lane_region_bytes;
}
/// The same ring named by its lane index (lane_idx = channel * W + w).
UCCL_DEVICE_INLINE char* lane_ring_of(void* buffer, const Geometry& g, int num_ranks, int lane_idx, int src) {
  return lane_ring(buffer, g, num_ranks, lane_idx / g.lanes_per_channel, src, lane_idx % g.lanes_per_channel);
}

}  // namespace uccl_moe::intranode
