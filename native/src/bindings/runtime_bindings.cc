// Bindings of the NVL runtime and the intranode kernels. Tensors cross as raw device pointers (Python ints,
// 0 = absent) plus a stream handle (int); uccl_moe/backends/native.py owns the tensors and validates shapes.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/error.hpp"

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
#include "../kernels/intranode/intranode.hpp"
#include "../kernels/intranode/nvl_layout.hpp"
#include "../runtime/nvl_runtime.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace uccl_moe::bindings {

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
namespace {

using intranode::Geometry;
using runtime::NvlRuntime;

/// Resets the ring counters (prepare_round: two barriers) before a dispatch or combine whose channel count
/// differs from the one the counters were last reset for; rounds with an unchanged count chain without it.
void ensure_rings(NvlRuntime& rt, const intranode::NvlContext& ctx, const Geometry& g, uintptr_t stream) {
  rt.check_graph_channels(g.num_channels, stream_of(stream));
  if (rt.ring_channels() == g.num_channels) return;
  intranode::launch_prepare_round(ctx, g, stream_of(stream));
  rt.set_ring_channels(g.num_channels);
}

/// The lane geometry of an op on `rt`'s GPU (refuses more SMs than it has: NvlRuntime::check_num_sms).
Geometry op_geometry(const NvlRuntime& rt, int num_sms, int nvl_send, int nvl_recv) {
  rt.check_num_sms(num_sms);
  return intranode::make_geometry(num_sms, rt.num_ranks(), nvl_send, nvl_recv);
}

nb::tuple geometry_tuple(const Geometry& g) {
  return nb::make_tuple(g.num_channels, g.lanes_per_channel, g.channel_slots, g.lane_slots, g.chunk_tokens);
}

}  // namespace

