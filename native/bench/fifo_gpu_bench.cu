// FIFO benchmark kernel with GPU producers; see fifo_gpu_bench.hpp.
#include "fifo_gpu_bench.hpp"

#include "uccl_moe/diag_device.cuh"
#include "uccl_moe/gpu_check.cuh"
#include "uccl_moe/transfer_cmd.hpp"

namespace uccl_moe::bench {

namespace {

constexpr int kBlockThreads = 64;
constexpr int kMaxProducersPerFifo = 32;

__global__ void fifo_bench_kernel(internode::RdmaContext ctx, int num_fifos, int producers, int cmds, int dst_rank,
                                  bool pingpong, int64_t* out_ns) {
  // Thread t pushes into FIFO t % num_fifos: `producers` threads (in different warps) share each FIFO and split its
  // `cmds` commands; out_ns[t] is thread t's time from its first push to the completion of its last command.
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (pingpong ? 1 : num_fifos * producers)) return;
  const int f = t % num_fifos;
  const int share = t / num_fifos;
  if (!pingpong) cmds = cmds / producers + (share < cmds % producers ? 1 : 0);
  const DiagDeviceHandle diag{ctx.diag_record, ctx.abort_flag, ctx.timeout_ns, ctx.rank};
  const FifoDeviceHandle fifo = ctx.fifos[f];
  TransferCmdFields c;
  c.op = CmdOp::kAtomic;
  c.dst_rank = static_cast<uint32_t>(dst_rank);
  c.counter_slot = static_cast<uint8_t>(kSlotBench + 8 * (f % kBenchCounterLines));
  c.counter_value = 1;
  const TransferCmd cmd = encode(c);
  auto wait_done = [&](uint64_t idx) {
    BoundedWait wait(diag);
    while (!fifo.check_completion(idx)) {
      if (wait.expired()) {
        report_timeout(diag, DiagPhase::kFifoCompletion, DiagRole::kSender, dst_rank, fifo.channel,
                       static_cast<int64_t>(idx) + 1, 0, idx, wait.waited_s());
        return false;
      }
    }
    return true;
  };
  const uint64_t t0 = gpu::global_timer_ns();
  uint64_t idx = 0;
  for (int i = 0; i < cmds; ++i) {
    const uint64_t t = gpu::global_timer_ns();
    idx = fifo.push(cmd, diag);
    if (idx == ~0ull) return;
    if (pingpong) {
      if (!wait_done(idx)) return;
      out_ns[i] = static_cast<int64_t>(gpu::global_timer_ns() - t);
    }
  }
  if (!pingpong && cmds > 0 && wait_done(idx)) out_ns[t] = static_cast<int64_t>(gpu::global_timer_ns() - t0);
}

}  // namespace

void launch_fifo_bench(const internode::RdmaContext& ctx, int num_fifos, int producers, int cmds, int dst_rank,
                       bool pingpong, int64_t* out_ns, void* stream) {
  UCCL_ASSERT(num_fifos >= 1 && num_fifos <= ctx.num_fifos, "num_fifos=%d must be in [1, %d]", num_fifos,
              ctx.num_fifos);
  UCCL_ASSERT(producers >= 1 && producers <= kMaxProducersPerFifo, "producers=%d per FIFO must be in [1, %d]",
              producers, kMaxProducersPerFifo);
  UCCL_ASSERT(dst_rank >= 0 && dst_rank < ctx.num_ranks, "dst_rank=%d", dst_rank);
  const int threads = pingpong ? 1 : num_fifos * producers;
  fifo_bench_kernel<<<(threads + kBlockThreads - 1) / kBlockThreads, kBlockThreads, 0,
                      static_cast<gpu::Stream>(stream)>>>(ctx, num_fifos, producers, cmds, dst_rank, pingpong, out_ns);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

}  // namespace uccl_moe::bench
