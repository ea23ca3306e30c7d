#include "uccl_moe/diag.hpp"

#include "uccl_moe/error.hpp"

namespace uccl_moe {

const char* diag_phase_name(DiagPhase phase) {
  switch (phase) {
    case DiagPhase::kNone: return "none";
    case DiagPhase::kBarrier: return "barrier";
    case DiagPhase::kNotifyCounts: return "notify/counts";
    case DiagPhase::kHostRecvCounts: return "host/recv-counts";
    case DiagPhase::kDispatchSendRoom: return "dispatch/send-room";
    case DiagPhase::kDispatchRecvTokens: return "dispatch/recv-tokens";
    case DiagPhase::kCombineSendRoom: return "combine/send-room";
    case DiagPhase::kCombineRecvTokens: return "combine/recv-tokens";
    case DiagPhase::kFifoFull: return "fifo/full";
    case DiagPhase::kFifoCompletion: return "fifo/completion";
    case DiagPhase::kProxyCompletion: return "proxy/completion";
    case DiagPhase::kProxyOrdering: return "proxy/ordering";
    case DiagPhase::kRdmaRecvTokens: return "rdma/recv-tokens";
    case DiagPhase::kForwarder: return "forwarder";
    case DiagPhase::kRdmaCapacity: return "rdma/capacity";
    case DiagPhase::kDispatchPublish: return "dispatch/publish";
    case DiagPhase::kCombinePullStart: return "combine/pull-start";
    case DiagPhase::kCombinePullDone: return "combine/pull-done";
    case DiagPhase::kCombinePullArgs: return "combine/pull-args";
    case DiagPhase::kDispatchDirectEnter: return "dispatch/direct-enter";
    case DiagPhase::kDispatchDirectLanded: return "dispatch/direct-landed";
    case DiagPhase::kDispatchDirectDone: return "dispatch/direct-done";
    case DiagPhase::kDispatchDirectArgs: return "dispatch/direct-args";
    case DiagPhase::kCombineCeChunk: return "combine/ce-chunk";
    case DiagPhase::kDispatchCeChunk: return "dispatch/ce-chunk";
    case DiagPhase::kDispatchArgs: return "dispatch/args";
    case DiagPhase::kCeSentinel: return "combine/ce-sentinel";
    case DiagPhase::kDispatchCeSentinel: return "dispatch/ce-sentinel";
    case DiagPhase::kDispatchCeEnter: return "dispatch/ce-enter";
    case DiagPhase::kDispatchCeDone: return "dispatch/ce-done";
  }
  return "unknown";
}

const char* diag_role_name(DiagRole role) {
  switch (role) {
    case DiagRole::kHost: return "host";
    case DiagRole::kSender: return "sender";
    case DiagRole::kReceiver: return "receiver";
    case DiagRole::kForwarder: return "forwarder";
    case DiagRole::kCoordinator: return "coordinator";
    case DiagRole::kProxy: return "proxy";
    case DiagRole::kLaunchEnd: return "launch end";
  }
  return "unknown";
}

ErrorCode diag_error_code(const DiagRecord& r) {
  return r.phase == DiagPhase::kRdmaCapacity || r.phase == DiagPhase::kCombinePullArgs ||
                 r.phase == DiagPhase::kDispatchDirectArgs || r.phase == DiagPhase::kDispatchArgs
             ? ErrorCode::kInvalidUsage
             : ErrorCode::kTimeout;
}

namespace {

/// A copy-engine `op` whose peer polls its landing area where this rank does not, or the other way round; `knob`
/// switches it.
std::string poll_differs(const char* op, const char* knob, const DiagRecord& r, bool peer_polls, bool we_poll) {
  return detail::format(
      "rank %d: copy-engine %s: peer %d %s its landing area, this rank %s; every rank must set the same %s (polling "
      "is also off while a CUDA graph captures and on a Buffer that had an op captured: every rank must capture "
      "alike)",
      r.rank, op, r.peer, peer_polls ? "polls" : "does not poll", we_poll ? "does" : "does not", knob);
}

}  // namespace

std::string format_diag(const DiagRecord& r) {
  if (r.phase == DiagPhase::kRdmaCapacity)
    return detail::format(
        "rank %d: an internode area needs %lld rows but the RDMA buffer holds %lld per area (num_rdma_bytes too small "
        "for this call); create the Buffer with a larger num_rdma_bytes (Config.get_rdma_buffer_size_hint)",
        r.rank, static_cast<long long>(r.expected), static_cast<long long>(r.seen));
  // A combine's value never has the copy-engine dispatch's mark: a peer whose value has it runs that dispatch.
  if (r.phase == DiagPhase::kCombinePullArgs && (r.seen & kCeDispatchArgsMark) != 0)
    return detail::format(
        "rank %d: peer %d runs a copy-engine dispatch where this rank runs a combine; every rank must make the same "
        "dispatch and combine calls on a Buffer, in the same order",
        r.rank, r.peer);
  if (r.phase == DiagPhase::kCombinePullArgs) {
    const int32_t path_bits = kPullArgsStaged | kPullArgsCe;
    const auto kind = [](int64_t v) {
      return (v & kPullArgsCe) != 0       ? "a tensor of its own (copy engines, UCCL_MOE_COMBINE_CE)"
             : (v & kPullArgsStaged) != 0 ? "a tensor of its own (staged)"
                                          : "its get_combine_buffer view";
    };
    const int64_t chunks_seen = ((r.seen >> kPullArgsChunksShift) & 7) + 1;
    const int64_t chunks_expected = ((r.expected >> kPullArgsChunksShift) & 7) + 1;
    if ((r.seen & path_bits) == (r.expected & path_bits) && (r.seen & kPullArgsCe) != 0 &&
        (r.seen & kPullArgsPoll) != (r.expected & kPullArgsPoll))
      return poll_differs("combine", "UCCL_MOE_CE_POLL", r, (r.seen & kPullArgsPoll) != 0,
                          (r.expected & kPullArgsPoll) != 0);
    if ((r.seen & path_bits) == (r.expected & path_bits) && (r.seen & kPullArgsCe) != 0 &&
        chunks_seen != chunks_expected)
      return detail::format(
          "rank %d: copy-engine combine: peer %d copies in %lld chunks, this rank expects %lld; every rank must set "
          "the same UCCL_MOE_COMBINE_CE_CHUNKS",
          r.rank, r.peer, static_cast<long long>(chunks_seen), static_cast<long long>(chunks_expected));
    if ((r.seen & path_bits) == (r.expected & path_bits) &&
        (r.seen & kPullArgsHiddenMask) != (r.expected & kPullArgsHiddenMask))
      return detail::format(
          "rank %d: combine: peer %d passes rows of hidden %lld, this rank of hidden %lld; every rank must pass x "
          "of the same hidden size to the same combine",
          r.rank, r.peer, static_cast<long long>(pull_args_hidden_of(r.seen)),
          static_cast<long long>(pull_args_hidden_of(r.expected)));
    if ((r.seen & path_bits) != (r.expected & path_bits))
      return detail::format(
          "rank %d: combine: peer %d passed %s as x, this rank %s; every rank must pass the same kind of x to the "
          "same combine (all get_combine_buffer views, or all tensors of their own) with the same "
          "UCCL_MOE_COMBINE_CE and UCCL_MOE_COMBINE_STAGED",
          r.rank, r.peer, kind(r.seen), kind(r.expected));
    return detail::format(
        "rank %d: combine (pull): peer %d staged %lld top-k weights per row, this rank expected %lld; every "
        "rank must pass topk_weights of the same shape (or none) to the same combine",
        r.rank, r.peer, static_cast<long long>(r.seen & kPullArgsTopkMask),
        static_cast<long long>(r.expected & kPullArgsTopkMask));
  }
  if (r.phase == DiagPhase::kDispatchDirectArgs && (r.seen & kCeDispatchArgsMark) != 0 &&
      (r.expected & kCeDispatchArgsMark) != 0 && (r.seen & kCeDispatchArgsPoll) != (r.expected & kCeDispatchArgsPoll))
    return poll_differs("dispatch",
                        "UCCL_MOE_DISPATCH_CE_POLL and, where it is auto (the default, which does not poll with one "
                        "hardware queue), the same CUDA_DEVICE_MAX_CONNECTIONS (GPU_MAX_HW_QUEUES on HIP)",
                        r, (r.seen & kCeDispatchArgsPoll) != 0,
                        (r.expected & kCeDispatchArgsPoll) != 0);
  if (r.phase == DiagPhase::kDispatchDirectArgs)
    return detail::format(
        "rank %d: ring-free or copy-engine dispatch: peer %d lays out its landing area as %lld, this rank as %lld "
        "(codes of size, top-k and scales and their layout, copy-engine chunks; from a sender: the area's rows and "
        "the row it needed); every rank must pass the same hidden size, dtype, top-k, scales (row- or column-major "
        "alike) and num_worst_tokens to the same dispatch, with the same UCCL_MOE_DISPATCH_DIRECT, "
        "UCCL_MOE_DISPATCH_CE and UCCL_MOE_DISPATCH_CE_CHUNKS (or the peer runs a combine where this rank dispatches: "
        "every rank must make the same calls in the same order)",
        r.rank, r.peer, static_cast<long long>(r.seen), static_cast<long long>(r.expected));
  if (r.phase == DiagPhase::kDispatchArgs) {
    const auto rows = [](int64_t v) {
      return detail::format("rows of %lld bytes with %lld top-k entries and %lld scales",
                            static_cast<long long>(dispatch_rows_bytes(v)), static_cast<long long>(dispatch_rows_topk(v)),
                            static_cast<long long>(dispatch_rows_scales(v)));
    };
    const char* outcome = (r.command & kDispatchArgsRanOn) != 0
                              ? "notify compared them, but with num_worst_tokens nothing waits for its counts: that "
                                "dispatch ran on, and its results, expert ids included, are not valid"
                              : "notify compared them: no row moved";
    if ((r.command & kDispatchArgsExperts) != 0)
      return detail::format(
          "rank %d: dispatch: peer %d passes num_experts=%lld, this rank num_experts=%lld; every rank must pass the "
          "same num_experts to get_dispatch_layout and dispatch (%s)",
          r.rank, r.peer, static_cast<long long>(r.seen), static_cast<long long>(r.expected), outcome);
    return detail::format(
        "rank %d: dispatch: peer %d passes %s, this rank %s; every rank must pass x of the same hidden size and "
        "element size (dtype), and the same top-k and scales (or none), to the same dispatch (%s)",
        r.rank, r.peer, rows(r.seen).c_str(), rows(r.expected).c_str(), outcome);
  }
  std::string peer = r.peer < 0 ? std::string("all peers") : "peer " + std::to_string(r.peer);
  std::string chan = r.channel < 0 ? std::string("") : " on channel " + std::to_string(r.channel);
  if (r.role == DiagRole::kLaunchEnd)
    return detail::format(
        "rank %d found its launch in %s aborted by a peer that gave up (its own error names what it waited for): no "
        "wait of this rank failed, but the abort skipped its work, so this op's results are not valid",
        r.rank, diag_phase_name(r.phase));
  if (r.drained != 0)
    return detail::format(
        "rank %d gave up after %.1f s in %s (%s) waiting for %s%s: expected %lld, saw %lld (command 0x%llx). The "
        "launch was aborted first, by a peer that gave up (its own error names what it waited for) or by another of "
        "this rank's waits; the first rank to time out names the cause.",
        r.rank, r.waited_s, diag_phase_name(r.phase), diag_role_name(r.role), peer.c_str(), chan.c_str(),
        static_cast<long long>(r.expected), static_cast<long long>(r.seen),
        static_cast<unsigned long long>(r.command));
  return detail::format(
      "rank %d timed out after %.1f s in %s (%s) waiting for %s%s: expected %lld, saw %lld (command 0x%llx). "
      "The peer is probably stuck, dead or skipped this call (an exception it raised, e.g. on its own arguments, skips "
      "it: its log says); raise UCCL_MOE_TIMEOUT_S only if the job is merely slow.",
      r.rank, r.waited_s, diag_phase_name(r.phase), diag_role_name(r.role), peer.c_str(),
      chan.c_str(), static_cast<long long>(r.expected), static_cast<long long>(r.seen),
      static_cast<unsigned long long>(r.command));
}

}  // namespace uccl_moe
