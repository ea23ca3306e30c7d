// Byte layout of one rank's NVL buffer as the intranode kernels use it (the size math is
// Config::get_nvl_buffer_size_hint in native/src/core/config.cc; its comment in config.hpp is the overview).
//
// Terms: N local ranks; C = num_sms / 2 channels (one sender and one receiver block each); a block has
// kWarpsPerBlock warps; W = kWarpsPerBlock / N "lanes" per channel, so L = C * W lanes in all. A lane is one
// sender warp's contiguous slice of this rank's tokens, for one destination. Every (lane, source rank) pair
// has its own single-producer single-consumer ring at the receiver: Tl = T / W slots (T =
// num_max_nvl_chunked_recv_tokens), so the rings of one channel use exactly the T slots per source that the
// size hint reserves. A sender warp pushes slots and publishes `tail` (in the receiver's meta; in dispatch the
// lane's direct warp releases it for the sender: TailPublisher); the receiver warp copies slots out and publishes
// `head` (in the sender's meta). Both spin only on local memory.
//
// Rounds without a barrier: tail and head count slots since the last reset (notify_dispatch, or prepare_round
// when the channel count changed), modulo 2^32, and are compared by wrapping difference. Each side keeps the
// count it ended the previous round at in its own meta (send_base / recv_base), so a cached dispatch or a
// combine needs no reset and no cross-rank barrier: positions inside a round are relative to the base, and a
// sender's first write of a round waits until the receiver drained the ring (head == send_base), because a
// round may lay out its slots differently (FP8 vs BF16 rows). A lane's ring sits at a fixed byte offset for
// a given channel count (lane_region_bytes, from num_nvl_bytes), whatever the slot size of the round.
// Meta region (first kNvlMetaBytes of the buffer), int32 unless noted:
//   barrier_signal[kMaxLocalRanks]                 +1 by rank p for each barrier it enters (written by p)
//   barrier_epoch                                  barriers this rank entered (local only)
//   abort_flag                                     nonzero once a wait of this rank expired (local only)
//   rank_counts[src][dst]      N x N               tokens src sends to dst (src writes its row into everyone)
//   expert_counts[src][e]      N x kMaxExpertsPerRank  tokens src sends to my local expert e
//   lane_prefix[src][lane]     N x kMaxLanes       inclusive prefix over lanes of tokens src sends me
//   tail[lane][src]            kMaxLanes x N       slots src has published in ring (lane, src) here
//   head[lane][dst]            kMaxLanes x N       slots dst has consumed from my ring (lane, me) there
//   send_base[lane][dst]       kMaxLanes x N       tail I published to dst at the end of my last round (local)
//   recv_base[lane][src]       kMaxLanes x N       head I published to src at the end of my last round (local)
//   pull_*                                         combine from the buffer (below)
// Rings region (from kNvlMetaBytes): lane ring (channel c, src, w) starts at ((c * N + src) * W + w) *
// lane_region_bytes and holds Tl slots of SlotLayout::bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "uccl_moe/config.hpp"

