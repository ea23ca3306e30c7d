// The efa transport with several EFA devices per GPU (p5en: two, striped over the proxy threads), with GPU memory
// registered through dma-buf, and with data regions larger than a device's max_mr_size (chunked MRs), over the strict
// fake (native/tests/transport/fake_nic/efa_fake.hpp), whose hosts expose several devices that refuse each other's
// MRs, CQs, PDs and AHs as the provider does.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>

#include "../fake_nic/efa_fake.hpp"
#include "../work_request.hpp"
#include "transport/efa/efa_detail.hpp"
#include "transport/nic_select.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

using test::EfaFabric;
using test::EfaProfile;
using test::FakeEfaNic;
constexpr uint64_t kMiB = 1 << 20;

std::string p5en_root() { return std::string(UCCL_MOE_SYSFS_FIXTURES) + "/p5en"; }

/// The p5en fixture's GPUs by PCI address: GPU g sits behind the switch of EFA devices 2g and 2g + 1.
std::vector<std::string> p5en_gpus() {
  std::vector<std::string> out;
  for (const auto& g : detail::list_gpus(p5en_root())) out.push_back(g.pci_addr);
  std::sort(out.begin(), out.end());
  return out;
}

/// Sets UCCL_MOE_* variables for one test and restores them.
class EnvGuard {
 public:
  EnvGuard(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (auto& [k, v] : vars) {
      names_.push_back(k);
      setenv(k, v, 1);
    }
    env::reset_cache();
  }
  ~EnvGuard() {
    for (const char* k : names_) unsetenv(k);
    env::reset_cache();
  }

 private:
  std::vector<const char*> names_;
};

/// One rank per host: `hosts[r]` is rank r's fake host (its devices), every rank on GPU `gpu` of its host.
struct Cluster {
  std::shared_ptr<EfaFabric> fabric;
  std::vector<std::shared_ptr<FakeEfaNic>> nics;
  MemoryKvStore store;
  std::vector<std::unique_ptr<Transport>> t;
  std::vector<std::vector<std::unique_ptr<Endpoint>>> ep;  // [rank][thread]
  std::vector<std::vector<uint8_t>> mem;
  std::vector<uint8_t*> data;  // 2 MiB aligned inside mem (as cudaMalloc returns)
  size_t bytes;

  struct Opts {
    int threads = 4;
    int gpu = 0;
    size_t bytes = 1 << 20;
    uint64_t align = 2 << 20;    ///< the allocation's alignment (cudaMalloc: 2 MiB)
    uint64_t region_offset = 0;  ///< data region starts this far past that boundary
    std::function<void(TransportContext&, FakeEfaNic&, uint8_t*)> setup;  ///< per rank, before registration
    std::shared_ptr<EfaFabric> fabric;  ///< null: a new one (seed, reorder)
  };

