// EFA transport: SRD queue pairs through efadv, one per proxy thread shared by all peers (SRD is connectionless;
// each peer gets an address handle). Writes are RDMA writes with immediate through the extended verbs API; there are
// no native atomics and SRD does not deliver in order, so the proxy uses software atomics and its ordering engine.
// Receives consume posted receive WRs (kRecvDepth, the Q of the sequence window argument) and name their sender by
// (address-handle number, source QP).
#include <arpa/inet.h>
#include <infiniband/efadv.h>

#include <cstring>
#include <deque>

#include "efa_detail.hpp"
#include "transport/ibverbs/post_queue.hpp"
#include "transport/ibverbs/verbs_ops.hpp"
#include "transport/nic_select.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kMagic = 0x45464131;  // "EFA1"
constexpr uint16_t kVersion = 1;
constexpr uint32_t kQkey = 0x11111111;
constexpr int kSendDepth = 512;
constexpr int kRecvDepth = 1024;
}  // namespace

std::string encode_efa_info(const EfaPeerInfo& in) {
  BlobWriter w(kMagic, kVersion);
  w.bytes(in.gid, 16).u32(in.qpn).u32(in.qkey);
  w.u64(in.data_addr).u64(in.data_bytes).u32(in.data_rkey).u64(in.ctr_addr).u64(in.ctr_bytes).u32(in.ctr_rkey);
  return w.data();
}

EfaPeerInfo decode_efa_info(const std::string& blob) {
  BlobReader r(blob, kMagic, kVersion, "efa");
  EfaPeerInfo o;
  r.bytes(o.gid, 16);
  o.qpn = r.u32();
  o.qkey = r.u32();
  o.data_addr = r.u64();
  o.data_bytes = r.u64();
  o.data_rkey = r.u32();
  o.ctr_addr = r.u64();
  o.ctr_bytes = r.u64();
  o.ctr_rkey = r.u32();
  if (!r.done()) UCCL_THROW(kTransport, "efa blob has trailing bytes (%zu)", blob.size());
  return o;
}

QpTransition srd_init(uint8_t port, uint32_t qkey) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = port;
  t.attr.qkey = qkey;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
  return t;
}
QpTransition srd_rtr() {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTR;
  t.mask = IBV_QP_STATE;
  return t;
}
QpTransition srd_rts(uint32_t psn) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = psn;
  t.mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  return t;
}

std::string build_efa_wr(const WorkRequest& in, const LocalMr& data, const RemoteMr& rdata, const EfaPeerInfo& peer,
                         EfaWrPlan* p) {
  if (in.op == WrOp::kAtomicAdd) return "efa has no native atomics (the proxy emulates them with immediates)";
  if (std::string err = check_write_bounds(in, data, rdata); !err.empty()) return err;
  *p = EfaWrPlan{};
  p->wr_id = in.wr_id;
  p->with_imm = in.op == WrOp::kWriteImm;
  p->rkey = rdata.rkey;
  p->remote_addr = rdata.addr + in.remote_offset;
  p->imm_be = htonl(in.imm);
  p->lkey = data.lkey;
  p->local_addr = data.addr + in.local_offset;
  p->length = in.bytes;
  p->remote_qpn = peer.qpn;
  p->qkey = peer.qkey;
  return "";
}

namespace {

class EfaTransport;

class EfaEndpoint : public Endpoint {
 public:
  EfaEndpoint(EfaTransport* t, int thread);
  ~EfaEndpoint() override;
  void connect(KvStore& store) override;
  void post(const WorkRequest& wr) override;
  int poll(std::vector<Completion>& out, int max) override;
  void flush() override;
  bool can_reach(int peer) const override { return peer >= 0 && size_t(peer) < ahs_.size() && ahs_[size_t(peer)]; }