namespace uccl_moe::intranode {

constexpr int kThreadsPerBlock = 768;  // one block per SM; 24 warps (12 on 64-wide AMD), 80 registers each
constexpr int kMaxLanes = 4096;         // C <= 128 channels x W <= 32 lanes

constexpr size_t kOffBarrierSignal = 0;
constexpr size_t kOffBarrierEpoch = kOffBarrierSignal + sizeof(int32_t) * kMaxLocalRanks;
// Abort flag polled by every bounded wait. It lives in GPU memory, not in the host-mapped block, so spinning warps
// never poll host memory over PCIe (that slowed every ring hand-off; docs/benchmarks.md). The host learns of an
// abort from the host-mapped DiagRecord instead. Never cleared: a Buffer whose wait expired stays unusable.
constexpr size_t kOffAbortFlag = kOffBarrierEpoch + 16;
constexpr size_t kOffRankCounts = 128;
constexpr size_t kOffExpertCounts = kOffRankCounts + sizeof(int32_t) * kMaxLocalRanks * kMaxLocalRanks;
constexpr size_t kOffLanePrefix =
    align_up(kOffExpertCounts + sizeof(int32_t) * kMaxLocalRanks * kMaxExpertsPerRank, 4096);
constexpr size_t kOffTail = kOffLanePrefix + sizeof(int32_t) * kMaxLocalRanks * kMaxLanes;
constexpr size_t kOffHead = kOffTail + sizeof(int32_t) * kMaxLocalRanks * kMaxLanes;
constexpr size_t kOffSendBase = kOffHead + sizeof(int32_t) * kMaxLocalRanks * kMaxLanes;
constexpr size_t kOffRecvBase = kOffSendBase + sizeof(int32_t) * kMaxLocalRanks * kMaxLanes;
constexpr size_t kMetaEnd = kOffRecvBase + sizeof(int32_t) * kMaxLocalRanks * kMaxLanes;
// Combine from the buffer (combine_pull.cu): words of the start / end hand-shakes, after the ring meta.
//   pull_start[src]  kMaxLocalRanks   round number src released once its inputs were in its buffer (written by src)
//   pull_done[src]   kMaxLocalRanks   round number src released once it stopped reading every buffer (written by src)
//   pull_round       1                rounds this rank completed (local)
//   pull_arrive      1                blocks of this launch that staged their share (local; reset by the last)
//   pull_leave       1                blocks of this launch that finished reading (local; reset by the last)
//   pull_topk[src]   kMaxLocalRanks   the value src checks with its peers for the round (a pull: top-k weights per
//                                     row, hidden size, path; diag.hpp kPullArgs*; written by src before start)
//   direct_enter[src] kMaxLocalRanks  round number src released when a ring-free dispatch began there (its earlier ops
//                                     are done with its buffer, so peers may write into it; written by src)
// A ring-free dispatch (dispatch.cu) shares the round counter and the other words: pull_start says "my rows are in
// your buffer", pull_done "I stopped reading my buffer".
// The copy-engine combine (combine_pull.cu, launch_combine_ce) shares the round counter and pull_start / pull_topk
// (there pull_start says "my earlier ops are done with my buffer: your copy engine may write into it"), and adds:
//   ce_ready[src][k] kMaxLocalRanks x kMaxCeChunks  round number src's copy engine wrote once chunk k of its rows for
//                                     us landed (written by src's copy engine, after the chunk on the same stream)
//   ce_round         1                the round of this rank's copy-engine combine: the word its copy engine copies
//                                     into the peers' ce_ready (local)
//   ce_head[src]     kMaxLocalRanks   round number src released once its SMs stored its head (the combine's top-k
//                                     weights, the dispatch's scales, the block's first rows: ce_head_rows, none in
//                                     a polled combine) into our
//                                     landing area (written by src)
// A copy-engine dispatch (dispatch_ce.cu) uses the same words. Notify also writes:
//   rank_tokens[src] kMaxLocalRanks   tokens of rank src (written by src; published to the host, for the copy engines)
//   notify_rows[src] kMaxLocalRanks, int64: how src's dispatch lays out its rows (diag.hpp dispatch_rows_code; written
//                                     by src, compared by every rank after notify's second barrier)
//   notify_experts[src] kMaxLocalRanks  num_experts of src's dispatch (written and compared alike)
// And the runtime (nvl_runtime.cu):
//   sentinel_ready[src] kMaxLocalRanks  how many side memsets src has made of its landing area (the polled ops'
//                                     sentinel, NvlRuntime::note_op): written by src's side stream after each, so a
//                                     copy stream that waits for the count (the gate, NvlRuntime::ce_copies) writes
//                                     into src's area only once src set it; our own kernel writes it where an op
//                                     fails (ce_op_end), so that our gate never holds a stream forever
constexpr size_t kOffPullStart = align_up(kMetaEnd, 128);
constexpr size_t kOffPullDone = kOffPullStart + sizeof(int32_t) * kMaxLocalRanks;
constexpr size_t kOffPullTopk = kOffPullDone + sizeof(int32_t) * kMaxLocalRanks;
constexpr size_t kOffPullRound = kOffPullTopk + sizeof(int32_t) * kMaxLocalRanks;
constexpr size_t kOffPullArrive = kOffPullRound + sizeof(int32_t);
constexpr size_t kOffPullLeave = kOffPullArrive + sizeof(int32_t);
constexpr size_t kOffDirectEnter = kOffPullLeave + sizeof(int32_t);
constexpr int kMaxCeChunks = 8;  // chunks of a peer's rows in a copy-engine combine (UCCL_MOE_COMBINE_CE_CHUNKS)
constexpr size_t kOffCeReady = align_up(kOffDirectEnter + sizeof(int32_t) * kMaxLocalRanks, 128);
constexpr size_t kOffCeRound = kOffCeReady + sizeof(int32_t) * kMaxLocalRanks * kMaxCeChunks;
constexpr size_t kOffCeHead = kOffCeRound + sizeof(int32_t);
constexpr size_t kOffRankTokens = align_up(kOffCeHead + sizeof(int32_t) * kMaxLocalRanks, 128);
constexpr size_t kOffNotifyRows = align_up(kOffRankTokens + sizeof(int32_t) * kMaxLocalRanks, 128);
constexpr size_t kOffNotifyExperts = kOffNotifyRows + sizeof(int64_t) * kMaxLocalRanks;
constexpr size_t kOffSentinelReady = align_up(kOffNotifyExperts + sizeof(int32_t) * kMaxLocalRanks, 128);
constexpr size_t kPullMetaEnd = kOffSentinelReady + sizeof(int32_t) * kMaxLocalRanks;
static_assert(kPullMetaEnd <= kNvlMetaBytes, "intranode meta region outgrew kNvlMetaBytes (config.hpp)");
/// Word `src` of the sentinel_ready array in the NVL buffer at `buffer` (kOffSentinelReady): how many side memsets
/// rank src made of its landing area, as src's side stream wrote it there.
UCCL_HOST_DEVICE_FN int32_t* sentinel_ready_word(void* buffer, int src) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(buffer) + kOffSentinelReady) + src;
}
/// Row `src` of the ce_ready array in the NVL buffer at `buffer` (kOffCeReady): word k is the round src's copy engine
/// wrote there after chunk k of its rows landed (the flag copy that follows each chunk).
UCCL_HOST_DEVICE_FN int32_t* ce_ready_words(void* buffer, int src) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(buffer) + kOffCeReady) + src * kMaxCeChunks;
}
/// Where a combine from the buffer finds its inputs: the rows start at the ring region (they replace the rings
/// for the length of the combine), the top-k weights at the next 128-B line after `rows` rows.
constexpr size_t kOffCombineInput = kNvlMetaBytes;
UCCL_HOST_DEVICE_FN constexpr size_t combine_input_weights_offset(int64_t rows, int64_t row_bytes) {
  return align_up(kOffCombineInput + static_cast<size_t>(rows * row_bytes), 128);
}
/// Bytes a combine from the buffer of `rows` rows of `hidden` BF16 values (plus `num_topk` staged weights per row)
/// needs from the buffer's start.
UCCL_HOST_DEVICE_FN constexpr int64_t combine_input_bytes(int64_t rows, int hidden, int num_topk) {
  return static_cast<int64_t>(combine_input_weights_offset(rows, static_cast<int64_t>(hidden) * 2)) +
         rows * num_topk * 4;
}
static_assert(kOffAbortFlag + sizeof(int32_t) <= kOffRankCounts, "barrier words overlap the count matrix");

