// Compile-only check: the device half of the FIFO builds with nvcc (the GPU producer tests come with the internode
// kernels). Instantiates push() and check_completion() in a kernel.
#include "uccl_moe/fifo_device.cuh"

namespace uccl_moe {
__global__ void fifo_device_compile_check_kernel(FifoDeviceHandle fifo, DiagDeviceHandle diag, uint64_t* out) {
  TransferCmdFields f;
  f.op = CmdOp::kWrite;
  f.dst_rank = 1;
  f.bytes = 64;
  const uint64_t idx = fifo.push(encode(f), diag);
  out[0] = idx;
  out[1] = fifo.check_completion(idx) ? 1 : 0;
}
}  // namespace uccl_moe
