// The memory a proxy registers with its transport: the data region (caller's, the transport's or ours) and the
// counters the receiving proxy applies software atomics to (GPU-mapped in GPU mode, since kernels poll them).
#include <cstdlib>
#include <cstring>

#include "proxy_impl.hpp"

namespace uccl_moe {

namespace {
constexpr size_t kPageBytes = 4096;  ///< our own allocations are page aligned, as transports register pages
size_t page_round(uint64_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }
}  // namespace

void Proxy::Impl::setup_memory() {
  if (opt.data_ptr) {
    data = opt.data_ptr;
  } else {
    data = transport->allocate(MemoryKind::kData, opt.data_bytes);
    if (!data) {
      data = std::aligned_alloc(kPageBytes, page_round(opt.data_bytes));
      UCCL_CHECK_INTERNAL(data != nullptr, "allocating %llu bytes", (unsigned long long)opt.data_bytes);
      std::memset(data, 0, opt.data_bytes);
      own_data = true;
    }
  }
  num_counters = uint64_t(opt.num_ranks) * kCountersPerSrc;
  const size_t counter_bytes = num_counters * sizeof(int64_t);
  if (opt.gpu) {
    // Kernels poll the counters: pinned host memory the GPU maps (the proxy applies software atomics there).
    void* dev = nullptr;
    counters = static_cast<int64_t*>(opt.gpu->alloc_mapped(counter_bytes, &dev));
    UCCL_CHECK_INTERNAL(counters != nullptr, "allocating mapped counters");
    counters_dev = static_cast<int64_t*>(dev);
  } else {
    counters = static_cast<int64_t*>(transport->allocate(MemoryKind::kCounters, counter_bytes));
  }
  if (!counters) {
    counters = static_cast<int64_t*>(std::aligned_alloc(kPageBytes, page_round(counter_bytes)));
    UCCL_CHECK_INTERNAL(counters != nullptr, "allocating counters");
    own_counters = true;
  }
  std::memset(counters, 0, counter_bytes);
  transport->register_memory(MemoryKind::kData, data, opt.data_bytes);
  transport->register_memory(MemoryKind::kCounters, counters, counter_bytes);
}

void Proxy::Impl::free_memory() {
  if (own_data) std::free(data);
  if (own_counters) std::free(counters);
  if (counters_dev && opt.gpu) opt.gpu->free_mapped(counters);
}

}  // namespace uccl_moe
