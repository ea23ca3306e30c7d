// BARRIER: when the command reaches the front of its FIFO (everything before it completed), the thread sends its next
// epoch of the command's scope to the same thread of every peer of that scope as a control immediate, and the command
// completes once every such peer's epoch reached ours. Scopes (all peers, same-rail peers) count epochs apart.
#include "proxy_impl.hpp"

namespace uccl_moe {

namespace {
size_t scope_idx(detail::BarrierScope s) { return size_t(s); }
}  // namespace

void Proxy::Impl::setup_barrier_peers() {
  for (int p = 0; p < opt.num_ranks; ++p) {
    if (p == opt.rank) continue;
    barrier_peers[scope_idx(detail::BarrierScope::kAll)].push_back(p);
    if (p % *opt.ranks_per_node == opt.rank % *opt.ranks_per_node)
      barrier_peers[scope_idx(detail::BarrierScope::kSameRail)].push_back(p);
  }
}

void Proxy::Impl::on_barrier_imm(Thread& t, const detail::Imm& m, int peer) {
  uint64_t& seen = t.barrier_seen[scope_idx(m.scope)][size_t(peer)];
  seen += (m.epoch - uint32_t(seen)) & detail::kImmEpochMask;  // unwrap the 24-bit epoch
}

void Proxy::Impl::start_barrier(Thread& t, FifoState& fs, Entry& e) {
  const detail::BarrierScope scope = detail::scope_of(e.f);
  e.epoch = ++t.barrier_epoch[scope_idx(scope)];
  e.started = true;
  e.posted = Clock::now();
  const uint32_t imm = detail::encode_imm_control(detail::ImmControlOp::kBarrier, uint32_t(e.epoch), scope);
  for (int p : barrier_peers[scope_idx(scope)]) {
    WorkRequest wr;
    wr.wr_id = wr_id_of(fs, e.idx);
    wr.op = WrOp::kWriteImm;
    wr.peer = p;
    wr.imm = imm;
    ++e.pending_wrs;
    t.ep->post(wr);
  }
}

bool Proxy::Impl::barrier_met(const Thread& t, const Entry& e) const {
  if (e.pending_wrs != 0) return false;
  const size_t s = scope_idx(detail::scope_of(e.f));
  for (int p : barrier_peers[s])
    if (t.barrier_seen[s][size_t(p)] < e.epoch) return false;
  return true;
}

std::string Proxy::Impl::barrier_missing(const Thread& t, const Entry& e) const {
  std::string missing;
  const size_t s = scope_idx(detail::scope_of(e.f));
  for (int p : barrier_peers[s])
    if (t.barrier_seen[s][size_t(p)] < e.epoch) missing += (missing.empty() ? "" : ",") + std::to_string(p);
  return missing;
}

}  // namespace uccl_moe
