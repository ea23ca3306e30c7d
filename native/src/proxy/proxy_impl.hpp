// Internal state of the CPU proxy (Proxy::Impl), shared by its files:
//   proxy.cc          lifecycle (options, transport, threads, FIFOs), the first-error slot, the public accessors
//   proxy_memory.cc   the data region and the counters a transport registers
//   proxy_loop.cc     the thread loop: poll completions, feed immediates to the ordering engine, retire commands
//   proxy_post.cc     the command semantics: read FIFO commands and post them to the transport under flow control
//   proxy_barrier.cc  BARRIER: epochs exchanged through control immediates, per BarrierScope
//   proxy_timeouts.cc the watchdog of a thread: lost commands and held counter updates
//   proxy_stats.cc    the counters (proxy_counters.def): per-thread atomics, snapshots, the sum over threads
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "flow_control.hpp"
#include "ordering.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/proxy.hpp"

namespace uccl_moe::detail {

using Clock = std::chrono::steady_clock;
constexpr int kWrIdCmdBits = 56;        ///< wr_id = local FIFO << 56 | command index
constexpr int kPollBatch = 512;         ///< completions + immediates per loop (loopback makes one of each per command)
constexpr int kPostBudgetPerFifo = 64;  ///< commands read from one FIFO per loop (fairness between FIFOs)

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// One thread's counters (proxy_counters.def). Written by its thread only, read by any (relaxed).
struct AtomicCounters {
#define UCCL_MOE_PROXY_COUNTER(NAME, MERGE, DOC) std::atomic<uint64_t> NAME{0};
#include "proxy_counters.def"
#undef UCCL_MOE_PROXY_COUNTER
  static void bump(std::atomic<uint64_t>& c, uint64_t n = 1) {
    c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  static void raise_to(std::atomic<uint64_t>& c, uint64_t v) {
    if (v > c.load(std::memory_order_relaxed)) c.store(v, std::memory_order_relaxed);
  }
  ProxyCounters snapshot() const;
};
/// Folds one thread's snapshot into the proxy's: SUM rows add, MAX rows keep the maximum.
void merge_counters(ProxyCounters& into, const ProxyCounters& thread);

/// One command between the FIFO's tail (oldest not retired) and the read cursor.
struct Entry {
  TransferCmdFields f;
  uint64_t idx = 0;
  int pending_wrs = 0;   ///< posted work requests not completed yet
  uint64_t bytes = 0;    ///< payload bytes charged to flow control (the WRITE piece in flight)
  uint64_t sent = 0;     ///< WRITE: payload bytes posted so far (pieces of at most the in-flight byte limit)
  Clock::time_point posted;
  bool started = false;  ///< QUIET/BARRIER: reached the front and began
  uint64_t epoch = 0;    ///< BARRIER: our epoch
  bool done = false;
};

/// The commands between a FIFO's tail and its read cursor, in a ring as large as the FIFO (the proxy never reads
/// further ahead than the FIFO holds): no allocation per command.
class EntryRing {
 public:
  explicit EntryRing(size_t capacity) : slots_(capacity) {}
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  Entry& front() { return slots_[head_]; }
  Entry& back() { return slots_[(head_ + size_ - 1) % slots_.size()]; }
  Entry& operator[](size_t i) { return slots_[(head_ + i) % slots_.size()]; }
  Entry& emplace_back() {
    UCCL_CHECK_INTERNAL(size_ < slots_.size(), "proxy read %zu commands ahead of a FIFO of %zu", size_ + 1,
                        slots_.size());
    Entry& e = slots_[(head_ + size_++) % slots_.size()];
    e = Entry{};
    return e;
  }
  void pop_front() {
    head_ = (head_ + 1) % slots_.size();
    --size_;
  }

 private:
  std::vector<Entry> slots_;
  size_t head_ = 0, size_ = 0;
};

struct FifoState {
  explicit FifoState(size_t capacity) : inflight(capacity) {}
  std::unique_ptr<Fifo> fifo;
  int global_idx = 0;
  int channel = 0;       ///< index within the thread (immediate channel field)
  uint64_t cursor = 0;   ///< next command to read
  uint64_t retired = 0;  ///< == fifo->tail()
  EntryRing inflight;    ///< commands [retired, cursor)
};

/// The scope a BARRIER command asks for (its same-rail flag).
inline BarrierScope scope_of(const TransferCmdFields& f) {
  return (f.flags & kCmdFlagSameRail) ? BarrierScope::kSameRail : BarrierScope::kAll;
}

}  // namespace uccl_moe::detail

namespace uccl_moe {

struct Proxy::Impl {
  using Clock = detail::Clock;
  using Entry = detail::Entry;
  using FifoState = detail::FifoState;

