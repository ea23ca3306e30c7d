"""``uccl-moe doctor``: what the internode path will use on this host, what will not work, and the fix.

    uccl-moe doctor                       # GPUs, RDMA devices, the NIC / GID / TC / MTU / CPUs per local rank, device
                                          # capabilities, GPU memory registration, flow control; problems with fixes
    uccl-moe doctor --json                # the same as one JSON object
    uccl-moe doctor --sysfs-root DIR      # read another sysfs tree (tests: tests/fixtures/sysfs/<platform>)
    torchrun --nproc-per-node 8 -m uccl_moe.cli doctor --pair     # or under srun: a transport self-test

``--pair`` runs write, write-with-immediate, software atomic, barrier and a short latency and bandwidth figure
through the real proxy and transport (``uccl_moe.proxy.Proxy``) between every rank and the next one, and names the
fix of each failure. Without RDMA devices it says so and runs over the loopback transport (one host only).
The NIC rules are native/src/transport/nic_select.hpp's (through ``uccl_moe._C``); docs/internode.md has the
per-platform first-run checklist.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from . import env as _env
from .cli import subcommand
from .errors import CommTimeoutError, TransportError, UcclMoeError

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


# ---------------------------------------------------------------------------------------------------------------
# the report


# long: one checklist in report order (transport, per-rank NIC, memory registration, flow control); split in a follow-up
def collect(sysfs_root: str = "/sys", local_ranks: int | None = None) -> dict[str, Any]:
    """Everything ``uccl-moe doctor`` prints, as a dict (``--json``); ``problems`` lists what will not work."""
    problems: list[dict[str, str]] = []
    C = _native()
    rep: dict[str, Any] = {"host": socket.gethostname(), "sysfs_root": sysfs_root, "problems": problems}
    live = sysfs_root == "/sys"
    if C is None:
        problems.append(_problem("error", "the native module uccl_moe._C is not built",
                                 "pip install . (or tools/build_inplace.sh) with a C++ compiler"))
        return rep
    rep["transports"] = {n: bool(ok) for n, ok in C.proxy_transports()}
    has_verbs = hasattr(C, "rdma_device_caps")
    port = int(_knob("IB_PORT", problems))
    sysfs = C.nic_sysfs(sysfs_root, port)
    devices = sysfs["devices"]
    rep["rdma_devices"] = devices
    verbs_names = list(C.rdma_device_names()) if (has_verbs and live) else []
    rep["verbs_devices"] = verbs_names

    torch_gpus = _torch_gpus() if live else []
    rep["gpus"] = torch_gpus or [{"index": i, "name": g["vendor"], "pci_bus_id": g["pci_addr"]}
                                 for i, g in enumerate(sysfs["gpus"])]
    rep["gpus_from"] = "torch" if torch_gpus else "sysfs"

    # Which transport the ranks would use.
    forced = _knob("TRANSPORT", problems)
    efa = [d for d in devices if d["efa"]]
    verbs = [d for d in devices if not d["efa"]]
    family = forced if forced in ("efa", "ibverbs") else ("efa" if efa else "ibverbs" if verbs else "loopback")
    rep["transport"] = family
    if not devices:
        problems.append(_problem(
            "warn", "no RDMA devices in " + sysfs_root + "/class/infiniband: internode traffic can only use the "
            "loopback transport, which does not leave this host",
            "install the NIC driver and rdma-core; in a container pass --device=/dev/infiniband and mount /sys"))
    elif live and has_verbs and not verbs_names:
        problems.append(_problem(
            "error", "sysfs lists RDMA devices but libibverbs opens none (no userspace provider)",
            "install the rdma-core provider (libefa / libmlx5 / libbnxt_re); Thor-2 containers: rebuild libbnxt_re to "
            "match the host driver (Primus REBUILD_BNXT)"))
    elif live and not has_verbs:
        problems.append(_problem("error", "this uccl_moe build has no ibverbs/efa transport",
                                 "rebuild with rdma-core headers (libibverbs-dev, efadv.h for EFA)"))

    # Per local rank: NIC, GID, TC/SL, MTU, CPUs.
    n = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or len(rep["gpus"]) or 1
    hca = str(_knob("IB_HCA", problems))
    cpus_knob = str(_knob("PROXY_CPUS", problems))
    gid_knob = str(_knob("IB_GID_INDEX", problems))
    tc_knob, sl_knob = str(_knob("IB_TC", problems)), str(_knob("IB_SL", problems))
    by_name = {d["name"]: d for d in devices}
    ranks: list[dict[str, Any]] = []
    caps: dict[str, Any] = {}
    allowed = sorted(os.sched_getaffinity(0)) if live and hasattr(os, "sched_getaffinity") else []
    for lr in range(n):
        gpu = rep["gpus"][lr]["pci_bus_id"] if lr < len(rep["gpus"]) else ""
        row: dict[str, Any] = {"local_rank": lr, "gpu": gpu}
        ranks.append(row)
        if family == "loopback":
            row.update(nic=[], reason="no NIC (loopback)", cpus="-")
            continue
        try:
            ch = C.nic_choose(sysfs_root, family, gpu, lr, hca, verbs_names, port)
        except UcclMoeError as e:
            row.update(nic=[], reason=str(e), cpus="-")
            problems.append(_problem("error", f"local rank {lr}: {e}", "fix UCCL_MOE_IB_HCA (docs/internode.md)"))
            continue
        row.update(nic=ch["devices"], reason=ch["reason"], numa_node=ch["numa_node"], pcie_hops=ch["pcie_distance"])
        if family == "efa" and len(ch["devices"]) > 1:
            row["reason"] += f"; proxy thread t uses {' / '.join(ch['devices'])}[t % {len(ch['devices'])}]"
        elif family == "efa" and ch["devices"] and rep["gpus"] and len(efa) >= 2 * len(rep["gpus"]):
            problems.append(_problem("warn", f"local rank {lr} gets one EFA device ({ch['devices'][0]}) on a host "
                                     f"with {len(efa)} for {len(rep['gpus'])} GPUs: half the GPU's EFA bandwidth",
                                     "bring the GPU's other EFA device up (see the DOWN devices above)"))
        if not ch["devices"]:
            problems.append(_problem("error", f"local rank {lr}: {ch['reason']}",
                                     "check the NIC ports (ibv_devinfo) or set UCCL_MOE_TRANSPORT"))
            continue
        dev = by_name.get(ch["devices"][0], {})
        if dev and dev.get("port_state") not in ("ACTIVE", None):
            problems.append(_problem("error", f"{dev['name']} port is {dev['port_state']}",
                                     "bring the link up (cable, switch port; InfiniBand: a subnet manager)"))
        gid_idx, gid_type, gid_err = _pick_gid(dev.get("gids", []), dev.get("link_layer", ""), gid_knob)
        if family == "efa":
            gid_idx, gid_type, gid_err = 0, "EFA", ""
        roce = dev.get("link_layer", "").lower() == "ethernet"
        if family == "efa":
            tc, sl = 0, int(_knob("EFA_SL", problems))
        else:
            tc = _qos("IB_TC", tc_knob, 104 if roce else 0, 255, problems)
            sl = _qos("IB_SL", sl_knob, 3 if roce else 0, 15, problems)
        row.update(gid_index=gid_idx, gid_type=gid_type, tc=tc, sl=sl)
        if gid_err:
            problems.append(_problem("error", f"local rank {lr} ({dev.get('name')}): {gid_err}",
                                     "configure an IPv4 (or ULA IPv6) address on the NIC's netdev, or set "
                                     "UCCL_MOE_IB_GID_INDEX to a RoCE v2 GID (show_gids)"))
        mtu = next((g["ndev_mtu"] for g in dev.get("gids", []) if g["index"] == gid_idx), -1)
        row["mtu"] = f"netdev {mtu}" if mtu > 0 else "-"
        if live and has_verbs:
            for name in ch["devices"]:
                if name not in caps:
                    caps[name] = dict(C.rdma_device_caps(name, port))
            c0 = caps[ch["devices"][0]]
            if c0.get("active_mtu"):
                row["mtu"] = str(c0["active_mtu"])
        try:
            mode, lst = C.proxy_cpus_for_rank(cpus_knob, lr)
        except UcclMoeError as e:
            problems.append(_problem("error", str(e), "fix UCCL_MOE_PROXY_CPUS (docs/internode.md)"))
            mode, lst = "none", []
        if mode == "auto":
            numa = ch["numa_cpus"]
            row["cpus"] = f"NUMA {ch['numa_node']}: {numa}" if numa else "not pinned (NUMA unknown)"
            node_cpus = set(C.proxy_cpus_for_rank(ch["numa_cpus"], 0)[1]) if ch["numa_cpus"] else set()
            if allowed and node_cpus and not node_cpus & set(allowed):
                problems.append(_problem(
                    "warn", f"local rank {lr}: this process may not run on NUMA node {ch['numa_node']} "
                    f"({ch['numa_cpus']}), its NIC's node; proxy threads stay unpinned",
                    "give the job all CPUs (sbatch --cpus-per-task=<all>, --exclusive) or set UCCL_MOE_PROXY_CPUS"))
        else:
            row["cpus"] = "none" if mode == "none" else _compact(lst)
    rep["local_ranks"] = ranks
    rep["capabilities"] = caps
    for name, c in caps.items():
        if c.get("error"):
            problems.append(_problem("error", f"{name}: {c['error']}",
                                     "check /dev/infiniband permissions and ulimit -l (memlock unlimited)"))
        if c.get("efa_queried") and not c.get("efa_rdma_write"):
            problems.append(_problem("error", f"{name}: this EFA device has no RDMA write",
                                     "use an instance with EFA RDMA write (p5/p5e/p5en, EFAv2+) or UCCL_MOE_TRANSPORT"))

    # GPU memory registration.
    mods = _loaded_modules(sysfs_root)
    dmabuf, dmabuf_detail = _dmabuf_kernel(sysfs_root)
    peer = [m for m in PEER_MODULES if m in mods]
    nvidia = any("nvidia" in str(g.get("name", "")).lower() or g.get("name") == "nvidia" for g in rep["gpus"])
    amd = any(str(g.get("name", "")).lower() in ("amd",) or "instinct" in str(g.get("name", "")).lower()
              or "mi3" in str(g.get("name", "")).lower() for g in rep["gpus"])
    rep["memory_registration"] = {"peer_memory_modules": peer, "amdgpu": "amdgpu" in mods,
                                  "dmabuf_kernel": dmabuf, "dmabuf_detail": dmabuf_detail}
    if devices and nvidia and not peer and dmabuf is not True:
        problems.append(_problem(
            "error" if dmabuf is False else "warn",
            "GPU memory cannot be registered with the NIC: no peer-memory module "
            f"({', '.join(PEER_MODULES)}) and dma-buf is {'unsupported' if dmabuf is False else 'unknown'} "
            f"({dmabuf_detail})",
            "modprobe nvidia_peermem (EFA: efa_nv_peermem), or run a kernel >= 5.12 with the NVIDIA open kernel module "
            "for dma-buf"))
    if devices and amd and "amdgpu" not in mods:
        problems.append(_problem("error", "amdgpu is not loaded: MI300X memory cannot be exported by dma-buf",
                                 "load amdgpu (ROCm driver)"))

    # Flow control and QoS in force.
    fc_names = [k for k in _env.KNOBS if "INFLIGHT" in k or k.startswith("IB_") or k in ("PROXY_THREADS", "TIMEOUT_S")]
    rep["settings"] = {_env.KNOBS[k].var: {"value": _knob(k, problems), "source": _env.source(k)} for k in fc_names}
    chosen = {d for r in ranks for d in r.get("nic", [])}
    if any(d.startswith("bnxt_re") for d in chosen):
        # The limits the proxy will use (flow_control.cc resolve_flow_limits); bytes are per proxy thread.
        threads = int(_knob("PROXY_THREADS", problems))
        thor2_bytes = _thor2_bytes_per_gpu()
        try:
            b, w, _, _ = C.flow_limits("bnxt_re", threads)
        except UcclMoeError:  # a bad knob: already listed among the problems by the settings above
            b, w = 0, 0
        rep["flow_control"] = {"max_inflight_bytes_per_thread": b, "max_inflight_writes_per_fifo": w,
                               "proxy_threads": threads}
        if b == 0 or b * threads > thor2_bytes or w > 1:
            problems.append(_problem(
                "warn", f"Broadcom Thor-2 with {'unlimited' if b == 0 else b * threads} bytes per GPU and {w} writes "
                "per FIFO in flight: expect CQE error 12 (transport retry exceeded) under load",
                "unset UCCL_MOE_MAX_INFLIGHT_BYTES and UCCL_MOE_MAX_INFLIGHT_WRITES (the Thor-2 defaults, "
                f"{thor2_bytes} bytes per GPU and 1 write, then apply)"))
    roce = any(by_name.get(d, {}).get("link_layer") == "Ethernet" for d in chosen)
    if roce and tc == 0:
        problems.append(_problem(
            "warn", "RoCE with UCCL_MOE_IB_TC=0: traffic goes in the best-effort class, which drops under congestion",
            "set UCCL_MOE_IB_TC to your fabric's lossless class (DSCP << 2, e.g. 104 for DSCP 26) and UCCL_MOE_IB_SL"))
    return rep


def format_report(rep: dict[str, Any]) -> str:
    """The compact text form of :func:`collect`'s dict."""
    lines = [f"uccl-moe doctor on {rep['host']} (sysfs {rep['sysfs_root']})"]
    if "transports" in rep:
        built = ", ".join(f"{n}{'' if ok else ' (no device)'}" for n, ok in rep["transports"].items())
        lines.append(f"  transports built: {built}; ranks would use: {rep['transport']}")
    gpus = rep.get("gpus", [])
    lines.append(f"GPUs ({rep.get('gpus_from', '-')}): {len(gpus)}")
    for g in gpus:
        lines.append(f"  {g['index']}: {g['name']} {g['pci_bus_id']}")
    devs = rep.get("rdma_devices", [])
    lines.append(f"RDMA devices: {len(devs)}" + ("" if not rep.get("verbs_devices") else
                                                  f" (libibverbs opens {len(rep['verbs_devices'])})"))
    for d in devs:
        lines.append(f"  {d['name']:<12} {d['pci_addr'] or '-':<13} numa {d['numa_node']:>2}  "
                     f"{d['port_state'] or '?':<7} {d['link_layer'] or '?':<11} {d['rate']}")
    if rep.get("local_ranks"):
        lines.append("Per local rank:")
        lines.append(f"  {'rank':<4} {'gpu':<13} {'nic':<24} {'gid':<16} {'tc/sl':<6} {'mtu':<11} cpus")
        for r in rep["local_ranks"]:
            gid = f"{r['gid_index']} {r['gid_type']}" if "gid_index" in r else "-"
            tcsl = f"{r['tc']}/{r['sl']}" if "tc" in r else "-"
            lines.append(f"  {r['local_rank']:<4} {r['gpu'] or '-':<13} {'+'.join(r['nic']) or '-':<24} {gid:<16} "
                         f"{tcsl:<6} {r.get('mtu', '-'):<11} {r['cpus']}")
            lines.append(f"       why: {r['reason']}")
    for name, c in rep.get("capabilities", {}).items():
        s = (f"  {name}: atomics {c['atomic_cap']}, max_qp {c['max_qp']}, max_qp_wr {c['max_qp_wr']}, max_cqe "
             f"{c['max_cqe']}, max_mr {c['max_mr_size']}, rd_atom {c['max_qp_rd_atom']}")
        if c.get("efa_queried"):
            s += (f"; EFA rdma_write {c['efa_rdma_write']}, unsolicited_recv {c['efa_unsolicited_write_recv']}, "
                  f"max_rdma_size {c['efa_max_rdma_size']}, sq/rq wr {c['efa_max_sq_wr']}/{c['efa_max_rq_wr']}")
        lines.append(("Capabilities:\n" if name == next(iter(rep["capabilities"])) else "") + s)
    mr = rep.get("memory_registration")
    if mr:
        lines.append(f"GPU memory registration: peer memory {', '.join(mr['peer_memory_modules']) or 'none'}; "
                     f"amdgpu {'loaded' if mr['amdgpu'] else 'no'}; dma-buf "
                     f"{ {True: 'yes', False: 'no', None: 'unknown'}[mr['dmabuf_kernel']] } ({mr['dmabuf_detail']})")
    if rep.get("settings"):
        lines.append("Settings: " + " ".join(f"{k.removeprefix('UCCL_MOE_')}={v['value']}"
                                            f"{'*' if v['source'] == 'env' else ''}"
                                            for k, v in rep["settings"].items()) + "   (* = from the environment)")
    probs = rep["problems"]
    lines.append("Problems: none" if not probs else f"Problems: {len(probs)}")
    for p in probs:
        lines.append(f"  [{p['severity']}] {p['what']}\n      fix: {p['fix']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# --pair: the transport self-test


def _fix_for(e: BaseException) -> str:
    msg = str(e)
    if "RETRY_EXC" in msg or "retry" in msg.lower():
        return (f"transport retries exhausted (CQE 12): lower UCCL_MOE_MAX_INFLIGHT_BYTES/WRITES (Thor-2: "
                f"{_thor2_bytes_per_gpu()}/1), check PFC/ECN and that UCCL_MOE_IB_TC maps to the lossless class")
    if "RNR" in msg:
        return "receiver not ready: the peer posted no receive (EFA: a provider without unsolicited receive); report it"
    if "reg_mr" in msg or "dmabuf" in msg or "REM_ACCESS" in msg or "access" in msg.lower():
        return "memory registration: load nvidia_peermem / efa_nv_peermem or use dma-buf; check ulimit -l unlimited"
    if isinstance(e, CommTimeoutError) or "timed out" in msg.lower() or "timeout" in msg.lower():
        return ("the peer never saw the data: RoCE: check UCCL_MOE_IB_GID_INDEX (same subnet or routed RoCE v2) and "
                "UCCL_MOE_IB_TC; EFA: the security group must allow all traffic to itself; IB: the subnet manager")
    if isinstance(e, TransportError):
        return "see the transport error above; `uccl-moe doctor` (without --pair) lists the NIC, GID and settings"
    return "unexpected failure: rerun with UCCL_MOE_LOG_LEVEL=INFO and report it"


def _wait_counter(arr: Any, idx: int, want: int, timeout_s: float, what: str, at_least: bool = False) -> None:
    end = time.monotonic() + timeout_s
    while not (int(arr[idx]) >= want if at_least else int(arr[idx]) == want):
        if time.monotonic() > end:
            raise CommTimeoutError(f"{what}: counter {idx} is {int(arr[idx])}, expected {want} after {timeout_s:.0f} s")
        time.sleep(0)


# long: the self-test steps are closures over one live proxy (start, writes, atomic, barrier, latency, bandwidth)
def run_pair(rank: int, world: int, store: Any, *, local_rank: int, ranks_per_node: int, transport: str,
             job: str, gpu_pci_bus_id: str = "", bw_bytes: int = 1 << 20, bw_iters: int = 32, lat_iters: int = 200,
             timeout_s: float = 30.0, barrier: Any = None) -> dict[str, Any]:
    """The self-test of one rank: rank r writes to r+1 and hears from r-1. Returns {"nic", "transport", "tests":
    [{name, ok, detail, fix}]}. `barrier()` synchronizes the ranks outside the transport (a gloo barrier)."""
    import numpy as np

    from .proxy import Proxy

    peer, src = (rank + 1) % world, (rank - 1) % world
    chunk = max(4096, bw_bytes)
    data_bytes = 4 * chunk
    recv = chunk  # [0, chunk): what we send; [chunk, 2 chunk): what src writes to us
    tests: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rank": rank, "transport": transport, "tests": tests}
    sync = barrier or (lambda: None)

    def step(name: str, fn: Any) -> bool:
        if proxy is not None and tests and not tests[-1]["ok"]:
            try:
                proxy.check()
            except UcclMoeError as e:  # a failed proxy fails every later test at once: name the first cause only
                tests.append({"name": name, "ok": False, "detail": f"not run: the proxy failed ({type(e).__name__})",
                              "fix": "see the first failure"})
                return False
        t0 = time.perf_counter()
        try:
            detail = fn() or "ok"
            tests.append({"name": name, "ok": True, "detail": detail, "fix": "",
                          "ms": round(1e3 * (time.perf_counter() - t0), 2)})
            return True
        except Exception as e:  # noqa: BLE001 - every failure is reported with its fix
            tests.append({"name": name, "ok": False, "detail": f"{type(e).__name__}: {e}", "fix": _fix_for(e)})
            return False

    proxy: Any = None

    def start() -> str:
        nonlocal proxy
        proxy = Proxy(rank, world, store, transport=transport, data_bytes=data_bytes, job=job, timeout_s=timeout_s,
                      ranks_per_node=ranks_per_node, gpu_pci_bus_id=gpu_pci_bus_id or None, local_rank=local_rank)
        proxy.start()
        nic = proxy.nic()
        result["nic"] = nic
        return f"{proxy.transport_name}, {proxy.num_threads} threads, NIC {'+'.join(nic['devices']) or '-'}"

    if not step("connect", start):
        return result
    data, ctr = proxy.data(), proxy.counter_array()
    pattern = ((np.arange(4096, dtype=np.int64) * 7 + rank * 13) % 251).astype(np.uint8)
    expect = ((np.arange(4096, dtype=np.int64) * 7 + src * 13) % 251).astype(np.uint8)

    def write() -> str:
        data[:4096] = pattern
        proxy.wait(0, proxy.push_write(0, peer, 4096, 0, recv))
        sync()
        if not np.array_equal(data[recv:recv + 4096], expect):
            raise TransportError(f"write: the bytes from rank {src} did not land (or landed corrupted)")
        return "4 KiB landed intact"

    def write_imm() -> str:
        data[:4096] = pattern[::-1]
        proxy.push_write(0, peer, 4096, 0, recv + 4096, counter_slot=1, counter_add=1)
        _wait_counter(ctr, src * 256 + 1, 1, timeout_s, "write-with-immediate")
        if not np.array_equal(data[recv + 4096:recv + 8192], expect[::-1]):
            raise TransportError("write-with-immediate: the counter moved but the bytes are wrong")
        return "counter after data"

    def atomic() -> str:
        proxy.push_atomic(0, peer, 2, 5)
        proxy.push_atomic(0, peer, 2, -2)
        _wait_counter(ctr, src * 256 + 2, 3, timeout_s, "software atomic")
        return "5 - 2 = 3"

    def barrier_test() -> str:
        proxy.wait(0, proxy.push_barrier(0))
        return "all ranks met"

    def latency() -> str:
        samples = []
        for i in range(1, lat_iters + 1):
            t0 = time.perf_counter()
            proxy.push_write(0, peer, 8, 0, recv, counter_slot=3, counter_add=1)
            _wait_counter(ctr, src * 256 + 3, i, timeout_s, "latency", at_least=True)  # the peer may be a step ahead
            samples.append(time.perf_counter() - t0)
        samples.sort()
        return f"latency {1e6 * samples[len(samples) // 2]:.1f} us (ring step, 8 B write + counter, median)"

    def bandwidth() -> str:
        sync()
        t0 = time.perf_counter()
        idx = 0
        for _ in range(bw_iters):
            idx = proxy.push_write(0, peer, chunk, 0, recv)
        proxy.wait(0, idx)
        dt = time.perf_counter() - t0
        return f"bandwidth {bw_iters * chunk / dt / 1e9:.2f} GB/s ({bw_iters} x {chunk >> 10} KiB writes)"

    try:
        for name, fn in (("write", write), ("write_with_imm", write_imm), ("software_atomic", atomic),
                         ("barrier", barrier_test), ("latency", latency), ("bandwidth", bandwidth)):
            step(name, fn)
        sync()
        step("stop", lambda: proxy.stop() or "clean")
    finally:
        if proxy is not None and proxy.running:
            try:
                proxy.stop()
            except UcclMoeError:
                pass
    return result


def _pair_env() -> tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from torchrun or srun."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return (int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)),
                int(e.get("LOCAL_WORLD_SIZE", e["WORLD_SIZE"])))
    if "SLURM_PROCID" in e:
        world = int(e["SLURM_NTASKS"])
        local_world = int(e.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or world)
        return int(e["SLURM_PROCID"]), world, int(e.get("SLURM_LOCALID", 0)), local_world
    return -1, 0, 0, 0


