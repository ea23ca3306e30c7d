// The efa transport over the strict EFA fake (native/tests/transport/fake_nic/efa_fake.hpp): each test pins one
// provider rule the transport must follow.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include "../fake_nic/efa_fake.hpp"
#include "../ibverbs/fake_verbs.hpp"
#include "../work_request.hpp"
#include "transport/efa/efa_detail.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

using test::EfaFabric;
using test::EfaProfile;
using test::FakeEfaNic;

EfaProfile no_unsolicited() {
  EfaProfile p = test::p5en_profile();
  p.device_caps &= ~detail::kEfaCapUnsolicitedWriteRecv;
  return p;
}

/// `n` ranks of one proxy thread each, every rank on its own fake EFA NIC of one fabric.
struct Ranks {
  std::shared_ptr<EfaFabric> fabric;
  std::vector<std::shared_ptr<FakeEfaNic>> nics;
  MemoryKvStore store;
  std::vector<std::unique_ptr<Transport>> t;
  std::vector<std::unique_ptr<Endpoint>> ep;
  std::vector<std::vector<uint8_t>> data;

  Ranks(int n, const EfaProfile& prof, int reorder_window = 0, size_t bytes = 1 << 16, uint64_t seed = 1)
      : fabric(std::make_shared<EfaFabric>(seed, reorder_window)), data(size_t(n), std::vector<uint8_t>(bytes)) {
    for (int r = 0; r < n; ++r) {
      nics.push_back(std::make_shared<FakeEfaNic>(fabric, prof));
      TransportContext c(Timeout::resolve());
      c.rank = r;
      c.num_ranks = n;
      c.job = "efatest";
      c.timeout_s = 10;
      c.verbs = nics.back();
      t.push_back(detail::create_efa_transport(c));
      t[size_t(r)]->register_memory(MemoryKind::kData, data[size_t(r)].data(), bytes);
      ep.push_back(t[size_t(r)]->create_endpoint(0));
    }
    std::vector<std::thread> th;
    for (int r = 1; r < n; ++r) th.emplace_back([this, r] { ep[size_t(r)]->connect(store); });
    ep[0]->connect(store);
    for (auto& x : th) x.join();
  }
  EfaFabric::Qp& qp(int r) {
    for (auto& [qpn, q] : fabric->qps)
      if (q->dev == &nics[size_t(r)]->dev()) return *q;
    throw std::runtime_error("no qp");
  }
  /// Polls every rank until `done` holds or `max_rounds` pass; returns the completions per rank.
  using PerRank = std::vector<std::vector<Completion>>;
  PerRank poll_until(const std::function<bool(const PerRank&)>& done, int max_rounds = 2000) {
    PerRank got(ep.size());
    for (int i = 0; i < max_rounds && !done(got); ++i)
      for (size_t r = 0; r < ep.size(); ++r) ep[r]->poll(got[r], 32);
    return got;
  }
};

detail::EfaDeviceCaps caps_of(const EfaProfile& p) {
  detail::EfaDeviceCaps c;
  c.device_caps = p.device_caps;
  c.max_sq_wr = p.max_sq_wr;
  c.max_rq_wr = p.max_rq_wr;
  c.max_rdma_size = p.max_rdma_size;
  c.max_sq_sge = p.max_sq_sge;
  c.max_rq_sge = p.max_rq_sge;
  c.max_qp = p.max_qp;
  c.max_cq = p.max_cq;
  c.max_cqe = p.max_cqe;
  c.max_qp_wr = p.max_qp_wr;
  c.max_ah = p.max_ah;
  return c;
}

int count(const std::vector<Completion>& v, CompletionKind k) {
  int n = 0;
  for (const auto& c : v) n += c.kind == k;
  return n;
}

// Without unsolicited write-recv the immediates need posted receives with one scatter entry: the efa provider writes
// a receive descriptor per scatter entry, so the old zero-entry receives never reached the device and every
// write-with-immediate stalled in RNR.
TEST(EfaTransport, PostedReceivesCarryOneScatterEntry) {
  Ranks k(2, no_unsolicited());
  EXPECT_FALSE(k.qp(1).unsolicited);
  EXPECT_EQ(k.qp(1).num_zero_sge_recvs, 0u);
  EXPECT_EQ(k.qp(1).rq_visible.size(), 1024u);
  EXPECT_EQ(k.t[1]->caps().recv_depth, 1024u);
  std::memset(k.data[0].data(), 0x5A, 512);
  k.ep[0]->post(test::write_imm(9, 1, 0, 1024, 512, 0xABC));
  auto got = k.poll_until([](auto& g) { return count(g[1], CompletionKind::kRecvImm) == 1 && !g[0].empty(); });
  ASSERT_EQ(count(got[1], CompletionKind::kRecvImm), 1) << "the immediate never found a receive (RNR)";
  EXPECT_EQ(got[1][0].imm, 0xABCu);
  EXPECT_EQ(got[1][0].peer, 0);
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0][0].kind, CompletionKind::kSend);
  EXPECT_EQ(k.data[1][1024 + 511], 0x5A);
  EXPECT_EQ(k.fabric->rnr_events, 0u);
  EXPECT_EQ(k.qp(1).rq_visible.size(), 1024u) << "the consumed receive was reposted";
}

