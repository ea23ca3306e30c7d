"""Host facts for ``uccl-moe doctor`` (:mod:`uccl_moe.doctor`): GPUs, kernel modules, dma-buf support, knob values,
and the transport's own GID / QoS rules through ``uccl_moe._C``."""

from __future__ import annotations

import platform as _platform
from pathlib import Path
from typing import Any

from . import env as _env
from .errors import UcclMoeError

PEER_MODULES = ("nvidia_peermem", "efa_nv_peermem", "nv_peer_mem")


def _native() -> Any:
    try:
        from . import _C
    except ImportError:
        return None
    return _C


def _problem(severity: str, what: str, fix: str) -> dict[str, str]:
    return {"severity": severity, "what": what, "fix": fix}


# ---------------------------------------------------------------------------------------------------------------
# host facts


def _torch_gpus() -> list[dict[str, Any]]:
    """GPUs torch sees (name, memory, PCI bus id), in device order; empty without torch or GPUs."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = ""
        if hasattr(p, "pci_bus_id"):
            bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
        out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "pci_bus_id": bus})
    return out


def _loaded_modules(sysfs_root: str) -> set[str]:
    mods = {p.name for p in Path(sysfs_root, "module").glob("*")}
    if sysfs_root == "/sys":
        try:
            mods |= {line.split()[0] for line in Path("/proc/modules").read_text().splitlines() if line.strip()}
        except OSError:
            pass
    return mods


def _dmabuf_kernel(sysfs_root: str) -> tuple[bool | None, str]:
    """Whether the kernel's RDMA core registers dma-buf memory (ibv_reg_dmabuf_mr, Linux >= 5.12); None = unknown
    (another sysfs tree than this host's)."""
    if sysfs_root != "/sys":
        return None, "unknown for a recorded sysfs tree"
    release = _platform.release()
    try:
        if "ib_umem_dmabuf_get" in Path("/proc/kallsyms").read_text():
            return True, f"kernel {release} (ib_umem_dmabuf_get present)"
    except OSError:
        pass
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return None, f"kernel {release}"
    return (major, minor) >= (5, 12), f"kernel {release}"


def _knob(name: str, problems: list[dict[str, str]]) -> Any:
    try:
        return _env.get(name)
    except UcclMoeError as e:
        problems.append(_problem("error", str(e), f"fix or unset {_env.KNOBS[name].var}"))
        return _env.KNOBS[name].parse(_env.KNOBS[name].default)


def _thor2_bytes_per_gpu() -> int:
    """The in-flight byte budget per GPU the proxy gives Thor-2 (flow_control.cc nic_flow_defaults, one thread)."""
    return int(_native().nic_flow_defaults("bnxt_re", 1)[0])


def _qos(name: str, value: str, auto: int, hi: int, problems: list[dict[str, str]]) -> int:
    """A traffic class or service level as the ibverbs transport resolves it: `auto` is RoCE's lossless-class
    default (TC 104, SL 3, as in ibverbs.cc) or 0 on InfiniBand; otherwise an int in [0, hi]."""
    if value == "auto":
        return auto
    try:
        return int(_native().env_parse_int(name, value, "0", str(hi)))  # the transport's parser (ibverbs.cc)
    except UcclMoeError:
        problems.append(_problem("error", f"UCCL_MOE_{name}={value!r} is not auto or an integer in [0, {hi}]",
                                 f"set UCCL_MOE_{name}=auto or a value in [0, {hi}]"))
        return auto


def _pick_gid(gids: list[dict[str, Any]], link_layer: str, knob: str) -> tuple[int, str, str]:
    """(index, type, problem) the GID rule gives: an explicit UCCL_MOE_IB_GID_INDEX; on RoCE the first RoCE v2 GID
    with an IPv4-mapped address, else a RoCE v2 ULA/global IPv6 one (Broadcom), never a link-local one
    (uccl include/rdma_util.hpp GID choice by gid_attrs/types; nic_rules.md RoCE GID); InfiniBand and EFA: 0."""
    if knob != "auto":
        try:
            idx = int(_native().env_parse_int("IB_GID_INDEX", knob, "0", "255"))  # the transport's parser
        except UcclMoeError as e:
            return -1, "-", str(e)
        match = [g for g in gids if g["index"] == idx]
        if not match:
            return idx, "?", f"UCCL_MOE_IB_GID_INDEX={idx} is not in the GID table"
        return idx, match[0]["type"] or "-", ""
    if link_layer != "Ethernet":
        return 0, (gids[0]["type"] if gids else "") or "-", ""
    # The ibverbs transport's preference (nic_select.hpp roce_gid_preference): lowest rank, then lowest index.
    C = _native()
    ranked = [(C.gid_preference(g["gid"]), g["index"]) for g in gids if g["type"] == "RoCE v2"]
    ranked = sorted(r for r in ranked if r[0] >= 0)
    if not ranked:
        return -1, "-", "no routable RoCE v2 GID (only link-local or v1)"
    pref, idx = ranked[0]
    return idx, "RoCE v2 IPv4" if pref == 0 else "RoCE v2 IPv6", ""


def _compact(cpus: list[int]) -> str:
    out, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)
