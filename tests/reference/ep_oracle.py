"""Plain-torch oracle of DeepEP-V1 HT semantics, computed from every rank's inputs (no communication code).

Used to check the reference backend (and, through it, the native kernels). Deliberately written the slow,
obvious way: Python loops over source ranks and tokens.
"""

from __future__ import annotations

import torch


def expected_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    T = topk_idx.shape[0]
    per_rank = num_experts // num_ranks
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros((T, num_ranks), dtype=torch.bool)
    for t in range(T):
        for e in topk_idx[t].tolist():
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // per_rank] = True
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


def expected_dispatch(me: int, num_ranks: int, num_experts: int, xs: list, topks: list, weights: list,
                      scales: list | None = None, expert_alignment: int = 1):
    """Rows rank `me` must receive, from the inputs of all ranks (lists indexed by source rank)."""
    per_rank = num_experts // num_ranks
    lo, hi = me * per_rank, (me + 1) * per_rank
    rows, srows, idx_rows, w_rows, src_idx = [], [], [], [], []
    per_expert = [0] * per_rank
    for src in range(num_ranks):
        for t in range(xs[src].shape[0]):
            experts = topks[src][t].tolist()
            if not any(lo <= e < hi for e in experts):
                continue
            rows.append(xs[src][t])
            if scales is not None:
                srows.append(scales[src][t])
            local = [e - lo if lo <= e < hi else -1 for e in experts]
            idx_rows.append(local)
            w_rows.append([w if l >= 0 else 0.0 for w, l in zip(weights[src][t].tolist(), local)])
            src_idx.append(t)
            for l in local:
                if l >= 0:
                    per_expert[l] += 1
    H = xs[0].shape[1]
    K = topks[0].shape[1]
    recv_x = torch.stack(rows) if rows else xs[0].new_zeros((0, H))
    recv_s = (torch.stack(srows) if srows else scales[0].new_zeros((0, *scales[0].shape[1:]))) if scales else None
    recv_idx = torch.tensor(idx_rows, dtype=torch.int64).reshape(-1, K)
    recv_w = torch.tensor(w_rows, dtype=torch.float32).reshape(-1, K)
    aligned = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in per_expert]
    return recv_x, recv_s, recv_idx, recv_w, aligned, torch.tensor(src_idx, dtype=torch.int32)


def expected_combine(me: int, num_ranks: int, num_experts: int, topks: list, returned: list, T: int, H: int,
                     biases: tuple = ()) -> torch.Tensor:
    """Sum, in float32 and rank order, of the rows every rank returns for rank `me`'s tokens.

    returned[r] is rank r's combine input (rows in r's recv order); the oracle recomputes that order.
    """
    per_rank = num_experts // num_ranks
    acc = torch.zeros((T, H), dtype=torch.float32)
    for r in range(num_ranks):
        lo, hi = r * per_rank, (r + 1) * per_rank
        row = 0
        for src in range(num_ranks):
            for t in range(topks[src].shape[0]):
                if any(lo <= e < hi for e in topks[src][t].tolist()):
                    if src == me:
                        acc[t] += returned[r][row].float()
                    row += 1
    for b in biases:
        if b is not None:
            acc += b.float()
    return acc
