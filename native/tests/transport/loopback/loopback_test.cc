#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "../../proxy/multi_rank.hpp"
#include "../work_request.hpp"
#include "transport/loopback/fault_injector.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe {
namespace {

using test::run_ranks;

TEST(FaultInjector, SameSeedSameFaults) {
  detail::FaultConfig cfg;
  cfg.reorder_window = 8;
  cfg.delay_us = 100;
  cfg.drop_every = 7;
  cfg.seed = 5;
  detail::FaultInjector a(cfg, 1), b(cfg, 1), c(cfg, 2);
  int drops = 0, diff = 0;
  for (int i = 0; i < 1000; ++i) {
    const bool da = a.next_drop(), db = b.next_drop();
    c.next_drop();
    EXPECT_EQ(da, db);
    drops += da;
    const int64_t xa = a.next_delay_us(), xb = b.next_delay_us(), xc = c.next_delay_us();
    EXPECT_EQ(xa, xb);
    EXPECT_LE(xa, 100);
    diff += xa != xc;
    EXPECT_EQ(a.pick(20), b.pick(20));
    c.pick(20);
  }
  EXPECT_EQ(drops, 1000 / 7 + ((1000 % 7) >= 2 ? 1 : 0));  // posted + seed == 0 mod 7
  EXPECT_GT(diff, 100) << "another stream must give other choices";
  detail::FaultConfig off;
  detail::FaultInjector d(off, 0);
  for (int i = 0; i < 100; ++i) {
    EXPECT_FALSE(d.next_drop());
    EXPECT_EQ(d.pick(10), 0);
    EXPECT_EQ(d.next_delay_us(), 0);
  }
}

struct Ctx {
  std::unique_ptr<Transport> t;
  uint8_t* data;
  std::unique_ptr<Endpoint> ep;
};

Ctx make(int rank, int num_ranks, const std::string& job, std::shared_ptr<KvStore> store, size_t bytes = 1 << 16) {
  TransportContext ctx(Timeout::resolve());
  ctx.rank = rank;
  ctx.num_ranks = num_ranks;
  ctx.num_threads = 1;
  ctx.job = job;
  ctx.timeout_s = 20;
  Ctx c;
  c.t = create_transport("loopback", ctx);
  c.data = static_cast<uint8_t*>(c.t->allocate(MemoryKind::kData, bytes));
  c.t->register_memory(MemoryKind::kData, c.data, bytes);
  c.ep = c.t->create_endpoint(0);
  c.ep->connect(*store);
  return c;
}

// Immediates arrive after their data, all of them, reordered by the fault injector (window 8, seeded).
TEST(Loopback, WriteImmAcrossProcessesReorderedDataBeforeImmediate) {
  const std::string fail = run_ranks(2, [](int rank, std::shared_ptr<KvStore> store, const std::string& job) {
    setenv("UCCL_MOE_LOOPBACK_REORDER_WINDOW", "8", 1);
    setenv("UCCL_MOE_LOOPBACK_SEED", "11", 1);
    env::reset_cache();
    Ctx c = make(rank, 2, job, store);
    CHILD_CHECK(std::string(c.t->name()) == "loopback" && !c.t->caps().native_atomics && !c.t->caps().ordered, "caps");
    CHILD_CHECK(c.ep->can_reach(0) && c.ep->can_reach(1) && !c.ep->can_reach(2), "can_reach");
    constexpr int kN = 200;
    std::vector<Completion> out;
    if (rank == 0) {
      for (int i = 0; i < kN; ++i) {
        std::memset(c.data + i * 64, i + 1, 64);
        c.ep->post(test::write_imm(uint64_t(i), /*peer=*/1, uint64_t(i) * 64, 32768 + uint64_t(i) * 64, 64, uint32_t(i)));
      }
      int sends = 0;
      const auto start = std::chrono::steady_clock::now();
      while (sends < kN) {
        out.clear();
        c.ep->poll(out, 64);
        for (auto& x : out) {
          CHILD_CHECK(x.kind == CompletionKind::kSend, "kind %d status %s", int(x.kind), x.status.c_str());
          ++sends;
        }
        CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "sends stuck at %d", sends);
      }
    } else {
      std::vector<uint32_t> seen;
      const auto start = std::chrono::steady_clock::now();
      while (int(seen.size()) < kN) {
        out.clear();
        c.ep->poll(out, 64);
        for (auto& x : out) {
          CHILD_CHECK(x.kind == CompletionKind::kRecvImm && x.peer == 0, "recv kind");
          const uint32_t i = x.imm;
          for (int b = 0; b < 64; ++b)
            CHILD_CHECK(c.data[32768 + i * 64 + b] == uint8_t(i + 1), "imm %u before its data", i);
          seen.push_back(i);
        }
        CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "recv stuck");
      }
      int out_of_order = 0;
      for (int i = 1; i < kN; ++i) out_of_order += seen[size_t(i)] < seen[size_t(i - 1)];
      CHILD_CHECK(out_of_order > 10, "window 8 must reorder (%d inversions)", out_of_order);
      std::sort(seen.begin(), seen.end());
      for (int i = 0; i < kN; ++i) CHILD_CHECK(seen[size_t(i)] == uint32_t(i), "missing imm %d", i);
    }
    store->set(job + "/done" + std::to_string(rank), "1");
    store->get(job + "/done" + std::to_string(1 - rank), 20);
  });
  EXPECT_EQ(fail, "");
}

