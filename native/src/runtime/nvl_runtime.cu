#include "nvl_runtime.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "uccl_moe/config.hpp"
#include "uccl_moe/device_query.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"
#include "../kernels/intranode/nvl_layout.hpp"
#include "uccl_moe/diag_device.cuh"
#include "uccl_moe/gpu_check.cuh"

namespace uccl_moe::runtime {

namespace {
// Host-mapped block layout (bytes). The record sits first so its 64 bytes share no line with counters.
constexpr size_t kHostOffDiag = 0;
constexpr size_t kHostOffAbort = 128;
constexpr size_t kHostOffTopkFault = 192;  // TopkFault, 32 bytes
constexpr size_t kHostOffRecvCounter = 256;
constexpr size_t kHostOffExpertCounters = 1024;
static_assert(kHostOffRecvCounter + sizeof(int32_t) * (intranode::kRecvCounterRankTokens + kMaxLocalRanks) <=
                  kHostOffExpertCounters,
              "recv_counter[] (counts, the rank prefix matrix, the ranks' tokens) overlaps the expert counters");
constexpr size_t kHostBytes = kHostOffExpertCounters + sizeof(int32_t) * kMaxExpertsPerRank;
static_assert(kHostOffDiag + sizeof(DiagRecord) <= kHostOffAbort && kHostOffTopkFault + sizeof(TopkFault) <= kHostOffRecvCounter,
              "host-mapped records overlap");

}  // namespace

namespace {

/// After a side memset (NvlRuntime::note_op), on the side stream behind the count writes: thread d waits, bounded,
/// until peer d's count of side memsets (its sentinel_ready word in our meta) reached ours. Where it does not within
/// UCCL_MOE_TIMEOUT_S (d failed or stopped before its memset, or counts differently), it writes our count there,
/// which opens the gate of any copy stream of ours waiting for it (NvlRuntime::ce_copies), and the record names d
/// (`phase`: combine/ce-sentinel, or dispatch/ce-sentinel where the op the memset is for is a polled dispatch; the
/// abort flag is up, so the Buffer's next call raises). A copy stream's stream-memory wait
/// is unbounded and may hold work queued behind it (streams that share a hardware queue, as with
/// CUDA_DEVICE_MAX_CONNECTIONS=1, the op's own kernel among them), so this kernel, queued before any gated copy,
/// is what bounds it.
__global__ void ce_gate_watch_kernel(DiagDeviceHandle diag, int32_t* words, int num_ranks, int rank, int32_t count,
                                     DiagPhase phase) {
  const int d = static_cast<int>(threadIdx.x);
  if (d >= num_ranks || d == rank) return;
  if (!wait_reached(diag, words + d, count, phase, DiagRole::kSender, d, -1))
    gpu::store_release_sys(words + d, count);
}

}  // namespace

NvlRuntime::NvlRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, int device)
    : rank_(rank),
      num_ranks_(num_ranks),
      device_(device),
      timeout_(Timeout::resolve()),
      num_nvl_bytes_(num_nvl_bytes) {
  UCCL_ASSERT(num_ranks >= 1 && num_ranks <= kMaxLocalRanks, "num_ranks=%d: the intranode runtime serves 1..%d local ranks",
              num_ranks, kMaxLocalRanks);
  std::fill(next_kind_, next_kind_ + kNumOpKinds, -1);
  UCCL_ASSERT(rank >= 0 && rank < num_ranks, "rank=%d outside [0, %d)", rank, num_ranks);
  UCCL_ASSERT(num_nvl_bytes >= static_cast<int64_t>(kNvlMetaBytes) && num_nvl_bytes % kBufferAlignBytes == 0,
              "num_nvl_bytes=%lld must be a multiple of %zu and at least %zu (use Config.get_nvl_buffer_size_hint)",
              static_cast<long long>(num_nvl_bytes), kBufferAlignBytes, kNvlMetaBytes);
  UCCL_CHECK_GPU(gpu::set_device(device));
  UCCL_CHECK_GPU(gpu::device_malloc(&local_, static_cast<size_t>(num_nvl_bytes)));
  // Only the meta region must start at zero (barrier words, counters); rings are written before being read.
  UCCL_CHECK_GPU(gpu::memset_sync(local_, 0, kNvlMetaBytes));
  void* host = nullptr;
  UCCL_CHECK_GPU(gpu::host_alloc_mapped(&host, kHostBytes));
  host_ = static_cast<char*>(host);
  std::memset(host_, 0, kHostBytes);
  void* dev = nullptr;
  UCCL_CHECK_GPU(gpu::host_device_pointer(&dev, host_));
  host_dev_ = static_cast<char*>(dev);
  reset_recv_counter();
  UCCL_CHECK_GPU(gpu::device_synchronize());
  peers_[rank_] = local_;
  device_sms_ = device_sm_count(device);
  UCCL_LOG(INFO, MEM, "NVL buffer of %lld bytes at %p on device %d (local rank %d of %d)",
           static_cast<long long>(num_nvl_bytes), local_, device, rank, num_ranks);
}

