// Bindings of the CPU proxy: start/stop proxies, push commands from host producers (tests, benchmarks), read
// counters, and views of the data and counter regions. Bootstrap goes through two Python callables (set/get over a
// torch.distributed Store; see uccl_moe/proxy.py).
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include "bindings.hpp"
#include "uccl_moe/error.hpp"
#include "../proxy/flow_control.hpp"
#include "uccl_moe/proxy.hpp"
#include "uccl_moe/transfer_cmd.hpp"

namespace nb = nanobind;
using namespace nb::literals;

#if defined(UCCL_MOE_HAVE_IBVERBS)
namespace uccl_moe::detail {
int gpu_export_dmabuf(void* ptr, uint64_t bytes, std::string* why);  // native/src/transport/gpu_mr.hpp
}  // namespace uccl_moe::detail
#endif

namespace uccl_moe::bindings {

std::shared_ptr<KvStore> python_store(nb::object set_fn, nb::object get_fn) {
  // The callables run with the GIL (taken here: start() releases it). Python errors become Transport/Timeout errors
  // carrying the Python message.
  auto set = [set_fn](const std::string& key, const std::string& value) {
    nb::gil_scoped_acquire gil;
    try {
      set_fn(key, nb::bytes(value.data(), value.size()));
    } catch (nb::python_error& e) {
      UCCL_THROW(kTransport, "bootstrap store set('%s') failed: %s", key.c_str(), e.what());
    }
  };
  auto get = [get_fn](const std::string& key, double timeout_s) -> std::string {
    nb::gil_scoped_acquire gil;
    try {
      nb::object r = get_fn(key, timeout_s);
      nb::bytes b = nb::cast<nb::bytes>(r);
      return std::string(b.c_str(), b.size());
    } catch (nb::python_error& e) {
      UCCL_THROW(kTimeout, "bootstrap store get('%s') failed within %.1f s: %s", key.c_str(), timeout_s, e.what());
    }
  };
  // Keep the callables' lifetime tied to the store; they are released with the GIL held by the owning Proxy's
  // destructor (called from Python).
  return std::make_shared<CallbackKvStore>(set, get);
}

nb::dict counters_dict(const ProxyCounters& c) {
  nb::dict d;
#define UCCL_MOE_PROXY_COUNTER(NAME, MERGE, DOC) d[#NAME] = c.NAME;
#include "proxy_counters.def"
#undef UCCL_MOE_PROXY_COUNTER
  return d;
}

void register_proxy(nb::module_& m) {
  register_nic(m);
  m.def("proxy_transports", &list_transports, "registered transports in priority order with their probe result");
  m.def(
      "nic_flow_defaults",
      [](const std::string& family, int num_threads) {
        const FlowLimits f = nic_flow_defaults(family, num_threads);
        return std::make_pair(f.max_inflight_bytes, f.max_inflight_writes);
      },
      "family"_a, "num_threads"_a,
      "(bytes per proxy thread, writes per FIFO) a NIC family ('mlx5', 'bnxt_re', ...) defaults to; -1 = no opinion");
  m.def(
      "flow_limits",
      [](const std::string& family, int num_threads) {
        const FlowLimits f = resolve_flow_limits(-1, -1, family, num_threads);
        return nb::make_tuple(f.max_inflight_bytes, f.max_inflight_writes, f.bytes_source, f.writes_source);
      },
      "family"_a, "num_threads"_a,
      "(bytes per thread, writes per FIFO, source of each) a proxy on that NIC family uses when no option is given: "
      "the knob if set, else the family's default, else the knob's default");
#if defined(UCCL_MOE_HAVE_IBVERBS)
  m.def(
      "gpu_export_dmabuf",
      [](uintptr_t ptr, uint64_t bytes) {
        std::string why;
        const int fd = detail::gpu_export_dmabuf(reinterpret_cast<void*>(ptr), bytes, &why);
        return std::make_pair(fd, why);
      },
      "ptr"_a, "bytes"_a,
      "Exports GPU memory [ptr, ptr + bytes) (2 MiB aligned) as a dma-buf fd the caller closes: (fd, '') or (-1, why)");
#endif
  m.def("encode_transfer_cmd",
        [](int op, int flags, uint32_t dst_rank, uint32_t bytes, int counter_slot, int counter_value,
           uint64_t src_offset, uint64_t dst_offset) {
          TransferCmdFields f;
          f.op = CmdOp(op);
          f.flags = uint8_t(flags);
          f.dst_rank = dst_rank;
          f.bytes = bytes;
          UCCL_ASSERT(counter_slot >= 0 && counter_slot < kCountersPerSrc, "counter_slot=%d must be in [0, %d)",
                      counter_slot, kCountersPerSrc);
          UCCL_ASSERT(counter_value >= -128 && counter_value <= 127, "counter_value=%d must be in [-128, 127]",
                      counter_value);
          f.counter_slot = uint8_t(counter_slot);
          f.counter_value = int8_t(counter_value);
          f.src_offset = src_offset;
          f.dst_offset = dst_offset;
          const TransferCmd c = encode_checked(f);
          return std::make_pair(c.word0, c.word1);
        },
        "op"_a, "flags"_a, "dst_rank"_a, "bytes"_a, "counter_slot"_a, "counter_value"_a, "src_offset"_a,
        "dst_offset"_a, "Encode a TransferCmd (validated); returns (word0, word1)");

  nb::class_<Proxy>(m, "Proxy")
      .def("__init__",
           [](Proxy* self, int rank, int num_ranks, nb::object store_set, nb::object store_get,
              std::optional<std::string> transport, std::optional<int> num_threads,
              std::optional<int> fifos_per_thread, std::optional<int> fifo_capacity,
              std::optional<int64_t> max_inflight_bytes, std::optional<int64_t> max_inflight_writes,
              std::optional<double> timeout_s, const std::string& job, uint64_t data_bytes,
              std::optional<std::string> cpus, std::optional<int> ranks_per_node, const std::string& gpu_pci_bus_id,
              std::optional<int> local_rank) {
             ProxyOptions o;
             o.rank = rank;
             o.num_ranks = num_ranks;
             o.transport = transport;
             o.num_threads = num_threads;
             o.fifos_per_thread = fifos_per_thread;
             o.fifo_capacity = fifo_capacity;
             o.max_inflight_bytes = max_inflight_bytes;
             o.max_inflight_writes = max_inflight_writes;
             o.timeout_s = timeout_s;
             o.job = job;
             o.data_bytes = data_bytes;
             o.cpus = cpus;
             o.ranks_per_node = ranks_per_node;
             o.gpu_pci_bus_id = gpu_pci_bus_id;
             o.local_rank = local_rank;
             new (self) Proxy(o, python_store(store_set, store_get));
           },
           "rank"_a, "num_ranks"_a, "store_set"_a, "store_get"_a, "transport"_a, "num_threads"_a,
           "fifos_per_thread"_a, "fifo_capacity"_a, "max_inflight_bytes"_a, "max_inflight_writes"_a, "timeout_s"_a,
           "job"_a, "data_bytes"_a, "cpus"_a, "ranks_per_node"_a, "gpu_pci_bus_id"_a = "",
           "local_rank"_a = nb::none())
      .def_prop_ro("timeout_s", [](const Proxy& p) { return p.timeout().limit_s; },
                   "the resolved UCCL_MOE_TIMEOUT_S (or the timeout_s given) every wait of this proxy uses")
      .def("start", [](Proxy& p) {
        nb::gil_scoped_release release;
        p.start();
      })
      .def("stop", [](Proxy& p) {
        nb::gil_scoped_release release;
        p.stop();
      })
      .def("check", &Proxy::check)
      .def_prop_ro("running", &Proxy::running)
      .def_prop_ro("num_threads", &Proxy::num_threads)
      .def_prop_ro("num_fifos", &Proxy::num_fifos)
      .def_prop_ro("transport_name", &Proxy::transport_name)
      .def("nic", [](const Proxy& p) {
        nb::dict d = transport_nic_dict(p.nic());
        d["pinned_cpus"] = p.pinned_cpus();
        d["local_rank"] = p.options().local_rank;
        return d;
      }, "the transport's NIC for this rank's GPU and the CPUs the proxy threads are pinned to")
      .def_prop_ro("data_bytes", &Proxy::data_bytes)
      .def_prop_ro("num_counters", &Proxy::num_counters)
      .def("push_raw", [](Proxy& p, int fifo, uint64_t word0, uint64_t word1) {
        const TransferCmd c{word0, word1};
        TransferCmdFields f = decode(c);
        nb::gil_scoped_release release;
        return p.push(fifo, f);
      }, "fifo"_a, "word0"_a, "word1"_a, "Push an encoded command (see encode_transfer_cmd); returns its index")
      .def("wait", [](Proxy& p, int fifo, uint64_t idx) {
        nb::gil_scoped_release release;
        p.wait(fifo, idx);
      }, "fifo"_a, "idx"_a)
      .def("check_completion", [](Proxy& p, int fifo, uint64_t idx) { return p.fifo(fifo).check_completion(idx); },
           "fifo"_a, "idx"_a)
      .def("counters", [](const Proxy& p) { return counters_dict(p.counters_total()); })
      .def("thread_counters", [](const Proxy& p) {
        nb::list l;
        for (const auto& c : p.thread_counters()) l.append(counters_dict(c));
        return l;
      })
      .def("data_view", [](nb::object self) {
        Proxy& p = nb::cast<Proxy&>(self);
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(p.data(), {size_t(p.data_bytes())}, self);
      }, "uint8 numpy view of the registered data region (valid while the Proxy lives)")
      .def("counters_view", [](nb::object self) {
        Proxy& p = nb::cast<Proxy&>(self);
        return nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(p.counters(), {size_t(p.num_counters())}, self);
      }, "int64 numpy view of the counters [num_ranks * 256] (source-major)");
}

}  // namespace uccl_moe::bindings
