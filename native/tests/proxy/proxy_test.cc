#include "uccl_moe/proxy.hpp"

#include <dirent.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "multi_rank.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#if defined(UCCL_MOE_HAVE_IBVERBS)
#include "../transport/ibverbs/fake_verbs.hpp"
#endif

namespace uccl_moe {
namespace {

using test::run_ranks;

constexpr uint32_t kChunk = 1024;
constexpr uint64_t kRecvBase = 1 << 20;  // data region: [0, 1 MiB) send area, [1 MiB, 2 MiB) receive area

void set_faults(int window, int delay_us, int drop_every, int seed) {
  setenv("UCCL_MOE_LOOPBACK_REORDER_WINDOW", std::to_string(window).c_str(), 1);
  setenv("UCCL_MOE_LOOPBACK_DELAY_US", std::to_string(delay_us).c_str(), 1);
  setenv("UCCL_MOE_LOOPBACK_DROP_EVERY", std::to_string(drop_every).c_str(), 1);
  setenv("UCCL_MOE_LOOPBACK_SEED", std::to_string(seed).c_str(), 1);
  env::reset_cache();
}

ProxyOptions loopback_options(int rank, int num_ranks, const std::string& job) {
  ProxyOptions o;
  o.rank = rank;
  o.num_ranks = num_ranks;
  o.num_threads = 2;
  o.fifos_per_thread = 2;
  o.fifo_capacity = 64;
  o.transport = "loopback";
  o.job = job;
  o.cpus = "";
  o.data_bytes = 2 << 20;
  o.timeout_s = 20;
  return o;
}

/// The NIC paths the proxy suites run on: forked processes over the loopback transport (with its reorder / delay /
/// drop faults), or threads of this process over the strict fake RC fabric (native/tests/transport/ibverbs/
/// fake_verbs.hpp, ConnectX-7 profile) with software atomics (the default) or native atomics (the knob).
enum class Net { kLoopback, kRcSoftAtomics, kRcNativeAtomics };
std::string net_name(const ::testing::TestParamInfo<Net>& i) {
  return i.param == Net::kLoopback ? "Loopback" : i.param == Net::kRcSoftAtomics ? "RcSoftAtomics" : "RcNativeAtomics";
}
bool is_rc(Net n) { return n != Net::kLoopback; }

/// Faults of one rank: loopback reorder window, a delay per work request, every Nth request of this rank lost.
using SetFaults = std::function<void(int window, int delay_us, int drop_every, int seed)>;
using RankFn = std::function<void(int rank, std::shared_ptr<KvStore> store, ProxyOptions o, const SetFaults& faults)>;

/// Runs `fn` on `num_ranks` ranks of `net` with options like loopback_options (transport and verbs layer set).
std::string run_on(Net net, int num_ranks, const RankFn& fn) {
  if (net == Net::kLoopback)
    return run_ranks(num_ranks, [&](int rank, std::shared_ptr<KvStore> store, const std::string& job) {
      fn(rank, store, loopback_options(rank, num_ranks, job), set_faults);
    });
#if defined(UCCL_MOE_HAVE_IBVERBS)
  auto fabric = std::make_shared<test::FakeFabric>();
  if (net == Net::kRcNativeAtomics) setenv("UCCL_MOE_IB_NATIVE_ATOMICS", "1", 1);
  env::reset_cache();
  std::string fail = test::run_rank_threads(num_ranks, [&](int rank, std::shared_ptr<KvStore> store,
                                                           const std::string& job) {
    ProxyOptions o = loopback_options(rank, num_ranks, job);
    o.transport = "ibverbs";
    auto ops = std::make_shared<test::FakeVerbs>(fabric, test::mlx5_cx7(uint8_t(rank + 1)));
    o.verbs = ops;
    SetFaults faults = [fabric, ops](int, int delay_us, int drop_every, int) {
      std::lock_guard<std::mutex> l(fabric->mu);
      fabric->delay_us = std::max(fabric->delay_us, delay_us);
      ops->drop_every = drop_every;
    };
    fn(rank, store, o, faults);
  });
  unsetenv("UCCL_MOE_IB_NATIVE_ATOMICS");
  env::reset_cache();
  for (auto& [cq, c] : fabric->cqs)
    if (c.overflowed) fail += "a completion queue overflowed; ";
  return fail;
#else
  return "";  // not reached: the RC instances are not instantiated without ibverbs
#endif
}

class ProxyNet : public ::testing::TestWithParam<Net> {};

/// Pushes a BARRIER (flags: 0 = all ranks, kCmdFlagSameRail = rail peers) on `fifo` and waits for it to retire.
void barrier(Proxy& proxy, int fifo, uint8_t flags = 0) {
  TransferCmdFields bar;
  bar.op = CmdOp::kBarrier;
  bar.flags = flags;
  proxy.wait(fifo, proxy.push(fifo, bar));
}

uint8_t pattern(int src, uint64_t chunk, uint32_t byte) { return uint8_t(src * 31 + chunk * 7 + byte); }

bool chunk_ok(const uint8_t* data, int src, uint64_t chunk, uint64_t offset) {
  for (uint32_t b = 0; b < kChunk; b += 97)
    if (data[offset + b] != pattern(src, chunk, b)) return false;
  return true;
}

// End to end between processes with reordering and delay on: every rank sends chunks to every other rank over all
// FIFOs; each write carries an HT counter add (+1 on slot = FIFO). Whenever a receiver observes counter value k for
// (src, FIFO), the first k chunks of that FIFO from src must already hold their data (the HT guarantee).
// RC has no QP to a rank itself (ibverbs.cc): there every rank sends to every other rank only.
void ht_end_to_end(Net net, int num_ranks, int chunks_per_fifo) {
  const bool self = !is_rc(net);
  const std::string fail = run_on(net, num_ranks, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                      const SetFaults& set_faults) {
    set_faults(8, 30, 0, 1000 + rank);
    Proxy proxy(o, store);
    auto* data = static_cast<uint8_t*>(proxy.data());
    const int nf = proxy.num_fifos();
    // Source chunks: one per (dst, fifo, chunk).
    auto src_off = [&](int dst, int f, int c) { return uint64_t(((dst * nf + f) * chunks_per_fifo + c)) * kChunk; };
    auto dst_off = [&](int src, int f, int c) { return kRecvBase + uint64_t(((src * nf + f) * chunks_per_fifo + c)) * kChunk; };
    for (int dst = 0; dst < num_ranks; ++dst)
      for (int f = 0; f < nf; ++f)
        for (int c = 0; c < chunks_per_fifo; ++c)
          for (uint32_t b = 0; b < kChunk; ++b) data[src_off(dst, f, c) + b] = pattern(rank, uint64_t(f * chunks_per_fifo + c), b);
    proxy.start();
    std::vector<uint64_t> last(size_t(nf), 0);
    for (int c = 0; c < chunks_per_fifo; ++c)
      for (int f = 0; f < nf; ++f)
        for (int dst = 0; dst < num_ranks; ++dst) {
          if (dst == rank && !self) continue;
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
    // Receiver check while traffic flows: counter k => chunks < k landed.
    const int64_t* ctr = proxy.counters();
    uint64_t checks = 0;
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      bool all = true;
      for (int src = 0; src < num_ranks; ++src)
        for (int f = 0; f < nf; ++f) {
          if (src == rank && !self) continue;
          const int64_t k = __atomic_load_n(&ctr[src * kCountersPerSrc + f], __ATOMIC_ACQUIRE);
          CHILD_CHECK(k >= 0 && k <= chunks_per_fifo, "counter %lld", (long long)k);
          if (k > 0) {
            CHILD_CHECK(chunk_ok(data, src, uint64_t(f * chunks_per_fifo + k - 1), dst_off(src, f, int(k - 1))),
                        "rank %d: counter (src %d, fifo %d) = %lld but chunk %lld has no data", rank, src, f,
                        (long long)k, (long long)k - 1);
            ++checks;
          }
          all &= k == chunks_per_fifo;
        }
      proxy.check();
      if (all) break;
      CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30), "timed out");
      std::this_thread::yield();
    }
    for (int f = 0; f < nf; ++f) proxy.wait(f, last[size_t(f)]);
    for (int src = 0; src < num_ranks; ++src)
      for (int f = 0; f < nf; ++f)
        for (int c = 0; c < chunks_per_fifo && (src != rank || self); ++c)
          CHILD_CHECK(chunk_ok(data, src, uint64_t(f * chunks_per_fifo + c), dst_off(src, f, c)), "chunk %d", c);
    // Barrier: nobody stops before everyone finished receiving.
    barrier(proxy, 0);
    const ProxyCounters pc = proxy.counters_total();
    const int dsts = self ? num_ranks : num_ranks - 1;
    CHILD_CHECK(pc.writes == uint64_t(dsts * nf * chunks_per_fifo), "writes=%llu", (unsigned long long)pc.writes);
    // Native atomics: the NIC applies the counter adds, the proxy none.
    const uint64_t applied = net == Net::kRcNativeAtomics ? 0 : uint64_t(dsts * nf * chunks_per_fifo);
    CHILD_CHECK(pc.applied_updates == applied, "applied=%llu", (unsigned long long)pc.applied_updates);
    if (is_rc(net))
      CHILD_CHECK(pc.reorders == 0, "RC delivers in order, yet %llu writes arrived out of order",
                  (unsigned long long)pc.reorders);
    else
      CHILD_CHECK(pc.reorders > 0, "reordering was on but no write arrived out of order");
    CHILD_CHECK(pc.barriers == 1, "barriers=%llu", (unsigned long long)pc.barriers);
    CHILD_CHECK(checks > 0, "no checks");
    std::fprintf(stderr, "[rank %d] reorders=%llu held=%llu checks=%llu\n", rank, (unsigned long long)pc.reorders,
                 (unsigned long long)pc.held_updates, (unsigned long long)checks);
    proxy.stop();
  });
  EXPECT_EQ(fail, "");
}

