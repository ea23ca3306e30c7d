// Bindings of the host core: build info, device queries, env knob parsing, logging, Config, diagnostics.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/tuple.h>

#include "bindings.hpp"
#include "uccl_moe/config.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/device_query.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/log.hpp"
#include "uccl_moe/streams.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace uccl_moe {
#if defined(UCCL_MOE_WITH_CUDA) || defined(UCCL_MOE_WITH_HIP)
DiagRecord selftest_device_timeout(double timeout_s, int rank, bool peer_aborted);  // device_wait.cu
#endif
}  // namespace uccl_moe

namespace uccl_moe::bindings {

nb::dict diag_to_dict(const DiagRecord& r) {
  nb::dict d;
  d["valid"] = r.valid;
  d["rank"] = r.rank;
  d["peer"] = r.peer;
  d["channel"] = r.channel;
  d["phase"] = std::string(diag_phase_name(r.phase));
  d["role"] = int32_t(r.role);
  d["expected"] = r.expected;
  d["seen"] = r.seen;
  d["command"] = r.command;
  d["waited_s"] = r.waited_s;
  d["drained"] = r.drained != 0;
  d["message"] = format_diag(r);
  d["error"] = std::string(error_code_name(diag_error_code(r)));  // "InvalidUsage" or "Timeout"
  return d;
}

void register_core(nb::module_& m) {
  m.def("gpu_backend", &gpu_backend, "'cuda', 'hip' or 'none': what this build targets");
  m.def("device_count", &device_count);
  m.def("device_arch", &device_arch, "device"_a);
  m.def("device_name", &device_name, "device"_a);
  m.def("device_sm_count", &device_sm_count, "device"_a,
        "SMs (CUDA) or compute units (HIP) of the device; 0 without a GPU");
  m.def("can_access_peer", &can_access_peer, "device"_a, "peer"_a);
  // Positional only: these run twice per dispatch/combine, where keyword matching is a measurable cost.
  m.def("join_event_create", &join_event_create, "A timing-free event on a device, for stream_join (an int)");
  m.def("join_event_destroy", &join_event_destroy);
  m.def("stream_join", &stream_join, "stream_join(waiter, stream, event): waiter waits for stream's work so far");
  m.def("has_intranode_kernels", []() {
#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
    return true;
#else
    return false;
#endif
  },
        "True once the native intranode kernels are compiled into this build");

  // ---- env ----
  m.def("env_knobs", []() {
    std::vector<std::tuple<std::string, int, std::string, std::string, std::string, std::string>> out;
    for (const auto& k : env::knobs())
      out.emplace_back(k.name, static_cast<int>(k.type), k.default_value, k.min_or_choices, k.max_value, k.doc);
    return out;
  });
  m.def("env_parse_int", &env::parse_int, "var"_a, "text"_a, "min"_a, "max"_a);
  m.def("env_parse_float", &env::parse_float, "var"_a, "text"_a, "min"_a, "max"_a);
  m.def("env_parse_bool", &env::parse_bool, "var"_a, "text"_a);
  m.def("env_parse_choice", &env::parse_choice, "var"_a, "text"_a, "choices"_a);
  m.def("env_timeout_s", []() { return env::TIMEOUT_S(); });
  m.def("env_reset_cache", []() {
    env::reset_cache();
    log::reset();
  });

  // ---- logging ----
  m.def("log_set_rank", &log::set_rank, "rank"_a);
  m.def("log_subsys_mask", &log::parse_subsys_mask, "text"_a);
  m.def("log_enabled", [](int level, const std::string& subsys) {
    uint32_t mask = log::parse_subsys_mask(subsys.c_str());
    return log::enabled(static_cast<log::Level>(level), static_cast<log::Subsys>(mask));
  }, "level"_a, "subsys"_a);

  // ---- Config (DeepEP-V1 compatible; positional and keyword construction) ----
  nb::class_<Config>(m, "Config")
      .def(nb::init<int, int, int, int, int>(), "num_sms"_a = 20, "num_max_nvl_chunked_send_tokens"_a = 6,
           "num_max_nvl_chunked_recv_tokens"_a = 256, "num_max_rdma_chunked_send_tokens"_a = 6,
           "num_max_rdma_chunked_recv_tokens"_a = 256)
      .def_ro("num_sms", &Config::num_sms)
      .def_ro("num_max_nvl_chunked_send_tokens", &Config::num_max_nvl_chunked_send_tokens)
      .def_ro("num_max_nvl_chunked_recv_tokens", &Config::num_max_nvl_chunked_recv_tokens)
      .def_ro("num_max_rdma_chunked_send_tokens", &Config::num_max_rdma_chunked_send_tokens)
      .def_ro("num_max_rdma_chunked_recv_tokens", &Config::num_max_rdma_chunked_recv_tokens)
      .def_prop_ro("num_channels", &Config::num_channels)
      .def("get_nvl_buffer_size_hint", &Config::get_nvl_buffer_size_hint, "hidden_bytes"_a, "num_ranks"_a,
           "num_nvl_ranks"_a = 0)
      .def("get_rdma_buffer_size_hint", &Config::get_rdma_buffer_size_hint, "hidden_bytes"_a, "num_ranks"_a,
           "num_nvl_ranks"_a = 0)
      .def("__repr__", [](const Config& c) {
        return ::uccl_moe::detail::format(
            "Config(num_sms=%d, num_max_nvl_chunked_send_tokens=%d, num_max_nvl_chunked_recv_tokens=%d, "
            "num_max_rdma_chunked_send_tokens=%d, num_max_rdma_chunked_recv_tokens=%d)",
            c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens);
      });
  m.def("nvl_slot_bytes", &nvl_slot_bytes, "hidden_bytes"_a);

  // ---- diagnostics ----
  m.def("format_diag", [](int rank, int peer, int channel, int phase, int role, int64_t expected, int64_t seen,
                          uint64_t command, double waited_s, bool drained) {
    const DiagRecord r{.valid = 1, .rank = rank, .peer = peer, .channel = channel, .phase = DiagPhase(phase),
                       .role = DiagRole(role), .expected = expected, .seen = seen, .command = command,
                       .waited_s = waited_s, .drained = drained ? 1 : 0};
    return diag_to_dict(r);
  }, "rank"_a, "peer"_a, "channel"_a, "phase"_a, "role"_a, "expected"_a, "seen"_a, "command"_a, "waited_s"_a,
  "drained"_a = false);
#if defined(UCCL_MOE_WITH_CUDA) || defined(UCCL_MOE_WITH_HIP)
  m.def("selftest_device_timeout", [](double timeout_s, int rank, bool peer_aborted) {
    DiagRecord r;
    {
      nb::gil_scoped_release release;
      r = selftest_device_timeout(timeout_s, rank, peer_aborted);
    }
    return diag_to_dict(r);
  }, "timeout_s"_a, "rank"_a = 0, "peer_aborted"_a = false,
        "Launch a kernel that waits on a flag nobody sets; returns the DiagRecord it wrote on timeout (peer_aborted: "
        "the abort flag is up before it starts, as a peer that gave up leaves it: the wait gives up at once and still "
        "writes the record)");
#endif
}

}  // namespace uccl_moe::bindings
