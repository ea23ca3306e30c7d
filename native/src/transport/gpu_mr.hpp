// GPU memory registration for the verbs transports (ibverbs RC, efa SRD). Order:
//   1. dma-buf: the GPU driver exports the 2 MiB aligned range as a dma-buf fd (cuMemGetHandleForAddressRange /
//      hipMemGetHandleForAddressRange), ibv_reg_dmabuf_mr registers it; needs no peer-memory kernel module;
//   2. ibv_reg_mr on the GPU pointer: works when a peer-memory module is loaded (nvidia-peermem, efa_nv_peermem,
//      amdgpu's peer memory);
//   3. neither: an error naming what is missing.
// IBV_ACCESS_RELAXED_ORDERING is added when the library defines it (man ibv_reg_mr: an optional flag the device may
// ignore), as UCCL-EP ep/src/rdma.cpp does for GPU buffers.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "transport/ibverbs/verbs_ops.hpp"
#include "uccl_moe/gpu_memory.hpp"

namespace uccl_moe::detail {

/// GPU page granularity of a dma-buf export (Hopper, MI300: 2 MiB; UCCL-EP ep/src/rdma.cpp kDmabufGranularity).
constexpr uint64_t kDmabufAlignBytes = 2ull << 20;

/// The aligned export covering [addr, addr + bytes): base and size multiples of kDmabufAlignBytes; `offset` is
/// addr - base, the fd offset ibv_reg_dmabuf_mr registers from.
struct DmabufRange {
  uint64_t base = 0, bytes = 0, offset = 0;
};
DmabufRange dmabuf_range(uint64_t addr, uint64_t bytes);

/// One registration of a GPU region: [addr, addr + bytes) with its own MR.
struct GpuMrChunk {
  uint64_t addr = 0, bytes = 0;
  ibv_mr* mr = nullptr;
};
/// [addr, addr + bytes) cut into chunks of at most `max_chunk_bytes` (a multiple of kDmabufAlignBytes) that start on
/// kDmabufAlignBytes boundaries after the first (each chunk is exported on its own, so the kernel maps only that
/// chunk's pages: UCCL-EP ep/src/rdma.cpp reg_mr_gpu_dmabuf_chunked).
std::vector<GpuMrChunk> plan_chunks(uint64_t addr, uint64_t bytes, uint64_t max_chunk_bytes);

/// Exports [ptr, ptr + bytes) (kDmabufAlignBytes aligned) of GPU memory as a dma-buf fd the caller closes. Returns
/// the fd, or -1 with *why set.
using DmabufExport = std::function<int(void* ptr, uint64_t bytes, std::string* why)>;

/// The GPU driver's export: cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) through the CUDA
/// runtime's driver entry point (no libcuda link), hipMemGetHandleForAddressRange on ROCm; -1 with *why in a build
/// without a GPU backend. Callable on its own (tests/gpu exports a cudaMalloc range with it).
int gpu_export_dmabuf(void* ptr, uint64_t bytes, std::string* why);

/// The export a transport uses: the GpuMemoryOps' export_dmabuf when set (tests), else gpu_export_dmabuf.
DmabufExport dmabuf_exporter(const GpuMemoryOps* gpu);

/// Access flags plus IBV_ACCESS_RELAXED_ORDERING.
int gpu_access_flags(int access);

/// Registers GPU memory [ptr, ptr + bytes) as one MR: dma-buf (one export of the aligned range), else ibv_reg_mr.
/// *method says which ("dma-buf" / "peer memory (ibv_reg_mr)"). Throws Transport naming what is needed when both fail.
ibv_mr* register_gpu_memory(VerbsOps& ops, ibv_pd* pd, void* ptr, uint64_t bytes, int access,
                            const DmabufExport& export_fn, std::string* method);

/// The same as chunks of at most `max_chunk_bytes`, one dma-buf export and MR each (for NICs that refuse one large
/// dma-buf MR), falling back to ibv_reg_mr per chunk. On failure deregisters what it registered and throws.
std::vector<GpuMrChunk> register_gpu_memory_chunked(VerbsOps& ops, ibv_pd* pd, void* ptr, uint64_t bytes, int access,
                                                    uint64_t max_chunk_bytes, const DmabufExport& export_fn,
                                                    std::string* method);

}  // namespace uccl_moe::detail
