// GPU memory registration (native/src/transport/gpu_mr.hpp) against the strict fake: the 2 MiB aligned dma-buf
// export, chunking, the ibv_reg_mr fallback and the error naming what is missing. The real export of a cudaMalloc
// range runs on a GPU in tests/gpu/test_gpu_mr_gpu.py.
#include "transport/gpu_mr.hpp"

#include <gtest/gtest.h>

#include "fake_verbs.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

using detail::kDmabufAlignBytes;
constexpr uint64_t kMiB = 1 << 20;

TEST(GpuMr, DmabufRangeIsTwoMiBAligned) {
  const uint64_t base = 0x7f0000000000ull;
  detail::DmabufRange r = detail::dmabuf_range(base + 3 * kMiB + 100, kMiB);
  EXPECT_EQ(r.base, base + 2 * kMiB);
  EXPECT_EQ(r.bytes, 4 * kMiB) << "[3 MiB + 100, 4 MiB + 100) touches the pages at 2 and 4 MiB";
  EXPECT_EQ(r.offset, kMiB + 100);
  r = detail::dmabuf_range(base + kMiB, 2 * kMiB);  // straddles a boundary
  EXPECT_EQ(r.base, base);
  EXPECT_EQ(r.bytes, 4 * kMiB);
  r = detail::dmabuf_range(base, 2 * kMiB);
  EXPECT_EQ(r.base, base);
  EXPECT_EQ(r.bytes, 2 * kMiB);
  EXPECT_EQ(r.offset, 0u);
}

TEST(GpuMr, ChunksCoverTheRangeOnAlignedBoundaries) {
  const uint64_t addr = 0x7f0000000000ull + 3 * kMiB, bytes = 22 * kMiB;
  const auto c = detail::plan_chunks(addr, bytes, 8 * kMiB);
  ASSERT_EQ(c.size(), 4u);  // [3, 8) [8, 16) [16, 24) [24, 25) MiB
  uint64_t next = addr;
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(c[i].addr, next);
    EXPECT_LE(c[i].bytes, 8 * kMiB);
    if (i > 0) EXPECT_EQ(c[i].addr % (8 * kMiB), 0u);
    next += c[i].bytes;
  }
  EXPECT_EQ(next, addr + bytes);
  EXPECT_THROW(detail::plan_chunks(addr, bytes, 3 * kMiB), Error) << "chunks are whole GPU pages";
}

struct RegFixture {
  std::shared_ptr<test::FakeFabric> fabric = std::make_shared<test::FakeFabric>();
  test::FakeVerbs ops{fabric, test::mlx5_cx7()};
  ibv_pd* pd = ops.alloc_pd(nullptr);
  test::FakeExporter exporter{fabric};
  std::vector<uint8_t> mem = std::vector<uint8_t>(12 * kMiB);
  uint8_t* gpu() {  // a 2 MiB aligned "GPU allocation" inside mem, as cudaMalloc returns
    const uint64_t a = (uint64_t(reinterpret_cast<uintptr_t>(mem.data())) + kDmabufAlignBytes - 1) /
                       kDmabufAlignBytes * kDmabufAlignBytes;
    return reinterpret_cast<uint8_t*>(a);
  }
  detail::DmabufExport fn() {
    return [this](void* p, uint64_t b, std::string* w) { return exporter(p, b, w); };
  }
};

TEST(GpuMr, DmabufFirstWithRelaxedOrdering) {
  RegFixture s;
  s.ops.mark_gpu(s.gpu(), 8 * kMiB);
  std::string method;
  uint8_t* p = s.gpu() + 4096;
  ibv_mr* mr = detail::register_gpu_memory(s.ops, s.pd, p, 3 * kMiB, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
                                           s.fn(), &method);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(method, "dma-buf");
  ASSERT_EQ(s.exporter.exports.size(), 1u);
  EXPECT_EQ(s.exporter.exports[0].first, uint64_t(reinterpret_cast<uintptr_t>(s.gpu())));
  EXPECT_EQ(s.exporter.exports[0].second, 4 * kMiB);
  ASSERT_EQ(s.fabric->dmabuf_regs.size(), 1u);
  EXPECT_EQ(s.fabric->dmabuf_regs[0].offset, 4096u);
  EXPECT_EQ(s.fabric->dmabuf_regs[0].length, 3 * kMiB);
  EXPECT_EQ(s.fabric->dmabuf_regs[0].iova, uint64_t(reinterpret_cast<uintptr_t>(p))) << "iova = the pointer";
  EXPECT_TRUE(s.fabric->dmabuf_regs[0].access & IBV_ACCESS_RELAXED_ORDERING);
  EXPECT_EQ(mr->addr, p);
}

