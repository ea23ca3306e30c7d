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
  a.device = 1;
  a.data_addr = 0x7000;
  a.data_bytes = 3 << 20;
  a.chunks = {{0x7000, 1 << 20, 99}, {0x7000 + (1 << 20), 2 << 20, 100}};
  const std::string blob = detail::encode_efa_info(a);
  const detail::EfaPeerInfo b = detail::decode_efa_info(blob);
  EXPECT_EQ(0, std::memcmp(a.gid, b.gid, 16));
  EXPECT_EQ(b.qpn, 0x1234u);
  EXPECT_EQ(b.qkey, 0x11111111u);
  EXPECT_EQ(b.device, 1u);
  ASSERT_EQ(b.chunks.size(), 2u);
  EXPECT_EQ(b.chunks[0].rkey, 99u);
  EXPECT_EQ(b.chunks[1].addr, 0x7000u + (1 << 20));
  EXPECT_EQ(b.chunks[1].bytes, 2u << 20);
  EXPECT_EQ(b.chunks[1].rkey, 100u);
  EXPECT_THROW(detail::decode_efa_info(blob.substr(0, 20)), Error);
  EXPECT_THROW(detail::decode_efa_info(blob + "zz"), Error);
  EXPECT_THROW(detail::decode_efa_info(detail::encode_peer_info(detail::IbPeerInfo{})), Error) << "ibverbs blob";
  // Chunks that leave a gap, or do not reach the region's end, are refused (the post path looks them up by address).
  detail::EfaPeerInfo gap = a;
  gap.chunks[1].addr += 4096;
  EXPECT_THROW(detail::decode_efa_info(detail::encode_efa_info(gap)), Error);
  detail::EfaPeerInfo shortc = a;
  shortc.data_bytes += 1;
  EXPECT_THROW(detail::decode_efa_info(detail::encode_efa_info(shortc)), Error);
}

// The chunk lookup and the piece length: a piece never crosses a local or remote chunk, nor max_rdma_size.
TEST(EfaWr, ChunkLookupAndPieceBytes) {
  const std::vector<detail::LocalMr> l = {{1000, 100, 1}, {1100, 200, 2}, {1300, 50, 3}};
  EXPECT_EQ(detail::find_chunk(l, 999), nullptr);
  EXPECT_EQ(detail::find_chunk(l, 1000)->lkey, 1u);
  EXPECT_EQ(detail::find_chunk(l, 1099)->lkey, 1u);
  EXPECT_EQ(detail::find_chunk(l, 1100)->lkey, 2u);
  EXPECT_EQ(detail::find_chunk(l, 1349)->lkey, 3u);
  EXPECT_EQ(detail::find_chunk(l, 1350), nullptr);
  const detail::RemoteMr r{5000, 60, 9};
  EXPECT_EQ(detail::next_piece_bytes(500, 1000, l[1], 1150, r, 5000), 60u) << "the remote chunk ends first";
  EXPECT_EQ(detail::next_piece_bytes(500, 1000, l[1], 1250, r, 5000), 50u) << "the local chunk ends first";
  EXPECT_EQ(detail::next_piece_bytes(500, 20, l[1], 1150, r, 5000), 20u) << "max_rdma_size";
  EXPECT_EQ(detail::next_piece_bytes(7, 20, l[1], 1150, r, 5000), 7u) << "what is left";
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
