// EFA transport: SRD queue pairs through efadv, one per proxy thread shared by all peers (SRD is connectionless;
// each peer gets an address handle). Every EFA device nic_select assigns to the GPU is opened (p5en: two) and proxy
// thread t uses device t % n, so the threads stripe the GPU's traffic over its devices. Writes are RDMA writes with
// immediate through the extended verbs API (EfaOps); there are no native atomics and SRD does not deliver in order,
// so the proxy uses software atomics and its ordering engine (which works per thread, so stripes never interact).
// Immediates land without a receive WR where the device offers unsolicited write-recv, otherwise in posted one-entry
// receives; they name their sender by (address-handle number, source QP). Device rules: efa_caps.cc; memory
// registration (dma-buf, chunks per max_mr_size): efa_reg.cc.
#include <arpa/inet.h>
#include <infiniband/efadv.h>

#include <algorithm>
#include <cstring>
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
constexpr uint64_t kRecvWrId = ~0ull;  ///< wr_id of our receive WRs (never a slot index)

class EfaTransport;

/// One opened EFA device: context, protection domain, capabilities, queue plan, and the data region's MRs on it (an
/// MR, a QP and an AH belong to one device; using them on another fails: efa_fake.hpp models the provider's rules).
struct EfaDevice {
  std::string name;
  uint32_t index = 0;  ///< position among the transport's devices; thread t uses device t % n
  ibv_context* ctx = nullptr;
  EfaDeviceCaps caps;
  EfaQueuePlan plan;
  ibv_gid gid{};
  ibv_pd* pd = nullptr;
  ibv_mr* scratch_mr = nullptr;
  EfaRegion data;  ///< empty until register_memory
  /// The one scatter entry of every posted receive (an RDMA write's immediate brings no payload into it).
  alignas(64) uint8_t scratch[64] = {0};
};

/// One proxy WorkRequest in flight, in a slot of the endpoint's fixed pool (its index is the wr_id of its pieces). A
/// write goes out as several pieces when it is longer than the device's max_rdma_size or crosses an MR chunk; the
/// piece carrying the immediate is posted only after the others landed (SRD does not order them), so the peer sees
/// the immediate only with all of the data. One completion is reported per request.
struct Pending {
  WorkRequest in;
  EfaWrPlan plan;       ///< built once, when the request is taken
  uint32_t sent = 0;    ///< bytes in posted pieces
  uint32_t posted = 0, done = 0;
  bool used = false;    ///< slot holds a request
  bool queued = false;  ///< in partial_ (pieces left to post)
  std::string error;
  bool more() const { return posted == 0 || sent < in.bytes; }
};

/// The next piece of a request: addresses, the keys of the chunks holding them, its length.
struct Piece {
  uint64_t laddr = 0, raddr = 0;
  uint32_t lkey = 0, rkey = 0, len = 0;
  bool last = false;
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
  void advance(uint32_t slot, Pending& p);
  std::string next_piece(const Pending& p, Piece* x) const;
  std::string post_piece(uint32_t slot, const Pending& p, const Piece& x);
  void on_piece_done(uint64_t wr_id, std::string error, std::vector<Completion>& out);
  void release(uint32_t slot);
  void post_recvs(uint32_t n);
  EfaTransport* t_;
  EfaDevice* dev_;  ///< the device this thread's QP lives on
  int thread_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_qp_ex* qpx_ = nullptr;
  std::vector<ibv_ah*> ahs_;
  std::vector<EfaPeerInfo> peers_;
  EfaPeerTable table_;
  uint32_t outstanding_ = 0;       ///< pieces posted and not completed (<= plan send_depth)
  std::vector<Pending> slots_;     ///< send_depth slots: every taken request has a piece in flight or is in partial_
  std::vector<uint32_t> free_;     ///< free slot indices (a stack)
  std::vector<uint32_t> partial_;  ///< slots with pieces still to post, oldest first (capacity reserved)
  PostQueue queue_;
};

