// A strict fake of an EFA NIC (rdma-core's efa provider + the efa kernel driver + SRD), implementing VerbsOps and
// EfaOps over an in-process fabric. Each rule it enforces is the provider's, cited next to it:
//   - receives: a receive WR takes a receive-queue slot, but only its scatter entries reach the device, so a
//     zero-entry receive is never consumed (a write-with-immediate finds "no receive" -> RNR);
//   - EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV only on devices that report the capability; with it, immediates consume
//     no receive;
//   - send-op flags against the capabilities (RDMA write needs EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE);
//   - queue depths, scatter entries, QPs, CQs, CQ entries and AHs against the device's attribute table;
//   - the attribute mask each SRD QP transition requires and allows (IBV_QP_RNR_RETRY only with the RNR-retry cap);
//   - writes longer than max_rdma_size fail; a full CQ overflows (poll_cq then fails);
//   - SRD delivery: work requests execute in a seeded random order among the first `reorder_window` pending ones, so
//     data lands and completions arrive out of order;
//   - RNR: a write-with-immediate without a receive retries; with rnr_retry 7 forever, else it fails after that many
//     retries (IBV_WC_RNR_RETRY_EXC_ERR);
//   - failed completions carry garbage in every field but wr_id, status, qp_num and vendor_err (man ibv_poll_cq);
//   - one host may expose several devices (p5en: 16), each with its own attributes, protection domain, AH numbers,
//     QPs, CQs and MRs; a resource of one device used with another's fails as on the device: a QP created with
//     another device's PD or CQ is refused, an lkey not registered on the sending device completes with
//     IBV_WC_LOC_PROT_ERR and an AH of another device with IBV_WC_LOC_QP_OP_ERR (rdma-core providers/efa/verbs.c maps
//     EFA_IO_COMP_STATUS_LOCAL_ERROR_INVALID_LKEY / _INVALID_AH so), an rkey not registered on the destination device
//     with IBV_WC_REM_ACCESS_ERR;
//   - memory registration: access flags beyond what the device supports are refused once the optional ones are
//     stripped (linux drivers/infiniband/hw/efa/efa_verbs.c efa_alloc_mr), an MR above max_mr_size fails (the
//     driver reports max_mr_size = max_mr_pages x PAGE_SIZE, efa_query_device), ibv_reg_mr of GPU memory fails with
//     EOPNOTSUPP without a peer-memory module (what p5en users without efa_nv_peermem see) and ibv_reg_dmabuf_mr
//     needs a dma-buf fd covering the range.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dmabuf_exporter.hpp"
#include "transport/efa/efa_ops.hpp"
#include "transport/gpu_mr.hpp"
#include "transport/ibverbs/verbs_ops.hpp"

