// The CPU proxy's lifecycle: options resolved against the knobs, the transport, threads and FIFOs, start/stop, the
// first-error slot every thread reports into, and the host producer's push/wait. Layout of the other files:
// proxy_impl.hpp.
#include "uccl_moe/proxy.hpp"

#include <sched.h>

#include <cstdio>

#include "proxy_impl.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/env.hpp"
#include "transport/nic_select.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe {

namespace {

/// Sets every option the caller left unset from its knob (each knob read here, once per proxy) and checks them.
void resolve_options(ProxyOptions& o, Timeout& timeout) {
  UCCL_ASSERT(o.num_ranks >= 1 && o.num_ranks <= int(kCmdMaxRanks), "num_ranks=%d must be in [1, %u]", o.num_ranks,
              kCmdMaxRanks);
  UCCL_ASSERT(o.rank >= 0 && o.rank < o.num_ranks, "rank=%d must be in [0, num_ranks=%d)", o.rank, o.num_ranks);
  if (!o.num_threads) o.num_threads = int(env::PROXY_THREADS());
  if (!o.fifos_per_thread) o.fifos_per_thread = int(env::PROXY_FIFOS_PER_THREAD());
  if (!o.fifo_capacity) o.fifo_capacity = int(env::FIFO_CAPACITY());
  // max_inflight_bytes / _writes: resolved once the transport names its NIC family (resolve_flow_limits).
  timeout = Timeout::resolve(o.timeout_s);
  o.timeout_s = timeout.limit_s;
  if (!o.transport) o.transport = env::TRANSPORT();
  if (!o.cpus) o.cpus = env::PROXY_CPUS();
  if (o.cpus->empty()) o.cpus = "none";
  if (!o.ranks_per_node) o.ranks_per_node = o.num_ranks;
  if (!o.local_rank) o.local_rank = o.rank % *o.ranks_per_node;
  UCCL_ASSERT(*o.num_threads >= 1, "num_threads=%d must be >= 1", *o.num_threads);
  UCCL_ASSERT(*o.fifos_per_thread >= 1 && *o.fifos_per_thread <= detail::kImmMaxChannels,
              "fifos_per_thread=%d must be in [1, %d] (3-bit channel field of the immediate)", *o.fifos_per_thread,
              detail::kImmMaxChannels);
  UCCL_ASSERT(*o.fifo_capacity >= 1, "fifo_capacity=%d must be >= 1", *o.fifo_capacity);
  UCCL_ASSERT(!o.max_inflight_bytes || *o.max_inflight_bytes >= 0,
              "max_inflight_bytes=%lld must be >= 0 (0 = unlimited)", (long long)o.max_inflight_bytes.value_or(0));
  UCCL_ASSERT(!o.max_inflight_writes || *o.max_inflight_writes >= 1, "max_inflight_writes=%lld must be >= 1",
              (long long)o.max_inflight_writes.value_or(1));
  UCCL_ASSERT(*o.ranks_per_node >= 1, "ranks_per_node=%d must be >= 1", *o.ranks_per_node);
  UCCL_ASSERT(o.data_bytes > 0, "data_bytes must be > 0");
}

}  // namespace

