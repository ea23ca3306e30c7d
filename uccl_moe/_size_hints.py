"""The Buffer's size hints beyond DeepEP's config hints (a base of :class:`uccl_moe.Buffer`): the NVL bytes of the
combine from the buffer and of the copy-engine dispatch and combine, and the RDMA bytes of the internode staging.
DeepEP's ``Config.get_nvl_buffer_size_hint`` sizes the rings, whatever the token count; these grow with the tokens,
and a Buffer takes the largest of them and the configs' hints (a path whose memory does not fit falls back to the
rings, alike on every rank)."""

from __future__ import annotations

from . import _C, _checks, env, tuning
from ._checks import err, int_arg
from .utils import page_bytes

#: The largest group the copy-engine ops serve: one node's NVLink domain (the intranode kernels' rank limit).
_MAX_CE_RANKS = 8


class SizeHints:
    """The static size hints of :class:`uccl_moe.Buffer` that depend on the token count (uccl-moe extensions)."""

    @staticmethod
    def get_combine_buffer_size_hint(num_rows: int, hidden: int, num_topk: int = 0) -> int:
        """``num_nvl_bytes`` that :meth:`get_combine_buffer` needs for `num_rows` rows of `hidden` BF16 values (plus
        `num_topk` staged weights per row when combine gets ``topk_weights``): 1 MiB of meta, then the rows, then the
        weights; a multiple of 4096. Take the largest of it and the dispatch/combine configs' size hints."""
        num_rows, hidden, num_topk = int_arg("num_rows", num_rows), int_arg("hidden", hidden), \
            int_arg("num_topk", num_topk)
        if num_rows < 0 or hidden <= 0 or num_topk < 0:
            raise err(f"get_combine_buffer_size_hint({num_rows}, {hidden}, {num_topk}): need rows >= 0, hidden > 0, "
                      f"num_topk >= 0")
        return page_bytes(_C.intranode_combine_input_layout(num_rows, hidden, num_topk)[1])  # the kernels' own layout

    @staticmethod
    def get_copy_engine_buffer_size_hint(num_tokens: int, hidden: int, num_ranks: int, num_topk: int = 0) -> int:
        """``num_nvl_bytes`` with which the copy-engine cached dispatch and combine of BF16 rows of `hidden` values
        (`num_topk` weights per row in the combine) fit any routing of up to `num_tokens` tokens per rank in a
        group of `num_ranks` ranks on one node; 0 where neither op is on for that group size
        (``UCCL_MOE_DISPATCH_CE`` / ``UCCL_MOE_COMBINE_CE`` and the EP sizes of :mod:`uccl_moe.tuning`: EP2 by
        default). A multiple of 4096 (uccl-moe extension; take the largest of it and the configs' hints). Without
        it, a Buffer sized by the configs' hints alone keeps the rings where a peer's whole block does not fit (at
        EP2, hidden 7168: beyond about 5000 tokens per rank)."""
        num_tokens, hidden = int_arg("num_tokens", num_tokens), int_arg("hidden", hidden)
        num_ranks, num_topk = int_arg("num_ranks", num_ranks), int_arg("num_topk", num_topk)
        if num_tokens < 0 or hidden <= 0 or not 1 <= num_ranks <= _MAX_CE_RANKS or num_topk < 0:
            raise err(f"get_copy_engine_buffer_size_hint({num_tokens}, {hidden}, {num_ranks}, {num_topk}): need "
                      f"tokens >= 0, hidden > 0, 1 <= num_ranks <= {_MAX_CE_RANKS} (one node), num_topk >= 0")
        need = 0
        # The worst routing: every rank sends all its tokens to every rank (rank_prefix[s][d] = (s + 1) * tokens).
        if tuning.combine_ce(num_ranks, env.get("COMBINE_CE")) and (hidden * 2) % 16 == 0:
            prefix = [(s + 1) * num_tokens for s in range(num_ranks) for _ in range(num_ranks)]
            need = max(need, int(_C.intranode_ce_landing_bytes(prefix, hidden, num_topk)))
        if tuning.dispatch_ce(num_ranks, env.get("DISPATCH_CE")):
            need = max(need, int(_C.intranode_ce_dispatch_landing_bytes([num_tokens] * num_ranks, hidden * 2, 0)))
        return page_bytes(need)

    @staticmethod
    def get_internode_rdma_size_hint(max_tokens: int, hidden: int, num_topk: int, num_nodes: int,
                                     num_scales: int = 0) -> int:
        """``num_rdma_bytes`` with room for any routing of up to `max_tokens` tokens per rank across `num_nodes` nodes
        on the native internode path: BF16 rows of `hidden` values (or FP8 rows with `num_scales` scales per token),
        `num_topk` experts per token. A multiple of 4096 (uccl-moe extension; take the larger of it and the configs'
        ``get_rdma_buffer_size_hint``)."""
        from .backends.internode import rdma_bytes_for  # (the internode path loads the proxy: only when asked)

        return int(rdma_bytes_for(*_checks.check_staging_args(max_tokens, hidden, num_topk, num_nodes, num_scales)))
