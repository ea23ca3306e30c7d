// A strict fake VerbsOps: an in-process RC "fabric" that records every call and executes RDMA writes, writes with
// immediate and fetch-and-add between the QPs it created, and refuses what a real provider refuses. Each rule cites
// where it comes from; values no public source gives are marked as our conservative choice.
//   - Device profiles (mlx5_cx7, bnxt_re_thor2, ...): ibv_device_attr limits, GID tables (v1/v2 pairs, ULA-only,
//     link-local-only) with their types via ibv_query_gid_ex or as sysfs text, atomic_cap, dma-buf support.
//   - Resources: create_qp / create_cq refuse depths over max_qp_wr / max_cqe and QPs over max_qp (EINVAL/ENOMEM as
//     rdma-core's providers return through the kernel's checks).
//   - QP transitions: the attribute mask each RC transition requires (man ibv_modify_qp), rd_atomic against
//     max_qp_rd_atom / max_qp_init_rd_atom, a GRH with a populated sgid_index on RoCE ports, timeout/retry ranges.
//   - Data path: work runs when a CQ is polled (progress), in post order per QP (RC). A write with immediate needs a
//     posted receive at the target: with rnr_retry 7 the sender waits (RNR NAKs forever), with less it fails with
//     RNR_RETRY_EXC_ERR. rkeys, MR bounds and MR/QP access flags are checked (REM_ACCESS_ERR / LOC_PROT_ERR), the
//     first error moves the QP to the error state and flushes the rest (WR_FLUSH_ERR). Failed completions carry a
//     garbage opcode (man ibv_poll_cq: only wr_id, status, qp_num, vendor_err are valid). A CQ that overflows is
//     marked and its poll fails (man ibv_create_cq: overrun is an error, IBV_EVENT_CQ_ERR).
//   - Faults: fail the next sends with a status/vendor_err, a delay per work request, a black hole for every Nth.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../fake_nic/dmabuf_exporter.hpp"
#include "transport/gpu_mr.hpp"
#include "transport/ibverbs/verbs_ops.hpp"

