// Cross-rank hand-shakes of the intranode kernels that read or write peers' buffers outside the rings (the combine
// from the buffer, combine_pull.cu; the ring-free dispatch, dispatch.cu): a launch-wide "last block" count, a release
// of a round number into a word of every peer's meta, and a bounded wait for every peer's release into ours. The
// words and the round counter are in nvl_layout.hpp (kOffPull*, kOffDirectEnter, kOffCe*); and the copy-engine ops'
// heads stored by their SMs (push_ce_head) and wait for landed heads and chunks (LandedChunks).
#pragma once

#include "intranode_device.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

struct PullSmem {
  int last;     // this block is the last to count itself (last_block)
  int failed;   // a wait of this block expired (wait_peers)
  int aborted;  // the abort flag as thread 0 read it (push_ce_head: one choice per block)
};

/// Called by every thread of every block: counts the block in `counter` (after a GPU-scope fence over the block's
/// earlier writes) and returns true, block-uniform, in the block that completed the count, which also resets it for
/// the next launch.
UCCL_DEVICE_INLINE bool last_block(int32_t* counter, PullSmem* sm) {
  __syncthreads();
  if (threadIdx.x == 0) {
    gpu::fence_gpu();
    const bool last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
    if (last) {
      gpu::fence_gpu();  // acquire side of the count: the other blocks' writes before theirs
      atomicExch(counter, 0);
    }
    sm->last = last ? 1 : 0;
  }
  __syncthreads();
  return sm->last != 0;
}

/// A system-scope fence before a release store that already covers what precedes it: on CUDA none. PTX's release
/// store orders the thread's earlier accesses before it, and through causality order (transitive across morally
/// strong pairs: the block barrier, the GPU-scope counts of last_block and finish_ce_head_block) those of the other
/// threads and blocks that the releasing thread synchronized with (PTX ISA, "Memory Consistency Model": release
/// patterns, causality order). The extra fence.sc.sys lengthened the done hand-shake that ends every op
/// (docs/intranode.md, "Session 48"). On HIP the fence stays: the cumulativity of a wider release over other waves'
/// accesses is what platform.cuh does not trust there, and it has not run on an AMD GPU.
UCCL_DEVICE_INLINE void fence_sys_before_release() {
#if defined(UCCL_MOE_HIP)
  gpu::fence_sys();
#endif
}

/// Thread d of the block (d < N, d != me) releases `round` into word [me] at `off` of rank d's meta; with
/// `arg` >= 0 it first stores it into d's pull_topk[me] (the release covers it): a value every rank must agree on
/// (a pull's top-k weights per row, hidden size and path, diag.hpp kPullArgs*; a dispatch's landing layout).
UCCL_DEVICE_INLINE void release_to_peers(const NvlContext& ctx, size_t off, int32_t round, int32_t arg = -1) {
  const int d = static_cast<int>(threadIdx.x);
  if (d < ctx.num_ranks && d != ctx.rank) {
    if (arg >= 0) meta_ptr(ctx.buffers[d], kOffPullTopk)[ctx.rank] = arg;
    fence_sys_before_release();
    gpu::store_release_sys(meta_ptr(ctx.buffers[d], off) + ctx.rank, round);
  }
}

/// The end of a launch (one block, every thread): where the abort flag is up but no wait of this launch wrote the
/// record, writes one (`drained`, naming `phase`). The flag skips work (a sum, an unpack) without any wait, and where
/// the waits that remain then pass (the peer that gave up still released them) the launch would end as if it had run;
/// the host learns of a failure only from the record.
UCCL_DEVICE_INLINE void record_if_aborted(const NvlContext& ctx, DiagPhase phase) {
  if (threadIdx.x == 0 && gpu::load_volatile(ctx.abort_flag) != 0)
    report_timeout(diag_of(ctx), phase, DiagRole::kLaunchEnd, -1, -1, 0, 0, 0, 0.0);
}

/// Whether peer d released `arg` for this round (our pull_topk[d], stored before its release: read after it was
/// acquired); else an `args_phase` InvalidUsage record naming both values.
UCCL_DEVICE_INLINE bool peer_arg_matches(const NvlContext& ctx, int d, int32_t arg, DiagPhase args_phase) {
  const int32_t theirs = gpu::load_volatile(meta_ptr(ctx.buffers[ctx.rank], kOffPullTopk) + d);
  if (theirs == arg) return true;
  report_timeout(diag_of(ctx), args_phase, DiagRole::kReceiver, d, -1, arg, theirs, 0, 0.0);
  return false;
}

