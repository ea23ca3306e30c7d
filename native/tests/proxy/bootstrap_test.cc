#include "uccl_moe/bootstrap.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "uccl_moe/error.hpp"

namespace uccl_moe {
namespace {

TEST(Bootstrap, MemoryStoreWaitsForKeyAndTimesOut) {
  MemoryKvStore kv;
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    kv.set("a", std::string("x\0y", 3));
  });
  EXPECT_EQ(kv.get("a", 5), std::string("x\0y", 3));
  t.join();
  try {
    kv.get("missing", 0.02);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
  }
}

TEST(Bootstrap, FileStoreAcrossProcesses) {
  char tmpl[] = "/tmp/uccl_kv_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  FileKvStore kv(tmpl);
  pid_t pid = fork();
  if (pid == 0) {
    FileKvStore child(tmpl);
    child.set("job/r1", "hello from child");
    _exit(child.get("job/r0", 5) == "hi" ? 0 : 3);
  }
  kv.set("job/r0", "hi");
  EXPECT_EQ(kv.get("job/r1", 5), "hello from child");
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_THROW(kv.get("never", 0.02), Error);
}

TEST(Bootstrap, BlobRoundTripAndErrors) {
  BlobWriter w(0xABCD1234, 3);
  w.u32(7).u64(1ull << 40).str("name").bytes("\x01\x02", 2);
  BlobReader r(w.data(), 0xABCD1234, 3, "test");
  EXPECT_EQ(r.u32(), 7u);
  EXPECT_EQ(r.u64(), 1ull << 40);
  EXPECT_EQ(r.str(), "name");
  char b[2];
  r.bytes(b, 2);
  EXPECT_EQ(b[1], 2);
  EXPECT_TRUE(r.done());
  EXPECT_THROW(BlobReader(w.data(), 0x1, 3, "test"), Error);         // bad magic
  EXPECT_THROW(BlobReader(w.data(), 0xABCD1234, 4, "test"), Error);  // version mismatch
  std::string cut = w.data().substr(0, 12);
  BlobReader short_reader(cut, 0xABCD1234, 3, "test");
  short_reader.u32();
  EXPECT_THROW(short_reader.u64(), Error);
}

}  // namespace
}  // namespace uccl_moe