def pair_main(args: argparse.Namespace) -> int:
    rank, world, local_rank, local_world = _pair_env()
    if world < 2:
        print("uccl-moe doctor --pair: needs 2+ ranks: run it under torchrun (--nproc-per-node 2) or srun "
              "(RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS, and MASTER_ADDR/MASTER_PORT)", file=sys.stderr)
        return 2
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        nodes = len(set(hosts))
        C = _native()
        transport = args.transport or str(_env.get("TRANSPORT"))
        note = ""
        if transport == "auto":
            usable = [n for n, ok in C.proxy_transports() if ok and n != "loopback"]
            if not usable:
                transport, note = "loopback", "no RDMA devices here: the self-test runs over the loopback transport"
            else:
                transport = usable[0]
        if transport == "loopback" and nodes > 1:
            if rank == 0:
                print(f"uccl-moe doctor --pair: {nodes} nodes but no RDMA transport usable "
                      f"({note or 'UCCL_MOE_TRANSPORT=loopback'}): loopback does not leave a host. Fix: install the "
                      "NIC driver and rdma-core (run `uccl-moe doctor` on a node)", file=sys.stderr)
            return 1
        gpu_bus = ""
        try:
            gpus = _torch_gpus()
            if gpus:
                gpu_bus = gpus[local_rank % len(gpus)]["pci_bus_id"]
        except Exception:  # noqa: BLE001 - a broken CUDA setup must not hide the transport test
            gpu_bus = ""
        token: list[Any] = [os.urandom(4).hex()]
        dist.broadcast_object_list(token, src=0)
        from .proxy import StoreBootstrap

        store = StoreBootstrap(dist.distributed_c10d._get_default_store(), prefix=f"uccl_moe/doctor{token[0]}/")
        res = run_pair(rank, world, store, local_rank=local_rank,
                       ranks_per_node=local_world if world % max(local_world, 1) == 0 else world,
                       transport=transport, job=f"doctor{token[0]}", gpu_pci_bus_id=gpu_bus,
                       bw_bytes=args.bytes, bw_iters=args.iters, timeout_s=args.timeout,
                       barrier=lambda: dist.barrier())
        res["host"] = socket.gethostname()
        results: list[Any] = [None] * world
        dist.all_gather_object(results, res)
    finally:
        dist.destroy_process_group()
    failed = [t for r in results for t in r["tests"] if not t["ok"]]
    if rank == 0:
        if args.json:
            print(json.dumps({"nodes": nodes, "transport": transport, "note": note, "ranks": results}, indent=1))
        else:
            print(f"uccl-moe doctor --pair: {world} ranks on {nodes} node(s) over {transport}" +
                  (f" ({note})" if note else ""))
            for r in results:  # one line per rank; failures spelled out with their fix
                nic = r.get("nic") or {}
                nic_s = "+".join(nic.get("devices", [])) or "-"
                cpus = _compact(nic.get("pinned_cpus", [])) or "unpinned"
                ok = [t for t in r["tests"] if t["ok"]]
                figures = {t["name"]: t["detail"] for t in ok if t["name"] in ("latency", "bandwidth")}
                print(f"  rank {r['rank']:<3} {r['host']} nic {nic_s} cpus {cpus}: {len(ok)}/{len(r['tests'])} ok"
                      + "".join(f" | {v}" for v in figures.values()))
                skipped = [t["name"] for t in r["tests"] if not t["ok"] and t["detail"].startswith("not run")]
                for t in r["tests"]:
                    if not t["ok"] and t["name"] not in skipped:
                        print(f"      FAIL {t['name']}: {t['detail']}\n           fix: {t['fix']}")
                if skipped:
                    print(f"      not run after that failure: {', '.join(skipped)}")
            print("PASS" if not failed else f"FAIL: {len(failed)} test(s) failed")
    return 1 if failed else 0


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sysfs-root", default=None, help="sysfs tree to read (default UCCL_MOE_SYSFS_ROOT, /sys)")
    p.add_argument("--local-ranks", type=int, default=None, help="ranks per node to plan for (default: GPUs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--pair", action="store_true", help="transport self-test across the ranks (torchrun / srun)")
    p.add_argument("--transport", choices=["auto", "ibverbs", "efa", "loopback"], default=None,
                   help="--pair: transport (default UCCL_MOE_TRANSPORT)")
    p.add_argument("--bytes", type=int, default=1 << 20, help="--pair: bandwidth message size")
    p.add_argument("--iters", type=int, default=32, help="--pair: bandwidth messages")
    p.add_argument("--timeout", type=float, default=30.0, help="--pair: seconds before a test fails")


@subcommand("doctor", "check this host's GPUs, NICs and settings for internode runs; --pair: transport self-test",
            _args)
def doctor(args: argparse.Namespace) -> int:
    if args.pair:
        return pair_main(args)
    root = args.sysfs_root or str(_env.get("SYSFS_ROOT"))
    if not Path(root).is_dir():
        print(f"uccl-moe doctor: --sysfs-root {root} is not a directory", file=sys.stderr)
        return 2
    rep = collect(root, args.local_ranks)
    print(json.dumps(rep, indent=1, default=str) if args.json else format_report(rep))
    return 1 if any(p["severity"] == "error" for p in rep["problems"]) else 0