namespace uccl_moe::test {

/// An EFA device's attributes (efadv_query_device + ibv_query_device) and firmware behaviour.
struct EfaProfile {
  std::string name = "rdmap0s0";
  uint32_t device_caps = 0;  ///< detail::kEfaCap*
  uint32_t max_sq_wr = 0, max_rq_wr = 0, max_rdma_size = 0;
  uint16_t max_sq_sge = 0, max_rq_sge = 0;
  int max_qp = 0, max_cq = 0, max_cqe = 0, max_qp_wr = 0, max_ah = 0;
  uint8_t default_rnr_retry = 7;  ///< what an SRD QP retries when RTS does not set IBV_QP_RNR_RETRY
  uint64_t max_mr_size = 0;       ///< ibv_device_attr.max_mr_size; 0 = no limit enforced
  bool dmabuf = true;             ///< ibv_reg_dmabuf_mr works (kernel >= 5.12, EFA driver with dma-buf)
  bool peer_memory = true;        ///< ibv_reg_mr accepts GPU memory (efa_nv_peermem loaded)
  bool opens = true;              ///< ibv_open_device succeeds (false: no userspace provider / a broken device)
  bool port_active = true;        ///< port 1 is ACTIVE
};

/// p5en's EFA (EFAv3). From public sources: RDMA read/write and unsolicited write-recv (UCCL-EP ep/src/rdma.cpp
/// creates its p5/p5en SRD QPs with RDMA write ops and EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV); max_sq_wr 4096
/// (measured on p5.48xlarge, kvcache-ai/Mooncake PR 3296); max_rdma_size 1 GiB (libfabric
/// prov/efa/docs/efa_rdm_protocol_v4.md, "RDMA write of a memory buffer up to 1GB"); rnr_retry 7 is the SRD default
/// (libfabric prov/efa/src/efa_base_ep.h, EFA_RNR_INFINITE_RETRY). Assumed: the RNR-retry capability (libfabric
/// sets IBV_QP_RNR_RETRY only where it is reported; the tests also run profiles without it). Not public, chosen
/// conservatively (likely smaller than the device reports): max_rq_wr 4096, 2 scatter entries per WR, 256 QPs and
/// CQs, 32768 CQ entries, 1024 address handles, max_mr_size 256 GiB (above any RDMA buffer; the chunking tests set
/// it small).
inline EfaProfile p5en_profile() {
  EfaProfile p;
  p.device_caps = detail::kEfaCapRdmaRead | detail::kEfaCapRnrRetry | detail::kEfaCapRdmaWrite |
                  detail::kEfaCapUnsolicitedWriteRecv;
  p.max_sq_wr = 4096;
  p.max_rq_wr = 4096;
  p.max_rdma_size = 1u << 30;
  p.max_sq_sge = 2;
  p.max_rq_sge = 2;
  p.max_qp = 256;
  p.max_cq = 256;
  p.max_cqe = 32768;
  p.max_qp_wr = 4096;
  p.max_ah = 1024;
  p.max_mr_size = 256ull << 30;
  return p;
}

/// The 16 EFA device names of tests/fixtures/sysfs/p5en (two behind each GPU's PCIe switch).
inline std::vector<std::string> p5en_efa_names() {
  std::vector<std::string> out;
  for (int base : {0x10, 0x20, 0x30, 0x40, 0x90, 0xa0, 0xb0, 0xc0})
    for (int k : {4, 5}) out.push_back("rdmap" + std::to_string(base + k) + "s0");
  return out;
}

/// A p5en host: `prof` under each of the 16 fixture names.
inline std::vector<EfaProfile> p5en_host(const EfaProfile& prof = p5en_profile()) {
  std::vector<EfaProfile> out;
  for (const std::string& n : p5en_efa_names()) {
    out.push_back(prof);
    out.back().name = n;
  }
  return out;
}

/// Shared by every fake NIC of a test: memory regions, QPs and the work requests in flight.
struct EfaFabric {
  explicit EfaFabric(uint64_t seed = 1, int reorder_window = 0) : rng(seed), reorder_window(reorder_window) {}
  std::mutex mu;
  std::mt19937_64 rng;
  int reorder_window;  ///< 0/1: in order; N: execute a random one of the first N pending work requests
  int steps_per_poll = 8;
  uint32_t next_qpn = 1, next_key = 1, next_gid = 1;
  struct Dev;
  struct Mr {
    uint64_t addr, len;
    int access;
    Dev* dev;
  };
  std::map<uint32_t, Mr> mrs;   // rkey -> region
  std::map<uint32_t, Mr> lmrs;  // lkey -> region
  std::map<int, uint64_t> dmabuf_fds;  ///< fd -> exported bytes (EfaExporter)
  struct DmabufReg {
    std::string dev;
    uint64_t offset, length, iova;
    int access;
  };
  std::vector<DmabufReg> dmabuf_regs;
  struct Cq {
    ibv_cq cq{};
    Dev* dev = nullptr;
    int cqe = 0;
    std::deque<ibv_wc> entries;
    bool overflowed = false;
  };
  struct Qp {
    ibv_qp_ex qpx{};
    Dev* dev = nullptr;
    Cq* cq = nullptr;
    ibv_qp_state state = IBV_QPS_RESET;
    std::vector<int> masks;
    bool rnr_set = false;
    uint8_t rnr_retry = 0;
    bool unsolicited = false;
    uint8_t sl = 0;
    uint64_t send_ops = 0;
    uint32_t max_send_wr = 0, max_recv_wr = 0, max_send_sge = 0, max_recv_sge = 0, qkey = 0;
    uint32_t sq_used = 0, rq_used = 0;
    std::deque<uint64_t> rq_visible;  // wr_ids of receives the device can use
    uint64_t num_zero_sge_recvs = 0;
    // The work request being built between wr_start and wr_complete.
    int session_err = 0;
    bool have_op = false, with_imm = false, have_sge = false, have_addr = false;
    uint32_t rkey = 0, lkey = 0, len = 0, imm_be = 0, dest_qpn = 0, dest_qkey = 0;
    uint64_t raddr = 0, laddr = 0;
    size_t num_sge = 0;
    ibv_gid dest_gid{};
    Dev* ah_dev = nullptr;
  };
  struct Ah {
    ibv_ah ah{};
    ibv_gid gid{};
    uint16_t ahn = 0;
    Dev* dev = nullptr;
  };
  struct Dev {
    EfaProfile prof;
    ibv_context ctx{};
    ibv_pd pd{};
    ibv_gid gid{};
    int num_qps = 0, num_cqs = 0, num_ahs = 0;
    std::map<std::string, uint16_t> ahn_of_gid;  // AH numbers are per device, per destination address
    uint64_t writes = 0, bytes = 0, imms_received = 0;  ///< work requests sent / bytes written from / immediates to it
  };
  struct Op {
    Qp* src;
    uint64_t wr_id;
    bool with_imm;
    uint32_t rkey, lkey, len, imm_be, dest_qpn, qkey;
    uint64_t raddr, laddr;
    ibv_gid dest_gid;
    Dev* ah_dev = nullptr;  ///< device of the address handle the send named
    int rnr_attempts = 0;
  };
  std::deque<Op> pending;
  std::map<uint32_t, Qp*> qps;  // qpn -> QP
  std::vector<std::unique_ptr<Dev>> devs;
  uint64_t executed = 0, out_of_order = 0, rnr_events = 0, max_write_seen = 0;

