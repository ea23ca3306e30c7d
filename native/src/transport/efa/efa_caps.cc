// What the efa transport asks of an EFA device, and the SRD QP rules it follows. Every rule cites where it comes from.
#include <algorithm>

#include "efa_detail.hpp"
#include "transport/ibverbs/verbs_ops.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kSendDepth = 512;   ///< send WRs in flight per QP we ask for (clamped to the device)
constexpr uint32_t kRecvDepth = 1024;  ///< receive WRs per QP = Q of the sequence window argument (ordering.hpp)
constexpr uint32_t kMinDepth = 16;     ///< below this a device is too small to keep a proxy thread busy
constexpr uint8_t kRnrRetryForever = 7;
}  // namespace

// The kernel's SRD state table (linux drivers/infiniband/hw/efa/efa_verbs.c, srd_qp_state_table) requires
// PKEY_INDEX | PORT | QKEY for RESET->INIT (port 1, pkey index 0), nothing beyond STATE for INIT->RTR, SQ_PSN for
// RTR->RTS with RNR_RETRY optional, and refuses any other mask bit; libfabric prov/efa/src/efa_base_ep.c
// (efa_base_ep_modify_qp_rst2rts) walks the same masks.
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
QpTransition srd_rts(uint32_t psn, bool set_rnr_retry) {
  QpTransition t{};
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = psn;
  t.mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  // RNR retry 7 = retry forever: a write-with-immediate that finds no posted receive waits instead of failing. Only
  // when the device reports EFADV_DEVICE_ATTR_CAPS_RNR_RETRY: older kernels refuse the mask bit (libfabric
  // prov/efa/src/efa_base_ep.c sets IBV_QP_RNR_RETRY only under efa_domain_support_rnr_retry_modify; the value 7 is
  // its EFA_RNR_INFINITE_RETRY, efa_base_ep.h).
  if (set_rnr_retry) {
    t.attr.rnr_retry = kRnrRetryForever;
    t.mask |= IBV_QP_RNR_RETRY;
  }
  return t;
}

std::string query_efa_caps(VerbsOps& verbs, EfaOps& efa, ibv_context* ctx, EfaDeviceCaps* caps) {
  efadv_device_attr ea{};
  if (int rc = efa.query_efa_device(ctx, &ea))
    return verbs_error("efadv_query_device", rc) + " (not an EFA device, or rdma-core too old)";
  ibv_device_attr da{};
  if (int rc = verbs.query_device(ctx, &da)) return verbs_error("ibv_query_device", rc);
  *caps = EfaDeviceCaps{};
  caps->device_caps = ea.device_caps;
  caps->max_sq_wr = ea.max_sq_wr;
  caps->max_rq_wr = ea.max_rq_wr;
  caps->max_rdma_size = ea.max_rdma_size;
  caps->max_sq_sge = ea.max_sq_sge;
  caps->max_rq_sge = ea.max_rq_sge;
  caps->max_qp = da.max_qp;
  caps->max_cq = da.max_cq;
  caps->max_cqe = da.max_cqe;
  caps->max_qp_wr = da.max_qp_wr;
  caps->max_ah = da.max_ah;
  caps->max_mr_size = da.max_mr_size;
  return "";
}

