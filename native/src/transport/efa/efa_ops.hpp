// The EFA half of the verbs seam: every efadv / extended-verbs call the efa transport makes goes through EfaOps (the
// plain verbs calls go through VerbsOps), so the transport runs in tests over a strict fake of the efa provider
// (native/tests/transport/fake_nic/efa_fake.hpp). real_efa_ops() forwards to rdma-core's libefa and libibverbs.
#pragma once

#include <infiniband/efadv.h>
#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace uccl_moe::detail {

class VerbsOps;

// efadv ABI values we need that older rdma-core headers (before v50) do not declare; the values are fixed by the
// kernel ABI (rdma-core providers/efa/efadv.h, "values must match efa-abi.h").
constexpr uint32_t kEfaCapRdmaRead = 1u << 0;                ///< EFADV_DEVICE_ATTR_CAPS_RDMA_READ
constexpr uint32_t kEfaCapRnrRetry = 1u << 1;                ///< EFADV_DEVICE_ATTR_CAPS_RNR_RETRY
constexpr uint32_t kEfaCapRdmaWrite = 1u << 3;               ///< EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE
constexpr uint32_t kEfaCapUnsolicitedWriteRecv = 1u << 4;    ///< EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV
constexpr uint16_t kEfaQpFlagUnsolicitedWriteRecv = 1u << 0; ///< EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV

/// struct efadv_qp_init_attr as rdma-core >= v50 lays it out up to `sl` (16 bytes, the same size as the older
/// {comp_mask, driver_qp_type, reserved[4]}: an older libefa sees flags/sl as its reserved bytes and refuses them).
struct EfaQpInitAttr {
  uint64_t comp_mask = 0;
  uint32_t driver_qp_type = 0;  ///< EFADV_QP_DRIVER_TYPE_SRD
  uint16_t flags = 0;           ///< kEfaQpFlag*
  uint8_t sl = 0;               ///< service level of the SRD QP
  uint8_t reserved = 0;
};
static_assert(sizeof(EfaQpInitAttr) == 16, "efadv_qp_init_attr prefix layout");

class EfaOps {
 public:
  virtual ~EfaOps() = default;
  virtual int query_efa_device(ibv_context* ctx, efadv_device_attr* attr) = 0;  ///< efadv_query_device
  /// efadv_create_qp_ex; nullptr + errno on failure.
  virtual ibv_qp* create_srd_qp(ibv_context* ctx, ibv_qp_init_attr_ex* attr, const EfaQpInitAttr& efa) = 0;
  virtual ibv_qp_ex* qp_to_qp_ex(ibv_qp* qp) = 0;
  virtual void wr_start(ibv_qp_ex* qpx) = 0;
  virtual void wr_rdma_write(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) = 0;
  virtual void wr_rdma_write_imm(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, __be32 imm_be) = 0;
  virtual void wr_set_sge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t length) = 0;
  virtual void wr_set_sge_list(ibv_qp_ex* qpx, size_t num_sge, const ibv_sge* sg_list) = 0;
  virtual void wr_set_ud_addr(ibv_qp_ex* qpx, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) = 0;
  virtual int wr_complete(ibv_qp_ex* qpx) = 0;
  virtual ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* attr) = 0;  ///< nullptr + errno on failure
  virtual int destroy_ah(ibv_ah* ah) = 0;
  virtual int query_ah(ibv_ah* ah, efadv_ah_attr* attr) = 0;  ///< efadv_query_ah
};

std::shared_ptr<EfaOps> real_efa_ops();

/// The ops an efa transport runs on: `injected` (a fake that implements both VerbsOps and EfaOps) or, when null, the
/// real libraries. Throws InvalidUsage if `injected` lacks the EFA half.
struct EfaOpsPair {
  std::shared_ptr<VerbsOps> verbs;
  std::shared_ptr<EfaOps> efa;
};
EfaOpsPair resolve_efa_ops(const std::shared_ptr<VerbsOps>& injected);

}  // namespace uccl_moe::detail
