"""train_gpt's BF16 model on CPU (2 ranks, EP 2, gloo): one dtype everywhere, on the plain path and on Megatron's
combined-1F1B schedule plan (``--overlap-moe-expert-parallel-comm``).

GPTModel creates its learned position embedding and its torch norms in float32 whatever ``params_dtype`` says;
Megatron-LM's get_model casts the chunk with Float16Module. Without that cast the embedding sum is float32 and the
first BF16 linear layer (attention's linear_qkv) refuses it ("expected m1 and m2 to have the same dtype").

The schedule plan needs CUDA only for its streams and events: here they are replaced by no-op stand-ins
(:func:`_cpu_streams`), so Megatron's own ``combined_1f1b_schedule_for_no_pipelining`` runs the uccl dispatcher's
nodes in its 1F1B order on CPU, and its losses and gradients must match the plain path's.
(tests/gpu/test_megatron_ep_overlap_gpu.py runs it with real streams on 2 GPUs.)
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers.mp import run_ranks_on as run_ranks
from helpers.requires import missing

# Not importorskip: the spawned ranks unpickle this module, and flex must find the deep_ep shim installed before
# Megatron's MoE modules are imported (as in test_flex_shim.py).
pytestmark = [pytest.mark.mp, pytest.mark.timeout(900),
              pytest.mark.skipif(missing("megatron.core") is not None, reason=missing("megatron.core") or "")]

ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-experts", "4",
    "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32",
    "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "32",
    "--disable-bias-linear", "--bf16",  # learned absolute positions: the float32 embedding the cast must catch
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "64",
    "--lr", "3e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
]
UCCL = ["--moe-token-dispatcher-type", "uccl", "--moe-uccl-backend", "reference"]
DISPATCHERS = {
    "uccl": UCCL,
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "flex_shim": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
}


def _train_rank(rank: int, world: int) -> list[float]:
    from megatron.core import parallel_state

    from uccl_moe.train import train_gpt

    rows = train_gpt.train(ARGS + UCCL + ["--train-iters", "10"])
    parallel_state.destroy_model_parallel()
    return [r["loss"] for r in rows]


def test_bf16_model_with_learned_positions_trains():
    losses = run_ranks(_train_rank, 2)[0]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, f"loss did not fall: {losses}"


class _Stream:
    """Stands in for torch.cuda.Stream: on CPU every kernel has finished when the call returns."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def wait_stream(self, other):
        del other

    def wait_event(self, event):
        del event

    def synchronize(self):
        pass


class _Event:
    """Stands in for torch.cuda.Event (see _Stream)."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def record(self, stream=None):
        del stream

    def wait(self, stream=None):
        del stream

    def synchronize(self):
        pass


@contextlib.contextmanager
def _cpu_streams():
    """Replace the CUDA stream/event API that Megatron's schedule plan touches with CPU no-ops."""
    cur = _Stream()
    patches = [
        (torch.cuda, "Stream", _Stream), (torch.cuda, "Event", _Event),
        (torch.cuda, "stream", lambda s=None: contextlib.nullcontext()),
        (torch.cuda, "current_stream", lambda device=None: cur),
        (torch.cuda.nvtx, "range_push", lambda *a, **k: None), (torch.cuda.nvtx, "range_pop", lambda *a, **k: None),
        (torch.Tensor, "record_stream", lambda self, stream: None),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _main_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().float().clone() for n, p in model.named_parameters()
            if getattr(p, "main_grad", None) is not None}


def _plan_vs_plain_rank(rank: int, world: int, dispatcher: str) -> dict[str, object]:
    if dispatcher == "flex_shim":  # before Megatron's fused_a2a looks for deep_ep
        import uccl_moe.deep_ep_compat as shim

        shim.install()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import combined_1f1b
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.transformer.moe import fused_a2a

    import uccl_moe
    from uccl_moe.train import train_gpt

    ts = train_gpt.setup(ARGS + DISPATCHERS[dispatcher] + ["--overlap-moe-expert-parallel-comm", "--train-iters", "1"])
    model = train_gpt.build_model(ts)
    config = ts.config
    config.no_sync_func = model.no_sync
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    n = ts.num_microbatches
    assert n >= 2, n  # the 1F1B steps overlap micro-batch i's forward with i-1's backward

    model.zero_grad_buffer()
    plain = train_gpt.cpu_forward_backward(forward_step_func=train_gpt._forward_step,
                                           data_iterator=train_gpt.synthetic_batches(ts), model=[model],
                                           num_microbatches=n, seq_length=0, micro_batch_size=0)
    plain_grads = _main_grads(model)

    model.zero_grad_buffer()
    with _cpu_streams():
        pp_utils._COMP_STREAM = pp_utils._COMM_STREAM = None  # set_streams builds them from the stand-ins
        store, _tokens = combined_1f1b.combined_1f1b_schedule_for_no_pipelining(
            train_gpt._forward_step, train_gpt.synthetic_batches(ts), model, n, None, None, [], config,
            False, False, False, model.no_sync, torch.zeros([], dtype=torch.int), lambda first: first,
        )
        pp_utils._COMP_STREAM = pp_utils._COMM_STREAM = None
    plan_grads = _main_grads(model)
    parallel_state.destroy_model_parallel()
    moe = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
    assert set(plan_grads) == set(plain_grads)
    return {
        "dtypes": dtypes,
        "dispatchers": sorted({type(d).__name__ for d in moe}),
        "buffer_is_ours": isinstance(getattr(fused_a2a, "_buffer", None), uccl_moe.Buffer),
        "plain": [float(x["lm loss"]) for x in plain],
        "plan": [float(x["lm loss"]) for x in store],
        "grad_rel": max(float((plan_grads[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in plain_grads.items()),
        "grad_norm": math.sqrt(sum(float(v.norm()) ** 2 for v in plain_grads.values())),
    }


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
def test_schedule_plan_path_runs_bf16_and_matches_plain(dispatcher):
    # the shim's Buffer takes the reference backend on CPU
    for rank, got in enumerate(run_ranks(_plan_vs_plain_rank, 2, dispatcher, env={"UCCL_MOE_BACKEND": "reference"})):
        print(f"rank {rank}: {got}")
        assert got["dtypes"] == ["torch.bfloat16"], (rank, got["dtypes"])
        expected = {"uccl": "UCCLTokenDispatcher", "alltoall": "MoEAlltoAllTokenDispatcher",
                    "flex_shim": "MoEFlexTokenDispatcher"}[dispatcher]
        assert got["dispatchers"] == [expected], (rank, got["dispatchers"])
        assert got["buffer_is_ours"] == (dispatcher == "flex_shim"), (rank, got)
        assert len(got["plan"]) == len(got["plain"]) == 2, (rank, got)
        for a, b in zip(got["plan"], got["plain"]):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (rank, got["plan"], got["plain"])  # the same ops
        assert got["grad_norm"] > 0 and got["grad_rel"] < 0.02, (rank, got["grad_rel"], got["grad_norm"])
