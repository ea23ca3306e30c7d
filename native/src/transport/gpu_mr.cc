#include "transport/gpu_mr.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "uccl_moe/error.hpp"

// The GPU half goes through the runtime the build links (the same seam as native/src/core/device_query.cc).
#if defined(UCCL_MOE_WITH_CUDA)
#include <cuda.h>
#include <cuda_runtime_api.h>
#elif defined(UCCL_MOE_WITH_HIP)
#include <hip/hip_runtime_api.h>
#endif

namespace uccl_moe::detail {

namespace {
uint64_t align_down(uint64_t v, uint64_t a) { return v / a * a; }
uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
void set_why(std::string* why, std::string text) {
  if (why) *why = std::move(text);
}
}  // namespace

DmabufRange dmabuf_range(uint64_t addr, uint64_t bytes) {
  DmabufRange r;
  r.base = align_down(addr, kDmabufAlignBytes);
  r.bytes = align_up(addr + bytes, kDmabufAlignBytes) - r.base;
  r.offset = addr - r.base;
  return r;
}

std::vector<GpuMrChunk> plan_chunks(uint64_t addr, uint64_t bytes, uint64_t max_chunk_bytes) {
  UCCL_CHECK_INTERNAL(max_chunk_bytes >= kDmabufAlignBytes && max_chunk_bytes % kDmabufAlignBytes == 0,
                      "dma-buf chunk of %llu bytes is not a multiple of %llu", (unsigned long long)max_chunk_bytes,
                      (unsigned long long)kDmabufAlignBytes);
  std::vector<GpuMrChunk> out;
  const uint64_t end = addr + bytes;
  uint64_t lo = addr;
  while (lo < end) {
    const uint64_t hi = std::min(end, align_down(lo, max_chunk_bytes) + max_chunk_bytes);
    out.push_back(GpuMrChunk{lo, hi - lo, nullptr});
    lo = hi;
  }
  return out;
}

DmabufExport dmabuf_exporter(const GpuMemoryOps* gpu) {
  if (gpu && gpu->export_dmabuf) return gpu->export_dmabuf;
  return gpu_export_dmabuf;
}

int gpu_access_flags(int access) {
#ifdef IBV_ACCESS_OPTIONAL_FIRST
  return access | IBV_ACCESS_RELAXED_ORDERING;
#else
  return access;
#endif
}

int gpu_export_dmabuf(void* ptr, uint64_t bytes, std::string* why) {
#if defined(UCCL_MOE_WITH_CUDA)
  // CUDA driver API >= 11.7, looked up through the runtime so the module never links libcuda.
  using ExportFn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  static const ExportFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &f, 11070, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return ExportFn(nullptr);
    }
    return reinterpret_cast<ExportFn>(f);
  }();
  if (!fn) {
    set_why(why, "the CUDA driver has no cuMemGetHandleForAddressRange (a driver for CUDA >= 11.7 is needed)");
    return -1;
  }
  int fd = -1;
  const CUresult rc = fn(&fd, CUdeviceptr(reinterpret_cast<uintptr_t>(ptr)), size_t(bytes),
                         CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (rc != CUDA_SUCCESS) {
    set_why(why, format("cuMemGetHandleForAddressRange(DMA_BUF_FD) returned CUresult %d%s", int(rc),
                        rc == CUDA_ERROR_NOT_SUPPORTED
                            ? " (not supported: needs the NVIDIA open kernel modules and a Linux kernel with dma-buf)"
                            : ""));
    return -1;
  }
  return fd;
#elif defined(UCCL_MOE_WITH_HIP)
  int fd = -1;
  const hipError_t rc = hipMemGetHandleForAddressRange(&fd, reinterpret_cast<hipDeviceptr_t>(ptr), size_t(bytes),
                                                       hipMemRangeHandleTypeDmaBufFd, 0);
  if (rc != hipSuccess) {
    (void)hipGetLastError();
    set_why(why, format("hipMemGetHandleForAddressRange(dma-buf) failed: %s", hipGetErrorString(rc)));
    return -1;
  }
  return fd;
#else
  (void)ptr;
  (void)bytes;
  set_why(why, "this build has no GPU backend (configure with UCCL_MOE_WITH_CUDA or UCCL_MOE_WITH_HIP)");
  return -1;
#endif
}

