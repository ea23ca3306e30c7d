// Loopback transport: emulates N nodes on one host across processes (or threads).
//   - Each rank creates two POSIX shared-memory segments: its data region ("/ucclmoe.<job>.<rank>.data") and one
//     receive queue per proxy thread ("/ucclmoe.<job>.<rank>.q", a bounded multi-producer queue of immediates).
//   - A write copies from our data region into the peer's mapped data region (through the CopyEngine seam), then,
//     only once the copy is done, enqueues (src rank, immediate) into the peer's queue of the same thread index, then
//     completes locally. A full peer queue holds the request at the sender (like an RNR retry).
//   - Fault injection (fault_injector.hpp) delays, reorders and drops requests at the sender.
// No native atomics and no ordering guarantee: the proxy uses software atomics and the ordering engine.
// GPU mode (TransportContext::gpu, set by the internode runtime): the data region is the caller's GPU buffer, peers
// map it through IPC handles published in the store, and a write is a copy-engine copy whose completion is observed
// before the immediate is enqueued — so the receiver's proxy never sees an immediate before the bytes landed.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>

#include "copy_engine.hpp"
#include "fault_injector.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe::detail {

FaultConfig FaultConfig::from_env() {
  FaultConfig c;
  c.reorder_window = int(env::LOOPBACK_REORDER_WINDOW());
  c.delay_us = env::LOOPBACK_DELAY_US();
  c.drop_every = env::LOOPBACK_DROP_EVERY();
  c.seed = uint64_t(env::LOOPBACK_SEED());
  return c;
}

namespace {

constexpr uint32_t kBlobMagic = 0x4C4F4F50;  // "LOOP"
constexpr uint16_t kBlobVersion = 1;

/// Bounded multi-producer / single-consumer queue in shared memory (sequence-numbered cells).
struct Cell {
  std::atomic<uint64_t> seq;
  uint64_t payload;  ///< src_rank << 32 | imm
};
struct alignas(64) QueueHeader {
  std::atomic<uint64_t> enqueue_pos;
  char pad0[56];
  std::atomic<uint64_t> dequeue_pos;
  char pad1[56];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process queues need lock-free 64-bit atomics");

struct QueueView {
  QueueHeader* hdr = nullptr;
  Cell* cells = nullptr;
  uint64_t mask = 0;

  bool try_enqueue(uint64_t payload) {
    uint64_t pos = hdr->enqueue_pos.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells[pos & mask];
      // Pairs with the consumer's release of c.seq in try_dequeue (slot free again).
      const uint64_t seq = c.seq.load(std::memory_order_acquire);
      const int64_t diff = int64_t(seq) - int64_t(pos);
      if (diff == 0) {
        if (hdr->enqueue_pos.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.payload = payload;
          c.seq.store(pos + 1, std::memory_order_release);  // publishes payload; pairs with try_dequeue's acquire
          return true;
        }
      } else if (diff < 0) {
        return false;  // full
      } else {
        pos = hdr->enqueue_pos.load(std::memory_order_relaxed);
      }
    }
  }
  bool try_dequeue(uint64_t* payload) {
    const uint64_t pos = hdr->dequeue_pos.load(std::memory_order_relaxed);
    Cell& c = cells[pos & mask];
    if (c.seq.load(std::memory_order_acquire) != pos + 1) return false;
    *payload = c.payload;
    hdr->dequeue_pos.store(pos + 1, std::memory_order_relaxed);
    c.seq.store(pos + mask + 1, std::memory_order_release);
    return true;
  }
};

size_t queue_bytes(uint32_t depth) { return sizeof(QueueHeader) + sizeof(Cell) * depth; }

/// A mapped POSIX shared-memory segment (created or opened).
struct ShmSegment {
  std::string name;
  void* base = nullptr;
  size_t bytes = 0;
  bool owner = false;

