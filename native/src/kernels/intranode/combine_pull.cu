// combine_pull_kernel: combine from the buffer. When the caller wrote the combine's input rows into its own NVL
// buffer (Buffer.get_combine_buffer), no rank pushes anything: each rank loads every copy of each of its tokens
// straight from the buffer that holds it (peers' over NVLink, its own locally) and sums them in float32 in rank
// order 0..N-1, then bias0, then bias1, rounded once to BF16: the same order, so the same bits, as the ring combine
// (combine.cu). No ring, no chunk hand-offs: one start and one end hand-shake per launch.
//
// Why: the ring combine moves every remote row twice through memory (the sender's load and NVLink store into the
// ring, the receiver's load from the ring) and pays a hand-off per chunk. Pulling the rows where they already lie
// leaves one NVLink load per remote row, which runs at the link's pace (native/bench/probes/combine_pull_probe.cu compares
// the designs; figures in docs/benchmarks.md).
//
// Where rank d holds our token t: its rows from source `me` start at rank_prefix[me - 1][d], the rows of our lane l
// at lane_prefix[d][l - 1] inside them (the same exclusive prefix d's recv_lane_start holds), and t is send_head
// [t][d] rows further (its position in the lane's stream to d). Rows live at kOffCombineInput of the buffer; the
// top-k weights (when given) are staged by the launch itself after each rank's received rows
// (combine_input_weights_offset), since peers read them too. A staged combine (`staged`) compacts both: rank d's buffer
// holds only the rows d got from other ranks (d's own block [rank_prefix[d - 1][d], rank_prefix[d][d]) stays in d's
// x), so our rows there sit d's own block further up when we rank after d (our_rows_at).
//
// Hand-shakes (words in nvl_layout.hpp), for round r = pull_round + 1:
//   start: every block stages its share of the weights and counts itself in pull_arrive; the last one releases r
//     into pull_start[me] of every peer (a system fence first: the rows were written by earlier kernels, the
//     weights by this launch). Every block then waits until each peer's pull_start[d] in our meta reached r.
//   end: every block counts itself in pull_leave once its loads returned; the last one releases r into
//     pull_done[me] of every peer, waits until every peer released r into ours (nobody reads our buffer any
//     more, so the next op may write it: the caller's next rows or a dispatch's ring slots) and sets pull_round.
// All waits are bounded (UCCL_MOE_TIMEOUT_S): a rank that skips a combine from the buffer, or passes a tensor of
// its own while its peers pass the buffer's, is named in a combine/pull-start timeout (where that tensor takes the
// rings) or a combine/pull-args record (where it is staged: the start release carries the layout).
#include <algorithm>
#include <cstdlib>

#include "combine_sum.cuh"
#include "handshake.cuh"
#include "phase_trace.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

