// Bindings of the internode runtime (RDMA buffer + CPU proxy in GPU mode) and the internode kernels. Like the
// intranode bindings: raw device pointers as ints (0 = absent), a stream handle; uccl_moe/backends/native.py owns
// the tensors, computes the per-call offsets on the device and validates shapes.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "args_class.hpp"
#include "bindings.hpp"
#include "uccl_moe/error.hpp"

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
#include "../../bench/fifo_gpu_bench.hpp"
#include "../kernels/internode/internode.hpp"
#include "../runtime/nvl_runtime.hpp"
#include "../runtime/rdma_runtime.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace uccl_moe::bindings {

#if defined(UCCL_MOE_WITH_INTRANODE_KERNELS)
namespace {

using runtime::NvlRuntime;
using runtime::RdmaRuntime;


nb::dict layout_dict(const internode::RdmaLayout& l) {
  nb::dict d;
  d["cap"] = l.cap;
  d["half_bytes"] = l.half_bytes;
  d["off_x"] = l.off_x;
  d["off_scales"] = l.off_scales;
  d["off_topk"] = l.off_topk;
  d["off_weights"] = l.off_weights;
  d["off_mask"] = l.off_mask;
  d["off_src"] = l.off_src;
  return d;
}

internode::RdmaLayout dispatch_layout_of(const RdmaRuntime& rt, int row_bytes, int num_scales, int num_topk,
                                         int ranks_per_node) {
  return internode::dispatch_layout(rt.num_rdma_bytes(), row_bytes, num_scales, num_topk, ranks_per_node);
}

}  // namespace

