// Stream joins at a low host cost, for the Python side's comm stream (uccl_moe/streams.py): one call records an
// event on one stream and makes another wait for it. Streams and events cross as integers (cudaStream_t /
// hipStream_t, cudaEvent_t / hipEvent_t). A build without a GPU backend throws kInvalidUsage.
#pragma once

#include <cstdint>

namespace uccl_moe {

/// A timing-free event on `device`, for stream_join; release it with join_event_destroy.
uintptr_t join_event_create(int device);
void join_event_destroy(uintptr_t event);
/// `waiter` waits for the work enqueued on `stream` so far: records `event` (of `stream`'s device) on `stream`,
/// then makes `waiter` wait for that record. Reusing one event is safe: a wait binds to the record before it.
void stream_join(uintptr_t waiter, uintptr_t stream, uintptr_t event);

}  // namespace uccl_moe
