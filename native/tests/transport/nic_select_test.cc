// NIC selection against the reconstructed sysfs trees of tests/fixtures/sysfs (p5en, MI300X + Thor-2, DGX H100):
// every GPU gets its nearest NIC(s), the NUMA node and CPU list come along, overrides and bad values.
#include "transport/nic_select.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(UCCL_MOE_SYSFS_FIXTURES) + "/" + name; }

NicChoice choose(const std::string& root, NicFamily fam, const std::string& gpu, int local_rank = 0,
                 const std::string& hca = "", std::vector<std::string> available = {}) {
  NicRequest r;
  r.sysfs_root = root;
  r.family = fam;
  r.gpu_pci_bus_id = gpu;
  r.local_rank = local_rank;
  r.hca = hca;
  r.available = std::move(available);
  return choose_nics(r);
}

/// A writable copy of a fixture (symlinks kept), for tests that take a port down.
class TreeCopy {
 public:
  explicit TreeCopy(const std::string& name) {
    char tmpl[] = "/tmp/uccl_nic_select_XXXXXX";
    root_ = mkdtemp(tmpl);
    fs::copy(fixture(name), root_, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  }
  ~TreeCopy() { fs::remove_all(root_); }
  void port_down(const std::string& dev) {
    std::ofstream(root_ + "/class/infiniband/" + dev + "/ports/1/state") << "1: DOWN\n";
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

std::vector<std::string> gpu_addrs(const std::string& root) {
  std::vector<std::string> out;
  for (const SysfsGpu& g : list_gpus(root)) out.push_back(g.pci_addr);
  return out;
}

template <typename F>
void expect_invalid(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning: " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(NicSelect, P5enTwoEfaDevicesBehindEachGpuSwitch) {
  const std::string root = fixture("p5en");
  const std::vector<std::string> gpus = gpu_addrs(root);
  ASSERT_EQ(gpus.size(), 8u) << "NVSwitches (class 0x0680) must not count as GPUs";
  EXPECT_EQ(list_rdma_devices(root).size(), 16u);
  const int bases[8] = {0x10, 0x20, 0x30, 0x40, 0x90, 0xa0, 0xb0, 0xc0};
  std::set<std::string> used;
  for (int g = 0; g < 8; ++g) {
    const NicChoice c = choose(root, NicFamily::kEfa, gpus[size_t(g)], g);
    const std::vector<std::string> want = {"rdmap" + std::to_string(bases[g] + 4) + "s0",
                                           "rdmap" + std::to_string(bases[g] + 5) + "s0"};
    EXPECT_EQ(c.devices, want) << "GPU " << gpus[size_t(g)] << ": " << c.reason;
    EXPECT_EQ(c.pcie_distance, 4) << c.reason;  // GPU -> downstream port -> switch <- downstream port <- EFA
    EXPECT_EQ(c.numa_node, g / 4);
    EXPECT_EQ(c.numa_cpus, g < 4 ? "0-47,96-143" : "48-95,144-191");
    EXPECT_EQ(c.fallbacks.size(), 14u);
    for (const std::string& d : c.devices) EXPECT_TRUE(used.insert(d).second) << d << " given to two GPUs";
  }
  EXPECT_EQ(used.size(), 16u);
}

TEST(NicSelect, Mi300xOneThor2PerGpu) {
  const std::string root = fixture("mi300x_bnxt_re");
  const std::vector<std::string> gpus = gpu_addrs(root);
  ASSERT_EQ(gpus.size(), 8u) << "MI300X is a processing accelerator (class 0x1200)";
  for (int g = 0; g < 8; ++g) {
    const NicChoice c = choose(root, NicFamily::kVerbs, gpus[size_t(g)], g);
    EXPECT_EQ(c.devices, std::vector<std::string>{"bnxt_re" + std::to_string(g)}) << c.reason;
    EXPECT_EQ(c.numa_node, g / 4);
    EXPECT_EQ(c.pcie_distance, 6) << c.reason;  // two OAM bridges above the GPU
  }
  // The EFA transport finds nothing here, and says so.
  const NicChoice efa = choose(root, NicFamily::kEfa, gpus[0]);
  EXPECT_TRUE(efa.devices.empty());
  EXPECT_NE(efa.reason.find("no efa"), std::string::npos) << efa.reason;
}

TEST(NicSelect, DgxH100ComputeNicPerGpuNeverStorage) {
  const std::string root = fixture("h100_mlx5");
  const std::vector<std::string> gpus = gpu_addrs(root);
  ASSERT_EQ(gpus.size(), 8u);
  const char* want[8] = {"mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"};
  for (int g = 0; g < 8; ++g) {
    const NicChoice c = choose(root, NicFamily::kVerbs, gpus[size_t(g)], g);
    EXPECT_EQ(c.devices, std::vector<std::string>{want[g]}) << c.reason;
    EXPECT_EQ(c.numa_cpus, g < 4 ? "0-55,112-167" : "56-111,168-223");
    // Storage ports that are down never appear, not even as fallbacks.
    for (const std::string& f : c.fallbacks) EXPECT_TRUE(f != "mlx5_2" && f != "mlx5_8") << f;
    // The closest fallback is the NIC of the GPU that shares the top-level switch.
    ASSERT_FALSE(c.fallbacks.empty());
    EXPECT_EQ(c.fallbacks[0], want[g ^ 1]);
  }
}

TEST(NicSelect, BusIdFormatsAndAssumedGpu) {
  const std::string root = fixture("h100_mlx5");
  EXPECT_EQ(choose(root, NicFamily::kVerbs, "00000000:45:00.0").devices, std::vector<std::string>{"mlx5_4"});
  EXPECT_EQ(choose(root, NicFamily::kVerbs, "0000:C5:00.0").devices, std::vector<std::string>{"mlx5_10"});
  EXPECT_EQ(normalize_pci_bus_id("d5:00.0"), "0000:d5:00.0");
  // No bus id: the local_rank-th GPU in PCI order.
  const NicChoice c = choose(root, NicFamily::kVerbs, "", 2);
  EXPECT_EQ(c.devices, std::vector<std::string>{"mlx5_4"});
  EXPECT_EQ(c.gpu_pci_bus_id, "0000:45:00.0");
  EXPECT_NE(c.reason.find("assumed"), std::string::npos) << c.reason;
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "GPU-0"); }, "not a PCI bus id");
  expect_invalid([&] { normalize_pci_bus_id("0000:53:00"); }, "not a PCI bus id");
}