namespace uccl_moe::test {

struct FakeGid {
  uint8_t raw[16];
  ibv_gid_type type;
};

inline FakeGid gid_link_local(uint8_t host, ibv_gid_type t) {
  FakeGid g{{0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, host}, t};
  return g;
}
inline FakeGid gid_v4(uint8_t host, ibv_gid_type t) {
  FakeGid g{{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, host}, t};
  return g;
}
inline FakeGid gid_ula(uint8_t host, ibv_gid_type t) {
  FakeGid g{{0xfd, 0x12, 0x34, 0x56, 0x78, 0x9a, 0, 1, 0, 0, 0, 0, 0, 0, 0, host}, t};
  return g;
}

struct DeviceProfile {
  std::string name;
  uint32_t vendor_id = 0;
  int max_qp = 0, max_qp_wr = 0, max_cqe = 0, max_sge = 0, max_qp_rd_atom = 0, max_qp_init_rd_atom = 0;
  ibv_atomic_cap atomic_cap = IBV_ATOMIC_NONE;
  uint8_t link_layer = IBV_LINK_LAYER_ETHERNET;
  std::vector<FakeGid> gids;
  bool gid_type_ex = true;  ///< ibv_query_gid_ex answers; false: only the sysfs text (older rdma-core)
  bool dmabuf = true;       ///< ibv_reg_dmabuf_mr works
  bool peer_memory = true;  ///< ibv_reg_mr accepts GPU pointers (nvidia-peermem loaded)
};

/// NVIDIA ConnectX-7 (mlx5). Limits as `ibv_devinfo -v` prints them for CX-6/CX-7 firmware (firmware values: rdma-core's
/// mlx5 provider forwards them); atomic_cap HCA (kernel mlx5 main.c advertises IB_ATOMIC_HCA in host endianness).
/// GIDs as the kernel fills a RoCE port: each address once as RoCE v1 then as RoCE v2 (drivers/infiniband/core/
/// roce_gid_mgmt.c), link-local first.
inline DeviceProfile mlx5_cx7(uint8_t host = 1) {
  DeviceProfile p;
  p.name = "mlx5_0";
  p.vendor_id = 0x02c9;
  p.max_qp = 131072;
  p.max_qp_wr = 32768;
  p.max_cqe = 4194303;
  p.max_sge = 30;
  p.max_qp_rd_atom = p.max_qp_init_rd_atom = 16;
  p.atomic_cap = IBV_ATOMIC_HCA;
  p.gids = {gid_link_local(host, IBV_GID_TYPE_ROCE_V1), gid_link_local(host, IBV_GID_TYPE_ROCE_V2),
            gid_v4(host, IBV_GID_TYPE_ROCE_V1), gid_v4(host, IBV_GID_TYPE_ROCE_V2)};
  return p;
}

/// Broadcom Thor-2 (bnxt_re). atomic_cap NONE: the kernel's bnxt_re reports atomics only when the host enables PCIe
/// AtomicOp routing (bnxt_qplib_is_atomic_cap), which the MI300X hosts we target do not by default. The queue limits
/// come from firmware and are not published: these are our conservative choices (max_qp_rd_atom 8 below mlx5's 16).
/// GIDs: IPv6 ULA only (UCCL-EP ep/include/rdma_util.hpp: "bnxt_re where all GIDs are IPv6 ULA").
inline DeviceProfile bnxt_re_thor2(uint8_t host = 1) {
  DeviceProfile p;
  p.name = "bnxt_re0";
  p.vendor_id = 0x14e4;
  p.max_qp = 65536;
  p.max_qp_wr = 8192;
  p.max_cqe = 65535;
  p.max_sge = 6;
  p.max_qp_rd_atom = p.max_qp_init_rd_atom = 8;
  p.atomic_cap = IBV_ATOMIC_NONE;
  p.gids = {gid_link_local(host, IBV_GID_TYPE_ROCE_V1), gid_link_local(host, IBV_GID_TYPE_ROCE_V2),
            gid_ula(host, IBV_GID_TYPE_ROCE_V1), gid_ula(host, IBV_GID_TYPE_ROCE_V2)};
  return p;
}

/// An InfiniBand port (mlx5): LID routing, an IB GID only.
inline DeviceProfile mlx5_ib(uint8_t host = 1) {
  DeviceProfile p = mlx5_cx7(host);
  p.link_layer = IBV_LINK_LAYER_INFINIBAND;
  p.gids = {gid_link_local(host, IBV_GID_TYPE_IB)};
  return p;
}

struct FakeFabric {
  std::mutex mu;
  uint32_t next_qpn = 100, next_key = 1000, next_lid = 1;
  struct Pending {
    ibv_send_wr wr;
    ibv_sge sge;
    std::chrono::steady_clock::time_point ready;
    bool black_hole = false;
  };
  struct Qp {
    ibv_qp* qp = nullptr;
    ibv_cq* cq = nullptr;
    const DeviceProfile* dev = nullptr;
    std::vector<ibv_qp_state> states{IBV_QPS_RESET};
    std::vector<int> masks;
    ibv_qp_attr init{}, rtr{}, rts{};
    uint32_t dest_qpn = 0;
    int recv_credits = 0, max_send_wr = 0, max_recv_wr = 0, access = 0;
    bool grh = false;
    std::deque<Pending> sendq;  ///< posted, not executed (RC: in order)
    uint64_t posted = 0;
  };
  struct Mr {
    uint64_t addr, len;
    int access;
    bool dmabuf;
  };
  struct Cq {
    int capacity = 0;
    std::deque<ibv_wc> q;
    size_t peak = 0;
    bool overflowed = false;
  };
  std::map<uint32_t, Qp> qps;  // qpn -> state
  std::map<ibv_cq*, Cq> cqs;
  std::map<uint32_t, Mr> mrs;  // rkey -> region
  std::map<uint32_t, Mr> lmrs; // lkey -> region
  std::vector<ibv_send_wr> sent;  // copies (sg_list not kept)
  std::vector<ibv_sge> sent_sge;
  struct DmabufReg {
    uint64_t offset, length, iova;
    int access;
  };
  std::vector<DmabufReg> dmabuf_regs;
  std::map<int, uint64_t> dmabuf_fds;  ///< fd -> exported bytes (FakeExporter)
  bool atomics = true;                 ///< legacy switch: false forces atomic_cap NONE on every device
  // Faults.
  int fail_next_sends = 0;
  ibv_wc_status fail_status = IBV_WC_RETRY_EXC_ERR;
  uint32_t fail_vendor_err = 0;
  int delay_us = 0;
  int drop_every = 0;         ///< every Nth send WR of a QP vanishes (a dead peer / lost forever)
  uint64_t rnr_naks = 0;      ///< writes with immediate that found no receive posted (waited)
  uint64_t max_sendq = 0;

