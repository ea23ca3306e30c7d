"""The bench's PNG: nvlink_GBps per op against tokens per rank (matplotlib, where installed)."""

from __future__ import annotations

from typing import Any


def plot(rows: list[dict[str, Any]], path: str, note: str = "") -> bool:
    """nvlink_GBps per op against tokens per rank; `note` goes into the title (e.g. that the times are device time)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["hidden"], r["experts"], r["dtype"], r["num_sms"], r["nvl_send"]) for r in rows})
    for key in keys:
        sel = sorted((r for r in rows if (r["hidden"], r["experts"], r["dtype"], r["num_sms"], r["nvl_send"]) == key),
                     key=lambda r: r["tokens"])
        lab = f"H={key[0]} E={key[1]} {key[2]} sms={key[3]} chunk={key[4]}"
        ax.plot([r["tokens"] for r in sel], [r["dispatch_nvlink_GBps"] for r in sel], "o-", label=f"dispatch {lab}")
        ax.plot([r["tokens"] for r in sel], [r["combine_nvlink_GBps"] for r in sel], "s--", label=f"combine {lab}")
        for op, mark, what in (("combine_view", "d-.", "combine from the buffer"),
                               ("combine_ring", "^-.", "combine ring"), ("combine_staged", "v-.", "combine staged"),
                               ("combine_ce", ">-.", "combine copy engines")):
            if f"{op}_nvlink_GBps" in sel[0]:
                ax.plot([r["tokens"] for r in sel], [r[f"{op}_nvlink_GBps"] for r in sel], mark, label=f"{what} {lab}")
        if "nccl_dispatch_nvlink_GBps" in sel[0]:
            ax.plot([r["tokens"] for r in sel], [r["nccl_dispatch_nvlink_GBps"] for r in sel], "x:",
                    label=f"NCCL a2a {lab}")
    if rows:
        ax.axhline(rows[0]["peer_copy_GBps"], color="k", lw=0.8, label="peer copy (one way)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("nvlink_GBps (slowest rank)")
    ax.set_title(f"uccl-moe intranode HT, EP{rows[0]['ranks'] if rows else '?'}" + (f"\n{note}" if note else ""),
                 fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
