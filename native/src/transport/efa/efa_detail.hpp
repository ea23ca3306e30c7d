// Pure pieces of the EFA (SRD) transport, exposed for unit tests: exchange format, SRD QP transitions, the work-request
// plan posted through the extended verbs API, and the (address handle, QP number) -> rank lookup of receives.
#pragma once

#include <infiniband/verbs.h>

#include <map>
#include <string>
#include <utility>

#include "efa_ops.hpp"
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

/// SRD: RESET -> INIT (pkey, port, qkey) -> RTR (state only) -> RTS (send PSN, and RNR retry 7 = retry forever
/// when the device lets it be set).
QpTransition srd_init(uint8_t port, uint32_t qkey);
QpTransition srd_rtr();
QpTransition srd_rts(uint32_t psn, bool set_rnr_retry);

/// What the device offers (efadv_query_device + ibv_query_device).
struct EfaDeviceCaps {
  uint32_t device_caps = 0;  ///< kEfaCap* bits
  uint32_t max_sq_wr = 0, max_rq_wr = 0, max_rdma_size = 0;
  uint16_t max_sq_sge = 0, max_rq_sge = 0;
  int max_qp = 0, max_cq = 0, max_cqe = 0, max_qp_wr = 0, max_ah = 0;
  bool has(uint32_t cap) const { return (device_caps & cap) != 0; }
};
/// Queries both attribute sets; returns "" or the failing call's error.
std::string query_efa_caps(VerbsOps& verbs, EfaOps& efa, ibv_context* ctx, EfaDeviceCaps* caps);

/// Queue sizes and modes one endpoint (one SRD QP, one CQ) uses on a device.
struct EfaQueuePlan {
  uint32_t send_depth = 0;      ///< send WRs in flight per QP
  uint32_t recv_depth = 0;      ///< receive WRs posted per QP (0 with unsolicited write-recv)
  uint32_t cqe = 0;             ///< CQ entries
  uint32_t window = 0;          ///< most unprocessed immediates a receiver holds (TransportCaps::recv_depth)
  uint32_t max_write_bytes = 0; ///< largest single RDMA write; longer requests are split
  bool unsolicited = false;     ///< EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV
  bool set_rnr_retry = false;   ///< IBV_QP_RNR_RETRY at RTS
};
/// Checks the device against what the transport needs and sizes the queues for `num_ranks` peers and `num_threads`
/// QPs. Throws Transport naming the missing capability or limit and the fix.
EfaQueuePlan plan_efa_queues(const EfaDeviceCaps& caps, const std::string& device, int num_ranks, int num_threads);

/// True if `name` is an EFA device that can RDMA-write (the efa transport's probe; "auto" falls back otherwise).
bool efa_device_usable(VerbsOps& verbs, EfaOps& efa, const std::string& name);

/// The transport over ctx.verbs (a fake that implements EfaOps too) or, when null, the real libraries.
std::unique_ptr<Transport> create_efa_transport(const TransportContext& ctx);
/// The transport over the given ops (tests pass a fake).
std::unique_ptr<Transport> create_efa_transport_with(const TransportContext& ctx, EfaOpsPair ops);

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
/// Splits `bytes` into pieces of at most `max_piece` (>= 1): the number of RDMA writes one request becomes.
inline uint32_t num_write_pieces(uint32_t bytes, uint32_t max_piece) {
  return bytes <= max_piece ? 1 : uint32_t((uint64_t(bytes) + max_piece - 1) / max_piece);
}
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
