// Timeout diagnostics. Every bounded wait that expires (GPU or CPU) fills one DiagRecord, which the host
// turns into a CommTimeoutError message naming rank, peer, channel, phase and the counters it waited on.
// The GPU writes it into host-mapped memory (so it survives a trapped context); `valid` is written last
// with a system-scope release (pairs with the acquire in read_diag()).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "uccl_moe/compiler.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {

/// Where a wait happened. Append only: the numbers are part of the record's format.
enum class DiagPhase : int32_t {
  kNone = 0,
  kBarrier = 1,             ///< intranode barrier between local ranks
  kNotifyCounts = 2,        ///< waiting for peers' token counts (notify)
  kHostRecvCounts = 3,      ///< host waiting for the GPU to publish receive counts
  kDispatchSendRoom = 4,    ///< sender waiting for room in a peer's ring (head)
  kDispatchRecvTokens = 5,  ///< receiver waiting for tokens (tail)
  kCombineSendRoom = 6,
  kCombineRecvTokens = 7,
  kFifoFull = 8,            ///< GPU producer waiting for a free FIFO slot
  kFifoCompletion = 9,      ///< waiting for a FIFO command to be completed by the proxy
  kProxyCompletion = 10,    ///< proxy waiting for a transport completion
  kProxyOrdering = 11,      ///< proxy holding a counter update for missing earlier writes
  kRdmaRecvTokens = 12,     ///< internode receiver waiting for tokens from a node
  kForwarder = 13,          ///< internode forwarder waiting for NVLink room / RDMA data
  kRdmaCapacity = 14,       ///< not a wait: an internode area needs more rows than the RDMA buffer holds
  kDispatchPublish = 15,    ///< dispatch direct warp waiting for its lane's sender warps to finish (TailPublisher)
  kCombinePullStart = 16,   ///< combine from the buffer: waiting for a peer's inputs (its start release)
  kCombinePullDone = 17,    ///< combine from the buffer: waiting for a peer to stop reading our buffer
  kCombinePullArgs = 18,    ///< not a wait: a peer's pull combine staged another number of top-k weights or read
                            ///< another kind or hidden size of x (expected/seen: the kPullArgs* fields below)
  kDispatchDirectEnter = 19,   ///< ring-free dispatch: waiting for a peer to begin it (before writing its buffer)
  kDispatchDirectLanded = 20,  ///< ring-free dispatch: waiting for a peer's rows to land in our buffer
  kDispatchDirectDone = 21,    ///< ring-free dispatch: waiting for a peer to stop reading its buffer
  kDispatchDirectArgs = 22,    ///< not a wait: a peer's ring-free dispatch laid out another landing area (or a row
                               ///< fell outside ours)
  kCombineCeChunk = 23,        ///< copy-engine combine: waiting for a chunk of a peer's rows to land in our buffer
  kDispatchCeChunk = 24,       ///< copy-engine dispatch: waiting for a chunk of a peer's tokens to land in our buffer
  kDispatchArgs = 25,          ///< not a wait: notify found a peer's dispatch rows laid out otherwise (expected/seen:
                               ///< dispatch_rows_code values, below) or its num_experts other (kDispatchArgsExperts)
  kCeSentinel = 26,            ///< early polled copy-engine combine: waiting for a peer's side memset (its landing
                               ///< area set to the sentinel again; expected/seen: its count of them) before storing
                               ///< into that area
  kDispatchCeSentinel = 27,    ///< the same wait before an early polled copy-engine dispatch
  kDispatchCeEnter = 28,       ///< copy-engine dispatch: waiting for a peer to enter it (the combine's is
                               ///< kCombinePullStart: both ops share these hand-shake words)
  kDispatchCeDone = 29,        ///< copy-engine dispatch: waiting for a peer to finish with our buffer
};