 private:
  bool try_post(const WorkRequest& wr);
  void post_recvs(int n);
  EfaTransport* t_;
  int thread_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_qp_ex* qpx_ = nullptr;
  std::vector<ibv_ah*> ahs_;
  std::vector<EfaPeerInfo> peers_;
  EfaPeerTable table_;
  int outstanding_ = 0;
  PostQueue queue_;
};

class EfaTransport : public Transport {
 public:
  explicit EfaTransport(const TransportContext& ctx) : ctx_(ctx), ops_(real_verbs_ops()) {
    // nic_select.hpp: the EFA devices nearest the GPU (p5en: two; TODO(i27-efa): stripe threads over nic_.devices).
    const NicChoice choice = choose_transport_nics(ctx_, NicFamily::kEfa, ops_->device_names());
    for (const std::string& name : nic_open_order(choice)) {
      if ((dev_ = ops_->open_device(name))) {
        dev_name_ = name;
        break;
      }
    }
    if (!dev_) UCCL_THROW(kTransport, "efa: no EFA device opened (%s; UCCL_MOE_IB_HCA)", choice.reason.c_str());
    nic_ = transport_nic(choice, dev_name_);
    if (ops_->query_gid(dev_, 1, 0, &gid_) != 0) UCCL_THROW(kTransport, "%s", verbs_error("ibv_query_gid", 0).c_str());
    pd_ = ops_->alloc_pd(dev_);
    if (!pd_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_alloc_pd", 0).c_str());
    UCCL_LOG(INFO, NET, "efa: %s (SRD, software atomics)", dev_name_.c_str());
  }
  ~EfaTransport() override {
    for (ibv_mr* mr : {data_mr_, ctr_mr_})
      if (mr) ops_->dereg_mr(mr);
    if (pd_) ops_->dealloc_pd(pd_);
    if (dev_) ops_->close_device(dev_);
  }
  const char* name() const override { return "efa"; }
  TransportCaps caps() const override { return TransportCaps{false, false, uint32_t(kRecvDepth)}; }
  void* allocate(MemoryKind, size_t) override { return nullptr; }
  void register_memory(MemoryKind kind, void* ptr, size_t bytes) override {
    if (kind == MemoryKind::kCounters) return;  // counters are applied by our own proxy (no remote atomics)
    data_mr_ = ops_->reg_mr(pd_, ptr, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!data_mr_) UCCL_THROW(kTransport, "efa %s: %s (%zu bytes)", dev_name_.c_str(), verbs_error("ibv_reg_mr", 0).c_str(), bytes);
    data_ = LocalMr{uint64_t(reinterpret_cast<uintptr_t>(ptr)), bytes, data_mr_->lkey};
  }
  std::unique_ptr<Endpoint> create_endpoint(int thread_idx) override {
    return std::make_unique<EfaEndpoint>(this, thread_idx);
  }
  TransportNic nic() const override { return nic_; }

  TransportContext ctx_;
  std::shared_ptr<VerbsOps> ops_;
  ibv_context* dev_ = nullptr;
  std::string dev_name_;
  TransportNic nic_;
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  ibv_mr *data_mr_ = nullptr, *ctr_mr_ = nullptr;
  LocalMr data_;
};

EfaEndpoint::EfaEndpoint(EfaTransport* t, int thread) : t_(t), thread_(thread) {
  cq_ = t_->ops_->create_cq(t_->dev_, kSendDepth + kRecvDepth);
  if (!cq_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_create_cq", 0).c_str());
  ibv_qp_init_attr_ex a{};
  a.send_cq = cq_;
  a.recv_cq = cq_;
  a.qp_type = IBV_QPT_DRIVER;
  a.cap.max_send_wr = kSendDepth;
  a.cap.max_recv_wr = kRecvDepth;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
  a.pd = t_->pd_;
  a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
  efadv_qp_init_attr ea{};
  ea.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
  qp_ = efadv_create_qp_ex(t_->dev_, &a, &ea, sizeof ea);
  if (!qp_) UCCL_THROW(kTransport, "%s (needs an EFA device with RDMA write)", verbs_error("efadv_create_qp_ex", 0).c_str());
  qpx_ = ibv_qp_to_qp_ex(qp_);
  std::srand(unsigned(t_->ctx_.rank * 131 + thread));
  for (const QpTransition& tr : {srd_init(1, kQkey), srd_rtr(), srd_rts(uint32_t(std::rand()) & 0xFFFFFF)}) {
    ibv_qp_attr attr = tr.attr;
    if (int rc = t_->ops_->modify_qp(qp_, &attr, tr.mask))
      UCCL_THROW(kTransport, "%s qp=%u state=%d", verbs_error("ibv_modify_qp", rc).c_str(), qp_->qp_num, int(tr.attr.qp_state));
  }
  post_recvs(kRecvDepth);
}

EfaEndpoint::~EfaEndpoint() {
  for (ibv_ah* ah : ahs_)
    if (ah) ibv_destroy_ah(ah);
  if (qp_) t_->ops_->destroy_qp(qp_);
  if (cq_) t_->ops_->destroy_cq(cq_);
}

void EfaEndpoint::post_recvs(int n) {
  for (int i = 0; i < n; ++i) {
    ibv_recv_wr wr{}, *bad = nullptr;
    if (int rc = t_->ops_->post_recv(qp_, &wr, &bad))
      UCCL_THROW(kTransport, "%s", verbs_error("ibv_post_recv", rc).c_str());
  }
}

void EfaEndpoint::connect(KvStore& store) {
  const TransportContext& c = t_->ctx_;
  EfaPeerInfo me;
  std::memcpy(me.gid, t_->gid_.raw, 16);
  me.qpn = qp_->qp_num;
  me.qkey = kQkey;
  me.data_addr = t_->data_.addr;
  me.data_bytes = t_->data_.bytes;
  me.data_rkey = t_->data_mr_ ? t_->data_mr_->rkey : 0;
  const std::string key = c.job + "/efa/t" + std::to_string(thread_) + "/r";
  store.set(key + std::to_string(c.rank), encode_efa_info(me));
  ahs_.assign(size_t(c.num_ranks), nullptr);
  for (int p = 0; p < c.num_ranks; ++p) {
    EfaPeerInfo r = decode_efa_info(store.get(key + std::to_string(p), c.timeout_s));
    ibv_ah_attr ah{};
    ah.is_global = 1;
    ah.port_num = 1;
    std::memcpy(ah.grh.dgid.raw, r.gid, 16);
    ibv_ah* h = ibv_create_ah(t_->pd_, &ah);
    if (!h) UCCL_THROW(kTransport, "%s peer=%d", verbs_error("ibv_create_ah", 0).c_str(), p);
    efadv_ah_attr ea{};
    if (int rc = efadv_query_ah(h, &ea, sizeof ea)) UCCL_THROW(kTransport, "%s", verbs_error("efadv_query_ah", rc).c_str());
    table_.add(ea.ahn, r.qpn, p);
    ahs_[size_t(p)] = h;
    peers_.push_back(r);
  }
}

bool EfaEndpoint::try_post(const WorkRequest& in) {
  if (outstanding_ >= kSendDepth) return false;
  EfaWrPlan p;
  std::string err = build_efa_wr(in, t_->data_, RemoteMr{peers_[size_t(in.peer)].data_addr,
                                 peers_[size_t(in.peer)].data_bytes, peers_[size_t(in.peer)].data_rkey},
                                 peers_[size_t(in.peer)], &p);
  if (err.empty()) {
    ibv_wr_start(qpx_);
    qpx_->wr_id = p.wr_id;
    qpx_->wr_flags = IBV_SEND_SIGNALED;
    if (p.with_imm)
      ibv_wr_rdma_write_imm(qpx_, p.rkey, p.remote_addr, p.imm_be);
    else
      ibv_wr_rdma_write(qpx_, p.rkey, p.remote_addr);
    if (p.length)
      ibv_wr_set_sge(qpx_, p.lkey, p.local_addr, p.length);
    else
      ibv_wr_set_sge_list(qpx_, 0, nullptr);
    ibv_wr_set_ud_addr(qpx_, ahs_[size_t(in.peer)], p.remote_qpn, p.qkey);
    if (int rc = ibv_wr_complete(qpx_)) err = verbs_error("ibv_wr_complete", rc);
  }
  if (!err.empty()) {
    queue_.fail(in, std::move(err));
    return true;
  }
  ++outstanding_;
  return true;
}

void EfaEndpoint::post(const WorkRequest& wr) {
  UCCL_CHECK_INTERNAL(can_reach(wr.peer), "efa: post to unconnected peer %d", wr.peer);
  queue_.post(wr, [this](const WorkRequest& w) { return try_post(w); });
}

void EfaEndpoint::flush() {
  queue_.flush([this](const WorkRequest& w) { return try_post(w); });
}

int EfaEndpoint::poll(std::vector<Completion>& out, int max) {
  const size_t start = out.size();
  ibv_wc wc[kPollBatch];
  const int n = queue_.poll_cq(*t_->ops_, cq_, out, max, wc);
  for (int i = 0; i < n; ++i) {
    Completion c;
    c.wr_id = wc[i].wr_id;
    if (wc[i].status != IBV_WC_SUCCESS) {
      c.kind = CompletionKind::kError;
      c.status = wc_error_status(wc[i]);
    } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      c.kind = CompletionKind::kRecvImm;
      c.imm = ntohl(wc[i].imm_data);
      c.peer = table_.lookup(uint16_t(wc[i].slid), wc[i].src_qp);  // EFA reports the sender's AH number in slid
      if (c.peer < 0)
        UCCL_THROW(kTransport, "efa: immediate from unknown sender (ahn %u, qpn %u)", unsigned(wc[i].slid), wc[i].src_qp);
      post_recvs(1);
    } else {
      c.kind = CompletionKind::kSend;
      --outstanding_;
    }
    out.push_back(std::move(c));
  }
  flush();
  return int(out.size() - start);
}

}  // namespace

std::unique_ptr<Transport> create_efa_transport(const TransportContext& ctx) { return std::make_unique<EfaTransport>(ctx); }

bool probe_efa() {
  for (const std::string& name : real_verbs_ops()->device_names())
    if (is_efa_device(name)) return true;
  return false;
}

}  // namespace uccl_moe::detail
