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
per-platform first-run checklist. Host facts are read by :mod:`uccl_moe.doctor_host`; ``--pair`` is
:mod:`uccl_moe.doctor_pair`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env as _env
from .cli import subcommand
from .doctor_host import (
    PEER_MODULES,
    _compact,
    _dmabuf_kernel,
    _knob,
    _loaded_modules,
    _native,
    _pick_gid,
    _problem,
    _qos,
    _thor2_bytes_per_gpu,
    _torch_gpus,
)
from .doctor_pair import pair_main, run_pair
from .errors import UcclMoeError

__all__ = ["collect", "doctor", "format_report", "pair_main", "run_pair"]


@dataclass
class _Scan:
    """What the device scan found; the report's later sections read it and add to ``problems``."""

    C: Any
    sysfs_root: str
    live: bool
    port: int
    has_verbs: bool
    devices: list[dict[str, Any]]
    verbs_names: list[str]
    family: str
    problems: list[dict[str, str]]

    @property
    def by_name(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in self.devices}


def collect(sysfs_root: str = "/sys", local_ranks: int | None = None) -> dict[str, Any]:
    """Everything ``uccl-moe doctor`` prints, as a dict (``--json``); ``problems`` lists what will not work.

    Sections in report order: transport and devices, per local rank (NIC, GID, TC/SL, MTU, CPUs), GPU memory
    registration, flow control and QoS.
    """
    problems: list[dict[str, str]] = []
    C = _native()
    rep: dict[str, Any] = {"host": socket.gethostname(), "sysfs_root": sysfs_root, "problems": problems}
    if C is None:
        problems.append(_problem("error", "the native module uccl_moe._C is not built",
                                 "pip install . (or tools/build_inplace.sh) with a C++ compiler"))
        return rep
    scan = _scan_devices(rep, C, sysfs_root, problems)
    _native_build(rep, C, problems)
    last_tc = _local_ranks(rep, scan, local_ranks)
    _memory_registration(rep, scan)
    _flow_control(rep, scan, last_tc)
    return rep


def _native_build(rep: dict[str, Any], C: Any, problems: list[dict[str, str]]) -> None:
    """What the native module was built with: its GPU kernels ('cuda', 'hip' or 'none') and where it lives; an
    error where this host has GPUs but the build has no kernels for them (a Buffer's native backend would refuse)."""
    backend = str(C.gpu_backend())
    rep["native"] = {"module": str(getattr(C, "__file__", "?")), "gpu_backend": backend,
                     "intranode_kernels": bool(C.has_intranode_kernels())}
    gpus = rep.get("gpus", [])
    if gpus and backend == "none":
        problems.append(_problem(
            "error", f"this host has {len(gpus)} GPU(s) but the native module was built without GPU kernels (no nvcc "
                     f"or hipcc at install time): only the reference backend runs",
            "reinstall where nvcc (CUDA) or hipcc (ROCm) is on PATH: pip install -e . (UCCL_MOE_WITH_CUDA=ON or "
            "UCCL_MOE_WITH_HIP=ON makes a missing compiler an install error)"))


def _scan_devices(rep: dict[str, Any], C: Any, sysfs_root: str, problems: list[dict[str, str]]) -> _Scan:
    """The transports built, RDMA devices (sysfs and libibverbs), GPUs, and which transport the ranks would use."""
    live = sysfs_root == "/sys"
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
    return _Scan(C, sysfs_root, live, port, has_verbs, devices, verbs_names, family, problems)