class EfaTransport : public Transport {
 public:
  EfaTransport(const TransportContext& ctx, EfaOpsPair ops)
      : ctx_(ctx), ops_(std::move(ops.verbs)), efa_(std::move(ops.efa)) {
    // nic_select.hpp: the EFA devices nearest the GPU (p5en: two per GPU). Each chosen device that opens and is
    // usable gets a share of the proxy threads. An automatic choice that loses a device keeps the others (a warning:
    // that rank gets the bandwidth of fewer NICs), and falls back to the next closest device only when none of its
    // own opened; a device named in UCCL_MOE_IB_HCA that does not open is an error.
    const NicChoice choice = choose_transport_nics(ctx_, NicFamily::kEfa, ops_->device_names());
    const int share = (ctx_.num_threads + int(std::max<size_t>(1, choice.devices.size())) - 1) /
                      int(std::max<size_t>(1, choice.devices.size()));
    std::vector<std::string> failed;  // "name (why)"
    for (const std::string& name : choice.devices) open_device(name, share, &failed);
    if (!failed.empty() && choice.explicit_choice)
      UCCL_THROW(kTransport, "efa: UCCL_MOE_IB_HCA names %s for local rank %d, which cannot be used: %s (fix the name "
                 "or unset UCCL_MOE_IB_HCA for the automatic choice)", join_names(choice.devices).c_str(),
                 ctx_.local_rank, join_names(failed).c_str());
    const size_t own = devs_.size();
    for (size_t i = 0; devs_.empty() && i < choice.fallbacks.size(); ++i)
      open_device(choice.fallbacks[i], ctx_.num_threads, &failed);
    if (devs_.empty())
      UCCL_THROW(kTransport, "efa: no EFA device opened (%s%s%s; UCCL_MOE_IB_HCA)", choice.reason.c_str(),
                 failed.empty() ? "" : "; ", join_names(failed).c_str());
    nic_ = transport_nic(choice, devs_[0]->name);
    if (own == 0)
      UCCL_LOG(WARN, NET, "efa: local rank %d: none of its EFA devices is usable (%s); using %s", ctx_.local_rank,
               join_names(failed).c_str(), devs_[0]->name.c_str());
    if (own > 0 && own < choice.devices.size()) {
      std::vector<std::string> names;
      for (const auto& d : devs_) names.push_back(d->name);
      nic_.devices = names;
      nic_.reason += "; " + join_names(failed) + " not usable: using " + join_names(names);
      UCCL_LOG(WARN, NET, "efa: local rank %d uses %zu of its %zu EFA devices (%s not usable: %s); expect that share "
               "of the GPU's EFA bandwidth", ctx_.local_rank, own, choice.devices.size(), join_names(failed).c_str(),
               join_names(names).c_str());
    }
    // Threads per device decide the QP and CQ counts each device must hold.
    const size_t n = devs_.size();
    window_ = UINT32_MAX;
    for (size_t d = 0; d < n; ++d) {
      EfaDevice& dv = *devs_[d];
      dv.index = uint32_t(d);
      const int threads = (ctx_.num_threads - int(d) + int(n) - 1) / int(n);
      dv.plan = plan_efa_queues(dv.caps, dv.name, ctx_.num_ranks, std::max(1, threads));
      window_ = std::min(window_, dv.plan.window);
      UCCL_LOG(INFO, NET, "efa: %s (SRD, software atomics, %s receives, send %u / recv %u / cq %u, max write %u, "
               "sl %d, %d of %d proxy threads)", dv.name.c_str(), dv.plan.unsolicited ? "unsolicited" : "posted",
               dv.plan.send_depth, dv.plan.recv_depth, dv.plan.cqe, dv.plan.max_write_bytes, int(env::EFA_SL()),
               threads, ctx_.num_threads);
    }
  }
  ~EfaTransport() override {
    for (auto& d : devs_) {
      for (const GpuMrChunk& c : d->data.mrs)
        if (c.mr) ops_->dereg_mr(c.mr);
      if (d->scratch_mr) ops_->dereg_mr(d->scratch_mr);
      if (d->pd) ops_->dealloc_pd(d->pd);
      if (d->ctx) ops_->close_device(d->ctx);
    }
  }
  const char* name() const override { return "efa"; }
  TransportCaps caps() const override { return TransportCaps{false, false, window_}; }
  void* allocate(MemoryKind, size_t) override { return nullptr; }
  void register_memory(MemoryKind kind, void* ptr, size_t bytes) override {
    if (kind == MemoryKind::kCounters) return;  // counters are applied by our own proxy (no remote atomics)
    // On every device: an MR serves only the protection domain (so the device) it was registered with.
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    for (auto& d : devs_) {
      const uint64_t chunk = efa_chunk_bytes(d->caps.max_mr_size, bytes, d->name);
      d->data = register_efa_region(*ops_, d->pd, ptr, bytes, access, ctx_.gpu != nullptr, chunk,
                                    dmabuf_exporter(ctx_.gpu.get()), d->name);
      UCCL_LOG(INFO, MEM, "efa %s: %s data region of %zu bytes registered by %s as %zu MR(s) (max_mr_size %llu)",
               d->name.c_str(), ctx_.gpu ? "GPU" : "host", bytes, d->data.method.c_str(), d->data.mrs.size(),
               (unsigned long long)d->caps.max_mr_size);
    }
    data_addr_ = uint64_t(reinterpret_cast<uintptr_t>(ptr));
    data_bytes_ = bytes;
  }
  std::unique_ptr<Endpoint> create_endpoint(int thread_idx) override {
    return std::make_unique<EfaEndpoint>(this, thread_idx);
  }
  TransportNic nic() const override { return nic_; }
  EfaDevice& device_for(int thread) { return *devs_[size_t(thread) % devs_.size()]; }

