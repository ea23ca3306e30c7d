// Host API of the intranode (NVLink / xGMI) HT kernels: get_dispatch_layout, notify, dispatch, combine.
// Torch-free: raw device pointers, sizes and a stream handle (`void*` = cudaStream_t / hipStream_t).
// Included by the bindings (plain C++), so nothing here may need a GPU compiler.
//
// Handle fields produced by notify/dispatch (DeepEP-V1 positions; shapes are ours where noted):
//   rank_prefix_matrix [R, R] int32  inclusive prefix over source ranks: [i][j] = tokens ranks 0..i send to j
//   lane_prefix        [R, L] int32  sender side: inclusive prefix over lanes of tokens this rank sends to dst
//   recv_lane_start    [R, L] int32  receiver side: first row of (src, lane) inside src's block of recv_x
//   recv_src_idx       [T_recv] int32 row of each received token in the sender's x
//   is_token_in_rank   [T, R] bool
//   send_head          [T, R] int32  position of token t in its lane's stream to rank r, -1 if not sent
// L = lanes = num_channels * lanes_per_channel (see nvl_layout.hpp); DeepEP's [R, C] channel matrices become
// [R, L] because each sender warp is its own ordered stream.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "uccl_moe/compiler.hpp"
#include "uccl_moe/config.hpp"
#include "uccl_moe/diag.hpp"

namespace uccl_moe::intranode {

/// First word of the rank prefix matrix in NvlContext::recv_counter, then of every rank's token count.
constexpr int kRecvCounterRankPrefix = 4;
constexpr int kRecvCounterRankTokens = kRecvCounterRankPrefix + kMaxLocalRanks * kMaxLocalRanks;

/// What every intranode kernel knows about the buffers (trivially copyable; passed by value).
struct NvlContext {
  void* buffers[8];          ///< NVL buffer of each local rank, mapped into this process; [rank] is ours
  int32_t rank;              ///< local rank
  int32_t num_ranks;         ///< local ranks (== ranks of the group: intranode only)
  int64_t num_nvl_bytes;
  int32_t* recv_counter;     ///< host-mapped (device view): [0] rows this rank receives (-1 = not yet), [1] the
                             ///< most rows any local rank receives, [2] the most any receives from other ranks,
                             ///< [kRecvCounterRankPrefix + i * N + j] the rank prefix matrix,
                             ///< [kRecvCounterRankTokens + s] the tokens of rank s (all written before [0] is
                             ///< released)
  int32_t* expert_counters;  ///< device view of host-mapped per-local-expert receive counts
  DiagRecord* diag_record;   ///< device view of the host-mapped diagnostic record
  int32_t* abort_flag;       ///< abort flag in this rank's NVL buffer meta (GPU memory; see nvl_layout.hpp)
  uint64_t timeout_ns;       ///< bound of every device spin (UCCL_MOE_TIMEOUT_S)
  int32_t diag_rank;         ///< rank named in diagnostics: the global rank (== rank inside one node)
};

/// Lane geometry of one dispatch (and of the combine / cached dispatch that reuse its handle). Computed in one place,
/// NvlRuntime::geometry (make_geometry, then place_lanes for the runtime's buffer); Python reads it from there
/// (IntranodeGeometry) to size the handle's lane matrices and hands it back to every launch, which checks that it
/// was placed for its buffer (check_geometry) instead of recomputing it.
struct Geometry {
  int32_t num_channels;       ///< C = num_sms / 2
  int32_t lanes_per_channel;  ///< W = warps per block / num_ranks
  int32_t channel_slots;      ///< T = num_max_nvl_chunked_recv_tokens: slots per (channel, source) ring
  int32_t lane_slots;         ///< Tl = T / W: slots of one lane's ring
  int32_t chunk_tokens;       ///< tokens a sender writes between two tail publications
  int32_t num_lanes;          ///< L = num_channels * lanes_per_channel
  int64_t lane_region_bytes;  ///< byte stride of the lane rings (fixed per channel count; 0 until placed)
  int32_t num_ranks;          ///< local ranks the rings were placed for (0 until placed)
  int64_t num_nvl_bytes;      ///< NVL buffer size the rings were placed in (0 until placed)
};

/// Which block of a combine launch serves which lane. The lanes, their token ranges and their rings come from the
/// dispatch handle (Geometry); only the assignment of blocks to the two roles is free. The first `senders` blocks
/// push rows: warp w of sender block b serves remote pair p = w * senders + b of the L * (N - 1) pairs (lane
/// p / (N - 1), toward the (p % (N - 1))-th rank other than us), so each block mixes lanes and destinations. The
/// other `receivers` blocks sum: receiver block r serves lanes [first_lane(r), first_lane(r + 1)), the lanes
/// spread evenly, with group(r) warps per lane, each a slice of the columns. SMs whose sender warps a
/// dispatch-shaped split leaves idle (the dst == me warps) can thus be handed to the receivers; the built-in split
/// stays the default since no other measured faster (docs/benchmarks.md).
struct CombineSplit {
  int32_t senders;    ///< S sender blocks (0 when there is no peer)
  int32_t receivers;  ///< R receiver blocks; S + R = Config.num_sms
  int32_t num_lanes;  ///< L
  int32_t peers;      ///< N - 1

