// Self-test of the device-side bounded wait: a kernel waits for a host-mapped flag to reach `expected` and, when
// it does not, reports through the same wait and DiagRecord path the kernels use (wait_reached). Exposed to Python
// (uccl_moe._C.selftest_device_timeout) so the timeout path is proven on each GPU build.
#include <cstring>

#include "uccl_moe/diag_device.cuh"
#include "uccl_moe/error.hpp"

namespace uccl_moe {

namespace {
__global__ void wait_flag_selftest_kernel(const int32_t* flag, int32_t expected, DiagDeviceHandle diag) {
  wait_reached(diag, flag, expected, DiagPhase::kBarrier, DiagRole::kCoordinator, /*peer=*/-1, /*channel=*/0,
               /*command=*/0xdead);
}

void check(gpu::Error e, const char* what) {
  if (e != gpu::kSuccess) UCCL_THROW(kCuda, "%s: %s", what, gpu::error_string(e));
}
}  // namespace

DiagRecord selftest_device_timeout(double timeout_s, int rank, bool peer_aborted) {
  void* host = nullptr;
  check(gpu::host_alloc_mapped(&host, 4096), "host_alloc_mapped");
  std::memset(host, 0, 4096);
  auto* record = static_cast<DiagRecord*>(host);
  auto* abort_flag = reinterpret_cast<int32_t*>(static_cast<char*>(host) + 256);
  auto* flag = reinterpret_cast<int32_t*>(static_cast<char*>(host) + 512);
  if (peer_aborted) *abort_flag = 1;  // as a peer that gave up leaves it
  DiagDeviceHandle h{record, abort_flag, static_cast<uint64_t>(timeout_s * 1e9), rank};
  void *d_record, *d_abort, *d_flag;
  check(gpu::host_device_pointer(&d_record, record), "host_device_pointer");
  check(gpu::host_device_pointer(&d_abort, abort_flag), "host_device_pointer");
  check(gpu::host_device_pointer(&d_flag, flag), "host_device_pointer");
  h.record = static_cast<DiagRecord*>(d_record);
  h.abort_flag = static_cast<int32_t*>(d_abort);
  wait_flag_selftest_kernel<<<1, 1>>>(static_cast<int32_t*>(d_flag), 1, h);
  check(gpu::get_last_error(), "launch wait_flag_selftest_kernel");
  check(gpu::device_synchronize(), "synchronize wait_flag_selftest_kernel");
  DiagRecord out = *record;
  check(gpu::host_free(host), "host_free");
  return out;
}

}  // namespace uccl_moe