// A full receive queue holds the sender (no loss), bad offsets give an error completion.
TEST(Loopback, FullQueueHoldsSenderAndBadOffsetErrors) {
  const std::string fail = run_ranks(2, [](int rank, std::shared_ptr<KvStore> store, const std::string& job) {
    setenv("UCCL_MOE_LOOPBACK_RECV_DEPTH", "16", 1);
    env::reset_cache();
    Ctx c = make(rank, 2, job, store);
    std::vector<Completion> out;
    if (rank == 0) {
      for (int i = 0; i < 40; ++i) {
        c.ep->post(test::write_imm(uint64_t(i), /*peer=*/1, 0, 0, /*bytes=*/0, uint32_t(i)));
      }
      int sends = 0;
      for (int k = 0; k < 200; ++k) {
        out.clear();
        c.ep->poll(out, 64);
        sends += int(out.size());
      }
      CHILD_CHECK(sends == 16, "only the queue depth may complete before the receiver polls, got %d", sends);
      store->set(job + "/go", "1");
      const auto start = std::chrono::steady_clock::now();
      while (sends < 40) {
        out.clear();
        c.ep->poll(out, 64);
        sends += int(out.size());
        CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "stuck at %d", sends);
      }
      WorkRequest bad;
      bad.wr_id = 99;
      bad.op = WrOp::kWrite;
      bad.peer = 1;
      bad.bytes = 128;
      bad.remote_offset = (1 << 16) - 64;
      c.ep->post(bad);
      out.clear();
      for (int k = 0; k < 100 && out.empty(); ++k) c.ep->poll(out, 4);
      CHILD_CHECK(out.size() == 1 && out[0].kind == CompletionKind::kError && out[0].wr_id == 99, "error completion");
      CHILD_CHECK(out[0].status.find("remote access error") != std::string::npos, "%s", out[0].status.c_str());
      store->set(job + "/done", "1");
    } else {
      store->get(job + "/go", 20);
      int recvd = 0;
      const auto start = std::chrono::steady_clock::now();
      while (recvd < 40) {
        out.clear();
        c.ep->poll(out, 64);
        recvd += int(out.size());
        CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20), "recv stuck at %d", recvd);
      }
      store->get(job + "/done", 20);
    }
  });
  EXPECT_EQ(fail, "");
}

TEST(Loopback, RegistryListsLoopbackAndRejectsForeignMemory) {
  auto names = list_transports();
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.back().first, "loopback");
  EXPECT_TRUE(names.back().second);
  TransportContext ctx(Timeout::resolve());
  ctx.job = test::unique_job("foreign");
  auto t = create_transport("loopback", ctx);
  std::vector<char> mine(4096);
  EXPECT_THROW(t->register_memory(MemoryKind::kData, mine.data(), mine.size()), Error);
}

TEST(TransportRegistry, ResolveNamesTheTransportAutoAndCreateWouldTake) {
  EXPECT_EQ(resolve_transport("loopback"), "loopback");
  std::string first_usable;
  for (const auto& t : list_transports())
    if (t.second && first_usable.empty()) first_usable = t.first;
  EXPECT_EQ(resolve_transport("auto"), first_usable);
  try {
    resolve_transport("tcp");
    ADD_FAILURE() << "an unknown transport was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown transport 'tcp'"), std::string::npos) << e.what();
  }
  for (const auto& t : list_transports())
    if (!t.second) {
      try {
        resolve_transport(t.first);
        ADD_FAILURE() << t.first << " has no usable device but was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("no usable device"), std::string::npos) << e.what();
      }
    }
}

}  // namespace
}  // namespace uccl_moe