TEST(NicSelect, DownNicFallsBackToTheClosestActiveOne) {
  TreeCopy t("h100_mlx5");
  t.port_down("mlx5_0");
  const std::vector<std::string> gpus = gpu_addrs(t.root());
  const NicChoice c = choose(t.root(), NicFamily::kVerbs, gpus[0], 0);
  EXPECT_EQ(c.devices, std::vector<std::string>{"mlx5_3"}) << c.reason;  // same top-level switch
  EXPECT_EQ(c.pcie_distance, 8);
  EXPECT_EQ(c.numa_node, 0);
}

TEST(NicSelect, NumaBreaksTiesAcrossRootComplexes) {
  TreeCopy t("mi300x_bnxt_re");
  t.port_down("bnxt_re0");
  const std::vector<std::string> gpus = gpu_addrs(t.root());
  const NicChoice c = choose(t.root(), NicFamily::kVerbs, gpus[0], 0);
  ASSERT_EQ(c.devices.size(), 1u) << c.reason;
  // Every other NIC sits under another root complex: those of the GPU's own NUMA node win.
  EXPECT_TRUE(c.devices[0] == "bnxt_re1" || c.devices[0] == "bnxt_re2" || c.devices[0] == "bnxt_re3") << c.devices[0];
  EXPECT_EQ(c.numa_node, 0);
  EXPECT_EQ(c.pcie_distance, -1);
  EXPECT_NE(c.reason.find("same NUMA node"), std::string::npos) << c.reason;
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(c.fallbacks[i] != "bnxt_re4" && c.fallbacks[i] != "bnxt_re5");
}

TEST(NicSelect, WithoutTopologyRoundRobinOverTheVerbsList) {
  const std::string empty = ::testing::TempDir();
  const NicChoice c = choose(empty, NicFamily::kVerbs, "", 1, "", {"mlx5_0", "mlx5_1", "rdmap0s6"});
  EXPECT_EQ(c.devices, std::vector<std::string>{"mlx5_1"});
  EXPECT_EQ(c.fallbacks, std::vector<std::string>{"mlx5_0"});
  EXPECT_EQ(c.numa_node, -1);
  EXPECT_EQ(choose(empty, NicFamily::kEfa, "", 3, "", {"mlx5_0", "rdmap0s6"}).devices,
            std::vector<std::string>{"rdmap0s6"});
  EXPECT_TRUE(choose(empty, NicFamily::kVerbs, "", 0).devices.empty());
}

