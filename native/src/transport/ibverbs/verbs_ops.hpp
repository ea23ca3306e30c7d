// The verbs seam: every libibverbs call the ibverbs/efa transports make goes through VerbsOps, so their logic (QP state
// transitions, WR/SGE building, immediate encoding, MR table, bootstrap) is unit-tested with a fake that records the
// calls (native/tests/transport/ibverbs). real_verbs_ops() forwards to libibverbs.
#pragma once

#include <infiniband/verbs.h>

#include <memory>
#include <string>
#include <vector>

#include "../nic_select.hpp"

namespace uccl_moe::detail {

class VerbsOps {
 public:
  virtual ~VerbsOps() = default;
  virtual std::vector<std::string> device_names() = 0;
  virtual ibv_context* open_device(const std::string& name) = 0;  ///< nullptr + errno on failure
  virtual int close_device(ibv_context* ctx) = 0;
  virtual int query_device(ibv_context* ctx, ibv_device_attr* attr) = 0;
  virtual int query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) = 0;
  virtual int query_gid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) = 0;
  virtual ibv_pd* alloc_pd(ibv_context* ctx) = 0;
  virtual int dealloc_pd(ibv_pd* pd) = 0;
  virtual ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, int access) = 0;
  virtual int dereg_mr(ibv_mr* mr) = 0;
  virtual ibv_cq* create_cq(ibv_context* ctx, int cqe) = 0;
  virtual int destroy_cq(ibv_cq* cq) = 0;
  virtual ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) = 0;
  virtual int destroy_qp(ibv_qp* qp) = 0;
  virtual int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) = 0;
  virtual int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) = 0;
  virtual int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) = 0;
  virtual int poll_cq(ibv_cq* cq, int num, ibv_wc* wc) = 0;

  // Optional calls: the defaults fail with EOPNOTSUPP so every VerbsOps keeps compiling without them.
  /// GID type (IB, RoCE v1, RoCE v2) of one GID table entry: ibv_query_gid_ex, else read_sysfs_gid_type under
  /// UCCL_MOE_SYSFS_ROOT. Returns 0 or an errno.
  virtual int query_gid_type(ibv_context* ctx, uint8_t port, int index, ibv_gid_type* type);
  /// ibv_reg_dmabuf_mr: registers [offset, offset + length) of dma-buf `fd` at virtual address `iova`.
  /// nullptr + errno on failure.
  virtual ibv_mr* reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access);
};

std::shared_ptr<VerbsOps> real_verbs_ops();

/// The text of sysfs ports/<port>/gid_attrs/types/<index> ("IB/RoCE v1", "RoCE v2") as a GID type; false if unknown.
bool parse_sysfs_gid_type(const std::string& text, ibv_gid_type* type);
/// GID type of entry `index` from <sysfs_root>/class/infiniband/<device>/ports/<port>/gid_attrs/types/<index>:
/// 0, ENOENT (no such file) or EINVAL (text parse_sysfs_gid_type does not know).
int read_sysfs_gid_type(const std::string& sysfs_root, const std::string& device, int port, int index,
                        ibv_gid_type* type);

/// EFA devices belong to the efa transport; every other device to ibverbs (the rule: nic_select.hpp is_efa_name).
inline bool is_efa_device(const std::string& name) { return is_efa_name(name); }

/// "ibv_post_send qp=12: Cannot allocate memory (errno 12)" style message for a failed verbs call.
std::string verbs_error(const char* call, int ret_or_errno);

}  // namespace uccl_moe::detail
