// ibverbs transport: RC queue pairs, one per (proxy thread, peer other than itself), on the device named by
// UCCL_MOE_IB_HCA (or the first with an active port). Writes are RDMA writes (with immediate for software ordering);
// counter adds use native fetch-and-add only when UCCL_MOE_IB_NATIVE_ATOMICS asks and the device has atomics (RC
// delivers in order, so the proxy needs no receiver reordering then).
#include <arpa/inet.h>

#include <cstring>
#include <deque>
#include <random>
#include <unordered_map>

#include "ibverbs_detail.hpp"
#include "transport/nic_select.hpp"
#include "post_queue.hpp"
#include "transport/gpu_mr.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kMagic = 0x49425631;  // "IBV1"
constexpr uint16_t kVersion = 1;
constexpr int kSendDepth = 256;  ///< send WRs in flight per QP
constexpr int kRecvDepth = 512;  ///< receive WRs per QP = Q of the sequence window argument (ordering.hpp)
}  // namespace

std::string encode_peer_info(const IbPeerInfo& in) {
  BlobWriter w(kMagic, kVersion);
  w.u32(in.lid).bytes(in.gid, 16).u32(in.mtu).u32(in.port);
  w.u64(in.data_addr).u64(in.data_bytes).u32(in.data_rkey).u64(in.ctr_addr).u64(in.ctr_bytes).u32(in.ctr_rkey);
  w.u32(uint32_t(in.qpn.size()));
  for (size_t i = 0; i < in.qpn.size(); ++i) w.u32(in.qpn[i]).u32(in.psn[i]);
  return w.data();
}

IbPeerInfo decode_peer_info(const std::string& blob) {
  BlobReader r(blob, kMagic, kVersion, "ibverbs");
  IbPeerInfo o;
  o.lid = r.u32();
  r.bytes(o.gid, 16);
  o.mtu = r.u32();
  o.port = r.u32();
  o.data_addr = r.u64();
  o.data_bytes = r.u64();
  o.data_rkey = r.u32();
  o.ctr_addr = r.u64();
  o.ctr_bytes = r.u64();
  o.ctr_rkey = r.u32();
  const uint32_t n = r.u32();
  if (n > 4096) UCCL_THROW(kTransport, "ibverbs blob names %u ranks", n);
  for (uint32_t i = 0; i < n; ++i) {
    o.qpn.push_back(r.u32());
    o.psn.push_back(r.u32());
  }
  if (!r.done()) UCCL_THROW(kTransport, "ibverbs blob has %zu trailing bytes", blob.size());
  return o;
}

