// What an RDMA device can do, read through the verbs seam (ibv_query_device, ibv_query_port and, for EFA,
// efadv_query_device): for `uccl-moe doctor`, which flags what will not work before a job runs.
#pragma once

#include <cstdint>
#include <string>

#include "ibverbs/verbs_ops.hpp"

namespace uccl_moe::detail {

struct RdmaDeviceCaps {
  std::string name;
  std::string error;             ///< "" or why the device could not be opened / queried
  // ibv_query_device
  uint64_t max_mr_size = 0;
  int max_qp = 0, max_qp_wr = 0, max_cq = 0, max_cqe = 0, max_sge = 0;
  int max_qp_rd_atom = 0, max_qp_init_rd_atom = 0;
  std::string atomic_cap;        ///< "none", "hca", "global"
  // ibv_query_port
  std::string port_state;        ///< "ACTIVE", "DOWN", ...
  std::string link_layer;        ///< "InfiniBand", "Ethernet", "Unspecified"
  int active_mtu = 0;            ///< bytes (256..4096)
  int gid_tbl_len = 0;
  // efadv_query_device (EFA only; efa_queried says whether it ran)
  bool efa_queried = false;
  bool efa_rdma_read = false, efa_rdma_write = false, efa_unsolicited_write_recv = false, efa_rnr_retry = false;
  uint32_t efa_max_rdma_size = 0, efa_max_sq_wr = 0, efa_max_rq_wr = 0;
  int efa_inline_buf_size = 0;
};

/// Opens `name` through `ops`, queries it and closes it; never throws (failures land in .error). `query_efa` runs
/// efadv_query_device on an EFA device (real devices only: the fake verbs layer has no EFA context).
RdmaDeviceCaps query_device_caps(VerbsOps& ops, const std::string& name, uint8_t port, bool query_efa);

}  // namespace uccl_moe::detail
