// Combine-shaped probe: how fast can a combine of BF16 rows run on this host's NVLink if the ring protocol goes,
// and which side should cross the link? Decides the design of a ring-free combine (issue 5).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -Inative/include -o /tmp/cpp native/bench/probes/combine_pull_probe.cu
//   /tmp/cpp [tokens] [reps]
//
// One process drives every visible GPU (peer access on). Every GPU g owns `tokens` tokens; every token has one
// BF16 row of hidden 7168 at every GPU (at EP2 with top-8 of 256 experts 99.6% of tokens do). GPU g's combine
// input `xu[g]` holds, for each GPU p, the `tokens` rows it must give back to p (block p; block g are its own).
// GPU g writes y[g][t] = sum over p of its copy of token t, in float32 in rank order, rounded once to BF16.
// Modes (all end with a barrier: no GPU leaves while a peer still reads its memory):
//   zero_copy  the inputs already sit in peer-visible memory: the receiver loads each peer's copy over NVLink,
//              its own from xu (what a combine could do if the caller wrote x into the comm buffer)
//   copy_pull  each GPU first copies the blocks its peers need into its own peer-visible buffer, in chunks,
//              releasing a flag per chunk into every peer's memory; receivers pull each chunk once flagged
//   push_sum   each GPU pushes the blocks into its peers' buffers over NVLink (whole-size landing zone, no ring,
//              a flag per chunk); receivers sum from local memory (the current kernels' direction, without rings)
//   local_sum  every copy read from local memory (no NVLink): what the SMs alone take for the sum
//   pull_only  y = the peers' copies only, pulled (no own row): the link alone
//   ce_sum     the copy engines move each peer's block into the peer's landing zone (cudaMemcpyAsync, one stream
//              per peer, a chunk at a time, each chunk followed on the same stream by a 4-byte copy of the epoch
//              into the peer's flag for it); the kernel's blocks all sum chunk c once flagged: no SM crosses the
//              link (issue 28: 24 SMs push at most ~320 GB/s, the copy engines move ~350 with both GPUs sending)
//   ce_wait    the same copies, the kernel only waits for every flag: the copy engines alone
//   ce_sum2 / ce_wait2  the same, with chunk c on the second of two streams per peer when c is odd (do two streams
//              per direction move more than one, with both GPUs sending?); chunk 4096 is one copy per peer
//   ce_sumwv / ce_waitwv  the same as ce_sum / ce_wait, each chunk's flag written by a stream memory operation
//              (cuStreamWriteValue32, with its default fence) instead of a 4-byte copy-engine copy: what do the flag
//              copies cost between the chunks?
//   ce_sumws / ce_waitws / ce_waitcs  each chunk's flag on a second stream per peer, after an event on the chunk
//              (a stream memory operation; ce_waitcs: a 4-byte copy), so nothing runs between the chunks on the
//              first stream: what is a chunk boundary without the flag between the copies?
//   ce_push    the copy engines move the first `chunk` tokens of each peer's block (one copy and its flag) while the
//              kernel's SMs push the rest into the peer's landing zone at once, then wait for both: does the link move
//              more with both kinds of writer than with the engines alone? (chunk = tokens: the engines alone, one
//              copy, as ce_wait; chunk 0: the SMs alone)
// Blocks walk chunks of `chunk` tokens round robin; copy_pull / push_sum move chunk c + blocks before summing c.
// The ce_ modes time from a start gate every GPU passes once the host has enqueued every copy (start_gate,
// probe_common.cuh).
//   /tmp/cpp [tokens] [reps] [mode]   (mode: run only that one)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../src/kernels/bf16.cuh"  // the kernels' own BF16 sum and rounding
#include "probe_common.cuh"

using namespace uccl_moe;
using kernels::add_bf16x8;
using kernels::pack_bf16x8;

constexpr int kMaxGpus = 8, kThreads = 768, kWarps = kThreads / 32, kU = 4;
constexpr int kRowWords = 896;  // 14336 B: BF16 hidden 7168
enum Mode {
  kZeroCopy, kCopyPull, kPushSum, kLocalSum, kPullOnly, kCeSum, kCeWait, kCeSum2, kCeWait2, kCeSumWv, kCeWaitWv,
  kCePush, kCeSumWs, kCeWaitWs, kCeWaitCs, kNumModes
};
const char* const kModeNames[kNumModes] = {"zero_copy", "copy_pull", "push_sum", "local_sum", "pull_only", "ce_sum",
                                           "ce_wait",   "ce_sum2",   "ce_wait2", "ce_sumwv",  "ce_waitwv", "ce_push",
                                           "ce_sumws", "ce_waitws", "ce_waitcs"};
