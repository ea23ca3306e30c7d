#include "uccl_moe/config.hpp"

#include <algorithm>

#include "uccl_moe/error.hpp"

namespace uccl_moe {

size_t nvl_slot_bytes(size_t hidden_bytes) {
  const size_t num_scales = ceil_div(hidden_bytes / 2, kFp8ScaleBlock);  // hidden_bytes counts 2 B per channel
  const size_t tail = sizeof(int32_t)                                    // source token index
                      + kMaxTopk * sizeof(int32_t)                       // local expert ids (-1 = elsewhere)
                      + kMaxTopk * sizeof(float)                         // top-k weights
                      + num_scales * sizeof(float);                      // FP8 scales
  return align_up(align_up(hidden_bytes, 16) + tail, kSlotAlignBytes);
}

Config::Config(int num_sms_, int nvl_send, int nvl_recv, int rdma_send, int rdma_recv)
    : num_sms(num_sms_),
      num_max_nvl_chunked_send_tokens(nvl_send),
      num_max_nvl_chunked_recv_tokens(nvl_recv),
      num_max_rdma_chunked_send_tokens(rdma_send),
      num_max_rdma_chunked_recv_tokens(rdma_recv) {
  UCCL_ASSERT(num_sms > 0 && num_sms % 2 == 0 && num_sms <= 256,
              "Config(num_sms=%d): num_sms must be an even number in [2, 256] (one sender and one receiver SM per "
              "channel)", num_sms);
  UCCL_ASSERT(nvl_send > 0 && nvl_recv > 0 && rdma_send > 0 && rdma_recv > 0,
              "Config: chunk sizes must be positive (got nvl_send=%d nvl_recv=%d rdma_send=%d rdma_recv=%d)", nvl_send,
              nvl_recv, rdma_send, rdma_recv);
  UCCL_ASSERT(nvl_send < nvl_recv,
              "Config: num_max_nvl_chunked_send_tokens (%d) must be smaller than num_max_nvl_chunked_recv_tokens (%d)",
              nvl_send, nvl_recv);
  // Round rdma_recv up to a multiple of rdma_send (DeepEP does the same), then require two chunks of room.
  num_max_rdma_chunked_recv_tokens = static_cast<int>(align_up(rdma_recv, rdma_send));
  UCCL_ASSERT(rdma_send <= num_max_rdma_chunked_recv_tokens / 2,
              "Config: num_max_rdma_chunked_send_tokens (%d) must be at most half of "
              "num_max_rdma_chunked_recv_tokens (%d)", rdma_send, num_max_rdma_chunked_recv_tokens);
}

namespace {
void check_ranks(size_t hidden_bytes, int num_ranks, int& num_nvl_ranks) {
  UCCL_ASSERT(hidden_bytes > 0 && hidden_bytes % 16 == 0,
              "hidden_bytes=%zu must be a positive multiple of 16 (hidden * max(element_size, 2))", hidden_bytes);
  UCCL_ASSERT(num_ranks >= 1, "num_ranks=%d must be >= 1", num_ranks);
  if (num_nvl_ranks <= 0) num_nvl_ranks = std::min(num_ranks, kMaxLocalRanks);
  UCCL_ASSERT(num_nvl_ranks <= kMaxLocalRanks && num_ranks % num_nvl_ranks == 0,
              "num_ranks=%d with %d ranks per node: ranks per node must divide the world and be <= %d", num_ranks,
              num_nvl_ranks, kMaxLocalRanks);
}
}  // namespace

size_t Config::get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks, int num_nvl_ranks) const {
  check_ranks(hidden_bytes, num_ranks, num_nvl_ranks);
  const size_t rings = static_cast<size_t>(num_channels()) * num_nvl_ranks * num_max_nvl_chunked_recv_tokens *
                       nvl_slot_bytes(hidden_bytes);
  return align_up(kNvlMetaBytes + rings, kBufferAlignBytes);
}

size_t Config::get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int num_nvl_ranks) const {
  check_ranks(hidden_bytes, num_ranks, num_nvl_ranks);
  const int num_nodes = num_ranks / num_nvl_ranks;
  if (num_nodes <= 1) return 0;
  const size_t one_way = static_cast<size_t>(num_channels()) * num_nodes * num_max_rdma_chunked_recv_tokens *
                         nvl_slot_bytes(hidden_bytes);
  return align_up(kRdmaMetaBytes + 2 * one_way, kBufferAlignBytes);
}

}  // namespace uccl_moe
