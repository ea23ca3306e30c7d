"""Where does a float32 tensor enter train_gpt's BF16 model under Megatron's 1F1B EP overlap? (issue 29)

Trains train_gpt's tiny GPT-MoE (EP 2, BF16) on 2 GPUs for a few steps with ``--overlap-moe-expert-parallel-comm``
(and ``--delay-wgrad-compute`` with ``--delay-wgrad``), one run per dispatcher, and prints the dtype and shape of the
first tensor entering each attention and MoE part (forward pre-hooks on self_attention, linear_qkv, the router, the
routed and shared experts, and the MoE layer itself where the plain path calls it), for the first micro-batch of each
rank-0 step. A part whose input dtype differs from its parameters' is marked ``<-- MISMATCH``. Then each run's losses.

    python tools/device/overlap_probe.py                          # alltoall, uccl, flex_shim; 3 steps
    python tools/device/overlap_probe.py --dispatchers uccl --delay-wgrad --plain   # also without the overlap flag
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import torch  # noqa: E402
from helpers.mp import run_ranks_on  # noqa: E402

ARGS = [
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--num-experts", "8",
    "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "512",
    "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "256",
    "--disable-bias-linear", "--bf16",
    "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "512",
    "--lr", "3e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
]
DISPATCHERS = {
    "uccl": ["--moe-token-dispatcher-type", "uccl", "--moe-uccl-backend", "native"],
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "flex_shim": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
}
WATCHED = ("self_attention", "self_attention.linear_qkv", "mlp", "mlp.router", "mlp.experts", "mlp.shared_experts")


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _add_hooks(model: torch.nn.Module, rank: int, seen: dict[str, int], step: list[int]) -> None:
    for name, mod in model.named_modules():
        if not any(name.endswith("." + w) for w in WATCHED):
            continue
        params = {p.dtype for p in mod.parameters(recurse=True)}

        def hook(m, args, kwargs, name=name, params=params):
            x = _first_tensor(args, kwargs)
            key = f"{step[0]}:{name}"
            seen[key] = seen.get(key, 0) + 1
            if rank != 0 or seen[key] > 1 or x is None:
                return
            mark = "  <-- MISMATCH" if x.is_floating_point() and params and x.dtype not in params else ""
            short = name.replace("module.", "")
            print(f"[probe] step {step[0]} {short}: input {x.dtype} {tuple(x.shape)}; params "
                  f"{sorted(str(d) for d in params)}{mark}", flush=True)

        mod.register_forward_pre_hook(hook, with_kwargs=True)


def _rank(rank: int, world: int, dispatcher: str, dispatcher_args: list[str], extra: list[str],
          steps: int) -> list[float]:
    del world
    if dispatcher == "flex_shim":  # before Megatron's fused_a2a looks for deep_ep
        import uccl_moe.deep_ep_compat as shim

        shim.install()
    from megatron.core import parallel_state

    from uccl_moe.train import train_gpt

    seen: dict[str, int] = {}
    step = [1]
    build = train_gpt.build_model

    def build_with_hooks(ts):
        model = build(ts)
        if rank == 0:
            print(f"[probe] {dispatcher} {' '.join(extra)}: parameter dtypes "
                  f"{sorted({str(p.dtype) for p in model.parameters()})}; wrappers "
                  f"{type(model).__name__} > {type(model.module).__name__}", flush=True)
        _add_hooks(model, rank, seen, step)
        return model

    train_gpt.build_model = build_with_hooks
    orig_lr = train_gpt.lr_at

    def lr_at(args, iteration):  # called once per step, before its forward: the hooks' step number
        step[0] = iteration
        return orig_lr(args, iteration)

    train_gpt.lr_at = lr_at
    # An exception ends this rank (its traceback comes back through helpers.mp, and the peer is stopped).
    rows = train_gpt.train(ARGS + dispatcher_args + extra + ["--train-iters", str(steps)])
    parallel_state.destroy_model_parallel()
    return [r["loss"] for r in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dispatchers", default="alltoall,uccl,flex_shim")
    p.add_argument("--delay-wgrad", action="store_true", help="add --delay-wgrad-compute (needs TransformerEngine)")
    p.add_argument("--plain", action="store_true", help="also run each dispatcher without the overlap flag")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                   help="gloo: a CPU smoke of the hooks only (train_gpt's CPU loop never builds the schedule plan)")
    a = p.parse_args()
    env = None
    if a.backend == "gloo":  # the reference backend for uccl and for the shim's Buffer
        DISPATCHERS["uccl"] = ["--moe-token-dispatcher-type", "uccl", "--moe-uccl-backend", "reference"]
        env = {"UCCL_MOE_BACKEND": "reference"}
    elif torch.cuda.device_count() < 2:
        print("overlap_probe: needs 2 GPUs", file=sys.stderr)
        return 2
    overlap = ["--overlap-moe-expert-parallel-comm"] + (["--delay-wgrad-compute"] if a.delay_wgrad else [])
    variants = [overlap] + ([[]] if a.plain else [])
    failed = 0
    for d in a.dispatchers.split(","):
        for extra in variants:
            label = f"{d} {' '.join(extra) or '(no overlap)'}"
            print(f"\n=== {label}", flush=True)
            try:
                losses = run_ranks_on(_rank, 2, d, DISPATCHERS[d], extra, a.steps, backend=a.backend, env=env,
                                      timeout_s=600)[0]
            except AssertionError as e:  # the first failing rank's traceback
                print(f"[probe] {label}: FAILED\n{str(e)[-3000:]}", flush=True)
                failed += 1
                continue
            print(f"[probe] {label}: losses {[round(x, 4) for x in losses]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