namespace {

/// 16-B columns of a token in one work item of the polled copy-engine sum (pull_sum): 2 KB of a row, one load round
/// of a 32-lane warp at EP2 (kColUnroll 4; half a round of a 64-lane wavefront); half that measured far slower (the
/// per-item lookups dominate).
constexpr int kSumPartCols = 128;

/// Sums the copies of tokens t = (global warp), + (all warps), ... Lane d < N holds where rank d keeps this token's
/// copy (or -1 when the token did not go to d). `kLanded`: a copy-engine combine, where the peers' copies of our
/// tokens landed in our own buffer (ce_block_at) chunk by chunk (waited for per token), with their weights.
/// `kPoll` (with kLanded): the landing area held the sentinel before the peers' one copy each (UCCL_MOE_CE_POLL):
/// every word is taken as it lands (sum_token_copies_polled), with no wait for a head or a chunk, and the weights
/// are summed in a second pass over the tokens, once every peer's head (which carries them) landed: a wait or a
/// dependent load per token in the rows' loop would put the sum behind the engines.
template <int kNumRanks, int kColUnroll, bool kLanded = false, bool kPoll = false>
UCCL_DEVICE_INLINE void pull_sum(const NvlContext& ctx, const CombinePullArgs& a, int32_t round = 0,
                                 const CeEnter& enter = CeEnter{}) {
  static_assert(kLanded || !kPoll, "only a copy-engine combine's landing area is polled");
  const int N = kNumRanks, me = ctx.rank, lane = gpu::lane_id(), L = a.num_lanes, T = a.num_tokens;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int num_16 = static_cast<int>(row_bytes / 16);
  const int per_lane = (T + L - 1) / L;
  // Per lane d < N: rank d's rows and staged weights, and where its rows from us start. A staged combine left our
  // own rows in the caller's tensor (own_x): the same row numbers there.
  // A flag, not own_x != nullptr: a rank that received no rows passes an empty x (a null pointer) but must find its
  // tokens' rows in the peers' compacted buffers as every other rank does.
  const bool compact = kLanded || a.staged != 0;
  const int holder = kLanded ? me : lane;  // whose buffer holds rank d's copies (landed: ours)
  const char* rows_d = nullptr;
  if (lane < N)
    rows_d = lane == me && compact ? static_cast<const char*>(a.own_x)
                                   : static_cast<const char*>(ctx.buffers[holder]) + kOffCombineInput;
  // With weights (out_topk_weights given on every rank alike) every rank staged its own, even a rank whose
  // topk_weights pointer is null because it received no rows.
  const float* weights_d = nullptr;
  if (lane < N && a.out_topk_weights != nullptr)
    weights_d = reinterpret_cast<const float*>(
        static_cast<const char*>(ctx.buffers[holder]) +
        combine_input_weights_offset(kLanded ? ce_landing_rows(a.rank_prefix, N, me)
                                             : buffer_rows(a.rank_prefix, N, lane, compact), row_bytes));
  // Our own copies (lane == me): at their row numbers in x (own_x) or the view, and their weights in topk_weights.
  const int64_t from_me_d = lane >= N ? 0
                            : kLanded && lane != me ? ce_block_at(a.rank_prefix, N, me, lane)
                                                    : our_rows_at(a.rank_prefix, N, me, lane, compact);
  LandedChunks landed;
  if (kLanded && !kPoll && lane < N && lane != me) {  // a polled sum waits for no chunk
    landed.rows = rows_sent(a.rank_prefix, N, me, lane);
    landed.round = round;
    landed.head = false;  // waited for below, once
    landed.head_rows = static_cast<int32_t>(ce_head_rows(landed.rows, row_bytes, false, N - 1));
  }
  if (kLanded && enter.early != 0) {  // an early op: every peer entered with our checked bits, before anything of
    // theirs is read (their weights, then their rows)
    const bool ok = lane >= N || lane == me || wait_entered(ctx, enter, round, lane);
    gpu::sync_warp();
    if (gpu::ballot(!ok) != 0) return;
  }
  // The peers' heads (their top-k weights, and with chunk flags their blocks' first rows): waited for before the
  // first token, which needs them or chunk 0, and that lands long after them; a polled sum waits for them only
  // before the weights.
  auto heads_landed = [&]() {
    bool ok = true;
    if (lane < N && lane != me)
      ok = wait_reached(diag_of(ctx), meta_ptr<const int32_t>(ctx.buffers[me], kOffCeHead) + lane, round,
                        DiagPhase::kCombineCeChunk, DiagRole::kReceiver, lane, -1);
    gpu::sync_warp();  // lane d's acquire covers the warp's later loads of d's weights
    return gpu::ballot(!ok) == 0;
  };
  if (kLanded && !kPoll && !heads_landed()) return;
  const int4* bias0 = static_cast<const int4*>(a.bias0);
  const int4* bias1 = static_cast<const int4*>(a.bias1);
  const int stride = static_cast<int>(gridDim.x) * kWarpsPerBlock;
  const int first = static_cast<int>(blockIdx.x) * kWarpsPerBlock + gpu::warp_id();
  // Lane d's row of token t in rank d's rows (-1: none), from t's entry p of send_head.
  auto row_of = [&](int t, int32_t p) -> int64_t {
    const int l = t / per_lane;
    return lane < N && p >= 0 ? from_me_d + (l > 0 ? a.lane_prefix[lane * L + l - 1] : 0) + p : -1;
  };
  // The weights' sum of token t, in the same rank order (warp-collective).
  auto sum_weights = [&](int t, int64_t row, gpu::LaneMask have) {
    float sum = 0.0f;
    for (int d = 0; d < N; ++d) {
      const long long r = gpu::shfl(static_cast<long long>(row), d);
      const float* w = reinterpret_cast<const float*>(gpu::shfl(reinterpret_cast<unsigned long long>(weights_d), d));
      if (((have >> d) & 1) && lane < a.num_topk)  // our own copy exists, so our topk_weights is not null
        sum += d == me ? a.topk_weights[r * a.num_topk + lane]
                       : __int_as_float(gpu::load_ring_32(reinterpret_cast<const int32_t*>(w + r * a.num_topk + lane)));
    }
    if (lane < a.num_topk) a.out_topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] = sum;
  };
  // Polled: a word of peer d's still at the sentinel is data once d's copy and head both landed.
  uint32_t settled = 0;
  auto peek = [&](int d) {
    const int k = a.ce_chunks - 1;
    void* local = ctx.buffers[me];
    return ring_diff(gpu::load_volatile(ce_ready_words(local, d) + k), round) >= 0 &&
           ring_diff(gpu::load_volatile(meta_ptr<const int32_t>(local, kOffCeHead) + d), round) >= 0;
  };
  auto settle = [&](int d) {
    const int k = a.ce_chunks - 1;
    return wait_reached(diag_of(ctx), ce_ready_words(ctx.buffers[me], d) + k, round, DiagPhase::kCombineCeChunk,
                        DiagRole::kReceiver, d, k) &&
           wait_reached(diag_of(ctx), meta_ptr<const int32_t>(ctx.buffers[me], kOffCeHead) + d, round,
                        DiagPhase::kCombineCeChunk, DiagRole::kReceiver, d, -1);
  };
  if constexpr (kPoll) {
    // Work items of kSumPartCols columns of a token, not whole tokens: a warp sums an item in a chain of dependent
    // load rounds, and the tokens whose copies land last are summed after the copy, on the op's critical path; a
    // token's parts on G warps end about G times sooner (docs/intranode.md, "Session 46"). Consecutive items, the
    // parts of one token, go to consecutive warps.
    const int G = (num_16 + kSumPartCols - 1) / kSumPartCols, cw = kSumPartCols;
    const int items = T * G;
    int j = first;
    int t_next = j / G;
    int32_t q_next = lane < N && j < items ? a.send_head[static_cast<int64_t>(t_next) * N + lane] : -1;
    for (; j < items; j += stride) {
      const int tt = t_next;
      const int32_t q = q_next;
      const int part = j - tt * G;
      if (j + stride < items) {
        t_next = (j + stride) / G;
        if (lane < N) q_next = a.send_head[static_cast<int64_t>(t_next) * N + lane];
      }
      const int c0 = part * cw, c1 = min(num_16, c0 + cw);  // c0 < num_16: G parts cover the row
      const int64_t row = row_of(tt, q);
      const char* src = row >= 0 ? rows_d + row * row_bytes : nullptr;
      const gpu::LaneMask have = gpu::ballot(row >= 0);
      if (!sum_token_copies_polled<kNumRanks, kColUnroll>(src, have, me, c0, c1, bias0, bias1, tt, num_16,
                                                          static_cast<int4*>(a.out), settled, peek, settle))
        return;
    }
    if (a.out_topk_weights != nullptr) {
      if (!heads_landed()) return;
      for (int t = first; t < T; t += stride) {
        const int64_t row = row_of(t, lane < N ? a.send_head[static_cast<int64_t>(t) * N + lane] : -1);
        sum_weights(t, row, gpu::ballot(row >= 0));
      }
    }
    return;
  }
  int t = first;
  int32_t p_next = lane < N && t < T ? a.send_head[static_cast<int64_t>(t) * N + lane] : -1;
  for (; t < T; t += stride) {
    const int32_t p = p_next;  // the next token's entry loads while this one sums
    if (lane < N && t + stride < T) p_next = a.send_head[static_cast<int64_t>(t + stride) * N + lane];
    const int64_t row = row_of(t, p);
    if (kLanded) {  // a warp about to wait for the chunk that holds a peer's copy: our own copy into L2
      // meanwhile, so that the sum once the chunk landed (the op's tail, for the last chunk) reads it from there
      const bool waits = lane < N && lane != me && row >= 0 && row - from_me_d >= landed.ready_end;
      if (gpu::ballot(waits) != 0 && lane == me && row >= 0) gpu::prefetch_l2(rows_d + row * row_bytes, row_bytes);
      UCCL_MOE_TRACE(const long long t_land = trace::now());
      if (!landed.wait(ctx, a.ce_chunks, lane != me && row >= 0 ? row - from_me_d : -1, lane)) return;
      UCCL_MOE_TRACE(trace::add(trace::kWait, t_land));
    }
    const char* src = row >= 0 ? rows_d + row * row_bytes : nullptr;
    const gpu::LaneMask have = gpu::ballot(row >= 0);  // uniform
    // our own rows are not written during the launch: they may take non-coherent loads
    UCCL_MOE_TRACE(const long long t_sum = trace::now());
    sum_token_copies<kNumRanks, kColUnroll>(src, have, me, 0, num_16, bias0, bias1, t, num_16,
                                            static_cast<int4*>(a.out));
    UCCL_MOE_TRACE(trace::add(trace::kCopy, t_sum); const long long t_w = trace::now());
    if (a.out_topk_weights != nullptr) sum_weights(t, row, have);  // warp-uniform branch
    UCCL_MOE_TRACE(trace::add(trace::kMeta, t_w));
  }
}

