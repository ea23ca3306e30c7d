"""The Buffer API under torch's process-wide default device and dtype (issue 29).

Every tensor uccl_moe makes names its device and dtype, so a client's ``set_default_device`` /
``set_default_dtype`` / ``with torch.device(...)`` changes nothing: each mode of ``helpers.defaults`` must give
bit-identical results to the plain run, on CPU tensors, in the documented dtypes. The ``meta`` modes catch any tensor
made without ``device=`` (it would land on meta and fail on first use), the ``dtype`` modes any float tensor made
without ``dtype=``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.defaults import CPU_MODES, torch_defaults
from helpers.mp import run_ranks

pytestmark = [pytest.mark.mp, pytest.mark.timeout(300)]

HIDDEN = 256
EXPERTS_PER_RANK = 3


def make_inputs(rank: int, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Routing, BF16/FP32/FP8 rows and weights of one rank, built with explicit devices and dtypes."""
    gen = torch.Generator().manual_seed(17 + rank)
    E = EXPERTS_PER_RANK * world
    T = 24 + 5 * rank
    K = 4
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int64)
    idx[torch.rand((T, K), generator=gen, dtype=torch.float32) < 0.2] = -1
    x = torch.randn((T, HIDDEN), generator=gen, dtype=torch.float32)
    return {
        "idx": idx.to(device),
        "w": torch.rand((T, K), generator=gen, dtype=torch.float32).to(device),
        "x_bf16": x.to(torch.bfloat16).to(device),
        "x_fp32": x.to(device),
        "x_fp8": x.to(torch.float8_e4m3fn).to(device),
        "scales": (torch.rand((T, HIDDEN // 128), generator=gen, dtype=torch.float32) + 0.5).to(device),
        "bias": torch.randn((T, HIDDEN), generator=gen, dtype=torch.float32).to(torch.bfloat16).to(device),
    }


def buffer_ops(buf, inp: dict[str, torch.Tensor], num_experts: int,
               row_names: tuple[str, ...] = ("x_bf16", "x_fp32")) -> dict[str, torch.Tensor]:
    """Every HT call once (layout, dispatch of each of `row_names` then FP8, worst-case rows, cached, combine with
    weights and bias, the combine buffer); returns the outputs by name."""
    out: dict[str, torch.Tensor] = {}
    lay = buf.get_dispatch_layout(inp["idx"], num_experts)
    out.update(ntr=lay.num_tokens_per_rank, nte=lay.num_tokens_per_expert, itr=lay.is_token_in_rank)
    layout = dict(num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                  num_tokens_per_expert=lay.num_tokens_per_expert)
    for name in row_names:
        res = buf.dispatch(inp[name], topk_idx=inp["idx"], topk_weights=inp["w"], expert_alignment=4, **layout)
        out[f"{name}/recv_x"], out[f"{name}/recv_idx"], out[f"{name}/recv_w"] = res[0], res[1], res[2]
        out[f"{name}/counts"] = torch.tensor(res.num_recv_tokens_per_expert_list, dtype=torch.int64, device="cpu")
        cached = buf.dispatch(inp[name], handle=res.handle)
        out[f"{name}/cached"] = cached.recv_x
        rows = buf.get_combine_buffer(res.handle, HIDDEN, dtype=res.recv_x.dtype)
        rows.copy_(res.recv_x)
        bias = inp["bias"].to(res.recv_x.dtype)
        comb = buf.combine(rows, res.handle, topk_weights=res.recv_topk_weights, bias=bias)
        out[f"{name}/combined"], out[f"{name}/combined_w"] = comb.combined_x, comb.combined_topk_weights
    fp8 = buf.dispatch((inp["x_fp8"], inp["scales"]), topk_idx=inp["idx"], topk_weights=inp["w"],
                       num_worst_tokens=64 * buf.group_size, **layout)
    real = (fp8.recv_topk_idx >= 0).any(1)  # padding rows past the received ones hold no defined data
    out["fp8/recv_x"], out["fp8/recv_scales"] = fp8.recv_x[0].view(torch.uint8)[real], fp8.recv_x[1][real]
    out["fp8/recv_idx"] = fp8.recv_topk_idx
    return out


def under_every_mode(rank: int, world: int, modes: tuple[str, ...], backend: str = "reference") -> dict[str, str]:
    """Rank body (also of the GPU variant, tests/gpu/test_default_device_gpu.py): the plain run, then each mode."""
    from uccl_moe import Buffer

    R = world
    E = EXPERTS_PER_RANK * R
    cfg = Buffer.get_dispatch_config(R)
    nvl = max(cfg.get_nvl_buffer_size_hint(HIDDEN * 4, R), Buffer.get_combine_buffer_size_hint(64 * R, HIDDEN, 4))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "native" else torch.device("cpu")
    rows = ("x_bf16",) if backend == "native" else ("x_bf16", "x_fp32")  # the native kernels combine BF16 only
    inp = make_inputs(rank, world, device)
    ref = buffer_ops(Buffer(dist.group.WORLD, nvl, 0, backend=backend), inp, E, rows)
    failures: dict[str, str] = {}
    for mode in modes:
        try:
            with torch_defaults(mode):
                buf = Buffer(dist.group.WORLD, nvl, 0, backend=backend)
                got = buffer_ops(buf, inp, E, rows)
            for k, v in ref.items():
                g = got[k]
                assert g.device == v.device, f"{k}: on {g.device}, expected {v.device}"
                assert g.dtype == v.dtype, f"{k}: {g.dtype}, expected {v.dtype}"
                assert torch.equal(g, v), f"{k}: differs from the plain run"
        except Exception as e:  # noqa: BLE001 - collect every mode's failure, not just the first
            failures[mode] = f"{type(e).__name__}: {e}"
    return failures


def test_buffer_api_ignores_default_device_and_dtype():
    for rank, failures in enumerate(run_ranks(under_every_mode, 2, CPU_MODES,
                                              env={"UCCL_MOE_BACKEND": "reference"})):
        assert not failures, f"rank {rank}: {failures}"


def test_host_ints_under_default_device_meta():
    """The helper the issue names: a host read of an int tensor must not create tensors on the default device."""
    from uccl_moe.utils import host_ints

    t = torch.tensor([3, -1, 7], dtype=torch.int64, device="cpu")
    for mode in CPU_MODES:
        with torch_defaults(mode):
            assert host_ints(t) == [3, -1, 7]
