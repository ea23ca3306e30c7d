// Per-rank internode runtime: the registered RDMA buffer (device memory), the CPU proxy that serves it (FIFOs and
// counters in GPU-mapped memory, transport from UCCL_MOE_TRANSPORT), and the kernel context of the internode
// kernels. Diagnostics and the abort flag are shared with the rank's NVL runtime, so one Buffer has one record.
// Lifecycle: construct -> start() on every rank (connects through the store; blocking) -> kernels -> destroy().
// Plain C++ header (the bindings include it without a GPU compiler).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "../kernels/internode/internode.hpp"
#include "nvl_runtime.hpp"
#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/proxy.hpp"

namespace uccl_moe::runtime {

class RdmaRuntime {
 public:
  RdmaRuntime(int rank, int num_ranks, int ranks_per_node, int64_t num_rdma_bytes, int device, const std::string& job,
              std::shared_ptr<KvStore> store, int num_threads = 0);  ///< num_threads 0: UCCL_MOE_PROXY_THREADS
  ~RdmaRuntime();
  RdmaRuntime(const RdmaRuntime&) = delete;
  RdmaRuntime& operator=(const RdmaRuntime&) = delete;

  /// Connects the proxy to every peer (blocking, bounded by UCCL_MOE_TIMEOUT_S) and starts its threads.
  void start();
  void destroy();
  /// Rethrows the proxy's first error (Transport / Timeout naming the lost command), if any.
  void check() const;
  bool failed() const;
  /// Kernel context; diagnostics go to `nvl`'s record and abort flag.
  internode::RdmaContext context(const NvlRuntime& nvl) const;

  uintptr_t buffer() const { return reinterpret_cast<uintptr_t>(buffer_); }
  /// True when the RDMA buffer is host memory the GPU maps (loopback without UCCL_MOE_LOOPBACK_GPU_COPY).
  bool host_staged() const { return host_data_ != nullptr; }
  int64_t num_rdma_bytes() const { return num_rdma_bytes_; }
  const Proxy& proxy() const { return *proxy_; }

 private:
  int rank_, num_ranks_, ranks_per_node_, device_;
  int64_t num_rdma_bytes_;
  std::shared_ptr<GpuMemoryOps> ops_;
  void* buffer_ = nullptr;        ///< what kernels address: device memory, or the device view of host_data_
  void* host_data_ = nullptr;     ///< host-staged mode: the transport's data region, registered with the GPU
  void* fifo_table_ = nullptr;  ///< FifoDeviceHandle[num_fifos] in device memory
  int64_t* epochs_ = nullptr;   ///< device, [kNumSlots * num_ranks]
  std::unique_ptr<Proxy> proxy_;
  bool destroyed_ = false;
};

}  // namespace uccl_moe::runtime
