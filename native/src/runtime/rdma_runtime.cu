#include "rdma_runtime.hpp"

#include <vector>

#include "gpu_memory_ops.hpp"
#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"
#include "uccl_moe/gpu_check.cuh"
#include "uccl_moe/log.hpp"
#include "uccl_moe/transport.hpp"

namespace uccl_moe::runtime {

RdmaRuntime::RdmaRuntime(int rank, int num_ranks, int ranks_per_node, int64_t num_rdma_bytes, int device,
                         const std::string& job, std::shared_ptr<KvStore> store, int num_threads)
    : rank_(rank), num_ranks_(num_ranks), ranks_per_node_(ranks_per_node), device_(device),
      num_rdma_bytes_(num_rdma_bytes) {
  UCCL_ASSERT(ranks_per_node >= 1 && num_ranks % ranks_per_node == 0,
              "internode runtime: %d ranks do not split into nodes of %d", num_ranks, ranks_per_node);
  UCCL_ASSERT(num_ranks / ranks_per_node <= internode::kMaxNodes, "%d nodes exceed the supported %d",
              num_ranks / ranks_per_node, internode::kMaxNodes);
  UCCL_ASSERT(num_rdma_bytes >= 4 * internode::kNotifyReserveBytes && num_rdma_bytes % 4096 == 0,
              "num_rdma_bytes=%lld must be a multiple of 4096 and at least %lld (use Config.get_rdma_buffer_size_hint)",
              static_cast<long long>(num_rdma_bytes), static_cast<long long>(4 * internode::kNotifyReserveBytes));
  ops_ = make_gpu_memory_ops(device);
  UCCL_CHECK_GPU(gpu::set_device(device));
  // The loopback transport stages through pinned host memory unless asked for GPU copies (copy engines over CUDA IPC).
  // The proxy thread then issues CUDA calls that our spinning kernels wait for, which deadlocks against (a) lazy kernel
  // loading (a first launch waits for the context to go idle), so eager loading is required, and (b) a blocking
  // pageable device-to-host copy by the application, which holds a driver lock the proxy's copies need while it
  // waits for the stream (docs/internode.md, "Loopback on GPUs"). The host-staged proxy calls no CUDA at all.
  const std::string transport = resolve_transport(env::TRANSPORT());  // the proxy gets the same, unprobed again
  const bool host_staged = transport == "loopback" && !env::LOOPBACK_GPU_COPY();
  UCCL_ASSERT(host_staged || transport != "loopback" || !gpu::lazy_module_loading(),
              "UCCL_MOE_LOOPBACK_GPU_COPY=1 needs eager kernel loading: set CUDA_MODULE_LOADING=EAGER before the "
              "process starts CUDA (import uccl_moe before the first CUDA call does it for you), or unset "
              "UCCL_MOE_LOOPBACK_GPU_COPY (host-staged)");
  if (!host_staged) UCCL_CHECK_GPU(gpu::device_malloc(&buffer_, static_cast<size_t>(num_rdma_bytes)));
  epochs_ = static_cast<int64_t*>(ops_->alloc_device(sizeof(int64_t) * internode::kNumSlots * num_ranks));
  ProxyOptions o;
  o.rank = rank;
  o.num_ranks = num_ranks;
  o.ranks_per_node = ranks_per_node;
  o.job = job;
  o.transport = transport;
  if (num_threads > 0) o.num_threads = num_threads;  // else UCCL_MOE_PROXY_THREADS
  o.data_bytes = static_cast<uint64_t>(num_rdma_bytes);
  o.data_ptr = buffer_;  // null when host-staged: the transport allocates (shared memory) and we register it
  o.gpu = ops_;
  o.gpu_data = !host_staged;
  char bus_id[32] = {0};  // the GPU's PCI address: the transport picks the NIC nearest to it
  if (gpu::is_success(gpu::pci_bus_id(bus_id, sizeof bus_id, device))) o.gpu_pci_bus_id = bus_id;
  o.local_rank = rank % ranks_per_node;
  proxy_ = std::make_unique<Proxy>(o, std::move(store));
  if (host_staged) {
    host_data_ = proxy_->data();
    UCCL_CHECK_GPU(gpu::host_register_mapped(host_data_, static_cast<size_t>(num_rdma_bytes)));
    UCCL_CHECK_GPU(gpu::host_device_pointer(&buffer_, host_data_));
  }
  std::vector<FifoDeviceHandle> table;
  for (int i = 0; i < proxy_->num_fifos(); ++i) table.push_back(proxy_->fifo(i).device_handle());
  fifo_table_ = ops_->alloc_device(sizeof(FifoDeviceHandle) * table.size());
  UCCL_CHECK_GPU(gpu::memcpy_async(fifo_table_, table.data(), sizeof(FifoDeviceHandle) * table.size(), nullptr));
  UCCL_CHECK_GPU(gpu::device_synchronize());
  UCCL_LOG(INFO, MEM, "RDMA buffer of %lld bytes at %p on device %d (rank %d of %d, %d per node, %d FIFOs over %s)",
           static_cast<long long>(num_rdma_bytes), buffer_, device, rank, num_ranks, ranks_per_node,
           proxy_->num_fifos(), proxy_->transport_name().c_str());
}

RdmaRuntime::~RdmaRuntime() {
  try {
    destroy();
  } catch (const std::exception& e) {
    UCCL_LOG(WARN, MEM, "RdmaRuntime destroy failed: %s", e.what());
  }
}

void RdmaRuntime::start() {
  UCCL_ASSERT(!destroyed_, "the RDMA runtime was destroyed");
  proxy_->start();
}

void RdmaRuntime::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  gpu::set_device(device_);
  gpu::device_synchronize();  // no kernel still pushes into the FIFOs
  try {
    if (proxy_) proxy_->stop();
  } catch (const std::exception& e) {
    UCCL_LOG(WARN, PROXY, "proxy of rank %d stopped with an error: %s", rank_, e.what());
  }
  if (host_data_) {
    gpu::host_unregister(host_data_);  // before the proxy (and its transport) unmaps the region
    host_data_ = nullptr;
  } else if (buffer_) {
    gpu::device_free(buffer_);
  }
  buffer_ = nullptr;
  ops_->free_device(fifo_table_);
  ops_->free_device(epochs_);
  proxy_.reset();  // closes the peers' mappings (IPC or shared memory) after the GPU let go of them
}

void RdmaRuntime::check() const {
  if (proxy_) proxy_->check();
}

bool RdmaRuntime::failed() const { return proxy_ && proxy_->abort_flag().load(std::memory_order_acquire) != 0; }

internode::RdmaContext RdmaRuntime::context(const NvlRuntime& nvl) const {
  UCCL_ASSERT(!destroyed_, "the RDMA runtime was destroyed; create a new Buffer");
  const intranode::NvlContext n = nvl.context();
  internode::RdmaContext c{};
  c.rdma_buffer = static_cast<char*>(buffer_);
  c.num_rdma_bytes = num_rdma_bytes_;
  c.counters = proxy_->counters_device();
  c.epochs = epochs_;
  c.fifos = static_cast<const FifoDeviceHandle*>(fifo_table_);
  c.num_fifos = proxy_->num_fifos();
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.ranks_per_node = ranks_per_node_;
  c.num_nodes = num_ranks_ / ranks_per_node_;
  c.node = rank_ / ranks_per_node_;
  c.local = rank_ % ranks_per_node_;
  c.diag_record = n.diag_record;
  c.abort_flag = n.abort_flag;
  c.timeout_ns = n.timeout_ns;
  return c;
}

}  // namespace uccl_moe::runtime
