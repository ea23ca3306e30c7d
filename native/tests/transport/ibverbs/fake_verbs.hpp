// A fake VerbsOps: an in-process "fabric" that records every call and executes RDMA writes, writes with immediate
// and fetch-and-add between the QPs it created, enforcing the QP state machine (RESET->INIT->RTR->RTS) and rkeys.
#pragma once

#include <arpa/inet.h>

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/ibverbs/verbs_ops.hpp"

namespace uccl_moe::test {

struct FakeFabric {
  std::mutex mu;
  uint32_t next_qpn = 100, next_key = 1000, next_lid = 1;
  struct Qp {
    ibv_qp* qp;
    ibv_cq* cq;
    std::vector<ibv_qp_state> states{IBV_QPS_RESET};
    std::vector<int> masks;
    uint32_t dest_qpn = 0;
    int recv_credits = 0;
    bool grh = false;
  };
  struct Mr {
    uint64_t addr, len;
    int access;
  };
  std::map<uint32_t, Qp> qps;                    // qpn -> state
  std::map<ibv_cq*, std::deque<ibv_wc>> cqs;
  std::map<uint32_t, Mr> mrs;                    // rkey -> region
  std::vector<ibv_send_wr> sent;                 // copies (sg_list not kept)
  std::vector<ibv_sge> sent_sge;
  bool atomics = true;
};

class FakeVerbs : public detail::VerbsOps {
 public:
  explicit FakeVerbs(std::shared_ptr<FakeFabric> f) : f_(std::move(f)) {}
  std::vector<std::string> device_names() override { return {"fake_mlx5_0"}; }
  ibv_context* open_device(const std::string&) override { return keep(new ibv_context{}); }
  int close_device(ibv_context*) override { return 0; }
  int query_device(ibv_context*, ibv_device_attr* a) override {
    std::memset(a, 0, sizeof *a);
    a->atomic_cap = f_->atomics ? IBV_ATOMIC_HCA : IBV_ATOMIC_NONE;
    return 0;
  }
  int query_port(ibv_context*, uint8_t, ibv_port_attr* a) override {
    std::memset(a, 0, sizeof *a);
    a->state = IBV_PORT_ACTIVE;
    a->link_layer = IBV_LINK_LAYER_ETHERNET;
    a->gid_tbl_len = 4;
    a->active_mtu = IBV_MTU_4096;
    std::lock_guard<std::mutex> l(f_->mu);
    a->lid = uint16_t(f_->next_lid++);
    return 0;
  }
  int query_gid(ibv_context*, uint8_t, int index, ibv_gid* g) override {
    std::memset(g, 0, sizeof *g);
    if (index < 2) {
      g->raw[0] = 0xfe;
      g->raw[1] = 0x80;  // link-local (RoCE v1 style)
    } else {
      g->raw[10] = g->raw[11] = 0xff;
      g->raw[12] = 10;
      g->raw[15] = uint8_t(index);
    }
    return 0;
  }
  ibv_pd* alloc_pd(ibv_context*) override { return keep(new ibv_pd{}); }
  int dealloc_pd(ibv_pd*) override { return 0; }
  ibv_mr* reg_mr(ibv_pd*, void* addr, size_t len, int access) override {
    auto* mr = keep(new ibv_mr{});
    std::lock_guard<std::mutex> l(f_->mu);
    mr->addr = addr;
    mr->length = len;
    mr->lkey = f_->next_key++;
    mr->rkey = f_->next_key++;
    f_->mrs[mr->rkey] = {uint64_t(reinterpret_cast<uintptr_t>(addr)), len, access};
    return mr;
  }
  int dereg_mr(ibv_mr*) override { return 0; }
  ibv_cq* create_cq(ibv_context*, int) override {
    auto* cq = keep(new ibv_cq{});
    std::lock_guard<std::mutex> l(f_->mu);
    f_->cqs[cq];
    return cq;
  }
  int destroy_cq(ibv_cq*) override { return 0; }
  ibv_qp* create_qp(ibv_pd*, ibv_qp_init_attr* a) override {
    auto* qp = keep(new ibv_qp{});
    std::lock_guard<std::mutex> l(f_->mu);
    qp->qp_num = f_->next_qpn++;
    qp->qp_type = a->qp_type;
    f_->qps[qp->qp_num] = FakeFabric::Qp{qp, a->send_cq};
    return qp;
  }
  int destroy_qp(ibv_qp*) override { return 0; }
  int modify_qp(ibv_qp* qp, ibv_qp_attr* a, int mask) override {
    std::lock_guard<std::mutex> l(f_->mu);
    FakeFabric::Qp& q = f_->qps.at(qp->qp_num);
    const ibv_qp_state from = q.states.back(), to = a->qp_state;
    const bool legal = (from == IBV_QPS_RESET && to == IBV_QPS_INIT) || (from == IBV_QPS_INIT && to == IBV_QPS_RTR) ||
                       (from == IBV_QPS_RTR && to == IBV_QPS_RTS);
    if (!legal || !(mask & IBV_QP_STATE)) return EINVAL;
    if (to == IBV_QPS_RTR) {
      if (!(mask & IBV_QP_DEST_QPN) || !(mask & IBV_QP_AV)) return EINVAL;
      q.dest_qpn = a->dest_qp_num;
      q.grh = a->ah_attr.is_global;
    }
    q.states.push_back(to);
    q.masks.push_back(mask);
    return 0;
  }
  int post_recv(ibv_qp* qp, ibv_recv_wr*, ibv_recv_wr**) override {
    std::lock_guard<std::mutex> l(f_->mu);
    ++f_->qps.at(qp->qp_num).recv_credits;
    return 0;
  }
  int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) override {
    std::lock_guard<std::mutex> l(f_->mu);
    FakeFabric::Qp& q = f_->qps.at(qp->qp_num);
    if (q.states.back() != IBV_QPS_RTS) {
      *bad = wr;
      return EINVAL;
    }
    f_->sent.push_back(*wr);
    f_->sent_sge.push_back(wr->num_sge ? wr->sg_list[0] : ibv_sge{});
    ibv_wc wc{};
    wc.wr_id = wr->wr_id;
    wc.qp_num = qp->qp_num;
    wc.status = IBV_WC_SUCCESS;
    FakeFabric::Qp& dst = f_->qps.at(q.dest_qpn);
    const bool atomic = wr->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD;
    const uint64_t raddr = atomic ? wr->wr.atomic.remote_addr : wr->wr.rdma.remote_addr;
    const uint32_t rkey = atomic ? wr->wr.atomic.rkey : wr->wr.rdma.rkey;
    const uint64_t len = atomic ? 8 : (wr->num_sge ? wr->sg_list[0].length : 0);
    auto mr = f_->mrs.find(rkey);
    if (mr == f_->mrs.end() || raddr < mr->second.addr || raddr + len > mr->second.addr + mr->second.len) {
      wc.status = IBV_WC_REM_ACCESS_ERR;
      f_->cqs[q.cq].push_back(wc);
      return 0;
    }
    if (atomic) {
      auto* p = reinterpret_cast<uint64_t*>(raddr);
      *reinterpret_cast<uint64_t*>(wr->sg_list[0].addr) = *p;
      *p += wr->wr.atomic.compare_add;
      wc.opcode = IBV_WC_FETCH_ADD;
    } else {
      if (len) std::memcpy(reinterpret_cast<void*>(raddr), reinterpret_cast<void*>(wr->sg_list[0].addr), len);
      wc.opcode = IBV_WC_RDMA_WRITE;
      if (wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        if (dst.recv_credits == 0) {  // would be an RNR retry on hardware
          *bad = wr;
          return ENOMEM;
        }
        --dst.recv_credits;
        ibv_wc r{};
        r.status = IBV_WC_SUCCESS;
        r.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
        r.imm_data = wr->imm_data;
        r.wc_flags = IBV_WC_WITH_IMM;
        r.qp_num = dst.qp->qp_num;
        f_->cqs[dst.cq].push_back(r);
      }
    }
    f_->cqs[q.cq].push_back(wc);
    return 0;
  }
  int poll_cq(ibv_cq* cq, int num, ibv_wc* wc) override {
    std::lock_guard<std::mutex> l(f_->mu);
    auto& q = f_->cqs[cq];
    int n = 0;
    while (n < num && !q.empty()) {
      wc[n++] = q.front();
      q.pop_front();
    }
    return n;
  }
  ~FakeVerbs() override {
    for (auto& d : owned_) d();
  }

 private:
  template <typename T>
  T* keep(T* p) {
    owned_.push_back([p] { delete p; });
    return p;
  }
  std::shared_ptr<FakeFabric> f_;
  std::vector<std::function<void()>> owned_;
};

}  // namespace uccl_moe::test