EfaQueuePlan plan_efa_queues(const EfaDeviceCaps& c, const std::string& dev, int num_ranks, int num_threads) {
  const char* d = dev.c_str();
  // RDMA write is a device capability (rdma-core providers/efa/verbs.c efa_check_qp_attr: IBV_QP_EX_WITH_RDMA_WRITE*
  // send ops are refused without EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE; man efadv_query_device).
  if (!c.has(kEfaCapRdmaWrite) || c.max_rdma_size == 0)
    UCCL_THROW(kTransport, "efa %s: the device cannot RDMA-write (efadv_query_device reports no "
               "EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE): EFA RDMA write needs p5/p5e/p5en/p6-class instances with a current "
               "EFA driver and rdma-core (aws-efa-installer); UCCL_MOE_TRANSPORT=auto falls back to another transport",
               d);
  if (c.max_sq_sge < 1 || c.max_rq_sge < 1)
    UCCL_THROW(kTransport, "efa %s: device reports max_sq_sge=%u max_rq_sge=%u; one scatter entry is needed", d,
               unsigned(c.max_sq_sge), unsigned(c.max_rq_sge));
  if (c.max_qp > 0 && num_threads > c.max_qp)
    UCCL_THROW(kTransport, "efa %s: %d proxy threads need %d SRD QPs but the device allows max_qp=%d; lower "
               "UCCL_MOE_PROXY_THREADS", d, num_threads, num_threads, c.max_qp);
  if (c.max_cq > 0 && num_threads > c.max_cq)
    UCCL_THROW(kTransport, "efa %s: %d proxy threads need %d CQs but the device allows max_cq=%d; lower "
               "UCCL_MOE_PROXY_THREADS", d, num_threads, num_threads, c.max_cq);
  if (c.max_ah > 0 && num_ranks > c.max_ah)
    UCCL_THROW(kTransport, "efa %s: %d ranks need %d address handles but the device allows max_ah=%d", d, num_ranks,
               num_ranks, c.max_ah);
  EfaQueuePlan p;
  auto clamp = [&](uint32_t want, uint32_t dev_max) {
    uint32_t v = std::min(want, dev_max);
    if (c.max_qp_wr > 0) v = std::min(v, uint32_t(c.max_qp_wr));
    return v;
  };
  // Queue depths within the device's (efa_check_qp_limits refuses max_send_wr > max_sq_wr, max_recv_wr > max_rq_wr).
  p.send_depth = clamp(kSendDepth, c.max_sq_wr);
  // With EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV a write-with-immediate consumes no receive WR (efadv.h; UCCL-EP
  // ep/src/rdma.cpp create_srd_qp_ex), so none is posted; without it each one needs a posted receive.
  p.unsolicited = c.has(kEfaCapUnsolicitedWriteRecv);
  p.recv_depth = p.unsolicited ? 0 : clamp(kRecvDepth, c.max_rq_wr);
  p.set_rnr_retry = c.has(kEfaCapRnrRetry);
  p.max_write_bytes = c.max_rdma_size;
  if (p.send_depth < kMinDepth || (!p.unsolicited && p.recv_depth < kMinDepth))
    UCCL_THROW(kTransport, "efa %s: queue depths max_sq_wr=%u max_rq_wr=%u max_qp_wr=%d are below the %u the transport "
               "needs", d, c.max_sq_wr, c.max_rq_wr, c.max_qp_wr, kMinDepth);
  p.window = p.unsolicited ? kRecvDepth : p.recv_depth;
  // The CQ holds our send completions plus every receive completion not yet polled: with posted receives at most one
  // per posted receive; with unsolicited receives nothing at the NIC bounds them, so it is sized for every peer's
  // send window (peers x window). A CQ that overflows breaks the QP, so the send window shrinks to fit max_cqe.
  const uint64_t max_cqe = c.max_cqe > 0 ? uint64_t(c.max_cqe) : UINT32_MAX;
  if (p.unsolicited) {
    const uint64_t fit = max_cqe / (uint64_t(num_ranks) + 1);
    if (fit < kMinDepth)
      UCCL_THROW(kTransport, "efa %s: a CQ for %d ranks x a send window of %u needs more than max_cqe=%d entries; use "
                 "fewer ranks per EFA device", d, num_ranks, kMinDepth, c.max_cqe);
    p.send_depth = uint32_t(std::min<uint64_t>(p.send_depth, fit));
    p.cqe = p.send_depth * uint32_t(num_ranks + 1);
  } else {
    p.cqe = p.send_depth + p.recv_depth;
    if (p.cqe > max_cqe)
      UCCL_THROW(kTransport, "efa %s: a CQ of %u entries (%u sends + %u receives) exceeds max_cqe=%d", d, p.cqe,
                 p.send_depth, p.recv_depth, c.max_cqe);
  }
  return p;
}

bool efa_device_usable(VerbsOps& verbs, EfaOps& efa, const std::string& name) {
  if (!is_efa_device(name)) return false;
  ibv_context* ctx = verbs.open_device(name);
  if (!ctx) return false;
  EfaDeviceCaps caps;
  const std::string err = query_efa_caps(verbs, efa, ctx, &caps);
  verbs.close_device(ctx);
  const bool ok = err.empty() && caps.has(kEfaCapRdmaWrite) && caps.max_rdma_size > 0;
  if (!ok)
    UCCL_LOG(INFO, NET, "efa: %s is not usable (%s); auto skips the efa transport", name.c_str(),
             err.empty() ? "no RDMA write" : err.c_str());
  return ok;
}

}  // namespace uccl_moe::detail
