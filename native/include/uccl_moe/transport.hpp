// The transport interface of the CPU proxy (STYLE R4). One Transport per proxy (per GPU) owns the device context and
// the memory registration; one Endpoint per proxy thread owns that thread's queues and talks only to the endpoint of
// the same thread index on every peer. Implementations: native/src/transport/{loopback,ibverbs,efa}/, listed in
// priority order by registry.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "uccl_moe/bootstrap.hpp"
#include "uccl_moe/gpu_memory.hpp"
#include "uccl_moe/timeout.hpp"

namespace uccl_moe {

namespace detail {
class VerbsOps;  // native/src/transport/ibverbs/verbs_ops.hpp
}  // namespace detail

enum class MemoryKind : int { kData = 0, kCounters = 1 };

enum class WrOp : int {
  kWrite = 0,     ///< RDMA write, no receiver notification (ordered transports only)
  kWriteImm = 1,  ///< RDMA write with a 32-bit immediate (bytes may be 0: an immediate-only message)
  kAtomicAdd = 2, ///< native fetch-and-add of `add` on the peer's counters[counter_index] (caps().native_atomics)
};

/// One operation for a peer. Offsets are relative to the registered regions.
struct WorkRequest {
  uint64_t wr_id = 0;
  WrOp op = WrOp::kWrite;
  int peer = 0;
  uint64_t local_offset = 0;   ///< source in our data region
  uint64_t remote_offset = 0;  ///< destination in the peer's data region
  uint32_t bytes = 0;
  uint32_t imm = 0;            ///< kWriteImm (host order; the transport converts to wire order)
  uint32_t counter_index = 0;  ///< kAtomicAdd: index into the peer's int64 counters
  int64_t add = 0;             ///< kAtomicAdd
};

enum class CompletionKind : int {
  kSend = 0,     ///< our work request wr_id finished (its data landed at the peer)
  kRecvImm = 1,  ///< a peer's write-with-immediate landed in our memory
  kError = 2,    ///< wr_id failed; `status` says why
};

struct Completion {
  CompletionKind kind = CompletionKind::kSend;
  uint64_t wr_id = 0;
  int peer = -1;
  uint32_t imm = 0;
  std::string status;
};

struct TransportCaps {
  bool native_atomics = false;  ///< kAtomicAdd is supported
  bool ordered = false;         ///< writes (and atomics) to one peer land in post order (RC)
  uint32_t recv_depth = 0;      ///< most unprocessed immediates a receiver can hold (Q in src/proxy/ordering.hpp)
  std::string nic_family;       ///< "mlx5", "bnxt_re", "other" (NIC transports; picks flow-control defaults), "" = none
};

/// Per-proxy parameters a transport is created with. The timeout has no default of its own: the runtime that
/// creates the transport passes the limit it resolved once (Proxy: its Timeout), so both wait on the same value.
struct TransportContext {
  explicit TransportContext(const Timeout& timeout) : timeout_s(timeout.limit_s) {}

  int rank = 0;
  int num_ranks = 1;
  int num_threads = 1;
  std::string job = "uccl";  ///< namespace for bootstrap keys and shared-memory names
  double timeout_s;          ///< the creating runtime's resolved UCCL_MOE_TIMEOUT_S (bootstrap waits)
  /// GPU mode: the data region is GPU memory shared by IPC and copied by copy engines (loopback); see gpu_memory.hpp.
  std::shared_ptr<const GpuMemoryOps> gpu;
  std::shared_ptr<detail::VerbsOps> verbs;  ///< null: the real libibverbs (tests inject a fake)
  // GPU identity, for the NIC choice per GPU (native/src/transport/nic_select.hpp).
  std::string gpu_pci_bus_id;  ///< "0000:53:00.0"; "" = unknown (NIC selection assumes the local_rank-th GPU)
  int local_rank = 0;          ///< this rank's index on its node (per-rank UCCL_MOE_IB_HCA / UCCL_MOE_PROXY_CPUS)
};

/// The NIC a transport serves its GPU through (empty for loopback): where the proxy pins its threads by default, and
/// what `uccl-moe doctor` reports.
struct TransportNic {
  std::vector<std::string> devices;  ///< opened devices, primary first
  int numa_node = -1;                ///< -1 unknown
  std::string numa_cpus;             ///< CPU list of that node ("" unknown)
  std::string reason;                ///< why these devices (one line)
};

class Endpoint {
 public:
  virtual ~Endpoint() = default;
  /// Publishes this endpoint's connection info in `store` and connects to the same thread of every peer.
  /// May block (bounded by the context's timeout). Called once, from the proxy's start().
  virtual void connect(KvStore& store) = 0;
  /// Never blocks; queues when the NIC (or the peer's receive queue) is full. Owning proxy thread only.
  virtual void post(const WorkRequest& wr) = 0;
  /// Appends up to `max` completions to `out` and returns how many; 0 if none. Never blocks. Owning thread only.
  virtual int poll(std::vector<Completion>& out, int max) = 0;
  /// Pushes queued work to the NIC as far as possible. Never blocks. Owning thread only.
  virtual void flush() = 0;
  /// True if `peer` is connected and reachable through this endpoint.
  virtual bool can_reach(int peer) const = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual TransportCaps caps() const = 0;
  /// Memory for a region the transport can reach (shared memory for loopback, page-aligned host memory for NICs),
  /// owned by the transport. Returns nullptr if the transport takes caller memory only.
  virtual void* allocate(MemoryKind kind, size_t bytes) = 0;
  /// Registers [ptr, ptr + bytes) as the data or counter region (one of each). May block.
  virtual void register_memory(MemoryKind kind, void* ptr, size_t bytes) = 0;
  /// One endpoint per proxy thread, created after register_memory.
  virtual std::unique_ptr<Endpoint> create_endpoint(int thread_idx) = 0;
  /// The NIC chosen for this rank's GPU; empty for transports without one.
  virtual TransportNic nic() const { return {}; }
};

/// Creates the transport named `name` ("loopback", "ibverbs", "efa", or "auto": the first, in priority order
/// efa > ibverbs > loopback, whose probe finds usable hardware). Unknown or unavailable names throw InvalidUsage
/// listing the registered ones.
std::unique_ptr<Transport> create_transport(const std::string& name, const TransportContext& ctx);
/// The registered transport `name` stands for ("auto" resolved by the probes); throws like create_transport.
std::string resolve_transport(const std::string& name);
/// Registered transport names in priority order, and whether each was compiled in and its probe succeeds.
std::vector<std::pair<std::string, bool>> list_transports();

}  // namespace uccl_moe