constexpr bool is_ce(int mode) { return mode >= kCeSum; }
constexpr bool two_streams(int mode) { return mode == kCeSum2 || mode == kCeWait2; }
constexpr bool write_value(int mode) { return mode == kCeSumWv || mode == kCeWaitWv; }
constexpr bool side_flag(int mode) { return mode == kCeSumWs || mode == kCeWaitWs || mode == kCeWaitCs; }
constexpr bool only_waits(int mode) {
  return mode == kCeWait || mode == kCeWait2 || mode == kCeWaitWv || mode == kCePush || mode == kCeWaitWs ||
         mode == kCeWaitCs;
}
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Args {
  int4* xu[kMaxGpus];      // inputs, [n blocks][tokens][row]
  int4* xb[kMaxGpus];      // peer-visible staging, same shape
  int4* y[kMaxGpus];       // outputs, [tokens][row]
  int32_t* ready[kMaxGpus];  // [n][chunks] chunk flags, then [n] start flags
  int32_t* done[kMaxGpus];   // one counter: peer blocks finished with my memory
  int32_t* pushed[kMaxGpus];  // ce_push: [n] blocks of each peer whose pushed rows landed here
  int me, tokens, chunk, chunks;
  int32_t epoch;
};

/// Words [0, words) of s into d (peer memory: stores that bypass L1), this thread's share: first, first + step, ...,
/// kU words in flight.
__device__ __forceinline__ void copy_words(int4* d, const int4* s, long long words, long long first, long long step) {
  for (long long i = first; i < words; i += step * kU) {
    int4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * step < words) v[u] = __ldcs(s + i + u * step);
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * step < words) __stcg(d + i + u * step, v[u]);
  }
}

/// y[me][t]: token t's copies where `kMode` finds them, summed in float32 in rank order, rounded once to BF16. Warp.
template <int N, int kMode>
__device__ __forceinline__ void sum_token(const Args& a, long long t, int lane) {
  const int me = a.me;
  const long long T = a.tokens, rw = kRowWords;
  constexpr bool kReadsPeers = kMode == kZeroCopy || kMode == kCopyPull || kMode == kPullOnly;
  const int4* src[N];
#pragma unroll
  for (int p = 0; p < N; ++p) {
    if (kMode == kLocalSum) src[p] = a.xu[me] + (p * T + t) * rw;
    else if (p == me) src[p] = a.xu[me] + (me * T + t) * rw;
    else if (kMode == kPushSum || kMode == kCeSum) src[p] = a.xb[me] + (p * T + t) * rw;
    else if (kMode == kCopyPull) src[p] = a.xb[p] + (me * T + t) * rw;
    else src[p] = a.xu[p] + (me * T + t) * rw;
  }
  int4* dst = a.y[me] + t * rw;
  constexpr int kSU = N <= 2 ? kU : kU / 2;  // 16-B loads per lane in flight: kSU * N
#pragma unroll 1
  for (int w = lane; w < rw; w += 32 * kSU) {
    int4 v[N][kSU];
#pragma unroll
    for (int p = 0; p < N; ++p)
#pragma unroll
      for (int u = 0; u < kSU; ++u) {
        if (kMode == kPullOnly && p == me) continue;
        const bool remote = kReadsPeers && kMode != kLocalSum && p != me;
        if (w + u * 32 < rw) v[p][u] = remote ? __ldcg(src[p] + w + u * 32) : __ldcs(src[p] + w + u * 32);
      }
#pragma unroll
    for (int u = 0; u < kSU; ++u) {
      if (w + u * 32 >= rw) continue;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int p = 0; p < N; ++p)
        if (!(kMode == kPullOnly && p == me)) add_bf16x8(acc, v[p][u]);
      __stcs(dst + w + u * 32, pack_bf16x8(acc));
    }
  }
}

