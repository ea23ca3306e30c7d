// Test helper shared by the transport suites: the write-with-immediate WorkRequest they all post.
#pragma once

#include <cstdint>

#include "uccl_moe/transport.hpp"

namespace uccl_moe::test {

/// A kWriteImm of `bytes` from our `local_offset` to `peer`'s `remote_offset`, carrying `imm`.
inline WorkRequest write_imm(uint64_t wr_id, int peer, uint64_t local_offset, uint64_t remote_offset, uint32_t bytes,
                             uint32_t imm) {
  WorkRequest w;
  w.wr_id = wr_id;
  w.op = WrOp::kWriteImm;
  w.peer = peer;
  w.local_offset = local_offset;
  w.remote_offset = remote_offset;
  w.bytes = bytes;
  w.imm = imm;
  return w;
}

}  // namespace uccl_moe::test