  void create(const std::string& n, size_t b) {
    name = n;
    bytes = b;
    int fd = shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) {
      UCCL_LOG(WARN, NET, "loopback: removing stale shared memory %s (an earlier run with job name reused?)",
               n.c_str());
      shm_unlink(n.c_str());
      fd = shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    }
    UCCL_CHECK_SYS(fd, "shm_open(%s)", n.c_str());
    owner = true;
    if (ftruncate(fd, off_t(b)) != 0) {
      int e = errno;
      close(fd);
      UCCL_CHECK_SYS((errno = e, -1), "ftruncate(%s, %zu)", n.c_str(), b);
    }
    map(fd);
  }
  void open(const std::string& n, size_t b) {
    name = n;
    bytes = b;
    int fd = shm_open(n.c_str(), O_RDWR, 0600);
    UCCL_CHECK_SYS(fd, "shm_open(%s) of a peer (did it exit before every rank connected?)", n.c_str());
    map(fd);
  }
  void map(int fd) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
      base = nullptr;
      UCCL_CHECK_SYS(-1, "mmap(%s, %zu)", name.c_str(), bytes);
    }
  }
  void unlink() {
    if (owner && !name.empty()) shm_unlink(name.c_str());
    owner = false;
  }
  ~ShmSegment() {
    unlink();
    if (base) munmap(base, bytes);
  }
};

std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

class LoopbackTransport;

struct Peer {
  std::unique_ptr<ShmSegment> data;  ///< host mode
  char* base = nullptr;              ///< the peer's data region as mapped here
  uint64_t bytes = 0;
  bool ipc_opened = false;           ///< GPU mode: base came from open_ipc (closed with the transport)
  std::unique_ptr<ShmSegment> queues;
  uint32_t depth = 0;
};

class LoopbackEndpoint : public Endpoint {
 public:
  LoopbackEndpoint(LoopbackTransport* t, int thread_idx);
  void connect(KvStore& store) override;
  void post(const WorkRequest& wr) override;
  int poll(std::vector<Completion>& out, int max) override;
  void flush() override;
  bool can_reach(int peer) const override;

 private:
  struct Pending {
    WorkRequest wr;
    std::chrono::steady_clock::time_point ready;
    uint64_t copy_token = 0;  ///< 0 = copy not started
  };
  void progress(std::vector<Completion>& out);
  void drop_pending(size_t idx) {
    if (idx == 0)
      pending_.pop_front();  // in order: no shifting
    else
      pending_.erase(pending_.begin() + long(idx));
  }
  LoopbackTransport* t_;
  int thread_;
  FaultInjector faults_;
  std::unique_ptr<CopyEngine> copy_;  ///< created on the proxy thread at first use
  std::deque<Pending> pending_;
  std::deque<Completion> done_;
  std::vector<Completion> scratch_;  ///< flush()'s completions before they join done_
};

