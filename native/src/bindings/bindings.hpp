// Each native component exposes one register_* function; module.cc calls them in order.
// Bindings take raw pointers (as integers) and stream handles, never torch types: the module must not link
// libtorch, so one build serves every torch version.
#pragma once

#include <nanobind/nanobind.h>

#include "uccl_moe/diag.hpp"

namespace uccl_moe::bindings {

/// A DiagRecord as the dict Python sees (CommTimeoutError.record), with the formatted message.
nanobind::dict diag_to_dict(const DiagRecord& r);

void register_core(nanobind::module_& m);
void register_proxy(nanobind::module_& m);
void register_runtime(nanobind::module_& m);

}  // namespace uccl_moe::bindings
