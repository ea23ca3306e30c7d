// EFA transport: SRD queue pairs through efadv, one per proxy thread shared by all peers (SRD is connectionless;
// each peer gets an address handle). Writes are RDMA writes with immediate through the extended verbs API (EfaOps);
// there are no native atomics and SRD does not deliver in order, so the proxy uses software atomics and its ordering
// engine. Immediates land without a receive WR where the device offers unsolicited write-recv, otherwise in posted
// one-entry receives; they name their sender by (address-handle number, source QP). Device rules: efa_caps.cc.
#include <arpa/inet.h>
#include <infiniband/efadv.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <random>

#include "efa_detail.hpp"
#include "transport/ibverbs/post_queue.hpp"
#include "transport/ibverbs/verbs_ops.hpp"
#include "transport/nic_select.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kQkey = 0x11111111;
constexpr uint64_t kRecvWrId = ~0ull;  ///< wr_id of our receive WRs (never a proxy wr_id)

class EfaTransport;

RemoteMr remote_data(const EfaPeerInfo& p) { return RemoteMr{p.data_addr, p.data_bytes, p.data_rkey}; }

/// One proxy WorkRequest in flight: a write longer than the device's max_rdma_size goes out as several pieces, and
/// the piece carrying the immediate is posted only after the others landed (SRD does not order them), so the peer
/// sees the immediate only with all of the data. One completion is reported per request.
struct Pending {
  WorkRequest in;
  uint32_t pieces = 1, posted = 0, done = 0;
  std::string error;
};

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
  void advance(uint64_t tag, Pending& p);
  void on_piece_done(uint64_t tag, std::string error, std::vector<Completion>& out);
  std::string post_piece(uint64_t tag, const Pending& p);
  void post_recvs(uint32_t n);
  EfaTransport* t_;
  int thread_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_qp_ex* qpx_ = nullptr;
  std::vector<ibv_ah*> ahs_;
  std::vector<EfaPeerInfo> peers_;
  EfaPeerTable table_;
  uint32_t outstanding_ = 0;     ///< pieces posted and not completed (<= plan send_depth)
  uint64_t next_tag_ = 0;
  std::map<uint64_t, Pending> pending_;
  std::deque<uint64_t> partial_;  ///< requests with pieces still to post, oldest first
  PostQueue queue_;
};

