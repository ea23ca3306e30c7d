// The proxy's HT ordering path end to end over the strict EFA fake with SRD reordering on: writes land and complete
// out of order, so the receivers' ordering engines must restore, from the sequence numbers in the immediates, the
// order in which counter adds become visible. Ranks run as threads of one process sharing the fake fabric (the fake
// NIC lives in process memory); the proxy takes the fake through ProxyOptions::verbs.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "../transport/fake_nic/efa_fake.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/proxy.hpp"

namespace uccl_moe {
namespace {

constexpr uint32_t kChunk = 1024;
constexpr uint64_t kRecvBase = 1 << 20;  // data region: [0, 1 MiB) send area, [1 MiB, 2 MiB) receive area

uint8_t pattern(int src, uint64_t chunk, uint32_t byte) { return uint8_t(src * 31 + chunk * 7 + byte); }

bool chunk_ok(const uint8_t* data, int src, uint64_t chunk, uint64_t offset) {
  for (uint32_t b = 0; b < kChunk; b += 97)
    if (data[offset + b] != pattern(src, chunk, b)) return false;
  return true;
}

struct Failures {
  std::mutex mu;
  std::string text;
  void add(const std::string& s) {
    std::lock_guard<std::mutex> l(mu);
    text += s + "; ";
  }
};

#define RANK_CHECK(cond, ...)                                                            \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fails.add(detail::format("rank %d: %s: ", rank, #cond) + detail::format(__VA_ARGS__)); \
      return;                                                                            \
    }                                                                                    \
  } while (0)

