"""DeepEP's low-latency (LL) entry points, which uccl-moe does not implement yet (HT mode only): each raises
``NotImplementedError`` saying so, so a DeepEP client that probes for them gets a clear answer."""

from __future__ import annotations

from typing import Any

_WHY = "is not implemented in uccl-moe yet (HT mode only)"


class LowLatencyNotImplemented:
    """The LL half of ``deep_ep.Buffer``'s API, as stubs that raise (a base of :class:`uccl_moe.Buffer`)."""

    @staticmethod
    def get_low_latency_rdma_size_hint(*args: Any, **kwargs: Any) -> int:
        raise NotImplementedError(f"low-latency mode {_WHY}")

    def low_latency_dispatch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"low_latency_dispatch {_WHY}")

    def low_latency_combine(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"low_latency_combine {_WHY}")

    def clean_low_latency_buffer(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"low-latency mode {_WHY}")
