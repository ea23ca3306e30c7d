// Landing-area polling probe (issue 28): can the copy-engine ops drop their chunk flags? Today a peer's block
// crosses in chunks, each followed by a 4-byte flag copy; every chunk boundary costs the engine a few microseconds
// and the SMs wait for the last chunk's flag before they touch its rows (the tail). Here the landing area holds a
// sentinel (every 32-bit word all ones, a NaN in BF16, FP8 and float32) before the copy; the engine moves the block
// in one copy, and the SMs read each 16-byte word as soon as it holds no sentinel word, then write the sentinel
// back so the next round finds the area ready. A word is written once per round by the engine, so any value that
// is not the sentinel is the final one.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -Inative/include -o /tmp/lpp native/bench/probes/landing_poll_probe.cu
//   /tmp/lpp [tokens] [reps] [mode]
//
// Two GPUs, each returning `tokens` BF16 rows of hidden 7168 to the other, both at once. Modes (24 blocks of 768
// threads, DeepSeek-V3's 24 SMs; warps walk the tokens in order, strided over every warp of the grid):
//   wait1       one copy per GPU and its flag; the kernel only waits for the flag: the engines alone
//   chunk_sum   the combine's shape today: 4 halving chunks (1/2, 1/4, 1/8, the rest), a flag copy after each; a warp
//               waits for its token's chunk flag, then sums its own copy and the landed one (float32, one rounding)
//   poll_sum    one copy, no flag wait: a warp polls the landed row's words, sums, writes the sentinel back
//   poll_sum_nr the same without writing the sentinel back (the host refills the area before the timed round)
//   chunk_copy  the BF16 dispatch's shape today: 3 chunks (76%, 19%, 5%), the kernel copies each landed row to y
//   poll_copy   one copy, rows copied to y as their words land, the sentinel written back
// Every round ends with a done hand-shake (no GPU leaves while its peer may still write its landing area).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../src/kernels/bf16.cuh"
#include "probe_common.cuh"

using namespace uccl_moe;
using kernels::add_bf16x8;
using kernels::pack_bf16x8;

constexpr int kThreads = 768, kWarps = kThreads / 32, kSU = 4, kSms = 24;
constexpr long long kRowWords = 896;  // 14336 B: BF16 hidden 7168
enum Mode { kWait1, kChunkSum, kPollSum, kPollSumNr, kChunkCopy, kPollCopy, kNumModes };
const char* const kModeNames[kNumModes] = {"wait1", "chunk_sum", "poll_sum", "poll_sum_nr", "chunk_copy",
                                           "poll_copy"};
__host__ __device__ constexpr bool polls(int m) { return m == kPollSum || m == kPollSumNr || m == kPollCopy; }
__host__ __device__ constexpr bool sums(int m) { return m == kChunkSum || m == kPollSum || m == kPollSumNr; }

struct Args {
  const int4* own;  // our own copy of each token (combine: the row this GPU keeps)
  int4* land;       // the peer's rows land here
  int4* y;          // outputs
  int32_t* ready;   // [chunks] flags the peer's engine copies after each chunk
  int32_t* done;    // blocks of the peer finished with this GPU's memory
  int32_t* peer_done;
  long long tokens;
  long long chunk_end[4];  // end token of each chunk (the last: tokens)
  int32_t epoch;
};

__device__ __forceinline__ int4 load_volatile_128(const int4* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ bool has_sentinel(const int4& v) {
  return v.x == -1 || v.y == -1 || v.z == -1 || v.w == -1;
}
template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) probe(Args a) {
  const int lane = threadIdx.x % 32;
  const long long gw = static_cast<long long>(blockIdx.x) * kWarps + threadIdx.x / 32, step = 1ll * gridDim.x * kWarps;
  if (kMode == kWait1) {
    if (blockIdx.x == 0 && threadIdx.x == 0) spin_until(a.ready, a.epoch, "copy");
  } else {
    int landed = 0;  // chunks this warp saw flagged
    for (long long t = gw; t < a.tokens; t += step) {
      if (!polls(kMode)) {  // chunk flags land in stream order: a chunk's flag covers every earlier chunk
        int c = 0;
        while (t >= a.chunk_end[c]) ++c;
        if (c >= landed) {
          if (lane == 0) spin_until(a.ready + c, a.epoch, "chunk");
          __syncwarp();
          landed = c + 1;
        }
      }
      const int4* own = a.own + t * kRowWords;
      int4* land = a.land + t * kRowWords;
      int4* y = a.y + t * kRowWords;
#pragma unroll 1
      for (long long w = lane; w < kRowWords; w += 32 * kSU) {
        int4 o[kSU], v[kSU];
#pragma unroll
        for (int u = 0; u < kSU; ++u)
          if (w + u * 32 < kRowWords) {
            if (sums(kMode)) o[u] = __ldcs(own + w + u * 32);
            v[u] = polls(kMode) ? load_volatile_128(land + w + u * 32) : __ldcg(land + w + u * 32);
          }
        if (polls(kMode)) {
#pragma unroll
          for (int u = 0; u < kSU; ++u) {
            long long spins = 0;
            while (w + u * 32 < kRowWords && has_sentinel(v[u])) {
              if (++spins > (1ll << 31)) {
                printf("probe: poll timed out at token %lld\n", t);
                __trap();
              }
              v[u] = load_volatile_128(land + w + u * 32);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kSU; ++u) {
          if (w + u * 32 >= kRowWords) continue;
          if (sums(kMode)) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            add_bf16x8(acc, o[u]);
            add_bf16x8(acc, v[u]);
            __stcs(y + w + u * 32, pack_bf16x8(acc));
          } else {
            __stcs(y + w + u * 32, v[u]);
          }
          if (kMode == kPollSum || kMode == kPollCopy) __stcg(land + w + u * 32, make_int4(-1, -1, -1, -1));
        }
      }
    }
  }
  // done: the peer may write our landing area again only after every block here finished with it
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    atomicAdd_system(a.peer_done, 1);
    spin_until(a.done, a.epoch * static_cast<int32_t>(gridDim.x), "done");
  }
}

