#include "uccl_moe/proxy.hpp"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include "uccl_moe/diag.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/flow_control.hpp"
#include "uccl_moe/log.hpp"
#include "uccl_moe/ordering.hpp"
#include "transport/nic_select.hpp"

namespace uccl_moe {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kWrIdCmdBits = 56;  ///< wr_id = local FIFO << 56 | command index
constexpr int kPollBatch = 512;  // completions + immediates handled per loop (each command makes one of each on loopback)
constexpr int kPostBudgetPerFifo = 64;  ///< commands read from one FIFO per loop (fairness between FIFOs)

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct AtomicCounters {
  std::atomic<uint64_t> commands{0}, writes{0}, atomics{0}, bytes{0}, recv_imms{0}, reorders{0}, held_updates{0},
      applied_updates{0}, stalls{0}, barriers{0}, peak_inflight_bytes{0}, peak_inflight_window{0};
  void bump(std::atomic<uint64_t>& c, uint64_t n = 1) { c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
  ProxyCounters snapshot() const {
    ProxyCounters p;
    p.commands = commands.load(std::memory_order_relaxed);
    p.writes = writes.load(std::memory_order_relaxed);
    p.atomics = atomics.load(std::memory_order_relaxed);
    p.bytes = bytes.load(std::memory_order_relaxed);
    p.recv_imms = recv_imms.load(std::memory_order_relaxed);
    p.reorders = reorders.load(std::memory_order_relaxed);
    p.held_updates = held_updates.load(std::memory_order_relaxed);
    p.applied_updates = applied_updates.load(std::memory_order_relaxed);
    p.stalls = stalls.load(std::memory_order_relaxed);
    p.barriers = barriers.load(std::memory_order_relaxed);
    p.peak_inflight_bytes = peak_inflight_bytes.load(std::memory_order_relaxed);
    p.peak_inflight_window = peak_inflight_window.load(std::memory_order_relaxed);
    return p;
  }
};

/// One command between the FIFO's tail (oldest not retired) and the read cursor.
struct Entry {
  TransferCmdFields f;
  uint64_t idx = 0;
  int pending_wrs = 0;     ///< posted work requests not completed yet
  uint64_t bytes = 0;      ///< payload bytes charged to flow control (the WRITE piece in flight)
  uint64_t sent = 0;       ///< WRITE: payload bytes posted so far (pieces of at most the in-flight byte limit)
  Clock::time_point posted;
  bool started = false;    ///< QUIET/BARRIER: reached the front and began
  uint64_t epoch = 0;      ///< BARRIER: our epoch
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
  int channel = 0;         ///< index within the thread (immediate channel field)
  uint64_t cursor = 0;     ///< next command to read
  uint64_t retired = 0;    ///< == fifo->tail()
  EntryRing inflight;      ///< commands [retired, cursor)
};

}  // namespace

struct Proxy::Impl {
  ProxyOptions opt;
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
  std::vector<int> cpus;     ///< thread t on cpus[t % n]; or, with pin_numa, every thread on the whole set
  bool pin_numa = false;     ///< cpus is the NIC's NUMA node (UCCL_MOE_PROXY_CPUS=auto)
  std::vector<int> barrier_peers[2];  ///< [all|rail] ranks a BARRIER of that flavour exchanges epochs with

  struct Thread {
    int idx = 0;
    std::unique_ptr<Endpoint> ep;
    std::vector<FifoState*> fifos;
    std::unique_ptr<FlowControl> flow;
    std::unique_ptr<OrderingEngine> order;
    std::vector<uint32_t> next_seq;        ///< [dst * fifos_per_thread + channel]
    std::vector<uint64_t> barrier_seen[2]; ///< [all|rail][src] last epoch received (unwrapped)
    uint64_t barrier_epoch[2] = {0, 0};
    AtomicCounters stats;
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

  void record_error(ErrorCode code, const std::string& msg) {
    {
      std::lock_guard<std::mutex> lock(err_mu);
      if (!has_error) {
        has_error = true;
        err_code = code;
        err_msg = msg;
      }
    }
    UCCL_LOG(ERROR, PROXY, "%s", msg.c_str());
    abort_flag.store(1, std::memory_order_release);  // pairs with the acquire loads in check() and every thread loop
  }
  void check() const {
    if (abort_flag.load(std::memory_order_acquire) == 0) return;
    std::lock_guard<std::mutex> lock(err_mu);
    throw Error(err_code, err_msg);
  }

  std::string who(const Thread& t) const {
    return detail::format("proxy thread %d of rank %d (%s)", t.idx, opt.rank, transport->name());
  }

