// Cached dispatch through the copy engines (UCCL_MOE_DISPATCH_CE; launch_dispatch_ce). No SM moves a token across
// the link: each rank's copy engines move its whole x (every token, in chunks, each chunk followed by a 4-byte flag
// copy) into every peer's landing area (ce_dispatch_landing), its SMs store its scales there as they start, or
// without scales its first rows (push_ce_head, ce_head_rows: a copy of their own would delay the first chunk by an
// engine start, and the link would idle while the copy stream starts), and num_sms blocks gather
// the rows it receives into its outputs, its own from x at once and a peer's from the landing area once the chunk
// that holds it landed. The handle's recv_src_idx says which token each received row is, so nothing else is needed.
//
// Why whole x: at EP2 with top-8 of 256 experts 99.6% of tokens go to the peer, and a copy engine moves a contiguous
// block at its full pace (about 330 GB/s per GPU with both GPUs sending) where 24 SMs move rows at most at what a
// bare copy reaches (320 GB/s, with nothing else to do). Where few tokens go to a peer the engines move rows nobody
// reads, so the path is on by default only where it measured faster (uccl_moe/tuning.py CE_DISPATCH).
//
// Hand-shakes: the copy-engine combine's (combine_pull.cu): the enter kernel (ce_enter_kernel, pull_start with the
// checked value) before any copy into a peer, or where the op before ended with the done hand-shake none (CeEnter:
// the copies start at once and the gather checks each peer's entry before its rows), and the pull's done hand-shake
// at the end of the gather (a later op may write into the peers' buffers at once).
//
// Polled (UCCL_MOE_DISPATCH_CE_POLL, the default): one copy per peer into a landing area that holds the sentinel
// (NvlRuntime::begin_op), early only behind the gate (CeCopies::gated, as the polled combine); the gather takes each
// row's words as they land (landing_poll.cuh) and a peer's scales once its head landed.
#include <algorithm>

#include "gather_stamps.cuh"
#include "handshake.cuh"
#include "landing_poll.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