  static std::string key_of(const ibv_gid& g) { return std::string(reinterpret_cast<const char*>(g.raw), 16); }

  Dev* dev_of_gid(const ibv_gid& g) {
    for (auto& d : devs)
      if (std::memcmp(d->gid.raw, g.raw, 16) == 0) return d.get();
    return nullptr;
  }

  /// Adds a completion; a full CQ overflows (the kernel reports IBV_EVENT_CQ_ERR and the CQ is lost).
  void push(Cq* cq, const ibv_wc& wc) {
    if (int(cq->entries.size()) >= cq->cqe) {
      cq->overflowed = true;
      return;
    }
    cq->entries.push_back(wc);
  }

  /// A failed completion: garbage in every field the verbs do not define for errors.
  ibv_wc error_wc(uint64_t wr_id, uint32_t qpn, ibv_wc_status status, uint32_t vendor_err) {
    ibv_wc wc;
    std::memset(&wc, 0xA5, sizeof wc);
    wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;  // the worst garbage: looks like a received immediate
    wc.wr_id = wr_id;
    wc.status = status;
    wc.qp_num = qpn;
    wc.vendor_err = vendor_err;
    return wc;
  }

  /// Executes up to steps_per_poll pending work requests, SRD style (any order within the reorder window).
  void progress() {
    for (int step = 0; step < steps_per_poll && !pending.empty(); ++step) {
      const size_t window = reorder_window > 1 ? std::min(pending.size(), size_t(reorder_window)) : 1;
      const size_t idx = window > 1 ? size_t(rng() % window) : 0;
      if (idx > 0) ++out_of_order;
      Op op = pending[idx];
      pending.erase(pending.begin() + long(idx));
      if (!execute(op)) pending.push_back(op);  // RNR: retried later
    }
  }

