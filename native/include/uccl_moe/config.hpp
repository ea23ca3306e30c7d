// Tuning configuration of HT dispatch/combine (DeepEP-V1 compatible field names) and the buffer-size math.
//
// NVL buffer layout (one per rank, peers write into it over NVLink / xGMI; `N` local ranks, `C = num_sms / 2`
// channels, `T = num_max_nvl_chunked_recv_tokens` ring slots per (channel, source rank)):
//   [meta]   kNvlMetaBytes                         barrier signals/epoch, abort flag, [N,N] rank counts,
//                                                  per-expert counts, per-(source, lane) prefix, and the
//                                                  tail/head word of every lane ring (offsets and sizes:
//                                                  native/src/kernels/intranode/nvl_layout.hpp)
//   [rings]  C * N * T * nvl_slot_bytes(hidden)    one ring per (channel, source rank), split evenly between the
//                                                  channel's W = warps/N sender warps ("lanes", T/W slots each);
//                                                  a slot (kSlotAlignBytes-aligned) holds one token: x row +
//                                                  slot tail (src idx, kMaxTopk local expert ids, kMaxTopk
//                                                  weights, hidden/128 scales). The kernels' actual slot
//                                                  (SlotLayout) never exceeds nvl_slot_bytes when hidden_bytes =
//                                                  hidden * max(element size, 2) (tests/uccl_moe/backends).
// RDMA buffer layout (only with more than one node; `M` nodes, `Tr = num_max_rdma_chunked_recv_tokens`):
//   [meta]   kRdmaMetaBytes
//   [send]   C * M * Tr * nvl_slot_bytes(hidden)   staging of tokens bound for each node
//   [recv]   C * M * Tr * nvl_slot_bytes(hidden)   landing zone of tokens from each node
#pragma once

#include <cstddef>
#include <cstdint>

#include "uccl_moe/compiler.hpp"

namespace uccl_moe {

constexpr int kMaxTopk = 32;                      // DeepEP-V1 kernels assert num_topk <= 32 too
constexpr int kMaxLocalRanks = 8;                 // NVLink domain we address with one peer-pointer table
constexpr int kMaxExpertsPerRank = 1024;          // per-expert counters in the meta region
constexpr int kFp8ScaleBlock = 128;               // one float32 scale per 128 channels
constexpr size_t kNvlMetaBytes = 1u << 20;        // intranode meta is ~430 KB for N<=8 (static_assert in nvl_layout.hpp)
constexpr size_t kRdmaMetaBytes = 1u << 20;
constexpr size_t kBufferAlignBytes = 128;
// Ring slots and lane rings start on 128-B lines, so a warp's 512-B store of a row covers whole lines and
// 32-B sectors. With a 16-B-aligned stride (14416 B for a BF16 hidden-7168 dispatch slot) every odd slot sat
// 16 B off a sector and 7 of 8 slots off a line: each warp store touched 17 sectors and 5 lines, partial at
// both ends, across NVLink.
constexpr size_t kSlotAlignBytes = 128;

UCCL_HOST_DEVICE_FN constexpr size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
inline constexpr size_t ceil_div(size_t x, size_t y) { return (x + y - 1) / y; }

/// Bytes of one ring slot for tokens of `hidden_bytes` (= hidden * max(element size, 2)).
size_t nvl_slot_bytes(size_t hidden_bytes);

/// DeepEP-V1 `Config`. Construct by keyword from Python: Config(num_sms=24, num_max_nvl_chunked_send_tokens=8, ...).
struct Config {
  int num_sms = 20;
  int num_max_nvl_chunked_send_tokens = 6;
  int num_max_nvl_chunked_recv_tokens = 256;
  int num_max_rdma_chunked_send_tokens = 6;
  int num_max_rdma_chunked_recv_tokens = 256;

  /// Validates (throws InvalidUsage naming the field and the fix) and normalises rdma_recv up to a
  /// multiple of rdma_send, as DeepEP does.
  Config(int num_sms, int nvl_send, int nvl_recv, int rdma_send, int rdma_recv);

  int num_channels() const { return num_sms / 2; }

  /// NVL bytes needed per rank for `num_ranks` ranks of which `num_nvl_ranks` share a node
  /// (num_nvl_ranks <= 0: min(num_ranks, kMaxLocalRanks)).
  size_t get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, int num_nvl_ranks = 0) const;
  /// RDMA bytes needed per rank; 0 when all ranks share one node.
  size_t get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int num_nvl_ranks = 0) const;
};

}  // namespace uccl_moe
