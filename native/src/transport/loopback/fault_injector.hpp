// Seeded, reproducible fault injection of the loopback transport (UCCL_MOE_LOOPBACK_*):
//   delay    each work request becomes eligible delay ~ U[0, delay_us] microseconds after it was posted;
//   reorder  among the first `window` eligible requests, a random one executes next (window <= 1: in order);
//   drop     every `drop_every`-th posted request (counted per endpoint, offset by the seed) is discarded silently:
//            no data, no immediate, no completion. The proxy reports it as a timeout naming the lost command.
// The same seed and the same sequence of posts give the same drops and the same choices.
#pragma once

#include <cstdint>
#include <random>

namespace uccl_moe::detail {

struct FaultConfig {
  int reorder_window = 0;
  int64_t delay_us = 0;
  int64_t drop_every = 0;
  uint64_t seed = 0;
  static FaultConfig from_env();  ///< reads the UCCL_MOE_LOOPBACK_* knobs
};

class FaultInjector {
 public:
  FaultInjector(const FaultConfig& cfg, uint64_t stream) : cfg_(cfg), rng_(cfg.seed * 0x9E3779B97F4A7C15ull + stream) {}
  /// Decides for the next posted request: whether to drop it, and its delay in microseconds.
  bool next_drop() {
    ++posted_;
    return cfg_.drop_every > 0 && (posted_ + cfg_.seed) % uint64_t(cfg_.drop_every) == 0;
  }
  int64_t next_delay_us() {
    return cfg_.delay_us > 0 ? int64_t(rng_() % uint64_t(cfg_.delay_us + 1)) : 0;
  }
  /// Index (0 <= i < num_eligible) of the request to execute next.
  int pick(int num_eligible) {
    const int w = cfg_.reorder_window > 1 ? (num_eligible < cfg_.reorder_window ? num_eligible : cfg_.reorder_window) : 1;
    return w <= 1 ? 0 : int(rng_() % uint64_t(w));
  }
  const FaultConfig& config() const { return cfg_; }

 private:
  FaultConfig cfg_;
  std::mt19937_64 rng_;
  uint64_t posted_ = 0;
};

}  // namespace uccl_moe::detail