TEST(NicSelect, VerbsListFiltersSysfs) {
  const std::string root = fixture("h100_mlx5");
  // The verbs layer does not list mlx5_0 (e.g. hidden by the container): GPU 0 takes the next closest.
  const NicChoice c = choose(root, NicFamily::kVerbs, gpu_addrs(root)[0], 0, "",
                             {"mlx5_1", "mlx5_3", "mlx5_4", "mlx5_5"});
  EXPECT_EQ(c.devices, std::vector<std::string>{"mlx5_3"});
}

TEST(NicSelect, HcaOverrides) {
  const std::string root = fixture("mi300x_bnxt_re");
  const std::string g0 = gpu_addrs(root)[0];
  EXPECT_EQ(choose(root, NicFamily::kVerbs, g0, 5, "bnxt_re7").devices, std::vector<std::string>{"bnxt_re7"});
  const NicChoice pos = choose(root, NicFamily::kVerbs, g0, 2, "bnxt_re3,bnxt_re2,bnxt_re1,bnxt_re0");
  EXPECT_EQ(pos.devices, std::vector<std::string>{"bnxt_re1"});
  EXPECT_EQ(pos.numa_node, 0);
  EXPECT_NE(pos.reason.find("UCCL_MOE_IB_HCA"), std::string::npos);
  EXPECT_TRUE(pos.fallbacks.empty()) << "an explicit choice has no fallbacks";
  // Pairs: listed ranks take theirs, the others are automatic.
  EXPECT_EQ(choose(root, NicFamily::kVerbs, g0, 1, "1:bnxt_re6, 4:bnxt_re4").devices,
            std::vector<std::string>{"bnxt_re6"});
  EXPECT_EQ(choose(root, NicFamily::kVerbs, g0, 0, "1:bnxt_re6,4:bnxt_re4").devices,
            std::vector<std::string>{"bnxt_re0"});
  EXPECT_EQ(choose(root, NicFamily::kVerbs, g0, 1, "bnxt_re5,auto").devices, std::vector<std::string>{"bnxt_re0"});
  // '+' joins several devices (EFA striping).
  const std::string p5 = fixture("p5en");
  EXPECT_EQ(choose(p5, NicFamily::kEfa, "", 1, "rdmap20s0+rdmap21s0,rdmap36s0+rdmap37s0").devices,
            (std::vector<std::string>{"rdmap36s0", "rdmap37s0"}));
}

TEST(NicSelect, HcaErrors) {
  const std::string root = fixture("mi300x_bnxt_re");
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "", 3, "bnxt_re0,bnxt_re1"); }, "local rank 3 has none");
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "", 0, "bnxt_re9"); }, "only: bnxt_re0");
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "", 0, "0:bnxt_re1,bnxt_re2"); }, "mixes positional");
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "", 0, "0:bnxt_re1,0:bnxt_re2"); }, "names local rank 0 twice");
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "", 0, "x:bnxt_re1"); }, "is not a local rank");
  expect_invalid([&] { choose(root, NicFamily::kVerbs, "", 0, "bnxt re0"); }, "is not an RDMA device name");
  expect_invalid([&] { choose(fixture("p5en"), NicFamily::kVerbs, "", 0, "rdmap20s0"); }, "an EFA device");
  expect_invalid([&] { choose(::testing::TempDir(), NicFamily::kEfa, "", 0, "rdmap20s0"); }, "no RDMA devices");
  // The verbs layer's names count as existing even when sysfs lacks them.
  EXPECT_EQ(choose(::testing::TempDir(), NicFamily::kVerbs, "", 0, "fake0", {"fake0"}).devices,
            std::vector<std::string>{"fake0"});
}

