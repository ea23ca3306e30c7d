// NVLink all-to-all probe: how fast can SM stores (push), SM loads (pull) and the copy engines move an
// all-to-all between the GPUs of one host? Locates the ceiling the intranode kernels run against (issue 5).
//
//   nvcc -O3 -arch=sm_90 -o /tmp/nvlink_probe native/bench/probes/nvlink_probe.cu
//   /tmp/nvlink_probe [MB per peer] [reps] [tma]
//
// One process drives every visible GPU (peer access enabled). In one run each GPU moves `MB` MiB to every other
// GPU at once; the time is the slowest GPU's (events on each), the figure is what one GPU sends per second
// (egress, (N-1) * MB / time), the median of `reps` runs.
//   push   kernel on the sender: loads its own rows, stores them into the peer's buffer (what dispatch does)
//   pull   kernel on the receiver: loads the peer's rows over NVLink, stores them locally
//   ce     cudaMemcpyPeerAsync to every peer (copy engines), one stream per peer
//   local, mix, push_fenced: see a2a_kernel (local copies of the same bytes; half the warps push while the other
//          half copy locally, the figure counts the pushed bytes; push in 14-KB rows with a release every 4 rows)
//   push_spread  push_fenced with the peers dealt out per warp instead of per block, so every SM stores into every
//          peer at once, as the intranode kernels' sender blocks do (one warp per (lane, destination))
//   tma_push, tma_local  the same bytes through the Hopper bulk-copy (TMA) unit instead of SM loads/stores: one
//          thread per block streams 16-KB chunks global -> shared (mbarrier) -> global over an 8-stage ring
//          (sm_90 only; the SM's load/store pipeline stays free)
// Kernels: `sms` blocks of `warps` warps; each warp copies a contiguous piece, `unroll` 16-B words per lane in
// flight; blocks are spread over the peers round robin.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_common.cuh"

constexpr int kMaxGpus = 8;
struct Ptrs {
  int4* p[kMaxGpus];
};

enum Mode { kPush, kPull, kLocal, kMix, kPushFenced, kPushSpread };
constexpr int kNumModes = 6;
const char* const kModeNames[kNumModes] = {"push", "pull", "local", "mix", "push_fenced", "push_spread"};
constexpr int kRowWords = 896;     // kPushFenced: 14336-B rows (BF16 hidden 7168) ...
constexpr int kRowsPerFence = 4;   // ... and a release (system fence + flag store) every 4 rows, as dispatch does

// Block b serves peer (me + 1 + b % (n - 1)) % n; the peer's blocks split its words over their warps.
//   kPush / kPushFenced: my slot `peer` of src -> slot `me` of the peer's dst
//   kPull: slot `me` of the peer's src -> my slot `peer` of dst
//   kLocal: my slot `peer` of src -> my slot `peer` of dst (no NVLink; the same bytes)
//   kMix: the block's first half of warps push, the second half copy locally (a dispatch sender at EP2: remote
//         rows and the rows a rank keeps share the SM); each half moves the whole slot, so 2x the bytes of kPush
//   kPushSpread: as kPushFenced, but global warp i serves peer (me + 1 + i % (n - 1)) % n
/// This block's peer, its index among the blocks serving that peer, and their count.
struct BlockPeer {
  int peer, blk, blocks_of_peer;
  __device__ BlockPeer(int me, int n) {
    const int peers = n - 1, k = blockIdx.x % peers;
    peer = (me + 1 + k) % n;
    blk = blockIdx.x / peers;
    blocks_of_peer = (gridDim.x - k + peers - 1) / peers;
  }
};

