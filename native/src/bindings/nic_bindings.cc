// Bindings of the NIC choice per GPU (native/src/transport/nic_select.hpp) and of the device capability query, for
// `uccl-moe doctor` and the tests that drive both against the recorded sysfs trees (tests/fixtures/sysfs).
#include <arpa/inet.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../transport/nic_select.hpp"
#include "bindings.hpp"
#include "uccl_moe/error.hpp"
#if defined(UCCL_MOE_HAVE_IBVERBS)
#include "../transport/device_caps.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace uccl_moe::bindings {

namespace {

detail::NicFamily family_of(const std::string& f) {
  if (f == "efa") return detail::NicFamily::kEfa;
  if (f == "ibverbs") return detail::NicFamily::kVerbs;
  if (f == "any") return detail::NicFamily::kAny;
  UCCL_THROW(kInvalidUsage, "family=\"%s\" must be efa, ibverbs or any", f.c_str());
}

nb::dict choice_dict(const detail::NicChoice& c) {
  nb::dict d;
  d["devices"] = c.devices;
  d["fallbacks"] = c.fallbacks;
  d["numa_node"] = c.numa_node;
  d["numa_cpus"] = c.numa_cpus;
  d["pcie_distance"] = c.pcie_distance;
  d["gpu_pci_bus_id"] = c.gpu_pci_bus_id;
  d["reason"] = c.reason;
  return d;
}

}  // namespace

nb::dict transport_nic_dict(const TransportNic& n) {
  nb::dict d;
  d["devices"] = n.devices;
  d["numa_node"] = n.numa_node;
  d["numa_cpus"] = n.numa_cpus;
  d["reason"] = n.reason;
  return d;
}