class EfaTransport : public Transport {
 public:
  EfaTransport(const TransportContext& ctx, EfaOpsPair ops)
      : ctx_(ctx), ops_(std::move(ops.verbs)), efa_(std::move(ops.efa)) {
    // nic_select.hpp: the EFA devices nearest the GPU (p5en: two per GPU). This transport opens the first that opens;
    // striping proxy threads over both is future work (docs/internode.md).
    const NicChoice choice = choose_transport_nics(ctx_, NicFamily::kEfa, ops_->device_names());
    for (const std::string& name : nic_open_order(choice)) {
      if ((dev_ = ops_->open_device(name))) {
        dev_name_ = name;
        break;
      }
    }
    if (!dev_) UCCL_THROW(kTransport, "efa: no EFA device opened (%s; UCCL_MOE_IB_HCA)", choice.reason.c_str());
    nic_ = transport_nic(choice, dev_name_);
    if (std::string err = query_efa_caps(*ops_, *efa_, dev_, &caps_); !err.empty())
      UCCL_THROW(kTransport, "efa %s: %s", dev_name_.c_str(), err.c_str());
    plan_ = plan_efa_queues(caps_, dev_name_, ctx.num_ranks, ctx.num_threads);
    if (ops_->query_gid(dev_, 1, 0, &gid_) != 0) UCCL_THROW(kTransport, "%s", verbs_error("ibv_query_gid", 0).c_str());
    pd_ = ops_->alloc_pd(dev_);
    if (!pd_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_alloc_pd", 0).c_str());
    if (!plan_.unsolicited) {
      scratch_mr_ = ops_->reg_mr(pd_, scratch_, sizeof scratch_, IBV_ACCESS_LOCAL_WRITE);
      if (!scratch_mr_) UCCL_THROW(kTransport, "%s", verbs_error("ibv_reg_mr(receive scratch)", 0).c_str());
    }
    UCCL_LOG(INFO, NET, "efa: %s (SRD, software atomics, %s receives, send %u / recv %u / cq %u, max write %u, sl %d)",
             dev_name_.c_str(), plan_.unsolicited ? "unsolicited" : "posted", plan_.send_depth, plan_.recv_depth,
             plan_.cqe, plan_.max_write_bytes, int(env::EFA_SL()));
  }
  ~EfaTransport() override {
    for (ibv_mr* mr : {data_mr_, scratch_mr_})
      if (mr) ops_->dereg_mr(mr);
    if (pd_) ops_->dealloc_pd(pd_);
    if (dev_) ops_->close_device(dev_);
  }
  const char* name() const override { return "efa"; }
  TransportCaps caps() const override { return TransportCaps{false, false, plan_.window}; }
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
  std::shared_ptr<EfaOps> efa_;
  ibv_context* dev_ = nullptr;
  std::string dev_name_;
  EfaDeviceCaps caps_;
  EfaQueuePlan plan_;
  TransportNic nic_;
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  ibv_mr *data_mr_ = nullptr, *scratch_mr_ = nullptr;
  /// The one scatter entry of every posted receive (an RDMA write's immediate brings no payload into it).
  alignas(64) uint8_t scratch_[64] = {0};
  LocalMr data_;
};

EfaEndpoint::EfaEndpoint(EfaTransport* t, int thread) : t_(t), thread_(thread) {
  const EfaQueuePlan& plan = t_->plan_;
  cq_ = t_->ops_->create_cq(t_->dev_, int(plan.cqe));
  if (!cq_) UCCL_THROW(kTransport, "%s (%u entries, max_cqe %d)", verbs_error("ibv_create_cq", 0).c_str(), plan.cqe,
                       t_->caps_.max_cqe);
  ibv_qp_init_attr_ex a{};
  a.send_cq = cq_;
  a.recv_cq = cq_;
  a.qp_type = IBV_QPT_DRIVER;
  a.cap.max_send_wr = plan.send_depth;
  a.cap.max_recv_wr = std::max(1u, plan.recv_depth);
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
  a.pd = t_->pd_;
  a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
  EfaQpInitAttr ea;
  ea.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
  ea.flags = plan.unsolicited ? kEfaQpFlagUnsolicitedWriteRecv : 0;
  // Low-latency SL 8 by default: libfabric prov/efa/src/efa_base_ep.c (FI_TC_LOW_LATENCY) and UCCL-EP
  // ep/src/rdma.cpp (use_ll_sl on p5/p5en/p6) set efadv_qp_init_attr.sl = 8.
  ea.sl = uint8_t(env::EFA_SL());
  qp_ = t_->efa_->create_srd_qp(t_->dev_, &a, ea);
  if (!qp_)
    UCCL_THROW(kTransport, "%s (SRD QP, send %u recv %u, flags 0x%x, sl %u)",
               verbs_error("efadv_create_qp_ex", 0).c_str(), plan.send_depth, plan.recv_depth, unsigned(ea.flags),
               unsigned(ea.sl));
  qpx_ = t_->efa_->qp_to_qp_ex(qp_);
  std::mt19937 rng(uint32_t(t_->ctx_.rank * 131 + thread));
  for (const QpTransition& tr : {srd_init(1, kQkey), srd_rtr(), srd_rts(rng() & 0xFFFFFF, plan.set_rnr_retry)}) {
    ibv_qp_attr attr = tr.attr;
    if (int rc = t_->ops_->modify_qp(qp_, &attr, tr.mask))
      UCCL_THROW(kTransport, "%s qp=%u state=%d", verbs_error("ibv_modify_qp", rc).c_str(), qp_->qp_num, int(tr.attr.qp_state));
  }
  if (!plan.unsolicited) post_recvs(plan.recv_depth);
}

EfaEndpoint::~EfaEndpoint() {
  for (ibv_ah* ah : ahs_)
    if (ah) t_->efa_->destroy_ah(ah);
  if (qp_) t_->ops_->destroy_qp(qp_);
  if (cq_) t_->ops_->destroy_cq(cq_);
}

// One scatter entry per receive: the efa provider writes a receive descriptor per scatter entry, so a zero-entry
// receive never reaches the device (rdma-core providers/efa/verbs.c efa_post_recv; UCCL-EP ep/src/rdma.cpp posts
// one-entry receives).
void EfaEndpoint::post_recvs(uint32_t n) {
  ibv_sge sge{uint64_t(reinterpret_cast<uintptr_t>(t_->scratch_)), uint32_t(sizeof t_->scratch_),
              t_->scratch_mr_->lkey};
  for (uint32_t i = 0; i < n; ++i) {
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = kRecvWrId;
    wr.sg_list = &sge;
    wr.num_sge = 1;
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
  // Our own rank gets an address handle too (one SRD QP serves every peer, so there is no extra QP): the proxy's
  // writes to itself loop back through the device (libfabric prov/efa/src/efa_shm.c: node-local traffic "can still
  // loopback over the EFA device"), which keeps GPU copies, and CUDA calls, out of the proxy thread.
  for (int p = 0; p < c.num_ranks; ++p) {
    EfaPeerInfo r = decode_efa_info(store.get(key + std::to_string(p), c.timeout_s));
    ibv_ah_attr ah{};
    ah.is_global = 1;
    ah.port_num = 1;
    std::memcpy(ah.grh.dgid.raw, r.gid, 16);
    ibv_ah* h = t_->efa_->create_ah(t_->pd_, &ah);
    if (!h) UCCL_THROW(kTransport, "%s peer=%d", verbs_error("ibv_create_ah", 0).c_str(), p);
    ahs_[size_t(p)] = h;
    efadv_ah_attr ea{};
    if (int rc = t_->efa_->query_ah(h, &ea)) UCCL_THROW(kTransport, "%s", verbs_error("efadv_query_ah", rc).c_str());
    table_.add(ea.ahn, r.qpn, p);
    peers_.push_back(r);
  }
}

std::string EfaEndpoint::post_piece(uint64_t tag, const Pending& p) {
  const uint32_t max_piece = t_->plan_.max_write_bytes;
  const bool last = p.posted + 1 == p.pieces;
  WorkRequest w = p.in;
  const uint64_t off = uint64_t(p.posted) * max_piece;
  w.local_offset += off;
  w.remote_offset += off;
  w.bytes = last ? uint32_t(p.in.bytes - off) : max_piece;
  if (!last) w.op = WrOp::kWrite;  // the immediate rides on the last piece only
  const EfaPeerInfo& peer = peers_[size_t(w.peer)];
  EfaWrPlan plan;
  if (std::string err = build_efa_wr(w, t_->data_, remote_data(peer), peer, &plan); !err.empty()) return err;
  EfaOps& e = *t_->efa_;
  e.wr_start(qpx_);
  qpx_->wr_id = tag;
  qpx_->wr_flags = IBV_SEND_SIGNALED;
  if (plan.with_imm)
    e.wr_rdma_write_imm(qpx_, plan.rkey, plan.remote_addr, plan.imm_be);
  else
    e.wr_rdma_write(qpx_, plan.rkey, plan.remote_addr);
  // Always one scatter entry, zero bytes long for an immediate-only message (UCCL-EP ep/src/rdma.cpp posts a
  // zero-length entry; a write with no entry is not a documented efa send).
  e.wr_set_sge(qpx_, plan.lkey, plan.local_addr, plan.length);
  e.wr_set_ud_addr(qpx_, ahs_[size_t(w.peer)], plan.remote_qpn, plan.qkey);
  if (int rc = e.wr_complete(qpx_)) return verbs_error("ibv_wr_complete", rc);
  return "";
}

// Posts what `p` may post now: every piece but the last while there is room, the last once the others landed.
void EfaEndpoint::advance(uint64_t tag, Pending& p) {
  while (p.error.empty() && p.posted < p.pieces && outstanding_ < t_->plan_.send_depth) {
    if (p.posted + 1 == p.pieces && p.done + 1 < p.pieces) break;
    if (std::string err = post_piece(tag, p); !err.empty()) {
      p.error = std::move(err);
      break;
    }
    ++p.posted;
    ++outstanding_;
  }
}

bool EfaEndpoint::try_post(const WorkRequest& in) {
  if (outstanding_ >= t_->plan_.send_depth) return false;
  const EfaPeerInfo& peer = peers_[size_t(in.peer)];
  EfaWrPlan whole;  // the whole request is checked (atomics, region bounds) before any piece goes out
  if (std::string err = build_efa_wr(in, t_->data_, remote_data(peer), peer, &whole); !err.empty()) {
    queue_.fail(in, std::move(err));
    return true;
  }
  const uint64_t tag = next_tag_++;
  Pending& p = pending_[tag];
  p.in = in;
  p.pieces = num_write_pieces(in.bytes, t_->plan_.max_write_bytes);
  advance(tag, p);
  if (!p.error.empty() && p.posted == p.done) {
    queue_.fail(in, p.error);
    pending_.erase(tag);
  } else if (p.posted < p.pieces && p.error.empty()) {
    partial_.push_back(tag);
  }
  return true;
}

void EfaEndpoint::post(const WorkRequest& wr) {
  UCCL_CHECK_INTERNAL(can_reach(wr.peer), "efa: post to unconnected peer %d", wr.peer);
  queue_.post(wr, [this](const WorkRequest& w) { return try_post(w); });
}

void EfaEndpoint::flush() {
  for (auto it = partial_.begin(); it != partial_.end() && outstanding_ < t_->plan_.send_depth;) {
    Pending& p = pending_.at(*it);
    advance(*it, p);
    if (p.error.empty() && p.posted < p.pieces) {
      ++it;  // waits for room or for its earlier pieces to land
      continue;
    }
    if (!p.error.empty() && p.posted == p.done) {
      queue_.fail(p.in, p.error);
      pending_.erase(*it);
    }
    it = partial_.erase(it);
  }
  queue_.flush([this](const WorkRequest& w) { return try_post(w); });
}

void EfaEndpoint::on_piece_done(uint64_t tag, std::string error, std::vector<Completion>& out) {
  auto it = pending_.find(tag);
  UCCL_CHECK_INTERNAL(it != pending_.end(), "efa: completion for unknown work request tag %llu",
                      (unsigned long long)tag);
  Pending& p = it->second;
  --outstanding_;
  ++p.done;
  if (!error.empty() && p.error.empty()) p.error = std::move(error);
  if (p.done < p.posted || (p.error.empty() && p.posted < p.pieces)) return;  // more pieces to land or to post
  if (p.error.empty() || p.done == p.posted) {
    Completion c;
    c.kind = p.error.empty() ? CompletionKind::kSend : CompletionKind::kError;
    c.wr_id = p.in.wr_id;
    c.peer = p.in.peer;
    c.status = p.error;
    out.push_back(std::move(c));
    for (auto q = partial_.begin(); q != partial_.end(); ++q)
      if (*q == tag) {
        partial_.erase(q);
        break;
      }
    pending_.erase(it);
  }
}

int EfaEndpoint::poll(std::vector<Completion>& out, int max) {
  const size_t start = out.size();
  ibv_wc wc[kPollBatch];
  const int n = queue_.poll_cq(*t_->ops_, cq_, out, max, wc);
  for (int i = 0; i < n; ++i) {
    // On a failed completion only wr_id, status, qp_num and vendor_err are valid (man ibv_poll_cq); never the opcode.
    if (wc[i].status != IBV_WC_SUCCESS) {
      if (wc[i].wr_id == kRecvWrId) UCCL_THROW(kTransport, "efa: receive %s", wc_error_status(wc[i]).c_str());
      on_piece_done(wc[i].wr_id, wc_error_status(wc[i]), out);
    } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      Completion c;
      c.kind = CompletionKind::kRecvImm;
      c.wr_id = wc[i].wr_id;
      c.imm = ntohl(wc[i].imm_data);
      c.peer = table_.lookup(uint16_t(wc[i].slid), wc[i].src_qp);  // EFA reports the sender's AH number in slid
      if (c.peer < 0)
        UCCL_THROW(kTransport, "efa: immediate from unknown sender (ahn %u, qpn %u)", unsigned(wc[i].slid), wc[i].src_qp);
      out.push_back(std::move(c));
      if (!t_->plan_.unsolicited) post_recvs(1);
    } else {
      on_piece_done(wc[i].wr_id, "", out);
    }
  }
  flush();
  return int(out.size() - start);
}

}  // namespace

std::unique_ptr<Transport> create_efa_transport_with(const TransportContext& ctx, EfaOpsPair ops) {
  return std::make_unique<EfaTransport>(ctx, std::move(ops));
}

std::unique_ptr<Transport> create_efa_transport(const TransportContext& ctx) {
  return create_efa_transport_with(ctx, resolve_efa_ops(ctx.verbs));
}

bool probe_efa() {
  const EfaOpsPair ops = resolve_efa_ops(nullptr);
  for (const std::string& name : ops.verbs->device_names())
    if (efa_device_usable(*ops.verbs, *ops.efa, name)) return true;
  return false;
}

}  // namespace uccl_moe::detail