namespace {

constexpr int kGatherUnroll = 8;     // 16-B words per lane in each of a row's two buffers (warp_copy_row_pipelined)
constexpr int kGatherThreads = 512;  // per block (one block per SM): fewer warps, each with more bytes in flight
constexpr int kGatherWarps = kGatherThreads / gpu::kWarpSize;
constexpr int kScalesAhead = 2;       // scales per lane loaded ahead of a row's words (56 per row at hidden 7168)
/// Work items per row of the polled gather for rows without scales (BF16: docs/intranode.md, "Session 46", 2 measured
/// faster than 1 and 4); rows with scales (FP8), half as long, gather whole (2 parts measured far slower there).
constexpr int kPolledRowParts = 2;
/// Whether the gather's head is fenced by one warp per block (push_ce_head's kDeferred): the polled gather, on CUDA.
#if defined(UCCL_MOE_HIP)
template <bool kPoll>
constexpr bool kDeferHead = false;
#else
template <bool kPoll>
constexpr bool kDeferHead = kPoll;
#endif

/// Every received row r (our own source's block first: those rows need no wait) from x or from our landing area.
/// `kPoll` (UCCL_MOE_DISPATCH_CE_POLL; one copy per peer, early only behind the gate): the landing area held the
/// sentinel before the peers' copies, and a peer's row is copied as its words land (warp_copy_row_polled) with no
/// wait for its chunk; its scales (which the peer's head carries) once that head landed.
/// `kParts` (polled only): a row is kParts work items, each a run of its 16-B words on its own warp (the first would
/// copy the row's scales; launched only for rows without scales: kPolledRowParts), so that the rows whose words land
/// last, gathered after the copy on the op's critical path, take 1 / kParts of a warp's time each.
template <int kNumRanks, bool kPoll, int kParts = 1>
__global__ void __launch_bounds__(kGatherThreads, 1) dispatch_ce_gather_kernel(NvlContext ctx, DispatchArgs a,
                                                                               CeDispatchPlan p, CeHead head,
                                                                               CeEnter enter) {
  __shared__ PullSmem sm;
  const int N = kNumRanks, me = ctx.rank, lane = gpu::lane_id();
  void* local = ctx.buffers[me];
  UCCL_MOE_STAMP(stamps::begin());
  // The enter kernel advanced the round (where its wait gave up it did not, and the abort flag is up: no gather); an
  // early op releases its entry here (CeEnter).
  const int32_t round = ce_op_round(ctx, enter);
  ce_release_entry(ctx, enter, round);
  // Our scales (row-major) or first rows into the peers' landing areas. Polled: warp 0 of each block fences them and
  // gathers no row, the other warps gather from the start (finish_ce_head_block says why; chunk flags gathered no
  // faster so, since their gather waits for the engines' chunks anyway). Not on HIP yet: there a fence after a
  // workgroup barrier covering the other waves' stores is the case platform.cuh's block-scope hand-off does not
  // trust, and it has not run on an AMD GPU.
  constexpr bool kDefer = kDeferHead<kPoll>;
  push_ce_head<true, kDefer>(ctx, head, round, &sm, enter);
  constexpr int kRowWarps = kDefer ? kGatherWarps - 1 : kGatherWarps;
  const int row_warp = kDefer ? gpu::warp_id() - 1 : gpu::warp_id();
  if (kDefer && row_warp < 0) finish_ce_head_block(ctx, round);
  if (gpu::load_volatile(ctx.abort_flag) == 0 && row_warp >= 0) {
    const int64_t rows = p.recv_start[N], own0 = p.recv_start[me];
    const int S = a.num_scales, num_16 = a.row_bytes / 16;
    LandedChunks landed;
    landed.phase = DiagPhase::kDispatchCeChunk;
    landed.shrink_pct = ce_dispatch_shrink_pct(S);  // S is in the value every rank checks at enter
    if (lane < N && lane != me) {
      landed.rows = p.tokens[lane];
      landed.round = round;
      landed.head_rows = static_cast<int32_t>(ce_head_rows(landed.rows, a.row_bytes, S > 0, N - 1));  // S: alike
      landed.enter = enter;
    }
    auto peek = [&](int d) { return ce_landed_peek(local, d, round, p.chunks); };
    auto settle = [&](int d) {
      return ce_landed_settle(ctx, local, d, round, p.chunks, DiagPhase::kDispatchCeChunk);
    };
    uint32_t settled = 0, heads = 0;  // polled: peers whose copy (take_landed_word) and whose head this warp saw land
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowWarps;
    constexpr int G = kParts;
    const int cw = ((num_16 + G - 1) / G + gpu::kWarpSize - 1) / gpu::kWarpSize * gpu::kWarpSize;
    const int64_t items = rows * G;
    int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + row_warp;
    // Item i: part i % G of row own0 + i / G, wrapped (own0 <= rows). The next item's recv_src_idx entry loads while
    // this one copies.
    auto row_of_item = [&](int64_t j) {
      const int64_t k = G == 1 ? j : j / G;
      return own0 + k < rows ? own0 + k : own0 + k - rows;
    };
    int64_t r_next = G == 1 ? (own0 + i < rows ? own0 + i : own0 + i - rows) : i < items ? row_of_item(i) : 0;
    int32_t src_next = i < items ? a.recv_src_idx[r_next] : 0;
    UCCL_MOE_STAMP(stamps::rows_ready(ctx, local, round, p.chunks));
    for (; i < items; i += stride) {
      const int64_t r = r_next;
      const int part = G == 1 ? 0 : static_cast<int>(i % G);
      if constexpr (G == 1)  // one subtraction, not a 64-bit modulo per row (stride < rows while a next row exists)
        r_next = r + stride < rows ? r + stride : r + stride - rows;
      else if (i + stride < items)
        r_next = row_of_item(i + stride);
      int s = 0;
      while (s < N - 1 && r >= p.recv_start[s + 1]) ++s;
      const int32_t src = src_next;  // the handle's: token src of source s
      UCCL_MOE_STAMP(stamps::row_begins(s != me));
      if (i + stride < items) src_next = a.recv_src_idx[r_next];
      if (kPoll && s != me && ((heads >> s) & 1) == 0) {
        // Once per warp and peer: an early op's peer entered it with our checked bits (CeEnter) before anything of
        // its is taken, and its head, which holds its scales, landed.
        const bool ok =
            lane != s || ((enter.early == 0 || wait_entered(ctx, enter, round, s)) &&
                          (S == 0 || wait_reached(diag_of(ctx), meta_ptr<const int32_t>(local, kOffCeHead) + s, round,
                                                  DiagPhase::kDispatchCeChunk, DiagRole::kReceiver, s, -1)));
        gpu::sync_warp();  // lane s's acquire covers the warp's loads of s's scales
        if (gpu::ballot(!ok) != 0) break;
        heads |= 1u << s;
      }
      if (!kPoll && s != me && !landed.wait(ctx, p.chunks, lane == s ? src : -1, lane)) break;
      int4* dst = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + r * a.row_bytes);
      int32_t* out_scales = static_cast<int32_t*>(a.recv_scales) + r * S;
      // The row's first kScalesAhead scales per lane load before its words, and are stored after them.
      const int32_t* scales = reinterpret_cast<const int32_t*>(static_cast<const char*>(local) + p.scales_at[s]);
      // A peer's scales landed row-major whatever its order (the column-major ones stored transposed).
      const auto scale = [&](int j) {
        return s == me ? scale_at(a, src, j) : gpu::load_ring_32(scales + int64_t{src} * S + j);
      };
      const int S_part = part == 0 ? S : 0;  // the first part of a row copies its scales
      const int c0 = part * cw, n16 = G == 1 ? num_16 : min(num_16 - c0, cw);
      if (G > 1 && n16 <= 0 && S_part == 0) continue;
      int32_t ahead[kScalesAhead];
#pragma unroll
      for (int u = 0; u < kScalesAhead; ++u)
        if (lane + u * gpu::kWarpSize < S_part) ahead[u] = scale(lane + u * gpu::kWarpSize);
      if (s == me) {  // x is not written during the launch
        warp_copy_row_pipelined<kGatherUnroll, false>(
            dst + c0, reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + int64_t{src} * a.row_bytes) + c0,
            n16);
      } else {  // landed by a copy engine during the launch: coherent loads
        const char* from = static_cast<const char*>(local) + p.rows_at[s];
        const int4* row = reinterpret_cast<const int4*>(from + int64_t{src} * a.row_bytes);
        if constexpr (kPoll) {
          if (!warp_copy_row_polled<kGatherUnroll>(dst + c0, row + c0, n16, s, settled, peek, settle)) break;
        } else {
          warp_copy_row_pipelined<kGatherUnroll, true>(dst, row, num_16);
        }
      }
#pragma unroll
      for (int u = 0; u < kScalesAhead; ++u)
        if (lane + u * gpu::kWarpSize < S_part) out_scales[lane + u * gpu::kWarpSize] = ahead[u];
      for (int j = lane + kScalesAhead * gpu::kWarpSize; j < S_part; j += gpu::kWarpSize) out_scales[j] = scale(j);
      UCCL_MOE_STAMP(stamps::row_done(s != me));
    }
  }
  // The engines move tokens nobody here reads too, and the gather waited only for the chunks it read from: the end
  // waits for every peer's last chunk before saying "done".
  // Beside (CeEnter::beside): ce_end_kernel on the side stream ends the op instead.
  if (enter.beside == 0 && last_block(meta_ptr(local, kOffPullLeave), &sm)) {
    UCCL_MOE_STAMP(unsigned long long stamp_t[2]; stamps::last_block_waits(ctx, local, round, p.chunks, stamp_t));
    ce_op_end(ctx, enter, round, p.chunks, DiagPhase::kDispatchCeChunk, &sm);
    UCCL_MOE_STAMP(stamps::end(me, a.row_bytes, kParts, stamp_t));
  }
}

}  // namespace