/// One thread's part of wait_peers (below), for peer d: waits until word [d] at `off` of our meta reached `round`
/// (released by rank d: release_to_peers), then with `arg` >= 0 checks that d's value (our pull_topk[d]) is `arg`
/// (else an `args_phase` InvalidUsage record). Returns false on an expiry, an abort or a mismatch.
UCCL_DEVICE_INLINE bool wait_peer(const NvlContext& ctx, int d, size_t off, int32_t round, DiagPhase phase,
                                  int32_t arg, DiagPhase args_phase) {
  void* local = ctx.buffers[ctx.rank];
  if (!wait_reached(diag_of(ctx), meta_ptr<const int32_t>(local, off) + d, round, phase, DiagRole::kReceiver, d, -1))
    return false;
  return arg < 0 || peer_arg_matches(ctx, d, arg, args_phase);
}

/// Called by every thread of a block: thread d (d < N, d != me) waits until word [d] at `off` of our meta reached
/// `round` (wrapping compare); with `arg` >= 0 it then checks that rank d released the same value (else it reports
/// `args_phase`, an InvalidUsage record: for the pull, reading weights d did not stage could leave d's buffer; for
/// the direct dispatch, d would land rows where we do not look). Returns false, block-uniform, if a wait expired,
/// the launch was aborted or the values disagree.
UCCL_DEVICE_INLINE bool wait_peers(const NvlContext& ctx, size_t off, int32_t round, DiagPhase phase, PullSmem* sm,
                                   int32_t arg = -1, DiagPhase args_phase = DiagPhase::kCombinePullArgs) {
  if (threadIdx.x == 0) sm->failed = 0;
  __syncthreads();
  const int d = static_cast<int>(threadIdx.x);
  if (d < ctx.num_ranks && d != ctx.rank && !wait_peer(ctx, d, off, round, phase, arg, args_phase))
    sm->failed = 1;
  __syncthreads();
  return sm->failed == 0;
}

/// The pull's done hand-shake, by the last block of a kernel that read the peers' buffers (every thread): releases
/// `round` into every peer's pull_done and waits for theirs; once all came, the round is this rank's pull_round, and
/// round + 1 goes into ce_round (the flags' value if the next op is an early copy-engine op). Returns whether all
/// came (block-uniform); a wait that expires is reported as `phase` (a copy-engine op's: CePhases::done).
UCCL_DEVICE_INLINE bool pull_done(const NvlContext& ctx, int32_t round, PullSmem* sm,
                                  DiagPhase phase = DiagPhase::kCombinePullDone) {
  release_to_peers(ctx, kOffPullDone, round);
  const bool done = wait_peers(ctx, kOffPullDone, round, phase, sm);
  if (done && threadIdx.x == 0) {
    void* local = ctx.buffers[ctx.rank];
    *meta_ptr(local, kOffPullRound) = round;
    *meta_ptr(local, kOffCeRound) = round + 1;
  }
  return done;
}

/// Whether every peer's count of side memsets reached `gate` (an early polled op: push_ce_head), waited for by one
/// thread; false once that wait expired (a `phase` record) or the op aborted. Out of line: inlined, its loop costs
/// the sum kernel's loops registers.
UCCL_DEVICE_NOINLINE bool ce_gate_open(const NvlContext& ctx, int32_t gate, DiagPhase phase) {
  for (int d = 0; d < ctx.num_ranks; ++d)
    if (d != ctx.rank && !wait_reached(diag_of(ctx), sentinel_ready_word(ctx.buffers[ctx.rank], d), gate, phase,
                                       DiagRole::kSender, d, -1))
      return false;
  return true;
}