  // ---- thread loop ----
  void run(Thread& t);
  bool poll_completions(Thread& t, std::vector<Completion>& comps);
  bool retire(Thread& t);
  bool post_new(Thread& t);
  void post_cmd(Thread& t, FifoState& fs, Entry& e);
  void post_write_piece(Thread& t, FifoState& fs, Entry& e);
  void start_barrier(Thread& t, FifoState& fs, Entry& e);
  bool barrier_met(const Thread& t, const Entry& e) const;
  void check_timeouts(Thread& t);
  static uint64_t wr_id_of(const FifoState& fs, uint64_t idx) { return uint64_t(fs.channel) << kWrIdCmdBits | idx; }
  Entry& entry_of(FifoState& fs, uint64_t idx) {
    UCCL_CHECK_INTERNAL(idx >= fs.retired && idx < fs.cursor, "completion for FIFO %d command %llu outside [%llu, %llu)",
                        fs.global_idx, (unsigned long long)idx, (unsigned long long)fs.retired,
                        (unsigned long long)fs.cursor);
    return fs.inflight[size_t(idx - fs.retired)];
  }
};

void Proxy::Impl::run(Thread& t) {
  char name[16];
  std::snprintf(name, sizeof name, "uccl-proxy-%d", t.idx);
  pthread_setname_np(pthread_self(), name);
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (pin_numa) {
      for (int c : cpus) CPU_SET(c, &set);
    } else {
      CPU_SET(cpus[size_t(t.idx) % cpus.size()], &set);
    }
    const std::string what = pin_numa ? "the NIC's NUMA node CPUs" : detail::format("CPU %d", cpus[size_t(t.idx) % cpus.size()]);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
      UCCL_LOG(WARN, PROXY, "%s: cannot pin to %s (UCCL_MOE_PROXY_CPUS)", who(t).c_str(), what.c_str());
    else
      UCCL_LOG(INFO, PROXY, "%s pinned to %s", who(t).c_str(), what.c_str());
  }
  try {
    std::vector<Completion> comps;
    comps.reserve(kPollBatch);
    uint32_t idle = 0, iter = 0;
    t.held_since = Clock::now();
    while (!stop_flag.load(std::memory_order_acquire)) {
      if (abort_flag.load(std::memory_order_acquire)) return;  // another thread failed
      bool busy = poll_completions(t, comps);
      busy |= retire(t);
      busy |= post_new(t);
      t.ep->flush();
      if ((++iter & 255u) == 0) check_timeouts(t);
      if (busy) {
        idle = 0;
      } else if (++idle > 64) {
        // Idle: give the core away (a 2-core host runs several proxies); latency while busy is unaffected.
        if (idle > 20000)
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        else
          std::this_thread::yield();
      }
    }
  } catch (const Error& e) {
    record_error(e.code(), who(t) + ": " + e.what());
  } catch (const std::exception& e) {
    record_error(ErrorCode::kInternal, who(t) + ": unexpected exception: " + e.what());
  }
}

bool Proxy::Impl::poll_completions(Thread& t, std::vector<Completion>& comps) {
  comps.clear();
  const int n = t.ep->poll(comps, kPollBatch);
  for (const Completion& c : comps) {
    if (c.kind == CompletionKind::kRecvImm) {
      t.stats.bump(t.stats.recv_imms);
      const Imm m = decode_imm(c.imm);
      if (m.kind == ImmKind::kControl) {
        if (m.control != ImmControlOp::kBarrier)
          UCCL_THROW(kTransport, "control immediate 0x%08x from rank %d has unknown op", c.imm, c.peer);
        // Immediate epoch bits: [25:24] reserved carry the barrier flavour in bit 24 (see start_barrier).
        const int kind = (c.imm >> 24) & 1;
        uint64_t& seen = t.barrier_seen[kind][size_t(c.peer)];
        seen += (m.epoch - uint32_t(seen)) & kImmEpochMask;
        continue;
      }
      bool reordered = false;
      t.order->on_imm(c.peer, c.imm,
                      [&](int src, uint32_t slot, int64_t value) {
                        // Release: the data of every write this update covers landed before (ordering engine).
                        __atomic_fetch_add(&counters[size_t(src) * kCountersPerSrc + slot], value, __ATOMIC_RELEASE);
                        t.stats.bump(t.stats.applied_updates);
                      },
                      &reordered);
      if (reordered) t.stats.bump(t.stats.reorders);
      const size_t held = t.order->num_held();
      if (held > t.last_held) t.stats.bump(t.stats.held_updates, held - t.last_held);
      // The hold clock restarts when updates start being held or a held one is released (no clock read while
      // nothing is held: the common case, one immediate per command).
      if (held > 0 && (held < t.last_held || t.last_held == 0)) t.held_since = Clock::now();
      t.last_held = held;
      continue;
    }
    const int local = int(c.wr_id >> kWrIdCmdBits);
    const uint64_t idx = c.wr_id & ((1ull << kWrIdCmdBits) - 1);
    UCCL_CHECK_INTERNAL(local >= 0 && size_t(local) < t.fifos.size(), "completion wr_id 0x%llx names FIFO %d",
                        (unsigned long long)c.wr_id, local);
    FifoState& fs = *t.fifos[size_t(local)];
    Entry& e = entry_of(fs, idx);
    if (c.kind == CompletionKind::kError)
      UCCL_THROW(kTransport, "completion error for FIFO %d command %llu (%s) to peer %d: %s", fs.global_idx,
                 (unsigned long long)idx, describe(e.f).c_str(), c.peer, c.status.c_str());
    if (--e.pending_wrs == 0 && e.f.op != CmdOp::kBarrier) {
      t.flow->on_complete(fs.channel, e.bytes);
      e.bytes = 0;
      e.done = e.f.op != CmdOp::kWrite || e.sent == e.f.bytes;  // else post_new posts its next piece
    }
  }
  return n > 0;
}

bool Proxy::Impl::barrier_met(const Thread& t, const Entry& e) const {
  if (e.pending_wrs != 0) return false;
  const int kind = (e.f.flags & kCmdFlagSameRail) ? 1 : 0;
  for (int p : barrier_peers[kind])
    if (t.barrier_seen[kind][size_t(p)] < e.epoch) return false;
  return true;
}

void Proxy::Impl::start_barrier(Thread& t, FifoState& fs, Entry& e) {
  const int kind = (e.f.flags & kCmdFlagSameRail) ? 1 : 0;
  e.epoch = ++t.barrier_epoch[kind];
  e.started = true;
  e.posted = Clock::now();
  const uint32_t imm = encode_imm_control(ImmControlOp::kBarrier, uint32_t(e.epoch)) | (uint32_t(kind) << 24);
  for (int p : barrier_peers[kind]) {
    WorkRequest wr;
    wr.wr_id = wr_id_of(fs, e.idx);
    wr.op = WrOp::kWriteImm;
    wr.peer = p;
    wr.imm = imm;
    ++e.pending_wrs;
    t.ep->post(wr);
  }
}

bool Proxy::Impl::retire(Thread& t) {
  bool any = false;
  for (FifoState* fs : t.fifos) {
    while (!fs->inflight.empty()) {
      Entry& e = fs->inflight.front();
      if (e.f.op == CmdOp::kQuiet) {
        e.done = true;  // at the front: everything before it completed
      } else if (e.f.op == CmdOp::kBarrier) {
        if (!e.started) start_barrier(t, *fs, e);
        if (!barrier_met(t, e)) break;
        e.done = true;
        t.stats.bump(t.stats.barriers);
      }
      if (!e.done) break;
      fs->inflight.pop_front();
      fs->fifo->pop();
      ++fs->retired;
      t.stats.bump(t.stats.commands);
      any = true;
    }
  }
  return any;
}

void Proxy::Impl::post_cmd(Thread& t, FifoState& fs, Entry& e) {
  const TransferCmdFields& f = e.f;
  const int dst = int(f.dst_rank);
  if (dst >= opt.num_ranks)
    UCCL_THROW(kTransport, "FIFO %d command %llu (%s): dst_rank %d >= num_ranks %d", fs.global_idx,
               (unsigned long long)e.idx, describe(f).c_str(), dst, opt.num_ranks);
  const uint64_t wr_id = wr_id_of(fs, e.idx);
  const bool ll = (f.flags & kCmdFlagLL) != 0;
  const bool phase = (f.flags & kCmdFlagPhase) != 0;
  const uint32_t counter_index = uint32_t(opt.rank) * kCountersPerSrc + f.counter_slot;
  auto next_seq = [&]() { return t.next_seq[size_t(dst) * t.fifos.size() + size_t(fs.channel)]++; };
  WorkRequest wr;
  wr.wr_id = wr_id;
  wr.peer = dst;
  if (f.op == CmdOp::kWrite) {
    post_write_piece(t, fs, e);
    t.stats.bump(t.stats.writes);
    t.stats.bump(t.stats.bytes, f.bytes);
    return;
  } else {  // ATOMIC
    // An LL fence counts its group's writes at the receiver: they may come from several FIFOs of the thread, posted
    // in any order between FIFOs, so no NIC atomic could follow them all. LL goes as writes with immediate also with
    // native atomics (found by the RC native-atomics proxy suite); native adds carry HT counters only, which follow
    // their FIFO's writes on the same QP.
    if (software_atomics || ll) {
      wr.op = WrOp::kWriteImm;
      wr.bytes = 0;
      wr.imm = ll ? encode_imm_ll(true, phase, f.counter_slot, f.bytes)
                  : encode_imm_ht(true, uint32_t(fs.channel), next_seq(), f.counter_slot, f.counter_value);
    } else {
      wr.op = WrOp::kAtomicAdd;
      wr.counter_index = counter_index;
      wr.add = int64_t(f.counter_value);
    }
    ++e.pending_wrs;
    t.ep->post(wr);
    t.stats.bump(t.stats.atomics);
  }
  t.flow->on_post(fs.channel, e.bytes);
}

// The next piece of WRITE `e`: at most the in-flight byte limit (FlowControl::piece_bytes), one piece in flight at a
// time, so a command larger than the limit never has more than the limit in flight. Only the last piece carries the
// counter update or the LL tag; earlier pieces are ordinary writes of the same FIFO (HT: each with its sequence
// number; LL on an ordered transport: plain writes that land before the last piece).
void Proxy::Impl::post_write_piece(Thread& t, FifoState& fs, Entry& e) {
  const TransferCmdFields& f = e.f;
  const int dst = int(f.dst_rank);
  const uint64_t piece = t.flow->piece_bytes(f.bytes - e.sent);
  const bool last = e.sent + piece == f.bytes;
  const bool ll = (f.flags & kCmdFlagLL) != 0;
  const bool phase = (f.flags & kCmdFlagPhase) != 0;
  const bool counter = last && (f.flags & kCmdFlagCounter) != 0;
  if (ll && !last && !caps.ordered)
    UCCL_THROW(kInvalidUsage, "FIFO %d command %llu (%s): an LL write larger than the in-flight byte limit (%lld) "
               "cannot be split on the unordered %s transport; raise UCCL_MOE_MAX_INFLIGHT_BYTES", fs.global_idx,
               (unsigned long long)e.idx, describe(f).c_str(), (long long)t.flow->max_inflight_bytes(),
               transport->name());
  WorkRequest wr;
  wr.wr_id = wr_id_of(fs, e.idx);
  wr.peer = dst;
  wr.local_offset = f.src_offset + e.sent;
  wr.remote_offset = f.dst_offset + e.sent;
  wr.bytes = uint32_t(piece);
  if ((software_atomics || ll) && (last || !ll)) {  // LL: with immediate in both modes (see post_cmd)
    const uint32_t seq = ll ? 0 : t.next_seq[size_t(dst) * t.fifos.size() + size_t(fs.channel)]++;
    wr.op = WrOp::kWriteImm;
    wr.imm = ll ? encode_imm_ll(false, phase, f.counter_slot, 0)
                : encode_imm_ht(counter, uint32_t(fs.channel), seq, f.counter_slot, f.counter_value);
  } else {
    wr.op = WrOp::kWrite;
  }
  ++e.pending_wrs;
  t.ep->post(wr);
  if (!software_atomics && !ll && counter) {  // ordered transport: the add lands after the write
    WorkRequest a;
    a.wr_id = wr.wr_id;
    a.op = WrOp::kAtomicAdd;
    a.peer = dst;
    a.counter_index = uint32_t(opt.rank) * kCountersPerSrc + f.counter_slot;
    a.add = f.counter_value;
    ++e.pending_wrs;
    t.ep->post(a);
  }
  e.sent += piece;
  e.bytes = piece;
  t.flow->on_post(fs.channel, piece);
  const uint64_t peak = uint64_t(t.flow->peak_bytes());
  if (peak > t.stats.peak_inflight_bytes.load(std::memory_order_relaxed))
    t.stats.peak_inflight_bytes.store(peak, std::memory_order_relaxed);
}

bool Proxy::Impl::post_new(Thread& t) {
  bool any = false;
  // One clock read per pass, not per command: `posted` only feeds the timeout (seconds).
  Clock::time_point now{};
  bool have_now = false;
  for (FifoState* fs : t.fifos) {
    for (int budget = kPostBudgetPerFifo; budget > 0; --budget) {
      if (!fs->inflight.empty()) {
        // A WRITE larger than the byte limit: its next piece once the previous one completed and the bytes fit;
        // later commands of the FIFO wait behind it.
        Entry& last = fs->inflight.back();
        if (last.f.op == CmdOp::kWrite && last.sent < last.f.bytes) {
          if (last.pending_wrs > 0 || !t.flow->admit_piece(t.flow->piece_bytes(last.f.bytes - last.sent))) break;
          last.posted = Clock::now();
          post_write_piece(t, *fs, last);
          any = true;
          continue;
        }
        // A QUIET or BARRIER not yet retired fences everything after it.
        const CmdOp back = fs->inflight.back().f.op;
        if (back == CmdOp::kQuiet || back == CmdOp::kBarrier) break;
      }
      if (fs->cursor - fs->retired >= fs->fifo->capacity()) break;
      TransferCmd raw;
      if (!fs->fifo->poll(fs->cursor, &raw)) break;
      TransferCmdFields f = decode(raw);
      const bool data_op = f.op == CmdOp::kWrite || f.op == CmdOp::kAtomic;
      if (data_op) {
        // Window: the oldest incomplete command of the FIFO is the front of `inflight` (retire() ran first).
        const uint64_t oldest = fs->inflight.empty() ? fs->cursor : fs->retired;
        const uint64_t bytes = f.op == CmdOp::kWrite ? f.bytes : 0;
        if (!t.flow->admit(fs->channel, fs->cursor, oldest, bytes)) {
          t.stats.bump(t.stats.stalls);
          break;
        }
        t.flow->note_window(fs->cursor - oldest + 1);
        const uint64_t w = uint64_t(t.flow->peak_window());
        if (w > t.stats.peak_inflight_window.load(std::memory_order_relaxed))
          t.stats.peak_inflight_window.store(w, std::memory_order_relaxed);
      } else if (f.op != CmdOp::kQuiet && f.op != CmdOp::kBarrier) {
        UCCL_THROW(kTransport, "FIFO %d command %llu has invalid op %d (word0=0x%016llx word1=0x%016llx)",
                   fs->global_idx, (unsigned long long)fs->cursor, int(f.op), (unsigned long long)raw.word0,
                   (unsigned long long)raw.word1);
      }
      fs->inflight.emplace_back();
      Entry& e = fs->inflight.back();
      e.f = f;
      e.idx = fs->cursor;
      if (!have_now) {
        now = Clock::now();
        have_now = true;
      }
      e.posted = now;
      ++fs->cursor;
      if (data_op) post_cmd(t, *fs, e);
      any = true;
    }
  }
  return any;
}

void Proxy::Impl::check_timeouts(Thread& t) {
  const double limit = opt.timeout_s;
  for (FifoState* fs : t.fifos) {
    if (fs->inflight.empty()) continue;
    const Entry& e = fs->inflight.front();
    const double waited = seconds_since(e.posted);
    if (waited <= limit) continue;
    DiagRecord r{1, opt.rank, int32_t(e.f.dst_rank), fs->global_idx, int32_t(DiagPhase::kProxyCompletion), 5,
                 int64_t(e.idx), int64_t(fs->retired), encode(e.f).word0, waited, 0};
    if (e.f.op == CmdOp::kBarrier) {
      std::string missing;
      const int kind = (e.f.flags & kCmdFlagSameRail) ? 1 : 0;
      for (int p : barrier_peers[kind])
        if (t.barrier_seen[kind][size_t(p)] < e.epoch)
          missing += (missing.empty() ? "" : ",") + std::to_string(p);
      r.peer = -1;
      r.phase = int32_t(DiagPhase::kBarrier);
      UCCL_THROW(kTimeout, "%s; %s: BARRIER epoch %llu of FIFO %d still waits for ranks [%s]", format_diag(r).c_str(),
                 who(t).c_str(), (unsigned long long)e.epoch, fs->global_idx, missing.c_str());
    }
    UCCL_THROW(kTimeout, "%s; %s: lost command: FIFO %d command %llu (%s) posted %.1f s ago has %d unfinished work "
               "request(s) (dropped by the network or the peer is dead)", format_diag(r).c_str(), who(t).c_str(),
               fs->global_idx, (unsigned long long)e.idx, describe(e.f).c_str(), waited, e.pending_wrs);
  }
  if (t.order->num_held() > 0 && seconds_since(t.held_since) > limit) {
    int src = -1, channel = 0;
    uint64_t want = 0, held = 0;
    t.order->describe_held(&src, &channel, &want, &held);
    DiagRecord r{1, opt.rank, src, channel, int32_t(DiagPhase::kProxyOrdering), 5, int64_t(want), int64_t(held), 0,
                 seconds_since(t.held_since), 0};
    if (channel >= 0)
      UCCL_THROW(kTimeout, "%s; %s: a counter update of channel %d from rank %d (seq %llu) is held because write seq "
                 "%llu never landed", format_diag(r).c_str(), who(t).c_str(), channel, src,
                 (unsigned long long)held, (unsigned long long)want);
    UCCL_THROW(kTimeout, "%s; %s: LL fence of group %d from rank %d waits for %llu writes, %llu landed",
               format_diag(r).c_str(), who(t).c_str(), -1 - channel, src, (unsigned long long)want,
               (unsigned long long)held);
  }
}

// ---- Proxy ----

Proxy::Proxy(const ProxyOptions& options, std::shared_ptr<KvStore> store) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = options;
  m.store = std::move(store);
  ProxyOptions& o = m.opt;
  UCCL_ASSERT(m.store != nullptr, "a bootstrap store is required");
  UCCL_ASSERT(o.num_ranks >= 1 && o.num_ranks <= int(kCmdMaxRanks), "num_ranks=%d must be in [1, %u]", o.num_ranks,
              kCmdMaxRanks);
  UCCL_ASSERT(o.rank >= 0 && o.rank < o.num_ranks, "rank=%d must be in [0, num_ranks=%d)", o.rank, o.num_ranks);
  if (o.num_threads <= 0) o.num_threads = int(env::PROXY_THREADS());
  if (o.fifos_per_thread <= 0) o.fifos_per_thread = int(env::PROXY_FIFOS_PER_THREAD());
  if (o.fifo_capacity <= 0) o.fifo_capacity = int(env::FIFO_CAPACITY());
  if (o.timeout_s <= 0) o.timeout_s = env::TIMEOUT_S();
  if (o.transport.empty()) o.transport = env::TRANSPORT();
  if (o.cpus.empty()) o.cpus = "none";
  else if (o.cpus == "-") o.cpus = env::PROXY_CPUS();
  if (o.ranks_per_node <= 0) o.ranks_per_node = o.num_ranks;
  UCCL_ASSERT(o.fifos_per_thread >= 1 && o.fifos_per_thread <= kImmMaxChannels,
              "fifos_per_thread=%d must be in [1, %d] (3-bit channel field of the immediate)", o.fifos_per_thread,
              kImmMaxChannels);
  UCCL_ASSERT(o.data_bytes > 0, "data_bytes must be > 0");
  if (o.local_rank < 0) o.local_rank = o.rank % o.ranks_per_node;
  const detail::ProxyCpuSpec cpu_spec = detail::proxy_cpus_for_rank(o.cpus, o.local_rank);  // fails before resources
  for (int p = 0; p < o.num_ranks; ++p) {
    if (p == o.rank) continue;
    m.barrier_peers[0].push_back(p);
    if (p % o.ranks_per_node == o.rank % o.ranks_per_node) m.barrier_peers[1].push_back(p);  // same rail
  }

