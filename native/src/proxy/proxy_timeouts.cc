// The watchdog of a proxy thread: the oldest command of a FIFO that waits longer than the timeout (a lost work
// request, a barrier a peer never joined) or a counter update held that long for a write that never landed is an
// error whose message carries the diagnostic record.
#include "proxy_impl.hpp"
#include "uccl_moe/diag.hpp"

namespace uccl_moe {

void Proxy::Impl::check_timeouts(Thread& t) {
  const double limit = timeout.limit_s;
  for (FifoState* fs : t.fifos) {
    if (fs->inflight.empty()) continue;
    const Entry& e = fs->inflight.front();
    const double waited = detail::seconds_since(e.posted);
    if (waited <= limit) continue;
    DiagRecord r{.valid = 1, .rank = opt.rank, .peer = int32_t(e.f.dst_rank), .channel = fs->global_idx,
                 .phase = DiagPhase::kProxyCompletion, .role = DiagRole::kProxy, .expected = int64_t(e.idx),
                 .seen = int64_t(fs->retired), .command = encode(e.f).word0, .waited_s = waited};
    if (e.f.op == CmdOp::kBarrier) {
      r.peer = -1;
      r.phase = DiagPhase::kBarrier;
      UCCL_THROW(kTimeout, "%s; %s: BARRIER epoch %llu of FIFO %d still waits for ranks [%s]", format_diag(r).c_str(),
                 who(t).c_str(), (unsigned long long)e.epoch, fs->global_idx, barrier_missing(t, e).c_str());
    }
    UCCL_THROW(kTimeout, "%s; %s: lost command: FIFO %d command %llu (%s) posted %.1f s ago has %d unfinished work "
               "request(s) (dropped by the network or the peer is dead)", format_diag(r).c_str(), who(t).c_str(),
               fs->global_idx, (unsigned long long)e.idx, describe(e.f).c_str(), waited, e.pending_wrs);
  }
  if (t.order->num_held() > 0 && detail::seconds_since(t.held_since) > limit) {
    int src = -1, channel = 0;
    uint64_t want = 0, held = 0;
    t.order->describe_held(&src, &channel, &want, &held);
    const DiagRecord r{.valid = 1, .rank = opt.rank, .peer = src, .channel = channel,
                       .phase = DiagPhase::kProxyOrdering, .role = DiagRole::kProxy, .expected = int64_t(want),
                       .seen = int64_t(held), .waited_s = detail::seconds_since(t.held_since)};
    if (channel >= 0)
      UCCL_THROW(kTimeout, "%s; %s: a counter update of channel %d from rank %d (seq %llu) is held because write seq "
                 "%llu never landed", format_diag(r).c_str(), who(t).c_str(), channel, src,
                 (unsigned long long)held, (unsigned long long)want);
    UCCL_THROW(kTimeout, "%s; %s: LL fence of group %d from rank %d waits for %llu writes, %llu landed",
               format_diag(r).c_str(), who(t).c_str(), -1 - channel, src, (unsigned long long)want,
               (unsigned long long)held);
  }
}

}  // namespace uccl_moe
