// Pure pieces of the ibverbs (RC) transport, exposed for unit tests: the bootstrap exchange format, the QP state
// transitions, the MR table and WR/SGE building. ibverbs.cc wires them to VerbsOps.
#pragma once

#include <infiniband/verbs.h>

#include <string>
#include <vector>

#include "uccl_moe/transport.hpp"
#include "verbs_ops.hpp"

namespace uccl_moe::detail {

/// What one proxy thread of one rank publishes (key "<job>/ibverbs/r<rank>/t<thread>"). Blob: magic "IBV1"
/// (0x49425631), version 1, then lid u32, gid 16 bytes, mtu u32, port u32, data addr/bytes u64 + rkey u32,
/// counters addr/bytes u64 + rkey u32, num_ranks u32, then qpn u32 and psn u32 per rank (our QP for that peer).
struct IbPeerInfo {
  uint32_t lid = 0;
  uint8_t gid[16] = {0};
  uint32_t mtu = IBV_MTU_1024;
  uint32_t port = 1;
  uint64_t data_addr = 0, data_bytes = 0;
  uint32_t data_rkey = 0;
  uint64_t ctr_addr = 0, ctr_bytes = 0;
  uint32_t ctr_rkey = 0;
  std::vector<uint32_t> qpn, psn;  ///< [num_ranks]
};
std::string encode_peer_info(const IbPeerInfo& info);
IbPeerInfo decode_peer_info(const std::string& blob);

struct QpTransition {
  ibv_qp_attr attr;
  int mask;
};
/// RESET -> INIT: port, pkey 0, access flags for remote write (and atomics when `atomics`).
QpTransition rc_init(uint8_t port, bool atomics = true);
/// INIT -> RTR towards `remote`'s QP for `my_rank`. `use_gid`: RoCE / routed IB (GRH with the peer's GID).
QpTransition rc_rtr(const IbPeerInfo& remote, int my_rank, uint8_t port, int gid_index, bool use_gid, uint8_t sl,
                    uint8_t traffic_class, ibv_mtu local_mtu, uint8_t max_dest_rd_atomic = 16);
/// RTR -> RTS with our send PSN.
QpTransition rc_rts(uint32_t my_psn);
/// The same with the knobs' timeout / retry count and an rd_atomic already clamped to the device.
QpTransition rc_rts(uint32_t my_psn, uint8_t timeout, uint8_t retry_cnt, uint8_t max_rd_atomic);

/// The RC parameters that come from the knobs and the device (resolve_rc_params).
struct RcParams {
  uint8_t sl = 0, traffic_class = 0;
  uint8_t timeout = 14, retry_cnt = 7;
  uint8_t max_rd_atomic = 1, max_dest_rd_atomic = 1;  ///< clamped to max_qp_init_rd_atom / max_qp_rd_atom
  bool native_atomics = false;
};
/// Resolves UCCL_MOE_IB_{SL,TC,TIMEOUT,RETRY_CNT,NATIVE_ATOMICS} for a port (`roce`: Ethernet link layer) and device.
/// Native atomics only when the knob asks; a device with atomic_cap NONE then throws InvalidUsage naming the knob.
RcParams resolve_rc_params(const ibv_device_attr& dev, bool roce, const std::string& dev_name);

/// "" if the device can hold what one proxy needs: (num_ranks - 1) QPs per thread, a CQ of
/// (num_ranks - 1) * (send_depth + recv_depth) entries per thread, send_depth / recv_depth WRs per QP; else why not.
std::string check_device_limits(const ibv_device_attr& dev, int num_ranks, int num_threads, int send_depth,
                                int recv_depth);

/// "mlx5", "bnxt_re" or "other": from the device name, else the vendor id ibv_query_device reports.
std::string nic_family(const std::string& dev_name, uint32_t vendor_id);

/// Receive WRs carry this bit in wr_id (plus the peer): a failed completion is told apart by wr_id alone, since
/// man ibv_poll_cq leaves opcode undefined when status != IBV_WC_SUCCESS. Proxy wr_ids never set bit 63.
constexpr uint64_t kRecvWrTag = 1ull << 63;

struct LocalMr {
  uint64_t addr = 0, bytes = 0;
  uint32_t lkey = 0;
};
struct RemoteMr {
  uint64_t addr = 0, bytes = 0;
  uint32_t rkey = 0;
};

/// "" if the write [local_offset, +bytes) -> [remote_offset, +bytes) stays inside both data regions, else the
/// "remote access error: ..." text both verbs transports report as the request's error completion.
std::string check_write_bounds(const WorkRequest& in, const LocalMr& data, const RemoteMr& rdata);

/// Builds one send WR (and its SGE) from a proxy WorkRequest. Returns "" or why it cannot be posted (offsets outside
/// the registered regions). The immediate goes to the wire in network order.
std::string build_send_wr(const WorkRequest& in, const LocalMr& data, const LocalMr& scratch, const RemoteMr& rdata,
                          const RemoteMr& rctr, ibv_send_wr* wr, ibv_sge* sge);

/// The transport over a given VerbsOps (tests pass a fake).
std::unique_ptr<Transport> create_ibverbs_transport_with(const TransportContext& ctx, std::shared_ptr<VerbsOps> ops);

/// GID index from UCCL_MOE_IB_GID_INDEX ("auto" or an integer). auto picks a RoCE v2 GID by its type (ibv_query_gid_ex
/// or sysfs): IPv4-mapped first, then IPv6 ULA (fd00::/8), then another global IPv6; never a link-local or empty GID.
/// Nothing fits: throws Transport naming the knob and listing the GIDs seen.
int resolve_gid_index(VerbsOps& ops, ibv_context* ctx, uint8_t port, int gid_table_len, const std::string& knob);

}  // namespace uccl_moe::detail
