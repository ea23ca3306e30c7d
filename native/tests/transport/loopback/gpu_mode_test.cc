// GPU mode of the proxy path without a GPU: GpuMemoryOps filled with host memory stand-ins. Covers the FIFO in
// "mapped" memory with a device-style producer, and the loopback transport with caller data regions shared through
// exported handles and an asynchronous copy engine (completion one query late, like an event that is not ready yet).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "../../proxy/multi_rank.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/fifo.hpp"
#include "uccl_moe/gpu_memory.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe {
namespace {

using test::run_ranks;

/// Copies happen on the second done() query after submit (never inside submit).
class LateCopyEngine : public CopyEngine {
 public:
  uint64_t submit(void* dst, const void* src, uint64_t bytes) override {
    queue_.push_back({dst, src, bytes, ++submitted_, 0});
    return submitted_;
  }
  bool done(uint64_t token) override {
    for (auto& c : queue_)
      if (++c.queries == 2) {
        std::memcpy(c.dst, c.src, c.bytes);
        completed_ = c.token;
      }
    while (!queue_.empty() && queue_.front().token <= completed_) queue_.pop_front();
    return token <= completed_;
  }
  uint64_t submitted_ = 0, completed_ = 0;

 private:
  struct Copy {
    void* dst;
    const void* src;
    uint64_t bytes, token;
    int queries;
  };
  std::deque<Copy> queue_;
};

/// Host stand-ins. "Device memory" shared between processes is POSIX shared memory named by the exported handle.
struct FakeGpu {
  std::mutex mu;
  std::map<void*, std::pair<std::string, size_t>> shared;  // our regions: name, bytes
  std::map<void*, size_t> opened;
  std::atomic<int> engines{0};

