"""Which decoder layers each pipeline rank holds: Megatron's pipeline layout DSL, decoder_first/last_pipeline_num_layers
and virtual stages."""

from __future__ import annotations

import re
from typing import Any

from ..errors import InvalidUsageError


def middle_stages(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, int]:
    """(layers, stages) left between the first and last pipeline stages sized by decoder_first/last_*."""
    return num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)


def parse_pipeline_layout(layout: str) -> list[str]:
    """Expand Megatron's pipeline layout DSL into one token string per (virtual) stage.

    Stages are separated by ``|``; ``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss; ``(X)*n`` and
    ``x*n`` repeat; commas and spaces are cosmetic. ``"Et|(tt|)*2,mL"`` -> ``["Et", "tt", "tt", "mL"]``.
    """
    text = re.sub(r"[,\s]", "", layout)
    for _ in range(100):
        new = re.sub(r"\(([^()]*)\)\*(\d+)", lambda mo: mo.group(1) * int(mo.group(2)), text)
        if new == text:
            break
        text = new
    text = re.sub(r"([EtmL])\*(\d+)", lambda mo: mo.group(1) * int(mo.group(2)), text)
    if not re.fullmatch(r"[EtmL|]*", text):
        raise InvalidUsageError(f"parallel.pipeline_model_parallel_layout={layout!r}: only E t m L | ( ) * digits "
                                f"and commas are allowed")
    return text.split("|")


def pipeline_assignment(cfg: Any) -> list[list[int]]:
    """Decoder layer indices held by each PP rank (virtual stages v go to rank v % PP)."""
    p, L = cfg.parallel, cfg.model.num_layers
    pp = p.pipeline_model_parallel_size
    ranks: list[list[int]] = [[] for _ in range(pp)]
    if p.pipeline_model_parallel_layout:
        i = 0
        for v, st in enumerate(parse_pipeline_layout(p.pipeline_model_parallel_layout)):
            for _ in range(st.count("t")):
                ranks[v % pp].append(i)
                i += 1
        return ranks
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        sizes = [0] * pp
        rest, rest_stages = middle_stages(L, pp, first, last)
        for r in range(pp):
            if r == 0 and first is not None:
                sizes[r] = first
            elif r == pp - 1 and last is not None:
                sizes[r] = last
            else:
                sizes[r] = rest // max(rest_stages, 1)
        i = 0
        for r, n in enumerate(sizes):
            ranks[r] = list(range(i, i + n))
            i += n
        return ranks
    vpp = p.num_layers_per_virtual_pipeline_stage or max(L // pp, 1)
    for i in range(L):
        ranks[(i // vpp) % pp].append(i)
    return ranks
