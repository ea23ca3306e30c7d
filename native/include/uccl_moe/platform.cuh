// The CUDA/HIP seam. The only file allowed to test __HIP_PLATFORM_AMD__ or to hold inline PTX / vendor
// intrinsics (CI greps for violations). Kernels include this and use uccl_moe::gpu / the primitives below.
#pragma once

#include <cstdint>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define UCCL_MOE_HIP 1
#else
#include <cuda_runtime.h>
#define UCCL_MOE_CUDA 1
#endif

#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define UCCL_DEVICE_COMPILE 1
#endif

#define UCCL_DEVICE_INLINE __device__ __forceinline__
#define UCCL_HOST_DEVICE_INLINE __host__ __device__ __forceinline__

namespace uccl_moe::gpu {

#if defined(UCCL_MOE_HIP)
using Stream = hipStream_t;
using Error = hipError_t;
using Event = hipEvent_t;
constexpr Error kSuccess = hipSuccess;
inline const char* error_string(Error e) { return hipGetErrorString(e); }
inline Error get_last_error() { return hipGetLastError(); }
inline Error device_synchronize() { return hipDeviceSynchronize(); }
inline Error stream_synchronize(Stream s) { return hipStreamSynchronize(s); }
inline Error host_alloc_mapped(void** p, size_t bytes) { return hipHostMalloc(p, bytes, hipHostMallocMapped); }
inline Error host_free(void* p) { return hipHostFree(p); }
inline Error host_device_pointer(void** d, void* h) { return hipHostGetDevicePointer(d, h, 0); }
inline Error get_device(int* d) { return hipGetDevice(d); }
inline Error clock_rate_khz(int* khz, int device) {
  return hipDeviceGetAttribute(khz, hipDeviceAttributeClockRate, device);
}
/// Wall-clock-ish counter used for timeouts: AMD's constant-rate s_memrealtime (100 MHz).
constexpr int kWarpSize = 64;
#else
using Stream = cudaStream_t;
using Error = cudaError_t;
using Event = cudaEvent_t;
constexpr Error kSuccess = cudaSuccess;
inline const char* error_string(Error e) { return cudaGetErrorString(e); }
inline Error get_last_error() { return cudaGetLastError(); }
inline Error device_synchronize() { return cudaDeviceSynchronize(); }
inline Error stream_synchronize(Stream s) { return cudaStreamSynchronize(s); }
inline Error host_alloc_mapped(void** p, size_t bytes) {
  return cudaHostAlloc(p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
}
inline Error host_free(void* p) { return cudaFreeHost(p); }
inline Error host_device_pointer(void** d, void* h) { return cudaHostGetDevicePointer(d, h, 0); }
inline Error get_device(int* d) { return cudaGetDevice(d); }
constexpr int kWarpSize = 32;
#endif

/// Nanoseconds from a device-global timer (globaltimer on NVIDIA, s_memrealtime at 100 MHz on AMD).
/// Timeouts are in seconds, so a wall-clock source is used instead of SM cycles (clock rates vary with boost).
UCCL_DEVICE_INLINE uint64_t global_timer_ns() {
#if defined(UCCL_MOE_HIP)
  return __builtin_amdgcn_s_memrealtime() * 10ull;
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

UCCL_DEVICE_INLINE int lane_id() { return static_cast<int>(threadIdx.x % kWarpSize); }
UCCL_DEVICE_INLINE int warp_id() { return static_cast<int>(threadIdx.x / kWarpSize); }

// ---- memory-order primitives (system scope: visible to peers over NVLink and to the host) -----------
UCCL_DEVICE_INLINE void fence_sys() { __threadfence_system(); }
UCCL_DEVICE_INLINE void fence_gpu() { __threadfence(); }

UCCL_DEVICE_INLINE void store_release_sys(int32_t* p, int32_t v) {
#if defined(UCCL_MOE_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}
UCCL_DEVICE_INLINE void store_release_sys(int64_t* p, int64_t v) {
#if defined(UCCL_MOE_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}
UCCL_DEVICE_INLINE int32_t load_acquire_sys(const int32_t* p) {
#if defined(UCCL_MOE_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}
UCCL_DEVICE_INLINE int64_t load_acquire_sys(const int64_t* p) {
#if defined(UCCL_MOE_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  int64_t v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}
UCCL_DEVICE_INLINE int32_t load_volatile(const int32_t* p) { return *reinterpret_cast<const volatile int32_t*>(p); }
UCCL_DEVICE_INLINE int32_t atomic_add_sys(int32_t* p, int32_t v) {
#if defined(UCCL_MOE_HIP)
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  return atomicAdd_system(p, v);
#endif
}

/// One 16-byte store (used for FIFO commands: a command must never be observed half-written).
UCCL_DEVICE_INLINE void store_128(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

}  // namespace uccl_moe::gpu
