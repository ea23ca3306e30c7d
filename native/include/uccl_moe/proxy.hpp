// The CPU proxy: one per GPU, N threads (UCCL_MOE_PROXY_THREADS). Thread t owns FIFOs {g : g % N == t} and one
// transport endpoint that talks only to thread t of every peer. Each thread loops:
//   1. poll completions: retire sends; feed received immediates to the ordering engine, which applies counter adds
//      (software atomics) in the order the kernels need; count barrier arrivals;
//   2. retire FIFO commands that completed, in order (release-store of the FIFO tail);
//   3. read new commands from its FIFOs and post them while flow control admits them;
//   4. check timeouts: a posted command or a held counter update older than UCCL_MOE_TIMEOUT_S is an error.
// Threads never throw: the first error is kept (code + message), the abort flag is raised, every thread stops, and the
// next call on the Proxy (check(), counters(), stop(), Fifo waits through wait()) rethrows it. Threads are named
// uccl-proxy-<t> and optionally pinned (UCCL_MOE_PROXY_CPUS).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/fifo.hpp"
#include "uccl_moe/gpu_memory.hpp"
#include "uccl_moe/timeout.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe {

/// Options. An unset optional takes the environment knob named next to it; Proxy::options() has every one set.
struct ProxyOptions {
  int rank = 0;
  int num_ranks = 1;
  std::optional<int> ranks_per_node;        ///< for same-rail barriers; unset = num_ranks (one node)
  std::optional<int> num_threads;           ///< UCCL_MOE_PROXY_THREADS
  std::optional<int> fifos_per_thread;      ///< UCCL_MOE_PROXY_FIFOS_PER_THREAD (<= 8)
  std::optional<int> fifo_capacity;         ///< UCCL_MOE_FIFO_CAPACITY
  std::optional<int64_t> max_inflight_bytes;   ///< UCCL_MOE_MAX_INFLIGHT_BYTES if set, else the NIC default (0 = unlimited)
  std::optional<int64_t> max_inflight_writes;  ///< UCCL_MOE_MAX_INFLIGHT_WRITES if set, else the NIC default
  std::optional<double> timeout_s;          ///< UCCL_MOE_TIMEOUT_S
  std::optional<std::string> transport;     ///< UCCL_MOE_TRANSPORT
  std::optional<std::string> cpus;          ///< UCCL_MOE_PROXY_CPUS grammar ("" = no pinning)
  std::string gpu_pci_bus_id;               ///< this rank's GPU, for the NIC choice ("" = unknown)
  std::optional<int> local_rank;            ///< index on the node (per-rank NIC / CPU lists); unset = rank % ranks_per_node
  std::string job = "uccl";       ///< namespace for bootstrap keys and shared-memory names
  uint64_t data_bytes = 1 << 20;  ///< size of the registered data region
  void* data_ptr = nullptr;       ///< caller memory for the data region; nullptr = the transport allocates it
  /// GPU mode (set by the internode runtime): FIFOs and counters in GPU-mapped memory.
  std::shared_ptr<const GpuMemoryOps> gpu;
  /// With `gpu`: data_ptr is GPU memory (IPC + copy engines in the loopback). Otherwise the transport allocates host
  /// memory that the caller registers with the GPU (host-staged).
  bool gpu_data = false;
  /// Verbs layer handed to the transport (TransportContext::verbs); null = the real libibverbs. Tests inject a fake
  /// NIC here; the named transport is then created without probing for hardware.
  std::shared_ptr<detail::VerbsOps> verbs;
};

/// Monotone counters summed over threads and high-water marks (maxima); per-thread values from thread_counters().
/// Fields: the rows of proxy_counters.def (uccl_moe/, the one list).
struct ProxyCounters {
#define UCCL_MOE_PROXY_COUNTER(NAME, MERGE, DOC) uint64_t NAME = 0;
#include "proxy_counters.def"
#undef UCCL_MOE_PROXY_COUNTER
};

class Proxy {
 public:
  Proxy(const ProxyOptions& options, std::shared_ptr<KvStore> store);
  ~Proxy();  ///< stops (never throws)
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  /// Connects every thread's endpoint through the store (blocking, bounded) and starts the threads.
  void start();
  /// Stops the threads; rethrows the first thread error if there was one.
  void stop();
  bool running() const;
  /// Rethrows the first thread error (Transport / Timeout / Internal) if any.
  void check() const;

  int num_threads() const;
  int num_fifos() const;
  /// FIFO `idx` (0 <= idx < num_fifos()); it belongs to thread idx % num_threads().
  Fifo& fifo(int idx);
  /// Push from a host producer: like Fifo::push, but a proxy failure while waiting for room rethrows that failure.
  uint64_t push(int fifo_idx, const TransferCmdFields& cmd);
  /// Waits until command `idx` of FIFO `fifo_idx` completed; rethrows thread errors. Bounded by
  /// Timeout::caller_behind_proxy_s(), so a lost command is reported by the proxy thread's own diagnostic first.
  void wait(int fifo_idx, uint64_t idx);

  void* data() const;
  uint64_t data_bytes() const;
  /// int64 counters[num_ranks * kCountersPerSrc]; updates from rank s to slot c land at s * kCountersPerSrc + c.
  int64_t* counters() const;
  uint64_t num_counters() const;
  /// GPU view of counters() (GPU mode), else counters().
  int64_t* counters_device() const;
  /// Non-zero once a thread failed (kernels poll it through a mapped pointer later).
  const std::atomic<int32_t>& abort_flag() const;

  ProxyCounters counters_total() const;
  std::vector<ProxyCounters> thread_counters() const;
  std::string transport_name() const;
  /// The transport's NIC (empty for loopback) and the CPUs the threads are pinned to (empty = not pinned).
  TransportNic nic() const;
  std::vector<int> pinned_cpus() const;
  const ProxyOptions& options() const;  ///< with knobs resolved
  /// The resolved UCCL_MOE_TIMEOUT_S (or options.timeout_s) every wait of this proxy uses.
  const Timeout& timeout() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace uccl_moe
