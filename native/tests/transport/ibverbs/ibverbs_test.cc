#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <exception>
#include <functional>
#include <thread>

#include "../work_request.hpp"
#include "fake_verbs.hpp"
#include "transport/ibverbs/ibverbs_detail.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/transfer_cmd.hpp"

namespace uccl_moe {
namespace {

using detail::IbPeerInfo;

/// Sets UCCL_MOE_<name> for one scope (env knobs are cached: the cache is reset both ways).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : var_(std::string("UCCL_MOE_") + name) {
    setenv(var_.c_str(), value.c_str(), 1);
    env::reset_cache();
  }
  ~ScopedEnv() {
    unsetenv(var_.c_str());
    env::reset_cache();
  }

 private:
  std::string var_;
};

IbPeerInfo sample_info() {
  IbPeerInfo i;
  i.lid = 7;
  for (int k = 0; k < 16; ++k) i.gid[k] = uint8_t(k * 3);
  i.mtu = IBV_MTU_2048;
  i.port = 1;
  i.data_addr = 0x7f0000001000;
  i.data_bytes = 1 << 30;
  i.data_rkey = 0xAB;
  i.ctr_addr = 0x7f0000900000;
  i.ctr_bytes = 4096;
  i.ctr_rkey = 0xCD;
  i.qpn = {11, 12, 13};
  i.psn = {0x111, 0x222, 0x333};
  return i;
}

TEST(IbverbsBootstrap, PeerInfoRoundTripAndRejectsCorruption) {
  const IbPeerInfo a = sample_info();
  const std::string blob = detail::encode_peer_info(a);
  const IbPeerInfo b = detail::decode_peer_info(blob);
  EXPECT_EQ(b.lid, 7u);
  EXPECT_EQ(0, std::memcmp(a.gid, b.gid, 16));
  EXPECT_EQ(b.mtu, uint32_t(IBV_MTU_2048));
  EXPECT_EQ(b.data_addr, a.data_addr);
  EXPECT_EQ(b.data_bytes, a.data_bytes);
  EXPECT_EQ(b.data_rkey, 0xABu);
  EXPECT_EQ(b.ctr_rkey, 0xCDu);
  EXPECT_EQ(b.qpn, a.qpn);
  EXPECT_EQ(b.psn, a.psn);
  EXPECT_THROW(detail::decode_peer_info(blob.substr(0, blob.size() - 1)), Error);
  EXPECT_THROW(detail::decode_peer_info(blob + "x"), Error);
  std::string bad = blob;
  bad[0] ^= 1;
  EXPECT_THROW(detail::decode_peer_info(bad), Error);
}