void Proxy::Impl::record_error(ErrorCode code, const std::string& msg) {
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

void Proxy::Impl::check() const {
  if (abort_flag.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lock(err_mu);
  throw Error(err_code, err_msg);
}

std::string Proxy::Impl::who(const Thread& t) const {
  return detail::format("proxy thread %d of rank %d (%s)", t.idx, opt.rank, transport->name());
}

Proxy::Proxy(const ProxyOptions& options, std::shared_ptr<KvStore> store) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = options;
  m.store = std::move(store);
  ProxyOptions& o = m.opt;
  UCCL_ASSERT(m.store != nullptr, "a bootstrap store is required");
  resolve_options(o, m.timeout);
  const detail::ProxyCpuSpec cpu_spec = detail::proxy_cpus_for_rank(*o.cpus, *o.local_rank);  // fails before resources
  m.setup_barrier_peers();

  TransportContext ctx(m.timeout);
  ctx.rank = o.rank;
  ctx.num_ranks = o.num_ranks;
  ctx.num_threads = *o.num_threads;
  ctx.job = o.job;
  ctx.gpu = o.gpu_data ? o.gpu : nullptr;
  ctx.verbs = o.verbs;
  ctx.gpu_pci_bus_id = o.gpu_pci_bus_id;
  ctx.local_rank = *o.local_rank;
  m.transport = create_transport(*o.transport, ctx);
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
  const FlowLimits fl = resolve_flow_limits(o.max_inflight_bytes.value_or(-1), o.max_inflight_writes.value_or(-1),
                                            m.caps.nic_family, *o.num_threads);
  o.max_inflight_bytes = fl.max_inflight_bytes;
  o.max_inflight_writes = fl.max_inflight_writes;
  UCCL_ASSERT(*o.max_inflight_writes >= 1, "max_inflight_writes=%lld must be >= 1", (long long)*o.max_inflight_writes);
  UCCL_LOG(INFO, PROXY, "rank %d: flow control %lld bytes in flight per thread (%s), %lld writes per FIFO (%s)",
           o.rank, (long long)*o.max_inflight_bytes, fl.bytes_source.c_str(), (long long)*o.max_inflight_writes,
           fl.writes_source.c_str());
  m.software_atomics = !(m.caps.native_atomics && m.caps.ordered);
  if (m.software_atomics) {
    const uint64_t need = 2 * uint64_t(*o.max_inflight_writes) + m.caps.recv_depth;
    UCCL_ASSERT(need <= detail::kImmSeqSpace,
                "2 * UCCL_MOE_MAX_INFLIGHT_WRITES (%lld) + receive depth (%u) = %llu exceeds the %u sequence numbers "
                "of the immediate; lower UCCL_MOE_MAX_INFLIGHT_WRITES", (long long)*o.max_inflight_writes,
                m.caps.recv_depth, (unsigned long long)need, detail::kImmSeqSpace);
  }
  m.setup_memory();

  // FIFOs and threads: FIFO g belongs to thread g % T, as channel g / T of that thread.
  const int num_threads = *o.num_threads, fifos_per_thread = *o.fifos_per_thread, capacity = *o.fifo_capacity;
  const int num_fifos = num_threads * fifos_per_thread;
  for (int t = 0; t < num_threads; ++t) {
    auto th = std::make_unique<Impl::Thread>();
    th->idx = t;
    th->flow = std::make_unique<FlowControl>(fifos_per_thread, *o.max_inflight_bytes, *o.max_inflight_writes);
    th->order = std::make_unique<detail::OrderingEngine>(o.num_ranks, fifos_per_thread);
    th->next_seq.assign(size_t(o.num_ranks) * fifos_per_thread, 0);
    for (auto& seen : th->barrier_seen) seen.assign(size_t(o.num_ranks), 0);
    th->ep = m.transport->create_endpoint(t);
    m.threads.push_back(std::move(th));
  }
  for (int g = 0; g < num_fifos; ++g) {
    auto fs = std::make_unique<detail::FifoState>(size_t(capacity));
    fs->fifo = std::make_unique<Fifo>(uint32_t(capacity), g, o.gpu);
    fs->global_idx = g;
    fs->channel = g / num_threads;
    m.threads[size_t(g % num_threads)]->fifos.push_back(fs.get());
    m.fifos.push_back(std::move(fs));
  }
  UCCL_LOG(INFO, PROXY, "rank %d: proxy with %d threads x %d FIFOs (capacity %d) over %s (%s atomics)", o.rank,
           num_threads, fifos_per_thread, capacity, m.transport->name(),
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
  impl_->free_memory();
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
int Proxy::num_threads() const { return *impl_->opt.num_threads; }
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
  return f.push(c, impl_->timeout.limit_s, &impl_->abort_flag,
                [](const void* p) { static_cast<const Impl*>(p)->check(); }, impl_.get());
}

void Proxy::wait(int fifo_idx, uint64_t idx) {
  Fifo& f = fifo(fifo_idx);
  const auto start = detail::Clock::now();
  uint32_t spins = 0;
  while (!f.check_completion(idx)) {
    impl_->check();
    if ((++spins & 63u) == 0) {
      const double waited = detail::seconds_since(start);
      if (waited > impl_->timeout.caller_behind_proxy_s()) {
        const DiagRecord r{.valid = 1, .rank = impl_->opt.rank, .peer = -1, .channel = fifo_idx,
                           .phase = DiagPhase::kFifoCompletion, .role = DiagRole::kHost,
                           .expected = int64_t(idx + 1), .seen = int64_t(f.tail()), .waited_s = waited};
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
const Timeout& Proxy::timeout() const { return impl_->timeout; }

}  // namespace uccl_moe
