"""Host microseconds of Buffer's own Python path per op (validation, argument set-up, stream plumbing), on a CPU with
no GPU: a world-of-one gloo Buffer whose backend returns ready-made tensors, so only Buffer's code is timed (plus two
small allocations per non-cached dispatch). Each figure is the median over 7 rounds of --calls / 7 calls (this
machine's other load shows as slow rounds).

``--native`` times the native backend's own Python as well, for the copy-engine ops the bench's default mode runs
(the cached FP8 dispatch with column-major scales, the cached BF16 dispatch, the combine of a caller's tensor): a
NativeBackend whose runtime and copy-engine launches are stand-ins that do nothing but ask for the outputs (the
copy-engine knobs forced on, since the world has one rank), so what is timed is Buffer's and the backend's Python
before and after the native launch, and the outputs' allocation (on the CPU; a CPU Buffer has no comm stream, so
the stream joins a GPU Buffer makes are not timed).
Usage: python tools/device/python_path.py [--calls 3000] [--profile dispatch] [--native [--profile cached_fp8]]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 256, 8


def _null_backend(ctx: Any) -> Any:
    from uccl_moe.backends.base import Backend

    class Null(Backend):
        """Returns tensors of the right shapes and does nothing."""

        name = "null"

        def __init__(self, ctx: Any) -> None:
            super().__init__(ctx)
            self.layout = (torch.zeros(1, dtype=torch.int32), None, torch.zeros(E, dtype=torch.int32),
                           torch.ones((T, 1), dtype=torch.bool))
            i32 = torch.int32
            self.handle = (torch.zeros((1, 1), dtype=i32), torch.zeros((1, 4), dtype=i32),
                           torch.zeros((1, 4), dtype=i32), torch.arange(T, dtype=i32),
                           torch.ones((T, 1), dtype=torch.bool), torch.zeros((T, 1), dtype=i32))
            self.rows = torch.zeros((T, H), dtype=torch.bfloat16)

        def get_dispatch_layout(self, topk_idx: Any, num_experts: int) -> Any:
            return self.layout

        def dispatch(self, req: Any) -> Any:
            return (self.rows, None, torch.zeros((T, K), dtype=torch.int64), torch.zeros((T, K)), [0] * E,
                    self.handle)

        def cached_dispatch(self, x: Any, x_scales: Any, handle: Any, config: Any) -> Any:
            return self.rows, None

        def combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any, config: Any) -> Any:
            return self.rows, None

    return Null(ctx)


class _IdleRuntime:
    """The calls the native backend's Python makes on its runtime around a copy-engine op, answered as a healthy
    runtime with nothing recorded."""

    local_buffer = 1 << 40  # a caller's tensor never lies there
    topk_fault_device = 0

    def aborted(self) -> bool:
        return False

    def take_topk_fault(self) -> None:
        return None

    def destroy(self) -> None:
        pass


def _native_shell(buf: Any, T: int, H: int) -> tuple[Any, Any]:
    """(NativeBackend with _IdleRuntime, a cached handle of T tokens all received from this one rank) on `buf`'s
    context; the copy-engine launches are replaced while ops run (see main)."""
    from uccl_moe import _C
    from uccl_moe._checks import HANDLE_KEY_ATTR
    from uccl_moe.backends import _buffer_paths as bp
    from uccl_moe.backends.native import NativeBackend
    from uccl_moe.results import DispatchHandle
    from uccl_moe.utils import RoutingMemo

    nb = object.__new__(NativeBackend)
    nb.ctx, nb.R, nb.R_all, nb.me = buf._backend.ctx, 1, 1, 0
    nb.W, nb._inter, nb._rt = _C.intranode_lanes_per_channel(1), None, _IdleRuntime()
    nb._layout_checked = RoutingMemo()
    nb._stream = lambda: 0  # type: ignore[method-assign]
    i32 = torch.int32
    lanes = 12 * nb.W  # 24 SMs: 12 channels
    rank_prefix = torch.full((1, 1), T, dtype=i32)
    for attr, value in ((bp._RANK_PREFIX_HOST_ATTR, [T]), (bp._RANK_TOKENS_HOST_ATTR, [T]), (bp._MOST_ROWS_ATTR, T),
                        (bp._MOST_REMOTE_ATTR, 0), (HANDLE_KEY_ATTR, buf._handle_key)):
        setattr(rank_prefix, attr, value)
    handle = DispatchHandle(rank_prefix_matrix=rank_prefix, channel_prefix_matrix=torch.zeros((1, lanes), dtype=i32),
                            recv_channel_prefix_matrix=torch.zeros((1, lanes), dtype=i32),
                            recv_src_idx=torch.arange(T, dtype=i32),
                            is_token_in_rank=torch.ones((T, 1), dtype=torch.bool),
                            send_head=torch.zeros((T, 1), dtype=i32))
    return nb, handle


def _native_ops(buf: Any, T: int, H: int) -> dict[str, Any]:
    """The bench's default-mode calls on a native shell (_native_shell) swapped into `buf`."""
    buf._backend, h = _native_shell(buf, T, H)
    x8 = torch.randn((T, H)).to(torch.float8_e4m3fn)
    scales = torch.rand((H // 128, T)).t()  # column-major, as DeepGEMM-style casts give them
    xb, y = torch.randn((T, H)).bfloat16(), torch.randn((T, H)).bfloat16()
    return {"cached_fp8": lambda: buf.dispatch((x8, scales), handle=h),
            "cached_bf16": lambda: buf.dispatch(xb, handle=h), "combine_ce": lambda: buf.combine(y, h)}


def _asking_launch() -> Any:
    """A stand-in for a copy-engine launch: asks for its outputs (its callable argument) once, as the real one
    does."""
    def launch(*args: Any) -> None:
        next(a for a in reversed(args) if callable(a))()
    return launch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--native", action="store_true", help="the native backend's Python too (copy-engine ops)")
    p.add_argument("--profile", choices=("layout", "dispatch", "cached", "combine", "cached_fp8", "cached_bf16",
                                         "combine_ce"), help="cProfile this op after")
    args = p.parse_args()
    native_ops = ("cached_fp8", "cached_bf16", "combine_ce")
    if args.profile is not None and (args.profile in native_ops) != args.native:
        p.error(f"--profile {args.profile} is an op of {'--native' if args.native is False else 'the default mode'}: "
                f"pick from {', '.join(native_ops) if args.native else 'layout, dispatch, cached, combine'}")
    if args.native:
        from uccl_moe import _C

        for knob in ("DISPATCH_CE", "COMBINE_CE"):  # one rank: EP1, where auto takes the rings
            os.environ[f"UCCL_MOE_{knob}"] = "1"
        for name in ("dispatch_ce_intranode", "combine_ce_intranode"):
            setattr(_C, name, _asking_launch())
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        from uccl_moe import Buffer

        nvl = Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1)
        buf = Buffer(dist.group.WORLD, 4 * nvl if args.native else nvl, backend="reference")  # native: 24 SMs' rings
        buf._backend = _null_backend(buf._backend.ctx)  # type: ignore[union-attr]
        idx, w, x = torch.randint(0, E, (T, K)), torch.rand((T, K)), torch.randn((T, H)).bfloat16()
        lay = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                      num_tokens_per_expert=lay.num_tokens_per_expert)
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        ops = _native_ops(buf, T, H) if args.native else {"layout": lambda: buf.get_dispatch_layout(idx, E),
               "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout),
               "cached": lambda: buf.dispatch(x, handle=r.handle),
               "combine": lambda: buf.combine(r.recv_x, r.handle)}
        for name, fn in ops.items():
            for _ in range(200):
                fn()
            n = max(1, args.calls // 7)
            rounds = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                rounds.append((time.perf_counter() - t0) / n * 1e6)
            print(f"{name}: {statistics.median(rounds):.1f} us per call")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                ops[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        buf.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
