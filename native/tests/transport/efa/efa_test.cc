#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cstring>

#include "../work_request.hpp"
#include "transport/efa/efa_detail.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

TEST(EfaBootstrap, InfoRoundTripAndCorruption) {
  detail::EfaPeerInfo a;
  for (int i = 0; i < 16; ++i) a.gid[i] = uint8_t(0xf0 + i);
  a.qpn = 0x1234;
  a.qkey = 0x11111111;
  a.data_addr = 0x7000;
  a.data_bytes = 1 << 20;
  a.data_rkey = 99;
  const std::string blob = detail::encode_efa_info(a);
  const detail::EfaPeerInfo b = detail::decode_efa_info(blob);
  EXPECT_EQ(0, std::memcmp(a.gid, b.gid, 16));
  EXPECT_EQ(b.qpn, 0x1234u);
  EXPECT_EQ(b.qkey, 0x11111111u);
  EXPECT_EQ(b.data_rkey, 99u);
  EXPECT_THROW(detail::decode_efa_info(blob.substr(0, 20)), Error);
  EXPECT_THROW(detail::decode_efa_info(blob + "zz"), Error);
  EXPECT_THROW(detail::decode_efa_info(detail::encode_peer_info(detail::IbPeerInfo{})), Error) << "ibverbs blob";
}

TEST(EfaQp, SrdTransitions) {
  auto init = detail::srd_init(1, 0x1111);
  EXPECT_EQ(init.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(init.attr.qkey, 0x1111u);
  EXPECT_EQ(init.mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
  EXPECT_EQ(detail::srd_rtr().mask, IBV_QP_STATE);
  auto rts = detail::srd_rts(42, /*set_rnr_retry=*/false);
  EXPECT_EQ(rts.attr.sq_psn, 42u);
  EXPECT_EQ(rts.mask, IBV_QP_STATE | IBV_QP_SQ_PSN) << "a device without the RNR-retry cap refuses the mask bit";
  auto rts_rnr = detail::srd_rts(42, /*set_rnr_retry=*/true);
  EXPECT_EQ(rts_rnr.mask, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RNR_RETRY);
  EXPECT_EQ(rts_rnr.attr.rnr_retry, 7) << "7 = retry forever";
}

TEST(EfaWr, PlanCarriesImmediateInNetworkOrderAndRejectsAtomics) {
  detail::LocalMr data{0x1000, 1 << 16, 7};
  detail::RemoteMr rdata{0x90000, 1 << 16, 8};
  detail::EfaPeerInfo peer;
  peer.qpn = 55;
  peer.qkey = 0x1111;
  WorkRequest w = test::write_imm(3, /*peer=*/0, /*local_offset=*/16, /*remote_offset=*/32, /*bytes=*/100, 0x40000001);
  detail::EfaWrPlan p;
  ASSERT_EQ(detail::build_efa_wr(w, data, rdata, peer, &p), "");
  EXPECT_TRUE(p.with_imm);
  EXPECT_EQ(p.imm_be, htonl(0x40000001));
  EXPECT_EQ(p.remote_addr, 0x90000u + 32);
  EXPECT_EQ(p.local_addr, 0x1000u + 16);
  EXPECT_EQ(p.length, 100u);
  EXPECT_EQ(p.rkey, 8u);
  EXPECT_EQ(p.lkey, 7u);
  EXPECT_EQ(p.remote_qpn, 55u);
  EXPECT_EQ(p.qkey, 0x1111u);
  w.op = WrOp::kAtomicAdd;
  EXPECT_NE(detail::build_efa_wr(w, data, rdata, peer, &p).find("no native atomics"), std::string::npos);
  w.op = WrOp::kWrite;
  w.remote_offset = (1 << 16) - 50;
  EXPECT_NE(detail::build_efa_wr(w, data, rdata, peer, &p).find("remote access error"), std::string::npos);
}

TEST(EfaPeers, LookupByAhnAndQpn) {
  detail::EfaPeerTable t;
  t.add(3, 100, 0);
  t.add(3, 101, 1);
  t.add(4, 100, 2);  // same QP number on another host
  EXPECT_EQ(t.lookup(3, 100), 0);
  EXPECT_EQ(t.lookup(3, 101), 1);
  EXPECT_EQ(t.lookup(4, 100), 2);
  EXPECT_EQ(t.lookup(5, 100), -1);
}

}  // namespace
}  // namespace uccl_moe
