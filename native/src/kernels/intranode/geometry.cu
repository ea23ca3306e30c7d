// Lane geometry, NVL size check and the copy-engine peer copy (benchmark ceiling).
#include <algorithm>

#include "intranode_device.cuh"
#include "uccl_moe/env.hpp"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::intranode {

int lanes_per_channel(int num_ranks) {
  UCCL_ASSERT(num_ranks >= 1 && num_ranks <= kMaxLocalRanks, "num_ranks=%d outside 1..%d", num_ranks, kMaxLocalRanks);
  return kWarpsPerBlock / num_ranks;
}

Geometry make_geometry(int num_sms, int num_ranks, int nvl_send_tokens, int nvl_recv_tokens) {
  UCCL_ASSERT(num_sms >= 2 && num_sms % 2 == 0, "Config.num_sms=%d must be even and >= 2", num_sms);
  Geometry g{};
  g.num_channels = num_sms / 2;
  g.lanes_per_channel = lanes_per_channel(num_ranks);
  g.num_lanes = g.num_channels * g.lanes_per_channel;
  UCCL_ASSERT(g.num_lanes <= kMaxLanes, "Config.num_sms=%d gives %d lanes for %d ranks; at most %d are supported: "
              "lower num_sms", num_sms, g.num_lanes, num_ranks, kMaxLanes);
  g.channel_slots = nvl_recv_tokens;
  g.lane_slots = nvl_recv_tokens / g.lanes_per_channel;
  UCCL_ASSERT(g.lane_slots >= 2,
              "Config.num_max_nvl_chunked_recv_tokens=%d leaves %d slots per lane with %d lanes per channel (%d ranks); "
              "raise it to at least %d", nvl_recv_tokens, g.lane_slots, g.lanes_per_channel, num_ranks,
              2 * g.lanes_per_channel);
  UCCL_ASSERT(nvl_send_tokens >= 1, "Config.num_max_nvl_chunked_send_tokens=%d must be >= 1", nvl_send_tokens);
  g.chunk_tokens = nvl_send_tokens < g.lane_slots ? nvl_send_tokens : g.lane_slots;
  return g;
}

CombineSplit combine_split(const Geometry& g, int num_ranks, int senders) {
  const int blocks = 2 * g.num_channels;
  CombineSplit s{};
  s.num_lanes = g.num_lanes;
  s.peers = num_ranks - 1;
  const int pairs = s.num_pairs();
  // One warp per pair, and no receiver block without a lane (only possible where W = 1: 64-wide warps at EP7-8).
  const int min_senders = std::max((pairs + kWarpsPerBlock - 1) / kWarpsPerBlock, blocks - g.num_lanes);
  const int min_receivers = (g.num_lanes + kWarpsPerBlock - 1) / kWarpsPerBlock;  // one warp per lane
  const int max_senders = blocks - min_receivers;
  if (senders <= 0) senders = pairs == 0 ? 0 : g.num_channels;  // built-in: one block per channel each way
  UCCL_ASSERT(senders >= min_senders && senders <= max_senders,
              "UCCL_MOE_COMBINE_SENDER_SMS=%d: with Config.num_sms=%d and %d local ranks combine needs %d..%d sender "
              "blocks (%d remote lane pairs at one warp each, %d lanes at one receiver warp each and at least one lane per "
              "receiver block); unset it for the built-in split", senders, blocks, num_ranks, min_senders, max_senders,
              pairs, g.num_lanes);
  s.senders = senders;
  s.receivers = blocks - senders;
  return s;
}

Geometry place_lanes(Geometry g, int num_ranks, int64_t num_nvl_bytes) {
  const int64_t rings = static_cast<int64_t>(g.num_lanes) * num_ranks;
  g.lane_region_bytes = (num_nvl_bytes - static_cast<int64_t>(kNvlMetaBytes)) / rings / kSlotAlignBytes * kSlotAlignBytes;
  g.num_ranks = num_ranks;
  g.num_nvl_bytes = num_nvl_bytes;
  return g;
}

Geometry placed_geometry(int num_sms, int num_ranks, int nvl_send_tokens, int nvl_recv_tokens, int64_t num_nvl_bytes) {
  return place_lanes(make_geometry(num_sms, num_ranks, nvl_send_tokens, nvl_recv_tokens), num_ranks, num_nvl_bytes);
}

void check_geometry(const NvlContext& ctx, const Geometry& g, const char* op) {
  UCCL_ASSERT(g.num_ranks == ctx.num_ranks && g.num_nvl_bytes == ctx.num_nvl_bytes,
              "%s: the lane geometry was placed for %d ranks and %lld NVL bytes, but this buffer has %d ranks and "
              "%lld bytes; take it from this buffer's NvlRuntime.geometry", op, g.num_ranks,
              static_cast<long long>(g.num_nvl_bytes), ctx.num_ranks, static_cast<long long>(ctx.num_nvl_bytes));
}

int64_t required_nvl_bytes(const Geometry& g, int num_ranks, const SlotLayout& slot) {
  return static_cast<int64_t>(kNvlMetaBytes) +
         static_cast<int64_t>(g.num_channels) * num_ranks * g.channel_slots * slot.bytes;
}

void launch_peer_copy(const NvlContext& ctx, int peer, int64_t bytes, void* stream) {
  UCCL_ASSERT(peer >= 0 && peer < ctx.num_ranks, "peer=%d outside [0, %d)", peer, ctx.num_ranks);
  const int64_t avail = ctx.num_nvl_bytes - static_cast<int64_t>(kNvlMetaBytes);
  UCCL_ASSERT(bytes > 0 && bytes <= avail, "peer copy of %lld bytes: the ring region holds %lld",
              static_cast<long long>(bytes), static_cast<long long>(avail));
  // Source and destination are both ring regions (never the meta words the barrier uses).
  char* src = static_cast<char*>(ctx.buffers[ctx.rank]) + kNvlMetaBytes;
  char* dst = static_cast<char*>(ctx.buffers[peer]) + kNvlMetaBytes;
  UCCL_CHECK_GPU(gpu::memcpy_async(dst, src, static_cast<size_t>(bytes), static_cast<gpu::Stream>(stream)));
}

}  // namespace uccl_moe::intranode