/// Tokens [begin, kept_split) of a dispatch lane's tokens [begin, end) whose rows this rank keeps go through the
/// sender's direct warp, the rest through the receiver group (dispatch.cu: dispatch_send_direct, KeptRows). The
/// direct warp also releases the lane's tails, so it gets the smaller share: a quarter of rows over 8 KB (BF16 at
/// hidden 7168), three eighths of smaller ones, whose copies hold the releases up less (FP8: the receivers were the
/// slowest role in the phase trace; docs/intranode.md has both A/Bs). Always within [begin, end].
UCCL_HOST_DEVICE_FN constexpr int kept_split(int begin, int end, int row_bytes) {
  return row_bytes > 8192 ? begin + (end - begin + 3) / 4 : begin + (3 * (end - begin) + 7) / 8;
}

// A staged combine's rows (combine_pull.cu) are compacted: rank d's buffer holds only the rows d received from other
// ranks, in receive order without d's own block. rank_prefix [N, N] is the inclusive prefix over source ranks of the
// rows each rank receives (identical on every rank).

/// Rank d's own block of received rows: [begin, begin + count) (the rows d sent itself).
struct OwnBlock {
  int64_t begin, count;
  UCCL_HOST_DEVICE_FN OwnBlock(const int32_t* rank_prefix, int N, int d)
      : begin(d > 0 ? rank_prefix[(d - 1) * N + d] : 0), count(rank_prefix[d * N + d] - begin) {}
};
/// Rows rank d keeps in its buffer for a pull: every row it received, or compacted (`compact`) only those from other
/// ranks.
UCCL_HOST_DEVICE_FN int64_t buffer_rows(const int32_t* rank_prefix, int N, int d, bool compact) {
  const int64_t received = rank_prefix[(N - 1) * N + d];
  return compact ? received - OwnBlock(rank_prefix, N, d).count : received;
}
/// Where rank d's buffer holds its rows from rank me: from rank_prefix[me - 1][d] on, less d's own block when that
/// block comes first and the rows are compacted. For me == d: the start of d's own block (its rows in its x).
UCCL_HOST_DEVICE_FN int64_t our_rows_at(const int32_t* rank_prefix, int N, int me, int d, bool compact) {
  const int64_t from_me = me > 0 ? rank_prefix[(me - 1) * N + d] : 0;
  return compact && me > d ? from_me - OwnBlock(rank_prefix, N, d).count : from_me;
}
/// Index i of the compacted rows (or of their words or weights: `before` and `skip` in the same unit) as an index of
/// the received rows: own.begin rows come first, then the rows after our own.count rows.
UCCL_HOST_DEVICE_FN int64_t staged_to_received(int64_t i, int64_t before, int64_t skip) {
  return i < before ? i : i + skip;
}