/// push_ce_head's column-major source stored row-major (CeHead::transpose_rows, the dispatch's scales): tiles of
/// kCeHeadTileRows tokens by up to kCeHeadTileCols scale indices, each read one scale index at a time along the
/// tokens (coalesced) into shared memory, then written row by row (runs of the tile's columns; one run where a row
/// fits the tile). Every thread of the block takes part (block-wide barriers, block-uniform loop bounds). Returns
/// whether this thread stored anything.
UCCL_DEVICE_INLINE bool store_ce_head_transposed(const NvlContext& ctx, const CeHead& h) {
  __shared__ int32_t tile[kCeHeadTileRows][kCeHeadTileCols + 1];  // + 1: a tile column spans the banks
  const int64_t rows = h.transpose_rows, row_tiles = (rows + kCeHeadTileRows - 1) / kCeHeadTileRows;
  bool stored = false;
#pragma unroll  // constant indices: h's arrays are read from the parameter space, not copied to local memory
  for (int d = 0; d < kMaxLocalRanks; ++d) {
    if (d >= ctx.num_ranks) break;
    const int32_t* src = h.src[d];
    int32_t* dst = h.dst[d];
    const int cols = static_cast<int>(h.words[d] / rows);  // 0 for us and where nothing goes
    const int col_tiles = (cols + kCeHeadTileCols - 1) / kCeHeadTileCols;
    for (int64_t t = blockIdx.x; t < row_tiles * col_tiles; t += gridDim.x) {
      const int64_t r0 = t / col_tiles * kCeHeadTileRows;
      const int c0 = static_cast<int>(t % col_tiles) * kCeHeadTileCols;
      const int n = static_cast<int>(min(static_cast<int64_t>(kCeHeadTileRows), rows - r0));
      const int m = min(kCeHeadTileCols, cols - c0);
      for (int e = static_cast<int>(threadIdx.x); e < m * kCeHeadTileRows; e += static_cast<int>(blockDim.x)) {
        const int j = e / kCeHeadTileRows, rr = e % kCeHeadTileRows;
        if (rr < n) tile[rr][j] = src[(c0 + j) * rows + r0 + rr];
      }
      __syncthreads();
      for (int e = static_cast<int>(threadIdx.x); e < n * m; e += static_cast<int>(blockDim.x), stored = true)
        dst[(r0 + e / m) * cols + c0 + e % m] = tile[e / m][e % m];
      __syncthreads();
    }
  }
  return stored;
}

/// Called by every thread of every block of a copy-engine op, first: stores the op's head for each peer (CeHead:
/// the combine's top-k weights, the dispatch's scales, and the block's first rows, ce_head_rows, none in a polled
/// combine) into that peer's landing area with the SMs, which costs the copy engine nothing (a copy of its own would
/// delay the rows' first chunk by the engine's start) and moves rows while the copy stream still waits to begin, then
/// the last block to finish releases `round` into every peer's ce_head[me] (LandedChunks waits for it before the
/// first row it reads). Each storing thread fences its stores system-wide before the block counts itself (not with
/// `kDeferred`, below).
/// Not after an abort (the enter wait gave up: a peer may still be in an earlier op); the count still completes.
/// `kTransposable`: the launch may ask for the transposed store (CeHead::transpose_rows; the dispatch's gather
/// kernel, whose shared memory then holds the tile). `e.gated` (an early polled op): a peer's landing area holds the
/// sentinel again only once its side memset ended, so each block first waits for every peer's count, as our copy
/// streams do (the gate, CeCopies), bounded (e.phases.sentinel). `kDeferred`: every thread only issues its stores;
/// warp 0 of each block then fences them and counts the block (finish_ce_head_block), while the other warps go on.
template <bool kTransposable = false, bool kDeferred = false>
UCCL_DEVICE_INLINE void push_ce_head(const NvlContext& ctx, const CeHead& h, int32_t round, PullSmem* sm,
                                     const CeEnter& e = CeEnter{}) {
  if (threadIdx.x == 0)
    sm->aborted =
        (e.gated != 0 && !ce_gate_open(ctx, e.gate, e.phases.sentinel)) || gpu::load_volatile(ctx.abort_flag) != 0
            ? 1
            : 0;
  __syncthreads();
  const bool aborted = sm->aborted != 0;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool stored = false;
  const bool transposed = kTransposable && h.transpose_rows > 0;
  if constexpr (kTransposable) {
    if (transposed && !aborted) stored = store_ce_head_transposed(ctx, h);
  }
#pragma unroll  // constant indices: h's arrays are read from the parameter space, not copied to local memory
  for (int d = 0; d < kMaxLocalRanks; ++d) {
    if (d >= ctx.num_ranks || aborted || transposed) break;
    const int32_t* src = h.src[d];
    int32_t* dst = h.dst[d];
    const int64_t n = h.words[d];
    int64_t done = 0;  // 16-B words where both ends allow them, then 4-B words
    if ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0) {
      done = n / 4 * 4;
      for (int64_t i = first; i < n / 4; i += step, stored = true)
        reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
    }
    for (int64_t i = done + first; i < n; i += step, stored = true) dst[i] = src[i];
  }
