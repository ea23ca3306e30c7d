// GpuMemoryOps for one device (CUDA/HIP implementation in gpu_memory_ops.cu). Plain C++ header.
#pragma once

#include <memory>

#include "uccl_moe/gpu_memory.hpp"

namespace uccl_moe::runtime {

std::shared_ptr<GpuMemoryOps> make_gpu_memory_ops(int device);

}  // namespace uccl_moe::runtime