template <int kNumRanks, int kColUnroll = (kNumRanks <= 2 ? 4 : kNumRanks <= 4 ? 2 : 1)>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_pull_kernel(NvlContext ctx, CombinePullArgs a) {
  UCCL_MOE_TRACE(const long long t0 = trace::now(); const unsigned long long t0_ns = gpu::global_timer_ns();
                 trace::begin());
  __shared__ PullSmem sm;
  const int N = kNumRanks, me = ctx.rank;
  void* local = ctx.buffers[me];
  const int32_t round = gpu::load_volatile(meta_ptr(local, kOffPullRound)) + 1;
  UCCL_MOE_TRACE(const long long t_stage = trace::now());
  if (a.topk_weights != nullptr) {  // stage our weights where the peers look for them (compacted as the rows)
    const bool compact = a.staged != 0;
    const OwnBlock own(a.rank_prefix, N, me);
    const int64_t rows = buffer_rows(a.rank_prefix, N, me, compact);
    const int64_t n = rows * a.num_topk, before = own.begin * a.num_topk;
    const int64_t skip = compact ? own.count * a.num_topk : 0;  // staged_to_received, in weights (none: identity)
    float* staged = reinterpret_cast<float*>(static_cast<char*>(local) +
                                             combine_input_weights_offset(rows, static_cast<int64_t>(a.hidden) * 2));
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      staged[i] = a.topk_weights[staged_to_received(i, before, skip)];
  }
  // Every rank stages (and reads) as many weights per row as its topk_weights has (num_topk, 0 without): all or none
  // must pass them (not out_topk_weights != nullptr: a rank with no tokens of its own gets an empty one, address 0).
  // And every rank lays its rows out alike (a view's full layout, or a staged tensor's compacted one): a peer
  // reading the other layout would sum the wrong rows; and of the same hidden size. All go into the value every rank
  // checks (InvalidUsage).
  const int32_t checked = a.num_topk | pull_args_hidden(a.hidden) | (a.staged != 0 ? kPullArgsStaged : 0);
  UCCL_MOE_TRACE(trace::add(trace::kKept, t_stage); const long long t_start = trace::now());
  if (last_block(meta_ptr(local, kOffPullArrive), &sm)) release_to_peers(ctx, kOffPullStart, round, checked);
  const bool started = wait_peers(ctx, kOffPullStart, round, DiagPhase::kCombinePullStart, &sm, checked);
  UCCL_MOE_TRACE(trace::add(trace::kWait, t_start));
  if (started) pull_sum<kNumRanks, kColUnroll>(ctx, a);
  UCCL_MOE_TRACE(const long long t_end = trace::now());
  if (last_block(meta_ptr(local, kOffPullLeave), &sm)) {
    pull_done(ctx, round, &sm);
    record_if_aborted(ctx, DiagPhase::kCombinePullDone);
  }
  UCCL_MOE_TRACE(trace::add(trace::kPublish, t_end);
                 trace::finish(trace::kRecv, t0, t0_ns, a.staged != 0 ? "pull_staged" : "pull_view", me,
                               a.hidden * 2));
}