  TransportContext ctx;
  ctx.rank = o.rank;
  ctx.num_ranks = o.num_ranks;
  ctx.num_threads = o.num_threads;
  ctx.job = o.job;
  ctx.timeout_s = o.timeout_s;
  ctx.gpu = o.gpu_data ? o.gpu : nullptr;
  ctx.verbs = o.verbs;
  ctx.gpu_pci_bus_id = o.gpu_pci_bus_id;
  ctx.local_rank = o.local_rank;
  m.transport = create_transport(o.transport, ctx);
  {
    // Auto: the NIC's NUMA node, within the CPUs this process may use (a Slurm or container cpuset).
    std::vector<int> allowed;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) allowed.push_back(c);
    const detail::ProxyPinning pin = detail::plan_proxy_pinning(cpu_spec, m.transport->nic().numa_cpus, allowed);
    m.cpus = pin.cpus;
    m.pin_numa = pin.whole_set;
    if (!pin.note.empty() && cpu_spec.mode == detail::ProxyCpuSpec::Mode::kAuto && !m.transport->nic().devices.empty())
      UCCL_LOG(WARN, PROXY, "proxy threads not pinned: %s (UCCL_MOE_PROXY_CPUS)", pin.note.c_str());
  }
  m.caps = m.transport->caps();
  // Flow-control limits: options, knobs, then the NIC family's defaults (flow_control.hpp).
  const FlowLimits fl = resolve_flow_limits(o.max_inflight_bytes, o.max_inflight_writes, m.caps.nic_family,
                                            o.num_threads);
  o.max_inflight_bytes = fl.max_inflight_bytes;
  o.max_inflight_writes = fl.max_inflight_writes;
  UCCL_ASSERT(o.max_inflight_writes >= 1, "max_inflight_writes=%lld must be >= 1", (long long)o.max_inflight_writes);
  UCCL_LOG(INFO, PROXY, "rank %d: flow control %lld bytes in flight per thread (%s), %lld writes per FIFO (%s)",
           o.rank, (long long)o.max_inflight_bytes, fl.bytes_source.c_str(), (long long)o.max_inflight_writes,
           fl.writes_source.c_str());
  m.software_atomics = !(m.caps.native_atomics && m.caps.ordered);
  if (m.software_atomics) {
    const uint64_t need = 2 * uint64_t(o.max_inflight_writes) + m.caps.recv_depth;
    UCCL_ASSERT(need <= kImmSeqSpace,
                "2 * UCCL_MOE_MAX_INFLIGHT_WRITES (%lld) + receive depth (%u) = %llu exceeds the %u sequence numbers "
                "of the immediate; lower UCCL_MOE_MAX_INFLIGHT_WRITES", (long long)o.max_inflight_writes,
                m.caps.recv_depth, (unsigned long long)need, kImmSeqSpace);
  }

  // Memory: data region and counters.
  if (o.data_ptr) {
    m.data = o.data_ptr;
  } else {
    m.data = m.transport->allocate(MemoryKind::kData, o.data_bytes);
    if (!m.data) {
      m.data = std::aligned_alloc(4096, (o.data_bytes + 4095) / 4096 * 4096);
      UCCL_CHECK_INTERNAL(m.data != nullptr, "allocating %llu bytes", (unsigned long long)o.data_bytes);
      std::memset(m.data, 0, o.data_bytes);
      m.own_data = true;
    }
  }
  m.num_counters = uint64_t(o.num_ranks) * kCountersPerSrc;
  const size_t counter_bytes = m.num_counters * sizeof(int64_t);
  if (o.gpu) {
    // Kernels poll the counters: pinned host memory the GPU maps (the proxy applies software atomics there).
    void* dev = nullptr;
    m.counters = static_cast<int64_t*>(o.gpu->alloc_mapped(counter_bytes, &dev));
    UCCL_CHECK_INTERNAL(m.counters != nullptr, "allocating mapped counters");
    m.counters_dev = static_cast<int64_t*>(dev);
  } else {
    m.counters = static_cast<int64_t*>(m.transport->allocate(MemoryKind::kCounters, counter_bytes));
  }
  if (!m.counters) {
    m.counters = static_cast<int64_t*>(std::aligned_alloc(4096, (counter_bytes + 4095) / 4096 * 4096));
    UCCL_CHECK_INTERNAL(m.counters != nullptr, "allocating counters");
    m.own_counters = true;
  }
  std::memset(m.counters, 0, counter_bytes);
  m.transport->register_memory(MemoryKind::kData, m.data, o.data_bytes);
  m.transport->register_memory(MemoryKind::kCounters, m.counters, counter_bytes);

  // FIFOs and threads: FIFO g belongs to thread g % T, as channel g / T of that thread.
  const int num_fifos = o.num_threads * o.fifos_per_thread;
  for (int t = 0; t < o.num_threads; ++t) {
    auto th = std::make_unique<Impl::Thread>();
    th->idx = t;
    th->flow = std::make_unique<FlowControl>(o.fifos_per_thread, o.max_inflight_bytes, o.max_inflight_writes);
    th->order = std::make_unique<OrderingEngine>(o.num_ranks, o.fifos_per_thread);
    th->next_seq.assign(size_t(o.num_ranks) * o.fifos_per_thread, 0);
    th->barrier_seen[0].assign(size_t(o.num_ranks), 0);
    th->barrier_seen[1].assign(size_t(o.num_ranks), 0);
    th->ep = m.transport->create_endpoint(t);
    m.threads.push_back(std::move(th));
  }
  for (int g = 0; g < num_fifos; ++g) {
    auto fs = std::make_unique<FifoState>(size_t(o.fifo_capacity));
    fs->fifo = std::make_unique<Fifo>(uint32_t(o.fifo_capacity), g, o.gpu);
    fs->global_idx = g;
    fs->channel = g / o.num_threads;
    m.threads[size_t(g % o.num_threads)]->fifos.push_back(fs.get());
    m.fifos.push_back(std::move(fs));
  }
  UCCL_LOG(INFO, PROXY, "rank %d: proxy with %d threads x %d FIFOs (capacity %d) over %s (%s atomics)", o.rank,
           o.num_threads, o.fifos_per_thread, o.fifo_capacity, m.transport->name(),
           m.software_atomics ? "software" : "native");
}

