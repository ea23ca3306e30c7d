"""A Megatron-Core MoE layer whose tokens travel through uccl-moe, forward and backward, on CPU over gloo.

Run:  python examples/megatron_moe_layer.py [--ranks 2]      (needs megatron-core; prints "megatron_moe_layer OK ...")

`import uccl_moe.megatron` registers the `uccl` token dispatcher in the installed, unmodified Megatron-Core: in a
training script that is `--moe-token-dispatcher-type uccl` on the command line (with uccl_moe.megatron imported, or
launched through `python -m uccl_moe.megatron.pretrain <script> ...`); in code, as here,
`TransformerConfig(moe_token_dispatcher_type="uccl")`. On a host without GPUs it also lets Megatron run on CPU.

The layer (router, 8 experts, top-2) is built twice on the same weights: once with uccl and once with Megatron's
own `allgather` dispatcher. Both see the same input and output gradient; the output, the input gradient and every
weight gradient must agree.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, SEQ, BATCH, NUM_EXPERTS, TOPK = 32, 16, 2, 8, 2


def build_moe_layer(dispatcher: str, ep: int) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=2 * HIDDEN,
        moe_token_dispatcher_type=dispatcher,  # "uccl": the Buffer's dispatch/combine move the tokens
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_router_dtype="fp32",
        expert_model_parallel_size=ep, add_bias_linear=False, gradient_accumulation_fusion=False,
    )
    if dispatcher == "uccl":
        config.moe_uccl_backend = "reference"  # gloo/CPU; on GPUs leave "auto" (native kernels for BF16 models)
    mlp = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False).submodules.mlp
    # megatron-core <= 0.18 returns a ModuleSpec, 0.19 a functools.partial(MoELayer, submodules=...).
    submodules = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    return MoELayer(config, submodules, layer_number=1)


def forward_backward(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out, _bias = layer(x)  # x, out: [seq, batch, hidden]
    out.backward(grad_out)
    grads = {f"grad {n}": p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return {"output": out.detach(), "input grad": x.grad, **grads}


def rank_main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    import uccl_moe.megatron  # noqa: F401 - registers the "uccl" dispatcher (and, without GPUs, Megatron on CPU)

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)  # EP = all ranks
    torch.manual_seed(0)
    reference = build_moe_layer("allgather", world)
    torch.manual_seed(0)
    layer = build_moe_layer("uccl", world)
    layer.load_state_dict(reference.state_dict())
    assert type(layer.token_dispatcher).__name__ == "UCCLTokenDispatcher"

    gen = torch.Generator().manual_seed(rank)
    x, grad_out = torch.randn(SEQ, BATCH, HIDDEN, generator=gen), torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    expected = forward_backward(reference, x, grad_out)
    clear_aux_losses_tracker()
    got = forward_backward(layer, x, grad_out)
    assert expected.keys() == got.keys(), sorted(set(expected) ^ set(got))
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    print(f"rank {rank}: output, input grad and {len(got) - 2} weight grads match allgather", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter shutdown: gloo threads Megatron leaves behind can abort it (tests/helpers/mp.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 4, 8), help="ranks = EP size (divides 8 experts)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(args.ranks, os.path.join(d, "init")), nprocs=args.ranks, join=True)
    print(f"megatron_moe_layer OK: EP={args.ranks}, dispatcher uccl matches allgather, forward and backward")


if __name__ == "__main__":
    main()