TEST(IbverbsQp, StateTransitionsCarryTheRightAttributes) {
  auto init = detail::rc_init(1);
  EXPECT_EQ(init.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(init.attr.port_num, 1);
  EXPECT_TRUE(init.attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE);
  EXPECT_TRUE(init.attr.qp_access_flags & IBV_ACCESS_REMOTE_ATOMIC);
  EXPECT_EQ(init.mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);

  const IbPeerInfo remote = sample_info();
  auto rtr = detail::rc_rtr(remote, /*my_rank=*/2, 1, /*gid_index=*/3, /*use_gid=*/true, 5, 106, IBV_MTU_4096);
  EXPECT_EQ(rtr.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(rtr.attr.dest_qp_num, 13u) << "the remote's QP for *our* rank";
  EXPECT_EQ(rtr.attr.rq_psn, 0x333u);
  EXPECT_EQ(rtr.attr.path_mtu, IBV_MTU_2048) << "min of both MTUs";
  EXPECT_EQ(rtr.attr.ah_attr.is_global, 1);
  EXPECT_EQ(rtr.attr.ah_attr.grh.sgid_index, 3);
  EXPECT_EQ(rtr.attr.ah_attr.grh.traffic_class, 106);
  EXPECT_EQ(rtr.attr.ah_attr.sl, 5);
  EXPECT_EQ(0, std::memcmp(rtr.attr.ah_attr.grh.dgid.raw, remote.gid, 16));
  EXPECT_TRUE(rtr.mask & IBV_QP_AV);
  EXPECT_TRUE(rtr.mask & IBV_QP_DEST_QPN);
  EXPECT_TRUE(rtr.mask & IBV_QP_RQ_PSN);
  auto rtr_ib = detail::rc_rtr(remote, 0, 1, 0, /*use_gid=*/false, 0, 0, IBV_MTU_4096);
  EXPECT_EQ(rtr_ib.attr.ah_attr.is_global, 0);
  EXPECT_EQ(rtr_ib.attr.ah_attr.dlid, 7);
  EXPECT_EQ(rtr_ib.attr.dest_qp_num, 11u);
  EXPECT_THROW(detail::rc_rtr(remote, 3, 1, 0, false, 0, 0, IBV_MTU_4096), Error);

  auto rts = detail::rc_rts(0xABCDEF);
  EXPECT_EQ(rts.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(rts.attr.sq_psn, 0xABCDEFu);
  EXPECT_EQ(rts.attr.rnr_retry, 7) << "infinite RNR retry: a full receive queue holds the sender";
  EXPECT_TRUE(rts.mask & IBV_QP_SQ_PSN);
}

TEST(IbverbsWr, BuildsWritesImmediatesAndAtomics) {
  detail::LocalMr data{0x1000, 1 << 20, 0x11}, scratch{0x9000, 64, 0x22};
  detail::RemoteMr rdata{0x500000, 1 << 20, 0x33}, rctr{0x900000, 256 * 8, 0x44};
  ibv_send_wr wr;
  ibv_sge sge;
  WorkRequest in = test::write_imm(77, /*peer=*/0, /*local_offset=*/64, /*remote_offset=*/128, /*bytes=*/4096, 0x80123456);
  ASSERT_EQ(detail::build_send_wr(in, data, scratch, rdata, rctr, &wr, &sge), "");
  EXPECT_EQ(wr.opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
  EXPECT_EQ(wr.imm_data, htonl(0x80123456)) << "immediates travel in network order";
  EXPECT_EQ(wr.wr.rdma.remote_addr, 0x500000u + 128);
  EXPECT_EQ(wr.wr.rdma.rkey, 0x33u);
  EXPECT_EQ(wr.num_sge, 1);
  EXPECT_EQ(sge.addr, 0x1000u + 64);
  EXPECT_EQ(sge.length, 4096u);
  EXPECT_EQ(sge.lkey, 0x11u);
  EXPECT_EQ(wr.wr_id, 77u);
  EXPECT_TRUE(wr.send_flags & IBV_SEND_SIGNALED);

  in.bytes = 0;  // immediate-only
  ASSERT_EQ(detail::build_send_wr(in, data, scratch, rdata, rctr, &wr, &sge), "");
  EXPECT_EQ(wr.num_sge, 0);
  in.op = WrOp::kWrite;
  in.bytes = 8;
  ASSERT_EQ(detail::build_send_wr(in, data, scratch, rdata, rctr, &wr, &sge), "");
  EXPECT_EQ(wr.opcode, IBV_WR_RDMA_WRITE);

  WorkRequest a;
  a.op = WrOp::kAtomicAdd;
  a.counter_index = 5;
  a.add = -3;
  ASSERT_EQ(detail::build_send_wr(a, data, scratch, rdata, rctr, &wr, &sge), "");
  EXPECT_EQ(wr.opcode, IBV_WR_ATOMIC_FETCH_AND_ADD);
  EXPECT_EQ(wr.wr.atomic.remote_addr, 0x900000u + 40);
  EXPECT_EQ(wr.wr.atomic.rkey, 0x44u);
  EXPECT_EQ(int64_t(wr.wr.atomic.compare_add), -3);
  EXPECT_EQ(sge.lkey, 0x22u);
  a.counter_index = 256;
  EXPECT_NE(detail::build_send_wr(a, data, scratch, rdata, rctr, &wr, &sge), "");
  in.remote_offset = (1 << 20) - 4;
  EXPECT_NE(detail::build_send_wr(in, data, scratch, rdata, rctr, &wr, &sge).find("remote access error"),
            std::string::npos);
}

TEST(IbverbsGid, AutoPicksIpv4MappedGid) {
  auto fabric = std::make_shared<test::FakeFabric>();
  test::FakeVerbs ops(fabric);
  // The CX-7 table holds each address as RoCE v1 (index 2) then RoCE v2 (index 3); the old fake had no v1 twin.
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 4, "auto"), 3);
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 4, "3"), 3);
  EXPECT_THROW(detail::resolve_gid_index(ops, nullptr, 1, 4, "x"), Error);
}