  TransportContext ctx_;
  std::shared_ptr<VerbsOps> ops_;
  std::shared_ptr<EfaOps> efa_;
  std::vector<std::unique_ptr<EfaDevice>> devs_;
  TransportNic nic_;
  uint32_t window_ = 0;
  uint64_t data_addr_ = 0, data_bytes_ = 0;

 private:
  /// Opens `name` and checks it can serve `threads` QPs; on failure records "name (why)" and keeps nothing of it.
  void open_device(const std::string& name, int threads, std::vector<std::string>* failed) {
    auto d = std::make_unique<EfaDevice>();
    d->name = name;
    std::string why;
    try {
      d->ctx = ops_->open_device(name);
      if (!d->ctx) UCCL_THROW(kTransport, "%s", verbs_error("ibv_open_device", 0).c_str());
      ibv_port_attr pa{};
      if (int rc = ops_->query_port(d->ctx, 1, &pa))
        UCCL_THROW(kTransport, "%s", verbs_error("ibv_query_port", rc).c_str());
      if (pa.state != IBV_PORT_ACTIVE)
        UCCL_THROW(kTransport, "port 1 is %s, not ACTIVE", ibv_port_state_str(pa.state));
      if (std::string err = query_efa_caps(*ops_, *efa_, d->ctx, &d->caps); !err.empty())
        UCCL_THROW(kTransport, "%s", err.c_str());
      d->plan = plan_efa_queues(d->caps, name, ctx_.num_ranks, std::max(1, threads));
      if (int rc = ops_->query_gid(d->ctx, 1, 0, &d->gid))
        UCCL_THROW(kTransport, "%s", verbs_error("ibv_query_gid", rc).c_str());
      d->pd = ops_->alloc_pd(d->ctx);
      if (!d->pd) UCCL_THROW(kTransport, "%s", verbs_error("ibv_alloc_pd", 0).c_str());
      if (!d->plan.unsolicited) {
        d->scratch_mr = ops_->reg_mr(d->pd, d->scratch, sizeof d->scratch, IBV_ACCESS_LOCAL_WRITE);
        if (!d->scratch_mr) UCCL_THROW(kTransport, "%s", verbs_error("ibv_reg_mr(receive scratch)", 0).c_str());
      }
      devs_.push_back(std::move(d));
      return;
    } catch (const Error& e) {
      why = e.what();
    }
    if (d->pd) ops_->dealloc_pd(d->pd);
    if (d->ctx) ops_->close_device(d->ctx);
    UCCL_LOG(INFO, NET, "efa: %s is not usable: %s", name.c_str(), why.c_str());
    failed->push_back(name + " (" + why + ")");
  }
};

