#include "verbs_ops.hpp"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "uccl_moe/env.hpp"

namespace uccl_moe::detail {

namespace {
class RealVerbsOps : public VerbsOps {
 public:
  std::vector<std::string> device_names() override {
    std::vector<std::string> names;
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list) return names;
    for (int i = 0; i < n; ++i) names.emplace_back(ibv_get_device_name(list[i]));
    ibv_free_device_list(list);
    return names;
  }
  ibv_context* open_device(const std::string& name) override {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list) return nullptr;
    ibv_context* ctx = nullptr;
    for (int i = 0; i < n; ++i)
      if (name == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
    ibv_free_device_list(list);
    return ctx;
  }
  int close_device(ibv_context* c) override { return ibv_close_device(c); }
  int query_device(ibv_context* c, ibv_device_attr* a) override { return ibv_query_device(c, a); }
  int query_port(ibv_context* c, uint8_t p, ibv_port_attr* a) override { return ibv_query_port(c, p, a); }
  int query_gid(ibv_context* c, uint8_t p, int i, ibv_gid* g) override { return ibv_query_gid(c, p, i, g); }
  ibv_pd* alloc_pd(ibv_context* c) override { return ibv_alloc_pd(c); }
  int dealloc_pd(ibv_pd* pd) override { return ibv_dealloc_pd(pd); }
  ibv_mr* reg_mr(ibv_pd* pd, void* a, size_t l, int acc) override { return ibv_reg_mr(pd, a, l, acc); }
  int dereg_mr(ibv_mr* mr) override { return ibv_dereg_mr(mr); }
  ibv_cq* create_cq(ibv_context* c, int cqe) override { return ibv_create_cq(c, cqe, nullptr, nullptr, 0); }
  int destroy_cq(ibv_cq* cq) override { return ibv_destroy_cq(cq); }
  ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* a) override { return ibv_create_qp(pd, a); }
  int destroy_qp(ibv_qp* qp) override { return ibv_destroy_qp(qp); }
  int modify_qp(ibv_qp* qp, ibv_qp_attr* a, int m) override { return ibv_modify_qp(qp, a, m); }
  int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) override { return ibv_post_send(qp, wr, bad); }
  int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) override { return ibv_post_recv(qp, wr, bad); }
  int poll_cq(ibv_cq* cq, int n, ibv_wc* wc) override { return ibv_poll_cq(cq, n, wc); }
  int query_gid_type(ibv_context* c, uint8_t p, int i, ibv_gid_type* type) override {
    // man ibv_query_gid_ex: entry.gid_type is IBV_GID_TYPE_{IB,ROCE_V1,ROCE_V2} (rdma-core >= v32).
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(c, p, uint32_t(i), &e, 0) == 0) {
      *type = ibv_gid_type(e.gid_type);
      return 0;
    }
    // Older rdma-core: the kernel's sysfs text, under the same root as every other sysfs reader.
    return read_sysfs_gid_type(env::SYSFS_ROOT(), ibv_get_device_name(c->device), p, i, type);
  }
  ibv_mr* reg_dmabuf_mr(ibv_pd* pd, uint64_t off, size_t len, uint64_t iova, int fd, int acc) override {
    return ibv_reg_dmabuf_mr(pd, off, len, iova, fd, acc);
  }
};
}  // namespace

int VerbsOps::query_gid_type(ibv_context*, uint8_t, int, ibv_gid_type*) { return EOPNOTSUPP; }

ibv_mr* VerbsOps::reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  errno = EOPNOTSUPP;
  return nullptr;
}

bool parse_sysfs_gid_type(const std::string& text, ibv_gid_type* type) {
  if (text.rfind("RoCE v2", 0) == 0) {
    *type = IBV_GID_TYPE_ROCE_V2;
  } else if (text.rfind("IB/RoCE v1", 0) == 0 || text.rfind("RoCE v1", 0) == 0) {
    *type = IBV_GID_TYPE_ROCE_V1;
  } else if (text.rfind("IB", 0) == 0) {
    *type = IBV_GID_TYPE_IB;
  } else {
    return false;
  }
  return true;
}

int read_sysfs_gid_type(const std::string& sysfs_root, const std::string& device, int port, int index,
                        ibv_gid_type* type) {
  // "IB/RoCE v1" or "RoCE v2", as UCCL-EP ep/include/rdma_util.hpp ncclIbRoceGetVersionNum reads it.
  std::ifstream f(sysfs_root + "/class/infiniband/" + device + "/ports/" + std::to_string(port) + "/gid_attrs/types/" +
                  std::to_string(index));
  std::string text;
  if (!f || !std::getline(f, text)) return ENOENT;
  return parse_sysfs_gid_type(text, type) ? 0 : EINVAL;
}

std::shared_ptr<VerbsOps> real_verbs_ops() {
  static std::shared_ptr<VerbsOps> ops = std::make_shared<RealVerbsOps>();
  return ops;
}

std::string verbs_error(const char* call, int ret_or_errno) {
  const int e = ret_or_errno > 0 ? ret_or_errno : errno;
  return std::string(call) + ": " + std::strerror(e) + " (errno " + std::to_string(e) + ")";
}

}  // namespace uccl_moe::detail