  Cluster(const std::vector<std::vector<EfaProfile>>& hosts, const Opts& o, uint64_t seed = 1, int reorder = 0)
      : fabric(o.fabric ? o.fabric : std::make_shared<EfaFabric>(seed, reorder)), bytes(o.bytes) {
    const int n = int(hosts.size());
    const std::vector<std::string> gpus = p5en_gpus();
    for (int r = 0; r < n; ++r) {
      nics.push_back(std::make_shared<FakeEfaNic>(fabric, hosts[size_t(r)]));
      mem.emplace_back(o.bytes + o.region_offset + 2 * o.align);
      const uint64_t a = (uint64_t(reinterpret_cast<uintptr_t>(mem.back().data())) + o.align - 1) / o.align * o.align;
      data.push_back(reinterpret_cast<uint8_t*>(a + o.region_offset));
      TransportContext c(Timeout::resolve());
      c.rank = r;
      c.num_ranks = n;
      c.num_threads = o.threads;
      c.job = "efamulti";
      c.timeout_s = 10;
      c.verbs = nics.back();
      c.gpu_pci_bus_id = gpus.at(size_t(o.gpu));
      c.local_rank = o.gpu;
      if (o.setup) o.setup(c, *nics.back(), data.back());
      t.push_back(detail::create_efa_transport(c));
      t.back()->register_memory(MemoryKind::kData, data.back(), o.bytes);
      ep.emplace_back();
      for (int th = 0; th < o.threads; ++th) ep.back().push_back(t.back()->create_endpoint(th));
    }
    std::vector<std::thread> th;
    for (int r = 0; r < n; ++r)
      for (auto& e : ep[size_t(r)]) th.emplace_back([this, &e] { e->connect(store); });
    for (auto& x : th) x.join();
  }
  /// Polls every endpoint until `done` holds; returns completions per [rank][thread].
  using Got = std::vector<std::vector<std::vector<Completion>>>;
  Got poll_until(const std::function<bool(const Got&)>& done, int max_rounds = 5000) {
    Got got(ep.size());
    for (size_t r = 0; r < ep.size(); ++r) got[r].resize(ep[r].size());
    for (int i = 0; i < max_rounds && !done(got); ++i)
      for (size_t r = 0; r < ep.size(); ++r)
        for (size_t th = 0; th < ep[r].size(); ++th) ep[r][th]->poll(got[r][th], 64);
    return got;
  }
  /// The fake device each QP of rank r's transport lives on, by QP creation order (= thread order).
  std::vector<std::string> qp_devices(int r) {
    std::vector<std::pair<uint32_t, std::string>> q;
    for (auto& [qpn, qp] : fabric->qps)
      for (const std::string& name : nics[size_t(r)]->device_names())
        if (qp->dev == &nics[size_t(r)]->dev(name)) q.emplace_back(qpn, name);
    std::sort(q.begin(), q.end());
    std::vector<std::string> out;
    for (auto& x : q) out.push_back(x.second);
    return out;
  }
};

int count(const std::vector<Completion>& v, CompletionKind k) {
  int n = 0;
  for (const auto& c : v) n += c.kind == k;
  return n;
}

// p5en: each rank opens both EFA devices nic_select assigns to its GPU; proxy thread t has its QP on device t % 2;
// writes from every thread land, and both devices carry traffic on both ends.
TEST(EfaStripes, BothDevicesOfTheGpuOpenedAndThreadsStriped) {
  EnvGuard env({{"UCCL_MOE_SYSFS_ROOT", p5en_root().c_str()}});
  const std::vector<std::string> names = test::p5en_efa_names();
  for (int gpu : {0, 5}) {
    Cluster::Opts o;
    o.gpu = gpu;
    Cluster k({test::p5en_host(), test::p5en_host()}, o, 3, 8);
    const std::string a = names[size_t(2 * gpu)], b = names[size_t(2 * gpu + 1)];
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(k.t[size_t(r)]->nic().devices, (std::vector<std::string>{a, b})) << k.t[size_t(r)]->nic().reason;
      EXPECT_EQ(k.qp_devices(r), (std::vector<std::string>{a, b, a, b})) << "thread t on device t % 2";
    }
    for (uint32_t i = 0; i < 64; ++i) k.data[0][i] = uint8_t(i + 1);
    for (int th = 0; th < 4; ++th)
      for (uint32_t i = 0; i < 8; ++i)
        k.ep[0][size_t(th)]->post(test::write_imm(i, 1, 0, 4096 * uint64_t(th * 8 + i), 64, uint32_t(th * 100 + i)));
    auto got = k.poll_until([](auto& g) {
      int s = 0, r = 0;
      for (auto& v : g[0]) s += count(v, CompletionKind::kSend);
      for (auto& v : g[1]) r += count(v, CompletionKind::kRecvImm);
      return s == 32 && r == 32;
    });
    for (int th = 0; th < 4; ++th) {
      EXPECT_EQ(count(got[0][size_t(th)], CompletionKind::kSend), 8) << "thread " << th;
      ASSERT_EQ(count(got[1][size_t(th)], CompletionKind::kRecvImm), 8) << "thread " << th;
      for (const Completion& c : got[1][size_t(th)]) {
        EXPECT_EQ(c.peer, 0);
        EXPECT_EQ(c.imm / 100, uint32_t(th)) << "an immediate reached another thread's endpoint";
      }
      for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(k.data[1][4096 * (th * 8 + i) + 63], 64);
    }
    for (const std::string& d : {a, b}) {
      EXPECT_EQ(k.nics[0]->dev(d).writes, 16u) << d << ": the sender's two devices share the traffic";
      EXPECT_EQ(k.nics[1]->dev(d).imms_received, 16u) << d;
    }
    EXPECT_EQ(k.nics[0]->dev(names[(size_t(2 * gpu) + 2) % 16]).writes, 0u) << "another GPU's device stays idle";
  }
}

