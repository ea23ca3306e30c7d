// Sender-side flow control of one proxy thread. Commands that would exceed a limit stay in their FIFO (the proxy does
// not read past them), which back-pressures the producer through the FIFO's capacity.
//   bytes   sum of the payload bytes of posted, not yet completed writes of the thread <= max_inflight_bytes
//           (0 = unlimited). A single command larger than the limit is admitted when nothing else is in flight.
//   window  per FIFO: command i is posted only while i - oldest_incomplete < max_inflight_writes, where
//           oldest_incomplete is the FIFO's oldest posted command not yet completed (a sliding window, not a count:
//           the sequence-number argument in ordering.hpp relies on it).
#pragma once

#include <cstdint>
#include <vector>

namespace uccl_moe {

class FlowControl {
 public:
  FlowControl(int num_fifos, int64_t max_inflight_bytes, int64_t max_inflight_writes);
  /// True if command `idx` of FIFO `fifo` (payload `bytes`) may be posted now; `oldest_incomplete` is the FIFO's
  /// oldest incomplete command (== idx when none is in flight).
  bool admit(int fifo, uint64_t idx, uint64_t oldest_incomplete, uint64_t bytes) const;
  void on_post(int fifo, uint64_t bytes);
  void on_complete(int fifo, uint64_t bytes);
  int64_t inflight_bytes() const { return inflight_bytes_; }
  int64_t inflight_writes(int fifo) const { return inflight_writes_[fifo]; }
  int64_t max_inflight_bytes() const { return max_bytes_; }
  int64_t max_inflight_writes() const { return max_writes_; }
  /// High-water marks since construction (exported as counters; tests check them against the limits).
  int64_t peak_bytes() const { return peak_bytes_; }
  int64_t peak_window() const { return peak_window_; }
  void note_window(uint64_t span) {
    if (int64_t(span) > peak_window_) peak_window_ = int64_t(span);
  }

 private:
  int64_t max_bytes_, max_writes_;
  int64_t inflight_bytes_ = 0;
  std::vector<int64_t> inflight_writes_;
  int64_t peak_bytes_ = 0, peak_window_ = 0;
};

}  // namespace uccl_moe