EfaEndpoint::EfaEndpoint(EfaTransport* t, int thread) : t_(t), dev_(&t->device_for(thread)), thread_(thread) {
  const EfaQueuePlan& plan = dev_->plan;
  cq_ = t_->ops_->create_cq(dev_->ctx, int(plan.cqe));
  if (!cq_) UCCL_THROW(kTransport, "%s (%s, %u entries, max_cqe %d)", verbs_error("ibv_create_cq", 0).c_str(),
                       dev_->name.c_str(), plan.cqe, dev_->caps.max_cqe);
  ibv_qp_init_attr_ex a{};
  a.send_cq = cq_;
  a.recv_cq = cq_;
  a.qp_type = IBV_QPT_DRIVER;
  a.cap.max_send_wr = plan.send_depth;
  a.cap.max_recv_wr = std::max(1u, plan.recv_depth);
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
  a.pd = dev_->pd;
  a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
  EfaQpInitAttr ea;
  ea.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
  ea.flags = plan.unsolicited ? kEfaQpFlagUnsolicitedWriteRecv : 0;
  // Low-latency SL 8 by default: libfabric prov/efa/src/efa_base_ep.c (FI_TC_LOW_LATENCY) and UCCL-EP
  // ep/src/rdma.cpp (use_ll_sl on p5/p5en/p6) set efadv_qp_init_attr.sl = 8.
  ea.sl = uint8_t(env::EFA_SL());
  qp_ = t_->efa_->create_srd_qp(dev_->ctx, &a, ea);
  if (!qp_)
    UCCL_THROW(kTransport, "%s (%s SRD QP, send %u recv %u, flags 0x%x, sl %u)",
               verbs_error("efadv_create_qp_ex", 0).c_str(), dev_->name.c_str(), plan.send_depth, plan.recv_depth,
               unsigned(ea.flags), unsigned(ea.sl));
  qpx_ = t_->efa_->qp_to_qp_ex(qp_);
  std::mt19937 rng(uint32_t(t_->ctx_.rank * 131 + thread));
  for (const QpTransition& tr : {srd_init(1, kQkey), srd_rtr(), srd_rts(rng() & 0xFFFFFF, plan.set_rnr_retry)}) {
    ibv_qp_attr attr = tr.attr;
    if (int rc = t_->ops_->modify_qp(qp_, &attr, tr.mask))
      UCCL_THROW(kTransport, "%s qp=%u state=%d", verbs_error("ibv_modify_qp", rc).c_str(), qp_->qp_num, int(tr.attr.qp_state));
  }
  if (!plan.unsolicited) post_recvs(plan.recv_depth);
  // The request pool: every request taken holds a piece in flight or waits in partial_, so send_depth slots suffice;
  // with none free a request waits in the backlog like one that finds the send queue full.
  slots_.resize(plan.send_depth);
  free_.reserve(plan.send_depth);
  for (uint32_t i = plan.send_depth; i-- > 0;) free_.push_back(i);
  partial_.reserve(plan.send_depth);
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
  ibv_sge sge{uint64_t(reinterpret_cast<uintptr_t>(dev_->scratch)), uint32_t(sizeof dev_->scratch),
              dev_->scratch_mr->lkey};
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
  std::memcpy(me.gid, dev_->gid.raw, 16);
  me.qpn = qp_->qp_num;
  me.qkey = kQkey;
  me.device = dev_->index;
  me.data_addr = t_->data_addr_;
  me.data_bytes = t_->data_bytes_;
  for (const GpuMrChunk& ch : dev_->data.mrs) me.chunks.push_back(RemoteMr{ch.addr, ch.bytes, ch.mr->rkey});
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
    // The AH lives on this thread's device (an AH of another device names nothing there: the efa device completes
    // such a send with LOCAL_ERROR_INVALID_AH, rdma-core providers/efa/efa_io_defs.h).
    ibv_ah* h = t_->efa_->create_ah(dev_->pd, &ah);
    if (!h) UCCL_THROW(kTransport, "%s peer=%d (%s)", verbs_error("ibv_create_ah", 0).c_str(), p, dev_->name.c_str());
    ahs_[size_t(p)] = h;
    efadv_ah_attr ea{};
    if (int rc = t_->efa_->query_ah(h, &ea)) UCCL_THROW(kTransport, "%s", verbs_error("efadv_query_ah", rc).c_str());
    table_.add(ea.ahn, r.qpn, p);
    peers_.push_back(std::move(r));
  }
}