/// A copy-engine combine's sum: first our top-k weights and (with chunk flags) each block's first rows into the
/// peers' landing areas (push_ce_head), then every token's copies, the peers' read from our landing area once their
/// head (and past its rows their chunk) landed, or with `kPoll` as each word lands (pull_sum). Then the pull's end
/// hand-shake: a rank leaves once every peer stopped reading its own landing area, since the next op may write into
/// the peers' buffers at once (ring slots overlap the landing areas).
template <int kNumRanks, bool kPoll, int kColUnroll = (kNumRanks <= 2 ? 4 : kNumRanks <= 4 ? 2 : 1)>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_ce_sum_kernel(NvlContext ctx, CombinePullArgs a,
                                                                             CeHead head, CeEnter enter) {
  UCCL_MOE_TRACE(const long long t0 = trace::now(); const unsigned long long t0_ns = gpu::global_timer_ns();
                 trace::begin());
  __shared__ PullSmem sm;
  void* local = ctx.buffers[ctx.rank];
  // The enter kernel advanced the round (where its wait gave up it did not, and the abort flag is up: no sum); an
  // early op releases its entry here (CeEnter).
  const int32_t round = ce_op_round(ctx, enter);
  ce_release_entry(ctx, enter, round);
  push_ce_head(ctx, head, round, &sm, enter);
  if (gpu::load_volatile(ctx.abort_flag) == 0) pull_sum<kNumRanks, kColUnroll, true, kPoll>(ctx, a, round, enter);
  UCCL_MOE_TRACE(const long long t_end = trace::now());
  // Beside (CeEnter::beside): ce_end_kernel on the side stream ends the op instead.
  if (enter.beside == 0 && last_block(meta_ptr(local, kOffPullLeave), &sm))
    ce_op_end(ctx, enter, round, a.ce_chunks, DiagPhase::kCombineCeChunk, &sm);
  UCCL_MOE_TRACE(trace::add(trace::kPublish, t_end);
                 trace::finish(trace::kRecv, t0, t0_ns, "ce_sum", ctx.rank, a.hidden * 2));
}