// One of the GPU's two devices does not open, or its port is down: the automatic choice keeps the other (every thread
// on it, traffic flows) and says so in the NIC reason; named in UCCL_MOE_IB_HCA it is an error naming the device.
TEST(EfaStripes, AMissingDeviceLeavesTheOtherOrIsAnErrorWhenNamed) {
  EnvGuard env({{"UCCL_MOE_SYSFS_ROOT", p5en_root().c_str()}});
  const std::vector<std::string> names = test::p5en_efa_names();
  for (bool port_down : {false, true}) {
    std::vector<EfaProfile> host = test::p5en_host();
    (port_down ? host[1].port_active : host[1].opens) = false;
    Cluster k({host, host}, Cluster::Opts{});
    const TransportNic nic = k.t[0]->nic();
    EXPECT_EQ(nic.devices, std::vector<std::string>{names[0]});
    EXPECT_NE(nic.reason.find(names[1] + " ("), std::string::npos) << nic.reason;
    EXPECT_NE(nic.reason.find(port_down ? "not ACTIVE" : "ibv_open_device"), std::string::npos) << nic.reason;
    EXPECT_EQ(k.qp_devices(0), std::vector<std::string>(4, names[0]));
    for (int th = 0; th < 4; ++th) k.ep[0][size_t(th)]->post(test::write_imm(1, 1, 0, 64 * uint64_t(th), 64, 5));
    auto got = k.poll_until([](auto& g) {
      int r = 0;
      for (auto& v : g[1]) r += count(v, CompletionKind::kRecvImm);
      return r == 4;
    });
    int r = 0;
    for (auto& v : got[1]) r += count(v, CompletionKind::kRecvImm);
    EXPECT_EQ(r, 4);
  }
  // Both of the GPU's devices gone: the next closest device serves it (a fallback, as with one NIC per GPU).
  {
    std::vector<EfaProfile> host = test::p5en_host();
    host[0].opens = host[1].opens = false;
    Cluster k({host, host}, Cluster::Opts{});
    ASSERT_EQ(k.t[0]->nic().devices.size(), 1u);
    EXPECT_NE(k.t[0]->nic().devices[0], names[0]);
    EXPECT_NE(k.t[0]->nic().reason.find("fallback"), std::string::npos) << k.t[0]->nic().reason;
  }
  // Named explicitly: no silent downgrade.
  EnvGuard hca({{"UCCL_MOE_IB_HCA", (names[0] + "+" + names[1]).c_str()}});
  std::vector<EfaProfile> host = test::p5en_host();
  host[1].opens = false;
  try {
    Cluster k({host, host}, Cluster::Opts{});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kTransport) << w;
    EXPECT_NE(w.find(names[1] + " ("), std::string::npos) << w;
    EXPECT_NE(w.find("UCCL_MOE_IB_HCA"), std::string::npos) << w;
  }
  // Every device unusable: the error lists why each failed.
  std::vector<EfaProfile> dead = test::p5en_host();
  for (auto& p : dead) p.device_caps &= ~detail::kEfaCapRdmaWrite;
  EnvGuard auto_hca({{"UCCL_MOE_IB_HCA", "auto"}});
  try {
    Cluster k({dead}, Cluster::Opts{});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE"), std::string::npos) << e.what();
  }
}

