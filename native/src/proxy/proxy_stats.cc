// The proxy's counters, one list (proxy_counters.def) expanded into the per-thread atomics, their snapshot and the
// merge over threads.
#include <algorithm>

#include "proxy_impl.hpp"

namespace uccl_moe {

namespace detail {

ProxyCounters AtomicCounters::snapshot() const {
  ProxyCounters p;
#define UCCL_MOE_PROXY_COUNTER(NAME, MERGE, DOC) p.NAME = NAME.load(std::memory_order_relaxed);
#include "proxy_counters.def"
#undef UCCL_MOE_PROXY_COUNTER
  return p;
}

void merge_counters(ProxyCounters& into, const ProxyCounters& thread) {
#define UCCL_MOE_MERGE_SUM(NAME) into.NAME += thread.NAME;
#define UCCL_MOE_MERGE_MAX(NAME) into.NAME = std::max(into.NAME, thread.NAME);
#define UCCL_MOE_PROXY_COUNTER(NAME, MERGE, DOC) UCCL_MOE_MERGE_##MERGE(NAME)
#include "proxy_counters.def"
#undef UCCL_MOE_PROXY_COUNTER
#undef UCCL_MOE_MERGE_SUM
#undef UCCL_MOE_MERGE_MAX
}

}  // namespace detail

std::vector<ProxyCounters> Proxy::thread_counters() const {
  std::vector<ProxyCounters> out;
  for (const auto& t : impl_->threads) out.push_back(t->stats.snapshot());
  return out;
}

ProxyCounters Proxy::counters_total() const {
  ProxyCounters s;
  for (const ProxyCounters& c : thread_counters()) detail::merge_counters(s, c);
  return s;
}

}  // namespace uccl_moe