#pragma unroll
  for (int d = 0; d < kMaxLocalRanks; ++d) {  // the block's first rows: 16-B words, kU loads before their stores
    if (d >= ctx.num_ranks || aborted) break;
    const int4* src = static_cast<const int4*>(h.rows_src[d]);
    int4* dst = static_cast<int4*>(h.rows_dst[d]);
    const int64_t n = h.rows_16[d];
    constexpr int kU = 4;
    for (int64_t i0 = first; i0 < n; i0 += step * kU) {
      int4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i0 + u * step < n) v[u] = src[i0 + u * step];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i0 + u * step < n) dst[i0 + u * step] = v[u];
      stored = true;
    }
  }
  if constexpr (kDeferred) {
    __syncthreads();  // every thread's stores come before warp 0's fence (finish_ce_head_block)
    return;
  }
  if (stored) gpu::fence_sys();
  // Released only if no block skipped its stores: a block that read the abort flag raised did so before it counted
  // itself, so the last block, counting after it, reads it raised too (it is never lowered during an op).
  if (last_block(meta_ptr(ctx.buffers[ctx.rank], kOffPullArrive), sm) && gpu::load_volatile(ctx.abort_flag) == 0)
    release_to_peers(ctx, kOffCeHead, round);
}

/// The end of a deferred push_ce_head, by warp 0 of every block after the barrier that ends it: lane 0 fences the
/// block's head stores system-wide (a fence after a block barrier orders the stores of every thread before it, as a
/// release after __syncthreads does) and counts the block; the last block's warp releases `round` into every peer's
/// ce_head[me] (lane d serves peer d), unless the abort flag is up (push_ce_head's rule). Why: with the copy engines
/// on the link the SMs' stores to a peer take tens of microseconds to complete, and a block whose every thread fences
/// them starts its rows only then (a warp whose rows start late ends late); one fencing lane per block lets the
/// other warps gather meanwhile.
UCCL_DEVICE_INLINE void finish_ce_head_block(const NvlContext& ctx, int32_t round) {
  int32_t* counter = meta_ptr(ctx.buffers[ctx.rank], kOffPullArrive);
  int last = 0;
  if (gpu::lane_id() == 0) {
    gpu::fence_sys();
    last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1 ? 1 : 0;
    if (last) {
      gpu::fence_gpu();  // acquire side of the count: the other blocks' fenced stores before theirs
      atomicExch(counter, 0);
    }
  }
  last = gpu::shfl(last, 0);
  gpu::sync_warp();  // lane 0's acquire (fence_gpu above) covers the other lanes' releases below
  if (last == 0) return;
  const int d = gpu::lane_id();
  if (gpu::load_volatile(ctx.abort_flag) == 0 && d < ctx.num_ranks && d != ctx.rank) {
    fence_sys_before_release();  // lane 0's fence and the count above order the blocks' head stores before it
    gpu::store_release_sys(meta_ptr(ctx.buffers[d], kOffCeHead) + ctx.rank, round);
  }
}

/// Lane d (d < N, d != me) of an early copy-engine op's kernel (CeEnter::early: no enter kernel ran): waits until
/// peer d released this round into our pull_start[d] (it entered the op; every rank's kernel releases it as it
/// starts, ce_release_entry) and compares its value (our pull_topk[d]) with ours (`e.checked`). Returns false on an
/// expiry (reported as `e.phases.start`), an abort or a mismatch (as `e.phases.args`, InvalidUsage; the value is
/// compared since `e.checked` is never negative: every op's checked value leaves bit 31 clear).
UCCL_DEVICE_INLINE bool wait_entered(const NvlContext& ctx, const CeEnter& e, int32_t round, int d) {
  return wait_peer(ctx, d, kOffPullStart, round, e.phases.start, e.checked, e.phases.args);
}