// The fake itself: a zero-entry receive is invisible, so an immediate finds no receive and, with a finite RNR
// retry, fails with RNR_RETRY_EXC_ERR (what the old transport's receives led to).
TEST(EfaFake, ZeroEntryReceiveIsInvisibleAndTheImmediateRnrs) {
  EfaProfile prof = no_unsolicited();
  prof.device_caps &= ~detail::kEfaCapRnrRetry;
  prof.default_rnr_retry = 2;
  Ranks k(2, prof);
  EfaFabric::Qp& q = k.qp(1);
  q.rq_visible.clear();  // drop the transport's receives, then post what the old transport posted
  q.rq_used = 0;
  ibv_recv_wr wr{}, *bad = nullptr;
  ASSERT_EQ(k.nics[1]->post_recv(&q.qpx.qp_base, &wr, &bad), 0);
  EXPECT_EQ(q.num_zero_sge_recvs, 1u);
  k.ep[0]->post(test::write_imm(4, 1, 0, 0, 64, 1));
  auto got = k.poll_until([](auto& g) { return !g[0].empty(); });
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0][0].kind, CompletionKind::kError);
  EXPECT_EQ(got[0][0].wr_id, 4u);
  EXPECT_NE(got[0][0].status.find("RNR"), std::string::npos) << got[0][0].status;
  EXPECT_GT(k.fabric->rnr_events, 0u);
}

// With the capability the QP is created with EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV and posts no receives.
TEST(EfaTransport, UnsolicitedWriteRecvPostsNoReceives) {
  Ranks k(2, test::p5en_profile());
  EXPECT_TRUE(k.qp(1).unsolicited);
  EXPECT_EQ(k.qp(1).rq_used, 0u);
  for (int i = 0; i < 100; ++i) k.ep[0]->post(test::write_imm(uint64_t(i), 1, 0, 64 * uint64_t(i), 64, uint32_t(i)));
  auto got = k.poll_until([](auto& g) { return count(g[1], CompletionKind::kRecvImm) == 100; });
  EXPECT_EQ(count(got[1], CompletionKind::kRecvImm), 100);
  EXPECT_EQ(k.qp(1).rq_used, 0u);
}

// The fake refuses the flag on a device that lacks the capability (rdma-core efa_check_qp_attr).
TEST(EfaFake, UnsolicitedFlagNeedsTheCapability) {
  auto fabric = std::make_shared<EfaFabric>();
  FakeEfaNic nic(fabric, no_unsolicited());
  ibv_cq* cq = nic.create_cq(nullptr, 64);
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_DRIVER;
  a.send_cq = a.recv_cq = cq;
  a.pd = nic.alloc_pd(nullptr);
  a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE;
  a.cap.max_send_wr = a.cap.max_recv_wr = 16;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  detail::EfaQpInitAttr e;
  e.flags = detail::kEfaQpFlagUnsolicitedWriteRecv;
  EXPECT_EQ(nic.create_srd_qp(nullptr, &a, e), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  e.flags = 0;
  EXPECT_NE(nic.create_srd_qp(nullptr, &a, e), nullptr);
}

// RTS sets IBV_QP_RNR_RETRY = 7 where the device allows it (and the fake refuses the bit where it does not).
TEST(EfaTransport, RnrRetryAtRtsFollowsTheCapability) {
  {
    Ranks k(2, test::p5en_profile());
    EfaFabric::Qp& q = k.qp(0);
    ASSERT_EQ(q.masks.size(), 3u);
    EXPECT_EQ(q.masks[2], IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RNR_RETRY);
    EXPECT_TRUE(q.rnr_set);
    EXPECT_EQ(q.rnr_retry, 7);
    EXPECT_EQ(q.masks[0], IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
    EXPECT_EQ(q.masks[1], IBV_QP_STATE);
    EXPECT_EQ(q.state, IBV_QPS_RTS);
  }
  EfaProfile old = test::p5en_profile();
  old.device_caps &= ~detail::kEfaCapRnrRetry;
  Ranks k(2, old);
  EXPECT_FALSE(k.qp(0).rnr_set);
  EXPECT_EQ(k.qp(0).masks[2], IBV_QP_STATE | IBV_QP_SQ_PSN);
}

// A receiver that falls behind (no receive posted) holds a sender with RNR retry 7 instead of failing it.
TEST(EfaTransport, RnrRetryForeverWaitsForTheReceiver) {
  EfaProfile prof = no_unsolicited();
  prof.default_rnr_retry = 0;  // a firmware whose default does not retry: only the explicit 7 keeps the sender waiting
  Ranks k(2, prof);
  EfaFabric::Qp& q = k.qp(1);
  const auto saved = q.rq_visible;
  q.rq_visible.clear();
  k.ep[0]->post(test::write_imm(1, 1, 0, 0, 8, 7));
  std::vector<Completion> out;
  for (int i = 0; i < 50; ++i) k.ep[0]->poll(out, 8);
  EXPECT_TRUE(out.empty()) << out[0].status;
  EXPECT_GT(k.fabric->rnr_events, 0u);
  q.rq_visible = saved;
  auto got = k.poll_until([](auto& g) { return count(g[1], CompletionKind::kRecvImm) == 1 && !g[0].empty(); });
  EXPECT_EQ(count(got[1], CompletionKind::kRecvImm), 1);
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0][0].kind, CompletionKind::kSend);
}

