"""`uccl-moe doctor` and the NIC choice per GPU through the binding, against the reconstructed sysfs trees
(tests/fixtures/sysfs), and `doctor --pair` between 2 local processes over the loopback transport."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.mp import free_port

from uccl_moe import _C, UcclMoeError
from uccl_moe import doctor as doc
from uccl_moe.cli import main
from uccl_moe.errors import InvalidUsageError

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "sysfs"
P5EN, MI300X, H100 = str(FIX / "p5en"), str(FIX / "mi300x_bnxt_re"), str(FIX / "h100_mlx5")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("UCCL_MOE_") or k in ("LOCAL_WORLD_SIZE",):
            monkeypatch.delenv(k)


def _copy(tree: str, tmp_path: Path) -> Path:
    dst = tmp_path / Path(tree).name
    shutil.copytree(tree, dst, symlinks=True)
    return dst


def _whats(rep: dict[str, Any]) -> str:
    return "\n".join(f"{p['severity']}: {p['what']} -> {p['fix']}" for p in rep["problems"])


# ---- the binding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree, family, want",
    [
        (P5EN, "efa", lambda g, b: [f"rdmap{b + 1}s0", f"rdmap{b + 2}s0"]),
        (MI300X, "ibverbs", lambda g, b: [f"bnxt_re{g}"]),
        (H100, "ibverbs", lambda g, b: [["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10",
                                          "mlx5_11"][g]]),
    ],
)
def test_binding_gives_every_gpu_its_nearest_nics(tree: str, family: str, want: Any) -> None:
    gpus = _C.nic_sysfs(tree)["gpus"]
    assert len(gpus) == 8
    seen: set[str] = set()
    for g, gpu in enumerate(sorted(gpus, key=lambda x: x["pci_addr"])):
        bus = int(gpu["pci_addr"][5:7], 16)
        ch = _C.nic_choose(tree, family, gpu["pci_addr"], g)
        assert ch["devices"] == want(g, bus), ch["reason"]
        assert ch["numa_node"] == gpu["numa_node"] == g // 4
        assert ch["numa_cpus"] == _C.numa_cpulist(tree, g // 4) != ""
        assert not seen & set(ch["devices"])
        seen |= set(ch["devices"])


def test_binding_errors_are_invalid_usage() -> None:
    with pytest.raises(InvalidUsageError, match="local rank 5 has none"):
        _C.nic_choose(MI300X, "ibverbs", "", 5, "bnxt_re0,bnxt_re1")
    with pytest.raises(InvalidUsageError, match="an EFA device"):
        _C.nic_choose(P5EN, "ibverbs", "", 0, "rdmap20s0")
    with pytest.raises(InvalidUsageError, match="not a PCI bus id"):
        _C.normalize_pci_bus_id("nope")
    with pytest.raises(InvalidUsageError, match="must be efa, ibverbs or any"):
        _C.nic_choose(P5EN, "roce")
    assert _C.proxy_cpus_for_rank("0-1;2-3", 1) == ("list", [2, 3])
    assert _C.hca_for_rank("0:mlx5_0,1:mlx5_3+mlx5_4", 1) == ["mlx5_3", "mlx5_4"]


def test_proxy_pins_per_local_rank() -> None:
    import torch.distributed as dist

    from uccl_moe.proxy import Proxy

    for cpus, local_rank, want in (("0:1;1:0", 1, [0]), ("none", 0, []), ("0", 3, [0])):
        p = Proxy(0, 1, dist.HashStore(), transport="loopback", cpus=cpus, local_rank=local_rank,
                  job=f"pin{os.getpid()}{local_rank}")
        with p:
            nic = p.nic()
            assert nic["pinned_cpus"] == want and nic["local_rank"] == local_rank
            assert nic["devices"] == []  # loopback has no NIC
    os.environ["UCCL_MOE_PROXY_CPUS"] = "0-1;2-3"
    try:
        with pytest.raises(InvalidUsageError, match="local rank 2 has none"):
            Proxy(0, 1, dist.HashStore(), transport="loopback", local_rank=2, job="pinbad")
    finally:
        del os.environ["UCCL_MOE_PROXY_CPUS"]


# ---- the report -------------------------------------------------------------------------------------------------


def test_report_p5en() -> None:
    rep = doc.collect(P5EN)
    assert rep["transport"] == "efa" and len(rep["rdma_devices"]) == 16
    r4 = rep["local_ranks"][4]
    assert r4["nic"] == ["rdmap148s0", "rdmap149s0"] and r4["gid_type"] == "EFA"
    assert r4["cpus"] == "NUMA 1: 48-95,144-191"
    assert rep["memory_registration"]["peer_memory_modules"] == ["efa_nv_peermem"]
    assert rep["problems"] == [], _whats(rep)


def test_report_p5en_both_efa_devices_per_gpu_or_a_warning(tmp_path: Path) -> None:
    rep = doc.collect(P5EN)
    r0 = rep["local_ranks"][0]
    assert r0["nic"] == ["rdmap20s0", "rdmap21s0"] and "t % 2" in r0["reason"]
    tree = _copy(P5EN, tmp_path)
    (tree / "class/infiniband/rdmap21s0/ports/1/state").write_text("1: DOWN\n")
    rep = doc.collect(str(tree))
    assert rep["local_ranks"][0]["nic"] == ["rdmap20s0"]
    text = _whats(rep)
    assert "local rank 0 gets one EFA device (rdmap20s0)" in text
    assert [p for p in rep["problems"] if "one EFA device" in p["what"]][0]["severity"] == "warn"
    assert all(len(r["nic"]) == 2 for r in rep["local_ranks"][1:])


def test_report_mi300x_flags_thor2_flow_control_and_tc(monkeypatch: pytest.MonkeyPatch) -> None:
    rep = doc.collect(MI300X)
    assert [r["nic"] for r in rep["local_ranks"]] == [[f"bnxt_re{g}"] for g in range(8)]
    assert {(r["gid_index"], r["gid_type"], r["mtu"]) for r in rep["local_ranks"]} == {(3, "RoCE v2 IPv4",
                                                                                       "netdev 9000")}
    # Defaults: the Thor-2 flow-control defaults and RoCE's lossless class apply, so nothing to flag.
    assert rep["problems"] == [], _whats(rep)
    assert rep["flow_control"]["max_inflight_writes_per_fifo"] == 1
    assert rep["flow_control"]["max_inflight_bytes_per_thread"] * rep["flow_control"]["proxy_threads"] <= 1572864
    assert {(r["tc"], r["sl"]) for r in rep["local_ranks"]} == {(104, 3)}
    # Knobs that override them badly are flagged with the fix.
    monkeypatch.setenv("UCCL_MOE_MAX_INFLIGHT_WRITES", "32")
    monkeypatch.setenv("UCCL_MOE_IB_TC", "0")
    rep = doc.collect(MI300X)
    text = _whats(rep)
    assert "unset UCCL_MOE_MAX_INFLIGHT_BYTES and UCCL_MOE_MAX_INFLIGHT_WRITES" in text
    assert "UCCL_MOE_IB_TC=0" in text
    assert rep["local_ranks"][0]["tc"] == 0
    assert rep["settings"]["UCCL_MOE_IB_TC"] == {"value": "0", "source": "env"}
    monkeypatch.setenv("UCCL_MOE_IB_TC", "x")
    assert "UCCL_MOE_IB_TC='x'" in _whats(doc.collect(MI300X))


def test_report_h100_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    rep = doc.collect(H100)
    assert rep["local_ranks"][7]["nic"] == ["mlx5_11"]
    assert rep["local_ranks"][0]["gid_type"] == "-"  # InfiniBand: GID 0, no RoCE type
    assert rep["problems"] == [], _whats(rep)
    monkeypatch.setenv("UCCL_MOE_IB_HCA", "0:mlx5_9")
    monkeypatch.setenv("UCCL_MOE_PROXY_CPUS", "0:0-3;1:none")
    rep = doc.collect(H100, local_ranks=3)
    assert [r["nic"] for r in rep["local_ranks"]] == [["mlx5_9"], ["mlx5_3"], ["mlx5_4"]]
    assert [r["cpus"] for r in rep["local_ranks"]] == ["0-3", "none", "NUMA 0: 0-55,112-167"]
    assert rep["problems"] == [], _whats(rep)
    monkeypatch.setenv("UCCL_MOE_PROXY_CPUS", "0-3;none")
    assert "local rank 2 has none" in _whats(doc.collect(H100, local_ranks=3))


def test_report_gid_and_memory_problems(tmp_path: Path) -> None:
    tree = _copy(MI300X, tmp_path)
    for dev in range(8):  # only link-local GIDs left: never used silently
        for i in (2, 3):
            (tree / f"class/infiniband/bnxt_re{dev}/ports/1/gids/{i}").unlink()
    shutil.rmtree(tree / "module" / "amdgpu")
    rep = doc.collect(str(tree))
    text = _whats(rep)
    assert "no routable RoCE v2 GID" in text and "UCCL_MOE_IB_GID_INDEX" in text
    assert "amdgpu is not loaded" in text
    assert rep["local_ranks"][0]["gid_index"] == -1
    h = _copy(H100, tmp_path)
    shutil.rmtree(h / "module" / "nvidia_peermem")
    (h / "class/infiniband/mlx5_4/ports/1/state").write_text("1: DOWN\n")
    rep = doc.collect(str(h))
    text = _whats(rep)
    assert "modprobe nvidia_peermem" in text
    assert rep["local_ranks"][2]["nic"] == ["mlx5_5"]  # the down port's GPU takes its switch neighbour's NIC


def test_pick_gid_ula_only() -> None:
    ula = [{"index": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "type": "RoCE v2"},
           {"index": 1, "gid": "fd00:0000:0000:0000:0000:0000:0000:0002", "type": "IB/RoCE v1"},
           {"index": 2, "gid": "fd00:0000:0000:0000:0000:0000:0000:0002", "type": "RoCE v2"}]
    assert doc._pick_gid(ula, "Ethernet", "auto") == (2, "RoCE v2 IPv6", "")
    assert doc._pick_gid(ula, "Ethernet", "1")[:2] == (1, "IB/RoCE v1")
    assert "not in the GID table" in doc._pick_gid(ula, "Ethernet", "7")[2]


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["doctor", "--sysfs-root", P5EN]) == 0
    out = capsys.readouterr().out
    assert "rdmap20s0+rdmap21s0" in out and "Problems: none" in out
    assert main(["doctor", "--sysfs-root", MI300X, "--json"]) == 0  # warnings only
    rep = json.loads(capsys.readouterr().out)
    assert rep["local_ranks"][5]["nic"] == ["bnxt_re5"]
    (tmp_path / "class").mkdir()
    assert main(["doctor", "--sysfs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no RDMA devices" in out and "loopback" in out
    assert main(["doctor", "--sysfs-root", str(tmp_path / "missing")]) == 2
    os.environ["UCCL_MOE_IB_HCA"] = "bnxt_re0,bnxt_re1"
    try:
        assert main(["doctor", "--sysfs-root", MI300X]) == 1  # an error: exit 1
    finally:
        del os.environ["UCCL_MOE_IB_HCA"]
    assert "local rank 2 has none" in capsys.readouterr().out


# ---- --pair -----------------------------------------------------------------------------------------------------


def _pair_rank(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    import torch.distributed as dist

    from uccl_moe.proxy import StoreBootstrap

    store = StoreBootstrap(dist.distributed_c10d._get_default_store(), prefix="doctor_test/")
    return doc.run_pair(rank, world, store, local_rank=rank, ranks_per_node=world, transport="loopback",
                        job=f"doctest{os.getppid()}", bw_bytes=1 << 16, bw_iters=8, lat_iters=20,
                        timeout_s=timeout_s, barrier=dist.barrier)


def test_pair_loopback_two_processes() -> None:
    from helpers.mp import run_ranks

    results = run_ranks(_pair_rank, 2, 30.0)
    for r in results:
        assert [t["name"] for t in r["tests"]] == ["connect", "write", "write_with_imm", "software_atomic", "barrier",
                                                 "latency", "bandwidth", "stop"]
        assert all(t["ok"] for t in r["tests"]), r["tests"]
        assert r["nic"]["devices"] == []


def test_pair_names_the_failure_and_fix() -> None:
    from helpers.mp import run_ranks

    # Every work request lost: the first write times out, and the report says what to check.
    results = run_ranks(_pair_rank, 2, 3.0, env={"UCCL_MOE_LOOPBACK_DROP_EVERY": "1"})
    for r in results:
        bad = {t["name"]: t for t in r["tests"] if not t["ok"]}
        assert "write" in bad, r["tests"]
        assert "CommTimeoutError" in bad["write"]["detail"]
        assert "UCCL_MOE_IB_GID_INDEX" in bad["write"]["fix"]
        later = [t for t in r["tests"] if t["name"] in ("write_with_imm", "software_atomic", "barrier")]
        assert all(t["detail"].startswith("not run") for t in later), later  # reported at once, no more timeouts


def test_pair_cli_under_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_MOE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "uccl_moe.cli", "doctor", "--pair", "--bytes", "65536", "--iters", "4", "--timeout", "30"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "over loopback (no RDMA devices here" in p.stdout
    assert "8/8 ok" in p.stdout and "PASS" in p.stdout
    single = subprocess.run([sys.executable, "-m", "uccl_moe.cli", "doctor", "--pair"], env=env, capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert single.returncode == 2 and "needs 2+ ranks" in single.stderr
    assert "torchrun --nproc-per-node 2 -m uccl_moe.cli doctor --pair" in single.stderr


def test_gid_choice_is_the_transports_rule() -> None:
    """doctor ranks GIDs with the transport's own rule (nic_select.hpp roce_gid_preference): IPv4-mapped, then ULA,
    then another global IPv6, lowest index on ties; a bad UCCL_MOE_IB_GID_INDEX is a problem line, not a traceback."""
    C = doc._native()
    assert [C.gid_preference(t) for t in ("::ffff:10.0.0.1", "fd00::1", "2001:db8::1", "fe80::1", "::")] == \
        [0, 1, 2, -1, -1]
    with pytest.raises(UcclMoeError, match="not a GID"):
        C.gid_preference("mlx5_0")
    gids = [{"index": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "type": "RoCE v2"},
            {"index": 1, "gid": "2001:0db8:0000:0000:0000:0000:0000:0001", "type": "RoCE v2"},
            {"index": 2, "gid": "fd00:0000:0000:0000:0000:0000:0000:0001", "type": "RoCE v1"},
            {"index": 3, "gid": "fd00:0000:0000:0000:0000:0000:0000:0002", "type": "RoCE v2"}]
    assert doc._pick_gid(gids, "Ethernet", "auto") == (3, "RoCE v2 IPv6", "")  # ULA before the earlier global one
    idx, _, err = doc._pick_gid(gids, "Ethernet", "abc")
    assert idx == -1 and "UCCL_MOE_IB_GID_INDEX" in err


class _Build:
    """A native module's build answers (gpu_backend, has_intranode_kernels), as _C gives them."""

    __file__ = "/site/uccl_moe/_C.so"

    def __init__(self, backend: str, intranode: bool) -> None:
        self.backend, self.intranode = backend, intranode

    def gpu_backend(self) -> str:
        return self.backend

    def has_intranode_kernels(self) -> bool:
        return self.intranode


