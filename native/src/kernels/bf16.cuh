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
/// 8 floats -> 8 bf16 (round to nearest even), packed as the 16 bytes of one row chunk.
UCCL_DEVICE_INLINE int4 pack_bf16x8(const float* acc) {
  int4 r;
  r.x = static_cast<int>(gpu::pack_bf16x2_rn(acc[0], acc[1]));
  r.y = static_cast<int>(gpu::pack_bf16x2_rn(acc[2], acc[3]));
  r.z = static_cast<int>(gpu::pack_bf16x2_rn(acc[4], acc[5]));
  r.w = static_cast<int>(gpu::pack_bf16x2_rn(acc[6], acc[7]));
  return r;
}

}  // namespace uccl_moe::kernels