  /// Returns false when the op must be retried (receiver not ready).
  bool execute(Op& op) {
    Qp& s = *op.src;
    const EfaProfile& prof = s.dev->prof;
    auto fail = [&](ibv_wc_status st, uint32_t vendor) {
      --s.sq_used;
      push(s.cq, error_wc(op.wr_id, s.qpx.qp_base.qp_num, st, vendor));
      return true;
    };
    if (op.len > prof.max_rdma_size) return fail(IBV_WC_LOC_LEN_ERR, 0x1);  // the device refuses it
    if (op.ah_dev && op.ah_dev != s.dev) return fail(IBV_WC_LOC_QP_OP_ERR, 0x7);  // LOCAL_ERROR_INVALID_AH
    // LOCAL_ERROR_INVALID_LKEY: "LKEY not registered or does not match IOVA" (rdma-core providers/efa/efa_io_defs.h).
    auto lmr = lmrs.find(op.lkey);
    if (lmr == lmrs.end() || lmr->second.dev != s.dev || op.laddr < lmr->second.addr ||
        op.laddr + op.len > lmr->second.addr + lmr->second.len)
      return fail(IBV_WC_LOC_PROT_ERR, 0x8);
    Dev* dd = dev_of_gid(op.dest_gid);
    auto qit = qps.find(op.dest_qpn);
    if (!dd || qit == qps.end() || qit->second->dev != dd) return fail(IBV_WC_REM_INV_RD_REQ_ERR, 0x2);
    Qp& d = *qit->second;
    if (d.state != IBV_QPS_RTR && d.state != IBV_QPS_RTS) return fail(IBV_WC_REM_INV_RD_REQ_ERR, 0x3);
    if (op.qkey != d.qkey) return fail(IBV_WC_REM_INV_RD_REQ_ERR, 0x4);
    auto mr = mrs.find(op.rkey);
    if (mr == mrs.end() || mr->second.dev != dd || op.raddr < mr->second.addr ||
        op.raddr + op.len > mr->second.addr + mr->second.len ||
        !(mr->second.access & IBV_ACCESS_REMOTE_WRITE))
      return fail(IBV_WC_REM_ACCESS_ERR, 0x5);
    uint64_t recv_wr_id = 0;
    if (op.with_imm && !d.unsolicited) {
      if (d.rq_visible.empty()) {
        ++rnr_events;
        const uint8_t retry = s.rnr_set ? s.rnr_retry : prof.default_rnr_retry;
        if (retry == 7 || op.rnr_attempts++ < retry) return false;
        return fail(IBV_WC_RNR_RETRY_EXC_ERR, 0x6);
      }
      recv_wr_id = d.rq_visible.front();
      d.rq_visible.pop_front();
      --d.rq_used;
    }
    if (op.len) std::memcpy(reinterpret_cast<void*>(op.raddr), reinterpret_cast<void*>(op.laddr), op.len);
    max_write_seen = std::max<uint64_t>(max_write_seen, op.len);
    ++executed;
    ++s.dev->writes;
    s.dev->bytes += op.len;
    if (op.with_imm) ++d.dev->imms_received;
    if (op.with_imm) {
      ibv_wc r{};
      r.wr_id = recv_wr_id;
      r.status = IBV_WC_SUCCESS;
      r.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
      r.wc_flags = IBV_WC_WITH_IMM;
      r.imm_data = op.imm_be;
      r.qp_num = d.qpx.qp_base.qp_num;
      r.src_qp = s.qpx.qp_base.qp_num;
      auto ahn = d.dev->ahn_of_gid.find(key_of(s.dev->gid));
      r.slid = ahn == d.dev->ahn_of_gid.end() ? 0xFFFF : ahn->second;  // the receiver's AH number for the sender
      push(d.cq, r);
    }
    ibv_wc w{};
    w.wr_id = op.wr_id;
    w.status = IBV_WC_SUCCESS;
    w.opcode = IBV_WC_RDMA_WRITE;
    w.qp_num = s.qpx.qp_base.qp_num;
    --s.sq_used;
    push(s.cq, w);
    return true;
  }
};

/// One host's EFA devices (one or several, e.g. p5en's 16) on `fabric`, implementing both halves of the seam. Every
/// call finds its device through the context, PD, CQ, QP or AH it is given; a null context means the first device
/// (the fake's own tests call it so).
class FakeEfaNic : public detail::VerbsOps, public detail::EfaOps {
 public:
  FakeEfaNic(std::shared_ptr<EfaFabric> f, EfaProfile prof) : FakeEfaNic(std::move(f), std::vector<EfaProfile>{prof}) {}
  FakeEfaNic(std::shared_ptr<EfaFabric> f, const std::vector<EfaProfile>& profs) : f_(std::move(f)) {
    std::lock_guard<std::mutex> l(f_->mu);
    for (const EfaProfile& prof : profs) {
      auto d = std::make_unique<EfaFabric::Dev>();
      d->prof = prof;
      d->gid.raw[0] = 0xfe;
      d->gid.raw[1] = 0x80;
      const uint32_t n = f_->next_gid++;
      std::memcpy(d->gid.raw + 12, &n, 4);
      d->pd.context = &d->ctx;
      devs_.push_back(d.get());
      f_->devs.push_back(std::move(d));
    }
  }
  EfaFabric::Dev& dev(size_t i = 0) { return *devs_.at(i); }
  EfaFabric::Dev& dev(const std::string& name) {
    for (EfaFabric::Dev* d : devs_)
      if (d->prof.name == name) return *d;
    throw std::runtime_error("no fake EFA device " + name);
  }
  EfaFabric::Cq* cq(ibv_cq* c) {
    for (auto& x : cqs_)
      if (&x->cq == c) return x.get();
    return nullptr;
  }
  EfaFabric::Qp* qp(ibv_qp* q) {
    std::lock_guard<std::mutex> l(f_->mu);
    return f_->qps.at(q->qp_num);
  }
  /// GPU-looking memory for the registration tests: ranges the fake treats as device memory.
  void mark_gpu(void* p, size_t bytes) { gpu_.mark(p, bytes); }