  ProxyOptions opt;
  Timeout timeout{0};
  std::shared_ptr<KvStore> store;
  std::unique_ptr<Transport> transport;
  TransportCaps caps;
  bool software_atomics = true;
  void* data = nullptr;
  bool own_data = false;
  int64_t* counters = nullptr;
  int64_t* counters_dev = nullptr;  ///< GPU view (GPU mode)
  bool own_counters = false;
  uint64_t num_counters = 0;
  std::vector<int> cpus;  ///< thread t on cpus[t % n]; or, with pin_numa, every thread on the whole set
  bool pin_numa = false;  ///< cpus is the NIC's NUMA node (UCCL_MOE_PROXY_CPUS=auto)
  /// [BarrierScope] ranks a BARRIER of that scope exchanges epochs with.
  std::vector<int> barrier_peers[detail::kNumBarrierScopes];

  struct Thread {
    int idx = 0;
    std::unique_ptr<Endpoint> ep;
    std::vector<FifoState*> fifos;
    std::unique_ptr<FlowControl> flow;
    std::unique_ptr<detail::OrderingEngine> order;
    std::vector<uint32_t> next_seq;  ///< [dst * fifos_per_thread + channel]
    std::vector<uint64_t> barrier_seen[detail::kNumBarrierScopes];  ///< [scope][src] last epoch received (unwrapped)
    uint64_t barrier_epoch[detail::kNumBarrierScopes] = {0, 0};
    detail::AtomicCounters stats;
    std::thread th;
    Clock::time_point held_since;
    size_t last_held = 0;
  };
  std::vector<std::unique_ptr<FifoState>> fifos;
  std::vector<std::unique_ptr<Thread>> threads;
  std::atomic<bool> stop_flag{false};
  std::atomic<bool> started{false};
  std::atomic<int32_t> abort_flag{0};
  mutable std::mutex err_mu;
  bool has_error = false;
  ErrorCode err_code = ErrorCode::kInternal;
  std::string err_msg;

  // ---- proxy.cc: the first-error slot ----
  void record_error(ErrorCode code, const std::string& msg);
  void check() const;
  std::string who(const Thread& t) const;

  // ---- proxy_memory.cc ----
  void setup_memory();
  void free_memory();

  // ---- proxy_loop.cc ----
  void run(Thread& t);
  bool poll_completions(Thread& t, std::vector<Completion>& comps);
  void on_data_imm(Thread& t, const Completion& c);
  bool retire(Thread& t);
  static uint64_t wr_id_of(const FifoState& fs, uint64_t idx) {
    return uint64_t(fs.channel) << detail::kWrIdCmdBits | idx;
  }
  Entry& entry_of(FifoState& fs, uint64_t idx);

  // ---- proxy_post.cc ----
  bool post_new(Thread& t);
  void post_cmd(Thread& t, FifoState& fs, Entry& e);
  void post_write_piece(Thread& t, FifoState& fs, Entry& e);
  /// The sequence-number slot of (dst, channel) in Thread::next_seq.
  static size_t seq_slot(const Thread& t, int dst, const FifoState& fs) {
    return size_t(dst) * t.fifos.size() + size_t(fs.channel);
  }
  /// The index of this rank's counter `f.counter_slot` in a peer's counters.
  uint32_t counter_index_of(const TransferCmdFields& f) const {
    return uint32_t(opt.rank) * kCountersPerSrc + f.counter_slot;
  }

  // ---- proxy_barrier.cc ----
  void setup_barrier_peers();
  void on_barrier_imm(Thread& t, const detail::Imm& m, int peer);
  void start_barrier(Thread& t, FifoState& fs, Entry& e);
  bool barrier_met(const Thread& t, const Entry& e) const;
  std::string barrier_missing(const Thread& t, const Entry& e) const;  ///< "1,3": ranks whose epoch is missing

  // ---- proxy_timeouts.cc ----
  void check_timeouts(Thread& t);
};

}  // namespace uccl_moe