namespace {
/// One MR for [addr, addr + bytes): dma-buf, else ibv_reg_mr. nullptr with *why (both attempts) on failure.
ibv_mr* register_one(VerbsOps& ops, ibv_pd* pd, uint64_t addr, uint64_t bytes, int access,
                     const DmabufExport& export_fn, std::string* method, std::string* why) {
  const DmabufRange r = dmabuf_range(addr, bytes);
  std::string export_why;
  const int fd = export_fn ? export_fn(reinterpret_cast<void*>(r.base), r.bytes, &export_why) : -1;
  if (!export_fn) export_why = "no dma-buf exporter";
  std::string dmabuf_why;
  if (fd >= 0) {
    // iova = the virtual address, so remote addresses stay pointers (man ibv_reg_dmabuf_mr).
    ibv_mr* mr = ops.reg_dmabuf_mr(pd, r.offset, bytes, addr, fd, access);
    const int err = errno;
    close(fd);  // the MR holds its own reference to the dma-buf
    if (mr) {
      *method = "dma-buf";
      return mr;
    }
    dmabuf_why = verbs_error("ibv_reg_dmabuf_mr", err);
  } else {
    dmabuf_why = "dma-buf export: " + export_why;
  }
  ibv_mr* mr = ops.reg_mr(pd, reinterpret_cast<void*>(addr), bytes, access);
  if (mr) {
    *method = "peer memory (ibv_reg_mr)";
    return mr;
  }
  *why = format("%s; %s", dmabuf_why.c_str(), verbs_error("ibv_reg_mr", 0).c_str());
  return nullptr;
}

[[noreturn]] void throw_unregistrable(uint64_t addr, uint64_t bytes, const std::string& why) {
  UCCL_THROW(kTransport, "cannot register GPU memory [0x%llx, +%llu) with the NIC (%s). Needed one of: dma-buf (a "
             "Linux kernel >= 5.12, rdma-core >= 34, the NVIDIA open kernel modules / ROCm >= 6 and a build with a "
             "GPU backend), or a peer-memory kernel module: nvidia-peermem (modprobe nvidia_peermem), "
             "efa_nv_peermem on AWS EFA, amdgpu peer memory on ROCm", (unsigned long long)addr,
             (unsigned long long)bytes, why.c_str());
}
}  // namespace

ibv_mr* register_gpu_memory(VerbsOps& ops, ibv_pd* pd, void* ptr, uint64_t bytes, int access,
                            const DmabufExport& export_fn, std::string* method) {
  const uint64_t addr = uint64_t(reinterpret_cast<uintptr_t>(ptr));
  std::string why;
  ibv_mr* mr = register_one(ops, pd, addr, bytes, gpu_access_flags(access), export_fn, method, &why);
  if (!mr) throw_unregistrable(addr, bytes, why);
  return mr;
}

std::vector<GpuMrChunk> register_gpu_memory_chunked(VerbsOps& ops, ibv_pd* pd, void* ptr, uint64_t bytes, int access,
                                                    uint64_t max_chunk_bytes, const DmabufExport& export_fn,
                                                    std::string* method) {
  const uint64_t addr = uint64_t(reinterpret_cast<uintptr_t>(ptr));
  std::vector<GpuMrChunk> chunks = plan_chunks(addr, bytes, max_chunk_bytes);
  for (size_t i = 0; i < chunks.size(); ++i) {
    std::string why;
    chunks[i].mr = register_one(ops, pd, chunks[i].addr, chunks[i].bytes, gpu_access_flags(access), export_fn, method,
                                &why);
    if (!chunks[i].mr) {
      for (size_t j = 0; j < i; ++j) ops.dereg_mr(chunks[j].mr);
      throw_unregistrable(chunks[i].addr, chunks[i].bytes, format("chunk %zu of %zu: %s", i + 1, chunks.size(),
                                                                  why.c_str()));
    }
  }
  return chunks;
}

}  // namespace uccl_moe::detail
