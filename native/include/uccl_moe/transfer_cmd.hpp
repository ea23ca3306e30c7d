// TransferCmd: the 16-byte command a GPU (or a CPU test producer) pushes into a proxy FIFO with one vector store.
// This header is the single declaration of the wire format (STYLE R3); encode()/decode() compile for host and device.
//
// Bit layout (two little-endian 64-bit words; bit 0 = LSB):
//
//   word0  [ 3: 0] op            CmdOp; 0 = EMPTY, so a valid command's word0 is never zero
//          [ 7: 4] flags         kCmdFlag* (meaning depends on op, see below)
//          [19: 8] dst_rank      destination rank, 12 bits (< 4096 ranks)
//          [43:20] bytes         WRITE: payload bytes (< 16 MiB); ATOMIC+LL: expected write count (< 2^20)
//          [51:44] counter_slot  receiver counter slot in the source's block (see below), 8 bits
//          [59:52] counter_value int8 add applied to that counter (WRITE+kCmdFlagCounter, plain ATOMIC)
//          [63:60] reserved (0)
//   word1  [31: 0] src_offset    local source offset >> 2 (4-byte units: 16 GiB addressable)
//          [62:32] dst_offset    remote destination offset >> 2 (31 bits: 8 GiB addressable)
//          [63]    valid         always 1 in an encoded command: a reader that sees word0 but a zero word1 knows the
//                                16-byte store is not visible yet (see Fifo::poll)
//
// Ops:
//   WRITE    copy `bytes` from our registered buffer at src_offset to dst_rank's buffer at dst_offset.
//            kCmdFlagCounter: after this write *and every earlier write of the same FIFO to dst_rank* landed, add
//            counter_value to dst_rank's counter (src_rank, counter_slot)  (HT partial order).
//            kCmdFlagLL: the write belongs to LL group (counter_slot, phase = kCmdFlagPhase) at the receiver; it is
//            counted there for the matching LL fence. LL state lives in the receiving proxy *thread*, so a group's
//            writes and its fence must go through FIFOs of one proxy thread (e.g. FIFO chosen from the expert index).
//   ATOMIC   without kCmdFlagLL: add counter_value to dst_rank's counter (src_rank, counter_slot), ordered after every
//            earlier write of the FIFO to dst_rank (a zero-byte HT counter write).
//            with kCmdFlagLL (LL partial fence): once `bytes` (= expected) LL writes of group (counter_slot, phase)
//            from us landed at dst_rank, add -(expected)-1 to that counter (DeepEP's LL count signal: non-zero means
//            "arrived", the count is -value-1) and forget those writes so the group can be reused.
//   QUIET    retired once every earlier command of this FIFO completed; later commands wait (a drain fence).
//   BARRIER  drain like QUIET, then meet the same proxy thread of every peer (kCmdFlagSameRail: only peers with the
//            same local rank, i.e. the same rail); later commands wait until every peer arrived.
//
// Counters: each rank owns int64 counters[num_ranks * kCountersPerSrc]; an update from source rank s to slot c lands in
// counters[s * kCountersPerSrc + c], applied by the receiving proxy (software atomics) or by the NIC (native atomics).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "uccl_moe/compiler.hpp"

#define UCCL_MOE_HD UCCL_HOST_DEVICE_FN

