#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "uccl_moe/error.hpp"

namespace nb = nanobind;

namespace {

// Maps uccl_moe::Error codes onto the Python exception tree in uccl_moe/errors.py.
const char* python_class_for(uccl_moe::ErrorCode code) {
  switch (code) {
    case uccl_moe::ErrorCode::kInvalidUsage: return "InvalidUsageError";
    case uccl_moe::ErrorCode::kSystem: return "SystemCallError";
    case uccl_moe::ErrorCode::kCuda: return "CudaError";
    case uccl_moe::ErrorCode::kTransport: return "TransportError";
    case uccl_moe::ErrorCode::kTimeout: return "CommTimeoutError";
    case uccl_moe::ErrorCode::kInternal: return "InternalError";
  }
  return "UcclMoeError";
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "uccl-moe native core (torch-free; raw pointers and stream handles)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const uccl_moe::Error& e) {
      nb::object errors = nb::module_::import_("uccl_moe.errors");
      nb::object cls = errors.attr(python_class_for(e.code()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
  uccl_moe::bindings::register_core(m);
  uccl_moe::bindings::register_proxy(m);
  uccl_moe::bindings::register_runtime(m);
  uccl_moe::bindings::register_internode(m);
}