  static uint8_t garbage_opcode() { return 0xff; }

  void push_wc(ibv_cq* cq, ibv_wc wc) {
    auto it = cqs.find(cq);
    if (it == cqs.end()) return;  // its owner is gone
    Cq& c = it->second;
    if (int(c.q.size()) >= c.capacity) {
      c.overflowed = true;
      return;
    }
    c.q.push_back(wc);
    if (c.q.size() > c.peak) c.peak = c.q.size();
  }
  void fail_wc(Qp& q, const ibv_send_wr& wr, ibv_wc_status st, uint32_t vendor_err) {
    ibv_wc wc;
    std::memset(&wc, 0xA5, sizeof wc);  // man ibv_poll_cq: everything but these four is undefined on error
    wc.wr_id = wr.wr_id;
    wc.status = st;
    wc.qp_num = q.qp->qp_num;
    wc.vendor_err = vendor_err;
    wc.opcode = ibv_wc_opcode(garbage_opcode());
    push_wc(q.cq, wc);
    q.states.push_back(IBV_QPS_ERR);
  }
  bool lkey_ok(const ibv_sge& s, int need) {
    auto it = lmrs.find(s.lkey);
    return it != lmrs.end() && s.addr >= it->second.addr && s.addr + s.length <= it->second.addr + it->second.len &&
           (it->second.access & need) == need;
  }

  /// Executes what is ready on every QP, in order per QP. Caller holds mu.
  void progress() {
    const auto now = std::chrono::steady_clock::now();
    for (auto& [qpn, q] : qps) {
      while (!q.sendq.empty()) {
        Pending& p = q.sendq.front();
        if (p.ready > now) break;
        if (p.black_hole) {  // never completes; the QP keeps going (the loss is the test's subject)
          q.sendq.pop_front();
          continue;
        }
        if (!execute(q, p.wr, p.sge)) break;  // waits for a receive (RNR)
        q.sendq.pop_front();
      }
    }
  }