  std::shared_ptr<GpuMemoryOps> ops() {
    auto o = std::make_shared<GpuMemoryOps>();
    o->alloc_mapped = [](size_t bytes, void** dev) {
      void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      std::memset(p, 0, bytes);
      *dev = p;  // unified addressing: the "device view" is the same address
      return p;
    };
    o->free_mapped = [](void* p) { std::free(p); };
    o->alloc_device = [](size_t bytes) { return std::calloc(1, bytes); };
    o->free_device = [](void* p) { std::free(p); };
    o->export_ipc = [this](void* p) {
      std::lock_guard<std::mutex> lock(mu);
      return shared.at(p).first + "|" + std::to_string(shared.at(p).second);
    };
    o->open_ipc = [this](const std::string& h) -> void* {
      const size_t bar = h.find('|');
      const std::string name = h.substr(0, bar);
      const size_t bytes = std::stoull(h.substr(bar + 1));
      const int fd = shm_open(name.c_str(), O_RDWR, 0600);
      UCCL_CHECK_SYS(fd, "shm_open(%s)", name.c_str());
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      std::lock_guard<std::mutex> lock(mu);
      opened[p] = bytes;
      return p;
    };
    o->close_ipc = [this](void* p) {
      std::lock_guard<std::mutex> lock(mu);
      munmap(p, opened.at(p));
      opened.erase(p);
    };
    o->make_copy_engine = [this]() -> std::unique_ptr<CopyEngine> {
      ++engines;
      return std::make_unique<LateCopyEngine>();
    };
    return o;
  }
  void* make_shared_region(const std::string& name, size_t bytes) {
    shm_unlink(name.c_str());
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    UCCL_CHECK_SYS(fd, "shm_open(%s)", name.c_str());
    if (ftruncate(fd, off_t(bytes)) != 0) UCCL_THROW(kInternal, "ftruncate");
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    std::lock_guard<std::mutex> lock(mu);
    shared[p] = {name, bytes};
    return p;
  }
};

TEST(GpuModeFifo, DeviceStyleProducerAndMappedTail) {
  FakeGpu gpu;
  Fifo fifo(8, 3, gpu.ops());
  EXPECT_TRUE(fifo.on_gpu());
  const FifoDeviceHandle h = fifo.device_handle();
  EXPECT_EQ(h.capacity_mask, 7u);
  EXPECT_EQ(h.channel, 3);
  // A host push into a GPU FIFO is refused (the producer index lives in device memory).
  TransferCmdFields f;
  f.op = CmdOp::kQuiet;
  EXPECT_THROW(fifo.push(encode(f)), Error);
  // What FifoDeviceHandle::push does on the GPU: reserve, write the 16 bytes, publish.
  for (uint64_t i = 0; i < 20; ++i) {
    const uint64_t idx = __atomic_fetch_add(h.head, 1, __ATOMIC_RELAXED);
    EXPECT_EQ(idx, i);
    f.op = CmdOp::kAtomic;
    f.dst_rank = uint32_t(i % 5);
    f.counter_slot = uint8_t(i);
    const TransferCmd c = encode(f);
    TransferCmd* slot = &h.ring[idx & h.capacity_mask];
    __atomic_store_n(&slot->word1, c.word1, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->word0, c.word0, __ATOMIC_RELEASE);
    TransferCmd got;
    ASSERT_TRUE(fifo.poll(idx, &got));
    const TransferCmdFields g = decode(got);
    EXPECT_EQ(g.dst_rank, i % 5);
    EXPECT_EQ(g.counter_slot, i);
    fifo.pop();
    // The GPU reads completion through the mapped view of the tail.
    EXPECT_EQ(__atomic_load_n(h.tail, __ATOMIC_ACQUIRE), i + 1);
    EXPECT_TRUE(fifo.check_completion(idx));
    EXPECT_FALSE(fifo.check_completion(idx + 1));
  }
}

// Rank 0 writes with immediates into rank 1's caller-provided region (opened through the exported handle); every
// immediate arrives only after its bytes, although the copy engine completes late.
TEST(GpuModeLoopback, CallerRegionsSharedByHandleAndAsyncCopies) {
  const std::string fail = run_ranks(2, [](int rank, std::shared_ptr<KvStore> store, const std::string& job) {
    FakeGpu gpu;
    const size_t bytes = 1 << 16;
    auto* data = static_cast<uint8_t*>(gpu.make_shared_region("/ucclmoe-gputest." + job + "." + std::to_string(rank),
                                                              bytes));
    TransportContext ctx(Timeout::resolve());
    ctx.rank = rank;
    ctx.num_ranks = 2;
    ctx.num_threads = 1;
    ctx.job = job;
    ctx.timeout_s = 20;
    ctx.gpu = gpu.ops();
    auto t = create_transport("loopback", ctx);
    CHILD_CHECK(t->allocate(MemoryKind::kData, bytes) == nullptr, "GPU mode must take caller memory");
    t->register_memory(MemoryKind::kData, data, bytes);
    auto ep = t->create_endpoint(0);
    ep->connect(*store);
    CHILD_CHECK(ep->can_reach(0) && ep->can_reach(1), "peers reachable");
    constexpr int kWrites = 50;
    std::vector<Completion> out;
    if (rank == 0) {
      for (int i = 0; i < kWrites; ++i) {
        std::memset(data + i * 64, i + 1, 64);
        WorkRequest wr;
        wr.wr_id = uint64_t(i);
        wr.op = WrOp::kWriteImm;
        wr.peer = 1;
        wr.local_offset = uint64_t(i) * 64;
        wr.remote_offset = 4096 + uint64_t(i) * 64;
        wr.bytes = 64;
        wr.imm = uint32_t(1000 + i);
        ep->post(wr);
      }
      int sends = 0;
      const auto start = std::chrono::steady_clock::now();
      while (sends < kWrites && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
        out.clear();
        ep->poll(out, 16);
        for (auto& c : out) sends += c.kind == CompletionKind::kSend;
      }
      CHILD_CHECK(sends == kWrites, "rank 0 saw %d of %d send completions", sends, kWrites);
      CHILD_CHECK(gpu.engines.load() == 1, "one copy engine per endpoint, got %d", gpu.engines.load());
    } else {
      int got = 0;
      const auto start = std::chrono::steady_clock::now();
      while (got < kWrites && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
        out.clear();
        ep->poll(out, 16);
        for (auto& c : out) {
          if (c.kind != CompletionKind::kRecvImm) continue;
          const int i = int(c.imm) - 1000;
          CHILD_CHECK(c.peer == 0 && i >= 0 && i < kWrites, "unexpected immediate %u from %d", c.imm, c.peer);
          for (int b = 0; b < 64; ++b)
            CHILD_CHECK(data[4096 + i * 64 + b] == uint8_t(i + 1), "immediate %d arrived before its data", i);
          ++got;
        }
      }
      CHILD_CHECK(got == kWrites, "rank 1 received %d of %d immediates", got, kWrites);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the peer finishes before we unmap
  });
  EXPECT_EQ(fail, "");
}

}  // namespace
}  // namespace uccl_moe
