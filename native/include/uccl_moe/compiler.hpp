// Compiler detection shared by headers that are compiled both by the host compiler and by nvcc/hipcc.
// With platform.cuh, the only places allowed to name __CUDACC__ / __HIPCC__ / __HIP_PLATFORM_AMD__
// (tests/native/test_platform_seam.py enforces it).
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
/// Defined while a GPU compiler (nvcc or hipcc) compiles this translation unit, host or device pass.
#define UCCL_GPU_COMPILER 1
/// For small helpers usable on both sides (wire-format encode/decode).
#define UCCL_HOST_DEVICE_FN __host__ __device__ inline
#else
#define UCCL_HOST_DEVICE_FN inline
#endif