/// Bit of a kCombinePullArgs value: the rank combines a tensor of its own, staged (compacted buffer layout), not its
/// get_combine_buffer view; the low bits are the top-k weights it staged per row.
constexpr int32_t kPullArgsStaged = 1 << 16;
/// Bit of a kCombinePullArgs value: the rank combines a tensor of its own through the copy engines
/// (UCCL_MOE_COMBINE_CE); the low bits are the top-k weights per row it sends.
constexpr int32_t kPullArgsCe = 1 << 17;
/// Bit of a copy-engine combine's kCombinePullArgs value: its landing areas are polled (UCCL_MOE_CE_POLL: one copy
/// per peer, each word taken as it lands); every rank must do alike (a rank that polls reads words its peer's
/// chunks have not written yet as final).
constexpr int32_t kPullArgsPoll = 1 << 18;
/// The top-k part of a kCombinePullArgs value (num_topk <= kMaxTopk = 32).
constexpr int32_t kPullArgsTopkMask = (1 << 6) - 1;
/// The rows' hidden size in a kCombinePullArgs value, as hidden / 8 (16-byte BF16 groups; every rank must lay its rows
/// out alike: a peer reading rows of another size sums the wrong values): its low 10 bits in bits [6, 16), the next
/// 6 in bits [24, 30) (bit 30 marks a dispatch's value), so hidden sizes below 2^19 compare exactly.
constexpr int kPullArgsHiddenShift = 6;
constexpr int kPullArgsHiddenHighShift = 24;
constexpr int32_t kPullArgsHiddenMask = (((1 << 10) - 1) << kPullArgsHiddenShift) |
                                        (((1 << 6) - 1) << kPullArgsHiddenHighShift);
/// The hidden bits of a kCombinePullArgs value for rows of `hidden` BF16 values.
UCCL_HOST_DEVICE_FN constexpr int32_t pull_args_hidden(int64_t hidden) {
  const int64_t code = hidden / 8;
  return static_cast<int32_t>((((code & 1023) << kPullArgsHiddenShift) |
                               (((code >> 10) & 63) << kPullArgsHiddenHighShift)));
}
/// The hidden size (modulo 2^19) a kCombinePullArgs value carries.
constexpr int64_t pull_args_hidden_of(int64_t value) {
  return (((value >> kPullArgsHiddenShift) & 1023) | (((value >> kPullArgsHiddenHighShift) & 63) << 10)) * 8;
}
/// Bits [20, 23) of a copy-engine combine's kCombinePullArgs value: its chunks per peer block, less one (every rank
/// must split alike: a reader maps rows to chunks by its own count).
constexpr int kPullArgsChunksShift = 20;
/// Bit 30 of a copy-engine dispatch's checked value (dispatch_ce.cu): no combine value sets it, so a rank whose peer
/// runs the other op of the two sees it differ.
constexpr int32_t kCeDispatchArgsMark = 1 << 30;
/// Bit 29 of a copy-engine dispatch's checked value: the gather polls its landing area (UCCL_MOE_DISPATCH_CE_POLL); the
/// value's other fields: chunks less one in bits [26, 29), scales in [16, 26), the row's 16-B words in [0, 16).
constexpr int32_t kCeDispatchArgsPoll = 1 << 29;
static_assert((kCeDispatchArgsPoll & ((7 << 26) | (0x3FF << 16) | 0xFFFF | kCeDispatchArgsMark)) == 0,
              "the poll bit of a copy-engine dispatch's value overlaps its other fields");
static_assert((kPullArgsTopkMask & kPullArgsHiddenMask) == 0 && (kPullArgsHiddenMask & kPullArgsStaged) == 0 &&
                  (kPullArgsHiddenMask & kPullArgsCe) == 0 && (kPullArgsHiddenMask & kPullArgsPoll) == 0 &&
                  (kPullArgsHiddenMask & (7 << kPullArgsChunksShift)) == 0 &&
                  ((kPullArgsTopkMask | kPullArgsHiddenMask | kPullArgsStaged | kPullArgsCe | kPullArgsPoll |
                    (7 << kPullArgsChunksShift)) & (kCeDispatchArgsMark | static_cast<int32_t>(1u << 31))) == 0,
              "the fields of a kCombinePullArgs value overlap, or reach the dispatch's mark or the sign bit");

/// A dispatch's rows as notify compares them between the ranks before any row moves (a kDispatchArgs value): the
/// row's bytes, top-k entries and scales per row. Ranks that disagree would read each other's rows at the wrong
/// offsets. Never 0 (0 = not compared).
UCCL_HOST_DEVICE_FN constexpr int64_t dispatch_rows_code(int64_t row_bytes, int num_topk, int num_scales) {
  return (int64_t{1} << 62) | (static_cast<int64_t>(num_scales & 0xFFFFF) << 38) |
         (static_cast<int64_t>(num_topk & 63) << 32) | (row_bytes & 0xFFFFFFFF);
}
static_assert(dispatch_rows_code(0xFFFFFFFF, 0, 0) == ((int64_t{1} << 62) | 0xFFFFFFFF) &&
                  dispatch_rows_code(0, 63, 0) == ((int64_t{1} << 62) | (int64_t{63} << 32)) &&
                  dispatch_rows_code(0, 0, 0xFFFFF) == ((int64_t{1} << 62) | (int64_t{0xFFFFF} << 38)) &&
                  (int64_t{0xFFFFF} << 38) < (int64_t{1} << 62),
              "the fields of a dispatch rows code overlap, or reach its marker bit");
