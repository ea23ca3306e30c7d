// fifo_bench: GPU->CPU FIFO throughput and push->pop latency with CPU producers (CPU figures; the GPU producer
// figure comes with the internode kernels).
//   fifo_bench [--fifos 1,2,4,8] [--threads 1,2,4] [--seconds 1] [--capacity 2048] [--mode flood|pingpong]
// flood: producers push as fast as the ring allows (throughput; latency then includes queueing in a full ring).
// pingpong: each producer waits for its command to be popped before pushing the next (unloaded push->pop latency).
// For each (fifos F, consumer threads T): F producer threads push timestamped commands into F FIFOs; T consumer
// threads (the proxy's role) each own FIFOs {f : f % T == t}, poll and pop. Reports commands/s and p50/p99 of
// (pop time - push time).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_args.hpp"
#include "uccl_moe/fifo.hpp"

using namespace uccl_moe;
using bench::parse_list;
using Clock = std::chrono::steady_clock;

static uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
}

int main(int argc, char** argv) {
  std::vector<int> fifos = {1, 2, 4, 8}, threads = {1, 2, 4};
  double seconds = 1.0;
  uint32_t capacity = 2048;
  bool pingpong = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--fifos")) fifos = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) threads = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--capacity")) capacity = uint32_t(std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--mode")) pingpong = !std::strcmp(argv[i + 1], "pingpong");
  }
  std::printf("# fifo_bench (CPU producers, %s), %u hw threads, capacity %u, %.1f s per point\n",
              pingpong ? "pingpong" : "flood", std::thread::hardware_concurrency(), capacity, seconds);
  std::printf("%6s %8s %14s %10s %10s\n", "fifos", "threads", "commands/s", "p50_us", "p99_us");
  for (int nf : fifos)
    for (int nt : threads) {
      if (nt > nf) continue;  // a consumer thread without a FIFO measures nothing
      std::vector<std::unique_ptr<Fifo>> q;
      for (int f = 0; f < nf; ++f) q.push_back(std::make_unique<Fifo>(capacity, f));
      std::atomic<bool> stop{false};
      std::atomic<uint64_t> popped{0};
      std::vector<std::vector<uint32_t>> lat(static_cast<size_t>(nt));  // sampled latencies in ns (every 16th command)
      std::vector<std::thread> producers, consumers;
      for (int f = 0; f < nf; ++f)
        producers.emplace_back([&, f] {
          TransferCmdFields c;
          c.op = CmdOp::kWrite;
          while (!stop.load(std::memory_order_relaxed)) {
            // Bench only: the push timestamp rides in word1 (bit 63 stays the valid bit).
            const uint64_t t = now_ns();
            TransferCmd cmd = encode(c);
            cmd.word1 = (t & 0x7FFFFFFFFFFFFFFFull) | kCmdValidBit;
            uint64_t idx;
            while (!q[size_t(f)]->try_push(cmd, &idx))
              if (stop.load(std::memory_order_relaxed)) return;
            if (pingpong)
              while (!q[size_t(f)]->check_completion(idx))
                if (stop.load(std::memory_order_relaxed)) return;
          }
        });
      for (int t = 0; t < nt; ++t)
        consumers.emplace_back([&, t] {
          std::vector<Fifo*> mine;
          std::vector<uint64_t> next;
          for (int f = t; f < nf; f += nt) {
            mine.push_back(q[size_t(f)].get());
            next.push_back(0);
          }
          uint64_t n = 0;
          while (!stop.load(std::memory_order_relaxed)) {
            for (size_t i = 0; i < mine.size(); ++i) {
              TransferCmd c;
              while (mine[i]->poll(next[i], &c)) {
                const uint64_t t_push = c.word1 & 0x7FFFFFFFFFFFFFFFull;
                mine[i]->pop();
                ++next[i];
                if ((++n & 15u) == 0) lat[size_t(t)].push_back(uint32_t(std::min<uint64_t>(now_ns() - t_push, ~0u)));
              }
            }
          }
          popped.fetch_add(n);
        });
      const auto start = Clock::now();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      stop = true;
      for (auto& th : producers) th.join();
      for (auto& th : consumers) th.join();
      const double el = std::chrono::duration<double>(Clock::now() - start).count();
      std::vector<uint32_t> all;
      for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
      std::sort(all.begin(), all.end());
      auto pct = [&](double p) { return all.empty() ? 0.0 : all[size_t(p * double(all.size() - 1))] / 1000.0; };
      std::printf("%6d %8d %14.0f %10.2f %10.2f\n", nf, nt, double(popped.load()) / el, pct(0.5), pct(0.99));
      std::fflush(stdout);
    }
  return 0;
}
