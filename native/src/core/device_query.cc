#include "uccl_moe/device_query.hpp"

#if defined(UCCL_MOE_WITH_CUDA)
#include <cuda_runtime_api.h>
#define UCCL_GPU_OK cudaSuccess
#define UCCL_GPU(fn) cuda##fn
#define UCCL_GPU_PROP cudaDeviceProp
#define UCCL_GPU_CLEAR() (void)cudaGetLastError()
#define UCCL_GPU_ATTR_SM_COUNT cudaDevAttrMultiProcessorCount
#elif defined(UCCL_MOE_WITH_HIP)
#include <hip/hip_runtime_api.h>
#define UCCL_GPU_OK hipSuccess
#define UCCL_GPU(fn) hip##fn
#define UCCL_GPU_PROP hipDeviceProp_t
#define UCCL_GPU_CLEAR() (void)hipGetLastError()
#define UCCL_GPU_ATTR_SM_COUNT hipDeviceAttributeMultiprocessorCount
#endif

namespace uccl_moe {

#if defined(UCCL_MOE_WITH_CUDA) || defined(UCCL_MOE_WITH_HIP)

const char* gpu_backend() {
#if defined(UCCL_MOE_WITH_CUDA)
  return "cuda";
#else
  return "hip";
#endif
}

int device_count() {
  int n = 0;
  if (UCCL_GPU(GetDeviceCount)(&n) != UCCL_GPU_OK) {
    UCCL_GPU_CLEAR();  // "no driver" is an answer here, not an error
    return 0;
  }
  return n;
}

int device_arch(int device) {
  UCCL_GPU_PROP prop;
  if (device < 0 || device >= device_count() || UCCL_GPU(GetDeviceProperties)(&prop, device) != UCCL_GPU_OK) {
    UCCL_GPU_CLEAR();
    return -1;
  }
  return prop.major * 10 + prop.minor;
}

std::string device_name(int device) {
  UCCL_GPU_PROP prop;
  if (device < 0 || device >= device_count() || UCCL_GPU(GetDeviceProperties)(&prop, device) != UCCL_GPU_OK) {
    UCCL_GPU_CLEAR();
    return "";
  }
  return prop.name;
}

int device_sm_count(int device) {
  int n = 0;
  if (device < 0 || device >= device_count() ||
      UCCL_GPU(DeviceGetAttribute)(&n, UCCL_GPU_ATTR_SM_COUNT, device) != UCCL_GPU_OK) {
    UCCL_GPU_CLEAR();
    return 0;
  }
  return n;
}

bool can_access_peer(int device, int peer) {
  int n = device_count();
  if (device < 0 || peer < 0 || device >= n || peer >= n) return false;
  if (device == peer) return true;
  int ok = 0;
  if (UCCL_GPU(DeviceCanAccessPeer)(&ok, device, peer) != UCCL_GPU_OK) {
    UCCL_GPU_CLEAR();
    return false;
  }
  return ok != 0;
}

#else  // no GPU backend in this build

const char* gpu_backend() { return "none"; }
int device_count() { return 0; }
int device_arch(int) { return -1; }
std::string device_name(int) { return ""; }
int device_sm_count(int) { return 0; }
bool can_access_peer(int, int) { return false; }

#endif

}  // namespace uccl_moe