/// A copy-engine op's enter hand-shake (one block): our earlier ops are done with our buffer (stream order), so the
/// peers' copy engines may write into its landing area; release that, with the checked value, and wait until every
/// peer released the same round (a wait that expires is reported as `phases.start`, a value that differs as
/// `phases.args`). Also writes the round into
/// ce_round, which our copy engine copies into the peers' ce_ready words after each chunk. On a wait that expires
/// the round is not advanced and the abort flag is up: the kernel after it then returns at once.
__global__ void __launch_bounds__(kThreadsPerBlock, 1) ce_enter_kernel(NvlContext ctx, int32_t checked,
                                                                       CePhases phases) {
  __shared__ PullSmem sm;
  void* local = ctx.buffers[ctx.rank];
  const int32_t round = gpu::load_volatile(meta_ptr(local, kOffPullRound)) + 1;
  if (threadIdx.x == 0) *meta_ptr(local, kOffCeRound) = round;
  __syncthreads();
  release_to_peers(ctx, kOffPullStart, round, checked);
  const bool entered =
      wait_peers(ctx, kOffPullStart, round, phases.start, &sm, checked, phases.args);
  if (entered && threadIdx.x == 0) *meta_ptr(local, kOffPullRound) = round;
  // Our copies are enqueued behind this kernel whatever it found, and would land in a peer that may still be in an
  // earlier op: raise every peer's abort flag too, so that op fails (a timeout naming this rank's record) instead of
  // returning rows the copies overwrote.
  const int d = static_cast<int>(threadIdx.x);
  if (!entered && d < ctx.num_ranks && d != ctx.rank) {
    gpu::store_release_sys(meta_ptr(ctx.buffers[d], kOffAbortFlag), 1);
  }
}

constexpr int kStageThreads = 512;
constexpr int kStageUnroll = 4;  // 16-B words per thread in flight

/// launch_stage_combine_rows: the 16-B words of the received rows that came from other ranks, as one index space
/// (the rows before our own block, then the rows after it), copied to the buffer's rows in that order (compacted),
/// at most `max_rows` rows (what the host checked the buffer holds).
__global__ void __launch_bounds__(kStageThreads) stage_combine_rows_kernel(const int4* __restrict__ x,
                                                                            int4* __restrict__ rows, int64_t row_words,
                                                                            const int32_t* rank_prefix, int N, int me,
                                                                            int64_t max_rows) {
  UCCL_MOE_TRACE(const long long t0 = trace::now(); const unsigned long long t0_ns = gpu::global_timer_ns();
                 trace::begin());
  const OwnBlock own(rank_prefix, N, me);
  const int64_t before = own.begin * row_words;  // words of rows [0, own.begin)
  const int64_t skip = own.count * row_words;    // words of our own rows, left in x
  const int64_t total = min(buffer_rows(rank_prefix, N, me, true), max_rows) * row_words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += stride * kStageUnroll) {
    int4 v[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < total) v[u] = gpu::load_stream_128(x + staged_to_received(i, before, skip));
    }
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < total) gpu::store_stream_128(rows + i, v[u]);
    }
  }
  UCCL_MOE_TRACE(trace::add(trace::kCopy, t0);
                 trace::finish(trace::kRecv, t0, t0_ns, "stage", me, static_cast<int>(row_words * 16)));
}

}  // namespace

