"""GPU (NCCL) variant of the MoELayer equality tests, plus Megatron's dropless round-trip contract on CUDA and the
shared-expert overlap (which needs CUDA streams). Runs on 2-4 GPUs through the device tool.

``UCCL_MOE_TEST_MEGATRON_BACKEND`` picks the Buffer backend (default ``reference``: all_to_all on NCCL; set
``native`` once the intranode kernels exist).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

from helpers.mp import run_ranks_on as run_ranks  # noqa: E402

from tests.uccl_moe.megatron._moe_cases import Case, dropless_roundtrip, run_cases  # noqa: E402
from tests.uccl_moe.megatron.test_dispatcher import _check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.mp, pytest.mark.timeout(900)]

BACKEND = os.environ.get("UCCL_MOE_TEST_MEGATRON_BACKEND", "reference")


def _world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip("needs >= 2 GPUs")
    return 4 if n >= 4 else 2


def _cases(world: int) -> list[Case]:
    # The native kernels move BF16 hidden states; the reference backend runs the exact FP32 comparison.
    dtype = "bf16" if BACKEND == "native" else "fp32"
    cases = [
        Case(ep=2, topk=2, backend=BACKEND, dtype=dtype),
        Case(ep=2, topk=1, capacity_factor=0.5, backend=BACKEND, dtype=dtype),
        Case(ep=2, topk=2, shared_expert=True, shared_expert_overlap=True, backend=BACKEND, dtype=dtype),
        Case(ep=2, topk=2, backend=BACKEND, dtype=dtype, combine_from_buffer=False),  # the ring combine
    ]
    if world == 4:
        cases += [
            Case(ep=4, topk=4, backend=BACKEND, dtype=dtype),
            Case(ep=4, topk=8, num_experts=16, backend=BACKEND, dtype=dtype),
            Case(tp=2, ep=2, topk=2, shared_expert=True, shared_expert_overlap=True, backend=BACKEND, dtype=dtype),
        ]
    if BACKEND == "native":  # an FP32 model under "auto" takes the reference backend, exactly
        cases.append(Case(ep=2, topk=2, backend="auto", dtype="fp32"))
    return cases


def test_matches_allgather_on_cuda():
    world = _world()
    cases = _cases(world)
    results = run_ranks(run_cases, world, cases, "cuda", backend="nccl")
    for case in cases:
        _check(results, case)
        want = "ReferenceBackend" if case.backend == "reference" or case.dtype == "fp32" else "NativeBackend"
        assert all(r[case.id]["backend"] == want for r in results), (case.id, [r[case.id]["backend"] for r in results])


def test_dropless_roundtrip_contract_on_cuda():
    world = _world()
    dtype = "bf16" if BACKEND == "native" else "fp32"
    for res in run_ranks(dropless_roundtrip, world, world, 2, "cuda", BACKEND, dtype, backend="nccl"):
        assert res["rows"] > 0 and res["forward"] <= 1e-6 and res["backward"] <= 1e-6, res
        assert res["backend"] == ("NativeBackend" if BACKEND == "native" else "ReferenceBackend"), res