TEST_P(ProxyNet, HtOrderingEndToEndTwoRanksWithReordering) { ht_end_to_end(GetParam(), 2, 40); }
TEST_P(ProxyNet, HtOrderingEndToEndThreeRanks) { ht_end_to_end(GetParam(), 3, 12); }

// LL: writes tagged with a group, then the fence with the expected count; the counter becomes -(n)-1 only after
// all n writes landed.
TEST_P(ProxyNet, LLPartialFenceTwoRanks) {
  const std::string fail = run_on(GetParam(), 2, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                     const SetFaults& set_faults) {
    set_faults(16, 50, 0, 7 + rank);
    Proxy proxy(o, store);
    auto* data = static_cast<uint8_t*>(proxy.data());
    const int peer = 1 - rank;
    constexpr int kGroups = 3, kWrites = 10;
    for (int g = 0; g < kGroups; ++g)
      for (int w = 0; w < kWrites; ++w)
        for (uint32_t b = 0; b < kChunk; ++b) data[uint64_t(g * kWrites + w) * kChunk + b] = pattern(rank, uint64_t(g * kWrites + w), b);
    proxy.start();
    for (int g = 0; g < kGroups; ++g) {
      // Spread a group's writes over the FIFOs of one proxy thread (LL state is per thread; FIFO f belongs to
      // thread f % num_threads) and fence on another of them.
      const int T = proxy.num_threads();
      for (int w = 0; w < kWrites; ++w) {
        TransferCmdFields c;
        c.op = CmdOp::kWrite;
        c.flags = kCmdFlagLL;
        c.dst_rank = uint32_t(peer);
        c.bytes = kChunk;
        c.src_offset = uint64_t(g * kWrites + w) * kChunk;
        c.dst_offset = kRecvBase + uint64_t(g * kWrites + w) * kChunk;
        c.counter_slot = uint8_t(10 + g);
        proxy.push(g % T + T * (w % 2), c);
      }
      TransferCmdFields fence;
      fence.op = CmdOp::kAtomic;
      fence.flags = kCmdFlagLL;
      fence.dst_rank = uint32_t(peer);
      fence.counter_slot = uint8_t(10 + g);
      fence.bytes = kWrites;
      proxy.push(g % T + T * ((g + 1) % 2), fence);
    }
    const int64_t* ctr = proxy.counters();
    const auto start = std::chrono::steady_clock::now();
    for (int g = 0; g < kGroups; ++g) {
      int64_t v;
      while ((v = __atomic_load_n(&ctr[peer * kCountersPerSrc + 10 + g], __ATOMIC_ACQUIRE)) == 0) {
        proxy.check();
        CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30), "timed out");
        std::this_thread::yield();
      }
      CHILD_CHECK(v == -kWrites - 1, "group %d counter %lld", g, (long long)v);
      for (int w = 0; w < kWrites; ++w)
        CHILD_CHECK(chunk_ok(data, peer, uint64_t(g * kWrites + w), kRecvBase + uint64_t(g * kWrites + w) * kChunk),
                    "group %d write %d missing when its fence applied", g, w);
    }
    barrier(proxy, 1);
    proxy.stop();
  });
  EXPECT_EQ(fail, "");
}