void launch_dispatch_ce(const NvlContext& ctx, int num_sms, const DispatchArgs& a, const int32_t* rank_tokens,
                        int chunks, const CeCopies& ce, void* stream, const LateOutputs& outputs, bool poll) {
  const int N = ctx.num_ranks, me = ctx.rank;
  const int32_t* rp = ce.rank_prefix_host;
  UCCL_ASSERT(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row bytes %d must be a positive multiple of 16",
              a.row_bytes);
  UCCL_ASSERT(chunks >= 1 && chunks <= kMaxCeChunks, "copy-engine dispatch chunks=%d outside [1, %d]", chunks,
              kMaxCeChunks);
  UCCL_ASSERT(num_sms > 0, "a copy-engine dispatch needs num_sms > 0");
  UCCL_ASSERT(!poll || (chunks == 1 && (ce.early == 0 || ce.gated != 0)),
              "a polled copy-engine dispatch copies in one chunk (got %d) and is early only behind the gate", chunks);
  UCCL_ASSERT(ce.gated == 0 || (poll && ce.early != 0), "only an early polled dispatch waits at the gate");
  UCCL_ASSERT(a.row_map == nullptr && a.num_tokens_ptr == nullptr, "the copy-engine dispatch is intranode only");
  UCCL_ASSERT(a.num_tokens == rank_tokens[me], "x has %d tokens but the handle was made for %d", a.num_tokens,
              rank_tokens[me]);
  // From num_scales, not the pointer: a rank with no tokens has empty scales (address 0) but lays out alike.
  const int S = a.num_scales;
  // The scales land row-major [T, S] in every peer's area: the caller's dense row-major scales as one block,
  // column-major [S, T] ones stored transposed (CeHead::transpose_rows). With at most one token both orders are the
  // same bytes, and an empty tensor's strides say little.
  const bool col = S > 1 && a.scale_token_stride == 1;
  const bool row = (a.scale_hidden_stride == 1 || S == 1) && a.scale_token_stride == S;
  UCCL_ASSERT(S == 0 || a.num_tokens <= 1 || (col ? a.scale_hidden_stride == a.num_tokens : row),
              "the copy-engine dispatch takes dense row- or column-major scales (strides %lld, %lld for %d tokens, "
              "%d scales)", static_cast<long long>(a.scale_token_stride),
              static_cast<long long>(a.scale_hidden_stride), a.num_tokens, S);
  CeDispatchPlan p{};
  for (int s = 0; s < N; ++s) {
    p.tokens[s] = rank_tokens[s];
    p.recv_start[s] = s > 0 ? rp[(s - 1) * N + me] : 0;
  }
  p.recv_start[N] = rp[(N - 1) * N + me];
  p.chunks = chunks;
  UCCL_ASSERT(p.recv_start[N] <= a.num_recv_rows, "the outputs hold %d rows, the handle receives %d",
              a.num_recv_rows, p.recv_start[N]);
  // A rank that receives nothing has an empty recv_src_idx (address 0) and still takes part (it sends).
  UCCL_ASSERT(a.recv_src_idx != nullptr || p.recv_start[N] == 0,
              "the copy-engine dispatch gathers along the handle's recv_src_idx, which is missing");
  // Every rank's landing area ([d][s]: where d holds source s's rows and scales); each fits (the host checked the
  // same on every rank).
  int64_t rows_at[kMaxLocalRanks][kMaxLocalRanks], scales_at[kMaxLocalRanks][kMaxLocalRanks];
  for (int d = 0; d < N; ++d) {
    const int64_t end = ce_dispatch_landing(p.tokens, N, d, a.row_bytes, S, rows_at[d], scales_at[d]);
    UCCL_ASSERT(end <= ctx.num_nvl_bytes, "a copy-engine dispatch lands %lld bytes in rank %d's buffer but the "
                "Buffer has %lld", static_cast<long long>(end), d, static_cast<long long>(ctx.num_nvl_bytes));
  }
  std::copy(rows_at[me], rows_at[me] + N, p.rows_at);
  std::copy(scales_at[me], scales_at[me] + N, p.scales_at);
  // Every rank must lay out its rows alike (size, scales, chunks) and take this path: checked by every peer (the
  // scales' order may differ per rank: every landing area holds them row-major).
  const int32_t checked =
      kCeDispatchArgsMark | (poll ? kCeDispatchArgsPoll : 0) | ((chunks - 1) << 26) | ((S & 0x3FF) << 16) |
      ((a.row_bytes / 16) & 0xFFFF);
  const CeEnter enter = launch_ce_enter(ctx, checked, kDispatchCePhases, ce, stream);
  const int64_t T = a.num_tokens;
  CeHead head{};  // our scales, or without scales our first rows (ce_head_rows), stored by the gather kernel's SMs
  const int shrink = ce_dispatch_shrink_pct(S);  // S: checked at enter
  const int64_t head_rows = ce_head_rows(T, a.row_bytes, S > 0, N - 1);
  for (int i = 1; i < N; ++i) {  // the head into d's area, by the gather kernel's SMs, at its entries for us
    const int d = (me + i) % N;
    if (a.x_scales != nullptr && T * S > 0) {
      head.src[d] = static_cast<const int32_t*>(a.x_scales);
      head.dst[d] = reinterpret_cast<int32_t*>(static_cast<char*>(ctx.buffers[d]) + scales_at[d][me]);
      head.words[d] = T * S;
      // column-major scales land row-major: the gather then reads a row's scales as one run
      head.transpose_rows = col ? static_cast<int32_t>(T) : 0;
    }
    head.rows_src[d] = a.x;
    head.rows_dst[d] = static_cast<char*>(ctx.buffers[d]) + rows_at[d][me];
    head.rows_16[d] = head_rows * a.row_bytes / 16;
  }
  launch_around_ce_copies(
      ctx, ce, enter, chunks, DiagPhase::kDispatchCeChunk,
      [&](int d, int k_begin, int k_end) {  // all of x into d's area, chunked as the peer's gather splits them
        enqueue_ce_block(ctx, ce, d, static_cast<char*>(ctx.buffers[d]) + rows_at[d][me],
                         static_cast<const char*>(a.x), T, a.row_bytes, chunks, shrink, k_begin, k_end,
                         head_rows);
      },
      [&] {
        DispatchArgs args = a;
        if (outputs && !outputs(args.recv_x, args.recv_scales)) {  // no outputs: gather no row, still hand-shake
          args.recv_x = args.recv_scales = nullptr;
          std::fill(p.recv_start, p.recv_start + N + 1, 0);
        }
        with_num_ranks(N, "dispatch", [&](auto n) {
          const dim3 grid(num_sms), block(kGatherThreads);
          const gpu::Stream st = static_cast<gpu::Stream>(stream);
          if (poll && S == 0)
            dispatch_ce_gather_kernel<decltype(n)::value, true, kPolledRowParts>
                <<<grid, block, 0, st>>>(ctx, args, p, head, enter);
          else if (poll)
            dispatch_ce_gather_kernel<decltype(n)::value, true><<<grid, block, 0, st>>>(ctx, args, p, head, enter);
          else
            dispatch_ce_gather_kernel<decltype(n)::value, false><<<grid, block, 0, st>>>(ctx, args, p, head, enter);
        });
      },
      stream);
}

}  // namespace uccl_moe::intranode
