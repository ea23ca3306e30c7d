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
/// Out of line on purpose (a rarely taken wait whose inlined loop would cost a hot kernel registers); internal
/// linkage, as a header's device function.
#define UCCL_DEVICE_NOINLINE static __device__ __noinline__
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
inline bool stream_capturing(Stream s) {
  hipStreamCaptureStatus st = hipStreamCaptureStatusNone;
  return hipStreamIsCapturing(s, &st) == hipSuccess && st != hipStreamCaptureStatusNone;
}
inline Error host_alloc_mapped(void** p, size_t bytes) { return hipHostMalloc(p, bytes, hipHostMallocMapped); }
inline Error host_free(void* p) { return hipHostFree(p); }
inline Error host_register_mapped(void* p, size_t bytes) {
  return hipHostRegister(p, bytes, hipHostRegisterMapped | hipHostRegisterPortable);
}
inline Error host_unregister(void* p) { return hipHostUnregister(p); }
inline Error host_device_pointer(void** d, void* h) { return hipHostGetDevicePointer(d, h, 0); }
inline Error get_device(int* d) { return hipGetDevice(d); }
inline Error set_device(int d) { return hipSetDevice(d); }
inline Error device_malloc(void** p, size_t bytes) { return hipMalloc(p, bytes); }
inline Error device_free(void* p) { return hipFree(p); }
inline Error memset_async(void* p, int v, size_t bytes, Stream s) { return hipMemsetAsync(p, v, bytes, s); }
inline Error memset_sync(void* p, int v, size_t bytes) { return hipMemset(p, v, bytes); }
inline Error memcpy_async(void* dst, const void* src, size_t bytes, Stream s) {
  return hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, s);
}
inline Error stream_create_nonblocking(Stream* s) { return hipStreamCreateWithFlags(s, hipStreamNonBlocking); }
inline Error stream_destroy(Stream s) { return hipStreamDestroy(s); }
inline Error event_create(Event* e) { return hipEventCreateWithFlags(e, hipEventDisableTiming); }
inline Error event_record(Event e, Stream s) { return hipEventRecord(e, s); }
inline Error stream_wait_event(Stream s, Event e) { return hipStreamWaitEvent(s, e, 0); }
/// Success once the event completed; kNotReady while it is pending; anything else is an error.
inline Error event_query(Event e) { return hipEventQuery(e); }
inline Error event_synchronize_any_capture(Event e) {
  hipStreamCaptureMode mode = hipStreamCaptureModeRelaxed;
  const Error x = hipThreadExchangeStreamCaptureMode(&mode);
  if (x != hipSuccess) return x;
  const Error r = hipEventSynchronize(e);
  (void)hipThreadExchangeStreamCaptureMode(&mode);
  return r;
}
constexpr Error kNotReady = hipErrorNotReady;
inline Error event_destroy(Event e) { return hipEventDestroy(e); }
/// Stream memory operations (stream_write_u32 / stream_wait_u32_geq below): 0 on success, else the API's error code
/// (-1: the API is not there).
inline int stream_write_u32(Stream s, void* p, uint32_t v) {
  return static_cast<int>(hipStreamWriteValue32(s, p, v, 0));
}
inline int stream_wait_u32_geq(Stream s, void* p, uint32_t v) {
  return static_cast<int>(hipStreamWaitValue32(s, p, v, hipStreamWaitValueGte, 0xFFFFFFFFu));
}
inline Error peek_last_error() { return hipPeekAtLastError(); }
inline bool is_success(Error e) { return e == hipSuccess; }
using IpcMemHandle = hipIpcMemHandle_t;
inline Error ipc_get_mem_handle(IpcMemHandle* h, void* p) { return hipIpcGetMemHandle(h, p); }
inline Error ipc_open_mem_handle(void** p, IpcMemHandle h) {
  return hipIpcOpenMemHandle(p, h, hipIpcMemLazyEnablePeerAccess);
}
inline Error ipc_close_mem_handle(void* p) { return hipIpcCloseMemHandle(p); }
inline Error func_set_max_dynamic_smem(const void* f, int bytes) {
  return hipFuncSetAttribute(f, hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
inline Error clock_rate_khz(int* khz, int device) {
  return hipDeviceGetAttribute(khz, hipDeviceAttributeClockRate, device);
}
/// "0000:53:00.0": the GPU's PCI address, for the NIC choice per GPU.
inline Error pci_bus_id(char* buf, int len, int device) { return hipDeviceGetPCIBusId(buf, len, device); }
/// Whether kernels load lazily on first launch (the CUDA hazard below). HIP: code objects are loaded per module, and
/// no ROCm run of the GPU-copy loopback was possible here, so this reports eager and the check is CUDA-only.
inline bool lazy_module_loading() { return false; }
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
inline bool stream_capturing(Stream s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}
inline Error host_alloc_mapped(void** p, size_t bytes) {
  return cudaHostAlloc(p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
}
inline Error host_free(void* p) { return cudaFreeHost(p); }
inline Error host_register_mapped(void* p, size_t bytes) {
  return cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
}
inline Error host_unregister(void* p) { return cudaHostUnregister(p); }
inline Error host_device_pointer(void** d, void* h) { return cudaHostGetDevicePointer(d, h, 0); }
inline Error get_device(int* d) { return cudaGetDevice(d); }
inline Error set_device(int d) { return cudaSetDevice(d); }
inline Error device_malloc(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
inline Error device_free(void* p) { return cudaFree(p); }
inline Error memset_async(void* p, int v, size_t bytes, Stream s) { return cudaMemsetAsync(p, v, bytes, s); }
inline Error memset_sync(void* p, int v, size_t bytes) { return cudaMemset(p, v, bytes); }
inline Error memcpy_async(void* dst, const void* src, size_t bytes, Stream s) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
}
inline Error stream_create_nonblocking(Stream* s) { return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking); }
inline Error stream_destroy(Stream s) { return cudaStreamDestroy(s); }
inline Error event_create(Event* e) { return cudaEventCreateWithFlags(e, cudaEventDisableTiming); }
inline Error event_record(Event e, Stream s) { return cudaEventRecord(e, s); }
inline Error stream_wait_event(Stream s, Event e) { return cudaStreamWaitEvent(s, e, 0); }
/// Success once the event completed; kNotReady while it is pending; anything else is an error.
inline Error event_query(Event e) { return cudaEventQuery(e); }
/// Waits on the host until `e` completed, also while a stream of this thread captures a graph (the call runs in the
/// relaxed capture mode: a global-mode capture would be invalidated by a synchronizing call).
inline Error event_synchronize_any_capture(Event e) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const Error x = cudaThreadExchangeStreamCaptureMode(&mode);
  if (x != cudaSuccess) return x;
  const Error r = cudaEventSynchronize(e);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  return r;
}
constexpr Error kNotReady = cudaErrorNotReady;
inline Error event_destroy(Event e) { return cudaEventDestroy(e); }
/// The driver's cuStreamWriteValue32 / cuStreamWaitValue32 (CUresult f(CUstream, CUdeviceptr, cuuint32_t, unsigned)),
/// found through the runtime's entry point (no libcuda link); null where the driver has none.
using StreamValueFn = int (*)(Stream, unsigned long long, uint32_t, unsigned int);
inline StreamValueFn stream_value_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<StreamValueFn>(fn);
}
/// Stream memory operations: once the work before it on `s` completed (and its writes are visible: the default
/// flags fence), the 4-byte word at `p` (device memory, ours or a peer's) becomes `v`. 0 on success, else the
/// driver's CUresult (-1: the driver has no such entry point).
inline int stream_write_u32(Stream s, void* p, uint32_t v) {
  static const StreamValueFn fn = stream_value_fn("cuStreamWriteValue32");
  return fn == nullptr ? -1 : fn(s, reinterpret_cast<unsigned long long>(p), v, 0 /* CU_STREAM_WRITE_VALUE_DEFAULT */);
}
/// Work after it on `s` waits until the word at `p` (device memory) reaches `v` (a count: at least `v`). Unbounded:
/// whoever relies on it must make sure the word gets there (the copy-engine gate: NvlRuntime::ce_copies).
inline int stream_wait_u32_geq(Stream s, void* p, uint32_t v) {
  static const StreamValueFn fn = stream_value_fn("cuStreamWaitValue32");
  return fn == nullptr ? -1 : fn(s, reinterpret_cast<unsigned long long>(p), v, 0 /* CU_STREAM_WAIT_VALUE_GEQ */);
}
inline Error peek_last_error() { return cudaPeekAtLastError(); }
inline bool is_success(Error e) { return e == cudaSuccess; }
using IpcMemHandle = cudaIpcMemHandle_t;
inline Error ipc_get_mem_handle(IpcMemHandle* h, void* p) { return cudaIpcGetMemHandle(h, p); }
inline Error ipc_open_mem_handle(void** p, IpcMemHandle h) {
  return cudaIpcOpenMemHandle(p, h, cudaIpcMemLazyEnablePeerAccess);
}
inline Error ipc_close_mem_handle(void* p) { return cudaIpcCloseMemHandle(p); }
inline Error func_set_max_dynamic_smem(const void* f, int bytes) {
  return cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
inline Error pci_bus_id(char* buf, int len, int device) { return cudaDeviceGetPCIBusId(buf, len, device); }
/// Whether the driver loads kernels lazily, on their first launch (CUDA_MODULE_LOADING=LAZY, the default since
/// CUDA 12.2). A lazy load may wait for the whole context to go idle, so a host thread that must issue CUDA work to
/// let a spinning kernel finish can deadlock against it. Asked through the driver entry point (no libcuda link).
inline bool lazy_module_loading() {
  using GetMode = int (*)(int*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr)
    return false;  // a driver without the query predates lazy loading
  int mode = 0;
  return reinterpret_cast<GetMode>(fn)(&mode) == 0 && mode == 2;  // CU_MODULE_LAZY_LOADING
}
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
// Block scope (shared memory words handed between warps of one block). With a later system-scope release by the
// reading warp they chain: what a warp stored before its block-scope release is covered by the reader's release
// (PTX causality order is transitive across morally strong pairs), so the writer never waits for its stores to
// cross NVLink; only the reader's system-scope release does. On HIP both take agent scope: LLVM's AMDGPU backend
// has not always made a workgroup-scope release followed by another wave's wider release cover the first wave's
// global stores (no vmcnt wait at workgroup scope on some targets), and this has not been run on an AMD GPU yet.
// On CUDA they are atomic read-modify-writes (an exchange, an add of 0) with the same release / acquire semantics
// as a st.release / ld.acquire: compute-sanitizer's racecheck, which checks shared memory, reports plain
// release/acquire pairs between warps as hazards but knows that atomics do not race.
UCCL_DEVICE_INLINE void store_release_block(int32_t* p, int32_t v) {
#if defined(UCCL_MOE_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
#else
  asm volatile("{ .reg .b32 old; atom.release.cta.exch.b32 old, [%0], %1; }" ::"l"(p), "r"(v) : "memory");
#endif
}
UCCL_DEVICE_INLINE int32_t load_acquire_block(int32_t* p) {
#if defined(UCCL_MOE_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
#else
  int32_t v;
  asm volatile("atom.acquire.cta.add.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "r"(0) : "memory");
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

/// Compare-and-swap at system scope; returns the old value (== expected: this thread swapped).
UCCL_DEVICE_INLINE int32_t atomic_cas_sys(int32_t* p, int32_t expected, int32_t desired) {
#if defined(UCCL_MOE_HIP)
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;
#else
  return atomicCAS_system(p, expected, desired);
#endif
}

/// One 16-byte store (used for FIFO commands: a command must never be observed half-written).
UCCL_DEVICE_INLINE void store_128(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

// ---- warp collectives (width kWarpSize; masks are 64-bit so one signature serves both vendors) --------
using LaneMask = unsigned long long;
UCCL_DEVICE_INLINE void sync_warp() {
#if defined(UCCL_MOE_HIP)
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "wavefront");
#else
  __syncwarp();
#endif
}
/// Bit i set when lane i's predicate holds.
UCCL_DEVICE_INLINE LaneMask ballot(bool pred) {
#if defined(UCCL_MOE_HIP)
  return __ballot(pred);
#else
  return __ballot_sync(0xffffffffu, pred);
#endif
}
template <typename T>
UCCL_DEVICE_INLINE T shfl(T v, int src_lane) {
#if defined(UCCL_MOE_HIP)
  return __shfl(v, src_lane);
#else
  return __shfl_sync(0xffffffffu, v, src_lane);
#endif
}
template <typename T>
UCCL_DEVICE_INLINE T shfl_up(T v, int delta) {
#if defined(UCCL_MOE_HIP)
  return __shfl_up(v, delta);
#else
  return __shfl_up_sync(0xffffffffu, v, delta);
#endif
}
template <typename T>
UCCL_DEVICE_INLINE T shfl_xor(T v, int mask) {
#if defined(UCCL_MOE_HIP)
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}
UCCL_DEVICE_INLINE int popcount(LaneMask m) { return __popcll(m); }
/// Index of the lowest set bit (m != 0).
UCCL_DEVICE_INLINE int lowest_bit(LaneMask m) { return __ffsll(static_cast<long long>(m)) - 1; }
/// Bits of the lanes below this one.
UCCL_DEVICE_INLINE LaneMask lanemask_lt() { return (LaneMask{1} << lane_id()) - 1; }

// ---- bulk data movement ------------------------------------------------------------------------------
#if defined(UCCL_MOE_HIP)
typedef int NativeInt4 __attribute__((ext_vector_type(4)));  // what clang's nontemporal builtins accept
UCCL_DEVICE_INLINE int4 nontemporal_load_128(const int4* p) {
  const NativeInt4 v = __builtin_nontemporal_load(reinterpret_cast<const NativeInt4*>(p));
  return make_int4(v[0], v[1], v[2], v[3]);
}
#endif
/// 16-byte load of data that no thread of this launch writes (read-only input): skips L1 so nothing
/// stale can be served later, and keeps the line out of L1 (streamed once).
UCCL_DEVICE_INLINE int4 load_stream_128(const int4* p) {
#if defined(UCCL_MOE_HIP)
  return nontemporal_load_128(p);
#else
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}
/// 16-byte load of ring data written by a peer during this launch; ordered after an acquire of the tail
/// that covers it, so it must not come from L1 (".nc" would be wrong here: the slot is rewritten).
UCCL_DEVICE_INLINE int4 load_ring_128(const int4* p) {
#if defined(UCCL_MOE_HIP)
  return nontemporal_load_128(p);
#else
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}
/// Hint: start fetching [p, p + bytes) into L2 for loads that come later (p and bytes multiples of 16). No effect
/// on results. sm_90: one bulk prefetch issued by the calling thread; elsewhere (and on HIP) nothing.
UCCL_DEVICE_INLINE void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(UCCL_MOE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}
/// 16-byte streaming store (local or peer memory); not kept in L1.
UCCL_DEVICE_INLINE void store_stream_128(int4* p, const int4& v) {
#if defined(UCCL_MOE_HIP)
  const NativeInt4 w = {v.x, v.y, v.z, v.w};
  __builtin_nontemporal_store(w, reinterpret_cast<NativeInt4*>(p));
#else
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
#endif
}
/// 4-byte load of ring metadata written by a peer (same rule as load_ring_128).
UCCL_DEVICE_INLINE int32_t load_ring_32(const int32_t* p) { return *reinterpret_cast<const volatile int32_t*>(p); }

/// Relaxed system-scope atomic add: a consumer handing ring slots back to their producer. No release: the slots'
/// loads have returned (their values were already stored or summed), so nothing earlier needs to be ordered, and a
/// release would be a system-wide fence waiting for the consumer's own output stores. For a counter several warps
/// advance by disjoint deltas, so it only moves forward (modulo 2^32).
UCCL_DEVICE_INLINE void atomic_add_relaxed_sys(int32_t* p, int32_t v) {
#if defined(UCCL_MOE_HIP)
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}
/// Two floats -> packed bf16x2 (lo in bits 0-15), round to nearest even. One instruction on sm_80+ (a NaN becomes
/// the canonical NaN there; the integer path below keeps its payload); the
/// combine reduction was issue-bound on the bit-twiddling version (ncu: math-pipe throttle, ~64 instructions per
/// 16 output bytes).
UCCL_DEVICE_INLINE uint32_t pack_bf16x2_rn(float lo, float hi) {
#if defined(UCCL_MOE_HIP) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  auto round = [](float f) -> uint32_t {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
  };
  return round(lo) | (round(hi) << 16);
#else
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}
/// Block-scope fence (shared-memory progress words read by sibling warps).
UCCL_DEVICE_INLINE void fence_block() { __threadfence_block(); }

}  // namespace uccl_moe::gpu