// A copy-engine combine (combine_pull.cu, launch_combine_ce) lands in each rank's buffer the copies its tokens got
// back: rank d's landing area holds, for each peer p != d in rank order, the rows d sent to p, in p's receive order
// (p's copy engine moves them in one piece of p's combine input, chunk by chunk). Host and device compute the same
// offsets from rank_prefix.

/// Rows rank d sent to rank p (p's receive block from source d).
UCCL_HOST_DEVICE_FN int64_t rows_sent(const int32_t* rank_prefix, int N, int d, int p) {
  return rank_prefix[d * N + p] - (d > 0 ? rank_prefix[(d - 1) * N + p] : 0);
}
/// First row of peer p's block in rank d's landing area.
UCCL_HOST_DEVICE_FN int64_t ce_block_at(const int32_t* rank_prefix, int N, int d, int p) {
  int64_t at = 0;
  for (int q = 0; q < p; ++q)
    if (q != d) at += rows_sent(rank_prefix, N, d, q);
  return at;
}
/// Rows of rank d's landing area: every row d sent to another rank.
UCCL_HOST_DEVICE_FN int64_t ce_landing_rows(const int32_t* rank_prefix, int N, int d) {
  return ce_block_at(rank_prefix, N, d, N);
}
/// The most rows any rank's landing area holds (ce_landing_rows): the same on every rank.
UCCL_HOST_DEVICE_FN int64_t ce_landing_rows_most(const int32_t* rank_prefix, int N) {
  int64_t most = 0;
  for (int d = 0; d < N; ++d) {
    const int64_t rows = ce_landing_rows(rank_prefix, N, d);
    most = rows > most ? rows : most;
  }
  return most;
}
/// How a copy-engine op's chunks shrink toward the end (ce_chunk_end's `shrink_pct`). The copy engines pay a few
/// microseconds per copy, and the work on the last chunk cannot overlap any copy, so the chunks shrink: the
/// combine's sum halves them (0). The dispatch's gather of rows without scales keeps pace with chunks that shrink
/// faster: 3 chunks of 40% shares left it the same tail as 4 halves with one copy fewer, and since the copies start
/// with the op (early copies) 25% measured faster still; rows with scales (FP8) take 35% shares: the gather reads
/// every row's scales too (one run per row, since every landing area holds them row-major), and at 25% it fell
/// behind as at 50% (docs/intranode.md).
constexpr int kCeCombineShrinkPct = 0;
constexpr int kCeDispatchShrinkPct = 25;
constexpr int kCeDispatchScaledShrinkPct = 35;
/// End of chunk k (of `chunks`) of a block of `rows` rows, the last chunk ending the block. shrink_pct 0: halves,
/// then quarters, ... of what is left, the last chunk taking the rest; else chunk k + 1 holds shrink_pct% of chunk
/// k's rows (ends rounded down). Host and device compute the same integers.
UCCL_HOST_DEVICE_FN int64_t ce_chunk_end(int64_t rows, int k, int chunks, int shrink_pct) {
  if (k >= chunks - 1) return rows;
  if (shrink_pct == 0) return rows - (rows >> (k + 1));
  int64_t w = int64_t{1} << 20, below = 0, total = 0;  // chunk i's weight: 2^20 * (shrink_pct / 100)^i
  for (int i = 0; i < chunks; ++i) {
    total += w;
    if (i <= k) below += w;
    w = w * shrink_pct / 100;
  }
  return rows * below / total;
}
/// The chunk that row q of a block of `rows` rows travels in, searched from chunk `k` on (q is at or after chunk k's
/// start; 0: from the first), and that chunk's end (`*end`): a reader that knows chunks [0, k) landed starts there.
UCCL_HOST_DEVICE_FN int ce_chunk_from(int64_t q, int64_t rows, int chunks, int shrink_pct, int k, int64_t* end) {
  *end = ce_chunk_end(rows, k, chunks, shrink_pct);
  while (q >= *end && k < chunks - 1) *end = ce_chunk_end(rows, ++k, chunks, shrink_pct);
  return k;
}
/// The first rows of a copy-engine op's block that the op's kernel stores into the peer with its SMs as it starts
/// (push_ce_head), ahead of the engines, which start a few microseconds after the kernel (the copy stream waits for
/// the caller's): so the link carries rows from the op's start. The engines' chunks (ce_chunk_end) split the rest of
/// the block. kCeSmHeadBytes of whole rows over all `peers` blocks, at most each block (the size measured fastest:
/// docs/intranode.md, "Session 33"; split over the peers, so that the SMs' stores before their own work stay the same
/// at any EP); none for a dispatch of rows with scales, whose head already stores the scales and whose gather, near
/// the op's critical path, slowed with more stores ahead of it. Every rank computes the same from the block's size.
/// A polled combine stores none (launch_combine_ce; its readers take rows as they land, whoever wrote them).
constexpr int64_t kCeSmHeadBytes = int64_t{4} << 20;
UCCL_HOST_DEVICE_FN int64_t ce_head_rows(int64_t rows, int64_t row_bytes, bool scaled, int peers) {
  if (scaled || row_bytes <= 0 || peers <= 0) return 0;
  const int64_t fit = kCeSmHeadBytes / peers / row_bytes;
  return rows < fit ? rows : fit;
}
/// The copy-engine dispatch's shrink for rows with `num_scales` scales each.
UCCL_HOST_DEVICE_FN int ce_dispatch_shrink_pct(int num_scales) {
  return num_scales > 0 ? kCeDispatchScaledShrinkPct : kCeDispatchShrinkPct;
}
static_assert(kCeDispatchShrinkPct >= 20 && kCeDispatchShrinkPct <= 100 && kCeDispatchScaledShrinkPct >= 20 &&
                  kCeDispatchScaledShrinkPct <= 100,
              "a chunk's weight must stay above 0 over kMaxCeChunks chunks");

