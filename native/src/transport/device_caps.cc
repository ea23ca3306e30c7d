#include "device_caps.hpp"

#include <cerrno>

#ifdef UCCL_MOE_HAVE_EFA
#include <infiniband/efadv.h>

#include "efa/efa_ops.hpp"  // kEfaCap*: the capability bits older efadv.h headers lack
#endif

namespace uccl_moe::detail {

namespace {
const char* port_state_name(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default: return "NOP";
  }
}
}  // namespace

RdmaDeviceCaps query_device_caps(VerbsOps& ops, const std::string& name, uint8_t port, bool query_efa) {
  RdmaDeviceCaps c;
  c.name = name;
  ibv_context* ctx = ops.open_device(name);
  if (!ctx) {
    c.error = verbs_error("ibv_open_device", errno);
    return c;
  }
  ibv_device_attr da{};
  if (int rc = ops.query_device(ctx, &da)) {
    c.error = verbs_error("ibv_query_device", rc);
  } else {
    c.max_mr_size = da.max_mr_size;
    c.max_qp = da.max_qp;
    c.max_qp_wr = da.max_qp_wr;
    c.max_cq = da.max_cq;
    c.max_cqe = da.max_cqe;
    c.max_sge = da.max_sge;
    c.max_qp_rd_atom = da.max_qp_rd_atom;
    c.max_qp_init_rd_atom = da.max_qp_init_rd_atom;
    c.atomic_cap = da.atomic_cap == IBV_ATOMIC_NONE ? "none" : da.atomic_cap == IBV_ATOMIC_HCA ? "hca" : "global";
  }
  ibv_port_attr pa{};
  if (int rc = ops.query_port(ctx, port, &pa)) {
    if (c.error.empty()) c.error = verbs_error("ibv_query_port", rc);
  } else {
    c.port_state = port_state_name(pa.state);
    c.link_layer = pa.link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand"
                   : pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "Unspecified";
    c.active_mtu = pa.active_mtu >= IBV_MTU_256 && pa.active_mtu <= IBV_MTU_4096 ? 128 << int(pa.active_mtu) : 0;
    c.gid_tbl_len = pa.gid_tbl_len;
  }
#ifdef UCCL_MOE_HAVE_EFA
  if (query_efa && is_efa_device(name)) {
    efadv_device_attr ea{};
    if (int rc = efadv_query_device(ctx, &ea, sizeof ea)) {
      if (c.error.empty()) c.error = verbs_error("efadv_query_device", rc);
    } else {
      c.efa_queried = true;
      c.efa_rdma_read = ea.device_caps & kEfaCapRdmaRead;
      c.efa_rnr_retry = ea.device_caps & kEfaCapRnrRetry;
      c.efa_rdma_write = ea.device_caps & kEfaCapRdmaWrite;
      c.efa_unsolicited_write_recv = ea.device_caps & kEfaCapUnsolicitedWriteRecv;
      c.efa_max_rdma_size = ea.max_rdma_size;
      c.efa_max_sq_wr = ea.max_sq_wr;
      c.efa_max_rq_wr = ea.max_rq_wr;
      c.efa_inline_buf_size = ea.inline_buf_size;
    }
  }
#else
  (void)query_efa;
#endif
  ops.close_device(ctx);
  return c;
}

}  // namespace uccl_moe::detail
