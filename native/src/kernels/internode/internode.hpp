// Host API of the internode HT path (across nodes through the CPU proxy, then NVLink inside the node).
// Torch-free: raw device pointers; uccl_moe/backends/native.py computes the (tiny) layout arithmetic with device
// tensor ops and owns every buffer.
//
// Data flow of a dispatch on N nodes x G GPUs (rank = node * G + local; rail peers share `local`):
//   1. pack      each token is staged once per destination node it needs (per-node deduplication): rows for our
//                own node go straight into our receive area, rows for node n into our send area's segment n.
//   2. post      per remote node, kStripes threads each push the WRITEs of one stripe of the segment and a counter
//                ATOMIC into their own FIFO; the proxy threads copy the stripes into the receive area of our rail
//                peer on node n in parallel.
//   3. wait      the receiver polls the counters the proxy applies (kStripes arrivals per source node per call).
//   4. forward   the receive area is an ordinary token array ("x'": rows from every node of our rail, in node
//                order); the intranode notify/dispatch kernels forward it over NVLink to the local GPUs that hold
//                its experts, writing each row at its final position (row_map) with its origin token index.
// Combine runs the same path backwards: intranode combine into the forwarder's partial rows (reduction inside the
// node), post of each node's partial rows back to their origin, wait, and a final fixed-order reduction over nodes.
//
// Notify: every rank writes its count row into row `rank` of every rank's notify region (WRITE + arrival through
// the proxy) and waits for every other rank's arrival: an all-gather of a few KB, graph-safe and NCCL-free.
// RDMA buffer: [half | half | notify regions]; the two halves have the same layout on every rank. Dispatch: [receive area | send area]; combine:
// [partial rows of x' | partial rows received from other nodes]. Each area holds `cap` rows of every array
// (RdmaLayout); the backend checks the counts against cap.
#pragma once

#include <cstdint>

#include "uccl_moe/diag.hpp"
#include "uccl_moe/fifo_device.cuh"

