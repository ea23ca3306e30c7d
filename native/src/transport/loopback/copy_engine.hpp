// Copy seam of the loopback transport (CopyEngine: uccl_moe/gpu_memory.hpp). Host memory is copied by the CPU;
// on GPUs the internode runtime supplies a copy-engine implementation (GpuMemoryOps::make_copy_engine). The
// loopback endpoint treats every copy as asynchronous either way.
#pragma once

#include <cstdint>
#include <cstring>

#include "uccl_moe/gpu_memory.hpp"

namespace uccl_moe::detail {

/// Synchronous CPU copy: done() is always true.
class HostCopyEngine : public CopyEngine {
 public:
  uint64_t submit(void* dst, const void* src, uint64_t bytes) override {
    std::memcpy(dst, src, bytes);
    return ++count_;
  }
  bool done(uint64_t token) override { return token <= count_; }

 private:
  uint64_t count_ = 0;
};

}  // namespace uccl_moe::detail
