// UCCL_CHECK_GPU(expr): throw uccl_moe::Error(kCuda) with the expression, the runtime's error string and
// file:line when a CUDA/HIP runtime call fails. For .cu files (needs platform.cuh).
#pragma once

#include "uccl_moe/error.hpp"
#include "uccl_moe/platform.cuh"

#define UCCL_CHECK_GPU(expr)                                                                                   \
  do {                                                                                                         \
    ::uccl_moe::gpu::Error uccl_gpu_err_ = (expr);                                                             \
    if (uccl_gpu_err_ != ::uccl_moe::gpu::kSuccess)                                                            \
      UCCL_THROW(kCuda, "%s: %s", #expr, ::uccl_moe::gpu::error_string(uccl_gpu_err_));                        \
  } while (0)