void launch_stage_combine_rows(const NvlContext& ctx, const void* x, int hidden, int64_t max_rows,
                               const int32_t* rank_prefix, int grid_blocks, void* stream) {
  UCCL_ASSERT(hidden > 0 && (hidden * 2) % 16 == 0, "combine hidden=%d: hidden * 2 bytes must be a multiple of 16",
              hidden);
  const int64_t row_bytes = static_cast<int64_t>(hidden) * 2;
  const int64_t end = static_cast<int64_t>(combine_input_weights_offset(max_rows, row_bytes));
  UCCL_ASSERT(max_rows >= 0 && end <= ctx.num_nvl_bytes, "staging %lld combine rows of %lld bytes needs %lld NVL bytes "
              "but the Buffer has %lld", static_cast<long long>(max_rows), static_cast<long long>(row_bytes),
              static_cast<long long>(end), static_cast<long long>(ctx.num_nvl_bytes));
  if (max_rows == 0) return;
  int4* rows = reinterpret_cast<int4*>(static_cast<char*>(ctx.buffers[ctx.rank]) + kOffCombineInput);
  stage_combine_rows_kernel<<<grid_blocks > 0 ? grid_blocks : 1, kStageThreads, 0, static_cast<gpu::Stream>(stream)>>>(
      static_cast<const int4*>(x), rows, row_bytes / 16, rank_prefix, ctx.num_ranks, ctx.rank, max_rows);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void launch_combine_pull(const NvlContext& ctx, int num_sms, int64_t num_rows, const CombinePullArgs& a, void* stream) {
  UCCL_ASSERT(a.hidden > 0 && (a.hidden * 2) % 16 == 0, "combine hidden=%d: hidden * 2 bytes must be a multiple of 16",
              a.hidden);
  UCCL_ASSERT(a.num_topk >= 0 && a.num_topk <= kMaxTopk && a.num_topk <= gpu::kWarpSize, "num_topk=%d outside [0, %d]",
              a.num_topk, kMaxTopk);
  UCCL_ASSERT(num_sms > 0 && a.num_lanes > 0, "combine from the buffer needs num_sms > 0 and a handle with lanes");
  const int64_t need = combine_input_bytes(num_rows, a.hidden, a.topk_weights != nullptr ? a.num_topk : 0);
  UCCL_ASSERT(need <= ctx.num_nvl_bytes,
              "combine from the buffer needs %lld NVL bytes for %lld rows but the Buffer has %lld",
              static_cast<long long>(need), static_cast<long long>(num_rows), static_cast<long long>(ctx.num_nvl_bytes));
  const dim3 grid(num_sms), block(kThreadsPerBlock);
  const gpu::Stream st = static_cast<gpu::Stream>(stream);
  with_num_ranks(ctx.num_ranks, "combine", [&](auto n) {
    combine_pull_kernel<decltype(n)::value><<<grid, block, 0, st>>>(ctx, a);
  });
  UCCL_CHECK_GPU(gpu::get_last_error());
}

CeEnter launch_ce_enter(const NvlContext& ctx, int32_t checked, const CePhases& phases, const CeCopies& ce,
                        void* stream) {
  const gpu::Stream st = static_cast<gpu::Stream>(stream);
  if (ce.early == 0) {
    ce_enter_kernel<<<1, kThreadsPerBlock, 0, st>>>(ctx, checked, phases);
    UCCL_CHECK_GPU(gpu::get_last_error());
  }
  UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(ce.entered), st));
  // ce_copies sets `gated` only on an early op and `beside` only on a gated one
  return CeEnter{ce.early != 0 ? 1 : 0, checked, phases, ce.gated, ce.gate, ce.beside};
}

namespace {
/// A copy-engine op's end beside its kernel (CeEnter::beside; one block on the runtime's side stream, after the
/// kernel): ce_op_end as the kernel's last block would run it, for the op's round (nothing moved it since the kernel
/// read it: the done hand-shake here does).
__global__ void __launch_bounds__(gpu::kWarpSize, 1) ce_end_kernel(NvlContext ctx, CeEnter enter, int chunks,
                                                                  DiagPhase phase) {
  __shared__ PullSmem sm;
  ce_op_end(ctx, enter, ce_op_round(ctx, enter), chunks, phase, &sm);
}
}  // namespace

void launch_ce_end_beside(const NvlContext& ctx, const CeCopies& ce, const CeEnter& enter, int chunks,
                          DiagPhase phase, void* stream) {
  UCCL_ASSERT(enter.beside != 0 && ce.end_stream != nullptr, "an op's end beside needs the runtime's side stream");
  UCCL_ASSERT(chunks == 1, "an op's end beside is for polled ops, which copy in one chunk (got %d)", chunks);
  const gpu::Stream side = static_cast<gpu::Stream>(ce.end_stream);
  // Where the op's kernel did not launch, our abort flag goes up first: the end then drains, records and raises the
  // peers' flags, instead of completing the done hand-shake as if the op had run.
  if (!gpu::is_success(gpu::peek_last_error()))
    (void)gpu::stream_write_u32(static_cast<gpu::Stream>(stream), ctx.abort_flag, 1u);
  UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(ce.end_after), static_cast<gpu::Stream>(stream)));
  UCCL_CHECK_GPU(gpu::stream_wait_event(side, static_cast<gpu::Event>(ce.end_after)));
  ce_end_kernel<<<1, gpu::kWarpSize, 0, side>>>(ctx, enter, chunks, phase);  // its launch: checked after the join
  UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(ce.ended), side));
}

void open_gate_if_launch_failed(const NvlContext& ctx, const CeEnter& enter, void* stream) {
  if (enter.gated == 0 || gpu::is_success(gpu::peek_last_error())) return;
  for (int d = 0; d < ctx.num_ranks; ++d)
    if (d != ctx.rank)
      (void)gpu::stream_write_u32(static_cast<gpu::Stream>(stream), sentinel_ready_word(ctx.buffers[ctx.rank], d),
                                  static_cast<uint32_t>(enter.gate));
}

int ce_chunks_before_kernel(int chunks) {
  static const bool blocking = [] {
    for (const char* var : {"CUDA_LAUNCH_BLOCKING", "HIP_LAUNCH_BLOCKING", "AMD_SERIALIZE_KERNEL"}) {
      const char* v = std::getenv(var);
      if (v != nullptr && std::atoi(v) != 0) return true;
    }
    return false;
  }();
  return blocking ? chunks : std::min(chunks, 1);
}

