"""Operand helpers the native intranode and internode paths share (so that neither imports the other)."""

from __future__ import annotations

from typing import Any

import torch

_Opt = torch.Tensor | None


def combine_inputs(topk_weights: _Opt, bias: Any) -> tuple[_Opt, _Opt, _Opt]:
    """(top-k weights, bias0, bias1) of a combine, made contiguous."""
    tw = topk_weights.contiguous() if topk_weights is not None else None
    b0 = bias[0].contiguous() if bias[0] is not None else None
    b1 = bias[1].contiguous() if bias[1] is not None else None
    return tw, b0, b1


def combine_outputs(x: torch.Tensor, T: int, tw: _Opt) -> tuple[torch.Tensor, _Opt]:
    """The outputs of a combine of `x`'s rows into T tokens: [T, H] rows in x's dtype, and [T, K] float32 weights
    where top-k weights `tw` are summed too (else None)."""
    out = torch.empty((T, x.shape[1]), dtype=x.dtype, device=x.device)
    out_w = torch.empty((T, tw.shape[1]), dtype=torch.float32, device=x.device) if tw is not None else None
    return out, out_w


def combine_operands(
    x: torch.Tensor, T: int, topk_weights: _Opt, bias: Any
) -> tuple[_Opt, _Opt, _Opt, torch.Tensor, _Opt]:
    """combine_inputs, then combine_outputs: (top-k weights, bias0, bias1, out, out_topk_weights)."""
    tw, b0, b1 = combine_inputs(topk_weights, bias)
    return (tw, b0, b1, *combine_outputs(x, T, tw))


def scale_layout(x_scales: torch.Tensor | None) -> tuple[int, int, int]:
    """(scales per token, token stride, hidden stride) of FP8 scales as the kernels index them; (0, 0, 0) if none."""
    if x_scales is None:
        return 0, 0, 0
    if x_scales.dim() == 1:
        return 1, x_scales.stride(0), 0
    return x_scales.shape[1], x_scales.stride(0), x_scales.stride(1)
