// The ibverbs transport opens the NIC nic_select chooses for its GPU (fake verbs over a recorded sysfs tree), falls
// back to the next closest one when that fails to open, and honours a per-rank UCCL_MOE_IB_HCA.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <set>

#include "ibverbs/fake_verbs.hpp"
#include "transport/device_caps.hpp"
#include "transport/ibverbs/ibverbs_detail.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

/// The DGX H100 fixture's device names; open_device fails for the names in `broken`.
class NamedFakeVerbs : public test::FakeVerbs {
 public:
  NamedFakeVerbs(std::shared_ptr<test::FakeFabric> f, std::set<std::string> broken)
      : FakeVerbs(std::move(f)), broken_(std::move(broken)) {}
  std::vector<std::string> device_names() override {
    return {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5",
            "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9", "mlx5_10", "mlx5_11"};
  }
  ibv_context* open_device(const std::string& name) override {
    opened.push_back(name);
    // The strict fake models one device (its profile); every fixture name opens as that model.
    return broken_.count(name) ? nullptr : FakeVerbs::open_device(profile().name);
  }
  std::vector<std::string> opened;

 private:
  std::set<std::string> broken_;
};

class NicWiring : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCCL_MOE_SYSFS_ROOT", UCCL_MOE_SYSFS_FIXTURES "/h100_mlx5", 1);
    unsetenv("UCCL_MOE_IB_HCA");
    env::reset_cache();
  }
  void TearDown() override {
    unsetenv("UCCL_MOE_SYSFS_ROOT");
    unsetenv("UCCL_MOE_IB_HCA");
    env::reset_cache();
  }
  TransportNic open(const std::string& gpu, int local_rank, std::set<std::string> broken = {},
                    std::vector<std::string>* opened = nullptr) {
    TransportContext c(Timeout::resolve());
    c.gpu_pci_bus_id = gpu;
    c.local_rank = local_rank;
    auto ops = std::make_shared<NamedFakeVerbs>(std::make_shared<test::FakeFabric>(), std::move(broken));
    auto t = detail::create_ibverbs_transport_with(c, ops);
    if (opened) *opened = ops->opened;
    return t->nic();
  }
};

TEST_F(NicWiring, OpensTheGpusNearestNic) {
  std::vector<std::string> opened;
  const TransportNic n = open("0000:45:00.0", 2, {}, &opened);
  EXPECT_EQ(n.devices, std::vector<std::string>{"mlx5_4"});
  EXPECT_EQ(opened, std::vector<std::string>{"mlx5_4"}) << "the first active device is no longer taken blindly";
  EXPECT_EQ(n.numa_node, 0);
  EXPECT_EQ(n.numa_cpus, "0-55,112-167");
  EXPECT_EQ(open("0000:d5:00.0", 7).devices, std::vector<std::string>{"mlx5_11"});
}

TEST_F(NicWiring, FallsBackToTheNextClosest) {
  std::vector<std::string> opened;
  const TransportNic n = open("0000:45:00.0", 2, {"mlx5_4"}, &opened);
  EXPECT_EQ(opened, (std::vector<std::string>{"mlx5_4", "mlx5_5"}));
  EXPECT_EQ(n.devices, std::vector<std::string>{"mlx5_5"});
  EXPECT_EQ(n.numa_node, 0);
  EXPECT_NE(n.reason.find("fallback mlx5_5"), std::string::npos) << n.reason;
}

TEST_F(NicWiring, PerRankOverride) {
  setenv("UCCL_MOE_IB_HCA", "0:mlx5_9,1:mlx5_10", 1);
  env::reset_cache();
  EXPECT_EQ(open("0000:15:00.0", 1).devices, std::vector<std::string>{"mlx5_10"});
  EXPECT_EQ(open("0000:15:00.0", 2).devices, std::vector<std::string>{"mlx5_0"}) << "unlisted rank: automatic";
  // An explicit device that does not open is an error naming it, not a silent switch to another NIC.
  try {
    open("0000:15:00.0", 0, {"mlx5_9"});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlx5_9"), std::string::npos) << e.what();
  }
  setenv("UCCL_MOE_IB_HCA", "mlx5_0,mlx5_3", 1);
  env::reset_cache();
  try {
    open("0000:15:00.0", 4);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("local rank 4 has none"), std::string::npos) << e.what();
  }
}

// doctor's capability query goes through the verbs seam: what the device reports, and a named error when it does not
// open.
TEST(DeviceCaps, ThroughTheVerbsSeam) {
  auto fabric = std::make_shared<test::FakeFabric>();
  fabric->atomics = false;
  NamedFakeVerbs ops(fabric, {"mlx5_3"});
  const detail::RdmaDeviceCaps c = detail::query_device_caps(ops, "mlx5_0", 1, false);
  EXPECT_EQ(c.error, "");
  EXPECT_EQ(c.atomic_cap, "none");
  EXPECT_EQ(c.port_state, "ACTIVE");
  EXPECT_EQ(c.link_layer, "Ethernet");
  EXPECT_EQ(c.active_mtu, 4096);
  EXPECT_EQ(c.gid_tbl_len, 4);
  EXPECT_FALSE(c.efa_queried);
  const detail::RdmaDeviceCaps bad = detail::query_device_caps(ops, "mlx5_3", 1, false);
  EXPECT_NE(bad.error.find("ibv_open_device"), std::string::npos) << bad.error;
}

}  // namespace
}  // namespace uccl_moe