// Every rank writes chunks to every rank (itself included) over all FIFOs, each write carrying an HT counter add
// (+1 on slot = FIFO). Whenever a receiver sees counter k for (src, FIFO), the first k chunks of that FIFO from src
// must hold their data (the HT guarantee), although the fake NIC delivered them in any order.
// With `devices` > 1 each host has that many EFA devices, named for the rank in UCCL_MOE_IB_HCA, and the proxy threads
// stripe over them (thread t on device t % devices): the guarantee holds per thread, so stripes must not interfere.
void ht_over_efa(int num_ranks, int chunks_per_fifo, test::EfaProfile prof, uint64_t seed, int devices = 1) {
  auto fabric = std::make_shared<test::EfaFabric>(seed, /*reorder_window=*/16);
  auto store = std::make_shared<MemoryKvStore>();
  std::vector<std::unique_ptr<Proxy>> proxies;
  std::vector<std::shared_ptr<test::FakeEfaNic>> nics;
  std::vector<test::EfaProfile> host;
  std::string hca;
  for (int d = 0; d < devices; ++d) {
    host.push_back(prof);
    host.back().name = "rdmap" + std::to_string(d) + "s0";
    hca += (d ? "+" : "") + host.back().name;
  }
  if (devices > 1) setenv("UCCL_MOE_IB_HCA", hca.c_str(), 1);
  env::reset_cache();
  for (int r = 0; r < num_ranks; ++r) {
    ProxyOptions o;
    o.rank = r;
    o.num_ranks = num_ranks;
    o.num_threads = 2 * devices;
    o.fifos_per_thread = 2;
    o.fifo_capacity = 64;
    o.max_inflight_writes = 8;
    o.transport = "efa";
    o.job = "efa_ht";
    o.cpus = "";
    o.data_bytes = 2 << 20;
    o.timeout_s = 20;
    nics.push_back(std::make_shared<test::FakeEfaNic>(fabric, host));
    o.verbs = nics.back();
    proxies.push_back(std::make_unique<Proxy>(o, store));
    ASSERT_EQ(proxies.back()->transport_name(), "efa");
    EXPECT_EQ(proxies.back()->nic().devices.size(), size_t(devices));
  }
  unsetenv("UCCL_MOE_IB_HCA");
  env::reset_cache();
  Failures fails;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < num_ranks; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        Proxy& proxy = *proxies[size_t(rank)];
        auto* data = static_cast<uint8_t*>(proxy.data());
        const int nf = proxy.num_fifos();
        auto src_off = [&](int dst, int f, int c) { return uint64_t(((dst * nf + f) * chunks_per_fifo + c)) * kChunk; };
        auto dst_off = [&](int src, int f, int c) {
          return kRecvBase + uint64_t(((src * nf + f) * chunks_per_fifo + c)) * kChunk;
        };
        for (int dst = 0; dst < num_ranks; ++dst)
          for (int f = 0; f < nf; ++f)
            for (int c = 0; c < chunks_per_fifo; ++c)
              for (uint32_t b = 0; b < kChunk; ++b)
                data[src_off(dst, f, c) + b] = pattern(rank, uint64_t(f * chunks_per_fifo + c), b);
        proxy.start();
        std::vector<uint64_t> last(size_t(nf), 0);
        for (int c = 0; c < chunks_per_fifo; ++c)
          for (int f = 0; f < nf; ++f)
            for (int dst = 0; dst < num_ranks; ++dst) {
              TransferCmdFields cmd;
              cmd.op = CmdOp::kWrite;
              cmd.flags = kCmdFlagCounter;
              cmd.dst_rank = uint32_t(dst);
              cmd.bytes = kChunk;
              cmd.src_offset = src_off(dst, f, c);
              cmd.dst_offset = dst_off(rank, f, c);
              cmd.counter_slot = uint8_t(f);
              cmd.counter_value = 1;
              last[size_t(f)] = proxy.push(f, cmd);
            }
        const int64_t* ctr = proxy.counters();
        uint64_t checks = 0;
        const auto start = std::chrono::steady_clock::now();
        for (;;) {
          bool all = true;
          for (int src = 0; src < num_ranks; ++src)
            for (int f = 0; f < nf; ++f) {
              const int64_t k = __atomic_load_n(&ctr[src * kCountersPerSrc + f], __ATOMIC_ACQUIRE);
              RANK_CHECK(k >= 0 && k <= chunks_per_fifo, "counter %lld", (long long)k);
              if (k > 0) {
                RANK_CHECK(chunk_ok(data, src, uint64_t(f * chunks_per_fifo + k - 1), dst_off(src, f, int(k - 1))),
                           "counter (src %d, fifo %d) = %lld but chunk %lld has no data", src, f, (long long)k,
                           (long long)k - 1);
                ++checks;
              }
              all &= k == chunks_per_fifo;
            }
          proxy.check();
          if (all) break;
          RANK_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60), "timed out");
          std::this_thread::yield();
        }
        for (int f = 0; f < nf; ++f) proxy.wait(f, last[size_t(f)]);
        for (int src = 0; src < num_ranks; ++src)
          for (int f = 0; f < nf; ++f)
            for (int c = 0; c < chunks_per_fifo; ++c)
              RANK_CHECK(chunk_ok(data, src, uint64_t(f * chunks_per_fifo + c), dst_off(src, f, c)), "chunk %d", c);
        TransferCmdFields bar;
        bar.op = CmdOp::kBarrier;
        proxy.wait(0, proxy.push(0, bar));
        const ProxyCounters pc = proxy.counters_total();
        RANK_CHECK(pc.writes == uint64_t(num_ranks * nf * chunks_per_fifo), "writes=%llu",
                   (unsigned long long)pc.writes);
        RANK_CHECK(pc.applied_updates == uint64_t(num_ranks * nf * chunks_per_fifo), "applied=%llu",
                   (unsigned long long)pc.applied_updates);
        RANK_CHECK(pc.reorders > 0, "SRD reordering was on but no write arrived out of order");
        RANK_CHECK(pc.barriers == 1, "barriers=%llu", (unsigned long long)pc.barriers);
        RANK_CHECK(checks > 0, "no checks");
        std::fprintf(stderr, "[rank %d] reorders=%llu held=%llu checks=%llu\n", rank, (unsigned long long)pc.reorders,
                     (unsigned long long)pc.held_updates, (unsigned long long)checks);
      } catch (const std::exception& e) {
        fails.add("rank " + std::to_string(rank) + ": " + e.what());
      }
    });
  for (auto& t : ranks) t.join();
  for (auto& p : proxies) {
    try {
      p->stop();
    } catch (const std::exception& e) {
      fails.add(std::string("stop: ") + e.what());
    }
  }
  EXPECT_EQ(fails.text, "");
  EXPECT_GT(fabric->out_of_order, 0u);
  for (auto& nic : nics)
    for (int d = 0; d < devices; ++d) {
      EXPECT_GT(nic->dev(size_t(d)).writes, 0u) << "device " << d << " carried no write";
      EXPECT_GT(nic->dev(size_t(d)).imms_received, 0u) << "device " << d << " received no immediate";
    }
}

TEST(ProxyEfa, HtOrderingTwoRanksUnsolicitedReceivesWithReordering) { ht_over_efa(2, 40, test::p5en_profile(), 3); }

TEST(ProxyEfa, HtOrderingThreeRanksPostedReceivesWithReordering) {
  test::EfaProfile prof = test::p5en_profile();
  prof.device_caps &= ~detail::kEfaCapUnsolicitedWriteRecv;
  ht_over_efa(3, 12, prof, 11);
}

// p5en: two EFA devices per GPU, four proxy threads striped over them, SRD reordering on each.
TEST(ProxyEfa, HtOrderingTwoDevicesPerGpuStriped) { ht_over_efa(3, 12, test::p5en_profile(), 17, /*devices=*/2); }

// Writes longer than the device's max_rdma_size are split by the transport; the HT guarantee still holds.
TEST(ProxyEfa, HtOrderingWithSplitWrites) {
  test::EfaProfile prof = test::p5en_profile();
  prof.max_rdma_size = 256;
  ht_over_efa(2, 10, prof, 5);
}

}  // namespace
}  // namespace uccl_moe
