// How a sender warp moves rows into a ring (or an output) and learns which of them it may publish.
// A mover takes rows in order (push) and answers "rows [0, n) are written" (complete_lagging / complete_all);
// the caller then publishes n with a system-scope release of the ring tail (after a warp sync).
//   WarpCopyMover: the warp copies each row through registers as it is pushed (every build).
//   BulkMover (CUDA sm_90+): lane 0 streams rows through S shared-memory stages of P bytes with the SM's bulk-copy
//     engine: global -> shared loads run up to S/2 pieces ahead of the shared -> global stores, so a warp keeps
//     S * P bytes in flight without holding them in registers (a register copy keeps 4 KB per warp).
// Include only from .cu files.
#pragma once

#include "intranode_device.cuh"

namespace uccl_moe::intranode {

struct WarpCopyMover {
  int rows = 0;
  UCCL_DEVICE_INLINE void push(void* dst, const void* src, int row_bytes) {
    warp_copy_row<8, false>(static_cast<int4*>(dst), static_cast<const int4*>(src), row_bytes / 16);
    ++rows;
  }
  /// The copies are plain stores: every pushed row is written once the warp syncs.
  UCCL_DEVICE_INLINE int complete_lagging() { return rows; }
  UCCL_DEVICE_INLINE int complete_all() { return rows; }
};

#if defined(UCCL_MOE_BULK_COPY)
class BulkMover {
 public:
  /// `region`: this warp's shape.warp_bytes of dynamic shared memory (128-byte aligned). Warp-collective.
  UCCL_DEVICE_INLINE BulkMover(char* region, const BulkShape& shape, int row_bytes)
      : bars_(reinterpret_cast<uint64_t*>(region)),
        dsts_(reinterpret_cast<char**>(region + 8 * kMaxBulkStages)),
        data_(region + kBulkMetaBytes),
        stages_(shape.stages),
        piece_(shape.piece_bytes),
        row_bytes_(row_bytes),
        pieces_((row_bytes + shape.piece_bytes - 1) / shape.piece_bytes),
        ahead_(shape.stages / 2 > 0 ? shape.stages / 2 : 1) {
    if (gpu::lane_id() == 0) {
      for (int s = 0; s < stages_; ++s) gpu::mbar_init(&bars_[s], 1);
      gpu::fence_mbar_init();
    }
    gpu::sync_warp();
  }

  /// Queues the copy of one row (row_bytes, 16-byte aligned at both ends). Warp-collective (lane 0 issues).
  UCCL_DEVICE_INLINE void push(void* dst, const void* src, int /*row_bytes*/) {
    for (int q = 0; q < pieces_; ++q) {
      const uint32_t j = loaded_;
      const int s = static_cast<int>(j % stages_);
      if (j >= static_cast<uint32_t>(stages_)) {
        // Stage s last held piece j - S: its store must have been issued and have finished reading it.
        const uint32_t prev = j - stages_;
        while (stored_ <= prev) issue_store();
        if (gpu::lane_id() == 0) gpu::bulk_wait<true>(static_cast<int>(stored_ - prev - 1));
      }
      if (gpu::lane_id() == 0) {
        const uint32_t bytes = piece_size(q);
        dsts_[s] = static_cast<char*>(dst) + static_cast<int64_t>(q) * piece_;
        gpu::mbar_arrive_expect_tx(&bars_[s], bytes);
        gpu::bulk_load(data_ + static_cast<int64_t>(s) * piece_, static_cast<const char*>(src) + static_cast<int64_t>(q) * piece_,
                       bytes, &bars_[s]);
      }
      ++loaded_;
      while (loaded_ - stored_ > static_cast<uint32_t>(ahead_)) issue_store();
    }
  }
  /// Waits until all rows but the newest whose stores were issued are written; returns how many rows that is
  /// (never fewer than a previous answer). Lane 0 holds the bulk groups; the caller syncs the warp before its
  /// release.
  UCCL_DEVICE_INLINE int complete_lagging() {
    const int issued_rows = static_cast<int>(stored_ / pieces_);
    const int target = issued_rows - 1;
    if (target <= done_rows_) return done_rows_;
    if (gpu::lane_id() == 0) {
      gpu::bulk_wait<false>(static_cast<int>(stored_ - static_cast<uint32_t>(target) * pieces_));
      gpu::fence_proxy_async();
    }
    done_rows_ = target;
    return done_rows_;
  }
  /// Issues every queued store and waits until all pushed rows are written (also what a warp must do before it
  /// leaves: the stages live in the block's shared memory). Returns the rows pushed.
  UCCL_DEVICE_INLINE int complete_all() {
    while (stored_ < loaded_) issue_store();
    if (gpu::lane_id() == 0) {
      gpu::bulk_wait<false>(0);
      gpu::fence_proxy_async();
    }
    done_rows_ = static_cast<int>(loaded_ / pieces_);
    return done_rows_;
  }

 private:
  UCCL_DEVICE_INLINE uint32_t piece_size(int q) const {
    return static_cast<uint32_t>(q + 1 < pieces_ ? piece_ : row_bytes_ - (pieces_ - 1) * piece_);
  }
  /// Stores the oldest loaded piece once its load landed (the load is local: it always completes).
  UCCL_DEVICE_INLINE void issue_store() {
    const uint32_t j = stored_;
    if (gpu::lane_id() == 0) {
      const int s = static_cast<int>(j % stages_);
      const uint32_t parity = (j / stages_) & 1u;
      while (!gpu::mbar_try_wait(&bars_[s], parity)) {
      }
      gpu::bulk_store(dsts_[s], data_ + static_cast<int64_t>(s) * piece_, piece_size(static_cast<int>(j % pieces_)));
      gpu::bulk_commit();
    }
    ++stored_;
  }

  uint64_t* bars_;
  char** dsts_;
  char* data_;
  int stages_, piece_, row_bytes_, pieces_, ahead_;
  uint32_t loaded_ = 0, stored_ = 0;  // pieces whose load / store was issued (warp-uniform)
  int done_rows_ = 0;
};
#endif

/// Lets `kernel` take `bytes` of dynamic shared memory (above the 48 KB default).
void allow_bulk_smem(const void* kernel, int bytes);

/// Index of sender warp (peer, w) among a block's mover warps: the W warps of every remote peer, in peer order.
UCCL_DEVICE_INLINE int mover_index(int peer, int me, int W, int w) { return (peer < me ? peer : peer - 1) * W + w; }

/// Runs `body(mover)` with this warp's mover: a BulkMover over slot `index` of the block's dynamic shared memory
/// when the launch has a bulk shape (and the build has the engine), else a WarpCopyMover. Warp-collective.
template <typename Body>
UCCL_DEVICE_INLINE void with_row_mover(const BulkShape& shape, int index, int row_bytes, Body&& body) {
#if defined(UCCL_MOE_BULK_COPY)
  if (shape.stages > 0) {
    extern __shared__ __align__(128) char bulk_smem[];
    BulkMover mover(bulk_smem + static_cast<int64_t>(index) * shape.warp_bytes, shape, row_bytes);
    body(mover);
    mover.complete_all();  // copies in flight read the block's shared memory: finish them before the warp leaves
    return;
  }
#endif
  WarpCopyMover mover;
  body(mover);
}

/// Dynamic shared memory of a sender block: `movers` warps x shape.warp_bytes.
UCCL_HOST_DEVICE_INLINE int bulk_smem_bytes(const BulkShape& shape, int movers) {
  return shape.stages > 0 ? shape.warp_bytes * movers : 0;
}

}  // namespace uccl_moe::intranode