std::string EfaEndpoint::next_piece(const Pending& p, Piece* x) const {
  const EfaPeerInfo& peer = peers_[size_t(p.in.peer)];
  const std::vector<LocalMr>& local = dev_->data.local;
  if (local.empty()) return "efa " + dev_->name + ": the data region is not registered";
  if (peer.chunks.empty()) return format("efa: peer %d published no data region", p.in.peer);
  x->laddr = p.plan.local_addr + p.sent;
  x->raddr = p.plan.remote_addr + p.sent;
  const uint32_t left = p.in.bytes - p.sent;
  // build_efa_wr checked the request against both regions, which the chunks tile; only a zero-byte write at the very
  // end of a region finds no chunk, and takes the last one's key (it touches no memory).
  const LocalMr* l = find_chunk(local, x->laddr);
  const RemoteMr* r = find_chunk(peer.chunks, x->raddr);
  if (!l) l = &local.back();
  if (!r) r = &peer.chunks.back();
  x->lkey = l->lkey;
  x->rkey = r->rkey;
  x->len = left == 0 ? 0 : next_piece_bytes(left, dev_->plan.max_write_bytes, *l, x->laddr, *r, x->raddr);
  x->last = p.sent + x->len == p.in.bytes;
  return "";
}

std::string EfaEndpoint::post_piece(uint32_t slot, const Pending& p, const Piece& x) {
  EfaOps& e = *t_->efa_;
  e.wr_start(qpx_);
  qpx_->wr_id = slot;
  qpx_->wr_flags = IBV_SEND_SIGNALED;
  if (x.last && p.plan.with_imm)  // the immediate rides on the last piece only
    e.wr_rdma_write_imm(qpx_, x.rkey, x.raddr, p.plan.imm_be);
  else
    e.wr_rdma_write(qpx_, x.rkey, x.raddr);
  // Always one scatter entry, zero bytes long for an immediate-only message (UCCL-EP ep/src/rdma.cpp posts a
  // zero-length entry; a write with no entry is not a documented efa send).
  e.wr_set_sge(qpx_, x.lkey, x.laddr, x.len);
  e.wr_set_ud_addr(qpx_, ahs_[size_t(p.in.peer)], p.plan.remote_qpn, p.plan.qkey);
  if (int rc = e.wr_complete(qpx_)) return verbs_error("ibv_wr_complete", rc);
  return "";
}