// Two transports over the fake fabric: QPs walk RESET->INIT->RTR->RTS, MRs/rkeys are exchanged through the store,
// writes with immediate land with their immediate, native atomics add, bad offsets give error completions.
TEST(IbverbsSeam, EndToEndOverFakeFabric) {
  auto fabric = std::make_shared<test::FakeFabric>();
  MemoryKvStore store;
  std::vector<std::unique_ptr<Transport>> t;
  std::vector<std::unique_ptr<Endpoint>> ep;
  std::vector<std::vector<uint8_t>> data(2, std::vector<uint8_t>(1 << 16));
  std::vector<std::vector<int64_t>> ctr(2, std::vector<int64_t>(2 * kCountersPerSrc, 0));
  ScopedEnv native("IB_NATIVE_ATOMICS", "1");  // software atomics are the default; this test covers the native path
  for (int r = 0; r < 2; ++r) {
    TransportContext c(Timeout::resolve());
    c.rank = r;
    c.num_ranks = 2;
    c.job = "ibtest";
    c.timeout_s = 10;
    t.push_back(detail::create_ibverbs_transport_with(c, std::make_shared<test::FakeVerbs>(fabric)));
    EXPECT_TRUE(t[r]->caps().native_atomics);
    EXPECT_TRUE(t[r]->caps().ordered);
    t[r]->register_memory(MemoryKind::kData, data[r].data(), data[r].size());
    t[r]->register_memory(MemoryKind::kCounters, ctr[r].data(), ctr[r].size() * 8);
    ep.push_back(t[r]->create_endpoint(0));
  }
  std::thread other([&] { ep[1]->connect(store); });
  ep[0]->connect(store);
  other.join();
  for (auto& [qpn, q] : fabric->qps) {
    ASSERT_EQ(q.states.size(), 4u) << "qp " << qpn;
    EXPECT_EQ(q.states[1], IBV_QPS_INIT);
    EXPECT_EQ(q.states[2], IBV_QPS_RTR);
    EXPECT_EQ(q.states[3], IBV_QPS_RTS);
    EXPECT_TRUE(q.grh) << "RoCE link layer: GRH with the peer's GID";
    EXPECT_EQ(q.recv_credits, 512);
  }
  EXPECT_TRUE(ep[0]->can_reach(1));
  std::memset(data[0].data(), 0x42, 1024);
  const WorkRequest w = test::write_imm(5, /*peer=*/1, /*local_offset=*/0, /*remote_offset=*/4096, /*bytes=*/1024, 0xC0FFEE01);
  ep[0]->post(w);
  WorkRequest a;
  a.wr_id = 6;
  a.op = WrOp::kAtomicAdd;
  a.peer = 1;
  a.counter_index = kCountersPerSrc + 3;  // raw index into the peer counters (the proxy computes src * 256 + slot)
  a.add = 9;
  ep[0]->post(a);
  WorkRequest bad = w;
  bad.wr_id = 7;
  bad.remote_offset = (1 << 16) - 8;
  ep[0]->post(bad);
  std::vector<Completion> out;
  ep[0]->poll(out, 16);
  ASSERT_EQ(out.size(), 3u);
  int sends = 0, errors = 0;
  for (auto& c : out) {
    if (c.kind == CompletionKind::kSend) ++sends;
    if (c.kind == CompletionKind::kError) {
      ++errors;
      EXPECT_EQ(c.wr_id, 7u);
      EXPECT_NE(c.status.find("remote access error"), std::string::npos) << c.status;
    }
  }
  EXPECT_EQ(sends, 2);
  EXPECT_EQ(errors, 1);
  out.clear();
  ep[1]->poll(out, 16);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, CompletionKind::kRecvImm);
  EXPECT_EQ(out[0].imm, 0xC0FFEE01u);
  EXPECT_EQ(out[0].peer, 0);
  EXPECT_EQ(data[1][4096 + 1023], 0x42);
  EXPECT_EQ(ctr[1][kCountersPerSrc + 3], 9);
  // The receive credit was reposted.
  for (auto& [qpn, q] : fabric->qps) EXPECT_EQ(q.recv_credits, 512);
}

// ---- The RC rules of issue 27, each against the strict fake (each of these failed on the transport of 52c7615) ----