def _local_ranks(rep: dict[str, Any], scan: _Scan, local_ranks: int | None) -> int | None:
    """Per local rank: NIC, GID, TC/SL, MTU, CPUs, and the NICs' capabilities. Returns the traffic class of the last
    rank that got a NIC (None when none did)."""
    problems = scan.problems
    n = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or len(rep["gpus"]) or 1
    knobs = {"hca": str(_knob("IB_HCA", problems)), "cpus": str(_knob("PROXY_CPUS", problems)),
             "gid": str(_knob("IB_GID_INDEX", problems)), "tc": str(_knob("IB_TC", problems)),
             "sl": str(_knob("IB_SL", problems))}
    ranks: list[dict[str, Any]] = []
    caps: dict[str, Any] = {}
    allowed = sorted(os.sched_getaffinity(0)) if scan.live and hasattr(os, "sched_getaffinity") else []
    last_tc = None
    for lr in range(n):
        gpu = rep["gpus"][lr]["pci_bus_id"] if lr < len(rep["gpus"]) else ""
        row: dict[str, Any] = {"local_rank": lr, "gpu": gpu}
        ranks.append(row)
        if scan.family == "loopback":
            row.update(nic=[], reason="no NIC (loopback)", cpus="-")
            continue
        tc = _rank_nic(row, scan, knobs, caps, allowed, len(rep["gpus"]))
        last_tc = tc if tc is not None else last_tc
    rep["local_ranks"] = ranks
    rep["capabilities"] = caps
    for name, c in caps.items():
        if c.get("error"):
            problems.append(_problem("error", f"{name}: {c['error']}",
                                     "check /dev/infiniband permissions and ulimit -l (memlock unlimited)"))
        if c.get("efa_queried") and not c.get("efa_rdma_write"):
            problems.append(_problem("error", f"{name}: this EFA device has no RDMA write",
                                     "use an instance with EFA RDMA write (p5/p5e/p5en, EFAv2+) or UCCL_MOE_TRANSPORT"))
    return last_tc


def _rank_nic(row: dict[str, Any], scan: _Scan, knobs: dict[str, str], caps: dict[str, Any],
              allowed: list[int], num_gpus: int) -> int | None:
    """Fills `row` (one local rank) with its NIC, GID, TC/SL, MTU and CPUs; adds the NICs it uses to `caps`.
    Returns its traffic class, or None when it got no NIC."""
    C, problems, lr = scan.C, scan.problems, row["local_rank"]
    try:
        ch = C.nic_choose(scan.sysfs_root, scan.family, row["gpu"], lr, knobs["hca"], scan.verbs_names, scan.port)
    except UcclMoeError as e:
        row.update(nic=[], reason=str(e), cpus="-")
        problems.append(_problem("error", f"local rank {lr}: {e}", "fix UCCL_MOE_IB_HCA (docs/internode.md)"))
        return None
    row.update(nic=ch["devices"], reason=ch["reason"], numa_node=ch["numa_node"], pcie_hops=ch["pcie_distance"])
    efa = [d for d in scan.devices if d["efa"]]
    if scan.family == "efa" and len(ch["devices"]) > 1:
        row["reason"] += f"; proxy thread t uses {' / '.join(ch['devices'])}[t % {len(ch['devices'])}]"
    elif scan.family == "efa" and ch["devices"] and num_gpus and len(efa) >= 2 * num_gpus:
        problems.append(_problem("warn", f"local rank {lr} gets one EFA device ({ch['devices'][0]}) on a host "
                                 f"with {len(efa)} for {num_gpus} GPUs: half the GPU's EFA bandwidth",
                                 "bring the GPU's other EFA device up (see the DOWN devices above)"))
    if not ch["devices"]:
        problems.append(_problem("error", f"local rank {lr}: {ch['reason']}",
                                 "check the NIC ports (ibv_devinfo) or set UCCL_MOE_TRANSPORT"))
        return None
    dev = scan.by_name.get(ch["devices"][0], {})
    if dev and dev.get("port_state") not in ("ACTIVE", None):
        problems.append(_problem("error", f"{dev['name']} port is {dev['port_state']}",
                                 "bring the link up (cable, switch port; InfiniBand: a subnet manager)"))
    gid_idx, gid_type, gid_err = _pick_gid(dev.get("gids", []), dev.get("link_layer", ""), knobs["gid"])
    if scan.family == "efa":
        gid_idx, gid_type, gid_err = 0, "EFA", ""
    roce = dev.get("link_layer", "").lower() == "ethernet"
    if scan.family == "efa":
        tc, sl = 0, int(_knob("EFA_SL", problems))
    else:
        tc = _qos("IB_TC", knobs["tc"], 104 if roce else 0, 255, problems)
        sl = _qos("IB_SL", knobs["sl"], 3 if roce else 0, 15, problems)
    row.update(gid_index=gid_idx, gid_type=gid_type, tc=tc, sl=sl)
    if gid_err:
        problems.append(_problem("error", f"local rank {lr} ({dev.get('name')}): {gid_err}",
                                 "configure an IPv4 (or ULA IPv6) address on the NIC's netdev, or set "
                                 "UCCL_MOE_IB_GID_INDEX to a RoCE v2 GID (show_gids)"))
    mtu = next((g["ndev_mtu"] for g in dev.get("gids", []) if g["index"] == gid_idx), -1)
    row["mtu"] = f"netdev {mtu}" if mtu > 0 else "-"
    if scan.live and scan.has_verbs:
        for name in ch["devices"]:
            if name not in caps:
                caps[name] = dict(C.rdma_device_caps(name, scan.port))
        c0 = caps[ch["devices"][0]]
        if c0.get("active_mtu"):
            row["mtu"] = str(c0["active_mtu"])
    _rank_cpus(row, scan, ch, knobs["cpus"], allowed)
    return tc


