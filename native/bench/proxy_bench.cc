// proxy_bench: commands/s through the whole CPU proxy path with CPU producers, one rank over the loopback transport
// to itself (the host-only twin of `python -m uccl_moe.bench.fifo_gpu`, for profiling the proxy without a GPU).
//   proxy_bench [--threads 1,2] [--fifos-per-thread 8] [--cmds 200000] [--op atomic|write]
// One producer thread per proxy thread pushes --cmds commands round-robin over that thread's FIFOs (ATOMIC: a
// zero-byte write-with-immediate carrying a counter add; WRITE: 64 bytes plus a counter add), then waits for the last
// one to retire. Reports commands/s from the first push to the last retirement, and the proxy's counters.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "bench_args.hpp"
#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/proxy.hpp"

using namespace uccl_moe;
using bench::parse_list;

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  int fifos_per_thread = 8;
  long cmds = 200000;
  bool write = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--fifos-per-thread")) fifos_per_thread = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--cmds")) cmds = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--op")) write = !std::strcmp(argv[i + 1], "write");
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  std::printf("%8s %6s %10s %12s %10s\n", "threads", "fifos", "commands", "M cmds/s", "stalls");
  for (int nt : threads) {
    ProxyOptions o;
    o.rank = 0;
    o.num_ranks = 1;
    o.num_threads = nt;
    o.fifos_per_thread = fifos_per_thread;
    o.transport = "loopback";
    o.job = "proxybench" + std::to_string(::getpid()) + "_" + std::to_string(nt);
    o.data_bytes = 1 << 20;
    Proxy proxy(o, std::make_shared<MemoryKvStore>());
    proxy.start();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> producers;
    for (int p = 0; p < nt; ++p)
      producers.emplace_back([&, p] {
        std::vector<uint64_t> last(size_t(fifos_per_thread), 0);
        for (long c = 0; c < cmds; ++c) {
          const int f = p + nt * int(c % fifos_per_thread);  // FIFOs of proxy thread p
          TransferCmdFields cmd;
          cmd.op = write ? CmdOp::kWrite : CmdOp::kAtomic;
          cmd.flags = write ? kCmdFlagCounter : 0;
          cmd.dst_rank = 0;
          cmd.bytes = write ? 64 : 0;
          cmd.src_offset = 0;
          cmd.dst_offset = 4096;
          cmd.counter_slot = uint8_t(f % 8);
          cmd.counter_value = 1;
          last[size_t(c % fifos_per_thread)] = proxy.push(f, cmd);
        }
        for (int k = 0; k < fifos_per_thread; ++k) proxy.wait(p + nt * k, last[size_t(k)]);
      });
    for (auto& t : producers) t.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    proxy.check();
    const ProxyCounters pc = proxy.counters_total();
    std::printf("%8d %6d %10ld %12.2f %10llu\n", nt, proxy.num_fifos(), cmds * nt, cmds * nt / s / 1e6,
                (unsigned long long)pc.stalls);
    proxy.stop();
  }
  return 0;
}