__host__ __device__ inline float input_value(int g, bool own, long long t, long long col) {
  return static_cast<float>((g * 7 + (own ? 3 : 0) + t * 5 + col) % 17) * 0.125f;
}
__global__ void fill(int4* x, int g, bool own, long long T) {
  const long long step = 1ll * gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * 1ll * blockDim.x + threadIdx.x; i < T * kRowWords; i += step) {
    float v[8];
    for (int k = 0; k < 8; ++k) v[k] = input_value(g, own, i / kRowWords, (i % kRowWords) * 8 + k);
    x[i] = pack_bf16x8(v);
  }
}

int main(int argc, char** argv) {
  const long long T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  const char* only = argc > 3 ? argv[3] : nullptr;
  if (visible_gpus(2) != 2) {
    std::fprintf(stderr, "runs on 2 GPUs\n");
    return 1;
  }
  const size_t bytes = T * kRowWords * 16;
  int4 *own[2], *send[2], *land[2], *y[2];
  int32_t *ready[2], *done[2], *epoch_word[2], *host_flag = nullptr;
  void* flush[2];
  cudaStream_t st[2], ce[2];
  std::vector<cudaEvent_t> e0(2), e1(2);
  CK(cudaHostAlloc(&host_flag, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable));
  *reinterpret_cast<volatile int32_t*>(host_flag) = 0;
  for (int g = 0; g < 2; ++g) {
    enable_peer_access(g, 2);
    CK(cudaMalloc(&own[g], bytes));
    CK(cudaMalloc(&send[g], bytes));
    CK(cudaMalloc(&land[g], bytes));
    CK(cudaMalloc(&y[g], bytes));
    CK(cudaMalloc(&ready[g], 64 * sizeof(int32_t)));
    CK(cudaMemset(ready[g], 0, 64 * sizeof(int32_t)));
    CK(cudaMalloc(&done[g], sizeof(int32_t)));
    CK(cudaMemset(done[g], 0, sizeof(int32_t)));
    CK(cudaMalloc(&epoch_word[g], sizeof(int32_t)));
    CK(cudaMalloc(&flush[g], kFlushBytes));
    CK(cudaMemset(land[g], 0xff, bytes));
    fill<<<264, 512>>>(own[g], g, true, T);
    fill<<<264, 512>>>(send[g], g, false, T);
    CK(cudaGetLastError());
    CK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&ce[g], cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0[g]));
    CK(cudaEventCreate(&e1[g]));
  }
  sync_all(2);
  int32_t epoch = 0;
  bool clean = true;  // the landing areas hold the sentinel everywhere
  auto once = [&](int mode) {
    ++epoch;
    std::vector<long long> ends;
    if (mode == kChunkSum) ends = {T / 2, T * 3 / 4, T * 7 / 8, T};
    else if (mode == kChunkCopy) ends = {T * 76 / 100, T * 95 / 100, T};
    else ends = {T};
    for (int g = 0; g < 2; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMemsetAsync(flush[g], g, kFlushBytes, st[g]));
      if (!clean) CK(cudaMemsetAsync(land[g], 0xff, bytes, st[g]));  // untimed: before the gate
    }
    sync_all(2);
    for (int g = 0; g < 2; ++g) {
      CK(cudaSetDevice(g));
      int32_t* flag_dev = nullptr;
      CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), host_flag, 0));
      start_gate<<<1, 1, 0, st[g]>>>(flag_dev, epoch, epoch_word[g]);
      CK(cudaGetLastError());
      CK(cudaEventRecord(e0[g], st[g]));
      CK(cudaStreamWaitEvent(ce[g], e0[g], 0));
      const int p = 1 - g;
      long long r0 = 0;
      for (size_t c = 0; c < ends.size(); ++c) {
        CK(cudaMemcpyAsync(land[p] + r0 * kRowWords, send[g] + r0 * kRowWords, (ends[c] - r0) * kRowWords * 16,
                           cudaMemcpyDeviceToDevice, ce[g]));
        if (!polls(mode) || c + 1 == ends.size())
          CK(cudaMemcpyAsync(ready[p] + c, epoch_word[g], sizeof(int32_t), cudaMemcpyDeviceToDevice, ce[g]));
        r0 = ends[c];
      }
      Args a{};
      a.own = own[g];
      a.land = land[g];
      a.y = y[g];
      a.ready = ready[g];
      a.done = done[g];
      a.peer_done = done[p];
      a.tokens = T;
      for (size_t c = 0; c < ends.size(); ++c) a.chunk_end[c] = ends[c];
      a.epoch = epoch;
      switch (mode) {
        case kWait1: probe<kWait1><<<kSms, kThreads, 0, st[g]>>>(a); break;
        case kChunkSum: probe<kChunkSum><<<kSms, kThreads, 0, st[g]>>>(a); break;
        case kPollSum: probe<kPollSum><<<kSms, kThreads, 0, st[g]>>>(a); break;
        case kPollSumNr: probe<kPollSumNr><<<kSms, kThreads, 0, st[g]>>>(a); break;
        case kChunkCopy: probe<kChunkCopy><<<kSms, kThreads, 0, st[g]>>>(a); break;
        default: probe<kPollCopy><<<kSms, kThreads, 0, st[g]>>>(a); break;
      }
      CK(cudaGetLastError());
      CK(cudaEventRecord(e1[g], st[g]));
    }
    *reinterpret_cast<volatile int32_t*>(host_flag) = epoch;
    sync_all(2);
    clean = mode == kPollSum || mode == kPollCopy;
    return slowest_ms(2, e0, e1) * 1e3f;
  };
  auto check = [&](int mode) {
    if (mode == kWait1) return;
    std::vector<uint16_t> row(kRowWords * 8), l(kRowWords * 8);
    for (int g = 0; g < 2; ++g)
      for (long long t = 0; t < T; t += std::max(1ll, T / 64)) {
        CK(cudaSetDevice(g));
        CK(cudaMemcpy(row.data(), y[g] + t * kRowWords, kRowWords * 16, cudaMemcpyDeviceToHost));
        if (mode == kPollSum || mode == kPollCopy) {  // the sentinel is back
          CK(cudaMemcpy(l.data(), land[g] + t * kRowWords, kRowWords * 16, cudaMemcpyDeviceToHost));
          for (uint16_t b : l)
            if (b != 0xffff) {
              std::fprintf(stderr, "%s: GPU %d token %lld: sentinel not restored\n", kModeNames[mode], g, t);
              std::exit(1);
            }
        }
        for (long long col = 0; col < kRowWords * 8; ++col) {
          float want = input_value(1 - g, false, t, col) + (sums(mode) ? input_value(g, true, t, col) : 0.f);
          const unsigned bits = static_cast<unsigned>(row[col]) << 16;
          float got;
          std::memcpy(&got, &bits, 4);
          if (got != want) {
            std::fprintf(stderr, "%s: GPU %d token %lld col %lld: %g, want %g\n", kModeNames[mode], g, t, col, got,
                         want);
            std::exit(1);
          }
        }
      }
  };
  std::printf("landing_poll_probe: 2 GPUs, %lld tokens of %lld B each way, %d SMs, median of %d (us, slowest GPU)\n", T,
              kRowWords * 16, kSms, reps);
  std::printf("%-12s %8s %8s %8s %8s\n", "mode", "us", "min", "max", "GB/s");
  // Modes interleave round by round, so a drift of the machine touches all alike.
  std::vector<std::vector<float>> times(kNumModes);
  for (int m = 0; m < kNumModes; ++m) {
    if (only != nullptr && std::strcmp(only, kModeNames[m]) != 0) continue;
    for (int g = 0; g < 2; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMemset(y[g], 0, bytes));
    }
    once(m);
    check(m);
  }
  for (int r = 0; r < reps; ++r)
    for (int m = 0; m < kNumModes; ++m) {
      if (only != nullptr && std::strcmp(only, kModeNames[m]) != 0) continue;
      times[m].push_back(once(m));
    }
  for (int m = 0; m < kNumModes; ++m) {
    if (times[m].empty()) continue;
    std::vector<float> t = times[m];
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2];
    std::printf("%-12s %8.1f %8.1f %8.1f %8.1f\n", kModeNames[m], med, t.front(), t.back(),
                static_cast<double>(bytes) / (med * 1e-6) / 1e9);
  }
  return 0;
}