template <int N, int kMode>
__global__ void __launch_bounds__(kThreads, 1) combine_probe(Args a) {
  const int me = a.me, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long T = a.tokens, rw = kRowWords;
  constexpr bool kStaged = kMode == kCopyPull || kMode == kPushSum;
  int32_t* start = a.ready[me] + N * a.chunks;
  if (kMode == kZeroCopy || kMode == kPullOnly) {  // my inputs are written (stream order): tell the peers
    if (blockIdx.x == 0 && threadIdx.x < N && threadIdx.x != me) {
      __threadfence_system();
      gpu::store_release_sys(a.ready[threadIdx.x] + N * a.chunks + me, a.epoch);
    }
    if (threadIdx.x < N && threadIdx.x != me) spin_until(start + threadIdx.x, a.epoch, "start");
    __syncthreads();
  }
  // Moves my rows for every peer p, tokens of chunk c: into my staging (copy_pull) or p's (push_sum).
  auto stage = [&](int c) {
    const long long r0 = static_cast<long long>(c) * a.chunk, r1 = min(T, r0 + a.chunk), words = (r1 - r0) * rw;
#pragma unroll 1
    for (int p = 0; p < N; ++p) {
      if (p == me) continue;
      const int4* s = a.xu[me] + (p * T + r0) * rw;
      int4* d = kMode == kPushSum ? a.xb[p] + (me * T + r0) * rw : a.xb[me] + (p * T + r0) * rw;
      copy_words(d, s, words, threadIdx.x, kThreads);
    }
    __syncthreads();
    if (threadIdx.x < N && threadIdx.x != me) {
      __threadfence_system();
      gpu::store_release_sys(a.ready[threadIdx.x] + me * a.chunks + c, a.epoch);
    }
  };
  auto sum = [&](int c) {
    if (kStaged) {
      if (threadIdx.x < N && threadIdx.x != me) spin_until(a.ready[me] + threadIdx.x * a.chunks + c, a.epoch, "chunk");
      __syncthreads();
    }
    const long long r0 = static_cast<long long>(c) * a.chunk, r1 = min(T, r0 + a.chunk);
    for (long long t = r0 + warp; t < r1; t += kWarps) sum_token<N, kMode>(a, t, lane);
  };
  int c = blockIdx.x;
  if (kStaged && c < a.chunks) stage(c);
  for (; c < a.chunks; c += gridDim.x) {
    if (kStaged && c + static_cast<int>(gridDim.x) < a.chunks) stage(c + gridDim.x);
    sum(c);
  }
  if (kMode != kLocalSum) {  // nobody may reuse memory a peer still reads or writes
    __syncthreads();
    if (threadIdx.x < N && threadIdx.x != me) atomicAdd_system(a.done[threadIdx.x], 1);
    if (threadIdx.x == 0) spin_until(a.done[me], static_cast<int32_t>(gridDim.x) * (N - 1), "done");
  }
}

/// ce_sum / ce_wait: the copy engines move the rows (host side, `once`); every block takes its share of chunk c's
/// tokens once each peer's flag for c arrived (ce_wait: only waits).
template <int N, int kMode>
__global__ void __launch_bounds__(kThreads, 1) ce_probe(Args a) {
  const int me = a.me, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int c = 0; c < a.chunks; ++c) {
    if (threadIdx.x < N && threadIdx.x != me) spin_until(a.ready[me] + threadIdx.x * a.chunks + c, a.epoch, "ce chunk");
    __syncthreads();
    if (kMode != kCeSum) continue;
    const long long r0 = static_cast<long long>(c) * a.chunk, r1 = min(static_cast<long long>(a.tokens), r0 + a.chunk);
    for (long long t = r0 + static_cast<long long>(blockIdx.x) * kWarps + warp; t < r1;
         t += static_cast<long long>(gridDim.x) * kWarps)
      sum_token<N, kMode>(a, t, lane);
  }
}

/// ce_push: rows [chunk, tokens) of each peer's block pushed by the SMs into the peer's landing zone, while the
/// engines move [0, chunk) (host side); then every GPU waits for both kinds of rows from every peer.
template <int N>
__global__ void __launch_bounds__(kThreads, 1) ce_push_probe(Args a) {
  const int me = a.me;
  const long long T = a.tokens, rw = kRowWords, split = a.chunk;
#pragma unroll 1
  for (int p = 0; p < N; ++p) {
    if (p == me) continue;
    const int4* s = a.xu[me] + (p * T + split) * rw;
    int4* d = a.xb[p] + (me * T + split) * rw;
    const long long step = static_cast<long long>(gridDim.x) * kThreads;
    copy_words(d, s, (T - split) * rw, static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x, step);
  }
  __syncthreads();
  if (threadIdx.x < N && threadIdx.x != me) {
    __threadfence_system();
    atomicAdd_system(a.pushed[threadIdx.x] + me, 1);
  }
  if (blockIdx.x == 0 && threadIdx.x < N && threadIdx.x != me) {
    spin_until(a.pushed[me] + threadIdx.x, static_cast<int32_t>(gridDim.x), "pushed");
    if (split > 0) spin_until(a.ready[me] + threadIdx.x * a.chunks, a.epoch, "ce_push chunk");
  }
}