/// Where a copy-engine dispatch (dispatch_ce.cu) lands the tokens of every other rank in rank d's buffer: for each
/// source s != d in rank order, all of s's rows (`tokens[s]` of `row_bytes`, in token order: the copy engines move x
/// whole, and d gathers the rows it receives), then their `num_scales` 4-byte scales, row-major [tokens, scales], each
/// piece on a 128-B line. Byte offsets from the buffer's start; -1 for s == d. Returns the end.
UCCL_HOST_DEVICE_FN int64_t ce_dispatch_landing(const int32_t* tokens, int N, int d, int64_t row_bytes,
                                                int num_scales, int64_t* rows_at, int64_t* scales_at) {
  int64_t at = static_cast<int64_t>(kOffCombineInput);
  for (int s = 0; s < N; ++s) {
    rows_at[s] = scales_at[s] = -1;
    if (s == d) continue;
    rows_at[s] = at;
    at = static_cast<int64_t>(align_up(static_cast<size_t>(at + tokens[s] * row_bytes), 128));
    scales_at[s] = at;
    at = static_cast<int64_t>(align_up(static_cast<size_t>(at + int64_t{tokens[s]} * num_scales * 4), 128));
  }
  return at;
}
/// The end of the largest copy-engine dispatch landing area of all N ranks (ce_dispatch_landing): the same on every
/// rank.
UCCL_HOST_DEVICE_FN int64_t ce_dispatch_landing_most(const int32_t* tokens, int N, int64_t row_bytes, int num_scales) {
  int64_t rows_at[kMaxLocalRanks], scales_at[kMaxLocalRanks], most = 0;
  for (int d = 0; d < N; ++d) {
    const int64_t end = ce_dispatch_landing(tokens, N, d, row_bytes, num_scales, rows_at, scales_at);
    most = end > most ? end : most;
  }
  return most;
}

