// Host cost per call of the CUDA calls a copy-engine op makes (issue 28: the default mode's host share): each call
// enqueued 200 times behind a GPU held by a spin kernel, so the GPU never pushes back; the median of 5 rounds, in us
// per call. A warm C++ loop: inside Python's per-op path the same calls cost more (docs/intranode.md, "Session 34").
//
//   nvcc -O3 -arch=sm_90 -o /tmp/call_cost_probe native/bench/probes/call_cost_probe.cu
//   /tmp/call_cost_probe            (2 GPUs with peer access: the copies go from GPU 0 into GPU 1's memory; each
//                                    line takes about 5 s, as every round waits out a ~1 s spin: about 45 s in all)
//
//   peer copy      cudaMemcpyAsync of 4 B and of 8 MB into the peer (a chunk's flag, a chunk)
//   local copy     cudaMemcpyAsync of 8 MB within GPU 0
//   write value    cuStreamWriteValue32 into the peer (through the runtime's driver entry point)
//   event          cudaEventRecord, cudaStreamWaitEvent, and the pair (a stream join)
//   launch         an empty kernel of 24 blocks of 768 threads (the op kernels' grid)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

namespace {

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void empty_kernel(int* p) {
  if (p != nullptr && threadIdx.x == 0) *p = 1;
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

}  // namespace

int main() {
  int n = 0;
  if (!ok(cudaGetDeviceCount(&n), "cudaGetDeviceCount")) return 1;
  if (n < 2) {
    std::fprintf(stderr, "call_cost_probe needs 2 GPUs (peer copies), found %d\n", n);
    return 2;
  }
  char *remote = nullptr, *local = nullptr;
  int* word = nullptr;
  if (!ok(cudaSetDevice(1), "cudaSetDevice(1)") || !ok(cudaMalloc(&remote, 64 << 20), "cudaMalloc on GPU 1") ||
      !ok(cudaSetDevice(0), "cudaSetDevice(0)") || !ok(cudaDeviceEnablePeerAccess(1, 0), "peer access 0 -> 1") ||
      !ok(cudaMalloc(&local, 64 << 20), "cudaMalloc on GPU 0") || !ok(cudaMalloc(&word, 4096), "cudaMalloc word"))
    return 1;
  cudaStream_t s, s2;
  cudaEvent_t ev;
  if (!ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream") ||
      !ok(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "stream") ||
      !ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event"))
    return 1;
  WriteValue32 write_value32 = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", reinterpret_cast<void**>(&write_value32), 12000,
                                       cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    write_value32 = nullptr;

  auto time = [&](const char* name, const std::function<void()>& call) {
    std::vector<double> rounds;
    for (int round = 0; round < 5; ++round) {
      spin<<<1, 1, 0, s>>>(2000000000LL);  // ~1 s at H100 clocks: longer than any round's enqueueing
      spin<<<1, 1, 0, s2>>>(2000000000LL);
      constexpr int kCalls = 200;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kCalls; ++i) call();
      const auto t1 = std::chrono::steady_clock::now();
      rounds.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls);
      cudaDeviceSynchronize();
    }
    std::sort(rounds.begin(), rounds.end());
    std::printf("%-40s %6.2f us per call (min %.2f)\n", name, rounds[2], rounds[0]);
    std::fflush(stdout);  // line by line through a pipe, so a run cut short still shows what it measured
  };
  time("peer copy 4 B", [&] { cudaMemcpyAsync(remote + 64, word, 4, cudaMemcpyDefault, s); });
  time("peer copy 8 MB", [&] { cudaMemcpyAsync(remote, local, 8 << 20, cudaMemcpyDefault, s); });
  time("local copy 8 MB", [&] { cudaMemcpyAsync(local + (32 << 20), local, 8 << 20, cudaMemcpyDefault, s); });
  if (write_value32 != nullptr)
    time("write value into the peer", [&] {
      write_value32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(remote + 128), 7, 0);
    });
  time("event record", [&] { cudaEventRecord(ev, s); });
  time("stream wait event", [&] { cudaStreamWaitEvent(s2, ev, 0); });
  time("event record + stream wait", [&] {
    cudaEventRecord(ev, s);
    cudaStreamWaitEvent(s2, ev, 0);
  });
  time("kernel launch <<<24, 768>>>", [&] { empty_kernel<<<24, 768, 0, s>>>(nullptr); });
  return ok(cudaDeviceSynchronize(), "synchronize") && ok(cudaGetLastError(), "last error") ? 0 : 1;
}