Proxy::~Proxy() {
  try {
    stop();
  } catch (const std::exception& e) {
    UCCL_LOG(WARN, PROXY, "proxy stopped with an error: %s", e.what());
  }
  impl_->threads.clear();  // endpoints before the transport
  impl_->transport.reset();
  if (impl_->own_data) std::free(impl_->data);
  if (impl_->own_counters) std::free(impl_->counters);
  if (impl_->counters_dev && impl_->opt.gpu) impl_->opt.gpu->free_mapped(impl_->counters);
}

void Proxy::start() {
  Impl& m = *impl_;
  UCCL_ASSERT(!m.started.load(), "proxy already started");
  for (auto& t : m.threads) t->ep->connect(*m.store);
  for (auto& t : m.threads)
    for (int p = 0; p < m.opt.num_ranks; ++p)
      if (p != m.opt.rank && !t->ep->can_reach(p))  // RC has no QP to itself; nothing sends to its own rank
        UCCL_THROW(kTransport, "proxy thread %d of rank %d: %s cannot reach rank %d", t->idx, m.opt.rank,
                   m.transport->name(), p);
  m.stop_flag.store(false);
  m.started.store(true);
  for (auto& t : m.threads) {
    Impl::Thread* tp = t.get();
    t->th = std::thread([&m, tp] { m.run(*tp); });
  }
}