void enqueue_ce_block(const NvlContext& ctx, const CeCopies& ce, int d, char* dst, const char* src, int64_t rows,
                      int64_t row_bytes, int chunks, int shrink_pct, int k_begin, int k_end, int64_t head_rows) {
  if (k_begin >= k_end) return;
  UCCL_ASSERT(head_rows >= 0 && head_rows <= rows, "a copy-engine block of %lld rows with %lld head rows",
              static_cast<long long>(rows), static_cast<long long>(head_rows));
  dst += head_rows * row_bytes;  // the op's kernel stores the first rows (push_ce_head)
  src += head_rows * row_bytes;
  rows -= head_rows;
  const gpu::Stream s = static_cast<gpu::Stream>(ce.streams[d]);
  if (k_begin == 0) {
    // The gate before the op's start: d's side memset (NvlRuntime::note_op; the gate's count: ce_copies) has as a
    // rule set its landing area to the sentinel again long before our op starts, and a stream memory wait enqueued
    // first passes while the caller's earlier work still runs; enqueued after the start's event it was evaluated
    // only once that event completed, and the gated copies started later (docs/intranode.md, "Session 46"). Gated
    // ops are early ops, which never run while a CUDA graph captures (a wait enqueued before the event would not be
    // part of the capture).
    if (ce.gated != 0) {
      void* gate = sentinel_ready_word(ctx.buffers[ctx.rank], d);
      const int r = gpu::stream_wait_u32_geq(s, gate, static_cast<uint32_t>(ce.gate));
      UCCL_ASSERT(r == 0, "a copy stream's wait for rank %d's sentinel failed (error %d)", d, r);
    }
    UCCL_CHECK_GPU(gpu::stream_wait_event(s, static_cast<gpu::Event>(ce.entered)));
  }
  const char* round_word = static_cast<const char*>(ctx.buffers[ctx.rank]) + kOffCeRound;
  int64_t r0 = k_begin > 0 ? ce_chunk_end(rows, k_begin - 1, chunks, shrink_pct) : 0;
  for (int k = k_begin; k < k_end; ++k) {
    const int64_t r1 = ce_chunk_end(rows, k, chunks, shrink_pct);
    if (r1 > r0)
      UCCL_CHECK_GPU(gpu::memcpy_async(dst + r0 * row_bytes, src + r0 * row_bytes,
                                       static_cast<size_t>((r1 - r0) * row_bytes), s));
    // every chunk's flag, empty or not: the peer waits only for the chunks it reads from. The flag copy follows the
    // chunk on one stream, so it starts after the chunk's copy completed; that the chunk's bytes are then visible to
    // the peer's kernel is what the GPU tests check bit for bit (a stream memory-op write would fence explicitly, but
    // bakes its value into a CUDA graph, which replays rounds)
    // Beside: the caller's stream waits for the rows only (x is read until then); the flag is the peer's business
    // (its end waits for it), and ce_round, which the flag copies, moves only once the peer saw it (ce_end_kernel).
    if (ce.beside != 0 && k == chunks - 1) UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(ce.copied[d]), s));
    UCCL_CHECK_GPU(gpu::memcpy_async(ce_ready_words(ctx.buffers[d], ctx.rank) + k, round_word, sizeof(int32_t), s));
    r0 = r1;
  }
  if (k_end == chunks && ce.beside == 0) UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(ce.copied[d]), s));
}

void join_ce_copies(const NvlContext& ctx, const CeCopies& ce, void* stream) {
  for (int d = 0; d < ctx.num_ranks; ++d)
    if (d != ctx.rank)
      UCCL_CHECK_GPU(gpu::stream_wait_event(static_cast<gpu::Stream>(stream), static_cast<gpu::Event>(ce.copied[d])));
}

