#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <thread>

#include "../work_request.hpp"
#include "fake_verbs.hpp"
#include "transport/ibverbs/ibverbs_detail.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/transfer_cmd.hpp"

namespace uccl_moe {
namespace {

using detail::IbPeerInfo;

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
  EXPECT_EQ(detail::resolve_gid_index(ops, nullptr, 1, 4, "auto"), 2);
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
  for (int r = 0; r < 2; ++r) {
    TransportContext c;
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

}  // namespace
}  // namespace uccl_moe