TEST(GpuMr, FallsBackToPeerMemoryThenNamesWhatIsNeeded) {
  RegFixture s;
  s.ops.mark_gpu(s.gpu(), 8 * kMiB);
  s.ops.profile().dmabuf = false;  // an old kernel / rdma-core
  std::string method;
  ibv_mr* mr = detail::register_gpu_memory(s.ops, s.pd, s.gpu(), 2 * kMiB, IBV_ACCESS_LOCAL_WRITE, s.fn(), &method);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(method, "peer memory (ibv_reg_mr)");
  s.ops.profile().peer_memory = false;  // and no nvidia-peermem
  try {
    detail::register_gpu_memory(s.ops, s.pd, s.gpu(), 2 * kMiB, IBV_ACCESS_LOCAL_WRITE, s.fn(), &method);
    FAIL();
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("nvidia-peermem"), std::string::npos) << w;
    EXPECT_NE(w.find("efa_nv_peermem"), std::string::npos) << w;
    EXPECT_NE(w.find("dma-buf"), std::string::npos) << w;
    EXPECT_NE(w.find("ibv_reg_dmabuf_mr"), std::string::npos) << "says why dma-buf failed: " << w;
  }
  // Export refused (no GPU backend / driver) and no peer memory: the export's reason is in the message.
  s.exporter.fail = true;
  try {
    detail::register_gpu_memory(s.ops, s.pd, s.gpu(), 2 * kMiB, IBV_ACCESS_LOCAL_WRITE, s.fn(), &method);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("export refused"), std::string::npos) << e.what();
  }
}

TEST(GpuMr, ChunkedRegistrationExportsEachChunkAligned) {
  RegFixture s;
  s.ops.mark_gpu(s.gpu(), 8 * kMiB);
  std::string method;
  const auto chunks = detail::register_gpu_memory_chunked(s.ops, s.pd, s.gpu() + kMiB, 6 * kMiB,
                                                          IBV_ACCESS_LOCAL_WRITE, 2 * kMiB, s.fn(), &method);
  ASSERT_EQ(chunks.size(), 4u);  // [1,2) [2,4) [4,6) [6,7) MiB
  ASSERT_EQ(s.exporter.exports.size(), 4u);
  for (auto& [base, bytes] : s.exporter.exports) {
    EXPECT_EQ(base % kDmabufAlignBytes, 0u);
    EXPECT_EQ(bytes, 2 * kMiB) << "each chunk exports only its own pages";
  }
  for (auto& c : chunks) EXPECT_NE(c.mr, nullptr);
  EXPECT_EQ(s.fabric->dmabuf_regs.size(), 4u);
  s.ops.profile().dmabuf = false;
  s.ops.profile().peer_memory = false;
  EXPECT_THROW(detail::register_gpu_memory_chunked(s.ops, s.pd, s.gpu(), 4 * kMiB, IBV_ACCESS_LOCAL_WRITE, 2 * kMiB,
                                                   s.fn(), &method),
               Error);
}

TEST(GpuMr, ExportWithoutAGpuBackendSaysSo) {
#if !defined(UCCL_MOE_WITH_CUDA) && !defined(UCCL_MOE_WITH_HIP)
  std::string why;
  EXPECT_EQ(detail::gpu_export_dmabuf(nullptr, kDmabufAlignBytes, &why), -1);
  EXPECT_NE(why.find("no GPU backend"), std::string::npos) << why;
#else
  GTEST_SKIP() << "GPU build: tests/gpu/test_gpu_mr_gpu.py exports real GPU memory";
#endif
}

}  // namespace
}  // namespace uccl_moe
