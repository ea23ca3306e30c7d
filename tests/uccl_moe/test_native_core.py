"""The native host core through its bindings: build facts, env parsing parity, logging masks, diagnostics."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import uccl_moe
from uccl_moe import _C, InvalidUsageError, env


def _so_path() -> Path:
    return Path(_C.__file__)


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_module_does_not_link_torch_or_cudart_dynamically():
    needed = _needed(_so_path())
    assert needed, "readelf found no NEEDED entries; is this an ELF shared object?"
    bad = [n for n in needed if n.startswith(("libtorch", "libc10", "libcudart", "libamdhip64"))]
    assert not bad, f"uccl_moe._C must not depend on {bad} (one build must serve every torch version): {needed}"


def test_gpu_backend_matches_build():
    assert _C.gpu_backend() in ("cuda", "hip", "none")
    assert _C.device_count() >= 0
    if _C.device_count() == 0:
        assert _C.can_access_peer(0, 1) is False and _C.device_arch(0) == -1
        assert _C.device_sm_count(0) == 0  # unknown: the runtime then skips its num_sms check
    else:
        assert _C.device_sm_count(0) > 0 and _C.device_sm_count(_C.device_count()) == 0


@pytest.mark.parametrize(
    "knob,text,ok",
    [
        ("PROXY_THREADS", "4", True), ("PROXY_THREADS", " 8 ", True), ("PROXY_THREADS", "12abc", False),
        ("PROXY_THREADS", "0", False), ("PROXY_THREADS", "65", False), ("PROXY_THREADS", "0x10", True),
        ("PROXY_THREADS", "", False), ("TIMEOUT_S", "2.5", True), ("TIMEOUT_S", "1e3", True),
        ("TIMEOUT_S", "fast", False), ("TIMEOUT_S", "0", False), ("TIMEOUT_S", "inf", False),
        ("BACKEND", "reference", True), ("BACKEND", "Reference", False), ("TRANSPORT", "efa", True),
        ("TRANSPORT", "tcp", False),
    ],
)
def test_env_parsers_agree_between_python_and_cpp(knob, text, ok):
    k = env.KNOBS[knob]
    py_ok = cpp_ok = True
    py_val = cpp_val = None
    try:
        py_val = k.parse(text)
    except InvalidUsageError as e:
        py_ok = False
        assert f"UCCL_MOE_{knob}=" in str(e)
    try:
        if k.type == "INT":
            cpp_val = _C.env_parse_int(knob, text, k.min_or_choices, k.max)
        elif k.type == "FLOAT":
            cpp_val = _C.env_parse_float(knob, text, k.min_or_choices, k.max)
        else:
            cpp_val = _C.env_parse_choice(knob, text, k.min_or_choices)
    except InvalidUsageError as e:
        cpp_ok = False
        assert f"UCCL_MOE_{knob}=" in str(e) and ".cc:" in str(e)  # file:line from the native macro
    assert py_ok == cpp_ok == ok
    if ok:
        assert py_val == cpp_val


def test_knob_table_is_shared():
    names_cpp = [row[0] for row in _C.env_knobs()]
    assert names_cpp == list(env.KNOBS)
    assert {"TIMEOUT_S", "BACKEND", "PROXY_THREADS", "MAX_INFLIGHT_BYTES"} <= set(names_cpp)


def test_env_main_prints_every_knob(capsys, monkeypatch):
    monkeypatch.setenv("UCCL_MOE_PROXY_THREADS", "2")
    assert env.main([]) == 0
    out = capsys.readouterr().out
    for name in env.KNOBS:
        assert f"UCCL_MOE_{name}" in out
    rows = [line for line in out.splitlines() if line.startswith("UCCL_MOE_PROXY_THREADS")]
    assert rows and " 2 " in rows[0] and "env" in rows[0]


def test_env_main_reports_bad_values(capsys, monkeypatch):
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "soon")
    assert env.main([]) == 1
    assert 'UCCL_MOE_TIMEOUT_S="soon" is invalid' in capsys.readouterr().out


def test_unknown_knob_warns(monkeypatch):
    """One warning names each unknown UCCL_MOE_* variable with the knobs its name is close to, at the caller's line
    (not ours); a variable our launchers set (the Primus entry) is not unknown."""
    monkeypatch.setenv("UCCL_MOE_PROXY_THREAD", "4")  # typo
    monkeypatch.setenv("UCCL_MOE_QWERTY", "1")  # nothing like a knob
    monkeypatch.setenv("UCCL_MOE_PRIMUS_ENTRY", "/somewhere/primus_entry.py")  # launch.primus.ENTRY_VAR
    monkeypatch.setattr(env, "_warned_unknown", False)
    with pytest.warns(UserWarning) as seen:
        env.get("BACKEND")
    [w] = seen
    msg = str(w.message)
    assert "UCCL_MOE_PROXY_THREAD (did you mean UCCL_MOE_PROXY_THREADS" in msg
    assert "UCCL_MOE_QWERTY;" in msg and "PRIMUS_ENTRY" not in msg and "`uccl-moe env`" in msg
    assert w.filename == __file__  # the caller's line
    monkeypatch.setattr(env, "_warned_unknown", False)
    monkeypatch.delenv("UCCL_MOE_PROXY_THREAD")
    monkeypatch.delenv("UCCL_MOE_QWERTY")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.get("BACKEND")  # only the launcher's variable is left: no warning


def test_uccl_moe_env_lists_the_knobs(capsys, monkeypatch):
    """`uccl-moe env` is uccl_moe.env.main: every knob with its value and source; 1 where a value is refused."""
    from uccl_moe import cli

    monkeypatch.setenv("UCCL_MOE_PROXY_THREADS", "6")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "UCCL_MOE_TIMEOUT_S" in out and any(
        line.split()[:3] == ["UCCL_MOE_PROXY_THREADS", "6", "env"] for line in out.splitlines())
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "soon")
    assert cli.main(["env"]) == 1


def test_env_get_follows_the_environment_and_refuses_a_bad_value_every_time(monkeypatch):
    """env.get keeps each knob's parsed value for the text it came from (hot paths read knobs per call): a change of
    the variable is seen at the next call, and a bad value is never remembered as a good one."""
    monkeypatch.delenv("UCCL_MOE_TIMEOUT_S", raising=False)
    assert env.get("TIMEOUT_S") == 100.0
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "7.5")
    assert env.get("TIMEOUT_S") == 7.5
    assert env.get("TIMEOUT_S") == 7.5
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "soon")
    for _ in range(2):
        with pytest.raises(InvalidUsageError, match="UCCL_MOE_TIMEOUT_S"):
            env.get("TIMEOUT_S")
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "")  # empty = unset: the default
    assert env.get("TIMEOUT_S") == 100.0


def test_native_timeout_knob_is_validated(monkeypatch):
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "12abc")
    _C.env_reset_cache()
    try:
        with pytest.raises(InvalidUsageError, match="UCCL_MOE_TIMEOUT_S"):
            _C.env_timeout_s()
        monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "7.5")
        _C.env_reset_cache()
        assert _C.env_timeout_s() == 7.5
    finally:
        monkeypatch.delenv("UCCL_MOE_TIMEOUT_S")
        _C.env_reset_cache()


def test_log_subsys_masks():
    all_mask = _C.log_subsys_mask("ALL")
    assert all_mask == 0xFF
    assert _C.log_subsys_mask("PROXY,NET") == (1 << 3) | (1 << 4)
    assert _C.log_subsys_mask("^FIFO") == 0xFF & ~(1 << 2)


def test_log_level_gates(monkeypatch):
    monkeypatch.setenv("UCCL_MOE_LOG_LEVEL", "INFO")
    monkeypatch.setenv("UCCL_MOE_LOG_SUBSYS", "^FIFO")
    _C.env_reset_cache()
    try:
        assert _C.log_enabled(3, "PROXY") and not _C.log_enabled(4, "PROXY")
        assert not _C.log_enabled(3, "FIFO")
    finally:
        monkeypatch.delenv("UCCL_MOE_LOG_LEVEL")
        monkeypatch.delenv("UCCL_MOE_LOG_SUBSYS")
        _C.env_reset_cache()


def test_diag_message_names_rank_peer_channel_phase():
    d = _C.format_diag(rank=3, peer=1, channel=5, phase=5, role=2, expected=812, seen=640, command=0x2A, waited_s=100.0)
    msg = d["message"]
    for part in ("rank 3", "peer 1", "channel 5", "dispatch/recv-tokens", "receiver", "expected 812", "saw 640",
                 "0x2a", "UCCL_MOE_TIMEOUT_S", "an exception it raised, e.g. on its own arguments, skips it"):
        assert part in msg, (part, msg)
    assert d["phase"] == "dispatch/recv-tokens"
    # every phase a kernel reports has a name (the copy-engine ops' chunk waits are the newest)
    names = [_C.format_diag(rank=0, peer=0, channel=0, phase=p, role=1, expected=1, seen=0, command=0,
                            waited_s=1.0)["phase"] for p in range(30)]
    assert "unknown" not in names and len(set(names)) == 30
    assert names[15:] == ["dispatch/publish", "combine/pull-start", "combine/pull-done", "combine/pull-args",
                          "dispatch/direct-enter", "dispatch/direct-landed", "dispatch/direct-done",
                          "dispatch/direct-args", "combine/ce-chunk", "dispatch/ce-chunk", "dispatch/args",
                          "combine/ce-sentinel", "dispatch/ce-sentinel",
                          "dispatch/ce-enter", "dispatch/ce-done"]
    assert _C.format_diag(rank=0, peer=0, channel=0, phase=30, role=1, expected=1, seen=0, command=0,
                          waited_s=1.0)["phase"] == "unknown"
    args = _C.format_diag(rank=2, peer=1, channel=-1, phase=18, role=2, expected=8, seen=0, command=0,
                          waited_s=0.0)["message"]
    assert "peer 1 staged 0 top-k weights per row, this rank expected 8" in args and "timed out" not in args
    staged = 1 << 16  # kPullArgsStaged: the rank combines a tensor of its own, staged
    both = _C.format_diag(rank=2, peer=1, channel=-1, phase=18, role=2, expected=staged | 8, seen=staged, command=0,
                          waited_s=0.0)["message"]
    assert "peer 1 staged 0 top-k weights per row, this rank expected 8" in both
    kinds = _C.format_diag(rank=0, peer=1, channel=-1, phase=18, role=2, expected=8, seen=staged | 8, command=0,
                           waited_s=0.0)["message"]
    assert ("peer 1 passed a tensor of its own (staged) as x, this rank its get_combine_buffer view" in kinds
            and "same kind of x" in kinds), kinds
    ce = 1 << 17  # kPullArgsCe: the rank combines a tensor of its own through the copy engines
    paths = _C.format_diag(rank=1, peer=0, channel=-1, phase=18, role=2, expected=staged | 8, seen=ce | 8, command=0,
                           waited_s=0.0)["message"]
    assert ("peer 0 passed a tensor of its own (copy engines, UCCL_MOE_COMBINE_CE) as x, this rank a tensor of its "
            "own (staged)" in paths and "UCCL_MOE_COMBINE_CE" in paths), paths
    ce_topk = _C.format_diag(rank=1, peer=0, channel=-1, phase=18, role=2, expected=ce | 8, seen=ce, command=0,
                             waited_s=0.0)["message"]
    assert "peer 0 staged 0 top-k weights per row, this rank expected 8" in ce_topk
    chunks = _C.format_diag(rank=1, peer=0, channel=-1, phase=18, role=2, expected=ce | (3 << 20) | 8,
                            seen=ce | (1 << 20) | 8, command=0, waited_s=0.0)["message"]
    assert "peer 0 copies in 2 chunks, this rank expects 4" in chunks and "UCCL_MOE_COMBINE_CE_CHUNKS" in chunks
    hidden = lambda h: ((h // 8) & 1023) << 6 | ((h // 8) >> 10) << 24  # noqa: E731 - pull_args_hidden
    wide = _C.format_diag(rank=1, peer=0, channel=-1, phase=18, role=2, expected=ce | hidden(7168) | 8,
                          seen=ce | hidden(7168 + 8192) | 8, command=0, waited_s=0.0)["message"]
    assert "peer 0 passes rows of hidden 15360, this rank of hidden 7168" in wide and "same hidden size" in wide, wide
    narrow = _C.format_diag(rank=0, peer=1, channel=-1, phase=18, role=2, expected=staged | hidden(4096) | 8,
                            seen=staged | hidden(2048), command=0, waited_s=0.0)["message"]
    assert "peer 1 passes rows of hidden 2048, this rank of hidden 4096" in narrow, narrow
    same = _C.format_diag(rank=0, peer=1, channel=-1, phase=18, role=2, expected=ce | hidden(7168) | 8,
                          seen=ce | hidden(7168), command=0, waited_s=0.0)["message"]
    assert "peer 1 staged 0 top-k weights per row, this rank expected 8" in same, same
    both = _C.format_diag(rank=0, peer=1, channel=-1, phase=18, role=2, expected=staged | hidden(4096),
                          seen=ce | hidden(2048), command=0, waited_s=0.0)["message"]
    assert "same kind of x" in both and "hidden" not in both, both  # the path names the mismatch first
    cross = _C.format_diag(rank=1, peer=0, channel=-1, phase=18, role=2, expected=ce | hidden(7168),
                           seen=(1 << 30) | (58 << 16) | 464, command=0, waited_s=0.0)["message"]
    assert "peer 0 runs a copy-engine dispatch where this rank runs a combine" in cross, cross
    direct = _C.format_diag(rank=2, peer=0, channel=-1, phase=22, role=2, expected=96, seen=64, command=0,
                            waited_s=0.0)["message"]
    assert "peer 0 lays out its landing area as 64, this rank as 96" in direct and "timed out" not in direct
    assert "UCCL_MOE_DISPATCH_CE" in direct and "column-major" in direct
    mark, poll = 1 << 30, 1 << 29  # kCeDispatchArgsMark, kCeDispatchArgsPoll: a copy-engine dispatch, polled
    ce_disp = mark | (56 << 16) | 448
    polls = _C.format_diag(rank=1, peer=0, channel=-1, phase=22, role=2, expected=ce_disp, seen=ce_disp | poll,
                           command=0, waited_s=0.0)["message"]
    assert ("copy-engine dispatch: peer 0 polls its landing area, this rank does not" in polls
            and "UCCL_MOE_DISPATCH_CE_POLL" in polls and "CUDA_DEVICE_MAX_CONNECTIONS" in polls), polls
    flags = _C.format_diag(rank=0, peer=1, channel=-1, phase=22, role=2, expected=ce_disp | poll, seen=ce_disp,
                           command=0, waited_s=0.0)["message"]
    assert "peer 1 does not poll its landing area, this rank does" in flags, flags
    other = _C.format_diag(rank=0, peer=1, channel=-1, phase=22, role=2, expected=ce_disp | poll,
                           seen=(ce_disp + 1) | poll, command=0, waited_s=0.0)["message"]
    assert "lays out its landing area" in other, other  # same polling, other rows: the layout message
    pc = _C.format_diag(rank=0, peer=1, channel=-1, phase=18, role=2, expected=ce | (1 << 18) | 8, seen=ce | 8,
                        command=0, waited_s=0.0)["message"]
    assert "copy-engine combine: peer 1 does not poll its landing area, this rank does" in pc, pc
    assert "same UCCL_MOE_CE_POLL " in pc, pc


def test_error_tree():
    assert issubclass(uccl_moe.InvalidUsageError, ValueError)
    assert issubclass(uccl_moe.InvalidTypeError, TypeError)
    assert issubclass(uccl_moe.CommTimeoutError, TimeoutError)
    err = uccl_moe.CommTimeoutError("x", {"rank": 1})
    assert err.record == {"rank": 1}


@pytest.mark.gpu
def test_device_timeout_writes_diagnostic_record():
    rec = _C.selftest_device_timeout(0.2, rank=5)
    assert rec["valid"] == 1 and rec["rank"] == 5 and rec["phase"] == "barrier"
    assert rec["expected"] == 1 and rec["seen"] == 0 and 0.2 <= rec["waited_s"] < 5
    assert "rank 5 timed out" in rec["message"] and not rec["drained"]


@pytest.mark.gpu
def test_a_wait_drained_by_a_peers_abort_still_writes_the_record():
    """A peer that gave up raises this rank's abort flag; this rank's waits then give up at once. The record must
    still be written (the host reads the record, not the flag): otherwise the op returns as if it had run."""
    rec = _C.selftest_device_timeout(30.0, rank=2, peer_aborted=True)
    assert rec["valid"] == 1 and rec["rank"] == 2 and rec["phase"] == "barrier" and rec["drained"]
    assert rec["waited_s"] < 5 and "rank 2 gave up" in rec["message"] and "aborted first" in rec["message"]


def test_a_drained_record_says_the_launch_was_aborted_first():
    own = _C.format_diag(rank=0, peer=2, channel=-1, phase=16, role=2, expected=2, seen=1, command=0, waited_s=3.0)
    assert "rank 0 timed out after 3.0 s" in own["message"] and not own["drained"]
    drained = _C.format_diag(rank=0, peer=2, channel=-1, phase=16, role=2, expected=2, seen=1, command=0,
                             waited_s=0.4, drained=True)
    msg = drained["message"]
    assert drained["drained"] and drained["error"] == "Timeout"
    assert "rank 0 gave up after 0.4 s in combine/pull-start" in msg and "waiting for peer 2" in msg, msg
    assert "aborted first" in msg and "timed out after" not in msg, msg
    # written at a launch's end (record_if_aborted: no wait of its own failed, the abort skipped its work)
    ended = _C.format_diag(rank=1, peer=-1, channel=-1, phase=16, role=6, expected=0, seen=0, command=0,
                           waited_s=0.0, drained=True)["message"]  # role 6: DiagRole::kLaunchEnd
    assert "rank 1 found its launch in combine/pull-start aborted by a peer" in ended, ended
    assert "no wait of this rank failed" in ended and "gave up after" not in ended, ended


def test_package_import_does_not_need_torch():
    code = "import sys, uccl_moe, uccl_moe.cli; assert 'torch' not in sys.modules, sorted(sys.modules)"
    root = str(Path(uccl_moe.__file__).parent.parent)
    subprocess.run([__import__("sys").executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize(
    "gpu_copy,preset,expect",
    [
        ("1", None, "EAGER"),     # GPU copies: eager loading is asked for
        ("0", None, None),        # host-staged: nothing to change
        (None, None, None),       # the default is host-staged
        ("1", "LAZY", "LAZY"),    # the user's choice stands (the runtime then refuses with the reason)
    ],
)
def test_prepare_cuda_module_loading(monkeypatch, gpu_copy, preset, expect):
    # CUDA not started in this process yet (on a GPU machine an earlier test of the session may have started it)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    if gpu_copy is None:
        monkeypatch.delenv("UCCL_MOE_LOOPBACK_GPU_COPY", raising=False)
    else:
        monkeypatch.setenv("UCCL_MOE_LOOPBACK_GPU_COPY", gpu_copy)
    if preset is None:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    else:
        monkeypatch.setenv("CUDA_MODULE_LOADING", preset)
    changed = env.prepare_cuda_module_loading()
    assert os.environ.get("CUDA_MODULE_LOADING") == expect
    assert changed == (preset is None and expect is not None)


def test_prepare_cuda_module_loading_leaves_a_started_cuda_alone(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setenv("UCCL_MOE_LOOPBACK_GPU_COPY", "1")
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    assert env.prepare_cuda_module_loading() is False
    assert "CUDA_MODULE_LOADING" not in os.environ


def test_diag_error_code_separates_usage_from_timeouts():
    """The phases that are a wrong argument seen on the device carry the InvalidUsage code (the Buffer raises
    InvalidUsageError from it); every wait carries Timeout."""
    codes = {p: _C.format_diag(rank=0, peer=1, channel=0, phase=p, role=1, expected=2, seen=1, command=0,
                               waited_s=1.0)["error"] for p in range(26)}
    usage = {14, 18, 22, 25}  # rdma/capacity, combine/pull-args, dispatch/direct-args, dispatch/args
    assert {p for p, c in codes.items() if c == "InvalidUsage"} == usage
    assert all(c == "Timeout" for p, c in codes.items() if p not in usage)


def test_dispatch_args_record_names_both_layouts():
    """notify's record of a peer whose dispatch rows differ (dispatch/args) names both layouts, from the code the
    native module computes for the rows (dispatch_rows_code)."""
    mine, theirs = _C.dispatch_rows_code(7168, 8, 56), _C.dispatch_rows_code(14336, 4, 0)
    assert mine != theirs and 0 not in (mine, theirs)
    msg = _C.format_diag(rank=1, peer=0, channel=-1, phase=25, role=4, expected=mine, seen=theirs, command=0,
                         waited_s=0.0)
    assert msg["error"] == "InvalidUsage" and msg["phase"] == "dispatch/args"
    for part in ("rank 1: dispatch: peer 0 passes rows of 14336 bytes with 4 top-k entries and 0 scales",
                 "this rank rows of 7168 bytes with 8 top-k entries and 56 scales", "same hidden size and element size",
                 "no row moved"):
        assert part in msg["message"], (part, msg["message"])
    worst = _C.format_diag(rank=1, peer=0, channel=-1, phase=25, role=4, expected=mine, seen=theirs, command=1,
                           waited_s=0.0)["message"]
    assert "with num_worst_tokens nothing waits" in worst and "no row moved" not in worst, worst
    experts = _C.format_diag(rank=2, peer=0, channel=-1, phase=25, role=4, expected=64, seen=128, command=2,
                             waited_s=0.0)["message"]
    assert ("peer 0 passes num_experts=128, this rank num_experts=64" in experts and "no row moved" in experts
            and "bytes" not in experts), experts
    experts_worst = _C.format_diag(rank=2, peer=0, channel=-1, phase=25, role=4, expected=64, seen=128, command=3,
                                   waited_s=0.0)["message"]
    assert "num_experts=128" in experts_worst and "with num_worst_tokens nothing waits" in experts_worst
    # each field at its limit decodes alone
    limits = _C.format_diag(rank=0, peer=1, channel=-1, phase=25, role=4,
                            expected=_C.dispatch_rows_code(2**32 - 1, 32, 2**20 - 1),
                            seen=_C.dispatch_rows_code(16, 0, 0), command=0, waited_s=0.0)["message"]
    assert ("this rank rows of 4294967295 bytes with 32 top-k entries and 1048575 scales" in limits
            and "peer 1 passes rows of 16 bytes with 0 top-k entries and 0 scales" in limits), limits


def test_diag_role_names():
    # role 6 (kLaunchEnd) is not a wait: its own message, test_a_drained_record_says_the_launch_was_aborted_first
    names = {0: "host", 1: "sender", 2: "receiver", 3: "forwarder", 4: "coordinator", 5: "proxy", 7: "unknown"}
    for r, name in names.items():
        msg = _C.format_diag(rank=0, peer=1, channel=0, phase=5, role=r, expected=2, seen=1, command=0,
                             waited_s=1.0)["message"]
        assert f"({name})" in msg, (r, msg)


def test_the_api_without_torch_says_what_to_install(monkeypatch):
    """`from uccl_moe import Buffer` where torch is missing (the launcher installs without it): a ModuleNotFoundError
    that names torch and how to install it, not a bare import error from deep inside the package."""
    import importlib

    real = importlib.import_module

    def no_torch(name, package=None):
        if name == ".buffer" and package == "uccl_moe":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_torch)
    monkeypatch.delitem(uccl_moe.__dict__, "Buffer", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"uccl_moe.Buffer needs PyTorch.*pip install torch") as e:
        uccl_moe.Buffer  # noqa: B018 - the lazy attribute's import is the point
    assert e.value.name == "torch"

    def other_missing(name, package=None):
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr(importlib, "import_module", other_missing)
    monkeypatch.delitem(uccl_moe.__dict__, "Config", raising=False)
    with pytest.raises(ModuleNotFoundError, match="numpy"):
        uccl_moe.Config  # noqa: B018 - another module missing is reported as it is