/// `n` ranks (one proxy thread each) over one fake fabric, each on its own device of `profile`, connected.
struct Cluster {
  std::shared_ptr<test::FakeFabric> fabric = std::make_shared<test::FakeFabric>();
  std::vector<std::shared_ptr<test::FakeVerbs>> ops;
  std::vector<std::unique_ptr<Transport>> t;
  std::vector<std::unique_ptr<Endpoint>> ep;
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::vector<int64_t>> ctr;
  MemoryKvStore store;
  Cluster(int n, const std::function<test::DeviceProfile(int)>& profile, bool connect = true) {
    data.assign(size_t(n), std::vector<uint8_t>(1 << 16));
    ctr.assign(size_t(n), std::vector<int64_t>(size_t(n) * kCountersPerSrc, 0));
    for (int r = 0; r < n; ++r) {
      TransportContext c(Timeout::resolve());
      c.rank = r;
      c.num_ranks = n;
      c.job = "cluster";
      c.timeout_s = 10;
      ops.push_back(std::make_shared<test::FakeVerbs>(fabric, profile(r)));
      c.verbs = ops.back();
      t.push_back(create_transport("ibverbs", c));
      t[r]->register_memory(MemoryKind::kData, data[r].data(), data[r].size());
      t[r]->register_memory(MemoryKind::kCounters, ctr[r].data(), ctr[r].size() * 8);
      ep.push_back(t[r]->create_endpoint(0));
    }
    if (!connect) return;
    std::vector<std::thread> th;
    std::vector<std::exception_ptr> err(static_cast<size_t>(n));
    for (int r = 1; r < n; ++r)
      th.emplace_back([this, r, &err] {
        try {
          ep[size_t(r)]->connect(store);
        } catch (...) {
          err[size_t(r)] = std::current_exception();
        }
      });
    try {
      ep[0]->connect(store);
    } catch (...) {
      err[0] = std::current_exception();
    }
    for (auto& x : th) x.join();
    for (auto& e : err)
      if (e) std::rethrow_exception(e);
  }
  /// Polls rank r until `want` completions arrived (or 1000 polls).
  std::vector<Completion> poll(int r, size_t want) {
    std::vector<Completion> out;
    for (int i = 0; i < 1000 && out.size() < want; ++i) ep[size_t(r)]->poll(out, 64);
    return out;
  }
};

test::DeviceProfile cx7(int r) { return test::mlx5_cx7(uint8_t(r + 1)); }
test::DeviceProfile thor2(int r) { return test::bnxt_re_thor2(uint8_t(r + 1)); }

TEST(IbverbsGid, AutoTakesTheRoceV2EntryNotItsV1Twin) {
  // Old code: the first IPv4-mapped GID, index 2, which is RoCE v1 (not routable across subnets).
  auto fabric = std::make_shared<test::FakeFabric>();
  test::FakeVerbs ops(fabric, test::mlx5_cx7());
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 4, "auto"), 3);
  // Types from sysfs text only (rdma-core without ibv_query_gid_ex).
  ops.profile().gid_type_ex = false;
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 4, "auto"), 3);
  ops.sysfs_types[3] = "IB/RoCE v1";  // the sysfs text decides: no v2 IPv4 entry left
  EXPECT_THROW(detail::resolve_gid_index(ops, nullptr, 1, 4, "auto"), Error);
}

TEST(IbverbsGid, BroadcomUlaOnlyTablePicksTheV2UlaGid) {
  // Old code: no IPv4-mapped GID -> index 0, a link-local RoCE v1 GID, silently.
  auto fabric = std::make_shared<test::FakeFabric>();
  test::FakeVerbs ops(fabric, test::bnxt_re_thor2());
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 4, "auto"), 3);
  // IPv4-mapped v2 still wins over ULA when both exist.
  ops.profile().gids.push_back(test::gid_v4(9, IBV_GID_TYPE_ROCE_V2));
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 5, "auto"), 4);
}

TEST(IbverbsGid, LinkLocalOnlyTableIsAnErrorNamingTheKnob) {
  auto fabric = std::make_shared<test::FakeFabric>();
  test::DeviceProfile p = test::mlx5_cx7();
  p.gids = {test::gid_link_local(1, IBV_GID_TYPE_ROCE_V1), test::gid_link_local(1, IBV_GID_TYPE_ROCE_V2),
            test::FakeGid{{0}, IBV_GID_TYPE_ROCE_V2}};
  test::FakeVerbs ops(fabric, p);
  try {
    detail::resolve_gid_index(ops, nullptr, 1, 3, "auto");
    FAIL() << "a link-local GID must not be taken";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("UCCL_MOE_IB_GID_INDEX"), std::string::npos) << w;
    EXPECT_NE(w.find("[1] fe80::"), std::string::npos) << "lists the GIDs seen: " << w;
    EXPECT_NE(w.find("RoCE v2"), std::string::npos) << w;
  }
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 3, "1"), 1) << "an explicit index is the user's choice";
}