namespace uccl_moe::internode {

constexpr int kSlotDispatch = 0;  ///< counter slot of dispatch arrivals (one add per source per call)
constexpr int kSlotCombine = 1;   ///< counter slot of combine arrivals
constexpr int kSlotNotify = 2;    ///< counter slot of notify arrivals (every rank writes to every rank)
constexpr int kNumSlots = 3;
/// The last bytes of the RDMA buffer hold the notify rows (two alternating regions); the halves split the rest.
constexpr int64_t kNotifyReserveBytes = 4LL << 20;
constexpr int kMaxNodes = 64;
constexpr uint32_t kMaxCmdBytes = 8u << 20;  ///< payload bytes per WRITE command (< TransferCmd's 16 MiB)
/// A node's segment is posted as this many stripes through different FIFOs (so different proxy threads copy in
/// parallel), each with its own arrival; the receiver waits for all of them.
constexpr int kStripes = 4;

/// What every internode kernel knows (trivially copyable; passed by value).
struct RdmaContext {
  char* rdma_buffer;               ///< this rank's registered buffer (device memory)
  int64_t num_rdma_bytes;
  const int64_t* counters;         ///< device view of the proxy's counters [num_ranks * kCountersPerSrc]
  int64_t* epochs;                 ///< [kNumSlots * num_ranks] arrivals consumed so far per (slot, source)
  const FifoDeviceHandle* fifos;   ///< [num_fifos] device memory
  int32_t num_fifos;
  int32_t rank, num_ranks, ranks_per_node, num_nodes, node, local;
  DiagRecord* diag_record;         ///< shared with the NVL runtime of this rank
  int32_t* abort_flag;
  uint64_t timeout_ns;
};

/// Byte offsets of the arrays of one area (relative to the area start) for `cap` rows.
struct RdmaLayout {
  int64_t cap;             ///< rows per area
  int64_t half_bytes;      ///< bytes of one half (area) of the buffer
  int64_t off_x, off_scales, off_topk, off_weights, off_mask, off_src;
  int32_t row_bytes, num_scales, num_topk, ranks_per_node;
};
/// Dispatch layout (x row, 4-byte scales, int64 node-relative expert ids, float weights, int32 mask bits, int32 source).
RdmaLayout dispatch_layout(int64_t num_rdma_bytes, int row_bytes, int num_scales, int num_topk, int ranks_per_node);
/// Combine layout (bf16 row of `hidden`, float top-k weights).
RdmaLayout combine_layout(int64_t num_rdma_bytes, int hidden, int num_topk);

/// Pointers of the arrays of one area.
struct Area {
  char* x;
  int32_t* scales;
  int64_t* topk;
  float* weights;
  int32_t* mask;   ///< [cap] bit g set = local rank g of the destination node holds one of the row's experts
  int32_t* src;    ///< [cap] token index at the origin rank
};
Area area_of(char* base, const RdmaLayout& l);

struct PackArgs {
  const void* x;                 ///< [T, row_bytes]
  const void* x_scales;          ///< 4-byte scales or null, strided like the intranode dispatch
  int64_t scale_token_stride, scale_hidden_stride;
  const int64_t* topk_idx;       ///< [T, K] global expert ids or null (cached dispatch: rows and scales only)
  const float* topk_weights;     ///< [T, K] or null
  const bool* is_token_in_rank;  ///< [T, R]
  const int32_t* send_pos;       ///< [T, N] row of token t in node n's segment, -1 if it does not go there
  const int64_t* dst_row;        ///< [N] first row of node n's segment (receive area for our node, else send area)
  int32_t num_tokens, num_experts;
  Area recv, send;
  RdmaLayout layout;
};
void launch_rdma_pack(const RdmaContext& ctx, const PackArgs& a, void* stream);

struct PostArray {
  int64_t src_off, dst_off;  ///< byte offsets of the array in our buffer and in the peer's buffer
  int32_t row_bytes;
};
struct PostArgs {
  const int32_t* rows;       ///< [N] rows to send to node n (n = our node is skipped)
  const int64_t* src_row;    ///< [N] first row in our area
  const int64_t* dst_row;    ///< [N] first row in the peer's area
  PostArray arrays[6];
  int32_t num_arrays;
  int32_t slot;              ///< kSlotDispatch / kSlotCombine
  int64_t peer_cap;          ///< rows of the peer's area: a segment that would overflow it is not sent (reported)
};
/// Notify all-gather: row `rank` of the `row_bytes`-wide rows at byte `offset` goes to every other rank (same
/// offset), then waits until every other rank's row arrived.
void launch_rdma_notify(const RdmaContext& ctx, int64_t offset, int row_bytes, void* stream);
/// kStripes threads per remote node each push the WRITEs of one stripe of every array and the stripe's arrival
/// ATOMIC into one FIFO (HT order: the arrival is applied after that FIFO's writes landed).
void launch_rdma_post(const RdmaContext& ctx, const PostArgs& a, void* stream);
/// Waits (bounded) until every remote rail peer's arrival for `slot` of this call landed.
void launch_rdma_wait(const RdmaContext& ctx, int slot, void* stream);
/// Barrier of the rail peers (same local rank on every node) through the proxy: after it, no peer still reads
/// the areas a following post writes into.
void launch_rail_barrier(const RdmaContext& ctx, void* stream);

struct ReduceArgs {
  const int32_t* send_pos;   ///< [T, N]
  const uint64_t* part_x;    ///< [N] address of node n's first partial row (bf16 [*, hidden])
  const uint64_t* part_w;    ///< [N] address of node n's first partial weight row (float [*, K]) or null
  const void* bias0;         ///< [T, hidden] bf16 or null
  const void* bias1;
  int32_t num_tokens, hidden, num_topk, num_nodes;
  void* out;                 ///< [T, hidden] bf16
  float* out_topk_weights;   ///< [T, K] or null
};
/// out[t] = sum over nodes n = 0..N-1 (fixed order) of node n's partial row of t, plus the biases, in float32.
void launch_combine_reduce(const ReduceArgs& a, void* stream);

}  // namespace uccl_moe::internode