NvlRuntime::~NvlRuntime() {
  try {
    destroy();
  } catch (const std::exception& e) {
    UCCL_LOG(WARN, MEM, "NvlRuntime destroy failed: %s", e.what());
  }
}

std::string NvlRuntime::ipc_handle() const {
  UCCL_ASSERT(!destroyed_, "the NVL runtime was destroyed");
  gpu::IpcMemHandle h;
  UCCL_CHECK_GPU(gpu::ipc_get_mem_handle(&h, local_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void NvlRuntime::connect(const std::vector<std::string>& handles) {
  UCCL_ASSERT(!destroyed_, "the NVL runtime was destroyed");
  UCCL_ASSERT(!connected_, "connect() called twice");
  UCCL_ASSERT(static_cast<int>(handles.size()) == num_ranks_, "got %zu IPC handles for %d local ranks",
              handles.size(), num_ranks_);
  UCCL_CHECK_GPU(gpu::set_device(device_));
  make_ce_streams();  // on our device (set above), so never inside a CUDA graph capture
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    UCCL_ASSERT(handles[r].size() == sizeof(gpu::IpcMemHandle), "IPC handle of rank %d has %zu bytes, expected %zu",
                r, handles[r].size(), sizeof(gpu::IpcMemHandle));
    gpu::IpcMemHandle h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    UCCL_CHECK_GPU(gpu::ipc_open_mem_handle(&peers_[r], h));
  }
  connected_ = true;
}

void NvlRuntime::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  // Best effort: keep freeing after a failure (a trapped context fails every call), but say so.
  auto warn = [](gpu::Error e, const char* what) {
    if (e != gpu::kSuccess) UCCL_LOG(WARN, MEM, "NvlRuntime::destroy: %s failed: %s", what, gpu::error_string(e));
  };
  warn(gpu::set_device(device_), "set_device");
  warn(gpu::device_synchronize(), "device_synchronize");  // our kernels finish before peers unmap us
  for (int r = 0; r < kMaxLocalRanks; ++r) {
    if (ce_streams_[r] != nullptr) warn(gpu::stream_destroy(static_cast<gpu::Stream>(ce_streams_[r])), "stream_destroy");
    if (ce_copied_[r] != nullptr) warn(gpu::event_destroy(static_cast<gpu::Event>(ce_copied_[r])), "event_destroy");
    ce_streams_[r] = ce_copied_[r] = nullptr;
  }
  if (ce_entered_ != nullptr) warn(gpu::event_destroy(static_cast<gpu::Event>(ce_entered_)), "event_destroy");
  ce_entered_ = nullptr;
  for (void** e : {&sentinel_after_, &sentinel_set_, &ce_end_after_, &ce_ended_}) {
    if (*e != nullptr) warn(gpu::event_destroy(static_cast<gpu::Event>(*e)), "event_destroy");
    *e = nullptr;
  }
  if (sentinel_stream_ != nullptr) warn(gpu::stream_destroy(static_cast<gpu::Stream>(sentinel_stream_)), "stream_destroy");
  sentinel_stream_ = nullptr;
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_ && peers_[r] != nullptr) warn(gpu::ipc_close_mem_handle(peers_[r]), "ipc_close_mem_handle");
  if (local_ != nullptr) warn(gpu::device_free(local_), "device_free");
  if (host_ != nullptr) warn(gpu::host_free(host_), "host_free");
  local_ = nullptr;
  host_ = host_dev_ = nullptr;
  for (auto& p : peers_) p = nullptr;
  connected_ = false;
}