// Posts what `p` may post now: pieces while there is room, the last one once the others landed.
void EfaEndpoint::advance(uint32_t slot, Pending& p) {
  while (p.error.empty() && p.more() && outstanding_ < dev_->plan.send_depth) {
    Piece x;
    if (std::string err = next_piece(p, &x); !err.empty()) {
      p.error = std::move(err);
      break;
    }
    if (x.last && p.done < p.posted) break;
    if (std::string err = post_piece(slot, p, x); !err.empty()) {
      p.error = std::move(err);
      break;
    }
    p.sent += x.len;
    ++p.posted;
    ++outstanding_;
  }
}

void EfaEndpoint::release(uint32_t slot) {
  slots_[slot].used = false;
  free_.push_back(slot);
}

bool EfaEndpoint::try_post(const WorkRequest& in) {
  if (outstanding_ >= dev_->plan.send_depth || free_.empty()) return false;
  const EfaPeerInfo& peer = peers_[size_t(in.peer)];
  const LocalMr data{t_->data_addr_, t_->data_bytes_, dev_->data.local.empty() ? 0 : dev_->data.local[0].lkey};
  const RemoteMr rdata{peer.data_addr, peer.data_bytes, peer.chunks.empty() ? 0 : peer.chunks[0].rkey};
  const uint32_t slot = free_.back();
  Pending& p = slots_[slot];
  // The whole request is checked (atomics, region bounds) and planned once, before any piece goes out.
  if (std::string err = build_efa_wr(in, data, rdata, peer, &p.plan); !err.empty()) {
    queue_.fail(in, std::move(err));
    return true;
  }
  free_.pop_back();
  p.in = in;
  p.sent = p.posted = p.done = 0;
  p.used = true;
  p.queued = false;
  p.error.clear();
  advance(slot, p);
  if (!p.error.empty() && p.posted == p.done) {
    queue_.fail(in, p.error);
    release(slot);
  } else if (p.error.empty() && p.more()) {
    p.queued = true;
    partial_.push_back(slot);
  }
  return true;
}

void EfaEndpoint::post(const WorkRequest& wr) {
  UCCL_CHECK_INTERNAL(can_reach(wr.peer), "efa: post to unconnected peer %d", wr.peer);
  queue_.post(wr, [this](const WorkRequest& w) { return try_post(w); });
}

void EfaEndpoint::flush() {
  size_t keep = 0;
  for (size_t i = 0; i < partial_.size(); ++i) {
    const uint32_t slot = partial_[i];
    Pending& p = slots_[slot];
    if (outstanding_ < dev_->plan.send_depth) advance(slot, p);
    if (p.error.empty() && p.more()) {
      partial_[keep++] = slot;  // waits for room or for its earlier pieces to land
      continue;
    }
    p.queued = false;
    if (!p.error.empty() && p.posted == p.done) {
      queue_.fail(p.in, p.error);
      release(slot);
    }
  }
  partial_.resize(keep);
  queue_.flush([this](const WorkRequest& w) { return try_post(w); });
}

void EfaEndpoint::on_piece_done(uint64_t wr_id, std::string error, std::vector<Completion>& out) {
  UCCL_CHECK_INTERNAL(wr_id < slots_.size() && slots_[size_t(wr_id)].used,
                      "efa: completion for unknown work request slot %llu", (unsigned long long)wr_id);
  const uint32_t slot = uint32_t(wr_id);
  Pending& p = slots_[slot];
  --outstanding_;
  ++p.done;
  if (!error.empty() && p.error.empty()) p.error = std::move(error);
  if (p.done < p.posted || (p.error.empty() && p.more())) return;  // more pieces to land or to post
  Completion c;
  c.kind = p.error.empty() ? CompletionKind::kSend : CompletionKind::kError;
  c.wr_id = p.in.wr_id;
  c.peer = p.in.peer;
  c.status = p.error;
  out.push_back(std::move(c));
  if (p.queued) {
    partial_.erase(std::find(partial_.begin(), partial_.end(), slot));
    p.queued = false;
  }
  release(slot);
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
      if (!dev_->plan.unsolicited) post_recvs(1);
    } else {
      on_piece_done(wc[i].wr_id, std::string(), out);
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
