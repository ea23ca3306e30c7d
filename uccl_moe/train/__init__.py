"""The training application on the Megatron adapter: ``python -m uccl_moe.train.train_gpt`` (a GPT-MoE trainer on
the megatron-core wheel), its per-step statistics, profiler and timeline report, the run log, and ``uccl-moe
compare``. The adapter itself (the ``uccl`` token dispatcher) is :mod:`uccl_moe.megatron`.

Importing this package imports nothing else: each module pulls in torch/Megatron only where it needs them.
"""
