// Send-side plumbing shared by the verbs transports (ibverbs RC, efa SRD): requests that find the send queue full
// wait in a backlog (post() never blocks), requests that cannot be posted at all become error completions handed
// out by the next poll(), and failed work completions get one status text.
#pragma once

#include <infiniband/verbs.h>

#include <algorithm>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "uccl_moe/error.hpp"
#include "uccl_moe/transport.hpp"
#include "verbs_ops.hpp"

namespace uccl_moe::detail {

/// Work completions per poll_cq call.
constexpr int kPollBatch = 32;

class PostQueue {
 public:
  /// Posts `wr` now if nothing is queued and `try_post(wr)` takes it, else queues it (FIFO order is kept).
  /// try_post returns false only for "no room now"; a request it cannot post at all it reports through fail().
  template <typename TryPost>
  void post(const WorkRequest& wr, TryPost&& try_post) {
    if (!backlog_.empty() || !try_post(wr)) backlog_.push_back(wr);
  }
  /// Posts queued requests in order until one finds no room.
  template <typename TryPost>
  void flush(TryPost&& try_post) {
    while (!backlog_.empty() && try_post(backlog_.front())) backlog_.pop_front();
  }
  /// Turns `in` into an error completion delivered by the next drain_errors().
  void fail(const WorkRequest& in, std::string status) {
    Completion c;
    c.kind = CompletionKind::kError;
    c.wr_id = in.wr_id;
    c.peer = in.peer;
    c.status = std::move(status);
    errors_.push_back(std::move(c));
  }
  /// Moves up to `max` deferred error completions to `out`; returns how many.
  int drain_errors(std::vector<Completion>& out, int max) {
    int n = 0;
    for (; n < max && !errors_.empty(); ++n) {
      out.push_back(std::move(errors_.front()));
      errors_.pop_front();
    }
    return n;
  }
  /// The first half of an endpoint's poll(): hands out deferred errors, then reads work completions from `cq` into
  /// `wc` (room for kPollBatch) up to what is left of `max`. Returns how many work completions it read.
  int poll_cq(VerbsOps& ops, ibv_cq* cq, std::vector<Completion>& out, int max, ibv_wc* wc) {
    const int room = std::min(kPollBatch, max - drain_errors(out, max));
    const int n = room > 0 ? ops.poll_cq(cq, room, wc) : 0;
    if (n < 0) UCCL_THROW(kTransport, "%s", verbs_error("ibv_poll_cq", -n).c_str());
    return n;
  }
  bool empty() const { return backlog_.empty() && errors_.empty(); }

 private:
  std::deque<WorkRequest> backlog_;
  std::deque<Completion> errors_;
};

/// "completion error status=RETRY_EXC_ERR (12) vendor_err=0x81 qp=77".
inline std::string wc_error_status(const ibv_wc& wc) {
  return uccl_moe::detail::format("completion error status=%s (%d) vendor_err=0x%x qp=%u", ibv_wc_status_str(wc.status),
                                  int(wc.status), wc.vendor_err, wc.qp_num);
}

}  // namespace uccl_moe::detail