/// The round of a copy-engine op's kernel: the enter kernel advanced pull_round (not early); an early op's is the
/// next one, and pull_round moves when the op ends (ce_op_end).
UCCL_DEVICE_INLINE int32_t ce_op_round(const NvlContext& ctx, const CeEnter& e) {
  return gpu::load_volatile(meta_ptr(ctx.buffers[ctx.rank], kOffPullRound)) + (e.early != 0 ? 1 : 0);
}

/// An early copy-engine op's entry, by block 0 as the kernel starts: the release the enter kernel would have made
/// (the round, with the checked value in the peers' pull_topk[me]).
UCCL_DEVICE_INLINE void ce_release_entry(const NvlContext& ctx, const CeEnter& e, int32_t round) {
  if (e.early != 0 && blockIdx.x == 0) release_to_peers(ctx, kOffPullStart, round, e.checked);
}

/// The end of a copy-engine op (its kernel's last block, every thread): every peer's last chunk landed (its flag
/// follows every copy on the peer's stream; a peer whose rows we never read, or read only in part, may still be
/// copying, and a late chunk would land on what our next op puts there), and in an early op every peer entered with
/// our checked bits (a peer whose rows we never read was not checked yet). Then the pull's done hand-shake. After it
/// every peer's flag copies of this op are done (each waited for our last chunk before its done release), so the
/// next op's round goes into ce_round for the flags of an early next op, and pull_round into the meta. An early op
/// that failed raises every peer's abort flag: its copies may have landed in a peer that runs another op.
UCCL_DEVICE_INLINE void ce_op_end(const NvlContext& ctx, const CeEnter& e, int32_t round, int chunks, DiagPhase phase,
                                  PullSmem* sm) {
  const int d = static_cast<int>(threadIdx.x);
  void* local = ctx.buffers[ctx.rank];
  if (d < ctx.num_ranks && d != ctx.rank && gpu::load_volatile(ctx.abort_flag) == 0) {
    if (e.early == 0 || wait_entered(ctx, e, round, d))
      wait_reached(diag_of(ctx), ce_ready_words(local, d) + chunks - 1, round, phase, DiagRole::kReceiver, d,
                   chunks - 1);
  }
  __syncthreads();
  const bool done = pull_done(ctx, round, sm, e.phases.done);
  if (e.early != 0 && !done && d < ctx.num_ranks && d != ctx.rank)
    gpu::store_release_sys(meta_ptr(ctx.buffers[d], kOffAbortFlag), 1);
  // An early op checks a peer's arguments in a wait for it; where a peer that failed that check raised our flag
  // before any of ours ran, compare what the peers released for this round now (no wait), so that this rank names
  // the mismatch (InvalidUsage) as they do, not only a drained launch.
  if (e.early != 0 && d < ctx.num_ranks && d != ctx.rank && gpu::load_volatile(ctx.abort_flag) != 0 &&
      gpu::load_acquire_sys(meta_ptr<const int32_t>(local, kOffPullStart) + d) == round)
    peer_arg_matches(ctx, d, e.checked, e.phases.args);
  // An early polled op's gate (CeCopies::gate): once every peer left the op, d's count has reached ours unless d
  // failed before its side memset or counts otherwise. Then open it here, so that our copy stream does not wait
  // forever, and fail the op (our rows never reached d).
  if (e.gated != 0 && d < ctx.num_ranks && d != ctx.rank) {
    int32_t* gate = sentinel_ready_word(local, d);
    if (ring_diff(gpu::load_volatile(gate), e.gate) < 0) {
      gpu::store_release_sys(gate, e.gate);
      gpu::store_release_sys(ctx.abort_flag, 1);
    }
  }
  __syncthreads();
  record_if_aborted(ctx, phase);
}

