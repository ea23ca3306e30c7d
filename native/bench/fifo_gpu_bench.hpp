// FIFO benchmark with GPU producers (uccl_moe/bench/fifo_gpu.py drives it through the binding fifo_bench): ATOMIC
// commands to `dst_rank` through the internode runtime's FIFOs and proxy. Not part of any op.
#pragma once

#include <cstdint>

#include "../src/kernels/internode/internode.hpp"

namespace uccl_moe::bench {

/// First counter slot the benchmark adds to (after the internode path's own slots).
constexpr int kSlotBench = 8;
/// FIFO f adds to slot kSlotBench + 8 * (f % kBenchCounterLines): counters of different FIFOs sit on different
/// 64-byte lines, so proxy threads do not contend for one line (as the kernels' own slots are per source rank).
constexpr int kBenchCounterLines = (kCountersPerSrc - kSlotBench) / 8;

/// flood (pingpong = false): `producers` threads per FIFO (thread t uses FIFO t % num_fifos, so sharers sit in
///   different warps) split FIFO f's `cmds` commands, each waits for its last one's completion and writes its
///   elapsed ns to out_ns[t] (num_fifos * producers entries);
/// pingpong: one thread pushes into FIFO 0 and waits for each command's completion: out_ns[i] = push -> retired as
///   seen by the GPU (an upper bound of push -> proxy).
void launch_fifo_bench(const internode::RdmaContext& ctx, int num_fifos, int producers, int cmds, int dst_rank,
                       bool pingpong, int64_t* out_ns, void* stream);

}  // namespace uccl_moe::bench