void register_internode(nb::module_& m) {
  nb::class_<RdmaRuntime>(m, "RdmaRuntime",
                          "Per-rank RDMA buffer (GPU memory) served by the CPU proxy; kernels push commands into its "
                          "GPU-mapped FIFOs")
      .def("__init__", [](RdmaRuntime* self, int rank, int num_ranks, int ranks_per_node, int64_t num_rdma_bytes,
                          int device, const std::string& job, nb::object store_set, nb::object store_get,
                          int num_threads) {
        new (self) RdmaRuntime(rank, num_ranks, ranks_per_node, num_rdma_bytes, device, job,
                               python_store(store_set, store_get), num_threads);
      }, "rank"_a, "num_ranks"_a, "ranks_per_node"_a, "num_rdma_bytes"_a, "device"_a, "job"_a, "store_set"_a,
      "store_get"_a, "num_threads"_a = 0)
      .def("start", [](RdmaRuntime& r) {
        nb::gil_scoped_release release;  // the store callbacks take the GIL back
        r.start();
      })
      // Keeps the GIL: destroying the proxy drops the bootstrap store, which holds Python callables.
      .def("destroy", &RdmaRuntime::destroy)
      .def("check", &RdmaRuntime::check, "rethrows the proxy's first error")
      .def("failed", &RdmaRuntime::failed)
      .def_prop_ro("buffer", &RdmaRuntime::buffer)
      .def_prop_ro("num_rdma_bytes", &RdmaRuntime::num_rdma_bytes)
      .def_prop_ro("host_staged", &RdmaRuntime::host_staged,
                   "loopback data path: True = pinned host memory copied by the proxy, False = GPU memory")
      .def("proxy_counters", [](const RdmaRuntime& r) { return counters_dict(r.proxy().counters_total()); })
      .def_prop_ro("transport", [](const RdmaRuntime& r) { return r.proxy().transport_name(); });

  m.def("internode_dispatch_layout", [](int64_t num_rdma_bytes, int row_bytes, int num_scales, int num_topk,
                                        int ranks_per_node) {
    return layout_dict(internode::dispatch_layout(num_rdma_bytes, row_bytes, num_scales, num_topk, ranks_per_node));
  }, "num_rdma_bytes"_a, "row_bytes"_a, "num_scales"_a, "num_topk"_a, "ranks_per_node"_a);
  m.def("internode_combine_layout", [](int64_t num_rdma_bytes, int hidden, int num_topk) {
    return layout_dict(internode::combine_layout(num_rdma_bytes, hidden, num_topk));
  }, "num_rdma_bytes"_a, "hidden"_a, "num_topk"_a);

  bind_args(m, "PackArgs", "rdma_pack's arguments (internode.hpp PackArgs; the binding adds the RDMA layout and areas)",
            UCCL_MOE_ARG(internode::PackArgs, x), UCCL_MOE_ARG(internode::PackArgs, x_scales),
            UCCL_MOE_ARG(internode::PackArgs, scale_token_stride),
            UCCL_MOE_ARG(internode::PackArgs, scale_hidden_stride), UCCL_MOE_ARG(internode::PackArgs, topk_idx),
            UCCL_MOE_ARG(internode::PackArgs, topk_weights), UCCL_MOE_ARG(internode::PackArgs, is_token_in_rank),
            UCCL_MOE_ARG(internode::PackArgs, send_pos), UCCL_MOE_ARG(internode::PackArgs, dst_row),
            UCCL_MOE_ARG(internode::PackArgs, num_tokens), UCCL_MOE_ARG(internode::PackArgs, num_experts));
  m.def("rdma_pack", [](RdmaRuntime& rt, NvlRuntime& nvl, const internode::PackArgs& args, int row_bytes,
                        int num_scales, int num_topk, uintptr_t stream) {
    const auto ctx = rt.context(nvl);
    internode::PackArgs a = args;
    a.layout = dispatch_layout_of(rt, row_bytes, num_scales, num_topk, ctx.ranks_per_node);
    a.recv = internode::area_of(ctx.rdma_buffer, a.layout);
    a.send = internode::area_of(ctx.rdma_buffer + a.layout.half_bytes, a.layout);
    internode::launch_rdma_pack(ctx, a, stream_of(stream));
  }, "runtime"_a, "nvl"_a, "args"_a, "row_bytes"_a, "num_scales"_a, "num_topk"_a, "stream"_a,
  "Stages each token once per destination node (the dispatch layout of these row sizes: internode_dispatch_layout)");

  m.def("rdma_post", [](RdmaRuntime& rt, NvlRuntime& nvl, uintptr_t rows, uintptr_t src_row, uintptr_t dst_row,
                        const std::vector<std::vector<int64_t>>& arrays, int slot, int64_t peer_cap,
                        uintptr_t stream) {
    UCCL_ASSERT(arrays.size() <= 6, "at most 6 arrays per post, got %zu", arrays.size());
    internode::PostArgs a{};
    a.rows = ptr<const int32_t>(rows);
    a.src_row = ptr<const int64_t>(src_row);
    a.dst_row = ptr<const int64_t>(dst_row);
    a.num_arrays = static_cast<int32_t>(arrays.size());
    for (size_t i = 0; i < arrays.size(); ++i) {
      UCCL_ASSERT(arrays[i].size() == 3, "post array %zu: expected (src_off, dst_off, row_bytes)", i);
      a.arrays[i] = internode::PostArray{arrays[i][0], arrays[i][1], static_cast<int32_t>(arrays[i][2])};
    }
    a.slot = slot;
    a.peer_cap = peer_cap;
    internode::launch_rdma_post(rt.context(nvl), a, stream_of(stream));
  }, "runtime"_a, "nvl"_a, "rows"_a, "src_row"_a, "dst_row"_a, "arrays"_a, "slot"_a, "peer_cap"_a, "stream"_a,
  "Pushes, per remote node, WRITEs of `rows[n]` rows of each (src_off, dst_off, row_bytes) array and an arrival");
  m.def("rdma_notify", [](RdmaRuntime& rt, NvlRuntime& nvl, int64_t offset, int row_bytes, uintptr_t stream) {
    internode::launch_rdma_notify(rt.context(nvl), offset, row_bytes, stream_of(stream));
  }, "runtime"_a, "nvl"_a, "offset"_a, "row_bytes"_a, "stream"_a,
  "All-gather of one row per rank through the proxy (row `rank` at `offset` goes to every rank)");
  m.def("internode_notify_offset", [](int64_t num_rdma_bytes, int parity) {
    return num_rdma_bytes - internode::kNotifyReserveBytes + (parity & 1) * (internode::kNotifyReserveBytes / 2);
  }, "num_rdma_bytes"_a, "parity"_a);
  m.def("rdma_wait", [](RdmaRuntime& rt, NvlRuntime& nvl, int slot, uintptr_t stream) {
    internode::launch_rdma_wait(rt.context(nvl), slot, stream_of(stream));
  }, "runtime"_a, "nvl"_a, "slot"_a, "stream"_a);
  m.def("rail_barrier", [](RdmaRuntime& rt, NvlRuntime& nvl, uintptr_t stream) {
    internode::launch_rail_barrier(rt.context(nvl), stream_of(stream));
  }, "runtime"_a, "nvl"_a, "stream"_a);
  m.def("combine_reduce", [](uintptr_t send_pos, uintptr_t part_x, uintptr_t part_w, uintptr_t bias0,
                             uintptr_t bias1, int num_tokens, int hidden, int num_topk, int num_nodes, uintptr_t out,
                             uintptr_t out_topk_weights, uintptr_t stream) {
    internode::ReduceArgs a{ptr<const int32_t>(send_pos), ptr<const uint64_t>(part_x), ptr<const uint64_t>(part_w),
                            ptr<const void>(bias0), ptr<const void>(bias1), num_tokens, hidden, num_topk, num_nodes,
                            ptr<void>(out), ptr<float>(out_topk_weights)};
    internode::launch_combine_reduce(a, stream_of(stream));
  }, "send_pos"_a, "part_x"_a, "part_w"_a, "bias0"_a, "bias1"_a, "num_tokens"_a, "hidden"_a, "num_topk"_a,
  "num_nodes"_a, "out"_a, "out_topk_weights"_a, "stream"_a);
  m.def("fifo_bench", [](RdmaRuntime& rt, NvlRuntime& nvl, int num_fifos, int cmds, int dst_rank, bool pingpong,
                         uintptr_t out_ns, uintptr_t stream, int producers) {
    bench::launch_fifo_bench(rt.context(nvl), num_fifos, producers, cmds, dst_rank, pingpong, ptr<int64_t>(out_ns),
                             stream_of(stream));
  }, "runtime"_a, "nvl"_a, "num_fifos"_a, "cmds"_a, "dst_rank"_a, "pingpong"_a, "out_ns"_a, "stream"_a,
  "producers"_a = 1);
  m.def("has_internode_kernels", []() { return true; });
}

#else

void register_internode(nb::module_& m) {
  m.def("has_internode_kernels", []() { return false; });
}

#endif

}  // namespace uccl_moe::bindings