// A dropped work request surfaces as a Timeout that names the lost command (not a hang).
TEST_P(ProxyNet, DropSurfacesAsTimeoutNamingTheCommand) {
  const std::string fail = run_on(GetParam(), 2, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                     const SetFaults& set_faults) {
    set_faults(0, 0, rank == 0 ? 3 : 0, 0);
    o.timeout_s = 1.0;
    Proxy proxy(o, store);
    proxy.start();
    if (rank == 0) {
      uint64_t last = 0;
      for (int i = 0; i < 5; ++i) {
        TransferCmdFields c;
        c.op = CmdOp::kWrite;
        c.dst_rank = 1;
        c.bytes = 64;
        c.dst_offset = kRecvBase;
        last = proxy.push(0, c);
      }
      try {
        proxy.wait(0, last);
        CHILD_CHECK(false, "expected a timeout");
      } catch (const Error& e) {
        const std::string w = e.what();
        CHILD_CHECK(e.code() == ErrorCode::kTimeout, "code %d: %s", int(e.code()), w.c_str());
        CHILD_CHECK(w.find("lost command") != std::string::npos, "%s", w.c_str());
        CHILD_CHECK(w.find("WRITE dst_rank=1 bytes=64") != std::string::npos, "%s", w.c_str());
        CHILD_CHECK(w.find("proxy/completion") != std::string::npos, "%s", w.c_str());
        std::fprintf(stderr, "[rank 0] got the expected error: %s\n", w.c_str());
      }
      // The error sticks: every later call rethrows it.
      try {
        proxy.check();
        CHILD_CHECK(false, "check() must rethrow");
      } catch (const Error& e) {
        CHILD_CHECK(e.code() == ErrorCode::kTimeout, "sticky code");
      }
      try {
        proxy.stop();
        CHILD_CHECK(false, "stop() must rethrow");
      } catch (const Error&) {
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      proxy.stop();
    }
  });
  EXPECT_EQ(fail, "");
}

