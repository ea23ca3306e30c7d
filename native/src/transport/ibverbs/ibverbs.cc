// ibverbs transport: RC queue pairs, one per (proxy thread, peer), on the device named by UCCL_MOE_IB_HCA (or the
// first with an active port). Writes are RDMA writes (with immediate for software ordering); counter adds use native
// fetch-and-add when the device has atomics (RC delivers in order, so the proxy needs no receiver reordering then).
#include <arpa/inet.h>

#include <cstring>
#include <deque>
#include <random>
#include <unordered_map>

#include "ibverbs_detail.hpp"
#include "transport/nic_select.hpp"
#include "post_queue.hpp"
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

QpTransition rc_init(uint8_t port) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = port;
  t.attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition rc_rtr(const IbPeerInfo& remote, int my_rank, uint8_t port, int gid_index, bool use_gid, uint8_t sl,
                    uint8_t traffic_class, ibv_mtu local_mtu) {
  UCCL_CHECK_INTERNAL(my_rank >= 0 && size_t(my_rank) < remote.qpn.size(), "peer info lacks rank %d", my_rank);
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTR;
  t.attr.path_mtu = std::min(local_mtu, ibv_mtu(remote.mtu));
  t.attr.dest_qp_num = remote.qpn[size_t(my_rank)];
  t.attr.rq_psn = remote.psn[size_t(my_rank)];
  t.attr.max_dest_rd_atomic = 16;
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

QpTransition rc_rts(uint32_t my_psn) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = my_psn;
  t.attr.timeout = 14;   // 4.096 us * 2^14 = 67 ms per retry
  t.attr.retry_cnt = 7;
  t.attr.rnr_retry = 7;  // infinite: a full receive queue holds the sender
  t.attr.max_rd_atomic = 16;
  t.mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
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

int resolve_gid_index(VerbsOps& ops, ibv_context* ctx, uint8_t port, int gid_table_len, const std::string& knob) {
  if (knob != "auto") return int(env::parse_int("IB_GID_INDEX", knob, "0", "255"));
  for (int i = 0; i < gid_table_len; ++i) {
    ibv_gid g;
    if (ops.query_gid(ctx, port, i, &g) != 0) continue;
    static const uint8_t kV4Mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (std::memcmp(g.raw, kV4Mapped, 12) == 0) return i;
  }
  return 0;
}

namespace {

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
  std::vector<ibv_qp*> qps_;
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
    ibv_device_attr da{};
    if (int rc = ops_->query_device(dev_, &da)) UCCL_THROW(kTransport, "%s", verbs_error("ibv_query_device", rc).c_str());
    native_atomics_ = da.atomic_cap != IBV_ATOMIC_NONE;
    use_gid_ = port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET;
    gid_index_ = resolve_gid_index(*ops_, dev_, port_, port_attr_.gid_tbl_len, env::IB_GID_INDEX());
    if (ops_->query_gid(dev_, port_, gid_index_, &gid_) != 0) std::memset(&gid_, 0, sizeof gid_);
    pd_ = ops_->alloc_pd(dev_);
    if (!pd_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_alloc_pd", 0).c_str());
    scratch_mr_ = ops_->reg_mr(pd_, scratch_, sizeof scratch_, IBV_ACCESS_LOCAL_WRITE);
    if (!scratch_mr_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_reg_mr(scratch)", 0).c_str());
    UCCL_LOG(INFO, NET, "ibverbs: %s port %u (%s, gid index %d, %s atomics)", dev_name_.c_str(), unsigned(port_),
             use_gid_ ? "RoCE" : "IB", gid_index_, native_atomics_ ? "native" : "no");
  }
  ~IbverbsTransport() override {
    for (ibv_mr* mr : {data_mr_, ctr_mr_, scratch_mr_})
      if (mr) ops_->dereg_mr(mr);
    if (pd_) ops_->dealloc_pd(pd_);
    if (dev_) ops_->close_device(dev_);
  }
  const char* name() const override { return "ibverbs"; }
  TransportCaps caps() const override { return TransportCaps{native_atomics_, true, uint32_t(kRecvDepth)}; }
  void* allocate(MemoryKind, size_t) override { return nullptr; }
  void register_memory(MemoryKind kind, void* ptr, size_t bytes) override {
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                       (kind == MemoryKind::kCounters ? IBV_ACCESS_REMOTE_ATOMIC : 0);
    ibv_mr* mr = ops_->reg_mr(pd_, ptr, bytes, access);
    if (!mr) UCCL_THROW(kTransport, "ibverbs %s: %s for %zu bytes at %p", dev_name_.c_str(),
                        verbs_error("ibv_reg_mr", 0).c_str(), bytes, ptr);
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
  std::string dev_name_;
  TransportNic nic_;
  ibv_port_attr port_attr_{};
  uint8_t port_ = 1;
  bool native_atomics_ = false, use_gid_ = false;
  int gid_index_ = 0;
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  ibv_mr *data_mr_ = nullptr, *ctr_mr_ = nullptr, *scratch_mr_ = nullptr;
  alignas(64) uint64_t scratch_[8] = {0};
  LocalMr data_, ctr_;
};

IbverbsEndpoint::IbverbsEndpoint(IbverbsTransport* t, int thread) : t_(t), thread_(thread) {
  const int n = t_->ctx_.num_ranks;
  cq_ = t_->ops_->create_cq(t_->dev_, n * (kSendDepth + kRecvDepth));
  if (!cq_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_create_cq", 0).c_str());
  std::mt19937 rng(uint32_t(t_->ctx_.rank * 7919 + thread));
  for (int p = 0; p < n; ++p) {
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
    QpTransition init = rc_init(t_->port_);
    if (int rc = t_->ops_->modify_qp(qp, &init.attr, init.mask))
      UCCL_THROW(kTransport, "%s qp=%u peer=%d", verbs_error("ibv_modify_qp(INIT)", rc).c_str(), qp->qp_num, p);
    qps_.push_back(qp);
    psn_.push_back(rng() & 0xFFFFFF);
    qpn_to_peer_[qp->qp_num] = p;
    post_recvs(p, kRecvDepth);
  }
  connected_.assign(size_t(n), false);
  outstanding_.assign(size_t(n), 0);
  rdata_.resize(size_t(n));
  rctr_.resize(size_t(n));
}

IbverbsEndpoint::~IbverbsEndpoint() {
  for (ibv_qp* qp : qps_) t_->ops_->destroy_qp(qp);
  if (cq_) t_->ops_->destroy_cq(cq_);
}

void IbverbsEndpoint::post_recvs(int peer, int n) {
  for (int i = 0; i < n; ++i) {
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = uint64_t(peer);
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
    me.qpn.push_back(qps_[p]->qp_num);
    me.psn.push_back(psn_[p]);
  }
  const std::string key = c.job + "/ibverbs/t" + std::to_string(thread_) + "/r";
  store.set(key + std::to_string(c.rank), encode_peer_info(me));
  for (int p = 0; p < c.num_ranks; ++p) {
    const IbPeerInfo r = decode_peer_info(store.get(key + std::to_string(p), c.timeout_s));
    if (r.qpn.size() != size_t(c.num_ranks))
      UCCL_THROW(kTransport, "ibverbs: rank %d published %zu QPs, expected %d", p, r.qpn.size(), c.num_ranks);
    QpTransition rtr = rc_rtr(r, c.rank, t_->port_, t_->gid_index_, t_->use_gid_, uint8_t(env::IB_SL()),
                              uint8_t(env::IB_TC()), t_->port_attr_.active_mtu);
    ibv_qp* qp = qps_[size_t(p)];
    if (int rc = t_->ops_->modify_qp(qp, &rtr.attr, rtr.mask))
      UCCL_THROW(kTransport, "%s qp=%u peer=%d", verbs_error("ibv_modify_qp(RTR)", rc).c_str(), qp->qp_num, p);
    QpTransition rts = rc_rts(psn_[size_t(p)]);
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
  UCCL_CHECK_INTERNAL(can_reach(wr.peer), "ibverbs: post to unconnected peer %d", wr.peer);
  queue_.post(wr, [this](const WorkRequest& w) { return try_post(w); });
}

void IbverbsEndpoint::flush() {
  queue_.flush([this](const WorkRequest& w) { return try_post(w); });
}

int IbverbsEndpoint::poll(std::vector<Completion>& out, int max) {
  const size_t start = out.size();
  ibv_wc wc[kPollBatch];
  const int n = queue_.poll_cq(*t_->ops_, cq_, out, max, wc);
  for (int i = 0; i < n; ++i) {
    Completion c;
    auto it = qpn_to_peer_.find(wc[i].qp_num);
    c.peer = it == qpn_to_peer_.end() ? -1 : it->second;
    c.wr_id = wc[i].wr_id;
    if (wc[i].status != IBV_WC_SUCCESS) {
      c.kind = CompletionKind::kError;
      c.status = wc_error_status(wc[i]);
      if (wc[i].opcode & IBV_WC_RECV) c.wr_id = ~0ull;  // a receive failed: not one of our commands
    } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      c.kind = CompletionKind::kRecvImm;
      c.imm = ntohl(wc[i].imm_data);
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
  return create_ibverbs_transport_with(ctx, real_verbs_ops());
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
