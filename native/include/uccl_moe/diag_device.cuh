// Device half of the timeout diagnostics (host half: diag.hpp). Kernels wait with BoundedWait (or wait_reached, its
// one-word form) and, on expiry, call report_timeout(), which fills the host-mapped DiagRecord once (first writer
// wins) and raises the abort flag that every other waiter of the launch polls, so the whole launch drains instead of
// hanging.
#pragma once

#include <type_traits>

#include "uccl_moe/compiler.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/platform.cuh"

namespace uccl_moe {

/// Trivially copyable; kernels take it by value.
struct DiagDeviceHandle {
  DiagRecord* record;   ///< host-mapped
  int32_t* abort_flag;  ///< nonzero once any waiter gave up; in the rank's own NVL buffer (GPU memory, where peers
                        ///< raise it too: the internode kernels share the NVL runtime's)
  uint64_t timeout_ns;  ///< from UCCL_MOE_TIMEOUT_S
  int32_t rank;
};

#if defined(UCCL_GPU_COMPILER)

/// Claims the record (valid 0 -> kDiagRecordWriting) and fills it, unless another report claimed it first.
UCCL_DEVICE_INLINE void write_record(const DiagDeviceHandle& h, DiagPhase phase, DiagRole role, int peer, int channel,
                                     int64_t expected, int64_t seen, uint64_t command, double waited_s, bool drained) {
  DiagRecord* r = h.record;
  if (gpu::load_volatile(&r->valid) == 0 && gpu::atomic_cas_sys(&r->valid, 0, kDiagRecordWriting) == 0) {
    r->rank = h.rank;
    r->peer = peer;
    r->channel = channel;
    r->phase = phase;
    r->role = role;
    r->expected = expected;
    r->seen = seen;
    r->command = command;
    r->waited_s = waited_s;
    r->drained = drained ? 1 : 0;
    gpu::store_release_sys(&r->valid, 1);
  }
}

/// Writes the record unless another waiter already did, then raises the abort flag (the launch drains); pairs with
/// the acquire of `valid` on the host. The record is claimed on its own word, not by being first to raise the flag: a
/// peer that gave up raises our flag too (an enter kernel or an early copy-engine op, handshake.cuh), and our waiters
/// then give up at once; were the record claimed with the flag, none of them would write it, the host (which reads
/// the record, not the flag in GPU memory) would see no failure, and the op would return rows it never summed.
/// `drained` says the flag was up before this waiter reported, i.e. it stopped for another's abort. The claim comes
/// before the flag, so that a waiter of this launch that stops for our flag finds the record taken: it cannot name
/// itself drained in place of the waiter that expired on its own clock (two waiters that expire together both read
/// the flag down, and either names the cause).
UCCL_DEVICE_INLINE void report_timeout(const DiagDeviceHandle& h, DiagPhase phase, DiagRole role, int peer, int channel,
                                       int64_t expected, int64_t seen, uint64_t command, double waited_s) {
  const bool drained = gpu::load_volatile(h.abort_flag) != 0;
  gpu::fence_sys();  // a flag seen up is ordered before our claim (the claimer's fence below pairs with it)
  write_record(h, phase, role, peer, channel, expected, seen, command, waited_s, drained);
  gpu::fence_sys();  // the claim is visible before the flag it raises
  gpu::atomic_add_sys(h.abort_flag, 1);
}

/// An argument a peer disagrees on, found where the launch can still run to its end (notify: the counts it exchanges
/// stay sound, and where the host waits for them it raises the record before the dispatch moves a row): writes the
/// record (an InvalidUsage phase; `command` as the phase defines it) without raising the abort flag, so that no wait
/// of this rank or of its peers gives up.
UCCL_DEVICE_INLINE void report_invalid(const DiagDeviceHandle& h, DiagPhase phase, DiagRole role, int peer,
                                       int channel, int64_t expected, int64_t seen, uint64_t command = 0) {
  write_record(h, phase, role, peer, channel, expected, seen, command, 0.0, false);
}

/// Records (token, k, value) in `fault` unless a fault is recorded there already (first writer wins); null = off.
/// Pairs with the acquire of `state` in NvlRuntime::take_topk_fault.
UCCL_DEVICE_INLINE void report_bad_topk(TopkFault* fault, int token, int k, int64_t value, int num_experts) {
  if (fault == nullptr) return;
  // A plain read first: once a fault is recorded, the other bad ids of an all-garbage topk_idx cost no PCIe atomic.
  if (gpu::load_volatile(&fault->state) != 0 || gpu::atomic_cas_sys(&fault->state, 0, 1) != 0) return;
  fault->token = token;
  fault->k = k;
  fault->num_experts = num_experts;
  fault->value = value;
  gpu::store_release_sys(&fault->state, 2);
}

/// Usage: BoundedWait w(diag); while (!ready()) { if (w.expired()) { report...; return; } }
struct BoundedWait {
  uint64_t start_ns;
  uint64_t timeout_ns;
  const int32_t* abort_flag;
  uint32_t polls = 0;
  UCCL_DEVICE_INLINE explicit BoundedWait(const DiagDeviceHandle& h)
      : start_ns(gpu::global_timer_ns()), timeout_ns(h.timeout_ns), abort_flag(h.abort_flag) {}
  /// True once the limit passed or another waiter aborted. Reads the timer every 64 polls to keep it cheap.
  UCCL_DEVICE_INLINE bool expired() {
    if ((++polls & 63u) != 0) return false;
    if (gpu::load_volatile(abort_flag) != 0) return true;
    return gpu::global_timer_ns() - start_ns > timeout_ns;
  }
  UCCL_DEVICE_INLINE double waited_s() const { return (gpu::global_timer_ns() - start_ns) * 1e-9; }
};

/// One thread's bounded wait until `*word` (polled with acquire) reached `target`. The compare wraps, so counters
/// that run modulo 2^32 across rounds compare right. Returns false once the wait expired or another waiter aborted,
/// after writing the record (expected = target, seen = the last value read); the caller makes that uniform.
template <typename T>
UCCL_DEVICE_INLINE bool wait_reached(const DiagDeviceHandle& diag, const T* word, T target, DiagPhase phase,
                                     DiagRole role, int peer, int channel, uint64_t command = 0) {
  using U = std::make_unsigned_t<T>;
  const auto behind = [target](T v) { return static_cast<T>(static_cast<U>(v) - static_cast<U>(target)) < 0; };
  T seen = gpu::load_acquire_sys(word);
  if (!behind(seen)) return true;
  BoundedWait wait(diag);
  while (behind(seen = gpu::load_acquire_sys(word))) {
    if (wait.expired()) {
      report_timeout(diag, phase, role, peer, channel, target, seen, command, wait.waited_s());
      return false;
    }
  }
  return true;
}

#endif

}  // namespace uccl_moe