// A proxy thread that fails (completion error, invalid command) records the error; the next call raises it.
TEST_P(ProxyNet, ThreadFailureIsRaisedByTheNextCall) {
  const std::string name = is_rc(GetParam()) ? "ibverbs" : "loopback";
  const std::string fail = run_on(GetParam(), 2, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                     const SetFaults& set_faults) {
    set_faults(0, 0, 0, 0);
    Proxy proxy(o, store);
    proxy.start();
    if (rank == 0) {
      TransferCmdFields c;
      c.op = CmdOp::kWrite;
      c.dst_rank = 1;
      c.bytes = 4096;
      c.dst_offset = (2 << 20) - 1024;  // runs past the peer's region
      const uint64_t idx = proxy.push(1, c);
      try {
        proxy.wait(1, idx);
        CHILD_CHECK(false, "expected a transport error");
      } catch (const Error& e) {
        const std::string w = e.what();
        CHILD_CHECK(e.code() == ErrorCode::kTransport, "%s", w.c_str());
        CHILD_CHECK(w.find("proxy thread 1 of rank 0 (" + name + ")") != std::string::npos, "%s", w.c_str());
        CHILD_CHECK(w.find("remote access error") != std::string::npos, "%s", w.c_str());
      }
      // Pushing after the failure raises the same error instead of queueing into a dead proxy.
      TransferCmdFields q;
      q.op = CmdOp::kQuiet;
      bool threw = false;
      try {
        proxy.push(0, q);
      } catch (const Error& e) {
        threw = e.code() == ErrorCode::kTransport;
      }
      CHILD_CHECK(threw, "push after failure must raise");
    } else {
      // An invalid raw command (op 7) kills a thread on this rank too.
      TransferCmd bad{7, kCmdValidBit};
      const uint64_t idx = proxy.fifo(0).push(bad);
      try {
        proxy.wait(0, idx);
        CHILD_CHECK(false, "expected an error");
      } catch (const Error& e) {
        CHILD_CHECK(std::string(e.what()).find("invalid op 7") != std::string::npos, "%s", e.what());
      }
    }
    try {
      proxy.stop();
    } catch (const Error&) {
    }
  });
  EXPECT_EQ(fail, "");
}

