"""Megatron's 1F1B EP overlap (``--overlap-moe-expert-parallel-comm``, optionally ``--delay-wgrad-compute``) with the
uccl dispatcher and with flex + our ``deep_ep`` shim, on 2 GPUs (issue 29):

- loss parity: a tiny GPT-MoE (EP 2, BF16) trains with each under the overlap flags, step by step within BF16 noise of
  Megatron's alltoall dispatcher under the same flags;
- the overlap is real: in a torch.profiler trace (``train_gpt --profile``), the share of uccl's kernel time that runs
  under compute on another stream (``uccl_moe.train.timeline``) is larger with the flag than without it.

    python -m pytest -q tests/gpu/test_megatron_ep_overlap_gpu.py
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.mp import run_ranks_on  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.mp, pytest.mark.timeout(1800)]

ARGS = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--num-experts", "8",
    "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "512",
    "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "256",
    "--disable-bias-linear", "--bf16",
    "--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "32", "--vocab-size", "512",
    "--train-iters", "12", "--lr", "3e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
DISPATCHERS = {
    "uccl": ["--moe-token-dispatcher-type", "uccl", "--moe-uccl-backend", "native"],
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "flex_shim": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
}


def _train(rank: int, world: int, dispatcher: str, extra: list[str]) -> list[float]:
    if dispatcher == "flex_shim":  # before Megatron's fused_a2a looks for deep_ep
        import uccl_moe.deep_ep_compat as shim

        shim.install()
    from megatron.core import parallel_state

    from uccl_moe.train import train_gpt

    rows = train_gpt.train(ARGS + DISPATCHERS[dispatcher] + extra)
    parallel_state.destroy_model_parallel()
    return [r["loss"] for r in rows]


def _losses(dispatcher: str, extra: list[str]) -> list[float]:
    return run_ranks_on(_train, 2, dispatcher, extra, backend="nccl", timeout_s=900)[0]


def _need_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def _close(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == 12 and all(math.isfinite(x) for x in got), got
    for i, (a, b) in enumerate(zip(got, ref)):
        # BF16 runs that sum expert outputs in different orders drift apart slowly; a wrong row is an O(1) jump.
        tol = (0.01 if i == 0 else 0.05) * max(1.0, abs(b))
        assert abs(a - b) <= tol, f"step {i + 1}: {a} vs {b}\n{got}\n{ref}"
    assert sum(got[-3:]) / 3 < got[0] - 0.2, f"loss did not fall: {got}"


@pytest.mark.parametrize("dispatcher", ["uccl", "flex_shim"])
@pytest.mark.parametrize("delay_wgrad", [False, True], ids=["overlap", "overlap+delay_wgrad"])
def test_ep_overlap_loss_parity_with_alltoall(dispatcher, delay_wgrad):
    _need_two_gpus()
    extra = OVERLAP + (["--delay-wgrad-compute"] if delay_wgrad else [])
    if delay_wgrad and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("--delay-wgrad-compute needs TransformerEngine's linear layers (Megatron's backward_dw)")
    ref = _losses("alltoall", extra)
    _close(_losses(dispatcher, extra), ref)


def _hidden_fraction(tmp_path, name: str, extra: list[str]) -> float:
    from uccl_moe.train import timeline

    d = tmp_path / name
    _losses("uccl", extra + ["--profile", "--profile-step-start", "8", "--profile-step-end", "10",
                             "--profile-ranks", "0", "--profile-dir", str(d)])
    res = timeline.analyze(timeline.kernels_of(timeline.load_trace(d / "trace_rank0.json")))
    frac = res["comm"]["uccl"]["hidden_fraction"]
    assert frac is not None and res["comm"]["uccl"]["busy_ms"] > 0, res["comm"]
    return float(frac)


# Known shortfall (2 x H200, megatron-core 0.19.2, 2026-11-26): loss parity holds under the flag, but only 1.6% of
# uccl's kernel time ran under the other micro-batch's compute (0.0% without the flag). Strict: the mark goes as soon
# as the overlap hides the comm (docs/megatron.md).
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="1F1B EP overlap does not hide uccl's comm yet")
def test_ep_overlap_hides_uccl_comm_under_the_other_micro_batch(tmp_path):
    _need_two_gpus()
    without = _hidden_fraction(tmp_path, "plain", [])
    with_overlap = _hidden_fraction(tmp_path, "overlap", OVERLAP)
    print(f"uccl kernel time under compute on another stream: {without:.1%} without, {with_overlap:.1%} with "
          f"--overlap-moe-expert-parallel-comm")
    assert with_overlap > max(0.2, without + 0.1), (without, with_overlap)