namespace uccl_moe {

enum class CmdOp : uint8_t { kEmpty = 0, kWrite = 1, kAtomic = 2, kQuiet = 3, kBarrier = 4 };

constexpr uint8_t kCmdFlagCounter = 1u << 0;   ///< WRITE: piggy-backed counter add
constexpr uint8_t kCmdFlagLL = 1u << 1;        ///< WRITE: LL group member; ATOMIC: LL partial fence
constexpr uint8_t kCmdFlagPhase = 1u << 2;     ///< LL double-buffer phase of the group
constexpr uint8_t kCmdFlagSameRail = 1u << 3;  ///< BARRIER: same-rail peers only

// Field widths and shifts (named once; tests round-trip every field at its maximum).
constexpr int kCmdBitsOp = 4, kCmdShiftOp = 0;
constexpr int kCmdBitsFlags = 4, kCmdShiftFlags = 4;
constexpr int kCmdBitsDstRank = 12, kCmdShiftDstRank = 8;
constexpr int kCmdBitsBytes = 24, kCmdShiftBytes = 20;
constexpr int kCmdBitsCounterSlot = 8, kCmdShiftCounterSlot = 44;
constexpr int kCmdBitsCounterValue = 8, kCmdShiftCounterValue = 52;
constexpr int kCmdBitsSrcOffset = 32, kCmdShiftSrcOffset = 0;
constexpr int kCmdBitsDstOffset = 31, kCmdShiftDstOffset = 32;
constexpr int kCmdOffsetShift = 2;  ///< offsets travel in 4-byte units
constexpr uint64_t kCmdValidBit = 1ull << 63;
constexpr int kCountersPerSrc = 1 << kCmdBitsCounterSlot;  ///< counter slots per source rank at a receiver
constexpr uint32_t kCmdMaxRanks = 1u << kCmdBitsDstRank;
constexpr uint32_t kCmdMaxBytes = (1u << kCmdBitsBytes) - 1;
constexpr uint64_t kCmdMaxSrcOffset = ((1ull << kCmdBitsSrcOffset) - 1) << kCmdOffsetShift;
constexpr uint64_t kCmdMaxDstOffset = ((1ull << kCmdBitsDstOffset) - 1) << kCmdOffsetShift;

/// The encoded command: exactly what lies in a FIFO slot.
struct alignas(16) TransferCmd {
  uint64_t word0;
  uint64_t word1;
};
static_assert(sizeof(TransferCmd) == 16, "TransferCmd is one 16-byte vector store");

/// The decoded command (what producers fill and the proxy reads). Offsets are in bytes, multiples of 4.
struct TransferCmdFields {
  CmdOp op = CmdOp::kEmpty;
  uint8_t flags = 0;
  uint32_t dst_rank = 0;
  uint32_t bytes = 0;          ///< WRITE: bytes; ATOMIC+LL: expected write count
  uint8_t counter_slot = 0;
  int8_t counter_value = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
};

namespace detail {
UCCL_MOE_HD constexpr uint64_t cmd_mask(int bits) { return bits >= 64 ? ~0ull : ((1ull << bits) - 1); }
}  // namespace detail

/// Packs fields into the wire format. Fields that do not fit are truncated: host code validates first
/// (check_cmd_fields / encode_checked); device code relies on its producer's own bounds.
UCCL_MOE_HD TransferCmd encode(const TransferCmdFields& f) {
  using detail::cmd_mask;
  TransferCmd c;
  c.word0 = (uint64_t(uint8_t(f.op)) & cmd_mask(kCmdBitsOp)) << kCmdShiftOp |
            (uint64_t(f.flags) & cmd_mask(kCmdBitsFlags)) << kCmdShiftFlags |
            (uint64_t(f.dst_rank) & cmd_mask(kCmdBitsDstRank)) << kCmdShiftDstRank |
            (uint64_t(f.bytes) & cmd_mask(kCmdBitsBytes)) << kCmdShiftBytes |
            (uint64_t(f.counter_slot) & cmd_mask(kCmdBitsCounterSlot)) << kCmdShiftCounterSlot |
            (uint64_t(uint8_t(f.counter_value)) & cmd_mask(kCmdBitsCounterValue)) << kCmdShiftCounterValue;
  c.word1 = ((f.src_offset >> kCmdOffsetShift) & cmd_mask(kCmdBitsSrcOffset)) << kCmdShiftSrcOffset |
            ((f.dst_offset >> kCmdOffsetShift) & cmd_mask(kCmdBitsDstOffset)) << kCmdShiftDstOffset | kCmdValidBit;
  return c;
}

UCCL_MOE_HD TransferCmdFields decode(const TransferCmd& c) {
  using detail::cmd_mask;
  TransferCmdFields f;
  f.op = CmdOp((c.word0 >> kCmdShiftOp) & cmd_mask(kCmdBitsOp));
  f.flags = uint8_t((c.word0 >> kCmdShiftFlags) & cmd_mask(kCmdBitsFlags));
  f.dst_rank = uint32_t((c.word0 >> kCmdShiftDstRank) & cmd_mask(kCmdBitsDstRank));
  f.bytes = uint32_t((c.word0 >> kCmdShiftBytes) & cmd_mask(kCmdBitsBytes));
  f.counter_slot = uint8_t((c.word0 >> kCmdShiftCounterSlot) & cmd_mask(kCmdBitsCounterSlot));
  f.counter_value = int8_t(uint8_t((c.word0 >> kCmdShiftCounterValue) & cmd_mask(kCmdBitsCounterValue)));
  f.src_offset = ((c.word1 >> kCmdShiftSrcOffset) & cmd_mask(kCmdBitsSrcOffset)) << kCmdOffsetShift;
  f.dst_offset = ((c.word1 >> kCmdShiftDstOffset) & cmd_mask(kCmdBitsDstOffset)) << kCmdOffsetShift;
  return f;
}

/// Host-only: throws InvalidUsage naming the first field that does not fit (or an op/flag combination that makes no
/// sense). LL fences' expected count must also fit the immediate (kImmLLBitsExpected, 20 bits:
/// native/src/proxy/ordering.hpp).
void check_cmd_fields(const TransferCmdFields& f);
/// check_cmd_fields + encode.
TransferCmd encode_checked(const TransferCmdFields& f);
/// "WRITE dst=3 bytes=4096 src=0x100 dst_off=0x2000 counter[5]+=1" (diagnostics).
std::string describe(const TransferCmdFields& f);
const char* cmd_op_name(CmdOp op);

}  // namespace uccl_moe