// An immediate-only message goes out with one zero-length scatter entry (the fake refuses a write with none).
TEST(EfaTransport, ZeroByteImmediateHasOneZeroLengthEntry) {
  Ranks k(2, test::p5en_profile());
  k.ep[0]->post(test::write_imm(3, 1, 0, 0, 0, 0x77));
  auto got = k.poll_until([](auto& g) { return count(g[1], CompletionKind::kRecvImm) == 1 && !g[0].empty(); });
  ASSERT_EQ(count(got[1], CompletionKind::kRecvImm), 1);
  EXPECT_EQ(got[1][0].imm, 0x77u);
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0][0].kind, CompletionKind::kSend) << got[0][0].status;
  EXPECT_EQ(k.qp(0).num_sge, 1u);
  EXPECT_EQ(k.qp(0).len, 0u);
}

// Writes longer than max_rdma_size are split; the immediate rides on the last piece, posted only after the others
// landed, so with SRD reordering the receiver never sees the immediate before all the data; one completion each.
TEST(EfaTransport, OversizedWriteIsSplitWithOneCompletion) {
  EfaProfile prof = test::p5en_profile();
  prof.max_rdma_size = 4096;
  Ranks k(2, prof, /*reorder_window=*/16, /*bytes=*/1 << 20, /*seed=*/7);
  constexpr uint32_t kBytes = 10 * 4096 + 123;
  for (uint32_t i = 0; i < kBytes; ++i) k.data[0][i] = uint8_t(i * 13 + 1);
  k.ep[0]->post(test::write_imm(11, 1, 0, 1 << 19, kBytes, 0x1234));
  WorkRequest plain = test::write_imm(12, 1, 0, 0, 3 * 4096, 0);
  plain.op = WrOp::kWrite;
  k.ep[0]->post(plain);
  std::vector<std::vector<Completion>> got(2);
  bool checked = false;
  for (int i = 0; i < 5000 && !(got[0].size() == 2 && checked); ++i) {
    k.ep[0]->poll(got[0], 32);
    const size_t before = got[1].size();
    k.ep[1]->poll(got[1], 32);
    if (got[1].size() > before) {
      for (uint32_t b = 0; b < kBytes; ++b)
        ASSERT_EQ(k.data[1][(1 << 19) + b], uint8_t(b * 13 + 1)) << "immediate arrived before byte " << b;
      checked = true;
    }
  }
  EXPECT_TRUE(checked);
  EXPECT_EQ(count(got[1], CompletionKind::kRecvImm), 1);
  ASSERT_EQ(got[0].size(), 2u);
  EXPECT_EQ(count(got[0], CompletionKind::kSend), 2);
  EXPECT_LE(k.fabric->max_write_seen, 4096u);
  EXPECT_EQ(k.fabric->executed, 11u + 3u) << "11 pieces and 3 pieces";
}