void launch_combine_ce(const NvlContext& ctx, int num_sms, const CombinePullArgs& a, const CeCopies& ce,
                       void* stream, const LateOutputs& outputs) {
  const int N = ctx.num_ranks, me = ctx.rank, K = a.num_topk;
  UCCL_ASSERT(a.hidden > 0 && (a.hidden * 2) % 16 == 0, "combine hidden=%d: hidden * 2 bytes must be a multiple of 16",
              a.hidden);
  UCCL_ASSERT(K >= 0 && K <= kMaxTopk && K <= gpu::kWarpSize, "num_topk=%d outside [0, %d]", K, kMaxTopk);
  UCCL_ASSERT(num_sms > 0 && a.num_lanes > 0, "a copy-engine combine needs num_sms > 0 and a handle with lanes");
  UCCL_ASSERT(a.ce_chunks >= 1 && a.ce_chunks <= kMaxCeChunks, "copy-engine combine chunks=%d outside [1, %d]",
              a.ce_chunks, kMaxCeChunks);
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int32_t* rp = ce.rank_prefix_host;
  // Every landing area fits (the host checked the same on every rank: ce_landing_bytes).
  for (int d = 0; d < N; ++d) {
    const int64_t need = combine_input_bytes(ce_landing_rows(rp, N, d), a.hidden, K);
    UCCL_ASSERT(need <= ctx.num_nvl_bytes, "a copy-engine combine lands %lld bytes in rank %d's buffer but the Buffer "
                "has %lld", static_cast<long long>(need), d, static_cast<long long>(ctx.num_nvl_bytes));
  }
  UCCL_ASSERT(a.ce_poll == 0 || (a.ce_chunks == 1 && (ce.early == 0 || ce.gated != 0)),
              "a polled copy-engine combine copies in one chunk (got %d) and is early only behind the gate",
              a.ce_chunks);
  UCCL_ASSERT(ce.gated == 0 || (a.ce_poll != 0 && ce.early != 0), "only an early polled combine waits at the gate");
  const CeEnter enter = launch_ce_enter(
      ctx, K | pull_args_hidden(a.hidden) | kPullArgsCe | ((a.ce_chunks - 1) << kPullArgsChunksShift) |
               (a.ce_poll != 0 ? kPullArgsPoll : 0),
      kCombineCePhases, ce, stream);
  const char* x = static_cast<const char*>(a.own_x);
  CeHead head{};  // each block's first rows and their top-k weights, stored by the sum kernel's SMs
  char* dst[kMaxLocalRanks];
  const char* src[kMaxLocalRanks];
  int64_t block_rows[kMaxLocalRanks], head_rows[kMaxLocalRanks];
  for (int i = 1; i < N; ++i) {  // peer d gets back the copies of its tokens we hold: a block of x
    const int d = (me + i) % N;
    const int64_t first = d > 0 ? rp[(d - 1) * N + me] : 0;  // our rows from d: a block of x
    const int64_t rows = rows_sent(rp, N, d, me);
    const int64_t at = ce_block_at(rp, N, d, me);  // where d's landing area holds them
    char* peer = static_cast<char*>(ctx.buffers[d]);
    dst[d] = peer + kOffCombineInput + at * row_bytes;
    src[d] = x + first * row_bytes;
    block_rows[d] = rows;
    head.rows_src[d] = src[d];
    head.rows_dst[d] = dst[d];
    // A polled sum stores no rows of its own ahead of the engines: a polled reader takes the rows as they land,
    // and our SMs' stores to the peer, slow while the engines fill the link, only held up the first tokens' sums
    // (docs/intranode.md, "Session 46"). With chunk flags the first rows still go that way (LandedChunks::head_rows).
    head_rows[d] = a.ce_poll != 0 ? 0 : ce_head_rows(rows, row_bytes, false, N - 1);
    head.rows_16[d] = head_rows[d] * row_bytes / 16;
    if (K > 0 && rows > 0) {
      head.src[d] = reinterpret_cast<const int32_t*>(a.topk_weights + first * K);
      head.dst[d] = reinterpret_cast<int32_t*>(peer + combine_input_weights_offset(ce_landing_rows(rp, N, d),
                                                                                   row_bytes) + at * K * 4);
      head.words[d] = rows * K;
    }
  }
  launch_around_ce_copies(
      ctx, ce, enter, a.ce_chunks, DiagPhase::kCombineCeChunk,
      [&](int d, int k_begin, int k_end) {
        enqueue_ce_block(ctx, ce, d, dst[d], src[d], block_rows[d], row_bytes, a.ce_chunks, kCeCombineShrinkPct,
                         k_begin, k_end, head_rows[d]);
      },
      [&] {
        CombinePullArgs args = a;
        void *out = nullptr, *out_w = nullptr;
        if (outputs && outputs(out, out_w)) {
          args.out = out;
          args.out_topk_weights = static_cast<float*>(out_w);
        } else if (outputs) {  // no outputs: sum no token, still store the head and hand-shake
          args.num_tokens = 0;
          args.out = nullptr;
          args.out_topk_weights = nullptr;
        }
        with_num_ranks(N, "combine", [&](auto n) {
          const dim3 grid(num_sms), block(kThreadsPerBlock);
          const gpu::Stream st = static_cast<gpu::Stream>(stream);
          if (a.ce_poll != 0)
            combine_ce_sum_kernel<decltype(n)::value, true><<<grid, block, 0, st>>>(ctx, args, head, enter);
          else
            combine_ce_sum_kernel<decltype(n)::value, false><<<grid, block, 0, st>>>(ctx, args, head, enter);
        });
      },
      stream);
}

}  // namespace uccl_moe::intranode