// Flow control end to end: with a delay on every request, the in-flight limits are reached but never exceeded.
TEST_P(ProxyNet, FlowControlLimitsNeverExceeded) {
  const std::string fail = run_on(GetParam(), 2, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                     const SetFaults& set_faults) {
    set_faults(4, 200, 0, 3);
    o.max_inflight_bytes = 8 * kChunk;
    o.max_inflight_writes = 4;
    Proxy proxy(o, store);
    proxy.start();
    const int peer = 1 - rank;
    std::vector<uint64_t> last(size_t(proxy.num_fifos()));
    for (int i = 0; i < 200; ++i) {
      TransferCmdFields c;
      c.op = CmdOp::kWrite;
      c.flags = kCmdFlagCounter;
      c.counter_slot = 1;
      c.counter_value = 1;
      c.dst_rank = uint32_t(peer);
      c.bytes = kChunk;
      c.src_offset = uint64_t(i % 64) * kChunk;
      c.dst_offset = kRecvBase + uint64_t(i % 64) * kChunk;
      const int f = i % proxy.num_fifos();
      last[size_t(f)] = proxy.push(f, c);
    }
    for (int f = 0; f < proxy.num_fifos(); ++f) proxy.wait(f, last[size_t(f)]);
    const ProxyCounters pc = proxy.counters_total();
    CHILD_CHECK(pc.peak_inflight_bytes <= 8 * kChunk, "peak bytes %llu", (unsigned long long)pc.peak_inflight_bytes);
    CHILD_CHECK(pc.peak_inflight_window <= 4, "peak window %llu", (unsigned long long)pc.peak_inflight_window);
    CHILD_CHECK(pc.peak_inflight_window == 4, "the window limit should be reached (peak %llu)",
                (unsigned long long)pc.peak_inflight_window);
    CHILD_CHECK(pc.stalls > 0, "flow control never held a command");
    const int64_t* ctr = proxy.counters();
    const auto start = std::chrono::steady_clock::now();
    while (__atomic_load_n(&ctr[peer * kCountersPerSrc + 1], __ATOMIC_ACQUIRE) != 200) {
      CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "counter stuck");
      std::this_thread::yield();
    }
    barrier(proxy, 0);
    proxy.stop();
  });
  EXPECT_EQ(fail, "");
}

// Same-rail barrier over 4 ranks (2 "nodes" x 2 local ranks): only rail peers are waited for.
TEST_P(ProxyNet, BarriersAllAndSameRail) {
  const std::string fail = run_on(GetParam(), 4, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                     const SetFaults& set_faults) {
    set_faults(0, 0, 0, 0);
    o.ranks_per_node = 2;
    o.num_threads = 1;
    o.fifos_per_thread = 1;
    Proxy proxy(o, store);
    proxy.start();
    for (int i = 0; i < 3; ++i) barrier(proxy, 0, i == 1 ? kCmdFlagSameRail : 0);
    CHILD_CHECK(proxy.counters_total().barriers == 3, "barriers");
    proxy.stop();
  });
  EXPECT_EQ(fail, "");
}