TEST(IbverbsQos, RoceDefaultsAreTc104Sl3AndKnobsOverride) {
  {
    Cluster c(2, cx7);  // old code: TC 0, SL 0
    for (auto& [qpn, q] : c.fabric->qps) {
      EXPECT_EQ(q.rtr.ah_attr.grh.traffic_class, 104) << qpn;
      EXPECT_EQ(q.rtr.ah_attr.sl, 3);
      EXPECT_EQ(q.rtr.ah_attr.grh.sgid_index, 3) << "the RoCE v2 GID";
      EXPECT_EQ(q.rts.timeout, 14);
      EXPECT_EQ(q.rts.retry_cnt, 7);
      EXPECT_EQ(q.rts.rnr_retry, 7);
    }
  }
  ScopedEnv tc("IB_TC", "106"), sl("IB_SL", "5"), to("IB_TIMEOUT", "20"), rc("IB_RETRY_CNT", "4");
  Cluster c(2, cx7);
  for (auto& [qpn, q] : c.fabric->qps) {
    EXPECT_EQ(q.rtr.ah_attr.grh.traffic_class, 106);
    EXPECT_EQ(q.rtr.ah_attr.sl, 5);
    EXPECT_EQ(q.rts.timeout, 20);
    EXPECT_EQ(q.rts.retry_cnt, 4);
  }
  ScopedEnv bad("IB_TC", "300");
  EXPECT_THROW(Cluster(2, cx7), Error);
}

TEST(IbverbsQos, InfinibandKeepsLidRoutingAndSl0) {
  Cluster c(2, [](int r) { return test::mlx5_ib(uint8_t(r + 1)); });
  for (auto& [qpn, q] : c.fabric->qps) {
    EXPECT_FALSE(q.grh);
    EXPECT_NE(q.rtr.ah_attr.dlid, 0);
    EXPECT_EQ(q.rtr.ah_attr.sl, 0);
  }
}

TEST(IbverbsAtomics, SoftwareAtomicsByDefaultNativeOnlyByKnob) {
  {
    Cluster c(2, cx7);  // old code: native atomics whenever the device has them
    EXPECT_FALSE(c.t[0]->caps().native_atomics);
    for (auto& [qpn, q] : c.fabric->qps) {
      EXPECT_FALSE(q.access & IBV_ACCESS_REMOTE_ATOMIC);
      EXPECT_EQ(q.rtr.max_dest_rd_atomic, 1);
    }
  }
  ScopedEnv on("IB_NATIVE_ATOMICS", "1");
  Cluster c(2, cx7);
  EXPECT_TRUE(c.t[0]->caps().native_atomics);
  for (auto& [qpn, q] : c.fabric->qps) EXPECT_EQ(q.rts.max_rd_atomic, 16);
}

TEST(IbverbsAtomics, NativeAtomicsOnADeviceWithoutThemIsRefused) {
  ScopedEnv on("IB_NATIVE_ATOMICS", "1");
  try {
    Cluster c(2, thor2);  // old code: silently software atomics (the knob did not exist)
    FAIL() << "atomic_cap NONE must refuse native atomics";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("UCCL_MOE_IB_NATIVE_ATOMICS"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("IBV_ATOMIC_NONE"), std::string::npos) << e.what();
  }
}

TEST(IbverbsAtomics, RdAtomicIsClampedToTheDevice) {
  // Thor-2 profile allows 8 outstanding reads/atomics: the old 16 made ibv_modify_qp(RTR) fail with EINVAL.
  Cluster c(2, thor2);
  for (auto& [qpn, q] : c.fabric->qps) {
    EXPECT_EQ(q.states.back(), IBV_QPS_RTS);
    EXPECT_LE(q.rtr.max_dest_rd_atomic, 8);
  }
  ScopedEnv on("IB_NATIVE_ATOMICS", "1");
  Cluster n(2, [](int r) {
    test::DeviceProfile p = test::mlx5_cx7(uint8_t(r + 1));
    p.max_qp_rd_atom = 4;
    p.max_qp_init_rd_atom = 2;
    return p;
  });
  for (auto& [qpn, q] : n.fabric->qps) {
    EXPECT_EQ(q.rtr.max_dest_rd_atomic, 4);
    EXPECT_EQ(q.rts.max_rd_atomic, 2);
  }
}

