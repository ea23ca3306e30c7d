// Transport registry: every transport in priority order. "auto" takes the first whose probe finds usable hardware;
// UCCL_MOE_TRANSPORT (or ProxyOptions::transport) forces one.
#include <string>

#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe {

namespace detail {
std::unique_ptr<Transport> create_loopback_transport(const TransportContext& ctx);
#if defined(UCCL_MOE_HAVE_IBVERBS)
std::unique_ptr<Transport> create_ibverbs_transport(const TransportContext& ctx);
bool probe_ibverbs();
#endif
#if defined(UCCL_MOE_HAVE_EFA)
std::unique_ptr<Transport> create_efa_transport(const TransportContext& ctx);
bool probe_efa();
#endif
}  // namespace detail

namespace {
struct Entry {
  const char* name;
  bool (*probe)();
  std::unique_ptr<Transport> (*create)(const TransportContext&);
};

bool probe_loopback() { return true; }

const std::vector<Entry>& registry() {
  static const std::vector<Entry> entries = {
#if defined(UCCL_MOE_HAVE_EFA)
      {"efa", &detail::probe_efa, &detail::create_efa_transport},
#endif
#if defined(UCCL_MOE_HAVE_IBVERBS)
      {"ibverbs", &detail::probe_ibverbs, &detail::create_ibverbs_transport},
#endif
      {"loopback", &probe_loopback, &detail::create_loopback_transport},
  };
  return entries;
}

std::string names() {
  std::string s;
  for (const auto& e : registry()) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}
}  // namespace

std::vector<std::pair<std::string, bool>> list_transports() {
  std::vector<std::pair<std::string, bool>> out;
  for (const auto& e : registry()) out.emplace_back(e.name, e.probe());
  return out;
}

std::string resolve_transport(const std::string& name) {
  for (const auto& e : registry()) {
    if (name == "auto" ? e.probe() : name == e.name) {
      if (name != "auto" && !e.probe())
        UCCL_THROW(kInvalidUsage, "transport '%s' was requested but no usable device was found (registered: %s)",
                   e.name, names().c_str());
      return e.name;
    }
  }
  UCCL_THROW(kInvalidUsage, "unknown transport '%s'; registered in this build: %s (UCCL_MOE_TRANSPORT)", name.c_str(),
             names().c_str());
}

std::unique_ptr<Transport> create_transport(const std::string& name, const TransportContext& ctx) {
  // An injected verbs layer (ctx.verbs, tests) stands for the hardware the probes look for.
  bool injected = false;
  for (const auto& e : registry()) injected |= ctx.verbs && name == e.name;
  const std::string chosen = injected ? name : resolve_transport(name);
  for (const auto& e : registry())
    if (chosen == e.name) {
      UCCL_LOG(INFO, NET, "rank %d: transport %s%s", ctx.rank, e.name, name == "auto" ? " (auto)" : "");
      return e.create(ctx);
    }
  UCCL_CHECK_INTERNAL(false, "resolved transport '%s' is not registered", chosen.c_str());
  return nullptr;
}

}  // namespace uccl_moe
