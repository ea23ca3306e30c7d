// BF16 <-> float helpers of the reducing kernels (intranode combine, internode final reduction).
#pragma once

#include <cstdint>

#include "uccl_moe/platform.cuh"

namespace uccl_moe::kernels {

UCCL_DEVICE_INLINE float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
UCCL_DEVICE_INLINE float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
UCCL_DEVICE_INLINE void add_bf16x8(float* acc, const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += bf16_lo(w[i]);
    acc[2 * i + 1] += bf16_hi(w[i]);
  }
}
/// float -> bf16 bits, round to nearest even (NaN stays NaN).
UCCL_DEVICE_INLINE uint32_t to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
UCCL_DEVICE_INLINE int4 pack_bf16x8(const float* acc) {
  int4 r;
  r.x = static_cast<int>(to_bf16_bits(acc[0]) | (to_bf16_bits(acc[1]) << 16));
  r.y = static_cast<int>(to_bf16_bits(acc[2]) | (to_bf16_bits(acc[3]) << 16));
  r.z = static_cast<int>(to_bf16_bits(acc[4]) | (to_bf16_bits(acc[5]) << 16));
  r.w = static_cast<int>(to_bf16_bits(acc[6]) | (to_bf16_bits(acc[7]) << 16));
  return r;
}

}  // namespace uccl_moe::kernels
