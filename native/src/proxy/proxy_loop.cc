// The proxy thread loop: poll completions (retire sends, feed immediates to the ordering engine), retire finished
// FIFO commands in order, then read and post new ones (proxy_post.cc).
#include <pthread.h>
#include <sched.h>

#include <cstdio>

#include "proxy_impl.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe {

using detail::AtomicCounters;
using detail::Clock;

namespace {
constexpr uint32_t kSpinsBeforeYield = 64;     ///< idle loops that keep polling before giving the core away
constexpr uint32_t kYieldsBeforeSleep = 20000; ///< then yields, then short sleeps (a 2-core host runs several proxies)
constexpr auto kIdleSleep = std::chrono::microseconds(50);
constexpr uint32_t kTimeoutCheckEvery = 256;   ///< busy loops between watchdog passes (it reads the clock)
}  // namespace

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
    const std::string what =
        pin_numa ? "the NIC's NUMA node CPUs" : detail::format("CPU %d", cpus[size_t(t.idx) % cpus.size()]);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
      UCCL_LOG(WARN, PROXY, "%s: cannot pin to %s (UCCL_MOE_PROXY_CPUS)", who(t).c_str(), what.c_str());
    else
      UCCL_LOG(INFO, PROXY, "%s pinned to %s", who(t).c_str(), what.c_str());
  }
  try {
    std::vector<Completion> comps;
    comps.reserve(detail::kPollBatch);
    uint32_t idle = 0, iter = 0;
    t.held_since = Clock::now();
    while (!stop_flag.load(std::memory_order_acquire)) {
      if (abort_flag.load(std::memory_order_acquire)) return;  // another thread failed
      bool busy = poll_completions(t, comps);
      busy |= retire(t);
      busy |= post_new(t);
      t.ep->flush();
      if (++iter % kTimeoutCheckEvery == 0) check_timeouts(t);
      if (busy) {
        idle = 0;
      } else if (++idle > kSpinsBeforeYield) {  // idle: latency while busy is unaffected
        // A yield or sleep can last milliseconds on a loaded host, so an idle thread runs the watchdog on every
        // pass: its deadlines then follow the clock, not a loop count.
        check_timeouts(t);
        if (idle > kYieldsBeforeSleep)
          std::this_thread::sleep_for(kIdleSleep);
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

Proxy::Impl::Entry& Proxy::Impl::entry_of(FifoState& fs, uint64_t idx) {
  UCCL_CHECK_INTERNAL(idx >= fs.retired && idx < fs.cursor, "completion for FIFO %d command %llu outside [%llu, %llu)",
                      fs.global_idx, (unsigned long long)idx, (unsigned long long)fs.retired,
                      (unsigned long long)fs.cursor);
  return fs.inflight[size_t(idx - fs.retired)];
}

void Proxy::Impl::on_data_imm(Thread& t, const Completion& c) {
  bool reordered = false;
  t.order->on_imm(c.peer, c.imm,
                  [&](int src, uint32_t slot, int64_t value) {
                    // Release: the data of every write this update covers landed before (ordering engine).
                    __atomic_fetch_add(&counters[size_t(src) * kCountersPerSrc + slot], value, __ATOMIC_RELEASE);
                    AtomicCounters::bump(t.stats.applied_updates);
                  },
                  &reordered);
  if (reordered) AtomicCounters::bump(t.stats.reorders);
  const size_t held = t.order->num_held();
  if (held > t.last_held) AtomicCounters::bump(t.stats.held_updates, held - t.last_held);
  // The hold clock restarts when updates start being held or a held one is released (no clock read while nothing is
  // held: the common case, one immediate per command).
  if (held > 0 && (held < t.last_held || t.last_held == 0)) t.held_since = Clock::now();
  t.last_held = held;
}

bool Proxy::Impl::poll_completions(Thread& t, std::vector<Completion>& comps) {
  comps.clear();
  const int n = t.ep->poll(comps, detail::kPollBatch);
  for (const Completion& c : comps) {
    if (c.kind == CompletionKind::kRecvImm) {
      AtomicCounters::bump(t.stats.recv_imms);
      const detail::Imm m = detail::decode_imm(c.imm);
      if (m.kind != detail::ImmKind::kControl) {
        on_data_imm(t, c);
      } else if (m.control == detail::ImmControlOp::kBarrier) {
        on_barrier_imm(t, m, c.peer);
      } else {
        UCCL_THROW(kTransport, "control immediate 0x%08x from rank %d has unknown op", c.imm, c.peer);
      }
      continue;
    }
    const int local = int(c.wr_id >> detail::kWrIdCmdBits);
    const uint64_t idx = c.wr_id & ((1ull << detail::kWrIdCmdBits) - 1);
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
        AtomicCounters::bump(t.stats.barriers);
      }
      if (!e.done) break;
      fs->inflight.pop_front();
      fs->fifo->pop();
      ++fs->retired;
      AtomicCounters::bump(t.stats.commands);
      any = true;
    }
  }
  return any;
}

}  // namespace uccl_moe