void Proxy::stop() {
  Impl& m = *impl_;
  if (m.started.exchange(false)) {
    m.stop_flag.store(true, std::memory_order_release);
    for (auto& t : m.threads)
      if (t->th.joinable()) t->th.join();
  }
  m.check();
}

bool Proxy::running() const { return impl_->started.load(); }
void Proxy::check() const { impl_->check(); }
int Proxy::num_threads() const { return impl_->opt.num_threads; }
int Proxy::num_fifos() const { return int(impl_->fifos.size()); }

Fifo& Proxy::fifo(int idx) {
  UCCL_ASSERT(idx >= 0 && idx < num_fifos(), "fifo index %d must be in [0, %d)", idx, num_fifos());
  return *impl_->fifos[size_t(idx)]->fifo;
}

uint64_t Proxy::push(int fifo_idx, const TransferCmdFields& cmd) {
  Fifo& f = fifo(fifo_idx);
  UCCL_ASSERT(cmd.dst_rank < uint32_t(impl_->opt.num_ranks) || cmd.op == CmdOp::kQuiet || cmd.op == CmdOp::kBarrier,
              "dst_rank=%u must be < num_ranks=%d", cmd.dst_rank, impl_->opt.num_ranks);
  const TransferCmd c = encode_checked(cmd);
  impl_->check();
  return f.push(c, impl_->opt.timeout_s, &impl_->abort_flag,
                [](const void* p) { static_cast<const Impl*>(p)->check(); }, impl_.get());
}

