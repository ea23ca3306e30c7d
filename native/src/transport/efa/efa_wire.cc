// The pure pieces of the efa transport: its bootstrap exchange format and the plan of one RDMA write.
#include <arpa/inet.h>

#include "efa_detail.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {

namespace {
constexpr uint32_t kMagic = 0x45464131;  // "EFA1"
constexpr uint16_t kVersion = 2;  // 2: device index and the data region's MR chunks (several devices per GPU)
}  // namespace

std::string encode_efa_info(const EfaPeerInfo& in) {
  BlobWriter w(kMagic, kVersion);
  w.bytes(in.gid, 16).u32(in.qpn).u32(in.qkey).u32(in.device).u64(in.data_addr).u64(in.data_bytes);
  w.u32(uint32_t(in.chunks.size()));
  for (const RemoteMr& c : in.chunks) w.u64(c.addr).u64(c.bytes).u32(c.rkey);
  return w.data();
}

EfaPeerInfo decode_efa_info(const std::string& blob) {
  BlobReader r(blob, kMagic, kVersion, "efa");
  EfaPeerInfo o;
  r.bytes(o.gid, 16);
  o.qpn = r.u32();
  o.qkey = r.u32();
  o.device = r.u32();
  o.data_addr = r.u64();
  o.data_bytes = r.u64();
  const uint32_t n = r.u32();
  if (n > kEfaMaxChunks) UCCL_THROW(kTransport, "efa blob lists %u memory chunks (at most %u)", n, kEfaMaxChunks);
  o.chunks.resize(n);
  for (RemoteMr& c : o.chunks) {
    c.addr = r.u64();
    c.bytes = r.u64();
    c.rkey = r.u32();
  }
  if (!r.done()) UCCL_THROW(kTransport, "efa blob has trailing bytes (%zu)", blob.size());
  // The chunks must tile the region in order: the post path looks them up by address.
  uint64_t next = o.data_addr;
  for (const RemoteMr& c : o.chunks) {
    if (c.addr != next || c.bytes == 0)
      UCCL_THROW(kTransport, "efa blob: memory chunks do not tile [0x%llx, +%llu)", (unsigned long long)o.data_addr,
                 (unsigned long long)o.data_bytes);
    next += c.bytes;
  }
  if (!o.chunks.empty() && next != o.data_addr + o.data_bytes)
    UCCL_THROW(kTransport, "efa blob: memory chunks cover %llu of %llu bytes", (unsigned long long)(next - o.data_addr),
               (unsigned long long)o.data_bytes);
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
