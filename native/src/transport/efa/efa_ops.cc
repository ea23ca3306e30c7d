#include "efa_ops.hpp"

#include "transport/ibverbs/verbs_ops.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {

namespace {
class RealEfaOps : public EfaOps {
 public:
  int query_efa_device(ibv_context* c, efadv_device_attr* a) override { return efadv_query_device(c, a, sizeof *a); }
  ibv_qp* create_srd_qp(ibv_context* c, ibv_qp_init_attr_ex* a, const EfaQpInitAttr& e) override {
    EfaQpInitAttr copy = e;
    return efadv_create_qp_ex(c, a, reinterpret_cast<efadv_qp_init_attr*>(&copy), sizeof copy);
  }
  ibv_qp_ex* qp_to_qp_ex(ibv_qp* qp) override { return ibv_qp_to_qp_ex(qp); }
  void wr_start(ibv_qp_ex* q) override { ibv_wr_start(q); }
  void wr_rdma_write(ibv_qp_ex* q, uint32_t rkey, uint64_t ra) override { ibv_wr_rdma_write(q, rkey, ra); }
  void wr_rdma_write_imm(ibv_qp_ex* q, uint32_t rkey, uint64_t ra, __be32 imm) override {
    ibv_wr_rdma_write_imm(q, rkey, ra, imm);
  }
  void wr_set_sge(ibv_qp_ex* q, uint32_t lkey, uint64_t addr, uint32_t len) override {
    ibv_wr_set_sge(q, lkey, addr, len);
  }
  void wr_set_sge_list(ibv_qp_ex* q, size_t n, const ibv_sge* sg) override { ibv_wr_set_sge_list(q, n, sg); }
  void wr_set_ud_addr(ibv_qp_ex* q, ibv_ah* ah, uint32_t qpn, uint32_t qkey) override {
    ibv_wr_set_ud_addr(q, ah, qpn, qkey);
  }
  int wr_complete(ibv_qp_ex* q) override { return ibv_wr_complete(q); }
  ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* a) override { return ibv_create_ah(pd, a); }
  int destroy_ah(ibv_ah* ah) override { return ibv_destroy_ah(ah); }
  int query_ah(ibv_ah* ah, efadv_ah_attr* a) override { return efadv_query_ah(ah, a, sizeof *a); }
};
}  // namespace

std::shared_ptr<EfaOps> real_efa_ops() {
  static std::shared_ptr<EfaOps> ops = std::make_shared<RealEfaOps>();
  return ops;
}

EfaOpsPair resolve_efa_ops(const std::shared_ptr<VerbsOps>& injected) {
  if (!injected) return EfaOpsPair{real_verbs_ops(), real_efa_ops()};
  auto efa = std::dynamic_pointer_cast<EfaOps>(injected);
  UCCL_ASSERT(efa != nullptr, "efa: the injected verbs ops (TransportContext::verbs) do not implement EfaOps");
  return EfaOpsPair{injected, std::move(efa)};
}

}  // namespace uccl_moe::detail
