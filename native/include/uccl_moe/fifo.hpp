// GPU->CPU FIFO channel (host half; device half: fifo_device.cuh).
//
// A ring of `capacity` TransferCmd slots (power of two). Indices are 64-bit and never wrap in practice.
//   head  producer index: the next slot to reserve. Producers reserve with fetch_add, so several may push at once.
//   tail  consumer index: the number of retired commands. Only the proxy thread that owns the FIFO writes it.
// Protocol:
//   push      idx = head++; wait while idx - tail >= capacity (back-pressure; the producer reads its cached copy of tail
//             first and re-reads the shared one only when the ring looks full); write word1, then word0 with release.
//   poll(i)   (consumer, tail <= i < tail + capacity) acquire-loads word0 of slot i; non-zero and word1's valid bit set
//             means the command is published. The proxy reads ahead of tail: commands in [tail, cursor) are in flight.
//   pop       (consumer) zeroes the oldest slot, then release-stores tail + 1. A command is retired when it *completed*
//             (its write landed, its QUIET drained, its BARRIER met), so check_completion(idx) = tail > idx means
//             "idx and everything before it is done".
// Memory: plain host memory for CPU producers. Created with GpuMemoryOps (the internode runtime), the ring and the tail
// live in pinned host memory the GPU maps and the producer index and tail cache in device memory; device_handle()
// then returns the GPU's views and only GPU producers may push (the host push methods throw).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "uccl_moe/fifo_device.cuh"
#include "uccl_moe/gpu_memory.hpp"
#include "uccl_moe/transfer_cmd.hpp"

namespace uccl_moe {

class Fifo {
 public:
  /// `capacity`: power of two >= 2. `channel`: global FIFO index used in diagnostics.
  explicit Fifo(uint32_t capacity, int channel = 0, std::shared_ptr<const GpuMemoryOps> gpu = nullptr);
  ~Fifo();
  Fifo(const Fifo&) = delete;
  Fifo& operator=(const Fifo&) = delete;

  // ---- producer side (any thread; thread-safe) ----
  /// Publishes `cmd` and returns its index. Blocks while the ring is full, bounded by `timeout_s` (none: the
  /// UCCL_MOE_TIMEOUT_S knob, read only if the ring is full); throws Timeout (phase fifo/full) on expiry. If
  /// `abort_flag` becomes non-zero while waiting, calls `on_abort` (which should throw the proxy's error) and then
  /// throws Transport.
  uint64_t push(const TransferCmd& cmd, std::optional<double> timeout_s = std::nullopt,
                const std::atomic<int32_t>* abort_flag = nullptr, void (*on_abort)(const void*) = nullptr,
                const void* on_abort_arg = nullptr);
  /// Non-blocking push: returns false (and reserves nothing) if the ring is full. Single-producer use only.
  bool try_push(const TransferCmd& cmd, uint64_t* idx);
  /// True once command `idx` and every earlier command were retired.
  bool check_completion(uint64_t idx) const;

  // ---- consumer side (the owning proxy thread only) ----
  /// Reads command `idx` if it is published. Requires tail() <= idx < tail() + capacity().
  bool poll(uint64_t idx, TransferCmd* out) const;
  /// Retires the oldest command (slot tail()). Requires it to have been published.
  void pop();

  uint64_t head() const { return head_.load(std::memory_order_acquire); }  ///< host producers' index
  uint64_t tail() const { return tail_->load(std::memory_order_acquire); }
  uint32_t capacity() const { return capacity_; }
  int channel() const { return channel_; }
  /// Handle for a device producer: GPU views with GpuMemoryOps, host pointers otherwise (CPU tests of the device code).
  FifoDeviceHandle device_handle();
  bool on_gpu() const { return gpu_ != nullptr; }

 private:
  uint32_t capacity_;
  uint32_t mask_;
  int channel_;
  std::shared_ptr<const GpuMemoryOps> gpu_;
  TransferCmd* ring_;
  TransferCmd* ring_dev_ = nullptr;       ///< GPU view of ring_ (GPU FIFOs)
  std::atomic<uint64_t>* tail_;           ///< &tail_storage_, or pinned memory the GPU maps
  uint64_t* tail_dev_ = nullptr;          ///< GPU view of tail_
  uint64_t* head_dev_ = nullptr;          ///< producer index of a GPU FIFO (device memory)
  uint64_t* tail_cache_dev_ = nullptr;    ///< tail cache of a GPU FIFO (device memory)
  alignas(64) std::atomic<uint64_t> head_{0};
  alignas(64) std::atomic<uint64_t> tail_storage_{0};
  alignas(64) std::atomic<uint64_t> tail_cache_{0};  ///< producers' cached copy of tail_ (a hint, never ahead of tail_)
};

}  // namespace uccl_moe