// The fake refuses a single write above max_rdma_size (what an unsplit 8 MiB write got on EFA).
TEST(EfaFake, WriteAboveMaxRdmaSizeFails) {
  auto fabric = std::make_shared<EfaFabric>();
  EfaProfile prof = test::p5en_profile();
  prof.max_rdma_size = 1024;
  EfaFabric::Op op{};
  FakeEfaNic nic(fabric, prof);
  ibv_cq* cq = nic.create_cq(nullptr, 8);
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_DRIVER;
  a.send_cq = a.recv_cq = cq;
  a.pd = nic.alloc_pd(nullptr);
  a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE;
  a.cap.max_send_wr = a.cap.max_recv_wr = 4;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  ibv_qp* qp = nic.create_srd_qp(nullptr, &a, detail::EfaQpInitAttr{});
  ASSERT_NE(qp, nullptr);
  op.src = nic.qp(qp);
  op.wr_id = 5;
  op.len = 2048;
  op.src->sq_used = 1;
  ASSERT_TRUE(fabric->execute(op));
  ibv_wc wc[2];
  ASSERT_EQ(nic.poll_cq(cq, 2, wc), 1);
  EXPECT_EQ(wc[0].status, IBV_WC_LOC_LEN_ERR);
  EXPECT_EQ(wc[0].wr_id, 5u);
}

// A failed work completion carries a garbage opcode (here: "received immediate"); the transport reads only wr_id,
// status, qp_num and vendor_err, and reports the request's error.
TEST(EfaTransport, ErrorCompletionIgnoresTheOpcode) {
  Ranks k(2, test::p5en_profile());
  k.fabric->mrs.clear();  // every rkey is now invalid: the write fails at the responder
  k.ep[0]->post(test::write_imm(21, 1, 0, 0, 64, 0x99));
  auto got = k.poll_until([](auto& g) { return !g[0].empty(); });
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0][0].kind, CompletionKind::kError);
  EXPECT_EQ(got[0][0].wr_id, 21u);
  EXPECT_EQ(got[0][0].peer, 1);
  EXPECT_NE(got[0][0].status.find("remote access error (10)"), std::string::npos) << got[0][0].status;
  EXPECT_EQ(count(got[1], CompletionKind::kRecvImm), 0);
}

// With unsolicited receives the CQ holds every peer's send window: four ranks each fill their send queue towards
// rank 0 before it polls, and its CQ (512 x 5 entries; the old transport's 1536 overflowed) keeps them all.
TEST(EfaTransport, CqIsSizedForPeersTimesWindow) {
  Ranks k(4, test::p5en_profile(), 0, 1 << 16);
  const detail::EfaQueuePlan plan = detail::plan_efa_queues(caps_of(test::p5en_profile()), "x", 4, 1);
  EXPECT_EQ(plan.cqe, plan.send_depth * 5);
  for (int r = 0; r < 4; ++r)
    for (uint32_t i = 0; i < plan.send_depth; ++i) k.ep[size_t(r)]->post(test::write_imm(i, 0, 0, 8 * (i % 64), 8, i));
  // Deliver everything without rank 0 draining its CQ: only ranks 1-3 poll (their own sends complete).
  for (int round = 0; round < 2000 && !k.fabric->pending.empty(); ++round) {
    std::lock_guard<std::mutex> l(k.fabric->mu);
    k.fabric->progress();
  }
  ASSERT_TRUE(k.fabric->pending.empty());
  std::vector<Completion> out;
  int recvs = 0, sends = 0;
  for (int i = 0; i < 400; ++i) {
    out.clear();
    k.ep[0]->poll(out, 32);  // throws on CQ overflow
    recvs += count(out, CompletionKind::kRecvImm);
    sends += count(out, CompletionKind::kSend);
  }
  EXPECT_EQ(recvs, int(4 * plan.send_depth));
  EXPECT_EQ(sends, int(plan.send_depth));
}

// The fake: more completions than CQ entries overflow the CQ, and the next poll fails.
TEST(EfaFake, CqOverflowFailsThePoll) {
  auto fabric = std::make_shared<EfaFabric>();
  FakeEfaNic nic(fabric, test::p5en_profile());
  ibv_cq* cq = nic.create_cq(nullptr, 2);
  ibv_wc wc[4] = {};
  for (int i = 0; i < 3; ++i) fabric->push(nic.cq(cq), wc[0]);
  EXPECT_EQ(nic.poll_cq(cq, 4, wc), -EOVERFLOW);
  EXPECT_EQ(nic.create_cq(nullptr, test::p5en_profile().max_cqe + 1), nullptr) << "above max_cqe";
}

