// Bindings of the NVL runtime and the intranode kernels. Tensors cross as raw device pointers (Python ints,
// 0 = absent) plus a stream handle (int); uccl_moe/backends/native.py owns the tensors and validates shapes.
#include <algorithm>
#include <exception>
#include <tuple>

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../kernels/intranode/intranode.hpp"
#include "../kernels/intranode/nvl_layout.hpp"
#include "args_class.hpp"
#include "bindings.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/error.hpp"

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
#include "../runtime/nvl_runtime.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace uccl_moe::bindings {

namespace {

using intranode::Geometry;

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
/// intranode::LateOutputs from `fn`, a Python callable that allocates a copy-engine op's outputs and returns their
/// device addresses (out0, out1), 0 for none; None: the args hold them. `need0` / `need1`: whether the kernel writes
/// through out0 / out1 (rows land there), so that 0 is an error. The first error (what `fn` raises, a result of another
/// shape, a missing address) goes into `failed`, which the binding raises once the launch is complete and noted: the
/// op then ran to its end without outputs, as the peers need.
intranode::LateOutputs late_outputs(const nb::object& fn, std::exception_ptr& failed, bool need0, bool need1,
                                    const char* what) {
  if (fn.is_none()) return {};
  return [&fn, &failed, need0, need1, what](void*& out0, void*& out1) {
    try {
      const auto [a, b] = nb::cast<std::tuple<uintptr_t, uintptr_t>>(fn());
      UCCL_CHECK_INTERNAL((a != 0 || !need0) && (b != 0 || !need1), "%s: its outputs came back without an address "
                          "(%#llx, %#llx) where rows land", what, static_cast<unsigned long long>(a),
                          static_cast<unsigned long long>(b));
      out0 = reinterpret_cast<void*>(a);
      out1 = reinterpret_cast<void*>(b);
      return true;
    } catch (...) {
      failed = std::current_exception();
      return false;
    }
  };
}
#endif

/// The intranode geometry, the launchers' argument structs (built in Python by field name: args_class.hpp) and the
/// combine-input layout Buffer's size hint reads. Plain data: registered in every build.
void register_args(nb::module_& m) {
  nb::class_<Geometry>(m, "IntranodeGeometry",
                       "Lane geometry of an op on one NVL buffer (NvlRuntime.geometry; read-only): notify, dispatch and "
                       "combine take it as computed there")
      .def_ro("num_channels", &Geometry::num_channels, "C = num_sms / 2")
      .def_ro("lanes_per_channel", &Geometry::lanes_per_channel, "W = warps per block / ranks")
      .def_ro("channel_slots", &Geometry::channel_slots, "T = num_max_nvl_chunked_recv_tokens")
      .def_ro("lane_slots", &Geometry::lane_slots, "Tl = T / W: slots of one lane ring")
      .def_ro("chunk_tokens", &Geometry::chunk_tokens, "tokens between two tail publications")
      .def_ro("num_lanes", &Geometry::num_lanes, "L = C * W: columns of the handle's lane matrices")
      .def_ro("lane_region_bytes", &Geometry::lane_region_bytes, "byte stride of the lane rings in the buffer")
      .def_ro("num_ranks", &Geometry::num_ranks, "local ranks it was placed for")
      .def_ro("num_nvl_bytes", &Geometry::num_nvl_bytes, "buffer size it was placed in")
      .def_prop_ro("num_sms", [](const Geometry& g) { return 2 * g.num_channels; }, "blocks of a dispatch or combine")
      .def("__repr__", [](const Geometry& g) {
        return ::uccl_moe::detail::format(
            "IntranodeGeometry(num_channels=%d, lanes_per_channel=%d, channel_slots=%d, lane_slots=%d, "
            "chunk_tokens=%d, num_lanes=%d, lane_region_bytes=%lld)", g.num_channels, g.lanes_per_channel,
            g.channel_slots, g.lane_slots, g.chunk_tokens, g.num_lanes, static_cast<long long>(g.lane_region_bytes));
      });

  using intranode::CombineArgs;
  using intranode::CombinePullArgs;
  using intranode::DispatchArgs;
  using intranode::NotifyArgs;
  bind_args(m, "NotifyArgs", "notify_dispatch's arguments (intranode.hpp NotifyArgs)",
            UCCL_MOE_ARG(NotifyArgs, is_token_in_rank),
            UCCL_MOE_ARG(NotifyArgs, num_tokens_per_rank),
            UCCL_MOE_ARG(NotifyArgs, num_tokens_per_expert),
            UCCL_MOE_ARG(NotifyArgs, num_tokens),
            UCCL_MOE_ARG(NotifyArgs, num_experts),
            UCCL_MOE_ARG(NotifyArgs, expert_alignment),
            UCCL_MOE_ARG(NotifyArgs, write_host_counters),
            UCCL_MOE_ARG(NotifyArgs, lane_prefix),
            UCCL_MOE_ARG(NotifyArgs, rank_prefix),
            UCCL_MOE_ARG(NotifyArgs, recv_lane_start),
            UCCL_MOE_ARG(NotifyArgs, num_tokens_ptr),
            UCCL_MOE_ARG(NotifyArgs, rows_code));
  bind_args(m, "DispatchArgs", "dispatch_intranode's arguments (intranode.hpp DispatchArgs)",
            UCCL_MOE_ARG(DispatchArgs, x),
            UCCL_MOE_ARG(DispatchArgs, x_scales),
            UCCL_MOE_ARG(DispatchArgs, topk_idx),
            UCCL_MOE_ARG(DispatchArgs, topk_weights),
            UCCL_MOE_ARG(DispatchArgs, is_token_in_rank),
            UCCL_MOE_ARG(DispatchArgs, rank_prefix),
            UCCL_MOE_ARG(DispatchArgs, recv_lane_start),
            UCCL_MOE_ARG(DispatchArgs, num_tokens),
            UCCL_MOE_ARG(DispatchArgs, row_bytes),
            UCCL_MOE_ARG(DispatchArgs, num_topk),
            UCCL_MOE_ARG(DispatchArgs, num_scales),
            UCCL_MOE_ARG(DispatchArgs, num_experts),
            UCCL_MOE_ARG(DispatchArgs, scale_token_stride),
            UCCL_MOE_ARG(DispatchArgs, scale_hidden_stride),
            UCCL_MOE_ARG(DispatchArgs, num_recv_rows),
            UCCL_MOE_ARG(DispatchArgs, recv_x),
            UCCL_MOE_ARG(DispatchArgs, recv_scales),
            UCCL_MOE_ARG(DispatchArgs, recv_topk_idx),
            UCCL_MOE_ARG(DispatchArgs, recv_topk_weights),
            UCCL_MOE_ARG(DispatchArgs, recv_src_idx),
            UCCL_MOE_ARG(DispatchArgs, send_head),
            UCCL_MOE_ARG(DispatchArgs, num_tokens_ptr),
            UCCL_MOE_ARG(DispatchArgs, row_map),
            UCCL_MOE_ARG(DispatchArgs, src_tag),
            UCCL_MOE_ARG(DispatchArgs, lane_prefix),
            UCCL_MOE_ARG(DispatchArgs, landing_rows));
  bind_args(m, "CombineArgs", "combine_intranode's arguments (intranode.hpp CombineArgs)",
            UCCL_MOE_ARG(CombineArgs, x),
            UCCL_MOE_ARG(CombineArgs, topk_weights),
            UCCL_MOE_ARG(CombineArgs, bias0),
            UCCL_MOE_ARG(CombineArgs, bias1),
            UCCL_MOE_ARG(CombineArgs, rank_prefix),
            UCCL_MOE_ARG(CombineArgs, recv_lane_start),
            UCCL_MOE_ARG(CombineArgs, send_head),
            UCCL_MOE_ARG(CombineArgs, num_tokens),
            UCCL_MOE_ARG(CombineArgs, hidden),
            UCCL_MOE_ARG(CombineArgs, num_topk),
            UCCL_MOE_ARG(CombineArgs, out),
            UCCL_MOE_ARG(CombineArgs, out_topk_weights),
            UCCL_MOE_ARG(CombineArgs, num_tokens_ptr),
            UCCL_MOE_ARG(CombineArgs, row_map));
  bind_args(m, "CombinePullArgs", "combine_pull_intranode's arguments (intranode.hpp CombinePullArgs)",
            UCCL_MOE_ARG(CombinePullArgs, topk_weights),
            UCCL_MOE_ARG(CombinePullArgs, bias0),
            UCCL_MOE_ARG(CombinePullArgs, bias1),
            UCCL_MOE_ARG(CombinePullArgs, rank_prefix),
            UCCL_MOE_ARG(CombinePullArgs, lane_prefix),
            UCCL_MOE_ARG(CombinePullArgs, send_head),
            UCCL_MOE_ARG(CombinePullArgs, num_tokens),
            UCCL_MOE_ARG(CombinePullArgs, hidden),
            UCCL_MOE_ARG(CombinePullArgs, num_topk),
            UCCL_MOE_ARG(CombinePullArgs, num_lanes),
            UCCL_MOE_ARG(CombinePullArgs, out),
            UCCL_MOE_ARG(CombinePullArgs, out_topk_weights),
            UCCL_MOE_ARG(CombinePullArgs, staged),
            UCCL_MOE_ARG(CombinePullArgs, own_x),
            UCCL_MOE_ARG(CombinePullArgs, ce_chunks),
            UCCL_MOE_ARG(CombinePullArgs, ce_poll));

  m.def("dispatch_rows_code", [](int64_t row_bytes, int num_topk, int num_scales) {
    return dispatch_rows_code(row_bytes, num_topk, num_scales);
  }, "row_bytes"_a, "num_topk"_a, "num_scales"_a,
  "What notify compares between the ranks of a dispatch (NotifyArgs.rows_code): its rows' bytes, top-k entries and "
  "scales per row");

  m.def("intranode_ce_dispatch_landing_bytes", [](const std::vector<int32_t>& rank_tokens, int row_bytes,
                                                  int num_scales) {
    const int N = static_cast<int>(rank_tokens.size());
    UCCL_ASSERT(N >= 1 && N <= kMaxLocalRanks, "rank_tokens has %d entries, expected 1..%d", N, kMaxLocalRanks);
    return intranode::ce_dispatch_landing_most(rank_tokens.data(), N, row_bytes, num_scales);
  }, "rank_tokens"_a, "row_bytes"_a, "num_scales"_a,
  "Bytes from the buffer's start the largest landing area of a copy-engine dispatch needs (every other rank's "
  "tokens of row_bytes with num_scales 4-byte scales each), the same on every rank");

  m.def("intranode_ce_landing_bytes", [](const std::vector<int32_t>& rank_prefix, int hidden, int num_topk) {
    int N = 0;
    while (N * N < static_cast<int>(rank_prefix.size())) ++N;
    UCCL_ASSERT(N >= 1 && N <= kMaxLocalRanks && N * N == static_cast<int>(rank_prefix.size()),
                "rank_prefix has %zu entries: not an [N, N] matrix with N in [1, %d]", rank_prefix.size(),
                kMaxLocalRanks);
    // (combine_input_bytes grows with the rows: the largest area is the one with the most rows)
    return intranode::combine_input_bytes(intranode::ce_landing_rows_most(rank_prefix.data(), N), hidden, num_topk);
  }, "rank_prefix"_a, "hidden"_a, "num_topk"_a,
  "Bytes from the buffer's start the largest landing area of a copy-engine combine needs (rows of hidden BF16 "
  "values, num_topk weights each), the same on every rank: rank_prefix is the handle's [N, N] matrix, row-major");

  m.def("intranode_combine_input_layout", [](int64_t rows, int hidden, int num_topk) {
    return nb::make_tuple(static_cast<int64_t>(intranode::kOffCombineInput),
                          intranode::combine_input_bytes(rows, hidden, num_topk));
  }, "rows"_a, "hidden"_a, "num_topk"_a,
  "(offset, end): where a combine from the buffer finds its [rows, hidden] BF16 input rows in the NVL buffer, and the "
  "bytes it needs from the buffer's start with num_topk staged weights per row");
}

}  // namespace

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
namespace {

using runtime::NvlRuntime;

/// Resets the ring counters (prepare_round: two barriers) before a dispatch or combine whose channel count
/// differs from the one the counters were last reset for; rounds with an unchanged count chain without it.
void ensure_rings(NvlRuntime& rt, const intranode::NvlContext& ctx, const Geometry& g, uintptr_t stream) {
  rt.check_graph_channels(g.num_channels, stream_of(stream));
  if (rt.ring_channels() == g.num_channels) return;
  intranode::launch_prepare_round(ctx, g, stream_of(stream));
  rt.set_ring_channels(g.num_channels);
}

nb::tuple geometry_tuple(const Geometry& g) {
  return nb::make_tuple(g.num_channels, g.lanes_per_channel, g.channel_slots, g.lane_slots, g.chunk_tokens);
}

}  // namespace

