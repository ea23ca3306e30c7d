// Device half of the GPU->CPU FIFO (host half: fifo.hpp). A trivially copyable handle that kernels take by value.
//
// Placement (see fifo.hpp for the full protocol): `ring` and `tail` live in host memory the GPU can map (pinned);
// `head` and `tail_cache` live in GPU memory, so a pushing thread crosses PCIe only to write its command and, when the
// ring looks full, to re-read the consumer's tail.
#pragma once

#include <cstdint>
#include <type_traits>

#include "uccl_moe/compiler.hpp"
#include "uccl_moe/transfer_cmd.hpp"

#if defined(UCCL_GPU_COMPILER)
#include "uccl_moe/diag_device.cuh"
#include "uccl_moe/platform.cuh"
#endif

namespace uccl_moe {

struct FifoDeviceHandle {
  TransferCmd* ring;        ///< [capacity] host-mapped slots; a zero word0 marks a free slot
  uint64_t* head;           ///< producer index (device memory): next slot to reserve
  uint64_t* tail;           ///< consumer index (host-mapped): number of retired commands; written by the proxy
  uint64_t* tail_cache;     ///< device-memory copy of tail, refreshed only when the ring looks full
  uint32_t capacity_mask;   ///< capacity - 1 (capacity is a power of two)
  int32_t channel;          ///< global FIFO index (diagnostics)

#if defined(UCCL_GPU_COMPILER)
  /// Reserves a slot, waits (bounded) for room and publishes `cmd` with one 16-byte store. Returns the command's
  /// index for check_completion(), or ~0ull if the wait expired (a DiagRecord with phase fifo/full was written and
  /// the abort flag raised; the kernel must drain).
  UCCL_DEVICE_INLINE uint64_t push(const TransferCmd& cmd, const DiagDeviceHandle& diag) const {
    const uint64_t idx = atomicAdd(reinterpret_cast<unsigned long long*>(head), 1ull);
    const uint64_t capacity = uint64_t(capacity_mask) + 1;
    if (idx - *reinterpret_cast<volatile uint64_t*>(tail_cache) >= capacity) {
      BoundedWait wait(diag);
      uint64_t t;
      // Released by the proxy's release-store of tail in Fifo::pop (pairs with this acquire).
      while (idx - (t = uint64_t(gpu::load_acquire_sys(reinterpret_cast<const int64_t*>(tail)))) >= capacity) {
        if (wait.expired()) {
          report_timeout(diag, DiagPhase::kFifoFull, DiagRole::kSender, /*peer=*/-1, channel,
                         int64_t(idx - capacity + 1), int64_t(t), cmd.word0, wait.waited_s());
          return ~0ull;
        }
      }
      *reinterpret_cast<volatile uint64_t*>(tail_cache) = t;
    }
    // Orders this thread's earlier payload writes (the data the proxy will send) before the command becomes visible;
    // pairs with the acquire load of word0 in Fifo::poll.
    gpu::fence_sys();
    uint4 v;
    v.x = uint32_t(cmd.word0);
    v.y = uint32_t(cmd.word0 >> 32);
    v.z = uint32_t(cmd.word1);
    v.w = uint32_t(cmd.word1 >> 32);
    gpu::store_128(&ring[idx & capacity_mask], v);
    return idx;
  }

  /// True once command `idx` and every earlier one were retired by the proxy.
  UCCL_DEVICE_INLINE bool check_completion(uint64_t idx) const {
    // Pairs with the release-store of tail in Fifo::pop.
    return uint64_t(gpu::load_acquire_sys(reinterpret_cast<const int64_t*>(tail))) > idx;
  }
#endif
};
static_assert(std::is_trivially_copyable<FifoDeviceHandle>::value, "kernels take FifoDeviceHandle by value");

}  // namespace uccl_moe
