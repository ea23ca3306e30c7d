"""The native backend: our NVLink/xGMI kernels inside a node and the CPU-proxy path across nodes.

The kernels are built into ``uccl_moe._C`` when CUDA or HIP is found at install time.
"""

from __future__ import annotations

from .. import _C
from .base import Backend, BufferContext, register_backend


class NativeBackend(Backend):
    name = "native"

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        missing = []
        if _C.gpu_backend() == "none":
            missing.append("this build has no GPU support (no nvcc/hipcc was found at install time)")
        if not _C.has_intranode_kernels():
            missing.append("the native intranode HT kernels (layout/notify/dispatch/combine) are not built yet")
        if ctx.topology.num_nodes > 1:
            missing.append("the internode path through the CPU proxy is not built yet")
        raise NotImplementedError(
            "uccl-moe native backend unavailable: " + "; ".join(missing) + ". Use backend='reference' "
            "(or UCCL_MOE_BACKEND=reference) to run on torch.distributed all-to-all meanwhile"
        )

    def get_dispatch_layout(self, topk_idx, num_experts):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def dispatch(self, req):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def cached_dispatch(self, x, x_scales, handle, config):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def combine(self, x, handle, topk_weights, bias, config):  # type: ignore[no-untyped-def]
        raise NotImplementedError


register_backend("native", NativeBackend)