// value of column `col` of token t in block `blk` of GPU g's input: exact in BF16, sums of 8 stay exact
__host__ __device__ inline float input_value(int g, int blk, long long t, int col) {
  return static_cast<float>((g * 7 + blk * 3 + t * 5 + col) % 17) * 0.125f;
}
__global__ void fill(int4* x, int g, int n, long long T) {
  const long long words = n * T * kRowWords;
  for (long long i = blockIdx.x * 1ll * blockDim.x + threadIdx.x; i < words; i += 1ll * gridDim.x * blockDim.x) {
    const int blk = static_cast<int>(i / (T * kRowWords));
    const long long t = (i / kRowWords) % T;
    const int col0 = static_cast<int>(i % kRowWords) * 8;
    float v[8];
    for (int k = 0; k < 8; ++k) v[k] = input_value(g, blk, t, col0 + k);
    x[i] = pack_bf16x8(v);
  }
}

template <int N>
void launch(int mode, dim3 grid, cudaStream_t s, const Args& a) {
  switch (mode) {
    case kZeroCopy: combine_probe<N, kZeroCopy><<<grid, kThreads, 0, s>>>(a); break;
    case kCopyPull: combine_probe<N, kCopyPull><<<grid, kThreads, 0, s>>>(a); break;
    case kPushSum: combine_probe<N, kPushSum><<<grid, kThreads, 0, s>>>(a); break;
    case kLocalSum: combine_probe<N, kLocalSum><<<grid, kThreads, 0, s>>>(a); break;
    case kCeSum:
    case kCeSum2:
    case kCeSumWv:
    case kCeSumWs: ce_probe<N, kCeSum><<<grid, kThreads, 0, s>>>(a); break;
    case kCeWait:
    case kCeWait2:
    case kCeWaitWv:
    case kCeWaitWs:
    case kCeWaitCs: ce_probe<N, kCeWait><<<grid, kThreads, 0, s>>>(a); break;
    case kCePush: ce_push_probe<N><<<grid, kThreads, 0, s>>>(a); break;
    default: combine_probe<N, kPullOnly><<<grid, kThreads, 0, s>>>(a); break;
  }
  CK(cudaGetLastError());
}