TEST(NicSelect, ProxyCpus) {
  using M = ProxyCpuSpec::Mode;
  EXPECT_EQ(proxy_cpus_for_rank("", 3).mode, M::kAuto);
  EXPECT_EQ(proxy_cpus_for_rank("auto", 3).mode, M::kAuto);
  EXPECT_EQ(proxy_cpus_for_rank("none", 3).mode, M::kNone);
  ProxyCpuSpec s = proxy_cpus_for_rank("0-3,64-65", 7);
  EXPECT_EQ(s.mode, M::kList);
  EXPECT_EQ(s.cpus, (std::vector<int>{0, 1, 2, 3, 64, 65}));
  EXPECT_EQ(proxy_cpus_for_rank("0-3;8-11;none", 1).cpus, (std::vector<int>{8, 9, 10, 11}));
  EXPECT_EQ(proxy_cpus_for_rank("0-3;8-11;none", 2).mode, M::kNone);
  EXPECT_EQ(proxy_cpus_for_rank("0:0-3;5:20,22", 5).cpus, (std::vector<int>{20, 22}));
  EXPECT_EQ(proxy_cpus_for_rank("0:0-3;5:20,22", 4).mode, M::kAuto);
  expect_invalid([] { proxy_cpus_for_rank("0-3;8-11", 2); }, "local rank 2 has none");
  expect_invalid([] { proxy_cpus_for_rank("0-3x", 0); }, "\"0-3x\" is not a CPU or range");
  expect_invalid([] { proxy_cpus_for_rank("3-1", 0); }, "is not a CPU or range");
  expect_invalid([] { proxy_cpus_for_rank("0:1;2", 0); }, "mixes positional");
  expect_invalid([] { proxy_cpus_for_rank(",", 0); }, "gives local rank 0 no CPU");
}

TEST(NicSelect, ProxyPinningPlan) {
  const ProxyCpuSpec autos = proxy_cpus_for_rank("auto", 0);
  ProxyPinning p = plan_proxy_pinning(autos, "0-3,8-9", {});
  EXPECT_EQ(p.cpus, (std::vector<int>{0, 1, 2, 3, 8, 9}));
  EXPECT_TRUE(p.whole_set);
  p = plan_proxy_pinning(autos, "0-3,8-9", {2, 3, 4, 9});  // a Slurm cpuset: only its share of the node
  EXPECT_EQ(p.cpus, (std::vector<int>{2, 3, 9}));
  p = plan_proxy_pinning(autos, "0-3", {4, 5});
  EXPECT_TRUE(p.cpus.empty());
  EXPECT_NE(p.note.find("outside this process's CPU set"), std::string::npos);
  EXPECT_TRUE(plan_proxy_pinning(autos, "", {0}).cpus.empty()) << "loopback: no NIC, no pinning";
  p = plan_proxy_pinning(proxy_cpus_for_rank("5;6", 1), "0-3", {0});
  EXPECT_EQ(p.cpus, std::vector<int>{6});
  EXPECT_FALSE(p.whole_set) << "an explicit list pins one CPU per thread, as it always did";
  EXPECT_TRUE(plan_proxy_pinning(proxy_cpus_for_rank("none", 0), "0-3", {}).cpus.empty());
  // The sysfs NUMA list of a fixture feeds it unchanged.
  EXPECT_EQ(plan_proxy_pinning(autos, numa_cpulist(fixture("p5en"), 1), {}).cpus.size(), 96u);
}

TEST(NicSelect, GidsAndNetdevMtu) {
  const std::string root = fixture("mi300x_bnxt_re");
  const std::vector<SysfsGid> gids = list_gids(root, "bnxt_re2");
  ASSERT_EQ(gids.size(), 4u);
  EXPECT_EQ(gids[3].type, "RoCE v2");
  EXPECT_EQ(gids[3].gid.substr(0, 30), "0000:0000:0000:0000:0000:ffff:");
  EXPECT_EQ(gids[0].gid.substr(0, 4), "fe80");
  EXPECT_EQ(netdev_mtu(root, gids[3].ndev), 9000);
  const std::vector<SysfsRdmaDevice> devs = list_rdma_devices(root);
  ASSERT_EQ(devs.size(), 8u);
  EXPECT_EQ(devs[0].link_layer, "Ethernet");
  EXPECT_EQ(devs[0].port_state, "ACTIVE");
  EXPECT_EQ(list_gids(fixture("h100_mlx5"), "mlx5_0")[0].type, "");
}

TEST(NicSelect, PcieDistance) {
  EXPECT_EQ(pcie_distance({"pci0000:00", "a", "b"}, {"pci0000:00", "a", "c"}), 2);
  EXPECT_EQ(pcie_distance({"pci0000:00", "a"}, {"pci0000:80", "a"}), kPcieFar);
  EXPECT_EQ(pcie_distance({}, {"pci0000:00", "a"}), kPcieFar);
}

}  // namespace
}  // namespace uccl_moe::detail
