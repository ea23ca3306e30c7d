// UCCL_MOE_TIMEOUT_S as a typed value, resolved once per runtime (Proxy, NvlRuntime, a host FIFO producer) and read
// from there by everything in it, Python included (the bindings expose the runtime's value). The margins below are
// the only other numbers a wait derives from it.
#pragma once

#include <cstdint>
#include <optional>

#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe {

struct Timeout {
  /// A host thread waiting on a GPU wait of the same limit waits longer, so the GPU's record (which names the peer)
  /// is written before the host's own (which cannot): limit * 1.5 + 5 s.
  static constexpr double kHostBehindDeviceFactor = 1.5;
  static constexpr double kHostBehindDeviceSlackS = 5.0;
  /// A caller waiting for a proxy command waits twice the limit, so the proxy thread reports a lost command first,
  /// with the diagnostic that names it.
  static constexpr double kCallerBehindProxyFactor = 2.0;

  double limit_s;  ///< bound of every GPU spin and proxy wait, in seconds

  /// `explicit_s` when given (a caller's own limit, > 0), else the knob (validated; a bad value throws InvalidUsage
  /// naming UCCL_MOE_TIMEOUT_S).
  static Timeout resolve(std::optional<double> explicit_s = std::nullopt) {
    if (!explicit_s) return Timeout{env::TIMEOUT_S()};
    UCCL_ASSERT(*explicit_s > 0, "timeout_s=%g must be > 0 seconds (leave it unset for UCCL_MOE_TIMEOUT_S)", *explicit_s);
    return Timeout{*explicit_s};
  }
  uint64_t limit_ns() const { return static_cast<uint64_t>(limit_s * 1e9); }
  double host_behind_device_s() const { return limit_s * kHostBehindDeviceFactor + kHostBehindDeviceSlackS; }
  double caller_behind_proxy_s() const { return limit_s * kCallerBehindProxyFactor; }
};

}  // namespace uccl_moe
