// The GPU-memory side of every fake NIC (the verbs fake and the EFA fake) for the registration tests: the ranges a
// fake treats as device memory (GpuRanges), and a dma-buf exporter (DmabufExporter) that records each export, refuses
// unaligned ranges (the real export works on whole GPU pages) and hands out real fds (of /dev/null) so the caller's
// close() is checked. `Fabric` is the fake's shared state, with a mutex `mu` and the open dma-buf fds in `dmabuf_fds`
// (fd -> bytes).
#pragma once

#include <fcntl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "transport/gpu_mr.hpp"

namespace uccl_moe::test {

/// Address ranges a fake treats as GPU memory (a plain registration of them needs peer-memory support).
struct GpuRanges {
  std::vector<std::pair<uint64_t, size_t>> ranges;  ///< (base, bytes)
  void mark(void* p, size_t bytes) { ranges.emplace_back(uint64_t(reinterpret_cast<uintptr_t>(p)), bytes); }
  bool contains(void* p) const {
    const uint64_t a = uint64_t(reinterpret_cast<uintptr_t>(p));
    for (const auto& [b, n] : ranges)
      if (a >= b && a < b + n) return true;
    return false;
  }
};

template <typename Fabric>
struct DmabufExporter {
  std::shared_ptr<Fabric> fabric;
  bool fail = false;
  std::vector<std::pair<uint64_t, uint64_t>> exports;  ///< (base, bytes)
  int operator()(void* ptr, uint64_t bytes, std::string* why) {
    const uint64_t base = uint64_t(reinterpret_cast<uintptr_t>(ptr));
    exports.emplace_back(base, bytes);
    if (fail || base % detail::kDmabufAlignBytes != 0 || bytes % detail::kDmabufAlignBytes != 0) {
      if (why) *why = "export refused";
      return -1;
    }
    const int fd = open("/dev/null", O_RDONLY);
    std::lock_guard<std::mutex> l(fabric->mu);
    fabric->dmabuf_fds[fd] = bytes;
    return fd;
  }
};

}  // namespace uccl_moe::test
