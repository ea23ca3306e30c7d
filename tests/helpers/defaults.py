"""Run code under torch's process-wide defaults as DeepEP-style clients set them.

DeepEP V1's test harness calls ``torch.set_default_device("cuda")`` and ``torch.set_default_dtype(torch.bfloat16)``
before it uses the Buffer; other clients work inside ``with torch.device(...)``. Code that creates a tensor without
an explicit ``device=``/``dtype=`` then gets the wrong one. On a CPU-only machine the ``meta`` device stands in for
"some other device": any tensor the package makes without ``device=`` lands there and fails on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: name -> (default device set with set_default_device or None, device of a `with torch.device(...)` block or None,
#: default dtype or None)
MODES: dict[str, tuple[str | None, str | None, torch.dtype | None]] = {
    "plain": (None, None, None),
    "dtype_bf16": (None, None, torch.bfloat16),
    "dtype_fp64": (None, None, torch.float64),
    "set_cpu": ("cpu", None, None),
    "with_cpu": (None, "cpu", None),
    "set_meta": ("meta", None, None),
    "with_meta_bf16": (None, "meta", torch.bfloat16),
    "set_meta_bf16": ("meta", None, torch.bfloat16),
}
CPU_MODES = tuple(MODES)
#: What a DeepEP V1 client sets on GPUs (tests/utils.py init_dist of DeepEP 567632d).
GPU_MODES = ("plain", "set_cuda_bf16", "with_cuda_fp64")
MODES["set_cuda_bf16"] = ("cuda", None, torch.bfloat16)
MODES["with_cuda_fp64"] = (None, "cuda", torch.float64)


@contextlib.contextmanager
def torch_defaults(mode: str) -> Iterator[None]:
    """Inside: torch's default device and dtype as `mode` (a key of MODES) sets them; restored after."""
    set_device, with_device, dtype = MODES[mode]
    old_dtype = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        if set_device is not None:
            torch.set_default_device(set_device)
        if with_device is not None:
            with torch.device(with_device):
                yield
        else:
            yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(old_dtype)