void register_runtime(nb::module_& m) {
  register_args(m);
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
      .def_prop_ro("ce_early_ops", &NvlRuntime::ce_early_ops,
                   "copy-engine ops that started their copies before any hand-shake (UCCL_MOE_CE_EARLY)")
      .def_prop_ro("ce_gated_ops", &NvlRuntime::ce_gated_ops,
                   "the polled ones among ce_early_ops: their copies waited for each peer's side memset (the gate)")
      .def_prop_ro("ce_ended_beside", &NvlRuntime::ce_ended_beside,
                   "the gated ones among ce_gated_ops whose end was to run on the side stream (UCCL_MOE_CE_END_BESIDE)")
      .def_prop_ro("ce_gate_ok", &NvlRuntime::ce_gate_ok,
                   "whether stream memory operations worked on this GPU (else polled ops are never early)")
      .def_prop_ro("ce_polled_ops", &NvlRuntime::ce_polled_ops,
                   "copy-engine combines and dispatches that polled (UCCL_MOE_CE_POLL, UCCL_MOE_DISPATCH_CE_POLL)")
      .def_prop_ro("ce_polled_dispatches", &NvlRuntime::ce_polled_dispatches,
                   "the copy-engine dispatches among ce_polled_ops")
      .def_prop_ro("ce_sentinel_sets", &NvlRuntime::ce_sentinel_sets,
                   "sentinel memsets a polled op ran on its own stream before its enter kernel")
      .def_prop_ro("ce_sentinel_side_sets", &NvlRuntime::ce_sentinel_side_sets,
                   "sentinel memsets run on the runtime's side stream after an op (NvlRuntime::note_op)")
      .def("wait_for_sentinel", [](NvlRuntime& r, uintptr_t stream) { r.wait_for_sentinel(stream_of(stream)); },
           "stream"_a, "The stream waits for the last sentinel memset (a get_combine_buffer view is written on it)")
      .def("forget_sentinel", &NvlRuntime::forget_sentinel,
           "The landing area was written behind the runtime's back (the bench's peer copies): set it all next time")
      .def("set_global_rank", &NvlRuntime::set_global_rank, "rank"_a)
      .def("aborted", &NvlRuntime::aborted)
      .def("check_num_sms", &NvlRuntime::check_num_sms, "num_sms"_a,
           "Raises InvalidUsageError if the GPU has fewer SMs than num_sms (every block of an op must be resident)")
      .def("geometry", &NvlRuntime::geometry, "num_sms"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a,
           "The lane geometry of an op with num_sms blocks and these Config chunk sizes on this buffer (validated: "
           "InvalidUsageError names the Config field to change); notify, dispatch and combine take it")
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
        int num_recv = -1, most_recv = -1, most_remote = -1;
        std::vector<int> per_expert, rank_prefix, rank_tokens;
        bool ok;
        {
          nb::gil_scoped_release release;
          ok = r.wait_recv_counts(num_local_experts, &num_recv, &most_recv, &most_remote, &per_expert, &rank_prefix,
                                  &rank_tokens);
        }
        return nb::make_tuple(ok, num_recv, most_recv, most_remote, per_expert, rank_prefix, rank_tokens);
      }, "num_local_experts"_a,
      "Blocks (GIL released) until notify published the receive counts: (ok, num_recv, most_recv, most_remote, "
      "per_expert_counts, rank_prefix, rank_tokens), most_recv being the most rows any local rank receives, "
      "most_remote the most any receives from other ranks, rank_prefix the handle's [N, N] matrix, row-major, and "
      "rank_tokens every rank's token count (both the same on every rank)");

  m.def("intranode_lanes_per_channel", &intranode::lanes_per_channel, "num_ranks"_a);
  m.def("intranode_geometry", [](int num_sms, int num_ranks, int nvl_send, int nvl_recv) {
    return geometry_tuple(intranode::make_geometry(num_sms, num_ranks, nvl_send, nvl_recv));
  }, "num_sms"_a, "num_ranks"_a, "nvl_send_tokens"_a, "nvl_recv_tokens"_a,
  "(num_channels, lanes_per_channel, channel_slots, lane_slots, chunk_tokens)");
  m.def("intranode_required_nvl_bytes", [](int num_sms, int num_ranks, int nvl_send, int nvl_recv, int row_bytes,
                                           int num_topk, int num_scales) {
    return intranode::required_nvl_bytes(intranode::make_geometry(num_sms, num_ranks, nvl_send, nvl_recv), num_ranks,
                                         intranode::SlotLayout::make(row_bytes, num_topk, num_scales));
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

  m.def("intranode_placed_geometry", &intranode::placed_geometry, "num_sms"_a, "num_ranks"_a, "nvl_send_tokens"_a,
        "nvl_recv_tokens"_a, "num_nvl_bytes"_a,
        "The IntranodeGeometry NvlRuntime.geometry returns for a buffer of num_nvl_bytes (without its SM count check)");
  m.def("intranode_slot_placement", [](int num_sms, int num_ranks, int nvl_send, int nvl_recv, int64_t num_nvl_bytes,
                                       int row_bytes, int num_topk, int num_scales) {
    const auto g = intranode::placed_geometry(num_sms, num_ranks, nvl_send, nvl_recv, num_nvl_bytes);
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

  // The ops take the geometry NvlRuntime.geometry computed and one argument struct built by field name.
  m.def("notify_dispatch", [](NvlRuntime& rt, const Geometry& g, const intranode::NotifyArgs& a, uintptr_t stream) {
    rt.check_graph_channels(g.num_channels, stream_of(stream));
    rt.begin_op(stream_of(stream), NvlRuntime::kOpNotify);
    intranode::launch_notify_dispatch(rt.context(), g, a, stream_of(stream));
    rt.set_ring_channels(g.num_channels);  // notify resets the ring counters
    rt.note_op(stream_of(stream), false, NvlRuntime::kOpNotify);
  }, "runtime"_a, "geometry"_a, "args"_a, "stream"_a);

  m.def("dispatch_intranode", [](NvlRuntime& rt, const Geometry& g, const intranode::DispatchArgs& a,
                                 uintptr_t stream) {
    const auto ctx = rt.context();
    rt.begin_op(stream_of(stream), NvlRuntime::kOpRingDispatch);
    ensure_rings(rt, ctx, g, stream);
    intranode::launch_dispatch_intranode(ctx, g, a, stream_of(stream));
    rt.note_op(stream_of(stream), false, NvlRuntime::kOpRingDispatch);
  }, "runtime"_a, "geometry"_a, "args"_a, "stream"_a);

  m.def("dispatch_direct_intranode", [](NvlRuntime& rt, const Geometry& g, const intranode::DispatchArgs& a,
                                        uintptr_t stream) {
    // No ring is used (the handle's lane geometry only places the rows): no ring reset needed. The unpack takes the
    // whole GPU (a grid of two blocks per SM; at its register count one is resident per SM at a time).
    const int unpack_blocks = rt.device_sms() > 0 ? 2 * rt.device_sms() : 264;
    rt.begin_op(stream_of(stream), NvlRuntime::kOpDirectDispatch);
    intranode::launch_dispatch_direct(rt.context(), g, a, unpack_blocks, stream_of(stream));
    rt.note_op(stream_of(stream), false, NvlRuntime::kOpDirectDispatch);  // its hand-shakes are its own
  }, "runtime"_a, "geometry"_a, "args"_a, "stream"_a,
  "The ring-free dispatch (intranode.hpp launch_dispatch_direct): same outputs as dispatch_intranode");
  m.def("intranode_direct_landing_bytes", &intranode::direct_landing_bytes, "rows"_a, "row_bytes"_a, "num_topk"_a,
        "num_scales"_a);

  m.def("combine_intranode", [](NvlRuntime& rt, const Geometry& g, const intranode::CombineArgs& a,
                                uintptr_t stream) {
    const auto ctx = rt.context();
    rt.begin_op(stream_of(stream), NvlRuntime::kOpRingCombine);
    ensure_rings(rt, ctx, g, stream);
    intranode::launch_combine_intranode(ctx, g, a, stream_of(stream));
    rt.note_op(stream_of(stream), false, NvlRuntime::kOpRingCombine);
  }, "runtime"_a, "geometry"_a, "args"_a, "stream"_a);

  m.def("combine_pull_intranode", [](NvlRuntime& rt, int num_sms, int64_t num_rows, const intranode::CombinePullArgs& a,
                                     uintptr_t stream) {
    // No ring is used, so the ring counters need no reset (ensure_rings) and the op's SM count is free.
    rt.check_num_sms(num_sms);
    rt.begin_op(stream_of(stream), NvlRuntime::kOpPullCombine);
    intranode::launch_combine_pull(rt.context(), num_sms, num_rows, a, stream_of(stream));
    rt.note_op(stream_of(stream), true, NvlRuntime::kOpPullCombine);
  }, "runtime"_a, "num_sms"_a, "num_rows"_a, "args"_a, "stream"_a);

  m.def("combine_ce_intranode", [](NvlRuntime& rt, int num_sms, const intranode::CombinePullArgs& a,
                                   const std::vector<int32_t>& rank_prefix, bool early, uintptr_t stream,
                                   const nb::object& outputs, bool poll, bool beside) {
    const int N = rt.num_ranks();
    UCCL_ASSERT(static_cast<int>(rank_prefix.size()) == N * N, "rank_prefix has %zu entries, expected %d x %d",
                rank_prefix.size(), N, N);
    rt.check_num_sms(num_sms);  // no ring: no ensure_rings, as for the pull
    intranode::CombinePullArgs args = a;
    args.ce_poll = rt.ce_poll(stream_of(stream), poll) ? 1 : 0;
    if (args.ce_poll != 0) {  // one copy per peer; the landing area's rows hold the sentinel before it
      args.ce_chunks = 1;
      // Every rank's largest landing area, not its own: the runtime's choices after the op (a memset on the side
      // stream, the rings' reset, no early op) must be the same on every rank, and rest on this extent.
      const int64_t rows = intranode::ce_landing_rows_most(rank_prefix.data(), N);
      rt.begin_op(stream_of(stream), NvlRuntime::kOpPolledCombine,
                  static_cast<int64_t>(intranode::kOffCombineInput) + rows * static_cast<int64_t>(a.hidden) * 2);
    } else {
      rt.begin_op(stream_of(stream), NvlRuntime::kOpCeCombine);
    }
    const int kind = args.ce_poll != 0 ? NvlRuntime::kOpPolledCombine : NvlRuntime::kOpCeCombine;
    const auto ce = rt.ce_copies(rank_prefix.data(), stream_of(stream), early, args.ce_poll != 0, beside);
    std::exception_ptr failed;
    intranode::launch_combine_ce(rt.context(), num_sms, args, ce, stream_of(stream),
                                 late_outputs(outputs, failed, a.num_tokens > 0, a.num_tokens > 0 && a.num_topk > 0,
                                              "copy-engine combine"));
    rt.note_op(stream_of(stream), true, kind);
    if (failed) std::rethrow_exception(failed);
  }, "runtime"_a, "num_sms"_a, "args"_a, "rank_prefix"_a, "early"_a, "stream"_a, "outputs"_a = nb::none(),
  "poll"_a = false, "beside"_a = false,
  "Combine of a caller's tensor through the copy engines (intranode.hpp launch_combine_ce); rank_prefix: the "
  "handle's [N, N] matrix as published to the host by notify (wait_recv_counts), row-major; early: "
  "UCCL_MOE_CE_EARLY (the copies start at once where the op before ended with the done hand-shake; polled, behind "
  "the gate: NvlRuntime::ce_copies); poll: "
  "UCCL_MOE_CE_POLL (one copy per peer into a landing area set to the sentinel, each word summed as it lands; "
  "NvlRuntime.ce_poll says where it is off, NvlRuntime::begin_op how the sentinel is kept); outputs: None "
  "(args.out holds them) or a callable returning (out, out_topk_weights) addresses, called once the first copies "
  "are enqueued (intranode.hpp LateOutputs; what it raises is raised after the launch)");

  m.def("dispatch_ce_intranode", [](NvlRuntime& rt, int num_sms, const intranode::DispatchArgs& a,
                                    const std::vector<int32_t>& rank_prefix, const std::vector<int32_t>& rank_tokens,
                                    int chunks, bool early, uintptr_t stream, const nb::object& outputs,
                                    bool poll, bool beside) {
    const int N = rt.num_ranks();
    UCCL_ASSERT(static_cast<int>(rank_prefix.size()) == N * N && static_cast<int>(rank_tokens.size()) == N,
                "rank_prefix has %zu entries and rank_tokens %zu, expected %d x %d and %d", rank_prefix.size(),
                rank_tokens.size(), N, N, N);
    rt.check_num_sms(num_sms);  // no ring: no ensure_rings
    poll = rt.ce_poll(stream_of(stream), poll);
    if (poll) {  // one copy per peer; the landing area holds the sentinel before it
      chunks = 1;
      // Every rank's largest landing area, as for the polled combine (the runtime's choices must be alike).
      const int64_t end = intranode::ce_dispatch_landing_most(rank_tokens.data(), N, a.row_bytes, a.num_scales);
      // (the host checked the fit on every rank alike; before the memset and the prediction, not after them)
      UCCL_ASSERT(end <= rt.num_nvl_bytes(), "a copy-engine dispatch lands %lld bytes but the Buffer has %lld",
                  static_cast<long long>(end), static_cast<long long>(rt.num_nvl_bytes()));
      rt.begin_op(stream_of(stream), NvlRuntime::kOpPolledDispatch, end);
    } else {
      rt.begin_op(stream_of(stream), NvlRuntime::kOpCeDispatch);
    }
    const int kind = poll ? NvlRuntime::kOpPolledDispatch : NvlRuntime::kOpCeDispatch;
    const auto ce = rt.ce_copies(rank_prefix.data(), stream_of(stream), early, poll, beside);
    std::exception_ptr failed;
    const bool rows = a.num_recv_rows > 0;
    intranode::launch_dispatch_ce(rt.context(), num_sms, a, rank_tokens.data(), chunks, ce, stream_of(stream),
                                  late_outputs(outputs, failed, rows, rows && a.num_scales > 0,
                                               "copy-engine dispatch"), poll);
    rt.note_op(stream_of(stream), true, kind);
    if (failed) std::rethrow_exception(failed);
  }, "runtime"_a, "num_sms"_a, "args"_a, "rank_prefix"_a, "rank_tokens"_a, "chunks"_a, "early"_a, "stream"_a,
  "outputs"_a = nb::none(), "poll"_a = false, "beside"_a = false,
  "Cached dispatch through the copy engines (intranode.hpp launch_dispatch_ce); args.recv_src_idx is the handle's "
  "(read); rank_prefix and rank_tokens as notify published them (wait_recv_counts); early, outputs (here "
  "(recv_x, recv_scales)) as for combine_ce_intranode; poll: UCCL_MOE_DISPATCH_CE_POLL (chunks is then 1; the gather "
  "polls as the combine's sum does)");

  m.def("stage_combine_rows_intranode", [](NvlRuntime& rt, uintptr_t x, int hidden, int64_t max_rows,
                                           uintptr_t rank_prefix, uintptr_t stream) {
    // The whole GPU (two blocks per SM): an HBM-bound copy, done before the pull's SMs start.
    const int blocks = rt.device_sms() > 0 ? 2 * rt.device_sms() : 264;
    rt.begin_op(stream_of(stream), NvlRuntime::kOpStage);
    intranode::launch_stage_combine_rows(rt.context(), reinterpret_cast<const void*>(x), hidden, max_rows,
                                         reinterpret_cast<const int32_t*>(rank_prefix), blocks, stream_of(stream));
    rt.note_op(stream_of(stream), false, NvlRuntime::kOpStage);
  }, "runtime"_a, "x"_a, "hidden"_a, "max_rows"_a, "rank_prefix"_a, "stream"_a,
  "A staged combine's first half: the rows of x that came from other ranks into this rank's buffer (intranode.hpp)");

  m.def("peer_copy", [](NvlRuntime& rt, int peer, int64_t bytes, uintptr_t stream) {
    rt.begin_op(stream_of(stream), NvlRuntime::kOpPeerCopy);
    intranode::launch_peer_copy(rt.context(), peer, bytes, stream_of(stream));
    rt.note_op(stream_of(stream), false, NvlRuntime::kOpPeerCopy);
  }, "runtime"_a, "peer"_a, "bytes"_a, "stream"_a,
  "Copy-engine copy of `bytes` from this rank's NVL ring region into peer's (benchmark ceiling)");
}

#else

void register_runtime(nb::module_& m) { register_args(m); }

#endif

}  // namespace uccl_moe::bindings