void register_runtime(nb::module_& m) {
  nb::class_<NvlRuntime>(m, "NvlRuntime",
                         "Per-rank NVL buffer shared over CUDA/HIP IPC, host-mapped counters and diagnostics")
      .def(nb::init<int, int, int64_t, int>(), "rank"_a, "num_ranks"_a, "num_nvl_bytes"_a, "device"_a)
      .def("ipc_handle", [](const NvlRuntime& r) { return nb::bytes(r.ipc_handle().data(), r.ipc_handle().size()); })
      .def("connect", [](NvlRuntime& r, const std::vector<nb::bytes>& handles) {
        std::vector<std::string> hs;
        for (const auto& h : handles) hs.emplace_back(h.c_str(), h.size());
        r.connect(hs);
      }, "handles"_a)
      .def("destroy", [](NvlRuntime& r) {
        nb::gil_scoped_release release;
        r.destroy();
      })
      .def_prop_ro("connected", &NvlRuntime::connected)
      .def_prop_ro("local_buffer", &NvlRuntime::local_buffer)
      .def_prop_ro("num_nvl_bytes", &NvlRuntime::num_nvl_bytes)
      .def("set_global_rank", &NvlRuntime::set_global_rank, "rank"_a)
      .def("aborted", &NvlRuntime::aborted)
      .def("check_num_sms", &NvlRuntime::check_num_sms, "num_sms"_a,
           "Raises InvalidUsageError if the GPU has fewer SMs than num_sms (every block of an op must be resident)")
      .def("diag", [](const NvlRuntime& r) { return diag_to_dict(r.diag()); })
      .def_prop_ro("topk_fault_device", &NvlRuntime::topk_fault_device,
                   "device view of the host-mapped record of the first top-k id outside [-1, num_experts)")
      .def("take_topk_fault", [](NvlRuntime& r) -> nb::object {
        const TopkFault f = r.take_topk_fault();
        if (f.state != 2) return nb::none();
        return nb::make_tuple(f.token, f.k, f.value, f.num_experts);
      }, "(token, k, value, num_experts) of the recorded bad top-k id, cleared; None if none. No device sync")
      .def("reset_recv_counter", &NvlRuntime::reset_recv_counter)
      .def_prop_ro("timeout_s", [](const NvlRuntime& r) { return r.timeout().limit_s; },
                   "UCCL_MOE_TIMEOUT_S as resolved when this runtime was created (its kernels' and host's bound)")
      .def("wait_recv_counts", [](NvlRuntime& r, int num_local_experts) {
        int num_recv = -1, most_recv = -1;
        std::vector<int> per_expert;
        bool ok;
        {
          nb::gil_scoped_release release;
          ok = r.wait_recv_counts(num_local_experts, &num_recv, &most_recv, &per_expert);
        }
        return nb::make_tuple(ok, num_recv, most_recv, per_expert);
      }, "num_local_experts"_a,
      "Blocks (GIL released) until notify published the receive counts: (ok, num_recv, most_recv, "
      "per_expert_counts), most_recv being the most rows any local rank receives");

  m.def("intranode_lanes_per_channel", &intranode::lanes_per_channel, "num_ranks"_a);
  m.def("intranode_geometry", [](int num_sms, int num_ranks, int nvl_send, int nvl_recv) {
    return geometry_tuple(intranode::make_geometry(num_sms, num_ranks, nvl_send, nvl_recv));
  }, "num_sms"_a, "num_ranks"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a,
  "(num_channels, lanes_per_channel, channel_slots, lane_slots, chunk_tokens)");
  m.def("intranode_required_nvl_bytes", [](int num_sms, int num_ranks, int nvl_send, int nvl_recv, int row_bytes,
                                           int num_topk, int num_scales) {
    return intranode::required_nvl_bytes(intranode::make_geometry(num_sms, num_ranks, nvl_send, nvl_recv), num_ranks,
                                         row_bytes, num_topk, num_scales);
  }, "num_sms"_a, "num_ranks"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a, "row_bytes"_a, "num_topk"_a,
  "num_scales"_a);

  m.def("intranode_combine_split", [](int num_sms, int num_ranks, int senders, int me) {
    // The split the combine kernel would use (senders <= 0: the built-in one), with every block's role spelled
    // out by the same CombineSplit methods the kernel calls: ((S, R), [(block, warp, lane, dst)] of the sender
    // warps that serve a pair, [(block, first_lane, lanes, group)] of the receiver blocks).
    const auto g = intranode::make_geometry(num_sms, num_ranks, 8, 256);
    const auto s = intranode::combine_split(g, num_ranks, senders);
    const int warps = intranode::lanes_per_channel(1);
    nb::list pairs, lanes;
    for (int b = 0; b < s.senders; ++b)
      for (int w = 0; w < warps; ++w) {
        const int p = s.pair_of(b, w);
        if (p < s.num_pairs()) pairs.append(nb::make_tuple(b, w, s.pair_lane(p), s.pair_dst(p, me)));
      }
    for (int r = 0; r < s.receivers; ++r)
      lanes.append(nb::make_tuple(s.senders + r, s.first_lane(r), s.lanes_of(r), s.group(r, warps)));
    return nb::make_tuple(nb::make_tuple(s.senders, s.receivers), pairs, lanes);
  }, "num_sms"_a, "num_ranks"_a, "senders"_a, "me"_a = 0,
  "((senders, receivers), sender pairs (block, warp, lane, dst), receiver blocks (block, first_lane, lanes, group))");

  m.def("intranode_slot_placement", [](int num_sms, int num_ranks, int nvl_send, int nvl_recv, int64_t num_nvl_bytes,
                                       int row_bytes, int num_topk, int num_scales) {
    const auto g = intranode::place_lanes(intranode::make_geometry(num_sms, num_ranks, nvl_send, nvl_recv), num_ranks,
                                          num_nvl_bytes);
    const auto s = intranode::SlotLayout::make(row_bytes, num_topk, num_scales);
    return nb::make_tuple(s.bytes, g.lane_region_bytes, static_cast<int64_t>(kNvlMetaBytes));
  }, "num_sms"_a, "num_ranks"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a, "num_nvl_bytes"_a, "row_bytes"_a,
  "num_topk"_a, "num_scales"_a, "(slot_bytes, lane_region_bytes, meta_bytes): where the lane rings and slots sit");

  m.def("get_dispatch_layout", [](uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                                  int ranks_per_node, uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_node,
                                  uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank, uintptr_t stream,
                                  uintptr_t topk_fault) {
    intranode::LayoutArgs a{ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks,
                            ranks_per_node, ptr<int32_t>(num_tokens_per_rank), ptr<int32_t>(num_tokens_per_node),
                            ptr<int32_t>(num_tokens_per_expert), ptr<bool>(is_token_in_rank), ptr<TopkFault>(topk_fault)};
    intranode::launch_get_dispatch_layout(a, stream_of(stream));
  }, "topk_idx"_a, "num_tokens"_a, "num_topk"_a, "num_experts"_a, "num_ranks"_a, "ranks_per_node"_a,
  "num_tokens_per_rank"_a, "num_tokens_per_node"_a, "num_tokens_per_expert"_a, "is_token_in_rank"_a, "stream"_a,
  "topk_fault"_a = 0, "topk_fault: NvlRuntime.topk_fault_device, or 0 (no range record)");

  m.def("check_topk_idx", [](uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, uintptr_t topk_fault,
                             uintptr_t stream) {
    intranode::launch_check_topk_idx(ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts,
                                     ptr<TopkFault>(topk_fault), stream_of(stream));
  }, "topk_idx"_a, "num_tokens"_a, "num_topk"_a, "num_experts"_a, "topk_fault"_a, "stream"_a,
  "Records the first id of topk_idx outside [-1, num_experts) in topk_fault (NvlRuntime.topk_fault_device); no sync");

  m.def("notify_dispatch", [](NvlRuntime& rt, int num_sms, int nvl_send, int nvl_recv, uintptr_t is_token_in_rank,
                              uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_expert, int num_tokens,
                              int num_experts, int expert_alignment, bool write_host_counters, uintptr_t lane_prefix,
                              uintptr_t rank_prefix, uintptr_t recv_lane_start, uintptr_t stream,
                              uintptr_t num_tokens_ptr) {
    const auto ctx = rt.context();
    const Geometry g = op_geometry(rt, num_sms, nvl_send, nvl_recv);
    intranode::NotifyArgs a{ptr<const bool>(is_token_in_rank), ptr<const int32_t>(num_tokens_per_rank),
                            ptr<const int32_t>(num_tokens_per_expert), num_tokens, num_experts, expert_alignment,
                            write_host_counters, ptr<int32_t>(lane_prefix), ptr<int32_t>(rank_prefix),
                            ptr<int32_t>(recv_lane_start), ptr<const int32_t>(num_tokens_ptr)};
    rt.check_graph_channels(g.num_channels, stream_of(stream));
    intranode::launch_notify_dispatch(ctx, g, a, stream_of(stream));
    rt.set_ring_channels(g.num_channels);  // notify resets the ring counters
  }, "runtime"_a, "num_sms"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a, "is_token_in_rank"_a,
  "num_tokens_per_rank"_a, "num_tokens_per_expert"_a, "num_tokens"_a, "num_experts"_a, "expert_alignment"_a,
  "write_host_counters"_a, "lane_prefix"_a, "rank_prefix"_a, "recv_lane_start"_a, "stream"_a,
  "num_tokens_ptr"_a = 0);

  m.def("dispatch_intranode", [](NvlRuntime& rt, int num_sms, int nvl_send, int nvl_recv, uintptr_t x,
                                 uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights,
                                 uintptr_t is_token_in_rank, uintptr_t rank_prefix, uintptr_t recv_lane_start,
                                 int num_tokens, int row_bytes, int num_topk, int num_scales, int num_experts,
                                 int64_t scale_token_stride, int64_t scale_hidden_stride, int num_recv_rows,
                                 uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_topk_idx,
                                 uintptr_t recv_topk_weights, uintptr_t recv_src_idx, uintptr_t send_head,
                                 uintptr_t stream, uintptr_t num_tokens_ptr, uintptr_t row_map, uintptr_t src_tag) {
    const auto ctx = rt.context();
    const Geometry g = op_geometry(rt, num_sms, nvl_send, nvl_recv);
    intranode::DispatchArgs a{};
    a.x = ptr<const void>(x);
    a.x_scales = ptr<const void>(x_scales);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.topk_weights = ptr<const float>(topk_weights);
    a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
    a.rank_prefix = ptr<const int32_t>(rank_prefix);
    a.recv_lane_start = ptr<const int32_t>(recv_lane_start);
    a.num_tokens = num_tokens;
    a.row_bytes = row_bytes;
    a.num_topk = num_topk;
    a.num_scales = num_scales;
    a.num_experts = num_experts;
    a.scale_token_stride = scale_token_stride;
    a.scale_hidden_stride = scale_hidden_stride;
    a.num_recv_rows = num_recv_rows;
    a.recv_x = ptr<void>(recv_x);
    a.recv_scales = ptr<void>(recv_scales);
    a.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
    a.recv_topk_weights = ptr<float>(recv_topk_weights);
    a.recv_src_idx = ptr<int32_t>(recv_src_idx);
    a.send_head = ptr<int32_t>(send_head);
    a.num_tokens_ptr = ptr<const int32_t>(num_tokens_ptr);
    a.row_map = ptr<const int32_t>(row_map);
    a.src_tag = ptr<const int32_t>(src_tag);
    ensure_rings(rt, ctx, g, stream);
    intranode::launch_dispatch_intranode(ctx, g, a, stream_of(stream));
  }, "runtime"_a, "num_sms"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a, "x"_a, "x_scales"_a, "topk_idx"_a,
  "topk_weights"_a, "is_token_in_rank"_a, "rank_prefix"_a, "recv_lane_start"_a, "num_tokens"_a, "row_bytes"_a,
  "num_topk"_a, "num_scales"_a, "num_experts"_a, "scale_token_stride"_a, "scale_hidden_stride"_a,
  "num_recv_rows"_a, "recv_x"_a, "recv_scales"_a, "recv_topk_idx"_a, "recv_topk_weights"_a, "recv_src_idx"_a,
  "send_head"_a, "stream"_a, "num_tokens_ptr"_a = 0, "row_map"_a = 0, "src_tag"_a = 0);

  m.def("combine_intranode", [](NvlRuntime& rt, int num_sms, int nvl_send, int nvl_recv, uintptr_t x,
                                uintptr_t topk_weights, uintptr_t bias0, uintptr_t bias1, uintptr_t rank_prefix,
                                uintptr_t recv_lane_start, uintptr_t send_head, int num_tokens, int hidden,
                                int num_topk, uintptr_t out, uintptr_t out_topk_weights, uintptr_t stream,
                                uintptr_t num_tokens_ptr, uintptr_t row_map) {
    const auto ctx = rt.context();
    const Geometry g = op_geometry(rt, num_sms, nvl_send, nvl_recv);
    intranode::CombineArgs a{ptr<const void>(x), ptr<const float>(topk_weights), ptr<const void>(bias0),
                             ptr<const void>(bias1), ptr<const int32_t>(rank_prefix),
                             ptr<const int32_t>(recv_lane_start), ptr<const int32_t>(send_head), num_tokens, hidden,
                             num_topk, ptr<void>(out), ptr<float>(out_topk_weights),
                             ptr<const int32_t>(num_tokens_ptr), ptr<const int32_t>(row_map)};
    ensure_rings(rt, ctx, g, stream);
    intranode::launch_combine_intranode(ctx, g, a, stream_of(stream));
  }, "runtime"_a, "num_sms"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a, "x"_a, "topk_weights"_a, "bias0"_a,
  "bias1"_a, "rank_prefix"_a, "recv_lane_start"_a, "send_head"_a, "num_tokens"_a, "hidden"_a, "num_topk"_a, "out"_a,
  "out_topk_weights"_a, "stream"_a, "num_tokens_ptr"_a = 0, "row_map"_a = 0);

  m.def("combine_pull_intranode", [](NvlRuntime& rt, int num_sms, int64_t num_rows, uintptr_t topk_weights,
                                     uintptr_t bias0, uintptr_t bias1, uintptr_t rank_prefix, uintptr_t lane_prefix,
                                     uintptr_t send_head, int num_tokens, int hidden, int num_topk, int num_lanes,
                                     uintptr_t out, uintptr_t out_topk_weights, uintptr_t stream) {
    // No ring is used, so the ring counters need no reset (ensure_rings) and the op's SM count is free.
    rt.check_num_sms(num_sms);
    intranode::CombinePullArgs a{ptr<const float>(topk_weights), ptr<const void>(bias0), ptr<const void>(bias1),
                                 ptr<const int32_t>(rank_prefix), ptr<const int32_t>(lane_prefix),
                                 ptr<const int32_t>(send_head), num_tokens, hidden, num_topk, num_lanes,
                                 ptr<void>(out), ptr<float>(out_topk_weights)};
    intranode::launch_combine_pull(rt.context(), num_sms, num_rows, a, stream_of(stream));
  }, "runtime"_a, "num_sms"_a, "num_rows"_a, "topk_weights"_a, "bias0"_a, "bias1"_a, "rank_prefix"_a,
  "lane_prefix"_a, "send_head"_a, "num_tokens"_a, "hidden"_a, "num_topk"_a, "num_lanes"_a, "out"_a,
  "out_topk_weights"_a, "stream"_a);

  m.def("intranode_combine_input_layout", [](int64_t rows, int hidden, int num_topk) {
    return nb::make_tuple(static_cast<int64_t>(intranode::kOffCombineInput),
                          intranode::combine_input_bytes(rows, hidden, num_topk));
  }, "rows"_a, "hidden"_a, "num_topk"_a,
  "(offset, end): where a combine from the buffer finds its [rows, hidden] BF16 input rows in the NVL buffer, and the "
  "bytes it needs from the buffer's start with num_topk staged weights per row");

  m.def("peer_copy", [](NvlRuntime& rt, int peer, int64_t bytes, uintptr_t stream) {
    intranode::launch_peer_copy(rt.context(), peer, bytes, stream_of(stream));
  }, "runtime"_a, "peer"_a, "bytes"_a, "stream"_a,
  "Copy-engine copy of `bytes` from this rank's NVL ring region into peer's (benchmark ceiling)");
}

#else

void register_runtime(nb::module_&) {}

#endif

}  // namespace uccl_moe::bindings