TEST(IbverbsLimits, DeviceLimitsAreCheckedBeforeCreating) {
  auto expect_error = [](const std::function<void(test::DeviceProfile&)>& tweak, const char* word) {
    try {
      Cluster c(4, [&](int r) {
        test::DeviceProfile p = test::mlx5_cx7(uint8_t(r + 1));
        tweak(p);
        return p;
      }, false);
      ADD_FAILURE() << "expected an error naming " << word;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  expect_error([](test::DeviceProfile& p) { p.max_qp = 2; }, "max_qp=2");  // 3 peers need 3 QPs
  expect_error([](test::DeviceProfile& p) { p.max_cqe = 1000; }, "max_cqe=1000");
  expect_error([](test::DeviceProfile& p) { p.max_qp_wr = 256; }, "max_qp_wr=256");
  Cluster ok(4, [](int r) {
    test::DeviceProfile p = test::mlx5_cx7(uint8_t(r + 1));
    p.max_qp = 3;  // exactly the peers: no QP to self
    return p;
  });
  EXPECT_EQ(ok.fabric->qps.size(), 12u);
}

TEST(IbverbsLimits, NoQpToSelf) {
  Cluster c(2, cx7);  // old code: 2 QPs per rank, one of them to itself
  EXPECT_EQ(c.fabric->qps.size(), 2u);
  EXPECT_FALSE(c.ep[0]->can_reach(0));
  EXPECT_TRUE(c.ep[0]->can_reach(1));
  WorkRequest w = test::write_imm(1, /*peer=*/0, 0, 0, 8, 1);
  try {
    c.ep[0]->post(w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no QP to itself"), std::string::npos) << e.what();
  }
  Cluster one(1, cx7);  // a single rank needs no QP and no CQ
  EXPECT_EQ(one.fabric->qps.size(), 0u);
  std::vector<Completion> out;
  EXPECT_EQ(one.ep[0]->poll(out, 8), 0);
}

TEST(IbverbsCompletions, FailedCompletionIsReadByWrIdNotOpcode) {
  Cluster c(2, cx7);
  c.fabric->fail_next_sends = 1;
  c.fabric->fail_status = IBV_WC_RETRY_EXC_ERR;
  c.fabric->fail_vendor_err = 0x81;
  c.ep[0]->post(test::write_imm(0x0300000000000007ull, 1, 0, 0, 64, 9));
  c.ep[0]->post(test::write_imm(0x0300000000000008ull, 1, 0, 64, 64, 10));  // flushed behind it
  const std::vector<Completion> out = c.poll(0, 2);
  ASSERT_EQ(out.size(), 2u);
  // The fake fills a failed completion's opcode with garbage that has the RECV bit: the old code took it for a
  // failed receive and lost the command's wr_id.
  EXPECT_EQ(out[0].kind, CompletionKind::kError);
  EXPECT_EQ(out[0].wr_id, 0x0300000000000007ull);
  EXPECT_EQ(out[0].peer, 1);
  EXPECT_NE(out[0].status.find("transport retry counter exceeded"), std::string::npos) << out[0].status;
  EXPECT_NE(out[0].status.find("vendor_err=0x81"), std::string::npos) << out[0].status;
  EXPECT_NE(out[0].status.find("peer=1"), std::string::npos) << out[0].status;
  EXPECT_EQ(out[1].wr_id, 0x0300000000000008ull);
  EXPECT_NE(out[1].status.find("Flushed"), std::string::npos) << out[1].status;
}

// GPU mode: the data region goes through gpu_mr (dma-buf, then peer memory); without either the error names the fix.
TEST(IbverbsGpuMemory, DataRegionRegistersThroughGpuMrAndNamesWhatIsMissing) {
  auto fabric = std::make_shared<test::FakeFabric>();
  std::vector<uint8_t> data(4 << 20), ctr(4096);
  for (bool peer_memory : {true, false}) {
    TransportContext c(Timeout::resolve());
    c.gpu = std::make_shared<GpuMemoryOps>();
    auto ops = std::make_shared<test::FakeVerbs>(fabric, test::mlx5_cx7());
    ops->mark_gpu(data.data(), data.size());
    ops->profile().peer_memory = peer_memory;
    c.verbs = ops;
    auto t = create_transport("ibverbs", c);
    t->register_memory(MemoryKind::kCounters, ctr.data(), ctr.size());
    if (peer_memory) {
      // This build exports no dma-buf (no GPU backend / the fake's memory is not the driver's): ibv_reg_mr.
      t->register_memory(MemoryKind::kData, data.data(), data.size());
      EXPECT_EQ(fabric->dmabuf_regs.size(), 0u);
    } else {
      try {
        t->register_memory(MemoryKind::kData, data.data(), data.size());
        FAIL() << "neither dma-buf nor peer memory: registration must fail";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("nvidia-peermem"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(IbverbsGid, SysfsGidTypeText) {
  ibv_gid_type t = IBV_GID_TYPE_IB;
  ASSERT_TRUE(detail::parse_sysfs_gid_type("RoCE v2", &t));
  EXPECT_EQ(t, IBV_GID_TYPE_ROCE_V2);
  ASSERT_TRUE(detail::parse_sysfs_gid_type("IB/RoCE v1", &t));
  EXPECT_EQ(t, IBV_GID_TYPE_ROCE_V1);
  ASSERT_TRUE(detail::parse_sysfs_gid_type("RoCE v1", &t));
  EXPECT_EQ(t, IBV_GID_TYPE_ROCE_V1);
  ASSERT_TRUE(detail::parse_sysfs_gid_type("IB", &t));
  EXPECT_EQ(t, IBV_GID_TYPE_IB);
  EXPECT_FALSE(detail::parse_sysfs_gid_type("", &t));
  EXPECT_FALSE(detail::parse_sysfs_gid_type("RoCE v3", &t));
}

TEST(IbverbsGid, SysfsGidTypeFileUnderTheGivenRoot) {
  // The fallback of query_gid_type reads under UCCL_MOE_SYSFS_ROOT, like every other sysfs reader (fixture:
  // tests/fixtures/sysfs/h100_mlx5, types 0/1 = "IB/RoCE v1"/"RoCE v2").
  const std::string root = UCCL_MOE_SYSFS_FIXTURES "/h100_mlx5";
  ibv_gid_type t = IBV_GID_TYPE_IB;
  ASSERT_EQ(detail::read_sysfs_gid_type(root, "mlx5_1", 1, 1, &t), 0);
  EXPECT_EQ(t, IBV_GID_TYPE_ROCE_V2);
  ASSERT_EQ(detail::read_sysfs_gid_type(root, "mlx5_1", 1, 0, &t), 0);
  EXPECT_EQ(t, IBV_GID_TYPE_ROCE_V1);
  EXPECT_EQ(detail::read_sysfs_gid_type(root, "mlx5_1", 1, 999, &t), ENOENT);
  EXPECT_EQ(detail::read_sysfs_gid_type(root + "/nowhere", "mlx5_1", 1, 1, &t), ENOENT);
}

TEST(IbverbsFake, RnrRetryHoldsTheSenderUntilAReceiveIsPosted) {
  Cluster c(2, cx7);
  constexpr int kMsgs = 600;  // more than the 512 receives rank 1 posted
  for (int i = 0; i < kMsgs; ++i) c.ep[0]->post(test::write_imm(uint64_t(i), 1, 0, 0, 0, uint32_t(i)));
  std::vector<Completion> sends = c.poll(0, 512);
  EXPECT_EQ(sends.size(), 512u) << "rank 1 posted 512 receives; the rest wait (RNR)";
  size_t recvs = 0, done = sends.size();
  for (int round = 0; round < 100 && (recvs < kMsgs || done < kMsgs); ++round) {
    std::vector<Completion> r;
    c.ep[1]->poll(r, 1024);
    for (auto& x : r) {
      ASSERT_EQ(x.kind, CompletionKind::kRecvImm);
      EXPECT_EQ(x.imm, uint32_t(recvs));  // in order
      ++recvs;
    }
    std::vector<Completion> s;
    c.ep[0]->poll(s, 1024);
    for (auto& x : s) ASSERT_EQ(x.kind, CompletionKind::kSend) << x.status;
    done += s.size();
  }
  EXPECT_EQ(recvs, size_t(kMsgs));
  EXPECT_EQ(done, size_t(kMsgs));
  EXPECT_GT(c.fabric->rnr_naks, 0u) << "some writes waited for a receive";
}

TEST(IbverbsFake, EnforcesTransitionMasksAccessFlagsAndCqOverflow) {
  auto fabric = std::make_shared<test::FakeFabric>();
  test::FakeVerbs ops(fabric, test::mlx5_cx7());
  ibv_pd* pd = ops.alloc_pd(nullptr);
  ibv_cq* cq = ops.create_cq(nullptr, 2);
  EXPECT_EQ(ops.create_cq(nullptr, 5000000), nullptr) << "over max_cqe";
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = cq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = 4;
  a.cap.max_recv_wr = 4;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  ibv_qp* qp = ops.create_qp(pd, &a);
  ibv_qp* peer = ops.create_qp(pd, &a);
  a.cap.max_send_wr = 40000;
  EXPECT_EQ(ops.create_qp(pd, &a), nullptr) << "over max_qp_wr";
  for (ibv_qp* q : {qp, peer}) {
    detail::QpTransition init = detail::rc_init(1, false);
    EXPECT_EQ(ops.modify_qp(q, &init.attr, init.mask & ~IBV_QP_ACCESS_FLAGS), EINVAL) << "INIT needs access flags";
    ASSERT_EQ(ops.modify_qp(q, &init.attr, init.mask), 0);
    IbPeerInfo remote = sample_info();
    remote.qpn = {q == qp ? peer->qp_num : qp->qp_num};
    remote.psn = {0};
    detail::QpTransition rtr = detail::rc_rtr(remote, 0, 1, 3, true, 3, 104, IBV_MTU_4096, 1);
    EXPECT_EQ(ops.modify_qp(q, &rtr.attr, rtr.mask & ~IBV_QP_MIN_RNR_TIMER), EINVAL) << "RTR needs min_rnr_timer";
    detail::QpTransition no_grh = detail::rc_rtr(remote, 0, 1, 3, false, 3, 104, IBV_MTU_4096, 1);
    EXPECT_EQ(ops.modify_qp(q, &no_grh.attr, no_grh.mask), EINVAL) << "RoCE needs a GRH";
    ASSERT_EQ(ops.modify_qp(q, &rtr.attr, rtr.mask), 0);
    detail::QpTransition rts = detail::rc_rts(1, 14, 7, 32);
    EXPECT_EQ(ops.modify_qp(q, &rts.attr, rts.mask), EINVAL) << "max_rd_atomic over max_qp_init_rd_atom";
    rts = detail::rc_rts(1, 14, 7, 1);
    EXPECT_EQ(ops.modify_qp(q, &rts.attr, rts.mask & ~IBV_QP_RNR_RETRY), EINVAL) << "RTS needs rnr_retry";
    ASSERT_EQ(ops.modify_qp(q, &rts.attr, rts.mask), 0);
  }
  std::vector<uint8_t> src(64, 7), dst(64, 0);
  EXPECT_EQ(ops.reg_mr(pd, dst.data(), 64, IBV_ACCESS_REMOTE_WRITE), nullptr) << "remote write needs local write";
  ibv_mr* lmr = ops.reg_mr(pd, src.data(), 64, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* ro = ops.reg_mr(pd, dst.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ibv_sge sge{uint64_t(reinterpret_cast<uintptr_t>(src.data())), 64, lmr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = uint64_t(reinterpret_cast<uintptr_t>(dst.data()));
  wr.wr.rdma.rkey = ro->rkey;
  ASSERT_EQ(ops.post_send(qp, &wr, &bad), 0);
  ibv_wc wc[4];
  ASSERT_EQ(ops.poll_cq(cq, 4, wc), 1);
  EXPECT_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR) << "the MR lacks REMOTE_WRITE";
  EXPECT_EQ(dst[0], 0);
  // The QP is in error now: the next two flush, and with the CQ of 2 entries already holding one... overflow.
  ASSERT_EQ(ops.post_send(qp, &wr, &bad), 0);
  ASSERT_EQ(ops.post_send(qp, &wr, &bad), 0);
  ASSERT_EQ(ops.post_send(qp, &wr, &bad), 0);
  EXPECT_LT(ops.poll_cq(cq, 1, wc), 0) << "three completions into a CQ of two: overrun";
}

}  // namespace
}  // namespace uccl_moe
