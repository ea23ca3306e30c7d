"""CPU proxy of the internode path: start/stop proxies, push commands from host producers, read counters.

One :class:`Proxy` per GPU (rank) runs ``num_threads`` native threads (``UCCL_MOE_PROXY_THREADS``); thread ``t`` owns
FIFOs ``{g : g % num_threads == t}`` and talks only to thread ``t`` of the peers. GPU kernels push
:class:`TransferCmd` entries through the device half of the FIFO; this module lets host code (tests, benchmarks) do
the same. Transports: ``loopback`` (N emulated nodes on one host, POSIX shared memory, fault injection),
``ibverbs`` (RC) and ``efa`` (SRD); see docs/proxy.md.

Bootstrap goes through a key/value store: pass a ``torch.distributed.Store`` (TCPStore, FileStore, ...) or any object
with ``set(key, bytes)`` and ``get(key) -> bytes``; :class:`StoreBootstrap` adapts it.

Notation: R = ranks. Counters are ``int64[R * 256]``; an update from source rank ``s`` to slot ``c`` lands at
``s * 256 + c``.
"""

from __future__ import annotations

import collections
import datetime
import logging
import re
from pathlib import Path
from typing import Any

from . import env as _env
from .errors import InvalidTypeError, InvalidUsageError

_log = logging.getLogger("uccl_moe.proxy")

# Mirrors native/include/uccl_moe/transfer_cmd.hpp (the single declaration of the wire format).
OP_WRITE, OP_ATOMIC, OP_QUIET, OP_BARRIER = 1, 2, 3, 4
FLAG_COUNTER, FLAG_LL, FLAG_PHASE, FLAG_SAME_RAIL = 1, 2, 4, 8
COUNTERS_PER_SRC = 256


def _native() -> Any:
    from . import _C

    return _C


class StoreBootstrap:
    """Adapts a ``torch.distributed.Store`` (or anything with ``set``/``get``) to the proxy's key/value bootstrap.

    Args:
        store: ``torch.distributed.Store`` or an object with ``set(key: str, value: bytes)`` and
            ``get(key: str) -> bytes`` (blocking until the key exists).
        prefix: prepended to every key, so several proxies can share one store.
    """

    def __init__(self, store: Any, prefix: str = "uccl_moe/proxy/") -> None:
        if not (hasattr(store, "set") and hasattr(store, "get")):
            raise InvalidTypeError(f"store must have set() and get() (a torch.distributed.Store); got {type(store)!r}")
        self.store = store
        self.prefix = prefix

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        k = self.prefix + key
        if hasattr(self.store, "wait"):
            try:
                self.store.wait([k], datetime.timedelta(seconds=timeout_s))
            except TypeError:  # stores whose wait() takes no timeout
                self.store.wait([k])
        value = self.store.get(k)
        return bytes(value)


def _counter_names() -> list[str]:
    """Field names of ProxyCounters: the rows of ``proxy_counters.def``, the one list C++ also compiles."""
    rows = Path(__file__).with_name("proxy_counters.def").read_text().splitlines()
    return [m[1] for m in (_COUNTER_ROW.match(r) for r in rows) if m is not None]


_COUNTER_ROW = re.compile(r"^UCCL_MOE_PROXY_COUNTER\((\w+),\s*(?:SUM|MAX),")
#: Monotone counters summed over a proxy's threads (peaks: maxima); fields in ``proxy_counters.def`` order.
ProxyCounters = collections.namedtuple("ProxyCounters", _counter_names())  # type: ignore[misc]


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidUsageError(f"{name}={value} must be in [{lo}, {hi}]")
    return value


