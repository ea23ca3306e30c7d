// NIC selection per GPU, from the sysfs tree alone (its root is a parameter, so recorded trees under
// tests/fixtures/sysfs/ drive the unit tests). Rules, in order:
//   1. an explicit UCCL_MOE_IB_HCA entry for this local rank wins (grammar at hca_for_rank);
//   2. only devices of the transport's family (EFA: efa*/rdmap*, ibverbs: the rest) with an active port;
//   3. the smallest PCIe distance to the GPU (hops to the deepest shared bridge or switch; devices under another root
//      complex are far), then the same NUMA node as the GPU;
//   4. the GPUs that share the same closest set split it evenly, by PCI address: p5en has two EFA devices behind
//      each GPU's switch (the EFA transport stripes its threads over both), DGX H100 and MI300X + Thor-2 one NIC per
//      GPU; more GPUs than NICs in a set go round robin.
// The choice carries the NIC's NUMA node and that node's CPU list, where the rank's proxy threads are pinned.
// Topology rule as in NCCL's and UCCL-EP's NIC choice (nccl src/graph/topo.cc paths by PCI hop type; uccl
// ep/src/rdma.cpp: PCIe distance then NUMA); sysfs layout per Linux Documentation/ABI/stable/sysfs-class-infiniband
// and Documentation/ABI/testing/sysfs-bus-pci.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uccl_moe/transport.hpp"

