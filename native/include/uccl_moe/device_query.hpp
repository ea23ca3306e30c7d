// Host-side queries of the GPUs this build can drive. All return "nothing" (0 / false / empty) when the
// build has no GPU backend or the machine has no driver, so callers can probe without try/catch.
#pragma once

#include <string>

namespace uccl_moe {

/// "cuda", "hip" or "none": what this build was compiled for.
const char* gpu_backend();
/// Number of visible GPUs (0 without a driver or GPU build).
int device_count();
/// Compute capability as major*10+minor on CUDA (90 for H100/H200), gfx number on HIP; -1 if unknown.
int device_arch(int device);
std::string device_name(int device);
/// Streaming multiprocessors (CUDA) or compute units (HIP) of `device`; 0 if unknown.
int device_sm_count(int device);
/// True if `device` can map memory of `peer` (NVLink/xGMI or PCIe P2P).
bool can_access_peer(int device, int peer);

}  // namespace uccl_moe