void NvlRuntime::make_ce_streams() {
  gpu::Event e = nullptr;
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    gpu::Stream st = nullptr;
    UCCL_CHECK_GPU(gpu::stream_create_nonblocking(&st));
    ce_streams_[r] = st;
    UCCL_CHECK_GPU(gpu::event_create(&e));
    ce_copied_[r] = e;
  }
  UCCL_CHECK_GPU(gpu::event_create(&e));
  ce_entered_ = e;
  gpu::Stream st = nullptr;
  UCCL_CHECK_GPU(gpu::stream_create_nonblocking(&st));
  sentinel_stream_ = st;
  UCCL_CHECK_GPU(gpu::event_create(&e));
  sentinel_after_ = e;
  UCCL_CHECK_GPU(gpu::event_create(&e));
  sentinel_set_ = e;
  UCCL_CHECK_GPU(gpu::event_create(&e));
  ce_end_after_ = e;
  UCCL_CHECK_GPU(gpu::event_create(&e));
  ce_ended_ = e;
  // The gate of early polled ops (ce_copies) rests on stream memory operations: tried once on our own word (no peer
  // writes it), else polled ops are never early.
  void* own = intranode::sentinel_ready_word(local_, rank_);
  gate_ok_ = gpu::stream_write_u32(st, own, 0) == 0 && gpu::stream_wait_u32_geq(st, own, 0) == 0 &&
             gpu::is_success(gpu::stream_synchronize(st));
  if (!gate_ok_)
    UCCL_LOG(INFO, MEM, "no stream memory operations on device %d: polled copy-engine ops wait for an enter "
             "hand-shake", device_);
}

intranode::CeCopies NvlRuntime::ce_copies(const int32_t* rank_prefix_host, void* stream, bool early_wanted,
                                          bool polled, bool beside_wanted) {
  UCCL_ASSERT(!destroyed_, "the NVL runtime was destroyed; create a new Buffer");
  UCCL_ASSERT(connected_, "the NVL runtime is not connected to its peers yet");
  intranode::CeCopies c{};
  c.rank_prefix_host = rank_prefix_host;
  for (int r = 0; r < kMaxLocalRanks; ++r) {
    c.streams[r] = ce_streams_[r];
    c.copied[r] = ce_copied_[r];
  }
  c.entered = ce_entered_;
  // After a side memset no op is early (a peer's copies could land under it) unless it is a polled one behind the
  // gate: the memset after the op before is the last one every rank made (sentinel_seq_ of them).
  const bool gated = polled && gate_ok_ && sentinel_unfenced_ && !pre_set_ && sentinel_seq_ > 0;
  const bool early = early_wanted && after_done_ && (polled ? gated : !sentinel_unfenced_) && outside_graphs(stream);
  if (early) ++ce_early_ops_;
  c.early = early ? 1 : 0;
  c.gated = early && polled ? 1 : 0;
  c.gate = static_cast<int32_t>(static_cast<uint32_t>(sentinel_seq_));
  if (c.gated != 0) ++ce_gated_ops_;
#if defined(UCCL_MOE_HIP)
  beside_wanted = false;  // not run on an AMD GPU
#endif
  c.beside = beside_wanted && c.gated != 0 ? 1 : 0;
  c.end_stream = sentinel_stream_;
  c.end_after = ce_end_after_;
  c.ended = ce_ended_;
  if (c.beside != 0) ++ended_seq_;  // the op launches its end beside right after its kernel (launch_ce_end_beside)
  return c;
}

intranode::NvlContext NvlRuntime::context() const {
  UCCL_ASSERT(!destroyed_, "the NVL runtime was destroyed; create a new Buffer");
  UCCL_ASSERT(connected_, "the NVL runtime is not connected to its peers yet");
  intranode::NvlContext c{};
  for (int r = 0; r < kMaxLocalRanks; ++r) c.buffers[r] = peers_[r];
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.num_nvl_bytes = num_nvl_bytes_;
  c.recv_counter = reinterpret_cast<int32_t*>(host_dev_ + kHostOffRecvCounter);
  c.expert_counters = reinterpret_cast<int32_t*>(host_dev_ + kHostOffExpertCounters);
  c.diag_record = reinterpret_cast<DiagRecord*>(host_dev_ + kHostOffDiag);
  c.abort_flag = reinterpret_cast<int32_t*>(static_cast<char*>(local_) + intranode::kOffAbortFlag);
  c.timeout_ns = timeout_.limit_ns();
  c.diag_rank = global_rank_ >= 0 ? global_rank_ : rank_;
  return c;
}