  UCCL_HOST_DEVICE_FN int32_t num_pairs() const { return num_lanes * peers; }
  /// Remote pair of sender block b, warp w (>= num_pairs(): that warp is idle).
  UCCL_HOST_DEVICE_FN int32_t pair_of(int32_t b, int32_t w) const { return w * senders + b; }
  UCCL_HOST_DEVICE_FN int32_t pair_lane(int32_t pair) const { return pair / peers; }
  /// Destination rank of a pair, for local rank `me`.
  UCCL_HOST_DEVICE_FN int32_t pair_dst(int32_t pair, int32_t me) const {
    const int32_t j = pair % peers;
    return j < me ? j : j + 1;
  }
  UCCL_HOST_DEVICE_FN int32_t first_lane(int32_t r) const { return r * num_lanes / receivers; }
  UCCL_HOST_DEVICE_FN int32_t lanes_of(int32_t r) const { return first_lane(r + 1) - first_lane(r); }
  /// Warps per lane in receiver block r of `warps_per_block` warps.
  UCCL_HOST_DEVICE_FN int32_t group(int32_t r, int32_t warps_per_block) const { return warps_per_block / lanes_of(r); }
};

/// The combine split of `g` over N ranks: `senders` sender blocks when > 0 (UCCL_MOE_COMBINE_SENDER_SMS), else the
/// built-in choice. Throws InvalidUsage, naming the knob, when the senders' warps cannot cover every pair or the
/// receivers' warps every lane.
CombineSplit combine_split(const Geometry& g, int num_ranks, int senders);

/// Lanes per channel for `num_ranks` local ranks on this build (warps per block / ranks).
int lanes_per_channel(int num_ranks);
/// Validated geometry (throws InvalidUsage naming the Config field to change).
Geometry make_geometry(int num_sms, int num_ranks, int nvl_send_tokens, int nvl_recv_tokens);
/// `g` with lane_region_bytes set for a buffer of `num_nvl_bytes` (the ring region split evenly over the
/// C * N * W lane rings, 128-byte aligned), and the ranks and buffer size it was placed for.
Geometry place_lanes(Geometry g, int num_ranks, int64_t num_nvl_bytes);
/// make_geometry placed for a buffer of `num_nvl_bytes` shared by `num_ranks` ranks: what every op runs on
/// (NvlRuntime::geometry adds the SM count check of its GPU).
Geometry placed_geometry(int num_sms, int num_ranks, int nvl_send_tokens, int nvl_recv_tokens, int64_t num_nvl_bytes);
/// Throws InvalidUsage unless `g` was placed (place_lanes) for ctx's ranks and buffer size: a launch runs on the
/// geometry it is handed and never recomputes it.
void check_geometry(const NvlContext& ctx, const Geometry& g, const char* op);
struct SlotLayout;
/// Bytes of NVL buffer a dispatch/combine with slots of `slot` needs (meta + rings); Buffer's hint is >= this
/// whenever hidden_bytes was computed as hidden * max(element size, 2).
int64_t required_nvl_bytes(const Geometry& g, int num_ranks, const SlotLayout& slot);

struct LayoutArgs {
  const int64_t* topk_idx;         ///< [T, K]; -1 = unused
  int32_t num_tokens, num_topk, num_experts, num_ranks, ranks_per_node;
  int32_t* num_tokens_per_rank;    ///< [R] out
  int32_t* num_tokens_per_node;    ///< [R / ranks_per_node] out, or null
  int32_t* num_tokens_per_expert;  ///< [E] out
  bool* is_token_in_rank;          ///< [T, R] out
  TopkFault* topk_fault = nullptr; ///< host-mapped: the first id outside [-1, E) is recorded here (null = off)
};
void launch_get_dispatch_layout(const LayoutArgs& a, void* stream);
/// The range check of the layout kernel on its own (a dispatch whose topk_idx the layout did not read): records the
/// first id of `topk_idx` [T, K] outside [-1, num_experts) in `fault`. No host sync.
void launch_check_topk_idx(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, TopkFault* fault,
                           void* stream);

struct NotifyArgs {
  const bool* is_token_in_rank;           ///< [T, R]
  const int32_t* num_tokens_per_rank;     ///< [R]
  const int32_t* num_tokens_per_expert;   ///< [E]
  int32_t num_tokens, num_experts, expert_alignment;
  bool write_host_counters;               ///< false with num_worst_tokens (no host wait; graph-safe)
  int32_t* lane_prefix;                   ///< [R, L] out
  int32_t* rank_prefix;                   ///< [R, R] out
  int32_t* recv_lane_start;               ///< [R, L] out
  const int32_t* num_tokens_ptr;          ///< device token count overriding num_tokens (internode forwarders), or null
  int64_t rows_code;                      ///< the dispatch's rows (diag.hpp dispatch_rows_code), compared with every
                                          ///< peer's; 0 = not compared
};
/// Barrier, count exchange, barrier; fills the three matrices and (optionally) the host-mapped counters.
void launch_notify_dispatch(const NvlContext& ctx, const Geometry& g, const NotifyArgs& a, void* stream);
/// Barrier, reset of ring heads/tails and their bases, barrier. Needed only before the first cached dispatch or
/// combine after the channel count changed (the bindings launch it then); otherwise rounds chain without it.
void launch_prepare_round(const NvlContext& ctx, const Geometry& g, void* stream);

struct DispatchArgs {
  const void* x;                 ///< [T, row_bytes]
  const void* x_scales;          ///< 4-byte scales or null; element (t, s) at t*scale_token_stride + s*scale_hidden_stride
  const int64_t* topk_idx;       ///< [T, K] or null
  const float* topk_weights;     ///< [T, K] or null
  const bool* is_token_in_rank;  ///< [T, R]
  const int32_t* rank_prefix;    ///< [R, R]
  const int32_t* recv_lane_start;///< [R, L]
  int32_t num_tokens, row_bytes, num_topk, num_scales, num_experts;
  int64_t scale_token_stride, scale_hidden_stride;
  int32_t num_recv_rows;         ///< rows allocated in the outputs (>= received; num_worst_tokens)
  void* recv_x;                  ///< [rows, row_bytes]
  void* recv_scales;             ///< [rows, S] or null
  int64_t* recv_topk_idx;        ///< [rows, K] or null (rows past the received ones get -1)
  float* recv_topk_weights;      ///< [rows, K] or null (0 where the idx is -1)
  int32_t* recv_src_idx;         ///< [rows] or null (cached)
  int32_t* send_head;            ///< [T, R] or null (cached)
  // Internode forwarding (null inside one node):
  const int32_t* num_tokens_ptr; ///< device token count overriding num_tokens
  const int32_t* row_map;        ///< received row r (in lane order) goes to row row_map[r] of the outputs
  const int32_t* src_tag;        ///< [T] value recorded in recv_src_idx instead of the token index
  // Ring-free dispatch only (launch_dispatch_direct):
  const int32_t* lane_prefix;    ///< [R, L] sender side, inclusive over lanes (the handle's channel_prefix_matrix)
  int64_t landing_rows;          ///< rows every rank's landing area holds (DirectLanding; the same on every rank)
};
void launch_dispatch_intranode(const NvlContext& ctx, const Geometry& g, const DispatchArgs& a, void* stream);
/// The ring-free dispatch: `2 * g.num_channels` blocks push every row straight to where it ends up: rows this rank
/// keeps into the outputs, the others into the receiver's landing area (DirectLanding, compacted); then
/// `unpack_blocks` blocks (the whole GPU: an HBM-bound copy) unpack it into the outputs once every peer's rows are in,
/// and a last hand-shake ends the op when nobody reads a buffer any more. Same outputs, bit for bit, as
/// launch_dispatch_intranode (the handle's lane geometry places the rows); intranode only (no row_map, num_tokens_ptr
/// or src_tag). Every local rank must take it for the call; a rank that does not is named in a dispatch/direct-enter
/// timeout.
void launch_dispatch_direct(const NvlContext& ctx, const Geometry& g, const DispatchArgs& a, int unpack_blocks,
                            void* stream);
/// NVL bytes a ring-free dispatch of `rows` landed rows of `row_bytes` (with `num_topk` ids and weights and
/// `num_scales` scales each) needs from the buffer's start.
int64_t direct_landing_bytes(int64_t rows, int row_bytes, int num_topk, int num_scales);

struct CombineArgs {
  const void* x;                 ///< [rows, hidden] bf16 (rows >= received)
  const float* topk_weights;     ///< [rows, K] or null
  const void* bias0;             ///< [T, hidden] bf16 or null
  const void* bias1;
  const int32_t* rank_prefix;    ///< [R, R]
  const int32_t* recv_lane_start;///< [R, L]
  const int32_t* send_head;      ///< [T, R]
  int32_t num_tokens, hidden, num_topk;
  void* out;                     ///< [T, hidden] bf16
  float* out_topk_weights;       ///< [T, K] or null
  const int32_t* num_tokens_ptr; ///< device token count overriding num_tokens (internode), or null
  const int32_t* row_map;        ///< row r of the dispatch's lane order is row row_map[r] of x (internode), or null
};
void launch_combine_intranode(const NvlContext& ctx, const Geometry& g, const CombineArgs& a, void* stream);

/// Combine from the buffer (combine_pull.cu): every rank's input rows already sit in its own NVL buffer at
/// kOffCombineInput (nvl_layout.hpp, with combine_input_bytes; the caller wrote them there:
/// Buffer.get_combine_buffer), so each rank loads the copies of its tokens where they lie instead of having them
/// pushed through rings. Same sum order and bits as the ring combine. Every local rank must take this path for the
/// same call.
struct CombinePullArgs {
  const float* topk_weights;     ///< [rows, K] or null (staged by the launch next to the rows; peers read them)
  const void* bias0;             ///< [T, hidden] bf16 or null
  const void* bias1;
  const int32_t* rank_prefix;    ///< [R, R]
  const int32_t* lane_prefix;    ///< [R, L] sender side: where this rank's tokens sit among each peer's rows
  const int32_t* send_head;      ///< [T, R]
  int32_t num_tokens, hidden, num_topk;
  int32_t num_lanes;             ///< L of the handle
  void* out;                     ///< [T, hidden] bf16
  float* out_topk_weights;       ///< [T, K] or null; given on every rank alike (topk_weights is null on a rank
                                 ///< that received no rows)
  int32_t staged = 0;            ///< 1: a staged combine (launch_stage_combine_rows put only the other ranks' rows
                                 ///< into each buffer, compacted: without each rank's own block); alike on every rank
  const void* own_x = nullptr;   ///< staged or copy-engine: [rows, hidden] bf16, the caller's x (our own copies; a
                                 ///< copy-engine combine's copy engines read the peers' blocks from it too; null on a
                                 ///< rank with no rows)
  int32_t ce_chunks = 0;         ///< copy-engine combine (launch_combine_ce): chunks per peer block (else unused)
  int32_t ce_poll = 0;           ///< copy-engine combine: 1 = our landing area holds the sentinel (every 32-bit word
                                 ///< all ones) and every peer's rows come in one copy (ce_chunks 1), taken word by
                                 ///< word as they land (NvlRuntime sets the sentinel); alike on every rank
};
/// `num_sms` blocks; `num_rows` = rows this rank's buffer holds (the caller's input rows, or for a staged combine
/// at least the rows staged), checked against the buffer.
void launch_combine_pull(const NvlContext& ctx, int num_sms, int64_t num_rows, const CombinePullArgs& a, void* stream);

/// The first half of a staged combine (a caller's tensor combined from the buffer): copies the rows of `x` [rows,
/// hidden] bf16 that came from other ranks (all but our own block [rank_prefix[me - 1][me], rank_prefix[me][me]))
/// to kOffCombineInput of this rank's buffer, compacted (the rows after our block move up by its length, so the
/// buffer needs room only for the other ranks' rows), where the peers' combine_pull loads them; the pull that follows
/// reads our own copies from x (CombinePullArgs::own_x). `max_rows`: the rows the caller checked the buffer holds
/// (at least this rank's staged rows; never more are written). `grid_blocks` blocks (the whole GPU: this copy is
/// HBM-bound). Ordered before the pull by the stream; the pull's start hand-shake publishes the rows to the peers.
void launch_stage_combine_rows(const NvlContext& ctx, const void* x, int hidden, int64_t max_rows,
                               const int32_t* rank_prefix, int grid_blocks, void* stream);

/// What a copy-engine combine needs from the host: the rank prefix matrix (notify's, published to the host), one
/// stream per peer for its copies, and events (GPU handles as void*, owned by the runtime).
struct CeCopies {
  const int32_t* rank_prefix_host;   ///< [N, N], the handle's (the same on every rank)
  void* streams[kMaxLocalRanks];     ///< [d]: our copy engine's stream for the rows that go back to rank d
  void* entered;                     ///< recorded after the enter hand-shake; every copy stream waits for it
  void* copied[kMaxLocalRanks];      ///< [d]: recorded after d's copies; the caller's stream waits for each
  int32_t early;                     ///< 1: the op before this one on the Buffer ended with the done hand-shake (the
                                     ///< host tracks it, NvlRuntime::ce_copies): no enter kernel, the copies
                                     ///< start at once and the op's kernel checks the peers' entry (CeEnter)
  int32_t gated;                     ///< 1 (an early polled op, NvlRuntime::ce_copies): d's copy stream first waits
  int32_t gate;                      ///< until our sentinel_ready[d] word reached `gate`, d's count of its side
                                     ///< memsets (nvl_layout.hpp; wrapping), i.e. d's landing area holds the sentinel
  int32_t beside;                    ///< 1 (UCCL_MOE_CE_END_BESIDE; an early polled op outside graphs, CUDA): the
                                     ///< op's end (ce_op_end) runs in ce_end_kernel on `end_stream` after `end_after`,
                                     ///< recorded on the caller's stream after the op's kernel; `ended` after it (the
                                     ///< next op waits for it: NvlRuntime::wait_for_sentinel). The copies' `copied`
                                     ///< events are then recorded before each last flag copy.
  void* end_stream;
  void* end_after;
  void* ended;
};
/// What a copy-engine op's hand-shake reports where it fails (DiagRecord::phase): the combine's waits are named
/// after the pull's, whose hand-shake words both ops share; the dispatch's name the dispatch.
struct CePhases {
  DiagPhase start;     ///< waiting for a peer's entry (ce_enter_kernel; an early op's wait_entered)
  DiagPhase done;      ///< waiting for a peer's done release (ce_op_end)
  DiagPhase args;      ///< not a wait: a peer entered with other checked bits (InvalidUsage)
  DiagPhase sentinel;  ///< an early polled op: waiting for a peer's count of side memsets (the gate)
};
constexpr CePhases kCombineCePhases{DiagPhase::kCombinePullStart, DiagPhase::kCombinePullDone,
                                    DiagPhase::kCombinePullArgs, DiagPhase::kCeSentinel};
constexpr CePhases kDispatchCePhases{DiagPhase::kDispatchCeEnter, DiagPhase::kDispatchCeDone,
                                     DiagPhase::kDispatchDirectArgs, DiagPhase::kDispatchCeSentinel};
/// How a copy-engine op's kernel (the gather, the sum) treats the enter hand-shake. Without `early` the enter kernel
/// ran before it (launch_ce_enter) and advanced the round. With `early` there was none: the copies started as soon as
/// the caller's stream reached the op, which is safe because the op before it ended with every rank's done release
/// (nobody reads or writes its landing area any more) and the previous op's kernel left this round in ce_round for
/// the flag copies; the kernel then releases the round with `checked` itself and each warp, before it reads a peer's
/// rows, waits for that peer's release and compares its value with `checked` (LandedChunks).
struct CeEnter {
  int32_t early;
  int32_t checked;
  CePhases phases;
  int32_t gated, gate;  ///< CeCopies': ce_op_end opens the gate where the op failed, so no copy stream waits forever
  int32_t beside;       ///< CeCopies': the kernel leaves ce_op_end to ce_end_kernel
};
/// The copy-engine ops' enter hand-shake. Not early: a one-block kernel on `stream`, then ce.entered recorded after
/// it: every rank releases the round with `checked`, which every rank must agree on (else `phases.args`,
/// InvalidUsage). Early (ce.early): only ce.entered, at once; the op's kernel checks the same (the returned
/// CeEnter).
CeEnter launch_ce_enter(const NvlContext& ctx, int32_t checked, const CePhases& phases, const CeCopies& ce,
                        void* stream);
/// Right after an early polled op's kernel launch (`enter.gated`; launch_around_ce_copies): where the launch failed,
/// the kernel that would open our gate on a failure (ce_op_end) never runs, so the host opens it on `stream` (our
/// count into our own sentinel_ready words), and the join after it does not wait forever for a copy stream held at
/// the gate; the launch's error is raised after the join.
void open_gate_if_launch_failed(const NvlContext& ctx, const CeEnter& enter, void* stream);
/// An op whose end runs beside (`ce.beside`), once its kernel and all its copies are enqueued: `ce.end_after` on
/// `stream` (after the kernel), the side stream waits for it, then ce_end_kernel (ce_op_end for `chunks` and `phase`)
/// there and `ce.ended` after it.
void launch_ce_end_beside(const NvlContext& ctx, const CeCopies& ce, const CeEnter& enter, int chunks,
                          DiagPhase phase, void* stream);
/// A copy-engine op's copies to peer d, on d's copy stream after ce.entered: `rows` rows of `row_bytes` from `src`
/// to `dst` in `chunks` chunks (ce_chunk_end with `shrink_pct`), each followed by a 4-byte copy of our ce_round
/// into d's ce_ready[us][chunk]; ce.copied[d] recorded after them. Chunks [k_begin, k_end) only: the launches
/// enqueue each peer's first chunks, then their kernel, then the rest (ce_chunks_before_kernel). The block's first
/// `head_rows` rows are the kernel's to store (ce_head_rows, CeHead::rows_src): the chunks split the rest.
void enqueue_ce_block(const NvlContext& ctx, const CeCopies& ce, int d, char* dst, const char* src, int64_t rows,
                      int64_t row_bytes, int chunks, int shrink_pct, int k_begin, int k_end, int64_t head_rows);
/// How many of an op's `chunks` chunks per peer the host enqueues before the op's kernel: one, so that the first
/// copy starts at once and the kernel (which has work of its own: the gather's own rows) follows a few microseconds
/// later instead of after every copy's enqueueing, which counts where the host runs behind the GPU. All of them
/// where launches block until their kernel ends (CUDA_LAUNCH_BLOCKING, HIP_LAUNCH_BLOCKING or AMD_SERIALIZE_KERNEL
/// set and not 0): there a kernel enqueued before its peer's later chunks would wait for chunks that peer enqueues
/// only after its own kernel ended. (compute-sanitizer's --force-blocking-launches sets no variable: not with it.)
int ce_chunks_before_kernel(int chunks);
/// A copy-engine op's head per peer, stored by the op's own SMs as it starts (push_ce_head, handshake.cuh) rather
/// than copied by the engine ahead of the rows' first chunk: `words[d]` 4-byte words (the combine's top-k weights, the
/// dispatch's scales) from `src[d]` to `dst[d]` (in peer d's landing area), and the block's first rows (rows_src).
/// Computed on the host.
struct CeHead {
  const int32_t* src[kMaxLocalRanks];
  int32_t* dst[kMaxLocalRanks];
  int64_t words[kMaxLocalRanks];  ///< 0 for us and where there is nothing to send
  /// > 0: src is a column-major [rows, cols] matrix (cols x rows words: cols = words / rows), stored transposed,
  /// row-major, at dst (the dispatch's column-major scales: every peer's landing area holds scales row-major, so
  /// the gather reads a row's scales as one run).
  int32_t transpose_rows;
  /// The first rows of the block for peer d (ce_head_rows of it: `rows_16[d]` 16-B words from `rows_src[d]` to
  /// `rows_dst[d]`, where the block lands in d's area), stored by the SMs as the op starts, while the copy stream
  /// still waits to begin; the engines copy the rest.
  const void* rows_src[kMaxLocalRanks];
  void* rows_dst[kMaxLocalRanks];
  int64_t rows_16[kMaxLocalRanks];
};
/// The transposed store's tile (store_ce_head_transposed): tokens by scale indices, in shared memory.
constexpr int kCeHeadTileRows = 32;
constexpr int kCeHeadTileCols = 128;
/// The outputs of a copy-engine op, allocated once its first copies are enqueued: the caller's allocations then run
/// while the copies do instead of delaying them (in the bench's default mode every microsecond of host time before
/// the copies is a microsecond of the op's time once the host outruns the L2 flush; time after them is hidden).
/// Sets (out0, out1) to the dispatch's (recv_x, recv_scales) or the combine's (out, out_topk_weights) and returns
/// true; false where it could not (the caller's allocation raised): the op then runs to its end writing no output, so
/// the peers' results stay right and the Buffer usable, and the caller raises its error. Empty: the args hold the
/// outputs.
using LateOutputs = std::function<bool(void*& out0, void*& out1)>;
/// The caller's `stream` waits for every peer's copy stream (ce.copied): the copies read the caller's tensors.
void join_ce_copies(const NvlContext& ctx, const CeCopies& ce, void* stream);
/// Combine of a caller's tensor through the copy engines (UCCL_MOE_COMBINE_CE): an enter hand-shake kernel, then per
/// peer d the rows of x that came from d (one block of x) go back into d's landing area (ce_block_at) on d's copy
/// stream, in `a.ce_chunks` chunks each followed by a 4-byte copy of the round into d's ce_ready word; meanwhile
/// `num_sms` blocks store their top-k weights and, with chunk flags (not `a.ce_poll`), the block's first rows
/// (ce_head_rows: the chunks carry the rest) into d's landing area (CeHead) and sum each token's copies (ours from
/// x = own_x, the peers' from our landing area once their head word and, past the head rows, their chunk's word say
/// so; polled: as each word lands), in the same rank order, so the same bits, as every other combine.
/// The caller's stream waits for the copy streams before anything after the combine. The sum ends with the pull's
/// done hand-shake (a later op's ring slots overlap the landing areas).
/// `outputs`: see LateOutputs (a rank without outputs sums no token).
void launch_combine_ce(const NvlContext& ctx, int num_sms, const CombinePullArgs& a, const CeCopies& ce, void* stream,
                       const LateOutputs& outputs = {});

/// A copy-engine dispatch's plan for the gather kernel (computed on the host from the handle's counts as notify
/// published them; the same on every rank).
struct CeDispatchPlan {
  int64_t rows_at[kMaxLocalRanks];         ///< byte offset in our buffer of source s's landed rows (-1: s == us)
  int64_t scales_at[kMaxLocalRanks];       ///< and of its landed scales (ce_dispatch_landing)
  int32_t tokens[kMaxLocalRanks];          ///< tokens of each rank
  int32_t recv_start[kMaxLocalRanks + 1];  ///< our received rows from source s: [recv_start[s], recv_start[s + 1])
  int32_t chunks;                          ///< copies per source (UCCL_MOE_DISPATCH_CE_CHUNKS)
};
/// Cached dispatch through the copy engines (UCCL_MOE_DISPATCH_CE, dispatch_ce.cu): the enter hand-shake, then per
/// peer d on its copy stream x's rows past the head rows in `chunks` chunks (ce_chunk_end over those, shrinking by
/// ce_dispatch_shrink_pct) into d's landing area (ce_dispatch_landing), each chunk followed by a 4-byte copy of the
/// round into d's ce_ready word; meanwhile `num_sms` blocks store our head there (CeHead: the scales, or without
/// scales x's first rows, ce_head_rows) and gather every row we receive into recv_x / recv_scales along
/// a.recv_src_idx (the handle's, read): ours from x, a peer's from our landing area once its head or its chunk
/// landed; then the pull's done
/// hand-shake. The caller's stream waits for the copy streams. `rank_tokens`: every rank's token count (notify's);
/// ce.rank_prefix_host the handle's matrix. Same outputs as the rings.
/// `outputs`: see LateOutputs (a rank without outputs gathers no row). `poll` (UCCL_MOE_DISPATCH_CE_POLL, chunks
/// 1, early only behind the gate, ce.gated): every 32-bit word of our landing area holds the sentinel before the
/// peers' copies (NvlRuntime::begin_op), and the gather copies a peer's rows as their words land, with no wait for a
/// chunk (landing_poll.cuh).
void launch_dispatch_ce(const NvlContext& ctx, int num_sms, const DispatchArgs& a, const int32_t* rank_tokens,
                        int chunks, const CeCopies& ce, void* stream, const LateOutputs& outputs = {},
                        bool poll = false);

/// One-way copy-engine copy of `bytes` from this rank's buffer to `peer`'s (the benchmark's ceiling).
void launch_peer_copy(const NvlContext& ctx, int peer, int64_t bytes, void* stream);

}  // namespace uccl_moe::intranode