/// A copy-engine op's wait for chunks of peer d's rows (lane d of a warp tracks d): the highest chunk known
/// to have landed, so each lane reads its ce_ready words only when a token needs a later chunk. Before the first
/// row it also waits for d's ce_head word (d's SMs stored its head: push_ce_head), which covers the block's first
/// `head_rows` rows.
struct LandedChunks {
  int64_t rows = 0;   // rows of d's block in our landing area (what we sent d)
  int ready = -2;     // chunks [0, ready] of d's block landed; -2: d's entry and head not waited for yet
  int32_t ready_end = 0;  // the rows of chunks [0, ready]: [0, ready_end) (a block has < 2^31 rows)
  int32_t round = 0;  // this op's round (what d's copy engine writes into ce_ready[d][k])
  bool head = true;   // wait for d's ce_head (push_ce_head) before the first row (false: the caller waited)
  DiagPhase phase = DiagPhase::kCombineCeChunk;  // reported if a wait expires (channel -1: the head)
  int shrink_pct = kCeCombineShrinkPct;          // the op's chunks (ce_chunk_end)
  int32_t head_rows = 0;  // rows [0, head_rows) of d's block came with its head (ce_head_rows), the chunks the rest
  CeEnter enter{};     // an early op (enter.early): before the first row, wait for d's entry (wait_entered)
  /// Warp-collective: returns false (uniform) if a lane's wait for the chunk that holds its row `q` (-1: none, or
  /// our own copy) expired or the launch was aborted.
  UCCL_DEVICE_INLINE bool wait(const NvlContext& ctx, int chunks, int64_t q, int d) {
    bool ok = true;
    // A row below ready_end (or none: q < 0) needs neither a wait nor the chunk arithmetic (a loop and a 64-bit
    // division), which per row would cost about as many instructions as copying a short row.
    if (q >= ready_end) {
      void* local = ctx.buffers[ctx.rank];
      if (ready == -2) {
        if (enter.early != 0) ok = wait_entered(ctx, enter, round, d);
        if (ok && head)
          ok = wait_reached(diag_of(ctx), meta_ptr<const int32_t>(local, kOffCeHead) + d, round, phase,
                            DiagRole::kReceiver, d, -1);
        if (ok) {
          ready = -1;
          ready_end = head_rows;
        }
      }
      if (ok && q >= ready_end) {
        int64_t end = 0;  // chunk `ready`'s rows end at ready_end <= q: q's chunk is a later one
        const int k = ce_chunk_from(q - head_rows, rows - head_rows, chunks, shrink_pct, ready + 1, &end);
        const int32_t* word = ce_ready_words(local, d) + k;
        ok = wait_reached(diag_of(ctx), word, round, phase, DiagRole::kReceiver, d, k);
        if (ok) {  // the copy engine wrote chunk k's word after chunks 0..k on one stream
          ready = k;
          ready_end = static_cast<int32_t>(head_rows + end);
        }
      }
    }
    // The lanes that waited acquired d's rows for the whole warp: a warp barrier orders the other lanes' loads after
    // their acquire.
    gpu::sync_warp();
    return gpu::ballot(!ok) == 0;
  }
};

/// A copy-engine op's launch order, on the host: each peer's first chunks (ce_chunks_before_kernel), then `kernel()`
/// (the op's gather or sum, on `stream`) and, where its launch failed, our gate opened (open_gate_if_launch_failed,
/// for `enter`), then the other chunks, the join, and the launch's error check after all of them (the peers' kernels
/// wait for those chunks, so a stale error raised earlier would leave them waiting).
/// `copies(d, k_begin, k_end)` enqueues chunks [k_begin, k_end) of the block for peer d (enqueue_ce_block).
template <class Copies, class Kernel>
void launch_around_ce_copies(const NvlContext& ctx, const CeCopies& ce, const CeEnter& enter, int chunks,
                             DiagPhase end_phase, const Copies& copies, const Kernel& kernel, void* stream) {
  const int N = ctx.num_ranks, before = ce_chunks_before_kernel(chunks);
  // An error an earlier call left pending is taken now and raised after the join (lost only where this op throws
  // first): then open_gate_if_launch_failed sees only errors of this op's own calls before it, the launch's above
  // all (a stale one would open our gate though the kernel launched).
  const gpu::Error pending_before_op = gpu::get_last_error();
  for (int i = 1; i < N; ++i) copies((ctx.rank + i) % N, 0, before);
  kernel();
  open_gate_if_launch_failed(ctx, enter, stream);
  for (int i = 1; i < N; ++i) copies((ctx.rank + i) % N, before, chunks);
  // After every copy: its side stream's wait for the kernel must not hold later chunks in a shared hardware queue.
  if (ce.beside != 0) launch_ce_end_beside(ctx, ce, enter, chunks, end_phase, stream);
  join_ce_copies(ctx, ce, stream);  // the copies read the caller's tensors until their streams finish
  UCCL_CHECK_GPU(gpu::get_last_error());
  UCCL_CHECK_GPU(pending_before_op);
}

}  // namespace uccl_moe::intranode