class LoopbackTransport : public Transport {
 public:
  explicit LoopbackTransport(const TransportContext& ctx) : ctx_(ctx) {
    depth_ = uint32_t(env::LOOPBACK_RECV_DEPTH());
    UCCL_ASSERT((depth_ & (depth_ - 1)) == 0, "UCCL_MOE_LOOPBACK_RECV_DEPTH=%u must be a power of two", depth_);
    const std::string base = "/ucclmoe." + ctx.job + "." + std::to_string(ctx.rank);
    queues_.create(base + ".q", queue_bytes(depth_) * size_t(ctx.num_threads));
    for (int t = 0; t < ctx.num_threads; ++t) {
      init_queue(queue_at(queues_.base, t));
      init_cells(t);
    }
    data_name_ = base + ".data";
  }
  ~LoopbackTransport() override {
    for (Peer& p : peers_)
      if (p.ipc_opened && ctx_.gpu) ctx_.gpu->close_ipc(p.base);
  }
  const char* name() const override { return "loopback"; }
  TransportCaps caps() const override { return TransportCaps{false, false, depth_}; }
  void* allocate(MemoryKind kind, size_t bytes) override {
    if (kind != MemoryKind::kData) return nullptr;  // counters: caller memory (applied by our own proxy)
    if (ctx_.gpu) return nullptr;                    // GPU mode: the caller's GPU buffer
    UCCL_ASSERT(data_.base == nullptr, "loopback: data region allocated twice");
    data_.create(data_name_, std::max<size_t>(bytes, 64));
    return data_.base;
  }
  void register_memory(MemoryKind kind, void* ptr, size_t bytes) override {
    if (kind == MemoryKind::kCounters) return;
    if (ctx_.gpu) {
      UCCL_ASSERT(ptr != nullptr && bytes > 0, "loopback (GPU mode): empty data region");
      local_data_ = static_cast<char*>(ptr);
      data_bytes_ = bytes;
      return;
    }
    UCCL_ASSERT(data_.base != nullptr && ptr == data_.base && bytes <= data_.bytes,
                "the loopback transport shares only the data region it allocated (pass data_ptr=nullptr)");
    local_data_ = static_cast<char*>(data_.base);
    data_bytes_ = bytes;
  }
  std::unique_ptr<Endpoint> create_endpoint(int thread_idx) override {
    return std::make_unique<LoopbackEndpoint>(this, thread_idx);
  }

  /// Publishes our segments and maps every peer's (once per proxy; endpoints share the mappings).
  void connect_all(KvStore& store) {
    std::lock_guard<std::mutex> lock(mu_);
    if (connected_) return;
    const std::string prefix = ctx_.job + "/loopback/";
    BlobWriter w(kBlobMagic, kBlobVersion);
    // Data: a shared-memory name (host mode) or an IPC handle of the GPU buffer (GPU mode).
    const std::string data_ref = ctx_.gpu ? ctx_.gpu->export_ipc(local_data_) : data_.name;
    w.str(host_name()).str(queues_.name).u64(queues_.bytes).str(data_ref).u64(data_bytes_).u32(depth_).u32(
        uint32_t(ctx_.num_threads)).u32(ctx_.gpu ? 1u : 0u);
    store.set(prefix + "r" + std::to_string(ctx_.rank), w.data());
    peers_.resize(size_t(ctx_.num_ranks));
    for (int p = 0; p < ctx_.num_ranks; ++p) {
      std::string blob = store.get(prefix + "r" + std::to_string(p), ctx_.timeout_s);
      BlobReader r(blob, kBlobMagic, kBlobVersion, "loopback");
      const std::string host = r.str(), qname = r.str();
      const uint64_t qbytes = r.u64();
      const std::string dname = r.str();
      const uint64_t dbytes = r.u64();
      const uint32_t depth = r.u32(), threads = r.u32(), gpu_mode = r.u32();
      if (host != host_name())
        UCCL_THROW(kInvalidUsage, "loopback transport: rank %d is on host '%s', we are on '%s'; loopback emulates "
                   "nodes on one host only (UCCL_MOE_TRANSPORT)", p, host.c_str(), host_name().c_str());
      if (int(threads) != ctx_.num_threads)
        UCCL_THROW(kInvalidUsage, "loopback: rank %d runs %u proxy threads, we run %d (UCCL_MOE_PROXY_THREADS must "
                   "match on every rank)", p, threads, ctx_.num_threads);
      if ((gpu_mode != 0) != (ctx_.gpu != nullptr))
        UCCL_THROW(kInvalidUsage, "loopback: rank %d registered %s memory, we registered %s memory; every rank of a "
                   "job must use the same mode", p, gpu_mode ? "GPU" : "host", ctx_.gpu ? "GPU" : "host");
      Peer& peer = peers_[size_t(p)];
      peer.depth = depth;
      peer.queues = std::make_unique<ShmSegment>();
      peer.queues->open(qname, qbytes);
      peer.bytes = dbytes;
      if (!ctx_.gpu) {
        peer.data = std::make_unique<ShmSegment>();
        peer.data->open(dname, dbytes);
        peer.base = static_cast<char*>(peer.data->base);
      } else if (p == ctx_.rank) {
        peer.base = local_data_;  // a process cannot open its own IPC handle
      } else {
        peer.base = static_cast<char*>(ctx_.gpu->open_ipc(dname));
        peer.ipc_opened = true;
      }
    }
    // Every rank mapped everything: the names can go, the mappings stay (no leak if a process dies later).
    store.set(prefix + "mapped/r" + std::to_string(ctx_.rank), "1");
    for (int p = 0; p < ctx_.num_ranks; ++p) store.get(prefix + "mapped/r" + std::to_string(p), ctx_.timeout_s);
    queues_.unlink();
    data_.unlink();
    connected_ = true;
    UCCL_LOG(INFO, NET, "loopback: rank %d connected to %d ranks (%d threads, receive depth %u)", ctx_.rank,
             ctx_.num_ranks, ctx_.num_threads, depth_);
  }

