// Sender-side flow control of one proxy thread. Commands that would exceed a limit stay in their FIFO (the proxy does
// not read past them), which back-pressures the producer through the FIFO's capacity.
//   bytes   sum of the payload bytes of posted, not yet completed writes of the thread <= max_inflight_bytes
//           (0 = unlimited). A command larger than the limit is posted in pieces of at most the limit
//           (piece_bytes), one piece in flight at a time, so the limit holds for every command.
//   window  per FIFO: command i is posted only while i - oldest_incomplete < max_inflight_writes, where
//           oldest_incomplete is the FIFO's oldest posted command not yet completed (a sliding window, not a count:
//           the sequence-number argument in ordering.hpp relies on it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace uccl_moe {

class FlowControl {
 public:
  FlowControl(int num_fifos, int64_t max_inflight_bytes, int64_t max_inflight_writes);
  /// True if command `idx` of FIFO `fifo` (payload `bytes`) may be posted now; `oldest_incomplete` is the FIFO's
  /// oldest incomplete command (== idx when none is in flight).
  /// A command larger than the byte limit is admitted when its first piece (piece_bytes) fits.
  bool admit(int fifo, uint64_t idx, uint64_t oldest_incomplete, uint64_t bytes) const;
  /// The next piece of a command with `remaining` payload bytes: all of it, or the byte limit if that is smaller.
  uint64_t piece_bytes(uint64_t remaining) const {
    return max_bytes_ > 0 && remaining > uint64_t(max_bytes_) ? uint64_t(max_bytes_) : remaining;
  }
  /// True if a further piece of `bytes` (<= the limit) of an admitted command may be posted now.
  bool admit_piece(uint64_t bytes) const { return max_bytes_ == 0 || inflight_bytes_ + int64_t(bytes) <= max_bytes_; }
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

/// Flow-control limits and where each came from (logged at INFO; `uccl-moe doctor` prints them).
struct FlowLimits {
  int64_t max_inflight_bytes = 0;   ///< per proxy thread, 0 = unlimited
  int64_t max_inflight_writes = 1;  ///< per FIFO
  std::string bytes_source, writes_source;  ///< "option", "UCCL_MOE_...", "<family> default", "knob default"
};

/// The defaults of a NIC family ("bnxt_re", "mlx5", anything else) for a proxy of `num_threads` threads; a limit the
/// family has no opinion on is -1. bnxt_re (Broadcom Thor-2): 1.5 MiB in flight per GPU, split over the proxy
/// threads, and one write per FIFO; mlx5: 8 writes per FIFO (UCCL-EP's defaults, ep/README.md, ep/include/common.hpp).
FlowLimits nic_flow_defaults(const std::string& nic_family, int num_threads);

/// The limits in force: an explicit option (>= 0) wins, then the knob when set in the environment, then the NIC
/// family's default, then the knob's default.
FlowLimits resolve_flow_limits(int64_t option_bytes, int64_t option_writes, const std::string& nic_family,
                               int num_threads);

}  // namespace uccl_moe
