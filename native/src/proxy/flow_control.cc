#include "flow_control.hpp"

#include "uccl_moe/error.hpp"

namespace uccl_moe {

FlowControl::FlowControl(int num_fifos, int64_t max_inflight_bytes, int64_t max_inflight_writes)
    : max_bytes_(max_inflight_bytes), max_writes_(max_inflight_writes), inflight_writes_(size_t(num_fifos), 0) {
  UCCL_ASSERT(max_inflight_bytes >= 0, "max_inflight_bytes=%lld must be >= 0 (0 = unlimited)",
              (long long)max_inflight_bytes);
  UCCL_ASSERT(max_inflight_writes >= 1, "max_inflight_writes=%lld must be >= 1", (long long)max_inflight_writes);
}

bool FlowControl::admit(int fifo, uint64_t idx, uint64_t oldest_incomplete, uint64_t bytes) const {
  if (idx - oldest_incomplete >= uint64_t(max_writes_)) return false;
  if (max_bytes_ > 0 && inflight_bytes_ > 0 && inflight_bytes_ + int64_t(bytes) > max_bytes_) return false;
  (void)fifo;
  return true;
}

void FlowControl::on_post(int fifo, uint64_t bytes) {
  inflight_bytes_ += int64_t(bytes);
  ++inflight_writes_[fifo];
  if (inflight_bytes_ > peak_bytes_) peak_bytes_ = inflight_bytes_;
}

void FlowControl::on_complete(int fifo, uint64_t bytes) {
  inflight_bytes_ -= int64_t(bytes);
  --inflight_writes_[fifo];
  UCCL_CHECK_INTERNAL(inflight_bytes_ >= 0 && inflight_writes_[fifo] >= 0, "flow-control accounting went negative");
}

}  // namespace uccl_moe