  /// One send WR; false if it must wait (RNR with infinite retry).
  bool execute(Qp& q, ibv_send_wr& wr, const ibv_sge& sge) {
    if (q.states.back() == IBV_QPS_ERR) {
      fail_wc(q, wr, IBV_WC_WR_FLUSH_ERR, 0);
      return true;
    }
    if (fail_next_sends > 0) {
      --fail_next_sends;
      fail_wc(q, wr, fail_status, fail_vendor_err);
      return true;
    }
    auto dit = qps.find(q.dest_qpn);
    if (dit == qps.end()) {  // the peer's QP is gone: the retries run out (IB spec: transport retry exceeded)
      fail_wc(q, wr, IBV_WC_RETRY_EXC_ERR, 0);
      return true;
    }
    Qp& dst = dit->second;
    const bool atomic = wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD;
    const uint64_t raddr = atomic ? wr.wr.atomic.remote_addr : wr.wr.rdma.remote_addr;
    const uint32_t rkey = atomic ? wr.wr.atomic.rkey : wr.wr.rdma.rkey;
    const uint64_t len = atomic ? 8 : (wr.num_sge ? sge.length : 0);
    // Local protection: the SGE inside a registered MR; the fetched value of an atomic needs LOCAL_WRITE.
    if (wr.num_sge && !lkey_ok(sge, atomic ? IBV_ACCESS_LOCAL_WRITE : 0)) {
      fail_wc(q, wr, IBV_WC_LOC_PROT_ERR, 0);
      return true;
    }
    // Remote access: rkey, bounds, the MR's and the target QP's access flags (IB spec 9.7.5.1.2 / man ibv_reg_mr,
    // man ibv_modify_qp qp_access_flags), 8-byte aligned atomics.
    const int need = atomic ? IBV_ACCESS_REMOTE_ATOMIC : IBV_ACCESS_REMOTE_WRITE;
    auto mr = mrs.find(rkey);
    if (len > 0 || atomic) {
      if (mr == mrs.end() || raddr < mr->second.addr || raddr + len > mr->second.addr + mr->second.len ||
          !(mr->second.access & need) || !(dst.access & need) || (atomic && raddr % 8 != 0)) {
        fail_wc(q, wr, IBV_WC_REM_ACCESS_ERR, 0);
        return true;
      }
    }
    if (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && dst.recv_credits == 0) {
      ++rnr_naks;
      if (q.rts.rnr_retry == 7) return false;  // infinite RNR retry: the sender waits (man ibv_modify_qp)
      fail_wc(q, wr, IBV_WC_RNR_RETRY_EXC_ERR, 0);
      return true;
    }
    ibv_wc wc{};
    wc.wr_id = wr.wr_id;
    wc.qp_num = q.qp->qp_num;
    wc.status = IBV_WC_SUCCESS;
    if (atomic) {
      auto* p = reinterpret_cast<int64_t*>(raddr);
      *reinterpret_cast<int64_t*>(sge.addr) =
          __atomic_fetch_add(p, int64_t(wr.wr.atomic.compare_add), __ATOMIC_RELEASE);
      wc.opcode = IBV_WC_FETCH_ADD;
    } else {
      if (len) std::memcpy(reinterpret_cast<void*>(raddr), reinterpret_cast<void*>(sge.addr), len);
      __atomic_thread_fence(__ATOMIC_RELEASE);
      wc.opcode = IBV_WC_RDMA_WRITE;
      if (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        --dst.recv_credits;
        ibv_wc r{};
        r.status = IBV_WC_SUCCESS;
        r.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
        r.imm_data = wr.imm_data;
        r.wc_flags = IBV_WC_WITH_IMM;
        r.qp_num = dst.qp->qp_num;
        r.wr_id = dst_recv_wr_id(dst);
        push_wc(dst.cq, r);
      }
    }
    push_wc(q.cq, wc);
    return true;
  }
  std::map<uint32_t, std::deque<uint64_t>> recv_ids;  ///< qpn -> wr_ids of posted receives
  uint64_t dst_recv_wr_id(Qp& dst) {
    auto& d = recv_ids[dst.qp->qp_num];
    const uint64_t id = d.empty() ? 0 : d.front();
    if (!d.empty()) d.pop_front();
    return id;
  }
};

class FakeVerbs : public detail::VerbsOps {
 public:
  explicit FakeVerbs(std::shared_ptr<FakeFabric> f, DeviceProfile profile = mlx5_cx7())
      : f_(std::move(f)), dev_(std::move(profile)) {}
  DeviceProfile& profile() { return dev_; }
  /// Sysfs text per GID index (gid_type_ex false); defaults to the profile's types written as the kernel does.
  std::map<int, std::string> sysfs_types;