int main(int argc, char** argv) {
  const long long T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 15;
  const char* only = argc > 3 ? argv[3] : nullptr;
  const int n = visible_gpus(kMaxGpus);
  if (n != 2 && n != 4) {
    std::fprintf(stderr, "runs on 2 or 4 GPUs, found %d\n", n);
    return 1;
  }
  const long long row_bytes = kRowWords * 16ll, block_bytes = T * row_bytes;
  const int max_chunks = 4096;
  WriteValue32 write_value32 = nullptr;  // the driver's cuStreamWriteValue32, through the runtime's entry point
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", reinterpret_cast<void**>(&write_value32), 12000,
                                       cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    write_value32 = nullptr;  // the *wv modes are skipped
  }
  Args a{};
  std::vector<cudaStream_t> st(n), ce(2 * n * n);  // ce[(i * n + g) * n + p]: GPU g's copies to peer p, stream i
  std::vector<int32_t*> epoch_word(n);           // the flag value the copy engines copy after each chunk
  int32_t* host_flag = nullptr;                  // the ce_ modes' start gate (mapped pinned memory)
  CK(cudaHostAlloc(&host_flag, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable));
  *reinterpret_cast<volatile int32_t*>(host_flag) = 0;
  std::vector<cudaEvent_t> e0(n), e1(n), chunk_ev(n * kMaxGpus * 32);
  std::vector<void*> flush(n);
  for (int g = 0; g < n; ++g) {
    enable_peer_access(g, n);
    CK(cudaMalloc(&a.xu[g], block_bytes * n));
    CK(cudaMalloc(&a.xb[g], block_bytes * n));
    CK(cudaMalloc(&a.y[g], block_bytes));
    CK(cudaMalloc(&a.ready[g], sizeof(int32_t) * (n * max_chunks + n)));
    CK(cudaMemset(a.ready[g], 0, sizeof(int32_t) * (n * max_chunks + n)));
    CK(cudaMalloc(&a.done[g], sizeof(int32_t)));
    CK(cudaMalloc(&a.pushed[g], sizeof(int32_t) * kMaxGpus));
    CK(cudaMalloc(&flush[g], kFlushBytes));
    fill<<<264, 512>>>(a.xu[g], g, n, T);
    CK(cudaGetLastError());
    CK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
    for (int p = 0; p < 2 * n; ++p) CK(cudaStreamCreateWithFlags(&ce[(p / n * n + g) * n + p % n], cudaStreamNonBlocking));
    CK(cudaMalloc(&epoch_word[g], sizeof(int32_t)));
    CK(cudaEventCreate(&e0[g]));
    CK(cudaEventCreate(&e1[g]));
    for (int i = 0; i < kMaxGpus * 32; ++i)
      CK(cudaEventCreateWithFlags(&chunk_ev[g * kMaxGpus * 32 + i], cudaEventDisableTiming));
  }
  sync_all(n);
  int32_t epoch = 0;
  auto once = [&](int mode, int sms, int chunk) {  // one launch on every GPU; the slowest GPU's kernel time
    ++epoch;
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMemset(a.done[g], 0, sizeof(int32_t)));
      CK(cudaMemset(a.pushed[g], 0, sizeof(int32_t) * kMaxGpus));
      CK(cudaMemsetAsync(flush[g], g, kFlushBytes, st[g]));  // L2 flush
    }
    sync_all(n);
    // ce_push: one copy of `chunk` tokens per peer (none at chunk 0)
    const int chunks = mode == kCePush ? 1 : static_cast<int>((T + chunk - 1) / chunk);
    if (is_ce(mode))  // every GPU waits at the gate until the host enqueued every copy (set below)
      for (int g = 0; g < n; ++g) {
        CK(cudaSetDevice(g));
        int32_t* flag_dev = nullptr;
        CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), host_flag, 0));
        start_gate<<<1, 1, 0, st[g]>>>(flag_dev, epoch, epoch_word[g]);
        CK(cudaGetLastError());
      }
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(g));
      Args ag = a;
      ag.me = g;
      ag.tokens = static_cast<int>(T);
      ag.chunk = chunk;
      ag.chunks = chunks;
      ag.epoch = epoch;
      CK(cudaEventRecord(e0[g], st[g]));
      for (int p = 0; p < n && is_ce(mode); ++p) {  // block p of our rows into p's landing zone, chunk by chunk
        if (p == g) continue;
        for (int i = 0; i < 2; ++i) CK(cudaStreamWaitEvent(ce[(i * n + g) * n + p], e0[g], 0));
        for (int c = 0; c < chunks; ++c) {
          cudaStream_t s = ce[((two_streams(mode) ? c % 2 : 0) * n + g) * n + p];
          const long long r0 = static_cast<long long>(c) * chunk, rows = std::min<long long>(chunk, T - r0);
          if (rows <= 0) continue;  // ce_push with no engine share
          CK(cudaMemcpyAsync(a.xb[p] + (g * T + r0) * kRowWords, a.xu[g] + (p * T + r0) * kRowWords,
                             rows * row_bytes, cudaMemcpyDeviceToDevice, s));
          if (side_flag(mode)) {  // the flag on the second stream after an event on the chunk: no op between chunks
            cudaStream_t side = ce[((1 * n) + g) * n + p];
            cudaEvent_t ev = chunk_ev[(g * kMaxGpus + p) * 32 + c];
            CK(cudaEventRecord(ev, s));
            CK(cudaStreamWaitEvent(side, ev, 0));
            if (mode == kCeWaitCs) {
              CK(cudaMemcpyAsync(a.ready[p] + g * chunks + c, epoch_word[g], sizeof(int32_t),
                                 cudaMemcpyDeviceToDevice, side));
            } else if (write_value32(reinterpret_cast<CUstream>(side),
                                     reinterpret_cast<CUdeviceptr>(a.ready[p] + g * chunks + c),
                                     static_cast<cuuint32_t>(epoch), CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
              std::fprintf(stderr, "cuStreamWriteValue32 failed on the side stream\n");
              std::exit(1);
            }
          } else if (write_value(mode)) {  // the flag by the stream's front end, after the chunk (default: fenced)
            const CUresult r = write_value32(reinterpret_cast<CUstream>(s),
                                             reinterpret_cast<CUdeviceptr>(a.ready[p] + g * chunks + c),
                                             static_cast<cuuint32_t>(epoch), CU_STREAM_WRITE_VALUE_DEFAULT);
            if (r != CUDA_SUCCESS) {  // e.g. stream memory operations off in this driver: no such figures
              std::fprintf(stderr, "cuStreamWriteValue32 failed (%d): stopping before the *wv modes' results\n",
                           static_cast<int>(r));
              std::exit(1);
            }
          } else {
            CK(cudaMemcpyAsync(a.ready[p] + g * chunks + c, epoch_word[g], sizeof(int32_t), cudaMemcpyDeviceToDevice,
                               s));  // after the chunk on the same stream: the peer's flag for it
          }
        }
      }
      (n == 2 ? launch<2> : launch<4>)(mode, dim3(sms), st[g], ag);
      CK(cudaEventRecord(e1[g], st[g]));
    }
    if (is_ce(mode)) *reinterpret_cast<volatile int32_t*>(host_flag) = epoch;  // open the gate
    sync_all(n);
    const float worst = slowest_ms(n, e0, e1);
    return worst * 1e3f;
  };
  auto check = [&](int mode) {  // rows 0, T/2 and T-1 of every GPU's output
    if (only_waits(mode)) return;  // no output
    std::vector<uint16_t> row(kRowWords * 8);
    for (int g = 0; g < n; ++g)
      for (long long t : {0ll, T / 2, T - 1}) {
        CK(cudaSetDevice(g));
        CK(cudaMemcpy(row.data(), a.y[g] + t * kRowWords, row_bytes, cudaMemcpyDeviceToHost));
        for (int col = 0; col < kRowWords * 8; ++col) {
          float want = 0;
          for (int p = 0; p < n; ++p) {
            if (mode == kPullOnly && p == g) continue;
            want += mode == kLocalSum ? input_value(g, p, t, col) : input_value(p, g, t, col);
          }
          const unsigned bits = static_cast<unsigned>(row[col]) << 16;
          float got;
          std::memcpy(&got, &bits, 4);
          if (got != want) {
            std::fprintf(stderr, "%s: GPU %d token %lld col %d: %g, want %g\n", kModeNames[mode], g, t, col, got, want);
            std::exit(1);
          }
        }
      }
  };
  std::printf("combine_pull_probe: %d GPUs, %lld tokens per GPU, rows of %lld B, median of %d (kernel us, slowest "
              "GPU); GB/s = rows received from peers per GPU\n",
              n, T, row_bytes, reps);
  std::printf("%-10s %5s %6s %10s %10s %10s\n", "mode", "SMs", "chunk", "us", "min us", "GB/s");
  const double remote_bytes = static_cast<double>(block_bytes) * (n - 1);
  for (int mode = 0; mode < kNumModes; ++mode)
    for (int sms : {16, 24, 32})
      for (int chunk : {24, 48, 96, 256, 512, 1024, 2048, 4096, -8, -7, -6, -5, -4, -1}) {
        if (only != nullptr && std::strcmp(only, kModeNames[mode]) != 0) continue;
        if ((mode == kCePush) != (chunk < 0)) continue;  // ce_push: the engines' share in eighths of the tokens
        if (mode == kCePush) {
          chunk = chunk == -1 ? 0 : static_cast<int>(T * -chunk / 8);
        } else if (is_ce(mode) != (chunk >= 256)) {
          continue;  // the copy engines take big chunks (a host call per chunk)
        }
        if (!is_ce(mode) && !(mode == kCopyPull || mode == kPushSum) && chunk != 48) continue;
        if (is_ce(mode) && mode != kCePush && sms != 24) continue;  // no SMs move rows: 24 sum (DeepSeek-V3's)
        if ((write_value(mode) || (side_flag(mode) && mode != kCeWaitCs)) && write_value32 == nullptr) continue;  // no driver entry point: not measured
        std::vector<float> t;
        CK(cudaSetDevice(0));
        for (int g = 0; g < n; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaMemset(a.y[g], 0xff, block_bytes));
        }
        once(mode, sms, chunk);  // warm-up, then checked
        check(mode);
        for (int r = 0; r < reps; ++r) t.push_back(once(mode, sms, chunk));
        std::sort(t.begin(), t.end());
        const double med = t[t.size() / 2];
        std::printf("%-10s %5d %6d %10.1f %10.1f %10.1f\n", kModeNames[mode], sms, chunk, med, t[0],
                    remote_bytes / (med * 1e-6) / 1e9);
      }
  return 0;
}