void Proxy::wait(int fifo_idx, uint64_t idx) {
  Fifo& f = fifo(fifo_idx);
  const auto start = Clock::now();
  uint32_t spins = 0;
  while (!f.check_completion(idx)) {
    impl_->check();
    if ((++spins & 63u) == 0) {
      const double waited = seconds_since(start);
      // Twice the proxy's limit: a lost command is reported by the proxy thread itself first, with its diagnostic.
      if (waited > 2 * impl_->opt.timeout_s) {
        DiagRecord r{1, impl_->opt.rank, -1, fifo_idx, int32_t(DiagPhase::kFifoCompletion), 0, int64_t(idx + 1),
                     int64_t(f.tail()), 0, waited, 0};
        UCCL_THROW(kTimeout, "%s (proxy %s)", format_diag(r).c_str(), impl_->started ? "running" : "not started");
      }
      std::this_thread::yield();
    }
  }
  impl_->check();
}

void* Proxy::data() const { return impl_->data; }
uint64_t Proxy::data_bytes() const { return impl_->opt.data_bytes; }
int64_t* Proxy::counters() const { return impl_->counters; }
int64_t* Proxy::counters_device() const { return impl_->counters_dev ? impl_->counters_dev : impl_->counters; }
uint64_t Proxy::num_counters() const { return impl_->num_counters; }
const std::atomic<int32_t>& Proxy::abort_flag() const { return impl_->abort_flag; }
std::string Proxy::transport_name() const { return impl_->transport->name(); }
const ProxyOptions& Proxy::options() const { return impl_->opt; }
TransportNic Proxy::nic() const { return impl_->transport->nic(); }
std::vector<int> Proxy::pinned_cpus() const { return impl_->cpus; }

std::vector<ProxyCounters> Proxy::thread_counters() const {
  std::vector<ProxyCounters> out;
  for (const auto& t : impl_->threads) out.push_back(t->stats.snapshot());
  return out;
}

ProxyCounters Proxy::counters_total() const {
  ProxyCounters s;
  for (const ProxyCounters& c : thread_counters()) {
    s.commands += c.commands;
    s.writes += c.writes;
    s.atomics += c.atomics;
    s.bytes += c.bytes;
    s.recv_imms += c.recv_imms;
    s.reorders += c.reorders;
    s.held_updates += c.held_updates;
    s.applied_updates += c.applied_updates;
    s.stalls += c.stalls;
    s.barriers += c.barriers;
    s.peak_inflight_bytes = std::max(s.peak_inflight_bytes, c.peak_inflight_bytes);
    s.peak_inflight_window = std::max(s.peak_inflight_window, c.peak_inflight_window);
  }
  return s;
}

}  // namespace uccl_moe