constexpr int64_t dispatch_rows_bytes(int64_t code) { return code & 0xFFFFFFFF; }
/// Bits of a kDispatchArgs record's `command`: num_worst_tokens (nothing waited for notify's counts, so the dispatch
/// ran on), and expected/seen are num_experts rather than rows codes.
constexpr uint64_t kDispatchArgsRanOn = 1;
constexpr uint64_t kDispatchArgsExperts = 2;
constexpr int64_t dispatch_rows_topk(int64_t code) { return (code >> 32) & 63; }
constexpr int64_t dispatch_rows_scales(int64_t code) { return (code >> 38) & 0xFFFFF; }

const char* diag_phase_name(DiagPhase phase);

/// Who waited. Append only: the numbers are part of the record's format.
enum class DiagRole : int32_t {
  kHost = 0,         ///< a host thread (Python's call, a FIFO producer on the CPU)
  kSender = 1,       ///< a kernel's sending warp / block
  kReceiver = 2,     ///< a kernel's receiving warp / block
  kForwarder = 3,    ///< the internode forwarder
  kCoordinator = 4,  ///< a barrier or notify coordinator
  kProxy = 5,        ///< a CPU proxy thread
  kLaunchEnd = 6,    ///< not a wait: a launch that ended with the abort flag up and no record (record_if_aborted)
};

const char* diag_role_name(DiagRole role);

/// DiagRecord::valid while a GPU thread fills the record (report_timeout claims it 0 -> this, then releases 1).
constexpr int32_t kDiagRecordWriting = 2;

/// 64 bytes, host-mapped; written by one thread of the first waiter that gives up. Fill it by field name
/// (DiagRecord{.valid = 1, .rank = r, ...}); unnamed fields stay zero.
struct DiagRecord {
  int32_t valid = 0;                  ///< 0 = empty; 1 = filled (written last); kDiagRecordWriting = being filled
  int32_t rank = 0;                   ///< rank that gave up waiting
  int32_t peer = 0;                   ///< rank (or node) it waited for; -1 = all
  int32_t channel = 0;                ///< channel / FIFO index; -1 = n/a
  DiagPhase phase = DiagPhase::kNone;
  DiagRole role = DiagRole::kHost;
  int64_t expected = 0;               ///< value it waited for (e.g. tail >= expected)
  int64_t seen = 0;                   ///< last value it saw
  uint64_t command = 0;               ///< op-specific: FIFO slot index, encoded TransferCmd, call sequence number
  double waited_s = 0;                ///< how long it waited
  int32_t drained = 0;                ///< 1: it gave up because the launch was already aborted (a peer, or another
                                      ///< waiter of this rank, raised the abort flag first), not on its own clock
  int32_t reserved = 0;
};
static_assert(sizeof(DiagRecord) == 64, "DiagRecord is a fixed 64-byte wire format");
static_assert(std::is_trivially_copyable_v<DiagRecord>, "DiagRecord is copied out of host-mapped memory");

/// The first top-k expert id outside [-1, num_experts) a kernel met: a usage error, not a wait, so it raises no abort
/// flag and the Buffer stays usable (the kernels skip such an id as if it were -1 and never index memory with it).
/// 32 bytes, host-mapped; the first writer claims it (state 0 -> 1), fills it and releases state = 2 last; the host
/// reads it without a device sync where it waits on the GPU anyway, raises InvalidUsageError and clears it.
struct TopkFault {
  int32_t state = 0;        ///< 0 = empty, 1 = being written, 2 = filled
  int32_t token = 0;        ///< row of topk_idx
  int32_t k = 0;            ///< column of topk_idx
  int32_t num_experts = 0;  ///< the valid range is [-1, num_experts)
  int64_t value = 0;        ///< the id found there
  int64_t reserved = 0;
};
static_assert(sizeof(TopkFault) == 32, "TopkFault is a fixed 32-byte wire format");
static_assert(std::is_trivially_copyable_v<TopkFault>, "TopkFault is copied out of host-mapped memory");

/// The error a filled record stands for: kInvalidUsage for the phases that are not waits but a wrong argument seen
/// on the device (kRdmaCapacity, kCombinePullArgs), kTimeout for every wait.
ErrorCode diag_error_code(const DiagRecord& rec);

/// "rank 3 timed out after 100.0 s in dispatch/recv-tokens (receiver) waiting for peer 1 on channel 5:
///  expected 812, saw 640 (command 0x...)". Suggests the knob to raise.
std::string format_diag(const DiagRecord& rec);

}  // namespace uccl_moe