QpTransition rc_init(uint8_t port, bool atomics) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = port;
  t.attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | (atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0);
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition rc_rtr(const IbPeerInfo& remote, int my_rank, uint8_t port, int gid_index, bool use_gid, uint8_t sl,
                    uint8_t traffic_class, ibv_mtu local_mtu, uint8_t max_dest_rd_atomic) {
  UCCL_CHECK_INTERNAL(my_rank >= 0 && size_t(my_rank) < remote.qpn.size(), "peer info lacks rank %d", my_rank);
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTR;
  t.attr.path_mtu = std::min(local_mtu, ibv_mtu(remote.mtu));
  t.attr.dest_qp_num = remote.qpn[size_t(my_rank)];
  t.attr.rq_psn = remote.psn[size_t(my_rank)];
  t.attr.max_dest_rd_atomic = max_dest_rd_atomic;
  t.attr.min_rnr_timer = 12;  // 0.64 ms
  t.attr.ah_attr.port_num = port;
  t.attr.ah_attr.sl = sl;
  if (use_gid) {
    t.attr.ah_attr.is_global = 1;
    std::memcpy(t.attr.ah_attr.grh.dgid.raw, remote.gid, 16);
    t.attr.ah_attr.grh.sgid_index = uint8_t(gid_index);
    t.attr.ah_attr.grh.hop_limit = 255;
    t.attr.ah_attr.grh.traffic_class = traffic_class;
  } else {
    t.attr.ah_attr.dlid = uint16_t(remote.lid);
  }
  t.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
           IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition rc_rts(uint32_t my_psn) { return rc_rts(my_psn, 14, 7, 16); }

QpTransition rc_rts(uint32_t my_psn, uint8_t timeout, uint8_t retry_cnt, uint8_t max_rd_atomic) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = my_psn;
  t.attr.timeout = timeout;  // 4.096 us * 2^timeout per retry (UCCL-EP ep/src/rdma.cpp uses 14 and retry_cnt 7)
  t.attr.retry_cnt = retry_cnt;
  t.attr.rnr_retry = 7;  // infinite: a full receive queue holds the sender
  t.attr.max_rd_atomic = max_rd_atomic;
  t.mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

RcParams resolve_rc_params(const ibv_device_attr& dev, bool roce, const std::string& dev_name) {
  RcParams p;
  // RoCE defaults as UCCL-EP ep/src/rdma.cpp sets them for RoCE QPs (SL 3, traffic class 104 = DSCP 26 << 2, the
  // class RoCE fabrics commonly run lossless/ECN); InfiniBand keeps SL 0 and no GRH traffic class.
  const std::string sl = env::IB_SL(), tc = env::IB_TC();
  p.sl = uint8_t(sl == "auto" ? (roce ? 3 : 0) : env::parse_int("IB_SL", sl, "0", "15"));
  p.traffic_class = uint8_t(tc == "auto" ? (roce ? 104 : 0) : env::parse_int("IB_TC", tc, "0", "255"));
  p.timeout = uint8_t(env::IB_TIMEOUT());
  p.retry_cnt = uint8_t(env::IB_RETRY_CNT());
  p.native_atomics = env::IB_NATIVE_ATOMICS();
  if (p.native_atomics && dev.atomic_cap == IBV_ATOMIC_NONE)
    UCCL_THROW(kInvalidUsage, "UCCL_MOE_IB_NATIVE_ATOMICS=1 but %s reports atomic_cap IBV_ATOMIC_NONE (no RDMA "
               "atomics; on bnxt_re they need PCIe AtomicOp routing); unset UCCL_MOE_IB_NATIVE_ATOMICS to use "
               "software atomics", dev_name.c_str());
  // man ibv_modify_qp: max_rd_atomic (initiator) <= max_qp_init_rd_atom, max_dest_rd_atomic (responder) <=
  // max_qp_rd_atom, else EINVAL. Software atomics issue no reads or atomics: one is enough (as UCCL-EP uses).
  const int want = p.native_atomics ? 16 : 1;
  p.max_rd_atomic = uint8_t(std::max(0, std::min(want, dev.max_qp_init_rd_atom)));
  p.max_dest_rd_atomic = uint8_t(std::max(0, std::min(want, dev.max_qp_rd_atom)));
  if (p.native_atomics && (p.max_rd_atomic == 0 || p.max_dest_rd_atomic == 0))
    UCCL_THROW(kInvalidUsage, "UCCL_MOE_IB_NATIVE_ATOMICS=1 but %s allows %d outstanding atomics per QP "
               "(max_qp_init_rd_atom %d, max_qp_rd_atom %d); unset UCCL_MOE_IB_NATIVE_ATOMICS", dev_name.c_str(),
               std::min(dev.max_qp_init_rd_atom, dev.max_qp_rd_atom), dev.max_qp_init_rd_atom, dev.max_qp_rd_atom);
  return p;
}

std::string check_device_limits(const ibv_device_attr& dev, int num_ranks, int num_threads, int send_depth,
                                int recv_depth) {
  // One QP per (thread, peer other than ourselves); one CQ per thread shared by its QPs (see IbverbsEndpoint).
  // Requests over these limits fail with a bare EINVAL/ENOMEM (man ibv_create_qp, man ibv_create_cq); say why first.
  const int64_t qps = int64_t(num_threads) * (num_ranks - 1);
  const int64_t cqe = int64_t(num_ranks - 1) * (send_depth + recv_depth);
  if (qps > dev.max_qp)
    return format("%lld QPs needed (%d proxy threads x %d peers) but the device allows max_qp=%d; use fewer proxy "
                  "threads (UCCL_MOE_PROXY_THREADS)", (long long)qps, num_threads, num_ranks - 1, dev.max_qp);
  if (cqe > dev.max_cqe)
    return format("a completion queue of %lld entries is needed (%d peers x %d) but the device allows max_cqe=%d",
                  (long long)cqe, num_ranks - 1, send_depth + recv_depth, dev.max_cqe);
  if (std::max(send_depth, recv_depth) > dev.max_qp_wr)
    return format("%d work requests per queue are needed but the device allows max_qp_wr=%d",
                  std::max(send_depth, recv_depth), dev.max_qp_wr);
  return "";
}

std::string nic_family(const std::string& dev_name, uint32_t vendor_id) {
  if (dev_name.rfind("bnxt_re", 0) == 0) return "bnxt_re";
  if (dev_name.rfind("mlx5", 0) == 0) return "mlx5";
  // Renamed devices (udev "rdmaN"): the vendor id. Broadcom's PCI id 0x14e4 (bnxt_re reports it); Mellanox's IEEE
  // OUI 0x02c9 (mlx5 reports it) and PCI id 0x15b3.
  if (vendor_id == 0x14e4) return "bnxt_re";
  if (vendor_id == 0x02c9 || vendor_id == 0x15b3) return "mlx5";
  return "other";
}

std::string check_write_bounds(const WorkRequest& in, const LocalMr& data, const RemoteMr& rdata) {
  if (in.local_offset + in.bytes <= data.bytes && in.remote_offset + in.bytes <= rdata.bytes) return "";
  return format("remote access error: %u bytes from local offset %llu (region %llu) to remote offset %llu (region "
                "%llu)", in.bytes, (unsigned long long)in.local_offset, (unsigned long long)data.bytes,
                (unsigned long long)in.remote_offset, (unsigned long long)rdata.bytes);
}

std::string build_send_wr(const WorkRequest& in, const LocalMr& data, const LocalMr& scratch, const RemoteMr& rdata,
                          const RemoteMr& rctr, ibv_send_wr* wr, ibv_sge* sge) {
  std::memset(wr, 0, sizeof *wr);
  std::memset(sge, 0, sizeof *sge);
  wr->wr_id = in.wr_id;
  wr->send_flags = IBV_SEND_SIGNALED;
  wr->sg_list = sge;
  if (in.op == WrOp::kAtomicAdd) {
    if ((uint64_t(in.counter_index) + 1) * 8 > rctr.bytes)
      return format("counter index %u outside the peer's %llu counter bytes", in.counter_index,
                    (unsigned long long)rctr.bytes);
    wr->opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr->wr.atomic.remote_addr = rctr.addr + uint64_t(in.counter_index) * 8;
    wr->wr.atomic.rkey = rctr.rkey;
    wr->wr.atomic.compare_add = uint64_t(in.add);
    sge->addr = scratch.addr;  // the fetched old value lands in our scratch
    sge->length = 8;
    sge->lkey = scratch.lkey;
    wr->num_sge = 1;
    return "";
  }
  if (std::string err = check_write_bounds(in, data, rdata); !err.empty()) return err;
  wr->opcode = in.op == WrOp::kWriteImm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  if (in.op == WrOp::kWriteImm) wr->imm_data = htonl(in.imm);
  wr->wr.rdma.remote_addr = rdata.addr + in.remote_offset;
  wr->wr.rdma.rkey = rdata.rkey;
  if (in.bytes) {
    sge->addr = data.addr + in.local_offset;
    sge->length = in.bytes;
    sge->lkey = data.lkey;
    wr->num_sge = 1;
  } else {
    wr->sg_list = nullptr;  // immediate-only message
    wr->num_sge = 0;
  }
  return "";
}

namespace {
std::string gid_text(const ibv_gid& g) {
  char buf[INET6_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET6, g.raw, buf, sizeof buf);
  return buf;
}
const char* gid_type_text(int rc, ibv_gid_type t) {
  if (rc != 0) return "type unknown";
  return t == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2" : t == IBV_GID_TYPE_ROCE_V1 ? "RoCE v1" : "IB";
}
}  // namespace

int resolve_gid_index(VerbsOps& ops, ibv_context* ctx, uint8_t port, int gid_table_len, const std::string& knob) {
  if (knob != "auto") return int(env::parse_int("IB_GID_INDEX", knob, "0", "255"));
  // Routed RoCE needs a RoCE v2 GID (UDP/IP encapsulation), told by its type (man ibv_query_gid_ex; sysfs
  // gid_attrs/types as UCCL-EP ep/include/rdma_util.hpp reads it), not by its address: a v1 entry carries the same
  // address. Preference as UCCL-EP (NCCL's rule): IPv4-mapped, then, on NICs whose GIDs are all IPv6 ULA (Broadcom
  // bnxt_re), a ULA fd00::/8 GID, then another global IPv6. Link-local fe80::/10 and empty GIDs never route.
  int best = -1, best_rank = 4;
  std::string seen;
  for (int i = 0; i < gid_table_len; ++i) {
    ibv_gid g;
    if (ops.query_gid(ctx, port, i, &g) != 0) continue;
    static const uint8_t kZero[16] = {0};
    if (std::memcmp(g.raw, kZero, 16) == 0) continue;  // unpopulated entry (not listed among the GIDs seen)
    ibv_gid_type type = IBV_GID_TYPE_IB;
    const int trc = ops.query_gid_type(ctx, port, i, &type);
    seen += format("%s[%d] %s (%s)", seen.empty() ? "" : ", ", i, gid_text(g).c_str(), gid_type_text(trc, type));
    if (trc != 0 || type != IBV_GID_TYPE_ROCE_V2) continue;
    const int rank = roce_gid_preference(g.raw);  // nic_select.hpp
    if (rank >= 0 && rank < best_rank) {
      best = i;
      best_rank = rank;
    }
  }
  if (best < 0)
    UCCL_THROW(kTransport, "ibverbs: no routable RoCE v2 GID on port %u (GIDs seen: %s); give the index of a RoCE v2 "
               "GID with an IPv4 or IPv6 address configured on the NIC's netdev in UCCL_MOE_IB_GID_INDEX (see "
               "show_gids or /sys/class/infiniband/<dev>/ports/%u/gid_attrs/types/)", unsigned(port),
               seen.empty() ? "none" : seen.c_str(), unsigned(port));
  return best;
}

namespace {

constexpr uint64_t kPeerMask = (1ull << 32) - 1;

class IbverbsTransport;

class IbverbsEndpoint : public Endpoint {
 public:
  IbverbsEndpoint(IbverbsTransport* t, int thread);
  ~IbverbsEndpoint() override;
  void connect(KvStore& store) override;
  void post(const WorkRequest& wr) override;
  int poll(std::vector<Completion>& out, int max) override;
  void flush() override;
  bool can_reach(int peer) const override { return peer >= 0 && size_t(peer) < connected_.size() && connected_[size_t(peer)]; }

 private:
  bool try_post(const WorkRequest& wr);
  void post_recvs(int peer, int n);
  IbverbsTransport* t_;
  int thread_;
  ibv_cq* cq_ = nullptr;
  std::vector<ibv_qp*> qps_;  ///< [peer]; nullptr for ourselves
  std::vector<uint32_t> psn_;
  std::vector<bool> connected_;
  std::vector<int> outstanding_;
  std::vector<RemoteMr> rdata_, rctr_;
  std::unordered_map<uint32_t, int> qpn_to_peer_;
  PostQueue queue_;
};

class IbverbsTransport : public Transport {
 public:
  IbverbsTransport(const TransportContext& ctx, std::shared_ptr<VerbsOps> ops) : ctx_(ctx), ops_(std::move(ops)) {
    port_ = uint8_t(env::IB_PORT());
    const NicChoice choice = choose_transport_nics(ctx_, NicFamily::kVerbs, ops_->device_names());  // nic_select.hpp
    for (const std::string& name : nic_open_order(choice)) {
      ibv_context* c = ops_->open_device(name);
      if (!c) continue;
      ibv_port_attr pa{};
      if (ops_->query_port(c, port_, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
        dev_ = c;
        dev_name_ = name;
        port_attr_ = pa;
        break;
      }
      ops_->close_device(c);
    }
    if (!dev_)
      UCCL_THROW(kTransport, "ibverbs: no device with an active port %u among [%s] (%s; UCCL_MOE_IB_HCA, "
                 "UCCL_MOE_IB_PORT)", unsigned(port_), join_names(nic_open_order(choice)).c_str(), choice.reason.c_str());
    nic_ = transport_nic(choice, dev_name_);
    if (int rc = ops_->query_device(dev_, &dev_attr_))
      UCCL_THROW(kTransport, "%s", verbs_error("ibv_query_device", rc).c_str());
    use_gid_ = port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET;
    family_ = nic_family(dev_name_, dev_attr_.vendor_id);
    rc_ = resolve_rc_params(dev_attr_, use_gid_, dev_name_);
    // Checked before any QP or CQ exists, so a job too large for the NIC fails here with the reason.
    if (std::string err = check_device_limits(dev_attr_, ctx_.num_ranks, ctx_.num_threads, kSendDepth, kRecvDepth);
        !err.empty())
      UCCL_THROW(kTransport, "ibverbs %s: %s", dev_name_.c_str(), err.c_str());
    // InfiniBand routes by LID inside a subnet (no GRH); RoCE needs a GID (resolve_gid_index).
    if (use_gid_) {
      gid_index_ = resolve_gid_index(*ops_, dev_, port_, port_attr_.gid_tbl_len, env::IB_GID_INDEX());
      if (int rc = ops_->query_gid(dev_, port_, gid_index_, &gid_))
        UCCL_THROW(kTransport, "%s (UCCL_MOE_IB_GID_INDEX=%d)", verbs_error("ibv_query_gid", rc).c_str(), gid_index_);
    }
    pd_ = ops_->alloc_pd(dev_);
    if (!pd_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_alloc_pd", 0).c_str());
    scratch_mr_ = ops_->reg_mr(pd_, scratch_, sizeof scratch_, IBV_ACCESS_LOCAL_WRITE);
    if (!scratch_mr_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_reg_mr(scratch)", 0).c_str());
    UCCL_LOG(INFO, NET, "ibverbs: %s (%s) port %u (%s, gid index %d, sl %u, tc %u, timeout %u, retry %u, %s atomics)",
             dev_name_.c_str(), family_.c_str(), unsigned(port_), use_gid_ ? "RoCE" : "IB", gid_index_,
             unsigned(rc_.sl), unsigned(rc_.traffic_class), unsigned(rc_.timeout), unsigned(rc_.retry_cnt),
             rc_.native_atomics ? "native" : "software");
  }
  ~IbverbsTransport() override {
    for (ibv_mr* mr : {data_mr_, ctr_mr_, scratch_mr_})
      if (mr) ops_->dereg_mr(mr);
    if (pd_) ops_->dealloc_pd(pd_);
    if (dev_) ops_->close_device(dev_);
  }
  const char* name() const override { return "ibverbs"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.native_atomics = rc_.native_atomics;
    c.ordered = true;
    c.recv_depth = uint32_t(kRecvDepth);
    c.nic_family = family_;
    return c;
  }
  void* allocate(MemoryKind, size_t) override { return nullptr; }
  void register_memory(MemoryKind kind, void* ptr, size_t bytes) override {
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                       (kind == MemoryKind::kCounters && rc_.native_atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0);
    ibv_mr* mr = nullptr;
    if (kind == MemoryKind::kData && ctx_.gpu) {
      // GPU mode: the data region is GPU memory (dma-buf first, then peer memory; gpu_mr.hpp).
      std::string method;
      mr = register_gpu_memory(*ops_, pd_, ptr, bytes, access, dmabuf_exporter(ctx_.gpu.get()), &method);
      UCCL_LOG(INFO, MEM, "ibverbs %s: GPU data region of %zu bytes registered by %s", dev_name_.c_str(), bytes,
               method.c_str());
    } else {
      mr = ops_->reg_mr(pd_, ptr, bytes, access);
      if (!mr) UCCL_THROW(kTransport, "ibverbs %s: %s for %zu bytes at %p", dev_name_.c_str(),
                          verbs_error("ibv_reg_mr", 0).c_str(), bytes, ptr);
    }
    (kind == MemoryKind::kData ? data_mr_ : ctr_mr_) = mr;
    LocalMr& l = kind == MemoryKind::kData ? data_ : ctr_;
    l.addr = uint64_t(reinterpret_cast<uintptr_t>(ptr));
    l.bytes = bytes;
    l.lkey = mr->lkey;
  }
  std::unique_ptr<Endpoint> create_endpoint(int thread_idx) override {
    return std::make_unique<IbverbsEndpoint>(this, thread_idx);
  }
  TransportNic nic() const override { return nic_; }

  TransportContext ctx_;
  std::shared_ptr<VerbsOps> ops_;
  ibv_context* dev_ = nullptr;
  std::string dev_name_, family_;
  ibv_device_attr dev_attr_{};
  TransportNic nic_;
  ibv_port_attr port_attr_{};
  uint8_t port_ = 1;
  bool use_gid_ = false;
  RcParams rc_;
  int gid_index_ = 0;
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  ibv_mr *data_mr_ = nullptr, *ctr_mr_ = nullptr, *scratch_mr_ = nullptr;
  alignas(64) uint64_t scratch_[8] = {0};
  LocalMr data_, ctr_;
};

IbverbsEndpoint::IbverbsEndpoint(IbverbsTransport* t, int thread) : t_(t), thread_(thread) {
  const int n = t_->ctx_.num_ranks, me = t_->ctx_.rank;
  connected_.assign(size_t(n), false);
  outstanding_.assign(size_t(n), 0);
  rdata_.resize(size_t(n));
  rctr_.resize(size_t(n));
  qps_.assign(size_t(n), nullptr);
  psn_.assign(size_t(n), 0);
  if (n == 1) return;  // no peers: no QPs, no CQ
  // Sized within max_cqe by check_device_limits: every QP's send and receive queue can complete at once.
  cq_ = t_->ops_->create_cq(t_->dev_, (n - 1) * (kSendDepth + kRecvDepth));
  if (!cq_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_create_cq", 0).c_str());
  std::mt19937 rng(uint32_t(me * 7919 + thread));
  for (int p = 0; p < n; ++p) {
    // No QP to ourselves: the proxy never sends to its own rank (barriers skip it, and the internode kernels address
    // every other rank only, internode.cu rdma_notify_kernel / rdma_post_kernel). Same-node peers do get QPs: the
    // notify kernel sends them its counts through the proxy too.
    if (p == me) continue;
    ibv_qp_init_attr a{};
    a.send_cq = cq_;
    a.recv_cq = cq_;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = kSendDepth;
    a.cap.max_recv_wr = kRecvDepth;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    ibv_qp* qp = t_->ops_->create_qp(t_->pd_, &a);
    if (!qp) UCCL_THROW(kTransport, "%s (peer %d)", verbs_error("ibv_create_qp", 0).c_str(), p);
    qps_[size_t(p)] = qp;
    QpTransition init = rc_init(t_->port_, t_->rc_.native_atomics);
    if (int rc = t_->ops_->modify_qp(qp, &init.attr, init.mask))
      UCCL_THROW(kTransport, "%s qp=%u peer=%d", verbs_error("ibv_modify_qp(INIT)", rc).c_str(), qp->qp_num, p);
    psn_[size_t(p)] = rng() & 0xFFFFFF;
    qpn_to_peer_[qp->qp_num] = p;
    post_recvs(p, kRecvDepth);
  }
}

IbverbsEndpoint::~IbverbsEndpoint() {
  for (ibv_qp* qp : qps_)
    if (qp) t_->ops_->destroy_qp(qp);
  if (cq_) t_->ops_->destroy_cq(cq_);
}

void IbverbsEndpoint::post_recvs(int peer, int n) {
  for (int i = 0; i < n; ++i) {
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = kRecvWrTag | uint64_t(peer);
    if (int rc = t_->ops_->post_recv(qps_[size_t(peer)], &wr, &bad))
      UCCL_THROW(kTransport, "%s peer=%d", verbs_error("ibv_post_recv", rc).c_str(), peer);
  }
}

void IbverbsEndpoint::connect(KvStore& store) {
  const TransportContext& c = t_->ctx_;
  IbPeerInfo me;
  me.lid = t_->port_attr_.lid;
  std::memcpy(me.gid, t_->gid_.raw, 16);
  me.mtu = t_->port_attr_.active_mtu;
  me.port = t_->port_;
  me.data_addr = t_->data_.addr;
  me.data_bytes = t_->data_.bytes;
  me.data_rkey = t_->data_mr_ ? t_->data_mr_->rkey : 0;
  me.ctr_addr = t_->ctr_.addr;
  me.ctr_bytes = t_->ctr_.bytes;
  me.ctr_rkey = t_->ctr_mr_ ? t_->ctr_mr_->rkey : 0;
  for (size_t p = 0; p < qps_.size(); ++p) {
    me.qpn.push_back(qps_[p] ? qps_[p]->qp_num : 0);
    me.psn.push_back(psn_[p]);
  }
  const std::string key = c.job + "/ibverbs/t" + std::to_string(thread_) + "/r";
  store.set(key + std::to_string(c.rank), encode_peer_info(me));
  for (int p = 0; p < c.num_ranks; ++p) {
    if (p == c.rank) continue;
    const IbPeerInfo r = decode_peer_info(store.get(key + std::to_string(p), c.timeout_s));
    if (r.qpn.size() != size_t(c.num_ranks))
      UCCL_THROW(kTransport, "ibverbs: rank %d published %zu QPs, expected %d", p, r.qpn.size(), c.num_ranks);
    const RcParams& rp = t_->rc_;
    QpTransition rtr = rc_rtr(r, c.rank, t_->port_, t_->gid_index_, t_->use_gid_, rp.sl, rp.traffic_class,
                              t_->port_attr_.active_mtu, rp.max_dest_rd_atomic);
    ibv_qp* qp = qps_[size_t(p)];
    if (int rc = t_->ops_->modify_qp(qp, &rtr.attr, rtr.mask))
      UCCL_THROW(kTransport, "%s qp=%u peer=%d", verbs_error("ibv_modify_qp(RTR)", rc).c_str(), qp->qp_num, p);
    QpTransition rts = rc_rts(psn_[size_t(p)], rp.timeout, rp.retry_cnt, rp.max_rd_atomic);
    if (int rc = t_->ops_->modify_qp(qp, &rts.attr, rts.mask))
      UCCL_THROW(kTransport, "%s qp=%u peer=%d", verbs_error("ibv_modify_qp(RTS)", rc).c_str(), qp->qp_num, p);
    rdata_[size_t(p)] = RemoteMr{r.data_addr, r.data_bytes, r.data_rkey};
    rctr_[size_t(p)] = RemoteMr{r.ctr_addr, r.ctr_bytes, r.ctr_rkey};
    connected_[size_t(p)] = true;
  }
}

bool IbverbsEndpoint::try_post(const WorkRequest& in) {
  if (outstanding_[size_t(in.peer)] >= kSendDepth) return false;
  ibv_send_wr wr, *bad = nullptr;
  ibv_sge sge;
  LocalMr scratch{uint64_t(reinterpret_cast<uintptr_t>(t_->scratch_)), sizeof t_->scratch_,
                  t_->scratch_mr_ ? t_->scratch_mr_->lkey : 0};
  std::string err = build_send_wr(in, t_->data_, scratch, rdata_[size_t(in.peer)], rctr_[size_t(in.peer)], &wr, &sge);
  if (err.empty()) {
    if (int rc = t_->ops_->post_send(qps_[size_t(in.peer)], &wr, &bad)) err = verbs_error("ibv_post_send", rc);
  }
  if (!err.empty()) {
    queue_.fail(in, std::move(err));
    return true;
  }
  ++outstanding_[size_t(in.peer)];
  return true;
}

void IbverbsEndpoint::post(const WorkRequest& wr) {
  if (!can_reach(wr.peer))
    UCCL_THROW(kTransport, "ibverbs: no connection to rank %d%s", wr.peer,
               wr.peer == t_->ctx_.rank ? " (this rank: the ibverbs transport has no QP to itself)" : "");
  queue_.post(wr, [this](const WorkRequest& w) { return try_post(w); });
}

void IbverbsEndpoint::flush() {
  queue_.flush([this](const WorkRequest& w) { return try_post(w); });
}

int IbverbsEndpoint::poll(std::vector<Completion>& out, int max) {
  const size_t start = out.size();
  ibv_wc wc[kPollBatch];
  int n = 0;  // work completions read into wc (a single rank has no CQ: only deferred errors)
  if (cq_)
    n = queue_.poll_cq(*t_->ops_, cq_, out, max, wc);
  else
    queue_.drain_errors(out, max);
  for (int i = 0; i < n; ++i) {
    Completion c;
    auto it = qpn_to_peer_.find(wc[i].qp_num);
    c.peer = it == qpn_to_peer_.end() ? -1 : it->second;
    c.wr_id = wc[i].wr_id;
    const bool recv = (wc[i].wr_id & kRecvWrTag) != 0;
    if (wc[i].status != IBV_WC_SUCCESS) {
      // man ibv_poll_cq: on a failed completion only wr_id, status, qp_num and vendor_err are valid (not opcode),
      // so a failed receive is known by its wr_id tag.
      c.kind = CompletionKind::kError;
      c.status = wc_error_status(wc[i]) + format(" peer=%d", c.peer);
      if (recv) {
        c.wr_id = ~0ull;  // a receive failed: not one of our commands
        c.status += " (receive)";
      } else if (c.peer >= 0) {
        --outstanding_[size_t(c.peer)];
      }
    } else if (recv) {
      if (wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM)
        UCCL_THROW(kTransport, "ibverbs: receive completion with opcode %d from rank %d (only writes with immediate "
                   "are expected)", int(wc[i].opcode), c.peer);
      c.kind = CompletionKind::kRecvImm;
      c.imm = ntohl(wc[i].imm_data);
      c.peer = int(wc[i].wr_id & kPeerMask);
      post_recvs(c.peer, 1);
    } else {
      c.kind = CompletionKind::kSend;
      if (c.peer >= 0) --outstanding_[size_t(c.peer)];
    }
    out.push_back(std::move(c));
  }
  flush();
  return int(out.size() - start);
}

}  // namespace

std::unique_ptr<Transport> create_ibverbs_transport_with(const TransportContext& ctx, std::shared_ptr<VerbsOps> ops) {
  return std::make_unique<IbverbsTransport>(ctx, std::move(ops));
}

std::unique_ptr<Transport> create_ibverbs_transport(const TransportContext& ctx) {
  return create_ibverbs_transport_with(ctx, ctx.verbs ? ctx.verbs : real_verbs_ops());
}

bool probe_ibverbs() {
  auto ops = real_verbs_ops();
  for (const std::string& name : ops->device_names()) {
    if (is_efa_device(name)) continue;  // EFA devices go to the efa transport
    ibv_context* c = ops->open_device(name);
    if (!c) continue;
    ibv_port_attr pa{};
    const bool up = ops->query_port(c, uint8_t(env::IB_PORT()), &pa) == 0 && pa.state == IBV_PORT_ACTIVE;
    ops->close_device(c);
    if (up) return true;
  }
  return false;
}

}  // namespace uccl_moe::detail
