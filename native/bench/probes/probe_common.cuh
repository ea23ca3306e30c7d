// What the standalone probes in tools/ share: the CUDA error check and the per-GPU set-up and synchronisation of a
// one-process, every-GPU run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "uccl_moe/platform.cuh"

/// Bytes a timed run writes before it (an L2 flush): more than the L2 of any supported GPU, as the bench's
/// FLUSH_BYTES (uccl_moe/bench/_timing.py).
constexpr size_t kFlushBytes = size_t{256} << 20;

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

/// Visible GPUs, at most `max_gpus`.
inline int visible_gpus(int max_gpus) {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  return n < max_gpus ? n : max_gpus;
}

/// Makes GPU g current and lets it access the memory of every other of the n GPUs.
inline void enable_peer_access(int g, int n) {
  CK(cudaSetDevice(g));
  for (int p = 0; p < n; ++p)
    if (p != g) CK(cudaDeviceEnablePeerAccess(p, 0));
}

/// Waits until every one of the n GPUs is idle.
inline void sync_all(int n) {
  for (int g = 0; g < n; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceSynchronize());
  }
}

/// Milliseconds of the slowest of the n GPUs between its events e0[g] and e1[g] (after sync_all).
inline float slowest_ms(int n, const std::vector<cudaEvent_t>& e0, const std::vector<cudaEvent_t>& e1) {
  float worst = 0;
  for (int g = 0; g < n; ++g) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0[g], e1[g]));
    worst = ms > worst ? ms : worst;
  }
  return worst;
}

/// A timed run's start gate (one thread): stores the run's epoch into `epoch_word` (what the copy engines copy as
/// flags), then waits until the host, done enqueueing every GPU's work, sets its mapped flag to the epoch, so the time
/// starts together on every GPU and never includes the host's enqueueing.
__global__ void start_gate(const volatile int32_t* host_flag, int32_t epoch, int32_t* epoch_word) {
  *epoch_word = epoch;
  long long spins = 0;
  while (*host_flag != epoch)
    if (++spins > (1ll << 31)) {
      printf("probe: start gate timed out\n");
      __trap();
    }
  __threadfence_system();
}

/// One thread's wait until `*p` (acquire, system scope) reached `target` (wrapping compare); traps, naming `what`,
/// after 2^30 polls (a probe has no diagnostic record).
__device__ __forceinline__ void spin_until(const int32_t* p, int32_t target, const char* what) {
  const auto behind = [&] {
    const auto seen = static_cast<uint32_t>(uccl_moe::gpu::load_acquire_sys(p));
    return static_cast<int32_t>(seen - static_cast<uint32_t>(target)) < 0;
  };
  long long spins = 0;
  while (behind())
    if (++spins > (1ll << 30)) {
      printf("probe: %s wait timed out (seen %d, want %d)\n", what, uccl_moe::gpu::load_acquire_sys(p), target);
      __trap();
    }
}
