// Pure pieces of the EFA (SRD) transport, exposed for unit tests: exchange format, SRD QP transitions, the work-request
// plan posted through the extended verbs API, and the (address handle, QP number) -> rank lookup of receives.
#pragma once

#include <infiniband/verbs.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "efa_ops.hpp"
#include "transport/gpu_mr.hpp"
#include "transport/ibverbs/ibverbs_detail.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe::detail {

/// Blob "EFA1" version 2: gid 16 bytes, qpn u32, qkey u32, device u32 (index among the sender's opened devices, for
/// diagnostics), data region addr/bytes u64, chunk count u32, then per chunk addr u64, bytes u64, rkey u32. SRD is
/// connectionless: one QP per proxy thread serves every peer. Each thread's blob describes the device its QP lives
/// on (p5en: thread t on device t % 2), so the exchange carries every device's address and the rkeys of the data
/// region's MRs on that device (an MR belongs to one device's protection domain: ibv_reg_mr takes one ibv_pd;
/// aws-ofi-nccl's RDMA protocol, src/nccl_ofi_rdma.c, likewise keeps one MR per rail and sends every rail's key).
/// Several chunks when the region is larger than the device's max_mr_size (efa_reg.cc).
struct EfaPeerInfo {
  uint8_t gid[16] = {0};
  uint32_t qpn = 0, qkey = 0, device = 0;
  uint64_t data_addr = 0, data_bytes = 0;
  std::vector<RemoteMr> chunks;  ///< sorted by addr, contiguous, covering [data_addr, data_addr + data_bytes)
};
/// Most chunks a blob may list (a decode guard: 64 Ki chunks of even 2 MiB cover 128 GiB).
constexpr uint32_t kEfaMaxChunks = 1u << 16;
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
  uint64_t max_mr_size = 0;  ///< ibv_device_attr (the efa driver reports max_mr_pages x PAGE_SIZE)
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

/// The data region as registered on one device: its MRs (one, or chunks when the region is larger than the device's
/// max_mr_size) and, per MR, the local range and lkey the post path looks up.
struct EfaRegion {
  std::vector<GpuMrChunk> mrs;
  std::vector<LocalMr> local;  ///< parallel to mrs
  std::string method;          ///< "dma-buf", "peer memory (ibv_reg_mr)" or "host (ibv_reg_mr)"
};
/// Largest MR the region is cut into on a device whose ibv_device_attr.max_mr_size is `max_mr_size`: 0 (no chunking)
/// when the region fits or the device reports no limit, else max_mr_size rounded down to whole 2 MiB GPU pages.
/// Throws Transport when the device's limit is below one GPU page.
uint64_t efa_chunk_bytes(uint64_t max_mr_size, uint64_t region_bytes, const std::string& device);
/// Registers [ptr, ptr + bytes) on `pd`: GPU memory through gpu_mr (dma-buf, then peer memory; chunked when
/// chunk_bytes > 0), host memory through ibv_reg_mr (chunked the same way). Throws Transport naming the device and
/// what is missing; on failure nothing stays registered.
EfaRegion register_efa_region(VerbsOps& ops, ibv_pd* pd, void* ptr, uint64_t bytes, int access, bool gpu,
                              uint64_t chunk_bytes, const DmabufExport& export_fn, const std::string& device);

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
/// The registered chunk of `chunks` (sorted by addr, contiguous) that holds `addr`, or nullptr. No allocation.
template <typename Mr>
const Mr* find_chunk(const std::vector<Mr>& chunks, uint64_t addr) {
  auto it = std::upper_bound(chunks.begin(), chunks.end(), addr,
                             [](uint64_t a, const Mr& c) { return a < c.addr; });
  if (it == chunks.begin()) return nullptr;
  --it;
  return addr < it->addr + it->bytes ? &*it : nullptr;
}
/// Bytes of the next RDMA write of a request with `left` bytes to go from local `laddr` to remote `raddr`: at most
/// `max_piece` (the device's max_rdma_size) and inside one local and one remote chunk, since a write carries one lkey
/// and one rkey and each must cover its whole range (rdma-core providers/efa/efa_io_defs.h: "LKEY not registered or
/// does not match IOVA" fails the send).
inline uint32_t next_piece_bytes(uint32_t left, uint32_t max_piece, const LocalMr& l, uint64_t laddr,
                                 const RemoteMr& r, uint64_t raddr) {
  uint64_t n = std::min<uint64_t>(left, max_piece);
  n = std::min(n, l.addr + l.bytes - laddr);
  n = std::min(n, r.addr + r.bytes - raddr);
  return uint32_t(n);
}
/// The plan of a whole request, built once when it is posted: addresses, immediate, destination, and the keys of
/// `data` / `rdata` (a region's first chunk). Each piece offsets the addresses and takes its chunks' keys. Returns ""
/// or why the request cannot be posted (EFA has no native atomics; offsets outside the regions).
std::string build_efa_wr(const WorkRequest& in, const LocalMr& data, const RemoteMr& rdata, const EfaPeerInfo& peer,
                         EfaWrPlan* plan);

/// Receives name their sender by (address-handle number, source QP number): a sorted flat table, so the receive path
/// looks a sender up without allocating.
class EfaPeerTable {
 public:
  void add(uint16_t ahn, uint32_t qpn, int rank) {
    const Entry e{ahn, qpn, rank};
    auto it = std::lower_bound(t_.begin(), t_.end(), e, less);
    if (it != t_.end() && it->ahn == ahn && it->qpn == qpn)
      it->rank = rank;
    else
      t_.insert(it, e);
  }
  int lookup(uint16_t ahn, uint32_t qpn) const {
    const Entry e{ahn, qpn, -1};
    auto it = std::lower_bound(t_.begin(), t_.end(), e, less);
    return it != t_.end() && it->ahn == ahn && it->qpn == qpn ? it->rank : -1;
  }

 private:
  struct Entry {
    uint16_t ahn;
    uint32_t qpn;
    int rank;
  };
  static bool less(const Entry& a, const Entry& b) { return a.ahn != b.ahn ? a.ahn < b.ahn : a.qpn < b.qpn; }
  std::vector<Entry> t_;
};

}  // namespace uccl_moe::detail