  static void init_queue(char* q) {
    auto* h = new (q) QueueHeader();
    h->enqueue_pos.store(0);
    h->dequeue_pos.store(0);
  }
  char* queue_at(void* base, int thread) const {
    return static_cast<char*>(base) + queue_bytes(depth_) * size_t(thread);
  }
  QueueView queue_view(void* base, uint32_t depth, int thread) const {
    char* q = static_cast<char*>(base) + queue_bytes(depth) * size_t(thread);
    QueueView v{reinterpret_cast<QueueHeader*>(q), reinterpret_cast<Cell*>(q + sizeof(QueueHeader)), depth - 1};
    return v;
  }
  void init_cells(int thread) {
    QueueView v = queue_view(queues_.base, depth_, thread);
    for (uint32_t i = 0; i < depth_; ++i) {
      new (&v.cells[i].seq) std::atomic<uint64_t>(i);
      v.cells[i].payload = 0;
    }
  }

  TransportContext ctx_;
  uint32_t depth_;
  ShmSegment queues_, data_;
  std::string data_name_;
  char* local_data_ = nullptr;
  uint64_t data_bytes_ = 0;
  std::mutex mu_;
  bool connected_ = false;
  std::vector<Peer> peers_;
};

LoopbackEndpoint::LoopbackEndpoint(LoopbackTransport* t, int thread_idx)
    : t_(t), thread_(thread_idx), faults_(FaultConfig::from_env(), uint64_t(t->ctx_.rank) * 1000003ull + uint64_t(thread_idx)) {
}

void LoopbackEndpoint::connect(KvStore& store) { t_->connect_all(store); }

bool LoopbackEndpoint::can_reach(int peer) const {
  return peer >= 0 && size_t(peer) < t_->peers_.size() && t_->peers_[size_t(peer)].base != nullptr;
}

void LoopbackEndpoint::post(const WorkRequest& wr) {
  UCCL_CHECK_INTERNAL(wr.op != WrOp::kAtomicAdd, "loopback has no native atomics");
  UCCL_CHECK_INTERNAL(can_reach(wr.peer), "loopback: post to unconnected peer %d", wr.peer);
  if (faults_.next_drop()) {
    UCCL_LOG(INFO, NET, "loopback fault injection: dropping wr_id=%llu to peer %d (imm 0x%08x)",
             (unsigned long long)wr.wr_id, wr.peer, wr.imm);
    return;
  }
  const int64_t delay = faults_.next_delay_us();
  // Without injected delays every request is ready at once: no clock read per request (the FIFO benchmark's path).
  const auto ready = delay > 0 ? std::chrono::steady_clock::now() + std::chrono::microseconds(delay)
                               : std::chrono::steady_clock::time_point::min();
  pending_.push_back(Pending{wr, ready, 0});
}

void LoopbackEndpoint::flush() {
  scratch_.clear();  // kept across calls: no allocation per proxy loop
  progress(scratch_);
  for (auto& c : scratch_) done_.push_back(std::move(c));
}