// A single write larger than the in-flight byte limit goes in pieces of at most the limit (the old flow control
// admitted it whole when idle, so the peak was the write itself); all its data lands, its counter update is applied
// once, and the next command of the FIFO lands after it.
TEST_P(ProxyNet, OversizedWriteIsSplitUnderTheByteLimit) {
  constexpr uint32_t kBig = 64 * 1024 + 100, kSmall = 1000;
  constexpr int64_t kLimit = 4096;
  const std::string fail = run_on(GetParam(), 2, [&](int rank, std::shared_ptr<KvStore> store, ProxyOptions o,
                                                     const SetFaults& set_faults) {
    set_faults(4, 50, 0, 11 + rank);
    o.max_inflight_bytes = kLimit;
    Proxy proxy(o, store);
    auto* data = static_cast<uint8_t*>(proxy.data());
    auto byte = [](int src, uint32_t b) { return uint8_t(src * 31 + b * 7 + b / 251); };
    for (uint32_t b = 0; b < kBig + kSmall; ++b) data[b] = byte(rank, b);
    proxy.start();
    const int peer = 1 - rank;
    TransferCmdFields big;
    big.op = CmdOp::kWrite;
    big.flags = kCmdFlagCounter;
    big.dst_rank = uint32_t(peer);
    big.bytes = kBig;
    big.dst_offset = kRecvBase;
    big.counter_slot = 5;
    big.counter_value = 1;
    TransferCmdFields small = big;
    small.bytes = kSmall;
    small.src_offset = kBig;
    small.dst_offset = kRecvBase + kBig;
    proxy.push(0, big);
    proxy.wait(0, proxy.push(0, small));
    const int64_t* ctr = proxy.counters();
    const auto start = std::chrono::steady_clock::now();
    while (__atomic_load_n(&ctr[peer * kCountersPerSrc + 5], __ATOMIC_ACQUIRE) != 2) {
      proxy.check();
      CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "counter stuck at %lld",
                  (long long)ctr[peer * kCountersPerSrc + 5]);
      std::this_thread::yield();
    }
    for (uint32_t b = 0; b < kBig + kSmall; ++b)
      CHILD_CHECK(data[kRecvBase + b] == byte(peer, b), "byte %u of the peer's writes is wrong", b);
    const ProxyCounters pc = proxy.counters_total();
    CHILD_CHECK(pc.peak_inflight_bytes <= uint64_t(kLimit), "peak in-flight bytes %llu over the limit %lld",
                (unsigned long long)pc.peak_inflight_bytes, (long long)kLimit);
    CHILD_CHECK(pc.writes == 2, "writes=%llu (one command per write, however many pieces)",
                (unsigned long long)pc.writes);
    barrier(proxy, 0);
    proxy.stop();
  });
  EXPECT_EQ(fail, "");
}

#if defined(UCCL_MOE_HAVE_IBVERBS)
// A failed work completion on RC (here transport retry exceeded, as a dead or congested path gives) reaches the
// caller naming the command, the status text, the vendor error and the peer.
TEST(ProxyRc, ErrorCompletionNamesStatusVendorErrAndPeer) {
  auto fabric = std::make_shared<test::FakeFabric>();
  const std::string fail = test::run_rank_threads(2, [&](int rank, std::shared_ptr<KvStore> store,
                                                         const std::string& job) {
    ProxyOptions o = loopback_options(rank, 2, job);
    o.transport = "ibverbs";
    o.verbs = std::make_shared<test::FakeVerbs>(fabric, test::bnxt_re_thor2(uint8_t(rank + 1)));
    o.timeout_s = 5;
    Proxy proxy(o, store);
    proxy.start();
    barrier(proxy, 0);
    if (rank == 0) {
      {
        std::lock_guard<std::mutex> l(fabric->mu);
        fabric->fail_next_sends = 1;
        fabric->fail_status = IBV_WC_RETRY_EXC_ERR;
        fabric->fail_vendor_err = 0x81;
      }
      TransferCmdFields c;
      c.op = CmdOp::kWrite;
      c.dst_rank = 1;
      c.bytes = 256;
      c.dst_offset = kRecvBase;
      try {
        proxy.wait(1, proxy.push(1, c));
        CHILD_CHECK(false, "expected a completion error");
      } catch (const Error& e) {
        const std::string w = e.what();
        CHILD_CHECK(e.code() == ErrorCode::kTransport, "%s", w.c_str());
        CHILD_CHECK(w.find("WRITE dst_rank=1 bytes=256") != std::string::npos, "%s", w.c_str());
        CHILD_CHECK(w.find("transport retry counter exceeded") != std::string::npos, "%s", w.c_str());
        CHILD_CHECK(w.find("vendor_err=0x81") != std::string::npos, "%s", w.c_str());
        CHILD_CHECK(w.find("peer=1") != std::string::npos, "%s", w.c_str());
      }
    }
    try {
      proxy.stop();
    } catch (const Error&) {
    }
  });
  EXPECT_EQ(fail, "");
}

