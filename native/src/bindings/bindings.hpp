// Each native component exposes one register_* function; module.cc calls them in order.
// Bindings take raw pointers (as integers) and stream handles, never torch types: the module must not link
// libtorch, so one build serves every torch version.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>

#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/proxy.hpp"

namespace uccl_moe::bindings {

/// A device pointer passed from Python as an int (0 = absent).
template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
/// A stream handle passed from Python as an int (cudaStream_t / hipStream_t).
inline void* stream_of(uintptr_t s) { return reinterpret_cast<void*>(s); }

/// A DiagRecord as the dict Python sees (CommTimeoutError.record), with the formatted message.
nanobind::dict diag_to_dict(const DiagRecord& r);
/// A KvStore over two Python callables: set(key: str, value: bytes) and get(key: str, timeout_s: float) -> bytes.
std::shared_ptr<KvStore> python_store(nanobind::object set_fn, nanobind::object get_fn);
/// ProxyCounters as a dict (field name -> int).
nanobind::dict counters_dict(const ProxyCounters& c);

void register_core(nanobind::module_& m);
void register_proxy(nanobind::module_& m);
void register_runtime(nanobind::module_& m);
void register_internode(nanobind::module_& m);
/// NIC choice per GPU and device capabilities (nic_bindings.cc); called by register_proxy.
void register_nic(nanobind::module_& m);
/// A TransportNic as a dict (devices, numa_node, numa_cpus, reason).
nanobind::dict transport_nic_dict(const TransportNic& n);

}  // namespace uccl_moe::bindings