void LoopbackEndpoint::progress(std::vector<Completion>& out) {
  if (pending_.empty()) return;
  if (!copy_) {
    if (t_->ctx_.gpu)
      copy_ = t_->ctx_.gpu->make_copy_engine();
    else
      copy_ = std::make_unique<HostCopyEngine>();
  }
  // Without reordering or delays the oldest request is always next: no scan and no clock (the common, fast case).
  const bool in_order = faults_.config().reorder_window <= 1 && faults_.config().delay_us <= 0;
  const auto now = in_order ? std::chrono::steady_clock::time_point::min() : std::chrono::steady_clock::now();
  // Eligible = ready; pick among the first `window` eligible ones (reordering).
  for (int budget = 64; budget > 0 && !pending_.empty(); --budget) {
    size_t idx = 0;
    if (!in_order) {
      int eligible[64];
      int n = 0;
      for (size_t i = 0; i < pending_.size() && n < 64; ++i)
        if (pending_[i].ready <= now) eligible[n++] = int(i);
      if (n == 0) return;
      idx = size_t(eligible[faults_.pick(n)]);
    }
    Pending& p = pending_[idx];
    const WorkRequest& wr = p.wr;
    Peer& peer = t_->peers_[size_t(wr.peer)];
    if (p.copy_token == 0) {
      if (wr.local_offset + wr.bytes > t_->data_bytes_ || wr.remote_offset + wr.bytes > peer.bytes) {
        Completion c;
        c.kind = CompletionKind::kError;
        c.wr_id = wr.wr_id;
        c.peer = wr.peer;
        c.status = detail::format("remote access error: %u bytes from local offset %llu (region %llu) to peer %d "
                                  "offset %llu (region %llu)", wr.bytes, (unsigned long long)wr.local_offset,
                                  (unsigned long long)t_->data_bytes_, wr.peer, (unsigned long long)wr.remote_offset,
                                  (unsigned long long)peer.bytes);
        out.push_back(std::move(c));
        drop_pending(idx);
        continue;
      }
      p.copy_token = wr.bytes ? copy_->submit(peer.base + wr.remote_offset, t_->local_data_ + wr.local_offset, wr.bytes)
                              : ~0ull;
    }
    if (p.copy_token != ~0ull && !copy_->done(p.copy_token)) {
      if (in_order) return;  // the oldest copy is still running; later ones complete after it
      continue;
    }
    if (wr.op == WrOp::kWriteImm) {
      QueueView q = t_->queue_view(peer.queues->base, peer.depth, thread_);
      // The immediate is published only after the data landed (release in try_enqueue).
      if (!q.try_enqueue(uint64_t(uint32_t(t_->ctx_.rank)) << 32 | wr.imm)) return;  // peer queue full: retry later
    }
    Completion c;
    c.kind = CompletionKind::kSend;
    c.wr_id = wr.wr_id;
    c.peer = wr.peer;
    out.push_back(std::move(c));
    drop_pending(idx);
  }
}

int LoopbackEndpoint::poll(std::vector<Completion>& out, int max) {
  const size_t start = out.size();
  while (!done_.empty() && int(out.size() - start) < max) {
    out.push_back(std::move(done_.front()));
    done_.pop_front();
  }
  if (int(out.size() - start) < max) progress(out);
  QueueView q = t_->queue_view(t_->queues_.base, t_->depth_, thread_);
  uint64_t payload;
  while (int(out.size() - start) < max && q.try_dequeue(&payload)) {
    Completion c;
    c.kind = CompletionKind::kRecvImm;
    c.peer = int(payload >> 32);
    c.imm = uint32_t(payload);
    out.push_back(std::move(c));
  }
  return int(out.size() - start);
}

}  // namespace

std::unique_ptr<Transport> create_loopback_transport(const TransportContext& ctx) {
  return std::make_unique<LoopbackTransport>(ctx);
}

}  // namespace uccl_moe::detail