class Proxy:
    """The CPU proxy of one rank.

    Args:
        rank: this rank, ``0 <= rank < num_ranks``.
        num_ranks: R.
        store: bootstrap store (see :class:`StoreBootstrap`); every rank must use the same one and the same ``job``.
        transport: ``"loopback"``, ``"ibverbs"``, ``"efa"`` or ``"auto"``; ``None`` = ``UCCL_MOE_TRANSPORT``.
        num_threads, fifos_per_thread, fifo_capacity, max_inflight_bytes, max_inflight_writes, timeout_s: ``None`` =
            the ``UCCL_MOE_*`` knob of the same name.
        data_bytes: size of the registered data region (allocated by the transport; :meth:`data` views it).
        job: namespace of bootstrap keys and shared-memory names; unique per concurrently running group.
        cpus: where to pin the threads, in ``UCCL_MOE_PROXY_CPUS`` grammar (``"0-3"``, ``"auto"``: the NIC's NUMA
            node, per-rank ``"0-3;8-11"``); ``None`` = the knob; ``""`` = no pinning.
        ranks_per_node: for same-rail barriers; ``None`` = all ranks on one node.
        gpu_pci_bus_id: this rank's GPU (``"0000:53:00.0"``), so the NIC transports take the NIC nearest to it;
            ``None`` = unknown (they assume the ``local_rank``-th GPU in PCI order).
        local_rank: index on the node for per-rank ``UCCL_MOE_IB_HCA`` / ``UCCL_MOE_PROXY_CPUS`` lists; ``None`` =
            ``rank % ranks_per_node``.

    Threads never raise: a failure is kept and re-raised (``TransportError``, ``CommTimeoutError``) by the next call.
    Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        store: Any,
        *,
        transport: str | None = None,
        num_threads: int | None = None,
        fifos_per_thread: int | None = None,
        fifo_capacity: int | None = None,
        max_inflight_bytes: int | None = None,
        max_inflight_writes: int | None = None,
        timeout_s: float | None = None,
        data_bytes: int = 1 << 20,
        job: str = "uccl",
        cpus: str | None = None,
        ranks_per_node: int | None = None,
        gpu_pci_bus_id: str | None = None,
        local_rank: int | None = None,
    ) -> None:
        _check_int("num_ranks", num_ranks, 1, 4096)
        _check_int("rank", rank, 0, num_ranks - 1)
        _check_int("data_bytes", data_bytes, 4, 1 << 40)
        choices = _env.KNOBS["TRANSPORT"].min_or_choices.split("|")  # the knob table names the transports
        if transport is not None and transport not in choices:
            raise InvalidUsageError(f"transport={transport!r} must be one of {', '.join(choices)}")
        boot = store if isinstance(store, StoreBootstrap) else StoreBootstrap(store)
        self.rank, self.num_ranks = rank, num_ranks
        self._p = _native().Proxy(
            rank=rank,
            num_ranks=num_ranks,
            store_set=boot.set,
            store_get=boot.get,
            transport=transport,
            num_threads=num_threads,
            fifos_per_thread=fifos_per_thread,
            fifo_capacity=fifo_capacity,
            max_inflight_bytes=max_inflight_bytes,
            max_inflight_writes=max_inflight_writes,
            timeout_s=timeout_s,
            job=job,
            data_bytes=data_bytes,
            cpus=cpus,
            ranks_per_node=ranks_per_node,
            gpu_pci_bus_id=gpu_pci_bus_id or "",
            local_rank=None if local_rank is None else _check_int("local_rank", local_rank, 0, 4095),
        )

    # ---- lifecycle ----
    def start(self) -> Proxy:
        """Connect to every peer through the store (blocking) and start the threads."""
        self._p.start()
        _log.info("rank %d: proxy started (%s, %d threads)", self.rank, self.transport_name, self.num_threads)
        return self

    def stop(self) -> None:
        """Stop the threads; raises the first thread error if there was one."""
        self._p.stop()

    def check(self) -> None:
        """Raise the first thread error, if any."""
        self._p.check()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.stop()
        else:
            try:
                self.stop()
            except Exception as e:  # the original exception wins
                _log.warning("proxy stop after an error: %s", e)

    # ---- properties ----
    @property
    def running(self) -> bool:
        return bool(self._p.running)

    @property
    def num_threads(self) -> int:
        return int(self._p.num_threads)

    @property
    def num_fifos(self) -> int:
        return int(self._p.num_fifos)

    @property
    def transport_name(self) -> str:
        return str(self._p.transport_name)

    def nic(self) -> dict[str, Any]:
        """The transport's NIC for this rank: ``devices`` (empty for loopback), ``numa_node``, ``numa_cpus``,
        ``reason``, and ``pinned_cpus`` (the CPUs the threads are pinned to; empty = not pinned), ``local_rank``."""
        return dict(self._p.nic())

    def data(self) -> Any:
        """``uint8[data_bytes]`` numpy view of the registered data region (valid while this Proxy lives)."""
        return self._p.data_view()

    def counter_array(self) -> Any:
        """``int64[R * 256]`` numpy view of the counters (source-major: ``[src * 256 + slot]``)."""
        return self._p.counters_view()

    @property
    def timeout_s(self) -> float:
        """The resolved ``UCCL_MOE_TIMEOUT_S`` (or the ``timeout_s`` given) every wait of this proxy uses."""
        return float(self._p.timeout_s)

    def counters(self) -> Any:
        """:data:`ProxyCounters` summed over threads: commands, bytes, reorders, stalls, ..."""
        return ProxyCounters(**self._p.counters())

    # ---- host producer ----
    def _fifo(self, fifo: int) -> int:
        return _check_int("fifo", fifo, 0, self.num_fifos - 1)

    def _push(self, fifo: int, op: int, flags: int = 0, dst_rank: int = 0, nbytes: int = 0, slot: int = 0,
              value: int = 0, src_offset: int = 0, dst_offset: int = 0) -> int:
        w0, w1 = _native().encode_transfer_cmd(op, flags, dst_rank, nbytes, slot, value, src_offset, dst_offset)
        return int(self._p.push_raw(self._fifo(fifo), w0, w1))

    def push_write(self, fifo: int, dst_rank: int, nbytes: int, src_offset: int, dst_offset: int, *,
                   counter_slot: int | None = None, counter_add: int = 1, ll_group: int | None = None,
                   ll_phase: int = 0) -> int:
        """Queue a write of ``nbytes`` from our data region to ``dst_rank``'s; returns the command index.

        ``counter_slot``: after this write and every earlier write of the FIFO to ``dst_rank`` landed, add
        ``counter_add`` (int8) to ``dst_rank``'s counter ``[rank * 256 + counter_slot]`` (HT).
        ``ll_group``: count the write for the LL fence of group ``(ll_group, ll_phase)`` instead.
        Offsets are bytes, multiples of 4.
        """
        _check_int("dst_rank", dst_rank, 0, self.num_ranks - 1)
        if counter_slot is not None and ll_group is not None:
            raise InvalidUsageError("a write carries either counter_slot (HT) or ll_group (LL), not both")
        flags, slot = 0, 0
        if counter_slot is not None:
            flags, slot = FLAG_COUNTER, _check_int("counter_slot", counter_slot, 0, 255)
        if ll_group is not None:
            flags, slot = FLAG_LL | (FLAG_PHASE if ll_phase else 0), _check_int("ll_group", ll_group, 0, 255)
        return self._push(fifo, OP_WRITE, flags, dst_rank, nbytes, slot, counter_add if counter_slot is not None else 0,
                          src_offset, dst_offset)

    def push_atomic(self, fifo: int, dst_rank: int, counter_slot: int, value: int) -> int:
        """Add ``value`` (int8) to ``dst_rank``'s counter ``[rank * 256 + counter_slot]`` after every earlier write
        of the FIFO to ``dst_rank`` landed."""
        _check_int("dst_rank", dst_rank, 0, self.num_ranks - 1)
        return self._push(fifo, OP_ATOMIC, 0, dst_rank, 0, counter_slot, value)

    def push_ll_fence(self, fifo: int, dst_rank: int, ll_group: int, expected: int, ll_phase: int = 0) -> int:
        """Once ``expected`` LL writes of group ``(ll_group, ll_phase)`` landed at ``dst_rank``, add
        ``-expected - 1`` to its counter ``[rank * 256 + ll_group]`` (DeepEP's LL count signal)."""
        _check_int("dst_rank", dst_rank, 0, self.num_ranks - 1)
        _check_int("expected", expected, 0, (1 << 20) - 1)
        return self._push(fifo, OP_ATOMIC, FLAG_LL | (FLAG_PHASE if ll_phase else 0), dst_rank, expected, ll_group, 0)

    def push_quiet(self, fifo: int) -> int:
        """Fence: completes once every earlier command of the FIFO completed."""
        return self._push(fifo, OP_QUIET)

    def push_barrier(self, fifo: int, same_rail: bool = False) -> int:
        """Drain the FIFO, then meet the same proxy thread of every peer (or only same-rail peers)."""
        return self._push(fifo, OP_BARRIER, FLAG_SAME_RAIL if same_rail else 0)

    def wait(self, fifo: int, idx: int) -> None:
        """Block until command ``idx`` of ``fifo`` (and all before it) completed; raises thread errors; bounded by
        twice ``UCCL_MOE_TIMEOUT_S``."""
        self._p.wait(self._fifo(fifo), idx)

    def done(self, fifo: int, idx: int) -> bool:
        """True once command ``idx`` of ``fifo`` completed."""
        return bool(self._p.check_completion(self._fifo(fifo), idx))


def transports() -> list[tuple[str, bool]]:
    """Transports compiled into this build, in priority order, with whether their device probe succeeds."""
    return [(str(n), bool(ok)) for n, ok in _native().proxy_transports()]


def default_threads() -> int:
    """``UCCL_MOE_PROXY_THREADS``."""
    return int(_env.get("PROXY_THREADS"))


__all__ = ["Proxy", "ProxyCounters", "StoreBootstrap", "transports", "default_threads"]
