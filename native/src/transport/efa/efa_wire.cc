// The pure pieces of the efa transport: its bootstrap exchange format and the plan of one RDMA write.
#include <arpa/inet.h>

#include "efa_detail.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kMagic = 0x45464131;  // "EFA1"
constexpr uint16_t kVersion = 1;
}  // namespace

std::string encode_efa_info(const EfaPeerInfo& in) {
  BlobWriter w(kMagic, kVersion);
  w.bytes(in.gid, 16).u32(in.qpn).u32(in.qkey);
  w.u64(in.data_addr).u64(in.data_bytes).u32(in.data_rkey).u64(in.ctr_addr).u64(in.ctr_bytes).u32(in.ctr_rkey);
  return w.data();
}

EfaPeerInfo decode_efa_info(const std::string& blob) {
  BlobReader r(blob, kMagic, kVersion, "efa");
  EfaPeerInfo o;
  r.bytes(o.gid, 16);
  o.qpn = r.u32();
  o.qkey = r.u32();
  o.data_addr = r.u64();
  o.data_bytes = r.u64();
  o.data_rkey = r.u32();
  o.ctr_addr = r.u64();
  o.ctr_bytes = r.u64();
  o.ctr_rkey = r.u32();
  if (!r.done()) UCCL_THROW(kTransport, "efa blob has trailing bytes (%zu)", blob.size());
  return o;
}

std::string build_efa_wr(const WorkRequest& in, const LocalMr& data, const RemoteMr& rdata, const EfaPeerInfo& peer,
                         EfaWrPlan* p) {
  if (in.op == WrOp::kAtomicAdd) return "efa has no native atomics (the proxy emulates them with immediates)";
  if (std::string err = check_write_bounds(in, data, rdata); !err.empty()) return err;
  *p = EfaWrPlan{};
  p->wr_id = in.wr_id;
  p->with_imm = in.op == WrOp::kWriteImm;
  p->rkey = rdata.rkey;
  p->remote_addr = rdata.addr + in.remote_offset;
  p->imm_be = htonl(in.imm);
  p->lkey = data.lkey;
  p->local_addr = data.addr + in.local_offset;
  p->length = in.bytes;
  p->remote_qpn = peer.qpn;
  p->qkey = peer.qkey;
  return "";
}

}  // namespace uccl_moe::detail
