#include "uccl_moe/fifo.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

TransferCmd make_cmd(uint32_t producer, uint32_t seq) {
  TransferCmdFields f;
  f.op = CmdOp::kWrite;
  f.dst_rank = producer;
  f.bytes = seq & kCmdMaxBytes;
  f.src_offset = uint64_t(seq) * 4;
  return encode(f);
}

TEST(Fifo, RejectsNonPowerOfTwoCapacity) {
  EXPECT_THROW(Fifo(3), Error);
  EXPECT_THROW(Fifo(1), Error);
}

TEST(Fifo, SingleProducerInOrderWithWrapAround) {
  Fifo fifo(8);
  // 10 laps of the ring: indices keep growing, slots are reused.
  uint64_t next_pop = 0;
  for (uint32_t i = 0; i < 80; ++i) {
    uint64_t idx = fifo.push(make_cmd(0, i));
    EXPECT_EQ(idx, i);
    EXPECT_FALSE(fifo.check_completion(idx));
    if (i % 3 == 2) {
      while (next_pop <= idx) {
        TransferCmd c;
        ASSERT_TRUE(fifo.poll(next_pop, &c));
        EXPECT_EQ(decode(c).src_offset, next_pop * 4);
        fifo.pop();
        EXPECT_TRUE(fifo.check_completion(next_pop));
        ++next_pop;
      }
      TransferCmd c;
      EXPECT_FALSE(fifo.poll(next_pop, &c)) << "slot past head must read empty";
    }
  }
}

TEST(Fifo, BackPressureBlocksUntilPopAndTimesOut) {
  Fifo fifo(4);
  for (uint32_t i = 0; i < 4; ++i) fifo.push(make_cmd(0, i));
  uint64_t idx;
  EXPECT_FALSE(fifo.try_push(make_cmd(0, 4), &idx));
  // Full: a blocking push times out with a fifo/full diagnostic.
  try {
    fifo.push(make_cmd(0, 4), 0.05);
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("fifo/full"), std::string::npos) << e.what();
  }
  // The timed-out push reserved index 4; a consumer now frees room and a new push goes through.
  std::atomic<bool> pushed{false};
  std::thread producer([&] {
    fifo.push(make_cmd(0, 5), 10);
    pushed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(pushed.load());
  TransferCmd c;
  ASSERT_TRUE(fifo.poll(0, &c));
  fifo.pop();
  ASSERT_TRUE(fifo.poll(1, &c));
  fifo.pop();
  producer.join();
  EXPECT_TRUE(pushed.load());
}

TEST(Fifo, AbortFlagInterruptsAWaitingProducer) {
  Fifo fifo(2);
  fifo.push(make_cmd(0, 0));
  fifo.push(make_cmd(0, 1));
  std::atomic<int32_t> abort_flag{1};
  EXPECT_THROW(fifo.push(make_cmd(0, 2), 10, &abort_flag), Error);
}

// Several producers, one consumer: every command arrives exactly once and each producer's commands in its order.
TEST(Fifo, MultiProducerEveryCommandOnceInProducerOrder) {
  constexpr int kProducers = 4;
  constexpr uint32_t kPerProducer = 20000;
  Fifo fifo(64);
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p)
    producers.emplace_back([&, p] {
      for (uint32_t i = 0; i < kPerProducer; ++i) fifo.push(make_cmd(uint32_t(p), i), 30);
    });
  std::vector<uint32_t> next(kProducers, 0);
  uint64_t idx = 0;
  const uint64_t total = uint64_t(kProducers) * kPerProducer;
  while (idx < total) {
    TransferCmd c;
    if (!fifo.poll(idx, &c)) {
      std::this_thread::yield();
      continue;
    }
    TransferCmdFields f = decode(c);
    ASSERT_LT(f.dst_rank, uint32_t(kProducers));
    ASSERT_EQ(f.src_offset / 4, next[f.dst_rank]) << "producer " << f.dst_rank << " out of order";
    ++next[f.dst_rank];
    fifo.pop();
    ++idx;
  }
  for (auto& t : producers) t.join();
  for (int p = 0; p < kProducers; ++p) EXPECT_EQ(next[size_t(p)], kPerProducer);
  EXPECT_EQ(fifo.head(), total);
  EXPECT_EQ(fifo.tail(), total);
}

TEST(Fifo, ConsumerReadsAheadOfTail) {
  Fifo fifo(8);
  for (uint32_t i = 0; i < 5; ++i) fifo.push(make_cmd(0, i));
  TransferCmd c;
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(fifo.poll(i, &c));  // in flight, not retired
  EXPECT_FALSE(fifo.check_completion(0));
  fifo.pop();
  EXPECT_TRUE(fifo.check_completion(0));
  EXPECT_FALSE(fifo.check_completion(1));
}

TEST(Fifo, DeviceHandleDescribesTheRing) {
  Fifo fifo(16, 7);
  FifoDeviceHandle h = fifo.device_handle();
  EXPECT_EQ(h.capacity_mask, 15u);
  EXPECT_EQ(h.channel, 7);
  fifo.push(make_cmd(0, 9));
  EXPECT_EQ(*h.head, 1u);
  EXPECT_EQ(decode(h.ring[0]).src_offset, 36u);
}

}  // namespace
}  // namespace uccl_moe
