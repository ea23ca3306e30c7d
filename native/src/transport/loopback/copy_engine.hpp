// Copy seam of the loopback transport. Host memory is copied by the CPU now; the internode work adds a GPU
// copy-engine implementation (cudaMemcpyAsync between IPC-mapped buffers, completion by event query) behind the same
// two calls, so the loopback endpoint already treats every copy as asynchronous.
#pragma once

#include <cstdint>
#include <cstring>

namespace uccl_moe::detail {

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  /// Starts copying `bytes` from `src` to `dst`; returns a token for done(). Never blocks on the copy.
  virtual uint64_t submit(void* dst, const void* src, uint64_t bytes) = 0;
  /// True once the copy of `token` (and every earlier one) is visible in `dst`.
  virtual bool done(uint64_t token) = 0;
};

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
