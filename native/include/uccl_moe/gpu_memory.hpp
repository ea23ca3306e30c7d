// Memory seam between the CPU proxy and a GPU (plain C++; the proxy component never includes a GPU header).
// The internode runtime (native/src/runtime/gpu_memory_ops.cu) fills GpuMemoryOps with CUDA/HIP calls; the proxy,
// its FIFOs and the loopback transport use it when set:
//   - FIFO rings, FIFO tails and the counters move to pinned host memory the GPU maps (alloc_mapped), FIFO heads and
//     tail caches to device memory (alloc_device), so kernels push commands and poll counters directly;
//   - the loopback transport's data region is the caller's GPU buffer, shared with the other processes of the host
//     by IPC handles (export_ipc / open_ipc), and a WRITE is a copy-engine copy (make_copy_engine).
// Host tests fill the same struct with plain host memory to exercise these paths without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace uccl_moe {

/// Asynchronous copies issued by one transport endpoint (one proxy thread).
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  /// Starts copying `bytes` from `src` to `dst`; returns a token for done(). Never blocks on the copy.
  virtual uint64_t submit(void* dst, const void* src, uint64_t bytes) = 0;
  /// True once the copy of `token` (and every earlier one) is visible in `dst`. Throws on a failed copy.
  virtual bool done(uint64_t token) = 0;
};

struct GpuMemoryOps {
  /// Zeroed pinned host memory mapped into the GPU: returns the host pointer and sets *device_view.
  std::function<void*(size_t bytes, void** device_view)> alloc_mapped;
  std::function<void(void* host_ptr)> free_mapped;
  /// Zeroed device memory.
  std::function<void*(size_t bytes)> alloc_device;
  std::function<void(void* ptr)> free_device;
  /// Opaque bytes another process of this host turns into a pointer to `ptr`'s allocation (open_ipc).
  std::function<std::string(void* ptr)> export_ipc;
  std::function<void*(const std::string& handle)> open_ipc;
  std::function<void(void* ptr)> close_ipc;
  /// One copy engine per endpoint; called from the thread that will use it.
  std::function<std::unique_ptr<CopyEngine>()> make_copy_engine;
  /// Exports [ptr, ptr + bytes) (2 MiB aligned) of device memory as a dma-buf fd for the NIC transports' registration;
  /// -1 with *why on failure. Unset: the GPU driver's export (native/src/transport/gpu_mr.hpp gpu_export_dmabuf);
  /// host tests set a fake.
  std::function<int(void* ptr, uint64_t bytes, std::string* why)> export_dmabuf;
};

}  // namespace uccl_moe