def _rank_cpus(row: dict[str, Any], scan: _Scan, ch: dict[str, Any], cpus_knob: str, allowed: list[int]) -> None:
    """The CPUs the rank's proxy threads are pinned to (its NIC's NUMA node unless UCCL_MOE_PROXY_CPUS says)."""
    C, problems, lr = scan.C, scan.problems, row["local_rank"]
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


def _memory_registration(rep: dict[str, Any], scan: _Scan) -> None:
    """Whether the NIC can register GPU memory: peer-memory modules, dma-buf, amdgpu."""
    problems, devices = scan.problems, scan.devices
    mods = _loaded_modules(scan.sysfs_root)
    dmabuf, dmabuf_detail = _dmabuf_kernel(scan.sysfs_root)
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


def _flow_control(rep: dict[str, Any], scan: _Scan, tc: int | None) -> None:
    """Flow control and QoS in force: the settings, Thor-2's in-flight limits, RoCE's traffic class (`tc`: the last
    rank's)."""
    C, problems = scan.C, scan.problems
    fc_names = [k for k in _env.KNOBS if "INFLIGHT" in k or k.startswith("IB_") or k in ("PROXY_THREADS", "TIMEOUT_S")]
    rep["settings"] = {_env.KNOBS[k].var: {"value": _knob(k, problems), "source": _env.source(k)} for k in fc_names}
    chosen = {d for r in rep["local_ranks"] for d in r.get("nic", [])}
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
    by_name = scan.by_name
    roce = any(by_name.get(d, {}).get("link_layer") == "Ethernet" for d in chosen)
    if roce and tc == 0:
        problems.append(_problem(
            "warn", "RoCE with UCCL_MOE_IB_TC=0: traffic goes in the best-effort class, which drops under congestion",
            "set UCCL_MOE_IB_TC to your fabric's lossless class (DSCP << 2, e.g. 104 for DSCP 26) and UCCL_MOE_IB_SL"))


def format_report(rep: dict[str, Any]) -> str:
    """The compact text form of :func:`collect`'s dict."""
    lines = [f"uccl-moe doctor on {rep['host']} (sysfs {rep['sysfs_root']})"]
    nat = rep.get("native")
    if nat:
        kernels = {"cuda": "CUDA kernels", "hip": "HIP kernels"}.get(nat["gpu_backend"], "no GPU kernels (CPU only)")
        if nat["gpu_backend"] != "none" and not nat["intranode_kernels"]:
            kernels += " (without the intranode kernels)"
        lines.append(f"  native module: {kernels}; {nat['module']}")
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
