#include "uccl_moe/streams.hpp"

#include "uccl_moe/error.hpp"

#if defined(UCCL_MOE_WITH_CUDA)
#include <cuda_runtime_api.h>
#define UCCL_GPU_OK cudaSuccess
#define UCCL_GPU(fn) cuda##fn
#define UCCL_GPU_EVENT cudaEvent_t
#define UCCL_GPU_STREAM cudaStream_t
#define UCCL_GPU_EVENT_FLAGS cudaEventDisableTiming
#elif defined(UCCL_MOE_WITH_HIP)
#include <hip/hip_runtime_api.h>
#define UCCL_GPU_OK hipSuccess
#define UCCL_GPU(fn) hip##fn
#define UCCL_GPU_EVENT hipEvent_t
#define UCCL_GPU_STREAM hipStream_t
#define UCCL_GPU_EVENT_FLAGS hipEventDisableTiming
#endif

namespace uccl_moe {

#if defined(UCCL_MOE_WITH_CUDA) || defined(UCCL_MOE_WITH_HIP)

namespace {
void check(decltype(UCCL_GPU_OK) e, const char* what) {
  if (e == UCCL_GPU_OK) return;
  (void)UCCL_GPU(GetLastError)();  // reported here: the next kernel launch's error check must not blame itself
  UCCL_THROW(kCuda, "%s: %s", what, UCCL_GPU(GetErrorString)(e));
}
}  // namespace

uintptr_t join_event_create(int device) {
  int prev = 0;
  check(UCCL_GPU(GetDevice)(&prev), "GetDevice");
  check(UCCL_GPU(SetDevice)(device), "SetDevice");  // an event belongs to the device current at its creation
  UCCL_GPU_EVENT e = nullptr;
  const auto err = UCCL_GPU(EventCreateWithFlags)(&e, UCCL_GPU_EVENT_FLAGS);
  const auto restored = UCCL_GPU(SetDevice)(prev);
  if (restored != UCCL_GPU_OK && err == UCCL_GPU_OK) (void)UCCL_GPU(EventDestroy)(e);
  check(restored, "SetDevice");
  check(err, "EventCreateWithFlags");
  return reinterpret_cast<uintptr_t>(e);
}

void join_event_destroy(uintptr_t event) {
  if (event != 0) check(UCCL_GPU(EventDestroy)(reinterpret_cast<UCCL_GPU_EVENT>(event)), "EventDestroy");
}

void stream_join(uintptr_t waiter, uintptr_t stream, uintptr_t event) {
  const auto e = reinterpret_cast<UCCL_GPU_EVENT>(event);
  check(UCCL_GPU(EventRecord)(e, reinterpret_cast<UCCL_GPU_STREAM>(stream)), "EventRecord (stream join)");
  check(UCCL_GPU(StreamWaitEvent)(reinterpret_cast<UCCL_GPU_STREAM>(waiter), e, 0), "StreamWaitEvent (stream join)");
}

#else  // no GPU backend in this build

uintptr_t join_event_create(int) { UCCL_THROW(kInvalidUsage, "stream joins need a GPU build of uccl-moe"); }
void join_event_destroy(uintptr_t) {}
void stream_join(uintptr_t, uintptr_t, uintptr_t) {
  UCCL_THROW(kInvalidUsage, "stream joins need a GPU build of uccl-moe");
}

#endif

}  // namespace uccl_moe