// The fake: a resource of one device used with another device's QP fails as on the device.
TEST(EfaFake, ResourcesOfAnotherDeviceAreRefused) {
  auto fabric = std::make_shared<EfaFabric>();
  EfaProfile a = test::p5en_profile(), b = test::p5en_profile(), c = test::p5en_profile();
  a.name = "rdmap0s0";
  b.name = "rdmap1s0";
  c.name = "rdmap2s0";
  FakeEfaNic host1(fabric, std::vector<EfaProfile>{a, b});
  FakeEfaNic host2(fabric, c);
  ibv_context* ca = host1.open_device("rdmap0s0");
  ibv_context* cb = host1.open_device("rdmap1s0");
  ibv_context* cc = host2.open_device("rdmap2s0");
  ASSERT_TRUE(ca && cb && cc && ca != cb);
  auto make_qp = [](FakeEfaNic& nic, ibv_context* ctx, ibv_pd* pd, ibv_cq* cq) {
    ibv_qp_init_attr_ex x{};
    x.qp_type = IBV_QPT_DRIVER;
    x.send_cq = x.recv_cq = cq;
    x.pd = pd;
    x.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    x.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE;
    x.cap.max_send_wr = x.cap.max_recv_wr = 16;
    x.cap.max_send_sge = x.cap.max_recv_sge = 1;
    detail::EfaQpInitAttr e;
    e.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
    e.flags = detail::kEfaQpFlagUnsolicitedWriteRecv;
    ibv_qp* q = nic.create_srd_qp(ctx, &x, e);
    if (!q) return q;
    for (const auto& tr : {detail::srd_init(1, 7), detail::srd_rtr(), detail::srd_rts(1, true)}) {
      ibv_qp_attr at = tr.attr;
      if (nic.modify_qp(q, &at, tr.mask)) return static_cast<ibv_qp*>(nullptr);
    }
    return q;
  };
  ibv_pd *pa = host1.alloc_pd(ca), *pb = host1.alloc_pd(cb), *pc = host2.alloc_pd(cc);
  ibv_cq *qa = host1.create_cq(ca, 64), *qb = host1.create_cq(cb, 64), *qc = host2.create_cq(cc, 64);
  EXPECT_EQ(make_qp(host1, cb, pa, qb), nullptr) << "a PD of device A for a QP of device B";
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(make_qp(host1, cb, pb, qa), nullptr) << "a CQ of device A for a QP of device B";
  ibv_qp* sender = make_qp(host1, cb, pb, qb);
  ibv_qp* receiver = make_qp(host2, cc, pc, qc);
  ASSERT_TRUE(sender && receiver);
  std::vector<uint8_t> src(4096, 0x3C), dst(4096, 0);
  ibv_mr* mr_a = host1.reg_mr(pa, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* mr_b = host1.reg_mr(pb, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* mr_c = host2.reg_mr(pc, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_mr* mr_a_remote = host1.reg_mr(pa, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_ah_attr aa{};
  aa.is_global = 1;
  aa.port_num = 1;
  aa.grh.dgid = host2.dev(0).gid;
  ibv_ah* ah_b = host1.create_ah(pb, &aa);
  ibv_ah* ah_a = host1.create_ah(pa, &aa);
  ibv_qp_ex* x = host1.qp_to_qp_ex(sender);
  auto send = [&](uint64_t id, uint32_t lkey, uint32_t rkey, ibv_ah* ah) {
    host1.wr_start(x);
    x->wr_id = id;
    host1.wr_rdma_write(x, rkey, uint64_t(reinterpret_cast<uintptr_t>(dst.data())));
    host1.wr_set_sge(x, lkey, uint64_t(reinterpret_cast<uintptr_t>(src.data())), 512);
    host1.wr_set_ud_addr(x, ah, receiver->qp_num, 7);
    EXPECT_EQ(host1.wr_complete(x), 0);
    ibv_wc wc[4];
    int n = 0;
    for (int i = 0; i < 10 && n == 0; ++i) n = host1.poll_cq(qb, 4, wc);
    EXPECT_EQ(n, 1);
    EXPECT_EQ(wc[0].wr_id, id);
    return wc[0].status;
  };
  EXPECT_EQ(send(1, mr_a->lkey, mr_c->rkey, ah_b), IBV_WC_LOC_PROT_ERR) << "an lkey of device A on device B's QP";
  EXPECT_EQ(send(2, mr_b->lkey, mr_c->rkey, ah_a), IBV_WC_LOC_QP_OP_ERR) << "an AH of device A";
  EXPECT_EQ(send(3, mr_b->lkey, mr_a_remote->rkey, ah_b), IBV_WC_REM_ACCESS_ERR) << "an rkey of another device";
  EXPECT_EQ(dst[0], 0);
  EXPECT_EQ(send(4, mr_b->lkey, mr_c->rkey, ah_b), IBV_WC_SUCCESS);
  EXPECT_EQ(dst[511], 0x3C);
  EXPECT_EQ(host1.dev("rdmap1s0").writes, 1u);
  EXPECT_EQ(host1.dev("rdmap0s0").writes, 0u);
}

// GPU data region on EFA: registered through dma-buf on every device (no peer-memory module needed), the fake
// refusing ibv_reg_mr of GPU memory without one (EOPNOTSUPP, what p5en users without efa_nv_peermem see); dma-buf
// unavailable: peer memory; neither: the ibverbs transport's error naming both fixes.
TEST(EfaGpuMemory, DmabufOnEveryDeviceElsePeerMemoryElseANamedError) {
  EnvGuard env({{"UCCL_MOE_SYSFS_ROOT", p5en_root().c_str()}});
  struct Run {
    std::shared_ptr<EfaFabric> fabric = std::make_shared<EfaFabric>();
    std::shared_ptr<test::EfaExporter> exporter = std::make_shared<test::EfaExporter>();
    Cluster::Opts opts(bool dmabuf, bool peer) {
      exporter->fabric = fabric;
      Cluster::Opts o;
      o.threads = 2;
      o.fabric = fabric;
      o.setup = [dmabuf, peer, ex = exporter](TransportContext& c, FakeEfaNic& nic, uint8_t* data) {
        for (const std::string& n : nic.device_names()) {
          nic.dev(n).prof.dmabuf = dmabuf;
          nic.dev(n).prof.peer_memory = peer;
        }
        nic.mark_gpu(data, 1 << 20);
        auto g = std::make_shared<GpuMemoryOps>();
        g->export_dmabuf = [ex](void* p, uint64_t b, std::string* w) { return (*ex)(p, b, w); };
        c.gpu = g;
      };
      return o;
    }
  };
  const std::vector<std::string> names = test::p5en_efa_names();
  {
    Run run;
    Cluster k({test::p5en_host(), test::p5en_host()}, run.opts(/*dmabuf=*/true, /*peer=*/false));
    ASSERT_EQ(run.fabric->dmabuf_regs.size(), 4u) << "2 ranks x 2 devices";
    EXPECT_EQ(run.fabric->dmabuf_regs[0].dev, names[0]);
    EXPECT_EQ(run.fabric->dmabuf_regs[1].dev, names[1]);
    EXPECT_EQ(run.fabric->dmabuf_regs[0].iova, uint64_t(reinterpret_cast<uintptr_t>(k.data[0])));
    EXPECT_EQ(run.fabric->dmabuf_regs[0].length, 1u << 20);
    EXPECT_EQ(run.exporter->exports[0].first % detail::kDmabufAlignBytes, 0u);
    // The fake refuses the peer-memory path here: plain ibv_reg_mr of the GPU region.
    FakeEfaNic& nic = *k.nics[0];
    errno = 0;
    EXPECT_EQ(nic.reg_mr(nic.alloc_pd(nic.open_device(names[0])), k.data[0], 4096, IBV_ACCESS_LOCAL_WRITE), nullptr);
    EXPECT_EQ(errno, EOPNOTSUPP);
    // Traffic over the dma-buf MRs, both threads (both devices).
    std::memset(k.data[0], 0x6B, 256);
    for (int th = 0; th < 2; ++th) k.ep[0][size_t(th)]->post(test::write_imm(7, 1, 0, 4096 * uint64_t(th + 1), 256, 1));
    auto got = k.poll_until([](auto& g) { return g[0][0].size() + g[0][1].size() == 2; });
    EXPECT_EQ(count(got[0][0], CompletionKind::kSend) + count(got[0][1], CompletionKind::kSend), 2);
    EXPECT_EQ(k.data[1][2 * 4096 + 255], 0x6B);
  }
  {
    Run run;
    Cluster k({test::p5en_host()}, run.opts(/*dmabuf=*/false, /*peer=*/true));
    EXPECT_EQ(run.fabric->dmabuf_regs.size(), 0u);
    EXPECT_EQ(run.fabric->lmrs.size(), 2u) << "peer memory: one ibv_reg_mr per device";
  }
  Run run;
  try {
    Cluster k({test::p5en_host()}, run.opts(/*dmabuf=*/false, /*peer=*/false));
    ADD_FAILURE() << "neither dma-buf nor peer memory: registration must fail";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kTransport);
    EXPECT_NE(w.find(names[0]), std::string::npos) << "names the device: " << w;
    EXPECT_NE(w.find("efa_nv_peermem"), std::string::npos) << w;
    EXPECT_NE(w.find("ibv_reg_dmabuf_mr"), std::string::npos) << "says why dma-buf failed: " << w;
  }
}

// A data region larger than the device's max_mr_size is registered as several MRs (each <= max_mr_size, on whole
// 2 MiB pages after the first) and every write takes the lkey and rkey of the chunks it touches: writes that cross
// chunk boundaries on either side are split there and land whole, with one completion and the immediate last.
TEST(EfaChunkedMr, RegionAboveMaxMrSizeIsChunkedAndWritesPickTheirChunksKeys) {
  EnvGuard env({{"UCCL_MOE_SYSFS_ROOT", p5en_root().c_str()}});
  EfaProfile prof = test::p5en_profile();
  prof.max_mr_size = 4 * kMiB + 12345;  // -> chunks of 4 MiB
  prof.max_rdma_size = 3 * kMiB;
  Cluster::Opts o;
  o.threads = 2;
  o.bytes = 11 * kMiB;
  o.align = 4 * kMiB;
  o.region_offset = kMiB;  // chunks [1, 4) [4, 8) [8, 12) MiB from a 4 MiB boundary: the first one is short
  Cluster k({test::p5en_host(prof), test::p5en_host(prof)}, o, 9, 8);
  const std::vector<std::string> names = test::p5en_efa_names();
  size_t mrs = 0;
  for (auto& [key, mr] : k.fabric->lmrs) {
    EXPECT_LE(mr.len, prof.max_mr_size);
    ++mrs;
  }
  EXPECT_EQ(mrs, 2u * 2u * 3u) << "2 ranks x 2 devices x 3 chunks";
  // Local chunk edges at region offsets 3 and 7 MiB; remote writes start elsewhere so the edges differ.
  const uint32_t len = uint32_t(5 * kMiB + 777);
  for (uint32_t i = 0; i < len; ++i) k.data[0][2 * kMiB + i] = uint8_t(i * 7 + 3);
  const uint64_t executed0 = k.fabric->executed;
  k.ep[0][1]->post(test::write_imm(42, 1, 2 * kMiB, 5 * kMiB + 100, len, 0xC0DE));
  bool checked = false;
  auto got = k.poll_until([&](auto& g) {
    if (!checked && count(g[1][1], CompletionKind::kRecvImm) == 1) {
      for (uint32_t i = 0; i < len; i += 4099)
        if (k.data[1][5 * kMiB + 100 + i] != uint8_t(i * 7 + 3)) return true;  // fail below
      checked = true;
    }
    return checked && !g[0][1].empty();
  });
  ASSERT_EQ(got[0][1].size(), 1u);
  EXPECT_EQ(got[0][1][0].kind, CompletionKind::kSend) << got[0][1][0].status;
  EXPECT_TRUE(checked) << "the immediate arrived before the data, or never";
  for (uint32_t i = 0; i < len; ++i) ASSERT_EQ(k.data[1][5 * kMiB + 100 + i], uint8_t(i * 7 + 3)) << "byte " << i;
  // Pieces (M = MiB): local chunk edges at +1M and +5M into the write, remote ones at +2M-100 (and past its end),
  // at most 3M each: [0, 1M) [1M, 2M-100) [2M-100, 5M-100) [5M-100, 5M) [5M, 5M+777).
  EXPECT_EQ(k.fabric->executed - executed0, 5u);
  EXPECT_LE(k.fabric->max_write_seen, 3 * kMiB);
  EXPECT_EQ(k.nics[0]->dev(names[1]).writes, 5u) << "thread 1 posts on device 1";
  // Without chunks the device refuses the MR: the error names max_mr_size's consequence when below one GPU page.
  EXPECT_THROW(detail::efa_chunk_bytes(kMiB, 3 * kMiB, "x"), Error);
  EXPECT_EQ(detail::efa_chunk_bytes(0, 1ull << 40, "x"), 0u) << "no limit reported";
  EXPECT_EQ(detail::efa_chunk_bytes(8 * kMiB, 8 * kMiB, "x"), 0u) << "fits";
  EXPECT_EQ(detail::efa_chunk_bytes(9 * kMiB, 10 * kMiB, "x"), 8 * kMiB);
}

// GPU memory above max_mr_size: one dma-buf export and MR per chunk, on each device.
TEST(EfaChunkedMr, GpuRegionIsExportedPerChunk) {
  EnvGuard env({{"UCCL_MOE_SYSFS_ROOT", p5en_root().c_str()}});
  auto fabric = std::make_shared<EfaFabric>();
  auto exporter = std::make_shared<test::EfaExporter>();
  exporter->fabric = fabric;
  EfaProfile prof = test::p5en_profile();
  prof.max_mr_size = 2 * kMiB;
  Cluster::Opts o;
  o.threads = 2;
  o.bytes = 6 * kMiB;
  o.fabric = fabric;
  o.setup = [exporter](TransportContext& c, FakeEfaNic& nic, uint8_t* data) {
    for (const std::string& n : nic.device_names()) nic.dev(n).prof.peer_memory = false;
    nic.mark_gpu(data, 6 * kMiB);
    auto g = std::make_shared<GpuMemoryOps>();
    g->export_dmabuf = [exporter](void* p, uint64_t b, std::string* w) { return (*exporter)(p, b, w); };
    c.gpu = g;
  };
  Cluster k({test::p5en_host(prof)}, o);
  EXPECT_EQ(exporter->exports.size(), 6u) << "3 chunks on each of 2 devices";
  for (auto& [base, bytes] : exporter->exports) EXPECT_EQ(bytes, 2 * kMiB);
  EXPECT_EQ(fabric->dmabuf_regs.size(), 6u);
  // A write to itself across all three chunks.
  for (uint32_t i = 0; i < 64; ++i) k.data[0][2 * kMiB - 32 + i] = uint8_t(200 + i);
  k.ep[0][0]->post(test::write_imm(1, 0, 2 * kMiB - 32, 4 * kMiB - 32, 64, 9));
  auto got = k.poll_until([](auto& g) { return !g[0][0].empty() && count(g[0][0], CompletionKind::kRecvImm) == 1; });
  EXPECT_EQ(count(got[0][0], CompletionKind::kSend), 1);
  for (uint32_t i = 0; i < 64; ++i) EXPECT_EQ(k.data[0][4 * kMiB - 32 + i], uint8_t(200 + i));
}

}  // namespace
}  // namespace uccl_moe