void register_nic(nb::module_& m) {
  m.def("nic_choose",
        [](const std::string& sysfs_root, const std::string& family, const std::string& gpu_pci_bus_id,
           int local_rank, const std::string& hca, const std::vector<std::string>& available, int port) {
          detail::NicRequest r;
          r.sysfs_root = sysfs_root;
          r.family = family_of(family);
          r.gpu_pci_bus_id = gpu_pci_bus_id;
          r.local_rank = local_rank;
          r.hca = hca;
          r.available = available;
          r.port = port;
          return choice_dict(detail::choose_nics(r));
        },
        "sysfs_root"_a, "family"_a, "gpu_pci_bus_id"_a = "", "local_rank"_a = 0, "hca"_a = "",
        "available"_a = std::vector<std::string>{}, "port"_a = 1,
        "The NIC(s) for one local rank's GPU (nic_select.hpp rules); raises InvalidUsageError for bad overrides");
  m.def("nic_sysfs",
        [](const std::string& sysfs_root, int port) {
          nb::dict out;
          nb::list devs;
          for (const detail::SysfsRdmaDevice& d : detail::list_rdma_devices(sysfs_root, port)) {
            nb::dict e;
            e["name"] = d.name;
            e["pci_addr"] = d.pci_addr;
            e["numa_node"] = d.numa_node;
            e["efa"] = d.efa;
            e["port_state"] = d.port_state;
            e["link_layer"] = d.link_layer;
            e["rate"] = d.rate;
            nb::list gids;
            for (const detail::SysfsGid& g : detail::list_gids(sysfs_root, d.name, port)) {
              nb::dict gd;
              gd["index"] = g.index;
              gd["gid"] = g.gid;
              gd["type"] = g.type;
              gd["ndev"] = g.ndev;
              gd["ndev_mtu"] = detail::netdev_mtu(sysfs_root, g.ndev);
              gids.append(gd);
            }
            e["gids"] = gids;
            devs.append(e);
          }
          nb::list gpus;
          for (const detail::SysfsGpu& g : detail::list_gpus(sysfs_root)) {
            nb::dict e;
            e["pci_addr"] = g.pci_addr;
            e["numa_node"] = g.numa_node;
            e["vendor"] = g.vendor;
            gpus.append(e);
          }
          out["devices"] = devs;
          out["gpus"] = gpus;
          return out;
        },
        "sysfs_root"_a, "port"_a = 1, "RDMA devices (with GID tables) and GPUs as the sysfs tree lists them");
  m.def("numa_cpulist", &detail::numa_cpulist, "sysfs_root"_a, "node"_a);
  m.def(
      "gid_preference",
      [](const std::string& text) {
        uint8_t raw[16];
        if (inet_pton(AF_INET6, text.c_str(), raw) != 1)
          UCCL_THROW(kInvalidUsage, "'%s' is not a GID (an IPv6 address as sysfs prints it)", text.c_str());
        return detail::roce_gid_preference(raw);
      },
      "text"_a, "RoCE v2 GID preference the ibverbs transport uses: 0 IPv4-mapped, 1 ULA, 2 global IPv6, -1 never");
  m.def("normalize_pci_bus_id", &detail::normalize_pci_bus_id, "text"_a);
  m.def("proxy_cpus_for_rank",
        [](const std::string& text, int local_rank) {
          const detail::ProxyCpuSpec s = detail::proxy_cpus_for_rank(text, local_rank);
          const char* mode = s.mode == detail::ProxyCpuSpec::Mode::kAuto   ? "auto"
                             : s.mode == detail::ProxyCpuSpec::Mode::kNone ? "none" : "list";
          return std::make_pair(std::string(mode), s.cpus);
        },
        "text"_a, "local_rank"_a, "UCCL_MOE_PROXY_CPUS for one local rank: (mode, cpus)");
  m.def("hca_for_rank", &detail::hca_for_rank, "text"_a, "local_rank"_a, "UCCL_MOE_IB_HCA for one local rank");
#if defined(UCCL_MOE_HAVE_IBVERBS)
  m.def("rdma_device_names", [] { return detail::real_verbs_ops()->device_names(); },
        "RDMA devices libibverbs lists (empty without rdma-core devices)");
  m.def("rdma_device_caps",
        [](const std::string& name, int port) {
          const detail::RdmaDeviceCaps c = detail::query_device_caps(*detail::real_verbs_ops(), name, uint8_t(port), true);
          nb::dict d;
          d["name"] = c.name;
          d["error"] = c.error;
          d["max_mr_size"] = c.max_mr_size;
          d["max_qp"] = c.max_qp;
          d["max_qp_wr"] = c.max_qp_wr;
          d["max_cq"] = c.max_cq;
          d["max_cqe"] = c.max_cqe;
          d["max_sge"] = c.max_sge;
          d["max_qp_rd_atom"] = c.max_qp_rd_atom;
          d["max_qp_init_rd_atom"] = c.max_qp_init_rd_atom;
          d["atomic_cap"] = c.atomic_cap;
          d["port_state"] = c.port_state;
          d["link_layer"] = c.link_layer;
          d["active_mtu"] = c.active_mtu;
          d["gid_tbl_len"] = c.gid_tbl_len;
          d["efa_queried"] = c.efa_queried;
          d["efa_rdma_read"] = c.efa_rdma_read;
          d["efa_rdma_write"] = c.efa_rdma_write;
          d["efa_unsolicited_write_recv"] = c.efa_unsolicited_write_recv;
          d["efa_rnr_retry"] = c.efa_rnr_retry;
          d["efa_max_rdma_size"] = c.efa_max_rdma_size;
          d["efa_max_sq_wr"] = c.efa_max_sq_wr;
          d["efa_max_rq_wr"] = c.efa_max_rq_wr;
          d["efa_inline_buf_size"] = c.efa_inline_buf_size;
          return d;
        },
        "name"_a, "port"_a = 1, "Open an RDMA device through the verbs layer and report what it can do");
#endif
}

}  // namespace uccl_moe::bindings
