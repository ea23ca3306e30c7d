#include "flow_control.hpp"

#include <cstdlib>

#include "uccl_moe/env.hpp"
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
  (void)fifo;
  // Not the whole command: a write larger than the limit goes in pieces (admitting it whole let one write exceed
  // the limit, which Thor-2 answers with CQE error 12, transport retry counter exceeded: UCCL-EP ep/README.md).
  return admit_piece(piece_bytes(bytes));
}

FlowLimits nic_flow_defaults(const std::string& nic_family, int num_threads) {
  FlowLimits f;
  f.max_inflight_bytes = f.max_inflight_writes = -1;
  if (nic_family == "bnxt_re") {
    // UCCL-EP ep/README.md: Thor-2 needs UCCL_IB_MAX_INFLIGHT_BYTES=1572864 UCCL_IB_MAX_INFLIGHT_NORMAL=1 against CQE
    // error 12; that byte budget is per GPU and divided among its proxy threads (ep/src/proxy.cpp).
    f.max_inflight_bytes = 1572864 / (num_threads > 0 ? num_threads : 1);
    f.max_inflight_writes = 1;
  } else if (nic_family == "mlx5") {
    f.max_inflight_writes = 8;  // UCCL-EP ep/include/common.hpp kMaxInflightNormal
  }
  f.bytes_source = f.writes_source = nic_family + " default";
  return f;
}

FlowLimits resolve_flow_limits(int64_t option_bytes, int64_t option_writes, const std::string& nic_family,
                               int num_threads) {
  const FlowLimits nic = nic_flow_defaults(nic_family, num_threads);
  auto set_in_env = [](const char* var) {
    const char* v = std::getenv(var);
    return v && *v;
  };
  FlowLimits f;
  if (option_bytes >= 0) {
    f.max_inflight_bytes = option_bytes;
    f.bytes_source = "option";
  } else if (set_in_env("UCCL_MOE_MAX_INFLIGHT_BYTES") || nic.max_inflight_bytes < 0) {
    f.max_inflight_bytes = env::MAX_INFLIGHT_BYTES();
    f.bytes_source = set_in_env("UCCL_MOE_MAX_INFLIGHT_BYTES") ? "UCCL_MOE_MAX_INFLIGHT_BYTES" : "knob default";
  } else {
    f.max_inflight_bytes = nic.max_inflight_bytes;
    f.bytes_source = nic.bytes_source;
  }
  if (option_writes >= 0) {
    f.max_inflight_writes = option_writes;
    f.writes_source = "option";
  } else if (set_in_env("UCCL_MOE_MAX_INFLIGHT_WRITES") || nic.max_inflight_writes < 0) {
    f.max_inflight_writes = env::MAX_INFLIGHT_WRITES();
    f.writes_source = set_in_env("UCCL_MOE_MAX_INFLIGHT_WRITES") ? "UCCL_MOE_MAX_INFLIGHT_WRITES" : "knob default";
  } else {
    f.max_inflight_writes = nic.max_inflight_writes;
    f.writes_source = nic.writes_source;
  }
  return f;
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
