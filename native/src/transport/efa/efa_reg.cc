// Memory registration of the efa transport: the data region on each opened device, GPU memory through the same
// dma-buf path as ibverbs (gpu_mr.hpp), cut into chunks when the region is larger than the device's max_mr_size.
#include <algorithm>

#include "efa_detail.hpp"
#include "transport/ibverbs/verbs_ops.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {

// The efa kernel driver reports max_mr_size = max_mr_pages x PAGE_SIZE (linux drivers/infiniband/hw/efa/efa_verbs.c
// efa_query_device) and the device refuses an MR of more pages than that (efa_com_register_mr), so a larger region
// is registered as several MRs. Counting in 4 KiB pages makes this conservative for memory mapped with larger pages
// (the driver picks the best page size, ib_umem_find_best_pgsz), which only means a few more chunks. Chunks are
// whole 2 MiB GPU pages so each one is exported as a dma-buf on its own (gpu_mr.hpp plan_chunks).
uint64_t efa_chunk_bytes(uint64_t max_mr_size, uint64_t region_bytes, const std::string& device) {
  if (max_mr_size == 0 || region_bytes <= max_mr_size) return 0;
  const uint64_t chunk = max_mr_size / kDmabufAlignBytes * kDmabufAlignBytes;
  if (chunk == 0)
    UCCL_THROW(kTransport, "efa %s: the device's max_mr_size (%llu bytes) is below one %llu-byte GPU page, so a "
               "%llu-byte region cannot be registered in chunks; use a smaller RDMA buffer (num_rdma_bytes)",
               device.c_str(), (unsigned long long)max_mr_size, (unsigned long long)kDmabufAlignBytes,
               (unsigned long long)region_bytes);
  return chunk;
}

EfaRegion register_efa_region(VerbsOps& ops, ibv_pd* pd, void* ptr, uint64_t bytes, int access, bool gpu,
                              uint64_t chunk_bytes, const DmabufExport& export_fn, const std::string& device) {
  EfaRegion r;
  const uint64_t addr = uint64_t(reinterpret_cast<uintptr_t>(ptr));
  if (gpu) {
    // The ibverbs transport's order and errors (gpu_mr.hpp): dma-buf (EFA supports ibv_reg_dmabuf_mr: rdma-core
    // providers/efa/verbs.c efa_reg_dmabuf_mr; libfabric prov/efa/src/efa_mr.c registers CUDA memory through it),
    // then ibv_reg_mr with a peer-memory module (efa_nv_peermem), then an error naming both.
    try {
      if (chunk_bytes == 0) {
        ibv_mr* mr = register_gpu_memory(ops, pd, ptr, bytes, access, export_fn, &r.method);
        r.mrs.push_back(GpuMrChunk{addr, bytes, mr});
      } else {
        r.mrs = register_gpu_memory_chunked(ops, pd, ptr, bytes, access, chunk_bytes, export_fn, &r.method);
      }
    } catch (const Error& e) {
      UCCL_THROW(kTransport, "efa %s: %s", device.c_str(), e.what());
    }
  } else {
    r.method = "host (ibv_reg_mr)";
    r.mrs = chunk_bytes == 0 ? std::vector<GpuMrChunk>{GpuMrChunk{addr, bytes, nullptr}}
                             : plan_chunks(addr, bytes, chunk_bytes);
    for (size_t i = 0; i < r.mrs.size(); ++i) {
      GpuMrChunk& c = r.mrs[i];
      c.mr = ops.reg_mr(pd, reinterpret_cast<void*>(c.addr), c.bytes, access);
      if (!c.mr) {
        const std::string err = verbs_error("ibv_reg_mr", 0);
        for (size_t j = 0; j < i; ++j) ops.dereg_mr(r.mrs[j].mr);
        UCCL_THROW(kTransport, "efa %s: %s for chunk %zu of %zu ([0x%llx, +%llu) of a %llu-byte region; ulimit -l "
                   "unlimited)", device.c_str(), err.c_str(), i + 1, r.mrs.size(), (unsigned long long)c.addr,
                   (unsigned long long)c.bytes, (unsigned long long)bytes);
      }
    }
  }
  for (const GpuMrChunk& c : r.mrs) r.local.push_back(LocalMr{c.addr, c.bytes, c.mr->lkey});
  return r;
}

}  // namespace uccl_moe::detail
