#include "uccl_moe/fifo.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "uccl_moe/diag.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"
#include "uccl_moe/timeout.hpp"

namespace uccl_moe {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}
// Slot words are accessed atomically through these (the ring is plain memory a GPU also writes).
inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline uint64_t load_relaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void store_relaxed(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
}  // namespace

namespace {
constexpr size_t kTailBytes = 64;  ///< the tail word sits alone in its cache line, after the ring
}  // namespace

Fifo::Fifo(uint32_t capacity, int channel, std::shared_ptr<const GpuMemoryOps> gpu)
    : capacity_(capacity), mask_(capacity - 1), channel_(channel), gpu_(std::move(gpu)), tail_(&tail_storage_) {
  UCCL_ASSERT(capacity >= 2 && (capacity & (capacity - 1)) == 0,
              "FIFO capacity=%u must be a power of two >= 2 (UCCL_MOE_FIFO_CAPACITY)", capacity);
  const size_t ring_bytes = std::max<size_t>(64, sizeof(TransferCmd) * capacity);
  if (gpu_) {
    // Ring + tail in one mapped block; producer index and tail cache in one device block (zeroed by the ops).
    void* dev = nullptr;
    char* host = static_cast<char*>(gpu_->alloc_mapped(ring_bytes + kTailBytes, &dev));
    UCCL_CHECK_INTERNAL(host != nullptr && dev != nullptr, "allocating a mapped FIFO of %u slots", capacity);
    ring_ = reinterpret_cast<TransferCmd*>(host);
    ring_dev_ = reinterpret_cast<TransferCmd*>(dev);
    tail_ = new (host + ring_bytes) std::atomic<uint64_t>(0);
    tail_dev_ = reinterpret_cast<uint64_t*>(static_cast<char*>(dev) + ring_bytes);
    head_dev_ = static_cast<uint64_t*>(gpu_->alloc_device(2 * kTailBytes));
    UCCL_CHECK_INTERNAL(head_dev_ != nullptr, "allocating a FIFO producer index");
    tail_cache_dev_ = head_dev_ + kTailBytes / sizeof(uint64_t);
  } else {
    ring_ = static_cast<TransferCmd*>(std::aligned_alloc(64, ring_bytes));
    UCCL_CHECK_INTERNAL(ring_ != nullptr, "allocating a FIFO of %u slots", capacity);
  }
  std::memset(ring_, 0, sizeof(TransferCmd) * capacity);
}

Fifo::~Fifo() {
  if (gpu_) {
    gpu_->free_device(head_dev_);
    gpu_->free_mapped(ring_);
  } else {
    std::free(ring_);
  }
}

uint64_t Fifo::push(const TransferCmd& cmd, std::optional<double> timeout_s, const std::atomic<int32_t>* abort_flag,
                    void (*on_abort)(const void*), const void* on_abort_arg) {
  UCCL_CHECK_INTERNAL(cmd.word0 != 0 && (cmd.word1 & kCmdValidBit), "pushing an unencoded command");
  UCCL_CHECK_INTERNAL(!gpu_, "FIFO %d belongs to GPU producers; the host may not push into it", channel_);
  const uint64_t idx = head_.fetch_add(1, std::memory_order_relaxed);
  // Acquire pairs with the release CAS below: the producer that refreshed the cache had acquired tail_, so the
  // consumer's zeroing of our slot (before its release of tail_) happens-before our write of the slot.
  if (idx - tail_cache_.load(std::memory_order_acquire) >= capacity_) {
    // Looks full: re-read the consumer's tail (acquire pairs with the release in pop()) until there is room.
    const double limit = Timeout::resolve(timeout_s).limit_s;
    const auto start = std::chrono::steady_clock::now();
    uint64_t t;
    uint32_t spins = 0;
    while (idx - (t = tail_->load(std::memory_order_acquire)) >= capacity_) {
      if ((++spins & 255u) == 0) {
        if (abort_flag && abort_flag->load(std::memory_order_acquire)) {
          if (on_abort) on_abort(on_abort_arg);
          UCCL_THROW(kTransport, "FIFO %d: the proxy aborted while a producer waited for room", channel_);
        }
        double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > limit) {
          const DiagRecord r{.valid = 1, .rank = -1, .peer = -1, .channel = channel_, .phase = DiagPhase::kFifoFull,
                             .role = DiagRole::kSender, .expected = int64_t(idx - capacity_ + 1), .seen = int64_t(t),
                             .command = cmd.word0, .waited_s = waited};
          UCCL_THROW(kTimeout, "%s (FIFO %d full: slot %llu waits for tail > %llu; is the proxy running?)",
                     format_diag(r).c_str(), channel_, (unsigned long long)idx,
                     (unsigned long long)(idx - capacity_));
        }
        std::this_thread::yield();
      } else {
        cpu_relax();
      }
    }
    // Monotone update of the hint; a stale value only costs another re-read.
    uint64_t cached = tail_cache_.load(std::memory_order_relaxed);
    while (cached < t && !tail_cache_.compare_exchange_weak(cached, t, std::memory_order_release,
                                                             std::memory_order_relaxed)) {
    }
  }
  TransferCmd* slot = &ring_[idx & mask_];
  store_relaxed(&slot->word1, cmd.word1);
  // Publishes the command; pairs with the acquire load of word0 in poll().
  store_release(&slot->word0, cmd.word0);
  return idx;
}

bool Fifo::try_push(const TransferCmd& cmd, uint64_t* idx) {
  const uint64_t h = head_.load(std::memory_order_relaxed);
  if (h - tail_->load(std::memory_order_acquire) >= capacity_) return false;
  *idx = push(cmd);
  return true;
}

bool Fifo::check_completion(uint64_t idx) const {
  // Pairs with the release-store of tail_ in pop().
  return tail_->load(std::memory_order_acquire) > idx;
}

bool Fifo::poll(uint64_t idx, TransferCmd* out) const {
  const TransferCmd* slot = &ring_[idx & mask_];
  // Pairs with the release store of word0 in push() (CPU) / the fence + 16-byte store in FifoDeviceHandle::push.
  const uint64_t w0 = load_acquire(&slot->word0);
  if (w0 == 0) return false;
  const uint64_t w1 = load_relaxed(&slot->word1);
  if (!(w1 & kCmdValidBit)) return false;  // 16-byte store not fully visible yet; poll again
  out->word0 = w0;
  out->word1 = w1;
  return true;
}

void Fifo::pop() {
  const uint64_t t = tail_->load(std::memory_order_relaxed);
  TransferCmd* slot = &ring_[t & mask_];
  store_relaxed(&slot->word1, 0);
  store_relaxed(&slot->word0, 0);
  // Hands the slot back to producers; pairs with their acquire loads of tail_ in push()/check_completion().
  tail_->store(t + 1, std::memory_order_release);
}

FifoDeviceHandle Fifo::device_handle() {
  FifoDeviceHandle h;
  if (gpu_) {
    h.ring = ring_dev_;
    h.head = head_dev_;
    h.tail = tail_dev_;
    h.tail_cache = tail_cache_dev_;
  } else {
    h.ring = ring_;
    h.head = reinterpret_cast<uint64_t*>(&head_);
    h.tail = reinterpret_cast<uint64_t*>(tail_);
    h.tail_cache = reinterpret_cast<uint64_t*>(&tail_cache_);
  }
  h.capacity_mask = mask_;
  h.channel = channel_;
  return h;
}

}  // namespace uccl_moe