// A device without RDMA write: a clear error naming the capability and the fix, and the probe says no so "auto"
// falls back.
TEST(EfaTransport, NoRdmaWriteIsAClearErrorAndTheProbeSaysNo) {
  EfaProfile prof = test::p5en_profile();
  prof.device_caps &= ~detail::kEfaCapRdmaWrite;
  auto fabric = std::make_shared<EfaFabric>();
  auto nic = std::make_shared<FakeEfaNic>(fabric, prof);
  TransportContext c(Timeout::resolve());
  c.verbs = nic;
  try {
    detail::create_efa_transport(c);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE"), std::string::npos) << w;
    EXPECT_NE(w.find("UCCL_MOE_TRANSPORT"), std::string::npos) << w;
  }
  EXPECT_FALSE(detail::efa_device_usable(*nic, *nic, prof.name));
  auto good = std::make_shared<FakeEfaNic>(fabric, test::p5en_profile());
  EXPECT_TRUE(detail::efa_device_usable(*good, *good, "rdmap0s0"));
  EXPECT_FALSE(detail::efa_device_usable(*good, *good, "mlx5_0")) << "not an EFA device name";
}

// Queue depths are clamped to max_sq_wr / max_rq_wr (the fake refuses larger ones, as efa_check_qp_limits does).
TEST(EfaTransport, QueueDepthsAreClampedToTheDevice) {
  EfaProfile prof = no_unsolicited();
  prof.max_sq_wr = 64;
  prof.max_rq_wr = 128;
  Ranks k(2, prof);
  EXPECT_EQ(k.qp(0).max_send_wr, 64u);
  EXPECT_EQ(k.qp(0).max_recv_wr, 128u);
  EXPECT_EQ(k.qp(0).rq_visible.size(), 128u);
  EXPECT_EQ(k.t[0]->caps().recv_depth, 128u);
  // More requests than the send queue holds wait in the backlog and all complete.
  for (int i = 0; i < 200; ++i) k.ep[0]->post(test::write_imm(uint64_t(i), 1, 0, 0, 16, uint32_t(i)));
  auto got = k.poll_until([](auto& g) { return count(g[0], CompletionKind::kSend) == 200; });
  EXPECT_EQ(count(got[0], CompletionKind::kSend), 200);
  EXPECT_EQ(count(got[1], CompletionKind::kRecvImm), 200);
}

// Device limits: too few QPs for the proxy threads, or a CQ the device cannot hold, are clear errors.
TEST(EfaTransport, DeviceLimitsAreCheckedWithClearErrors) {
  detail::EfaDeviceCaps c = caps_of(test::p5en_profile());
  c.max_sq_sge = c.max_rq_sge = 1;
  c.max_qp = 2;
  c.max_cqe = 4096;
  EXPECT_NO_THROW(detail::plan_efa_queues(c, "efa0", 2, 2));
  try {
    detail::plan_efa_queues(c, "efa0", 2, 4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_qp=2"), std::string::npos) << e.what();
  }
  // 64 ranks: the send window shrinks so that peers x window fits max_cqe.
  const detail::EfaQueuePlan big = detail::plan_efa_queues(c, "efa0", 63, 1);
  EXPECT_EQ(big.send_depth, 4096u / 64);
  EXPECT_LE(big.cqe, 4096u);
  try {
    detail::plan_efa_queues(c, "efa0", 1000, 1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_cqe"), std::string::npos) << e.what();
  }
  c.max_ah = 8;
  EXPECT_THROW(detail::plan_efa_queues(c, "efa0", 9, 1), Error);
}

// The SRD QP's service level comes from UCCL_MOE_EFA_SL (8, the low-latency SL, by default).
TEST(EfaTransport, ServiceLevelKnob) {
  {
    Ranks k(1, test::p5en_profile());
    EXPECT_EQ(k.qp(0).sl, 8);
  }
  setenv("UCCL_MOE_EFA_SL", "0", 1);
  env::reset_cache();
  {
    Ranks k(1, test::p5en_profile());
    EXPECT_EQ(k.qp(0).sl, 0);
  }
  unsetenv("UCCL_MOE_EFA_SL");
  env::reset_cache();
}

// An injected verbs layer without the EFA half is a usage error, not a crash.
TEST(EfaTransport, InjectedOpsMustImplementEfaOps) {
  TransportContext c(Timeout::resolve());
  c.verbs = std::make_shared<test::FakeVerbs>(std::make_shared<test::FakeFabric>());
  try {
    detail::create_efa_transport(c);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("EfaOps"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace uccl_moe