/// Where a ring-free dispatch (dispatch.cu) lands the rows a rank receives from other ranks in its buffer, compacted
/// as a staged combine's: `rows` rows of `row_bytes` from kOffCombineInput, then on 128-B lines the int32 source
/// indices, the int32 local expert ids [rows, K], the float weights [rows, K] and the 4-byte scales [rows, S]. `rows`
/// is the same on every rank (the most any rank receives from others), so every rank computes the same offsets.
struct DirectLanding {
  int64_t rows, src_off, topk_off, weights_off, scales_off, end;
  UCCL_HOST_DEVICE_FN static DirectLanding make(int64_t rows, int64_t row_bytes, int num_topk, int num_scales) {
    DirectLanding d{};
    d.rows = rows;
    d.src_off = static_cast<int64_t>(align_up(kOffCombineInput + static_cast<size_t>(rows * row_bytes), 128));
    d.topk_off = static_cast<int64_t>(align_up(static_cast<size_t>(d.src_off + rows * 4), 128));
    d.weights_off = static_cast<int64_t>(align_up(static_cast<size_t>(d.topk_off + rows * num_topk * 4), 128));
    d.scales_off = static_cast<int64_t>(align_up(static_cast<size_t>(d.weights_off + rows * num_topk * 4), 128));
    d.end = d.scales_off + rows * num_scales * 4;
    return d;
  }
};

/// Where the fields of one ring slot sit (bytes from the slot start). Dispatch slots carry the token row plus
/// its metadata; combine slots carry the row plus the top-k weights.
struct SlotLayout {
  int32_t row_bytes;      ///< x row (hidden * element size), a multiple of 16
  int32_t off_src_idx;    ///< int32 source token index
  int32_t off_topk_idx;   ///< int32 x num_topk local expert ids (-1 = not on this rank)
  int32_t off_weights;    ///< float x num_topk
  int32_t off_scales;     ///< 4-byte x num_scales (float or packed int scales, copied bit-exact)
  int32_t bytes;          ///< slot stride, a multiple of kSlotAlignBytes (128; config.hpp says why)

  static SlotLayout make(int row_bytes, int num_topk, int num_scales) {
    SlotLayout s{};
    s.row_bytes = row_bytes;
    s.off_src_idx = row_bytes;
    s.off_topk_idx = s.off_src_idx + 4;
    s.off_weights = s.off_topk_idx + 4 * num_topk;
    s.off_scales = s.off_weights + 4 * num_topk;
    s.bytes = static_cast<int32_t>(align_up(static_cast<size_t>(s.off_scales + 4 * num_scales), kSlotAlignBytes));
    return s;
  }
};

}  // namespace uccl_moe::intranode
