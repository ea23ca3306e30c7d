// GpuMemoryOps (uccl_moe/gpu_memory.hpp) on CUDA/HIP: pinned mapped host memory, device memory, IPC handles and a
// copy engine (one non-blocking stream per proxy thread; completion observed by event queries, never by a wait).
#include "gpu_memory_ops.hpp"

#include <cstring>
#include <deque>
#include <vector>

#include "uccl_moe/error.hpp"
#include "uccl_moe/gpu_check.cuh"
#include "uccl_moe/platform.cuh"

namespace uccl_moe::runtime {

namespace {

class GpuCopyEngine : public CopyEngine {
 public:
  explicit GpuCopyEngine(int device) : device_(device) {
    UCCL_CHECK_GPU(gpu::set_device(device_));  // the proxy thread that owns this engine drives this device
    UCCL_CHECK_GPU(gpu::stream_create_nonblocking(&stream_));
  }
  ~GpuCopyEngine() override {
    gpu::set_device(device_);
    gpu::stream_synchronize(stream_);
    for (auto& p : inflight_) gpu::event_destroy(p.second);
    for (gpu::Event e : free_) gpu::event_destroy(e);
    gpu::stream_destroy(stream_);
  }
  uint64_t submit(void* dst, const void* src, uint64_t bytes) override {
    UCCL_CHECK_GPU(gpu::memcpy_async(dst, src, bytes, stream_));
    gpu::Event e;
    if (free_.empty()) {
      UCCL_CHECK_GPU(gpu::event_create(&e));
    } else {
      e = free_.back();
      free_.pop_back();
    }
    UCCL_CHECK_GPU(gpu::event_record(e, stream_));
    inflight_.emplace_back(++submitted_, e);
    return submitted_;
  }
  bool done(uint64_t token) override {
    // Copies on one stream complete in order: retire events from the front while they report completion.
    while (!inflight_.empty()) {
      const gpu::Error r = gpu::event_query(inflight_.front().second);
      if (r == gpu::kNotReady) break;
      UCCL_CHECK_GPU(r);
      completed_ = inflight_.front().first;
      free_.push_back(inflight_.front().second);
      inflight_.pop_front();
    }
    return token <= completed_;
  }

 private:
  int device_;
  gpu::Stream stream_ = nullptr;
  std::deque<std::pair<uint64_t, gpu::Event>> inflight_;
  std::vector<gpu::Event> free_;
  uint64_t submitted_ = 0, completed_ = 0;
};

}  // namespace

std::shared_ptr<GpuMemoryOps> make_gpu_memory_ops(int device) {
  auto ops = std::make_shared<GpuMemoryOps>();
  ops->alloc_mapped = [device](size_t bytes, void** device_view) -> void* {
    UCCL_CHECK_GPU(gpu::set_device(device));
    void* host = nullptr;
    UCCL_CHECK_GPU(gpu::host_alloc_mapped(&host, bytes));
    std::memset(host, 0, bytes);
    UCCL_CHECK_GPU(gpu::host_device_pointer(device_view, host));
    return host;
  };
  ops->free_mapped = [](void* host) {
    if (host) gpu::host_free(host);
  };
  ops->alloc_device = [device](size_t bytes) -> void* {
    UCCL_CHECK_GPU(gpu::set_device(device));
    void* p = nullptr;
    UCCL_CHECK_GPU(gpu::device_malloc(&p, bytes));
    UCCL_CHECK_GPU(gpu::memset_sync(p, 0, bytes));
    return p;
  };
  ops->free_device = [](void* p) {
    if (p) gpu::device_free(p);
  };
  ops->export_ipc = [device](void* p) -> std::string {
    UCCL_CHECK_GPU(gpu::set_device(device));
    gpu::IpcMemHandle h;
    UCCL_CHECK_GPU(gpu::ipc_get_mem_handle(&h, p));
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  };
  ops->open_ipc = [device](const std::string& handle) -> void* {
    UCCL_ASSERT(handle.size() == sizeof(gpu::IpcMemHandle), "IPC handle of %zu bytes, expected %zu", handle.size(),
                sizeof(gpu::IpcMemHandle));
    UCCL_CHECK_GPU(gpu::set_device(device));
    gpu::IpcMemHandle h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    UCCL_CHECK_GPU(gpu::ipc_open_mem_handle(&p, h));
    return p;
  };
  ops->close_ipc = [](void* p) {
    if (p) gpu::ipc_close_mem_handle(p);
  };
  ops->make_copy_engine = [device]() -> std::unique_ptr<CopyEngine> { return std::make_unique<GpuCopyEngine>(device); };
  return ops;
}

}  // namespace uccl_moe::runtime