@pytest.mark.parametrize("backend, intranode, gpus, error, text", [
    ("none", False, 8, True, "no GPU kernels (CPU only)"),
    ("none", False, 0, False, "no GPU kernels (CPU only)"),
    ("cuda", True, 8, False, "native module: CUDA kernels; /site/uccl_moe/_C.so"),
    ("hip", False, 8, False, "HIP kernels (without the intranode kernels)"),
])
def test_report_says_what_the_native_module_was_built_with(backend: str, intranode: bool, gpus: int, error: bool,
                                                          text: str) -> None:
    rep: dict[str, Any] = {"host": "h", "sysfs_root": "/sys", "problems": [],
                           "gpus": [{"index": i, "name": "g", "pci_bus_id": "-"} for i in range(gpus)]}
    doc._native_build(rep, _Build(backend, intranode), rep["problems"])
    assert rep["native"] == {"module": "/site/uccl_moe/_C.so", "gpu_backend": backend, "intranode_kernels": intranode}
    assert (any("built without GPU kernels" in p["what"] and "nvcc" in p["fix"] for p in rep["problems"])
            == error), _whats(rep)
    assert text in doc.format_report(rep)


def test_report_of_this_build_names_its_kernels() -> None:
    rep = doc.collect(H100)
    assert rep["native"]["gpu_backend"] == _C.gpu_backend()
    assert "native module: " in doc.format_report(rep)