namespace uccl_moe::detail {

enum class NicFamily : int {
  kAny = 0,
  kVerbs = 1,  ///< every RDMA device that is not EFA (mlx5, bnxt_re, irdma, rxe, ...): the ibverbs transport
  kEfa = 2,    ///< efa* / rdmap* (is_efa_device): the efa transport
};
const char* nic_family_name(NicFamily f);
/// "efa*" or "rdmap*": the one EFA device-name rule (verbs_ops.hpp's is_efa_device forwards here).
bool is_efa_name(const std::string& name);
/// How a RoCE v2 GID routes, by its address (UCCL-EP's and NCCL's preference): 0 IPv4-mapped, 1 IPv6 ULA fd00::/8
/// (Broadcom bnxt_re ports with IPv6 only), 2 another global IPv6; -1 never (empty, or link-local fe80::/10). The one
/// rule for the ibverbs transport's GID choice and `uccl-moe doctor`.
int roce_gid_preference(const uint8_t raw[16]);
/// "a, b, c".
std::string join_names(const std::vector<std::string>& names);

/// One RDMA device as sysfs describes it (/sys/class/infiniband/<name>).
struct SysfsRdmaDevice {
  std::string name;
  std::string pci_addr;               ///< "0000:05:00.0"; "" for a device without a PCI parent (rxe)
  std::vector<std::string> pci_path;  ///< "pci0000:00" (root complex), bridges..., pci_addr
  int numa_node = -1;
  bool efa = false;
  std::string port_state;  ///< of the port asked for: "ACTIVE", "DOWN", "INIT", ...; "" if unknown
  std::string link_layer;  ///< "InfiniBand" or "Ethernet"; "" if unknown
  std::string rate;        ///< "400 Gb/sec (4X NDR)"
};

/// One GPU as sysfs describes it (an NVIDIA or AMD PCI function of display/3D/processing-accelerator class).
struct SysfsGpu {
  std::string pci_addr;
  std::vector<std::string> pci_path;
  int numa_node = -1;
  std::string vendor;  ///< "nvidia" or "amd"
};

/// One GID table entry of a port (gids/<i>, gid_attrs/types/<i>, gid_attrs/ndevs/<i>); empty entries are skipped.
struct SysfsGid {
  int index = 0;
  std::string gid;   ///< "fe80:0000:...": as sysfs prints it
  std::string type;  ///< "RoCE v2", "IB/RoCE v1", or "" (InfiniBand ports have no types)
  std::string ndev;  ///< the Ethernet device the GID belongs to (RoCE)
};

std::vector<SysfsRdmaDevice> list_rdma_devices(const std::string& sysfs_root, int port = 1);
std::vector<SysfsGpu> list_gpus(const std::string& sysfs_root);
std::vector<SysfsGid> list_gids(const std::string& sysfs_root, const std::string& device, int port = 1);
/// MTU of an Ethernet device (/sys/class/net/<ndev>/mtu), -1 if unknown.
int netdev_mtu(const std::string& sysfs_root, const std::string& ndev);
/// /sys/devices/system/node/node<N>/cpulist ("0-47,96-143"), "" if unknown.
std::string numa_cpulist(const std::string& sysfs_root, int node);

/// "00000000:53:00.0" (nvidia-smi), "0000:53:00.0" (cudaDeviceGetPCIBusId), "53:00.0" -> "0000:53:00.0".
/// Throws InvalidUsage for text that is not a PCI bus id.
std::string normalize_pci_bus_id(const std::string& text);
/// PCIe hops between two devices through their deepest shared bridge; kPcieFar when under different root complexes
/// or when a path is unknown.
constexpr int kPcieFar = 1 << 16;
int pcie_distance(const std::vector<std::string>& a, const std::vector<std::string>& b);

/// UCCL_MOE_IB_HCA for one local rank: the device names it gives that rank, {} = automatic. Grammar:
///   ""/"auto"            automatic for every rank
///   "DEV"                every rank uses DEV (a name without ',' or ':')
///   "D0,D1,...,Dn-1"     local rank i uses Di (an entry may be "auto"); a rank >= n is an error
///   "0:D0,3:D3"          pairs; ranks not listed are automatic
/// Each D may join several devices with '+' ("rdmap79s0+rdmap80s0": EFA striping). Throws InvalidUsage naming the
/// variable on a malformed value.
std::vector<std::string> hca_for_rank(const std::string& text, int local_rank);

/// UCCL_MOE_PROXY_CPUS for one local rank. Grammar:
///   ""/"auto"            the CPUs of the chosen NIC's NUMA node (no pinning when the transport has no NIC)
///   "none"               no pinning
///   "LIST"               every rank: thread t on CPU LIST[t % n] ("0-3,64-67"; as before)
///   "L0;L1;...;Ln-1"     local rank i uses Li (an entry may be auto or none); a rank >= n is an error
///   "0:L0;2:L2"          pairs; ranks not listed are auto
struct ProxyCpuSpec {
  enum class Mode : int { kAuto = 0, kNone = 1, kList = 2 };
  Mode mode = Mode::kAuto;
  std::vector<int> cpus;  ///< kList
};
ProxyCpuSpec proxy_cpus_for_rank(const std::string& text, int local_rank);
/// Where a rank's proxy threads run: kList -> thread t on cpus[t % n]; kAuto -> every thread on the whole NUMA set of
/// the NIC (`nic_numa_cpus`), within `allowed` (the process's CPUs; empty = unknown, no filter); kNone -> nowhere.
struct ProxyPinning {
  std::vector<int> cpus;   ///< empty = not pinned
  bool whole_set = false;  ///< each thread gets all of cpus (NUMA mode), else one CPU each
  std::string note;        ///< why not pinned, when auto could not pin
};
ProxyPinning plan_proxy_pinning(const ProxyCpuSpec& spec, const std::string& nic_numa_cpus,
                                const std::vector<int>& allowed);
/// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; throws InvalidUsage naming `var`.
std::vector<int> parse_cpu_list(const std::string& text, const std::string& var = "UCCL_MOE_PROXY_CPUS");

struct NicRequest {
  std::string sysfs_root = "/sys";
  NicFamily family = NicFamily::kAny;
  std::string gpu_pci_bus_id;          ///< this rank's GPU ("" = unknown: assume the local_rank-th GPU by PCI order)
  int local_rank = 0;
  std::string hca;                     ///< UCCL_MOE_IB_HCA text
  std::vector<std::string> available;  ///< names the verbs layer lists (the transport passes them); empty = sysfs
  int port = 1;
};

struct NicChoice {
  std::vector<std::string> devices;    ///< chosen, primary first; EFA uses all, ibverbs the first that opens
  std::vector<std::string> fallbacks;  ///< automatic choice only: other devices of the family, closest first
  int numa_node = -1;                  ///< of devices[0] (else of the GPU); -1 unknown
  std::string numa_cpus;               ///< that node's CPU list; "" unknown
  int pcie_distance = -1;              ///< GPU to devices[0]; -1 unknown
  std::string gpu_pci_bus_id;          ///< normalized; the one assumed when the request had none
  std::string reason;                  ///< one line: why these devices
  std::string sysfs_root;              ///< the tree it was chosen from
  bool explicit_choice = false;        ///< devices came from UCCL_MOE_IB_HCA (a device that fails is an error)
};
/// Throws InvalidUsage for a bad UCCL_MOE_IB_HCA, a named device that does not exist or belongs to the other family.
NicChoice choose_nics(const NicRequest& req);

/// What the verbs transports call: the choice for ctx's GPU and local rank among `available` (their verbs device
/// list), with UCCL_MOE_IB_HCA, UCCL_MOE_IB_PORT and UCCL_MOE_SYSFS_ROOT from the environment.
NicChoice choose_transport_nics(const TransportContext& ctx, NicFamily family, const std::vector<std::string>& available);
/// Devices to try opening, in order: the chosen ones, then the fallbacks.
std::vector<std::string> nic_open_order(const NicChoice& c);
/// The TransportNic once `opened` (one of nic_open_order) was opened: the chosen set, or the fallback alone with its
/// own NUMA node.
TransportNic transport_nic(const NicChoice& c, const std::string& opened);

}  // namespace uccl_moe::detail