  std::vector<std::string> device_names() override { return {dev_.name}; }
  ibv_context* open_device(const std::string& name) override {
    if (name != dev_.name) return nullptr;
    return keep(new ibv_context{});
  }
  int close_device(ibv_context*) override { return 0; }
  int query_device(ibv_context*, ibv_device_attr* a) override {
    std::memset(a, 0, sizeof *a);
    a->vendor_id = dev_.vendor_id;
    a->max_qp = dev_.max_qp;
    a->max_qp_wr = dev_.max_qp_wr;
    a->max_cqe = dev_.max_cqe;
    a->max_sge = dev_.max_sge;
    a->max_qp_rd_atom = dev_.max_qp_rd_atom;
    a->max_qp_init_rd_atom = dev_.max_qp_init_rd_atom;
    a->atomic_cap = f_->atomics ? dev_.atomic_cap : IBV_ATOMIC_NONE;
    a->phys_port_cnt = 1;
    return 0;
  }
  int query_port(ibv_context*, uint8_t port, ibv_port_attr* a) override {
    if (port != 1) return EINVAL;
    std::memset(a, 0, sizeof *a);
    a->state = IBV_PORT_ACTIVE;
    a->link_layer = dev_.link_layer;
    a->gid_tbl_len = int(dev_.gids.size());
    a->active_mtu = IBV_MTU_4096;
    std::lock_guard<std::mutex> l(f_->mu);
    a->lid = dev_.link_layer == IBV_LINK_LAYER_INFINIBAND ? uint16_t(f_->next_lid++) : 0;  // RoCE has no LIDs
    return 0;
  }
  int query_gid(ibv_context*, uint8_t, int index, ibv_gid* g) override {
    if (index < 0 || size_t(index) >= dev_.gids.size()) return EINVAL;
    std::memcpy(g->raw, dev_.gids[size_t(index)].raw, 16);
    return 0;
  }
  int query_gid_type(ibv_context*, uint8_t, int index, ibv_gid_type* type) override {
    if (index < 0 || size_t(index) >= dev_.gids.size()) return EINVAL;
    if (dev_.gid_type_ex) {
      *type = dev_.gids[size_t(index)].type;
      return 0;
    }
    // Older rdma-core: what the real VerbsOps reads from sysfs, parsed by the same function.
    auto it = sysfs_types.find(index);
    const ibv_gid_type t = dev_.gids[size_t(index)].type;
    const std::string text = it != sysfs_types.end() ? it->second
                             : t == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2"
                                                         : "IB/RoCE v1";
    return detail::parse_sysfs_gid_type(text, type) ? 0 : EINVAL;
  }
  ibv_pd* alloc_pd(ibv_context*) override { return keep(new ibv_pd{}); }
  int dealloc_pd(ibv_pd*) override { return 0; }
  ibv_mr* reg_mr(ibv_pd*, void* addr, size_t len, int access) override {
    if (!mr_access_ok(access)) return nullptr;
    if (gpu_.contains(addr) && !dev_.peer_memory) {  // no nvidia-peermem: the kernel cannot pin GPU pages
      errno = EFAULT;
      return nullptr;
    }
    return add_mr(uint64_t(reinterpret_cast<uintptr_t>(addr)), len, access, false);
  }
  ibv_mr* reg_dmabuf_mr(ibv_pd*, uint64_t offset, size_t length, uint64_t iova, int fd, int access) override {
    if (!dev_.dmabuf) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    if (!mr_access_ok(access)) return nullptr;
    {
      std::lock_guard<std::mutex> l(f_->mu);
      auto it = f_->dmabuf_fds.find(fd);
      if (it == f_->dmabuf_fds.end() || offset + length > it->second) {  // the range must lie inside the dma-buf
        errno = EINVAL;
        return nullptr;
      }
      f_->dmabuf_regs.push_back({offset, length, iova, access});
    }
    return add_mr(iova, length, access, true);
  }
  int dereg_mr(ibv_mr*) override { return 0; }
  ibv_cq* create_cq(ibv_context*, int cqe) override {
    if (cqe < 1 || cqe > dev_.max_cqe) {  // man ibv_create_cq: cqe above the device's max_cqe fails
      errno = EINVAL;
      return nullptr;
    }
    auto* cq = keep(new ibv_cq{});
    cq->cqe = cqe;
    std::lock_guard<std::mutex> l(f_->mu);
    f_->cqs[cq].capacity = cqe;
    my_cqs_.push_back(cq);
    return cq;
  }
  int destroy_cq(ibv_cq*) override { return 0; }
  ibv_qp* create_qp(ibv_pd*, ibv_qp_init_attr* a) override {
    // man ibv_create_qp: caps above the device's limits fail (EINVAL); the QP count is bounded by max_qp.
    if (int(a->cap.max_send_wr) > dev_.max_qp_wr || int(a->cap.max_recv_wr) > dev_.max_qp_wr ||
        int(a->cap.max_send_sge) > dev_.max_sge || int(a->cap.max_recv_sge) > dev_.max_sge || !a->send_cq ||
        !a->recv_cq) {
      errno = EINVAL;
      return nullptr;
    }
    if (num_qps_ >= dev_.max_qp) {
      errno = ENOMEM;
      return nullptr;
    }
    ++num_qps_;
    auto* qp = keep(new ibv_qp{});
    std::lock_guard<std::mutex> l(f_->mu);
    qp->qp_num = f_->next_qpn++;
    qp->qp_type = a->qp_type;
    FakeFabric::Qp q;
    q.qp = qp;
    q.cq = a->send_cq;
    q.dev = &dev_;
    q.max_send_wr = int(a->cap.max_send_wr);
    q.max_recv_wr = int(a->cap.max_recv_wr);
    f_->qps[qp->qp_num] = std::move(q);
    my_qps_.push_back(qp->qp_num);
    return qp;
  }
  int destroy_qp(ibv_qp*) override { return 0; }
  int modify_qp(ibv_qp* qp, ibv_qp_attr* a, int mask) override {
    std::lock_guard<std::mutex> l(f_->mu);
    FakeFabric::Qp& q = f_->qps.at(qp->qp_num);
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    const ibv_qp_state from = q.states.back(), to = a->qp_state;
    // man ibv_modify_qp, RC: the attributes each transition requires.
    int required = 0;
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT)
      required = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR)
      required = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS)
      required = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                 IBV_QP_MAX_QP_RD_ATOMIC;
    else
      return EINVAL;
    if ((mask & required) != required) return EINVAL;
    if (to == IBV_QPS_INIT) {
      if (a->port_num != 1) return EINVAL;
      q.access = a->qp_access_flags;
      q.init = *a;
    } else if (to == IBV_QPS_RTR) {
      if (a->max_dest_rd_atomic > dev_.max_qp_rd_atom) return EINVAL;
      if (a->ah_attr.sl > 15) return EINVAL;
      if (dev_.link_layer == IBV_LINK_LAYER_ETHERNET) {
        // RoCE: every packet carries a GRH built from sgid_index (the kernel resolves it to a populated GID).
        if (!a->ah_attr.is_global || a->ah_attr.grh.sgid_index >= dev_.gids.size()) return EINVAL;
        static const uint8_t kZero[16] = {0};
        if (std::memcmp(dev_.gids[a->ah_attr.grh.sgid_index].raw, kZero, 16) == 0) return EINVAL;
      } else if (!a->ah_attr.is_global && a->ah_attr.dlid == 0) {
        return EINVAL;  // IB without a GRH routes by LID
      }
      q.dest_qpn = a->dest_qp_num;
      q.grh = a->ah_attr.is_global;
      q.rtr = *a;
    } else {
      if (a->max_rd_atomic > dev_.max_qp_init_rd_atom || a->timeout > 31 || a->retry_cnt > 7 || a->rnr_retry > 7)
        return EINVAL;
      q.rts = *a;
    }
    q.states.push_back(to);
    q.masks.push_back(mask);
    return 0;
  }
  int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    std::lock_guard<std::mutex> l(f_->mu);
    FakeFabric::Qp& q = f_->qps.at(qp->qp_num);
    if (q.states.back() == IBV_QPS_RESET || q.recv_credits >= q.max_recv_wr) {  // man ibv_post_recv: ENOMEM when full
      *bad = wr;
      return q.states.back() == IBV_QPS_RESET ? EINVAL : ENOMEM;
    }
    ++q.recv_credits;
    f_->recv_ids[qp->qp_num].push_back(wr->wr_id);
    return 0;
  }
  int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) override {
    std::lock_guard<std::mutex> l(f_->mu);
    FakeFabric::Qp& q = f_->qps.at(qp->qp_num);
    const ibv_qp_state st = q.states.back();
    if (st != IBV_QPS_RTS && st != IBV_QPS_ERR) {
      *bad = wr;
      return EINVAL;
    }
    if (int(q.sendq.size()) >= q.max_send_wr) {  // the send queue is full
      *bad = wr;
      return ENOMEM;
    }
    const bool atomic = wr->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || wr->opcode == IBV_WR_ATOMIC_CMP_AND_SWP;
    if (atomic && dev_.atomic_cap == IBV_ATOMIC_NONE) {  // conservative: a provider without atomics refuses them
      *bad = wr;
      return EOPNOTSUPP;
    }
    if (wr->num_sge > q.dev->max_sge || (wr->num_sge > 0 && !wr->sg_list)) {
      *bad = wr;
      return EINVAL;
    }
    f_->sent.push_back(*wr);
    f_->sent_sge.push_back(wr->num_sge ? wr->sg_list[0] : ibv_sge{});
    FakeFabric::Pending p;
    p.wr = *wr;
    p.wr.next = nullptr;
    p.sge = wr->num_sge ? wr->sg_list[0] : ibv_sge{};
    p.wr.sg_list = nullptr;
    p.ready = std::chrono::steady_clock::now() + std::chrono::microseconds(f_->delay_us);
    ++q.posted;
    const int drop = drop_every ? drop_every : f_->drop_every;
    p.black_hole = drop > 0 && q.posted % uint64_t(drop) == 0;
    q.sendq.push_back(p);
    if (q.sendq.size() > f_->max_sendq) f_->max_sendq = q.sendq.size();
    return 0;
  }
  int poll_cq(ibv_cq* cq, int num, ibv_wc* wc) override {
    std::lock_guard<std::mutex> l(f_->mu);
    f_->progress();
    FakeFabric::Cq& c = f_->cqs.at(cq);
    if (c.overflowed) return -EIO;  // an overrun CQ is in error (IBV_EVENT_CQ_ERR)
    int n = 0;
    while (n < num && !c.q.empty()) {
      wc[n++] = c.q.front();
      c.q.pop_front();
    }
    return n;
  }
  ~FakeVerbs() override {
    {  // what this device owned leaves the fabric (work still aimed at it fails, as at a dead peer)
      std::lock_guard<std::mutex> l(f_->mu);
      for (uint32_t qpn : my_qps_) f_->qps.erase(qpn);
      for (ibv_cq* cq : my_cqs_) f_->cqs.erase(cq);
      for (uint32_t k : my_keys_) {
        f_->mrs.erase(k);
        f_->lmrs.erase(k);
      }
    }
    for (auto& d : owned_) d();
  }
  /// Every Nth send WR of this device's QPs vanishes (0: the fabric's drop_every).
  int drop_every = 0;

  /// GPU-looking memory for the registration tests: ranges the fake treats as device memory.
  void mark_gpu(void* p, size_t bytes) { gpu_.mark(p, bytes); }

 private:
  bool mr_access_ok(int access) {
    // man ibv_reg_mr (and the kernel's ib_check_mr_access): remote write or atomic requires local write.
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
      errno = EINVAL;
      return false;
    }
    return true;
  }
  ibv_mr* add_mr(uint64_t addr, size_t len, int access, bool dmabuf) {
    auto* mr = keep(new ibv_mr{});
    std::lock_guard<std::mutex> l(f_->mu);
    mr->addr = reinterpret_cast<void*>(addr);
    mr->length = len;
    mr->lkey = f_->next_key++;
    mr->rkey = f_->next_key++;
    f_->mrs[mr->rkey] = {addr, len, access, dmabuf};
    f_->lmrs[mr->lkey] = {addr, len, access, dmabuf};
    my_keys_.push_back(mr->lkey);
    my_keys_.push_back(mr->rkey);
    return mr;
  }
  template <typename T>
  T* keep(T* p) {
    owned_.push_back([p] { delete p; });
    return p;
  }
  std::shared_ptr<FakeFabric> f_;
  DeviceProfile dev_;
  int num_qps_ = 0;
  std::vector<uint32_t> my_qps_, my_keys_;
  std::vector<ibv_cq*> my_cqs_;
  GpuRanges gpu_;
  std::vector<std::function<void()>> owned_;
};

/// The dma-buf exporter of the registration tests over this fake (fake_nic/dmabuf_exporter.hpp).
using FakeExporter = DmabufExporter<FakeFabric>;

}  // namespace uccl_moe::test