void NvlRuntime::reset_recv_counter() {
  *reinterpret_cast<volatile int32_t*>(host_ + kHostOffRecvCounter) = -1;
}

bool NvlRuntime::aborted() const {
  if (host_ == nullptr) return false;
  return *reinterpret_cast<volatile int32_t*>(host_ + kHostOffAbort) != 0 ||
         reinterpret_cast<volatile DiagRecord*>(host_ + kHostOffDiag)->valid != 0;
}

DiagRecord NvlRuntime::diag() const {
  DiagRecord r{};
  if (host_ == nullptr) return r;
  // A GPU thread that claimed the record (kDiagRecordWriting) fills it in microseconds; read it once it released it
  // (a bounded wait: a context that died mid-write leaves what it wrote).
  const auto* valid = reinterpret_cast<const volatile int32_t*>(host_ + kHostOffDiag);
  const auto start = std::chrono::steady_clock::now();
  while (*valid == kDiagRecordWriting && std::chrono::steady_clock::now() - start < std::chrono::milliseconds(200))
    std::this_thread::yield();
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(&r, host_ + kHostOffDiag, sizeof(r));
  return r;
}

uintptr_t NvlRuntime::topk_fault_device() const {
  UCCL_ASSERT(!destroyed_, "the NVL runtime was destroyed; create a new Buffer");
  return reinterpret_cast<uintptr_t>(host_dev_ + kHostOffTopkFault);
}

TopkFault NvlRuntime::take_topk_fault() {
  TopkFault f{};
  if (host_ == nullptr) return f;
  auto* slot = reinterpret_cast<TopkFault*>(host_ + kHostOffTopkFault);
  if (reinterpret_cast<std::atomic<int32_t>*>(&slot->state)->load(std::memory_order_acquire) != 2) return f;
  std::memcpy(&f, slot, sizeof(f));
  // A fault a kernel records between the copy and this clear is lost; the first one is raised.
  reinterpret_cast<std::atomic<int32_t>*>(&slot->state)->store(0, std::memory_order_release);
  return f;
}