// The flow-control limits follow the NIC family unless the user sets them: Thor-2 (bnxt_re) 1.5 MiB per GPU and one
// write per FIFO, ConnectX (mlx5) 8 writes per FIFO; options() shows what is in force.
TEST(ProxyFlowDefaults, FollowTheNicFamilyUnlessSet) {
  unsetenv("UCCL_MOE_MAX_INFLIGHT_BYTES");
  unsetenv("UCCL_MOE_MAX_INFLIGHT_WRITES");
  env::reset_cache();
  auto fabric = std::make_shared<test::FakeFabric>();
  auto store = std::make_shared<MemoryKvStore>();
  ProxyOptions o = loopback_options(0, 1, test::unique_job("nicdef"));
  o.transport = "ibverbs";
  o.verbs = std::make_shared<test::FakeVerbs>(fabric, test::bnxt_re_thor2());
  {
    Proxy thor(o, store);
    EXPECT_EQ(thor.options().max_inflight_writes, 1);
    EXPECT_EQ(thor.options().max_inflight_bytes, 1572864 / *o.num_threads);
  }
  o.verbs = std::make_shared<test::FakeVerbs>(fabric, test::mlx5_cx7());
  o.job = test::unique_job("nicdef");
  {
    Proxy cx(o, store);
    EXPECT_EQ(cx.options().max_inflight_writes, 8);
    EXPECT_EQ(cx.options().max_inflight_bytes, 0);
  }
  o.verbs = std::make_shared<test::FakeVerbs>(fabric, test::bnxt_re_thor2());
  o.job = test::unique_job("nicdef");
  o.max_inflight_writes = 4;  // the caller's value wins
  Proxy set(o, store);
  EXPECT_EQ(set.options().max_inflight_writes, 4);
}
#endif

#if defined(UCCL_MOE_HAVE_IBVERBS)
INSTANTIATE_TEST_SUITE_P(Nets, ProxyNet,
                         ::testing::Values(Net::kLoopback, Net::kRcSoftAtomics, Net::kRcNativeAtomics), net_name);
#else
INSTANTIATE_TEST_SUITE_P(Nets, ProxyNet, ::testing::Values(Net::kLoopback), net_name);
#endif

TEST(Proxy, ThreadsAreNamedAndOptionsValidated) {
  MemoryKvStore* raw = new MemoryKvStore;
  std::shared_ptr<KvStore> store(raw);
  ProxyOptions o = loopback_options(0, 1, test::unique_job("names"));
  o.num_threads = 3;
  Proxy proxy(o, store);
  proxy.start();
  int named = 0;
  for (int attempt = 0; attempt < 200 && named != 3; ++attempt) {  // threads name themselves as they start
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    named = 0;
    DIR* d = opendir("/proc/self/task");
    ASSERT_NE(d, nullptr);
    while (dirent* e = readdir(d)) {
      std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/comm");
      std::string comm;
      if (f && std::getline(f, comm) && comm.rfind("uccl-proxy-", 0) == 0) ++named;
    }
    closedir(d);
  }
  EXPECT_EQ(named, 3);
  // Write to self through the loopback (rank 0 of 1).
  std::memset(proxy.data(), 0x5A, 256);
  TransferCmdFields c;
  c.op = CmdOp::kWrite;
  c.flags = kCmdFlagCounter;
  c.counter_slot = 2;
  c.counter_value = -3;
  c.bytes = 256;
  c.dst_offset = kRecvBase;
  proxy.wait(4, proxy.push(4, c));
  EXPECT_EQ(static_cast<uint8_t*>(proxy.data())[kRecvBase + 255], 0x5A);
  // The update is applied by the receiving thread (same thread index, possibly after the sender's completion).
  for (int i = 0; i < 100000 && __atomic_load_n(&proxy.counters()[2], __ATOMIC_ACQUIRE) == 0; ++i) std::this_thread::yield();
  EXPECT_EQ(proxy.counters()[2], -3);
  proxy.stop();

  ProxyOptions bad = o;
  bad.fifos_per_thread = 9;
  EXPECT_THROW(Proxy(bad, store), Error);
  bad = o;
  bad.cpus = "0-x";
  EXPECT_THROW(Proxy(bad, store), Error);
  bad = o;
  bad.transport = "carrier-pigeon";
  try {
    Proxy p(bad, store);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("loopback"), std::string::npos) << "lists registered transports";
  }
  bad = o;
  bad.max_inflight_writes = 600;  // 2*600 + 1024 > 2048 sequence numbers
  EXPECT_THROW(Proxy(bad, store), Error);
  bad = o;
  bad.cpus = "0";
  bad.job = test::unique_job("pin");
  Proxy pinned(bad, store);
  pinned.start();
  pinned.stop();
}

}  // namespace
}  // namespace uccl_moe