  // ---- VerbsOps ----
  std::vector<std::string> device_names() override {
    std::vector<std::string> out;
    for (EfaFabric::Dev* d : devs_) out.push_back(d->prof.name);
    return out;
  }
  ibv_context* open_device(const std::string& name) override {
    for (EfaFabric::Dev* d : devs_)
      if (d->prof.name == name) {
        if (!d->prof.opens) break;
        return &d->ctx;
      }
    errno = ENODEV;
    return nullptr;
  }
  int close_device(ibv_context*) override { return 0; }
  int query_device(ibv_context* c, ibv_device_attr* a) override {
    std::memset(a, 0, sizeof *a);
    const EfaProfile& p = of_ctx(c).prof;
    a->max_qp = p.max_qp;
    a->max_cq = p.max_cq;
    a->max_cqe = p.max_cqe;
    a->max_qp_wr = p.max_qp_wr;
    a->max_ah = p.max_ah;
    a->max_sge = p.max_sq_sge;
    a->max_mr_size = p.max_mr_size;
    a->atomic_cap = IBV_ATOMIC_NONE;  // EFA has no RDMA atomics
    return 0;
  }
  int query_port(ibv_context* c, uint8_t port, ibv_port_attr* a) override {
    std::memset(a, 0, sizeof *a);
    if (port != 1) return EINVAL;
    a->state = of_ctx(c).prof.port_active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
    a->gid_tbl_len = 1;
    return 0;
  }
  int query_gid(ibv_context* c, uint8_t port, int index, ibv_gid* g) override {
    if (port != 1 || index != 0) return EINVAL;
    *g = of_ctx(c).gid;
    return 0;
  }
  ibv_pd* alloc_pd(ibv_context* c) override { return &of_ctx(c).pd; }
  int dealloc_pd(ibv_pd*) override { return 0; }
  ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t len, int access) override {
    EfaFabric::Dev& d = of_pd(pd);
    if (!access_ok(d, access) || !size_ok(d, len)) return nullptr;
    if (gpu_.contains(addr) && !d.prof.peer_memory) {  // no efa_nv_peermem: the kernel cannot pin GPU pages
      errno = EOPNOTSUPP;
      return nullptr;
    }
    return add_mr(d, uint64_t(reinterpret_cast<uintptr_t>(addr)), len, access);
  }
  // man ibv_reg_dmabuf_mr: [offset, offset + length) of the dma-buf `fd`, mapped at `iova`.
  ibv_mr* reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) override {
    EfaFabric::Dev& d = of_pd(pd);
    if (!d.prof.dmabuf) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    if (!access_ok(d, access) || !size_ok(d, length)) return nullptr;
    {
      std::lock_guard<std::mutex> l(f_->mu);
      auto it = f_->dmabuf_fds.find(fd);
      if (it == f_->dmabuf_fds.end() || offset + length > it->second) {
        errno = EINVAL;
        return nullptr;
      }
      f_->dmabuf_regs.push_back({d.prof.name, offset, length, iova, access});
    }
    return add_mr(d, iova, length, access);
  }
  int dereg_mr(ibv_mr* mr) override {
    std::lock_guard<std::mutex> l(f_->mu);
    f_->mrs.erase(mr->rkey);
    f_->lmrs.erase(mr->lkey);
    return 0;
  }
  // linux drivers/infiniband/hw/efa/efa_verbs.c efa_create_cq: 1 <= entries <= max_cq_depth.
  ibv_cq* create_cq(ibv_context* c, int cqe) override {
    EfaFabric::Dev& d = of_ctx(c);
    std::lock_guard<std::mutex> l(f_->mu);
    if (cqe < 1 || cqe > d.prof.max_cqe || d.num_cqs >= d.prof.max_cq) {
      errno = EINVAL;
      return nullptr;
    }
    ++d.num_cqs;
    cqs_.push_back(std::make_unique<EfaFabric::Cq>());
    cqs_.back()->cqe = cqe;
    cqs_.back()->cq.cqe = cqe;
    cqs_.back()->cq.context = &d.ctx;
    cqs_.back()->dev = &d;
    return &cqs_.back()->cq;
  }
  int destroy_cq(ibv_cq*) override { return 0; }
  ibv_qp* create_qp(ibv_pd*, ibv_qp_init_attr*) override {
    errno = EOPNOTSUPP;  // SRD QPs come from efadv_create_qp_ex only
    return nullptr;
  }
  int destroy_qp(ibv_qp* q) override {
    std::lock_guard<std::mutex> l(f_->mu);
    f_->qps.erase(q->qp_num);
    return 0;
  }
  // The SRD state table of linux drivers/infiniband/hw/efa/efa_verbs.c (srd_qp_state_table, efa_modify_qp_validate).
  int modify_qp(ibv_qp* q, ibv_qp_attr* a, int mask) override {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = *f_->qps.at(q->qp_num);
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    const int supported = IBV_QP_STATE | IBV_QP_CUR_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY | IBV_QP_PKEY_INDEX |
                          IBV_QP_PORT | IBV_QP_QKEY | IBV_QP_SQ_PSN |
                          (s.dev->prof.device_caps & detail::kEfaCapRnrRetry ? IBV_QP_RNR_RETRY : 0);
    if (mask & ~supported) return EOPNOTSUPP;
    int req = 0, opt = 0;
    if (s.state == IBV_QPS_RESET && a->qp_state == IBV_QPS_INIT) {
      req = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
    } else if (s.state == IBV_QPS_INIT && a->qp_state == IBV_QPS_RTR) {
      opt = IBV_QP_PKEY_INDEX | IBV_QP_QKEY;
    } else if (s.state == IBV_QPS_RTR && a->qp_state == IBV_QPS_RTS) {
      req = IBV_QP_SQ_PSN;
      opt = IBV_QP_CUR_STATE | IBV_QP_QKEY | IBV_QP_RNR_RETRY;
    } else {
      return EINVAL;
    }
    if ((mask & req) != req || (mask & ~(req | opt | IBV_QP_STATE))) return EINVAL;
    if ((mask & IBV_QP_PORT) && a->port_num != 1) return EOPNOTSUPP;
    if ((mask & IBV_QP_PKEY_INDEX) && a->pkey_index != 0) return EOPNOTSUPP;
    if (mask & IBV_QP_QKEY) s.qkey = a->qkey;
    if (mask & IBV_QP_RNR_RETRY) {
      s.rnr_set = true;
      s.rnr_retry = a->rnr_retry;
    }
    s.state = a->qp_state;
    s.masks.push_back(mask);
    return 0;
  }
  int post_send(ibv_qp*, ibv_send_wr* wr, ibv_send_wr** bad) override {
    *bad = wr;  // SRD sends go through the ibv_wr_* API only
    return EOPNOTSUPP;
  }
  // rdma-core providers/efa/verbs.c efa_post_recv: state not RESET/ERR, num_sge <= max_sge, ENOMEM when the queue is
  // full; a descriptor is written per scatter entry, so a zero-entry WR takes a slot the device never fills.
  int post_recv(ibv_qp* q, ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = *f_->qps.at(q->qp_num);
    for (; wr; wr = wr->next) {
      if (s.state == IBV_QPS_RESET || s.state == IBV_QPS_ERR || uint32_t(wr->num_sge) > s.max_recv_sge) {
        *bad = wr;
        return EINVAL;
      }
      if (s.rq_used == s.max_recv_wr) {
        *bad = wr;
        return ENOMEM;
      }
      ++s.rq_used;
      if (wr->num_sge > 0)
        s.rq_visible.push_back(wr->wr_id);
      else
        ++s.num_zero_sge_recvs;
    }
    return 0;
  }
  int poll_cq(ibv_cq* ibcq, int num, ibv_wc* wc) override {
    std::lock_guard<std::mutex> l(f_->mu);
    f_->progress();
    EfaFabric::Cq* c = cq(ibcq);
    if (c->overflowed) return -EOVERFLOW;
    int n = 0;
    for (; n < num && !c->entries.empty(); ++n) {
      wc[n] = c->entries.front();
      c->entries.pop_front();
    }
    return n;
  }

  // ---- EfaOps ----
  int query_efa_device(ibv_context* c, efadv_device_attr* a) override {
    std::memset(a, 0, sizeof *a);
    const EfaProfile& p = of_ctx(c).prof;
    a->max_sq_wr = p.max_sq_wr;
    a->max_rq_wr = p.max_rq_wr;
    a->max_sq_sge = p.max_sq_sge;
    a->max_rq_sge = p.max_rq_sge;
    a->device_caps = p.device_caps;
    a->max_rdma_size = p.max_rdma_size;
    return 0;
  }
  // rdma-core providers/efa/verbs.c efa_check_qp_attr + efa_check_qp_limits; the PD and CQs must be the device's
  // (libibverbs hands the call to the provider of the context; a PD or CQ of another device is not its object).
  ibv_qp* create_srd_qp(ibv_context* c, ibv_qp_init_attr_ex* a, const detail::EfaQpInitAttr& e) override {
    EfaFabric::Dev& d = of_ctx(c);
    std::lock_guard<std::mutex> l(f_->mu);
    const EfaProfile& p = d.prof;
    uint64_t supp_ops = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
    uint16_t supp_flags = 0;
    if (p.device_caps & detail::kEfaCapRdmaRead) supp_ops |= IBV_QP_EX_WITH_RDMA_READ;
    if (p.device_caps & detail::kEfaCapRdmaWrite)
      supp_ops |= IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
    if (p.device_caps & detail::kEfaCapUnsolicitedWriteRecv) supp_flags |= detail::kEfaQpFlagUnsolicitedWriteRecv;
    auto bad = [](int e) -> ibv_qp* {
      errno = e;
      return nullptr;
    };
    if (a->qp_type != IBV_QPT_DRIVER || e.driver_qp_type != EFADV_QP_DRIVER_TYPE_SRD || e.comp_mask || e.reserved)
      return bad(EINVAL);
    if (e.flags & ~supp_flags) return bad(EOPNOTSUPP);
    if (a->comp_mask & ~uint32_t(IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)) return bad(EOPNOTSUPP);
    if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd) return bad(EINVAL);
    if ((a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) && (a->send_ops_flags & ~supp_ops)) return bad(EOPNOTSUPP);
    if (!a->send_cq || !a->recv_cq || a->srq) return bad(EINVAL);
    EfaFabric::Cq* scq = cq(a->send_cq);
    EfaFabric::Cq* rcq = cq(a->recv_cq);
    if (a->pd != &d.pd || !scq || !rcq || scq->dev != &d || rcq->dev != &d) return bad(EINVAL);
    if (a->cap.max_send_sge > p.max_sq_sge || a->cap.max_recv_sge > p.max_rq_sge || a->cap.max_send_wr > p.max_sq_wr ||
        a->cap.max_recv_wr > p.max_rq_wr)
      return bad(EINVAL);
    if (d.num_qps >= p.max_qp) return bad(ENOMEM);
    ++d.num_qps;
    auto q = std::make_unique<EfaFabric::Qp>();
    q->dev = &d;
    q->cq = scq;
    q->qpx.qp_base.qp_num = f_->next_qpn++;
    q->qpx.qp_base.qp_type = IBV_QPT_DRIVER;
    q->qpx.qp_base.context = &d.ctx;
    q->qpx.qp_base.pd = a->pd;
    q->unsolicited = (e.flags & detail::kEfaQpFlagUnsolicitedWriteRecv) != 0;
    q->sl = e.sl;
    q->send_ops = (a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) ? a->send_ops_flags : 0;
    q->max_send_wr = a->cap.max_send_wr;
    q->max_recv_wr = a->cap.max_recv_wr;
    q->max_send_sge = a->cap.max_send_sge;
    q->max_recv_sge = a->cap.max_recv_sge;
    f_->qps[q->qpx.qp_base.qp_num] = q.get();
    qps_.push_back(std::move(q));
    return &qps_.back()->qpx.qp_base;
  }
  ibv_qp_ex* qp_to_qp_ex(ibv_qp* q) override { return &qp(q)->qpx; }
  void wr_start(ibv_qp_ex* x) override {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = of(x);
    s.session_err = 0;
    s.have_op = s.have_sge = s.have_addr = false;
  }
  void wr_rdma_write(ibv_qp_ex* x, uint32_t rkey, uint64_t raddr) override { set_op(x, false, rkey, raddr, 0); }
  void wr_rdma_write_imm(ibv_qp_ex* x, uint32_t rkey, uint64_t raddr, __be32 imm) override {
    set_op(x, true, rkey, raddr, imm);
  }
  void wr_set_sge(ibv_qp_ex* x, uint32_t lkey, uint64_t addr, uint32_t len) override {
    ibv_sge s{addr, len, lkey};
    wr_set_sge_list(x, 1, &s);
  }
  void wr_set_sge_list(ibv_qp_ex* x, size_t n, const ibv_sge* sg) override {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = of(x);
    // efa_send_wr_set_sge_list: more entries than the QP's max_send_sge fail the session. A write with no entry at
    // all is not a documented efa send (UCCL-EP posts a zero-length entry instead); the fake refuses it too, a
    // conservative choice rather than a provider rule.
    if (n == 0 || n > s.max_send_sge) {
      s.session_err = EINVAL;
      return;
    }
    s.have_sge = true;
    s.num_sge = n;
    s.lkey = sg[0].lkey;
    s.laddr = sg[0].addr;
    s.len = sg[0].length;
  }
  void wr_set_ud_addr(ibv_qp_ex* x, ibv_ah* ah, uint32_t qpn, uint32_t qkey) override {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = of(x);
    auto it = ahs_by_ptr_.find(ah);
    if (it == ahs_by_ptr_.end()) {
      s.session_err = EINVAL;
      return;
    }
    s.have_addr = true;
    s.dest_gid = it->second->gid;
    s.ah_dev = it->second->dev;
    s.dest_qpn = qpn;
    s.dest_qkey = qkey;
  }
  int wr_complete(ibv_qp_ex* x) override {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = of(x);
    if (s.session_err) return s.session_err;
    if (s.state != IBV_QPS_RTS || !s.have_op || !s.have_sge || !s.have_addr) return EINVAL;
    if (s.sq_used >= s.max_send_wr) return ENOMEM;
    ++s.sq_used;
    EfaFabric::Op op{&s, x->wr_id, s.with_imm, s.rkey, s.lkey, s.len, s.imm_be, s.dest_qpn, s.dest_qkey, s.raddr,
                     s.laddr, s.dest_gid, s.ah_dev};
    f_->pending.push_back(op);
    return 0;
  }
  ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* a) override {
    EfaFabric::Dev& d = of_pd(pd);
    std::lock_guard<std::mutex> l(f_->mu);
    if (!a->is_global || a->port_num != 1 || d.num_ahs >= d.prof.max_ah) {
      errno = EINVAL;
      return nullptr;
    }
    ++d.num_ahs;
    auto h = std::make_unique<EfaFabric::Ah>();
    h->gid = a->grh.dgid;
    h->dev = &d;
    h->ah.pd = pd;
    h->ah.context = &d.ctx;
    const std::string k = EfaFabric::key_of(h->gid);
    auto it = d.ahn_of_gid.find(k);
    h->ahn = it != d.ahn_of_gid.end() ? it->second : uint16_t(d.ahn_of_gid.size() + 1);
    d.ahn_of_gid[k] = h->ahn;
    ahs_by_ptr_[&h->ah] = h.get();
    ahs_.push_back(std::move(h));
    return &ahs_.back()->ah;
  }
  int destroy_ah(ibv_ah*) override { return 0; }
  int query_ah(ibv_ah* ah, efadv_ah_attr* a) override {
    std::lock_guard<std::mutex> l(f_->mu);
    auto it = ahs_by_ptr_.find(ah);
    if (it == ahs_by_ptr_.end()) return EINVAL;
    std::memset(a, 0, sizeof *a);
    a->ahn = it->second->ahn;
    return 0;
  }

 private:
  EfaFabric::Qp& of(ibv_qp_ex* x) { return *f_->qps.at(x->qp_base.qp_num); }
  EfaFabric::Dev& of_ctx(ibv_context* c) {
    if (!c) return *devs_.at(0);
    for (EfaFabric::Dev* d : devs_)
      if (&d->ctx == c) return *d;
    throw std::runtime_error("fake EFA: a context of another host");
  }
  EfaFabric::Dev& of_pd(ibv_pd* pd) {
    for (EfaFabric::Dev* d : devs_)
      if (&d->pd == pd) return *d;
    throw std::runtime_error("fake EFA: a protection domain of another host");
  }
  // linux drivers/infiniband/hw/efa/efa_verbs.c efa_alloc_mr: the optional flags (relaxed ordering) are dropped, the
  // rest must be local write, remote read with the RDMA-read cap, remote write with the RDMA-write cap.
  static bool access_ok(const EfaFabric::Dev& d, int access) {
    int supported = IBV_ACCESS_LOCAL_WRITE;
    if (d.prof.device_caps & detail::kEfaCapRdmaRead) supported |= IBV_ACCESS_REMOTE_READ;
    if (d.prof.device_caps & detail::kEfaCapRdmaWrite) supported |= IBV_ACCESS_REMOTE_WRITE;
    if ((access & ~int(IBV_ACCESS_OPTIONAL_RANGE)) & ~supported) {
      errno = EOPNOTSUPP;
      return false;
    }
    return true;
  }
  // The driver reports max_mr_size = max_mr_pages x PAGE_SIZE (efa_query_device); the device refuses larger MRs.
  static bool size_ok(const EfaFabric::Dev& d, uint64_t len) {
    if (d.prof.max_mr_size && len > d.prof.max_mr_size) {
      errno = EINVAL;
      return false;
    }
    return true;
  }
  ibv_mr* add_mr(EfaFabric::Dev& d, uint64_t addr, size_t len, int access) {
    auto mr = std::make_unique<ibv_mr>();
    std::lock_guard<std::mutex> l(f_->mu);
    mr->addr = reinterpret_cast<void*>(addr);
    mr->length = len;
    mr->pd = &d.pd;
    mr->context = &d.ctx;
    mr->lkey = f_->next_key++;
    mr->rkey = f_->next_key++;
    f_->mrs[mr->rkey] = {addr, len, access, &d};
    f_->lmrs[mr->lkey] = {addr, len, access, &d};
    mrs_.push_back(std::move(mr));
    return mrs_.back().get();
  }
  // efa_qp_fill_wr_pfns installs only the send ops named in send_ops_flags; the fake fails the session instead.
  void set_op(ibv_qp_ex* x, bool imm, uint32_t rkey, uint64_t raddr, uint32_t imm_be) {
    std::lock_guard<std::mutex> l(f_->mu);
    EfaFabric::Qp& s = of(x);
    const uint64_t need = imm ? IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM : IBV_QP_EX_WITH_RDMA_WRITE;
    if (!(s.send_ops & need)) {
      s.session_err = EOPNOTSUPP;
      return;
    }
    s.have_op = true;
    s.with_imm = imm;
    s.rkey = rkey;
    s.raddr = raddr;
    s.imm_be = imm_be;
  }
  std::shared_ptr<EfaFabric> f_;
  std::vector<EfaFabric::Dev*> devs_;
  std::vector<std::unique_ptr<ibv_mr>> mrs_;
  std::vector<std::unique_ptr<EfaFabric::Cq>> cqs_;
  std::vector<std::unique_ptr<EfaFabric::Qp>> qps_;
  std::vector<std::unique_ptr<EfaFabric::Ah>> ahs_;
  std::map<ibv_ah*, EfaFabric::Ah*> ahs_by_ptr_;
  GpuRanges gpu_;
};

/// The dma-buf exporter of the registration tests over this fake (fake_nic/dmabuf_exporter.hpp).
using EfaExporter = DmabufExporter<EfaFabric>;

}  // namespace uccl_moe::test
