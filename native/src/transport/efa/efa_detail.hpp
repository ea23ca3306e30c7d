// Pure pieces of the EFA (SRD) transport, exposed for unit tests: exchange format, SRD QP transitions, the work-request
// plan posted through the extended verbs API, and the (address handle, QP number) -> rank lookup of receives.
#pragma once

#include <infiniband/verbs.h>

#include <map>
#include <string>
#include <utility>

#include "transport/ibverbs/ibverbs_detail.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe::detail {

/// Blob "EFA1" (0x45464131) version 1: gid 16 bytes, qpn u32, qkey u32, data addr/bytes u64 + rkey u32,
/// counters addr/bytes u64 + rkey u32. SRD is connectionless: one QP per proxy thread serves every peer.
struct EfaPeerInfo {
  uint8_t gid[16] = {0};
  uint32_t qpn = 0, qkey = 0;
  uint64_t data_addr = 0, data_bytes = 0;
  uint32_t data_rkey = 0;
  uint64_t ctr_addr = 0, ctr_bytes = 0;
  uint32_t ctr_rkey = 0;
};
std::string encode_efa_info(const EfaPeerInfo& info);
EfaPeerInfo decode_efa_info(const std::string& blob);

/// SRD: RESET -> INIT (pkey, port, qkey) -> RTR (state only) -> RTS (send PSN).
QpTransition srd_init(uint8_t port, uint32_t qkey);
QpTransition srd_rtr();
QpTransition srd_rts(uint32_t psn);

/// What one post does through ibv_wr_start / ibv_wr_rdma_write[_imm] / ibv_wr_set_sge / ibv_wr_set_ud_addr /
/// ibv_wr_complete.
struct EfaWrPlan {
  uint64_t wr_id = 0;
  bool with_imm = false;
  uint32_t rkey = 0;
  uint64_t remote_addr = 0;
  uint32_t imm_be = 0;  ///< immediate in network order
  uint32_t lkey = 0;
  uint64_t local_addr = 0;
  uint32_t length = 0;
  uint32_t remote_qpn = 0, qkey = 0;
};
/// Returns "" or why the request cannot be posted (EFA has no native atomics; offsets outside the regions).
std::string build_efa_wr(const WorkRequest& in, const LocalMr& data, const RemoteMr& rdata, const EfaPeerInfo& peer,
                         EfaWrPlan* plan);

/// Receives name their sender by (address-handle number, source QP number).
class EfaPeerTable {
 public:
  void add(uint16_t ahn, uint32_t qpn, int rank) { map_[{ahn, qpn}] = rank; }
  int lookup(uint16_t ahn, uint32_t qpn) const {
    auto it = map_.find({ahn, qpn});
    return it == map_.end() ? -1 : it->second;
  }

 private:
  std::map<std::pair<uint16_t, uint32_t>, int> map_;
};

}  // namespace uccl_moe::detail