template <int kUnroll, int kMode>
__global__ void __launch_bounds__(768, 1) a2a_kernel(Ptrs src, Ptrs dst, int me, int n, long long words_per_peer, Ptrs flags) {
  const BlockPeer bp(me, n);
  int peer = bp.peer;
  int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  bool remote = kMode != kLocal;
  if (kMode == kMix) {
    warps /= 2;
    remote = warp < warps;
    warp %= warps;
  }
  // This warp's index among the warps serving `peer`, and their count.
  long long idx = static_cast<long long>(bp.blk) * warps + warp;
  long long total_warps = static_cast<long long>(bp.blocks_of_peer) * warps;
  if (kMode == kPushSpread) {
    const int peers = n - 1;
    const long long g = static_cast<long long>(blockIdx.x) * warps + warp, all = static_cast<long long>(gridDim.x) * warps;
    const int k = static_cast<int>(g % peers);
    peer = (me + 1 + k) % n;
    idx = g / peers;
    total_warps = (all - k + peers - 1) / peers;
  }
  const long long per_warp = (words_per_peer + total_warps - 1) / total_warps;
  const long long w0 = idx * per_warp;
  const long long w1 = w0 + per_warp < words_per_peer ? w0 + per_warp : words_per_peer;
  const int4* s = kMode == kPull ? src.p[peer] + me * words_per_peer : src.p[me] + peer * words_per_peer;
  int4* d = kMode == kPull || !remote ? dst.p[me] + peer * words_per_peer : dst.p[peer] + me * words_per_peer;
  int rows = 0;
  for (long long row = w0; row < w1; row += kRowWords) {
    constexpr bool kRows = kMode == kPushFenced || kMode == kPushSpread;
    const long long row_end = kRows && row + kRowWords < w1 ? row + kRowWords : w1;
    for (long long base = row; base < row_end; base += kUnroll * 32) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const long long i = base + u * 32 + lane;
        if (i < row_end) v[u] = __ldcs(s + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const long long i = base + u * 32 + lane;
        if (i < row_end) __stcs(d + i, v[u]);
      }
    }
    if (!kRows) break;  // one piece: the whole range
    if (++rows % kRowsPerFence == 0 || row + kRowWords >= w1) {
      __syncwarp();
      if (lane == 0) {
        int* flag = reinterpret_cast<int*>(flags.p[peer]) + me * 4096 + blockIdx.x * 32 + warp;  // tail at the peer
        asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(flag), "r"(rows) : "memory");
      }
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PROBE_TMA 1
#endif
constexpr int kTmaChunk = 16384, kTmaStages = 8;
constexpr int kTmaSmem = kTmaChunk * kTmaStages + 64;

// Block b serves the same peer and range as a2a_kernel (kPush or kLocal), split into 16-KB chunks; thread 0
// loads chunk j into stage j % S (completion on mbarrier j % S), stores it from there once loaded, and refills a
// stage only after the store that read it finished reading shared memory.
template <int kMode>
__global__ void tma_kernel(Ptrs src, Ptrs dst, int me, int n, long long words_per_peer) {
#ifdef PROBE_TMA
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kTmaChunk * kTmaStages);
  if (threadIdx.x != 0) return;
  const BlockPeer bp(me, n);
  const int peer = bp.peer;
  const long long bytes = words_per_peer * 16, per_blk = (bytes / bp.blocks_of_peer + 15) / 16 * 16;
  const long long b0 = bp.blk * per_blk, b1 = b0 + per_blk < bytes ? b0 + per_blk : bytes;
  const char* s = reinterpret_cast<const char*>(src.p[me] + peer * words_per_peer);
  char* d = reinterpret_cast<char*>(kMode == kLocal ? dst.p[me] + peer * words_per_peer : dst.p[peer] + me * words_per_peer);
  const int chunks = b0 < b1 ? static_cast<int>((b1 - b0 + kTmaChunk - 1) / kTmaChunk) : 0;
  for (int i = 0; i < kTmaStages; ++i) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar + i));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // Chunk j: its byte offset and length, and the shared-memory addresses of its stage and mbarrier.
  const auto off_of = [&](int j) { return b0 + static_cast<long long>(j) * kTmaChunk; };
  const auto len_of = [&](int j) {
    return static_cast<unsigned>(off_of(j) + kTmaChunk <= b1 ? kTmaChunk : b1 - off_of(j));
  };
  const auto stage_of = [&](int j) {
    return static_cast<unsigned>(__cvta_generic_to_shared(smem + (j % kTmaStages) * kTmaChunk));
  };
  const auto bar_of = [&](int j) { return static_cast<unsigned>(__cvta_generic_to_shared(bar + j % kTmaStages)); };
  auto load = [&](int j) {
    const long long off = off_of(j);
    const unsigned len = len_of(j), a = bar_of(j), sm = stage_of(j);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(len) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sm), "l"(s + off), "r"(len), "r"(a) : "memory");
  };
  for (int j = 0; j < chunks && j < kTmaStages; ++j) load(j);
  for (int j = 0; j < chunks; ++j) {
    const unsigned a = bar_of(j), parity = (j / kTmaStages) & 1;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(a), "r"(parity) : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + off_of(j)), "r"(stage_of(j)),
                 "r"(len_of(j))
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // The store of chunk j - 1 has finished reading its stage once at most one group (chunk j's) is pending.
    if (j >= 1 && j - 1 + kTmaStages < chunks) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(j - 1 + kTmaStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

int main(int argc, char** argv) {
  const long long mb = argc > 1 ? std::atoll(argv[1]) : 48;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 9;
  const int n = visible_gpus(kMaxGpus);
  if (n < 2) {
    std::fprintf(stderr, "needs >= 2 GPUs, found %d\n", n);
    return 1;
  }
  const long long bytes_per_peer = mb << 20, words = bytes_per_peer / 16;
  Ptrs src{}, dst{}, flags{};
  std::vector<cudaStream_t> st(n * kMaxGpus);
  std::vector<cudaEvent_t> e0(n), e1(n);
  for (int g = 0; g < n; ++g) {
    enable_peer_access(g, n);
    CK(cudaMalloc(&src.p[g], bytes_per_peer * n));
    CK(cudaMalloc(&dst.p[g], bytes_per_peer * n));
    CK(cudaMemset(src.p[g], g + 1, bytes_per_peer * n));
    CK(cudaMalloc(&flags.p[g], 1 << 20));
    for (int p = 0; p < n; ++p) CK(cudaStreamCreateWithFlags(&st[g * kMaxGpus + p], cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0[g]));
    CK(cudaEventCreate(&e1[g]));
  }
  auto TS = [&](int g) { return st[g * kMaxGpus + g]; };  // the stream a GPU's run is timed on
  // One run: every GPU starts when the host issues (all issued back to back), the slowest GPU's event time.
  auto run = [&](auto&& launch_on) {
    std::vector<float> t;
    for (int r = 0; r < reps + 1; ++r) {
      sync_all(n);
      for (int g = 0; g < n; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaEventRecord(e0[g], TS(g)));
        launch_on(g);
        CK(cudaEventRecord(e1[g], TS(g)));
      }
      sync_all(n);
      const float worst = slowest_ms(n, e0, e1);
      if (r > 0) t.push_back(worst);  // first run warms up
    }
    std::sort(t.begin(), t.end());
    const double ms = t[t.size() / 2];
    return static_cast<double>(bytes_per_peer) * (n - 1) / (ms * 1e-3) / 1e9;
  };
  std::printf("nvlink_probe: %d GPUs, %lld MiB to each peer per GPU, median of %d; GB/s = one GPU's egress\n", n, mb,
              reps);
  // Copy engines: one stream per peer, joined into the timing stream.
  const double ce = run([&](int g) {
    cudaEvent_t ev;
    CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    CK(cudaEventRecord(ev, TS(g)));
    for (int p = 0; p < n; ++p) {
      if (p == g) continue;
      cudaStream_t s = st[g * kMaxGpus + p];  // stream g of GPU g times the run; streams p != g carry the copies
      CK(cudaStreamWaitEvent(s, ev, 0));
      CK(cudaMemcpyPeerAsync(dst.p[p] + g * words, p, src.p[g] + p * words, g, bytes_per_peer, s));
      cudaEvent_t done;
      CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      CK(cudaEventRecord(done, s));
      CK(cudaStreamWaitEvent(TS(g), done, 0));
      CK(cudaEventDestroy(done));
    }
    CK(cudaEventDestroy(ev));
  });
  std::printf("ce (copy engines, all peers at once): %.1f GB/s\n", ce);
  std::printf("%6s %6s %6s", "SMs", "warps", "unroll");
  for (const char* m : kModeNames) std::printf(" %12s", m);
  std::printf("\n");
  const bool sm_modes = !(argc > 3 && std::string(argv[3]) == "tma");  // "tma": only the bulk-copy table
  const int sm_list[] = {8, 12, 16, 24, 32, 64};
  const int warps = 24;  // 768 threads: a2a_kernel's launch bound
  using K = void (*)(Ptrs, Ptrs, int, int, long long, Ptrs);
  const K k4[kNumModes] = {a2a_kernel<4, 0>, a2a_kernel<4, 1>, a2a_kernel<4, 2>,
                           a2a_kernel<4, 3>, a2a_kernel<4, 4>, a2a_kernel<4, 5>};
  const K k8[kNumModes] = {a2a_kernel<8, 0>, a2a_kernel<8, 1>, a2a_kernel<8, 2>,
                           a2a_kernel<8, 3>, a2a_kernel<8, 4>, a2a_kernel<8, 5>};
  for (int sms : sm_list) {
    if (!sm_modes) break;
    for (int unroll : {4, 8}) {
      std::printf("%6d %6d %6d", sms, warps, unroll);
      for (int mode = 0; mode < kNumModes; ++mode) {
        const double gb = run([&](int g) {
          (unroll == 4 ? k4 : k8)[mode]<<<sms, warps * 32, 0, TS(g)>>>(src, dst, g, n, words, flags);
          CK(cudaGetLastError());
        });
        std::printf(" %12.1f", gb);  // kMix: GB/s of its remote half (it also copies as much locally)
      }
      std::printf("\n");
    }
  }
  // TMA: 1 block (one driving thread) per SM.
  for (int g = 0; g < n; ++g) {  // per device
    CK(cudaSetDevice(g));
    CK(cudaFuncSetAttribute(tma_kernel<kPush>, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaSmem));
    CK(cudaFuncSetAttribute(tma_kernel<kLocal>, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaSmem));
  }
  std::printf("%6s %12s %12s\n", "SMs", "tma_local", "tma_push");
  for (int sms : {1, 2, 4, 8, 12, 16, 24, 32}) {
    std::printf("%6d", sms);
    for (int mode : {static_cast<int>(kLocal), static_cast<int>(kPush)}) {  // push last: the check below reads it
      const double gb = run([&](int g) {
        (mode == kPush ? tma_kernel<kPush> : tma_kernel<kLocal>)<<<sms, 32, kTmaSmem, TS(g)>>>(src, dst, g, n, words);
        CK(cudaGetLastError());
      });
      std::printf(" %12.1f", gb);
    }
    std::printf("\n");
  }
  // Check the bulk copies moved the bytes: dst slot `me` at each peer holds the sender's fill byte g + 1.
  for (int g = 0; g < n; ++g) {
    CK(cudaSetDevice(g));
    const int from = (g + 1) % n;
    unsigned char probe[2] = {0, 0};
    CK(cudaMemcpy(&probe[0], reinterpret_cast<char*>(dst.p[g] + from * words), 1, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&probe[1], reinterpret_cast<char*>(dst.p[g] + from * words) + bytes_per_peer - 1, 1,
                  cudaMemcpyDeviceToHost));
    if (probe[0] != from + 1 || probe[1] != from + 1) {
      std::fprintf(stderr, "GPU %d: slot of %d holds %d/%d, expected %d\n", g, from, probe[0], probe[1], from + 1);
      return 1;
    }
  }
  return 0;
}
