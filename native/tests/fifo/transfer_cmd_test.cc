#include "uccl_moe/transfer_cmd.hpp"

#include <gtest/gtest.h>

#include <random>

#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

void expect_same(const TransferCmdFields& a, const TransferCmdFields& b) {
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.flags, b.flags);
  EXPECT_EQ(a.dst_rank, b.dst_rank);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.counter_slot, b.counter_slot);
  EXPECT_EQ(a.counter_value, b.counter_value);
  EXPECT_EQ(a.src_offset, b.src_offset);
  EXPECT_EQ(a.dst_offset, b.dst_offset);
}

TEST(TransferCmd, RoundTripsEveryFieldAtItsMaximum) {
  TransferCmdFields f;
  f.op = CmdOp::kBarrier;
  f.flags = 0xF;
  f.dst_rank = kCmdMaxRanks - 1;
  f.bytes = kCmdMaxBytes;
  f.counter_slot = 255;
  f.counter_value = 127;
  f.src_offset = kCmdMaxSrcOffset;
  f.dst_offset = kCmdMaxDstOffset;
  TransferCmd c = encode(f);
  expect_same(decode(c), f);
  EXPECT_NE(c.word0, 0u);
  EXPECT_TRUE(c.word1 & kCmdValidBit);
  f.counter_value = -128;
  expect_same(decode(encode(f)), f);
}

TEST(TransferCmd, FieldsDoNotOverlap) {
  // Setting one field to all-ones must leave every other field zero after decode.
  TransferCmdFields f;
  f.op = CmdOp::kWrite;
  f.dst_rank = kCmdMaxRanks - 1;
  TransferCmdFields d = decode(encode(f));
  EXPECT_EQ(d.bytes, 0u);
  EXPECT_EQ(d.flags, 0u);
  EXPECT_EQ(d.counter_slot, 0u);
  f = TransferCmdFields{};
  f.op = CmdOp::kWrite;
  f.bytes = kCmdMaxBytes;
  d = decode(encode(f));
  EXPECT_EQ(d.dst_rank, 0u);
  EXPECT_EQ(d.counter_slot, 0u);
  f = TransferCmdFields{};
  f.op = CmdOp::kWrite;
  f.src_offset = kCmdMaxSrcOffset;
  d = decode(encode(f));
  EXPECT_EQ(d.dst_offset, 0u);
}

TEST(TransferCmd, RandomRoundTrip) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    TransferCmdFields f;
    f.op = CmdOp(1 + rng() % 4);
    f.flags = uint8_t(rng() % 16);
    f.dst_rank = uint32_t(rng() % kCmdMaxRanks);
    f.bytes = uint32_t(rng() % (kCmdMaxBytes + 1));
    f.counter_slot = uint8_t(rng());
    f.counter_value = int8_t(rng());
    f.src_offset = (rng() % (kCmdMaxSrcOffset / 4 + 1)) * 4;
    f.dst_offset = (rng() % (kCmdMaxDstOffset / 4 + 1)) * 4;
    expect_same(decode(encode(f)), f);
  }
}

TEST(TransferCmd, CheckedEncodeNamesTheBadField) {
  TransferCmdFields f;
  f.op = CmdOp::kWrite;
  f.bytes = kCmdMaxBytes + 1;
  try {
    encode_checked(f);
    FAIL() << "expected InvalidUsage";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("bytes="), std::string::npos) << e.what();
  }
  f.bytes = 16;
  f.src_offset = 6;  // not a multiple of 4
  EXPECT_THROW(encode_checked(f), Error);
  f.src_offset = 0;
  f.dst_rank = kCmdMaxRanks;
  EXPECT_THROW(encode_checked(f), Error);
  f.dst_rank = 1;
  f.flags = kCmdFlagCounter | kCmdFlagLL;
  EXPECT_THROW(encode_checked(f), Error);
  f.op = CmdOp::kAtomic;
  f.flags = kCmdFlagLL;
  f.bytes = (1u << 20);  // LL expected count must fit 20 bits
  EXPECT_THROW(encode_checked(f), Error);
  f.op = CmdOp::kEmpty;
  f.flags = 0;
  f.bytes = 0;
  EXPECT_THROW(encode_checked(f), Error);
}

TEST(TransferCmd, DescribeNamesOpAndCounter) {
  TransferCmdFields f;
  f.op = CmdOp::kWrite;
  f.flags = kCmdFlagCounter;
  f.dst_rank = 3;
  f.bytes = 4096;
  f.counter_slot = 5;
  f.counter_value = 1;
  const std::string s = describe(f);
  EXPECT_NE(s.find("WRITE dst_rank=3"), std::string::npos) << s;
  EXPECT_NE(s.find("counter[5]+=1"), std::string::npos) << s;
}

}  // namespace
}  // namespace uccl_moe