bool NvlRuntime::wait_recv_counts(int num_local_experts, int* num_recv, int* most_recv, int* most_remote,
                                  std::vector<int>* per_expert, std::vector<int>* rank_prefix,
                                  std::vector<int>* rank_tokens) {
  UCCL_ASSERT(num_local_experts >= 0 && num_local_experts <= kMaxExpertsPerRank,
              "num_local_experts=%d exceeds %d", num_local_experts, kMaxExpertsPerRank);
  volatile int32_t* counter = reinterpret_cast<volatile int32_t*>(host_ + kHostOffRecvCounter);
  const auto start = std::chrono::steady_clock::now();
  const double host_limit_s = timeout_.host_behind_device_s();  // the GPU's record (naming the peer) comes first
  uint64_t polls = 0;
  while (*counter < 0) {
    if (aborted()) return false;
    if ((++polls & 1023u) == 0) {
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > host_limit_s) {
        auto* rec = reinterpret_cast<volatile DiagRecord*>(host_ + kHostOffDiag);
        // claimed as the GPU's waiters claim it (report_timeout: valid 0 -> writing -> 1), so that a GPU waiter
        // giving up at the same moment cannot mix its fields with ours
        int32_t free_word = 0;
        auto* valid = reinterpret_cast<int32_t*>(host_ + kHostOffDiag);
        if (__atomic_compare_exchange_n(valid, &free_word, kDiagRecordWriting, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
          rec->rank = rank_;
          rec->peer = -1;
          rec->channel = -1;
          rec->phase = DiagPhase::kHostRecvCounts;
          rec->role = DiagRole::kHost;
          rec->expected = 0;
          rec->seen = *counter;
          rec->command = 0;
          rec->waited_s = waited;
          rec->drained = 0;
          __atomic_store_n(valid, 1, __ATOMIC_RELEASE);
        }
        *reinterpret_cast<volatile int32_t*>(host_ + kHostOffAbort) = 1;
        return false;
      }
      if (polls > (1u << 20)) std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // pairs with the GPU's release of the counter
  // notify records a peer whose rows differ (dispatch/args) before it releases the counts: raised before any row moves
  if (aborted()) return false;
  *num_recv = *counter;
  *most_recv = counter[1];
  *most_remote = counter[2];
  per_expert->resize(num_local_experts);
  const volatile int32_t* ec = reinterpret_cast<volatile int32_t*>(host_ + kHostOffExpertCounters);
  for (int e = 0; e < num_local_experts; ++e) (*per_expert)[e] = ec[e];
  rank_prefix->resize(static_cast<size_t>(num_ranks_) * num_ranks_);
  for (int i = 0; i < num_ranks_ * num_ranks_; ++i) (*rank_prefix)[i] = counter[intranode::kRecvCounterRankPrefix + i];
  rank_tokens->resize(static_cast<size_t>(num_ranks_));
  for (int s = 0; s < num_ranks_; ++s) (*rank_tokens)[s] = counter[intranode::kRecvCounterRankTokens + s];
  return true;
}

void NvlRuntime::check_graph_channels(int channels, void* stream) {
  if (graph_channels_ >= 0 && graph_channels_ != channels)
    UCCL_THROW(kInvalidUsage,
               "this Buffer has ops captured in a CUDA graph with num_sms=%d; a dispatch or combine with num_sms=%d "
               "would re-lay its NVL rings under the graph's replays. Use one num_sms for every op of a Buffer that "
               "is captured (Config.num_sms), or a second Buffer", 2 * graph_channels_, 2 * channels);
  if (gpu::stream_capturing(static_cast<gpu::Stream>(stream))) graph_channels_ = channels;
}

bool NvlRuntime::outside_graphs(void* stream) const {
  return !captured_ && graph_channels_ < 0 && !gpu::stream_capturing(static_cast<gpu::Stream>(stream));
}

bool NvlRuntime::ce_poll(void* stream, bool wanted) const { return wanted && outside_graphs(stream); }

void NvlRuntime::wait_for_sentinel(void* stream) {
  UCCL_ASSERT(!destroyed_ && connected_, "the NVL runtime is not connected (or was destroyed)");
  if (sentinel_seq_ == waited_seq_ && ended_seq_ == waited_ended_seq_ && stream == waited_stream_) return;
  // `stream` waits for a side-stream event; on the host where it captures (a capture may not wait for work outside it).
  const auto st = static_cast<gpu::Stream>(stream);
  const bool capturing = (ended_seq_ > 0 || sentinel_seq_ > 0) && gpu::stream_capturing(st);
  const auto wait_for = [&](void* event) {
    const auto e = static_cast<gpu::Event>(event);
    UCCL_CHECK_GPU(capturing ? gpu::event_synchronize_any_capture(e) : gpu::stream_wait_event(st, e));
  };
  // An op that ended beside (CeCopies::beside) ends on the side stream: nothing that writes our buffer or a peer's
  // runs before that end; nor before the side memset that set our landing area (NvlRuntime::note_op).
  if (ended_seq_ > 0) wait_for(ce_ended_);
  waited_ended_seq_ = ended_seq_;
  if (sentinel_seq_ > 0) wait_for(sentinel_set_);
  waited_stream_ = stream;
  waited_seq_ = sentinel_seq_;
}

void NvlRuntime::begin_op(void* stream, int kind, int64_t polled_end) {
  UCCL_ASSERT(kind >= 0 && kind < kNumOpKinds, "op kind %d", kind);
  wait_for_sentinel(stream);
  if (last_kind_ >= 0) next_kind_[last_kind_] = kind;
  last_kind_ = kind;
  if (polls(kind)) {
    const int64_t base = static_cast<int64_t>(intranode::kOffCombineInput);
    UCCL_ASSERT(polled_end >= base && polled_end <= num_nvl_bytes_, "a polled landing area ends at %lld, outside "
                "[%lld, %lld]", static_cast<long long>(polled_end), static_cast<long long>(base),
                static_cast<long long>(num_nvl_bytes_));
    const int64_t from = std::max(sentinel_end_, base);
    pre_set_ = polled_end > from;
    if (pre_set_) {
      UCCL_CHECK_GPU(gpu::memset_async(static_cast<char*>(local_) + from, 0xFF, static_cast<size_t>(polled_end - from),
                                       static_cast<gpu::Stream>(stream)));
      ++ce_sentinel_sets_;
    }
    poll_end_[kind] = polled_end;
    ++ce_polled_ops_;
    if (kind == kOpPolledDispatch) ++ce_polled_dispatches_;
  }
  if (!polls(kind)) pre_set_ = false;
  if (kind != kOpNotify) sentinel_end_ = 0;  // the op overwrites the area (notify writes only the meta)
}

void NvlRuntime::note_op(void* stream, bool done, int kind) {
  const bool capturing = gpu::stream_capturing(static_cast<gpu::Stream>(stream));
  if (capturing) captured_ = true;
  after_done_ = done;
  // Every kind but these enters with a cross-rank hand-shake that each rank reached after its memset: from here on
  // no rank's buffer is still being set, and an early op may start its copies again. Not an op captured in a graph:
  // the capture ran nothing.
  if (!capturing && kind != kOpStage && kind != kOpPeerCopy) sentinel_unfenced_ = false;
  // After notify (a ring or ring-free dispatch follows, which overwrites the area), a stage (the pull after it reads
  // the staged rows) and the bench's peer copy (one-sided, into a peer's buffer) no memset.
  const bool after = kind != kOpNotify && kind != kOpStage && kind != kOpPeerCopy;
  const int next = next_kind_[kind];
  const int64_t base = static_cast<int64_t>(intranode::kOffCombineInput);
  if (!after || next < 0 || !polls(next) || captured_ || poll_end_[next] <= base) return;
  const int64_t end = poll_end_[next];
  const auto side = static_cast<gpu::Stream>(sentinel_stream_);
  UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(sentinel_after_), static_cast<gpu::Stream>(stream)));
  UCCL_CHECK_GPU(gpu::stream_wait_event(side, static_cast<gpu::Event>(sentinel_after_)));
  UCCL_CHECK_GPU(gpu::memset_async(static_cast<char*>(local_) + base, 0xFF, static_cast<size_t>(end - base), side));
  UCCL_CHECK_GPU(gpu::event_record(static_cast<gpu::Event>(sentinel_set_), side));
  sentinel_end_ = end;
  ++sentinel_seq_;
  ++ce_sentinel_side_sets_;
  sentinel_unfenced_ = true;
  ring_channels_ = -1;  // the next ring op resets the rings: its barriers order every peer's writes after our memset
  if (!gate_ok_ || num_ranks_ < 2) return;
  // Every peer learns that our area holds the sentinel again (the write fences the memset): an early polled op's copy
  // stream waits for it (ce_copies). Then the watch that bounds our own copy streams' waits for the peers' counts.
  const auto count = static_cast<int32_t>(static_cast<uint32_t>(sentinel_seq_));
  for (int d = 0; d < num_ranks_; ++d) {
    if (d == rank_) continue;
    const int r = gpu::stream_write_u32(side, intranode::sentinel_ready_word(peers_[d], rank_),
                                        static_cast<uint32_t>(count));
    UCCL_ASSERT(r == 0, "the side stream could not tell rank %d that our landing area is set (error %d)", d, r);
  }
  const DiagDeviceHandle diag{reinterpret_cast<DiagRecord*>(host_dev_ + kHostOffDiag),
                              reinterpret_cast<int32_t*>(static_cast<char*>(local_) + intranode::kOffAbortFlag),
                              timeout_.limit_ns(), global_rank_ >= 0 ? global_rank_ : rank_};
  ce_gate_watch_kernel<<<1, gpu::kWarpSize, 0, side>>>(
      diag, intranode::sentinel_ready_word(local_, 0), num_ranks_, rank_, count,
      next == kOpPolledDispatch ? DiagPhase::kDispatchCeSentinel : DiagPhase::kCeSentinel);
  UCCL_CHECK_GPU(gpu::get_last_error());
}

void NvlRuntime::check_num_sms(int num_sms) const {
  if (device_sms_ > 0 && num_sms > device_sms_)
    UCCL_THROW(kInvalidUsage,
               "Config.num_sms=%d exceeds the %d SMs of GPU %d (%s): a dispatch or combine runs num_sms blocks (a "
               "sender and a receiver per channel) that must all be resident at once. Use an even num_sms <= %d "
               "(Buffer.set_num_sms or the Config passed to the op)", num_sms, device_sms_, device_,
               device_name(device_).c_str(), device_sms_ - device_sms_ % 2);
}

intranode::Geometry NvlRuntime::geometry(int num_sms, int nvl_send_tokens, int nvl_recv_tokens) const {
  check_num_sms(num_sms);
  return intranode::placed_geometry(num_sms, num_ranks_, nvl_send_tokens, nvl_recv_tokens, num_nvl_bytes_);
}

}  // namespace uccl_moe::runtime
