#include "uccl_moe/transfer_cmd.hpp"

#include "uccl_moe/error.hpp"
#include "../proxy/ordering.hpp"

namespace uccl_moe {

const char* cmd_op_name(CmdOp op) {
  switch (op) {
    case CmdOp::kEmpty: return "EMPTY";
    case CmdOp::kWrite: return "WRITE";
    case CmdOp::kAtomic: return "ATOMIC";
    case CmdOp::kQuiet: return "QUIET";
    case CmdOp::kBarrier: return "BARRIER";
  }
  return "INVALID";
}

void check_cmd_fields(const TransferCmdFields& f) {
  UCCL_ASSERT(f.op == CmdOp::kWrite || f.op == CmdOp::kAtomic || f.op == CmdOp::kQuiet || f.op == CmdOp::kBarrier,
              "op=%d is not WRITE/ATOMIC/QUIET/BARRIER", int(f.op));
  UCCL_ASSERT(f.flags < (1u << kCmdBitsFlags), "flags=0x%x exceeds %d bits", f.flags, kCmdBitsFlags);
  UCCL_ASSERT(f.dst_rank < kCmdMaxRanks, "dst_rank=%u exceeds the %u ranks a command can address", f.dst_rank,
              kCmdMaxRanks);
  UCCL_ASSERT(f.bytes <= kCmdMaxBytes, "bytes=%u exceeds %u (24 bits); split the transfer", f.bytes, kCmdMaxBytes);
  UCCL_ASSERT(f.src_offset % 4 == 0 && f.dst_offset % 4 == 0,
              "src_offset=%llu dst_offset=%llu must be multiples of 4", (unsigned long long)f.src_offset,
              (unsigned long long)f.dst_offset);
  UCCL_ASSERT(f.src_offset <= kCmdMaxSrcOffset, "src_offset=%llu exceeds %llu", (unsigned long long)f.src_offset,
              (unsigned long long)kCmdMaxSrcOffset);
  UCCL_ASSERT(f.dst_offset <= kCmdMaxDstOffset, "dst_offset=%llu exceeds %llu", (unsigned long long)f.dst_offset,
              (unsigned long long)kCmdMaxDstOffset);
  if (f.op == CmdOp::kAtomic && (f.flags & kCmdFlagLL))
    UCCL_ASSERT(f.bytes <= detail::kImmLLMaxExpected, "LL fence expected=%u exceeds %u (20-bit immediate field)",
                f.bytes, detail::kImmLLMaxExpected);
  if (f.op == CmdOp::kWrite)
    UCCL_ASSERT(!((f.flags & kCmdFlagCounter) && (f.flags & kCmdFlagLL)),
                "a WRITE is either HT (kCmdFlagCounter) or LL (kCmdFlagLL), not both (flags=0x%x)", f.flags);
}

TransferCmd encode_checked(const TransferCmdFields& f) {
  check_cmd_fields(f);
  return encode(f);
}

std::string describe(const TransferCmdFields& f) {
  std::string s = detail::format("%s dst_rank=%u", cmd_op_name(f.op), f.dst_rank);
  if (f.op == CmdOp::kWrite) {
    s += detail::format(" bytes=%u src_offset=0x%llx dst_offset=0x%llx", f.bytes, (unsigned long long)f.src_offset,
                        (unsigned long long)f.dst_offset);
    if (f.flags & kCmdFlagCounter) s += detail::format(" counter[%u]+=%d", f.counter_slot, f.counter_value);
    if (f.flags & kCmdFlagLL) s += detail::format(" ll_group=%u phase=%d", f.counter_slot, (f.flags & kCmdFlagPhase) ? 1 : 0);
  } else if (f.op == CmdOp::kAtomic) {
    if (f.flags & kCmdFlagLL)
      s += detail::format(" ll_fence group=%u phase=%d expected=%u", f.counter_slot, (f.flags & kCmdFlagPhase) ? 1 : 0,
                          f.bytes);
    else
      s += detail::format(" counter[%u]+=%d", f.counter_slot, f.counter_value);
  } else if (f.op == CmdOp::kBarrier && (f.flags & kCmdFlagSameRail)) {
    s += " same_rail";
  }
  return s;
}

}  // namespace uccl_moe
