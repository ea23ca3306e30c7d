"""Checks before torchrun: Megatron-Core present and supported, torch present, every UCCL_MOE_* knob parses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.config import compose
from uccl_moe.launch import preflight
from uccl_moe.launch.preflight import PreflightError, check_env_knobs, check_megatron, megatron_version


@pytest.mark.parametrize("version", ["0.13.0", "0.15.3", "0.16.1", "0.19.2", "0.19.0rc1"])
def test_supported_megatron_versions_pass(version):
    check_megatron(version)


@pytest.mark.parametrize("version, needle", [
    (None, "Megatron-Core is not installed"),
    ("0.12.3", "megatron-core 0.12.3 is installed but uccl-moe supports 0.13-0.19"),
    ("0.20.0", "megatron-core 0.20.0 is installed but uccl-moe supports 0.13-0.19"),
    ("1.0.0", "megatron-core 1.0.0 is installed"),
])
def test_missing_or_unsupported_megatron_is_one_line_with_the_fix(version, needle):
    with pytest.raises(PreflightError) as e:
        check_megatron(version)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert 'pip install "megatron-core==0.16.1"' in msg and '"megatron-core>=0.19,<0.20"' in msg


def test_the_version_is_read_from_the_megatron_that_would_be_imported(tmp_path, monkeypatch):
    """A Megatron-LM checkout on the path shadows the installed wheel: its package_info.py is what counts."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("raise RuntimeError('must not be imported by the preflight')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 11\nPATCH = 4\nPRE_RELEASE = ''\n")
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert megatron_version() == "0.11.4"
    with pytest.raises(PreflightError, match="0.11.4 is installed"):
        check_megatron(megatron_version())


def test_no_megatron_on_the_path_reads_as_none(monkeypatch):
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    assert megatron_version() is None


@pytest.mark.parametrize("var, value, needle", [
    ("UCCL_MOE_TIMEOUT_S", "abc", 'UCCL_MOE_TIMEOUT_S="abc" is invalid: expected a number'),
    ("UCCL_MOE_PROXY_THREADS", "12abc", 'UCCL_MOE_PROXY_THREADS="12abc" is invalid: expected an integer'),
])
def test_a_bad_knob_value_names_the_knob_and_the_fix(var, value, needle):
    with pytest.raises(PreflightError) as e:
        check_env_knobs({var: value, "PATH": "/usr/bin"})
    msg = str(e.value)
    assert needle in msg and "uccl-moe env" in msg and len(msg.splitlines()) <= 5


def test_good_knobs_and_non_knob_variables_pass():
    check_env_knobs({"UCCL_MOE_TIMEOUT_S": "30", "UCCL_MOE_CONFIG_DIR": "/x", "UCCL_MOE_CUDA_ARCHS": "90"})


def test_training_stack_needs_torch(monkeypatch):
    cfg = compose(["recipe=tiny_cpu_moe"])
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda n: None if n == "torch" else real(n))
    with pytest.raises(PreflightError, match=r'torch is not installed: pip install "uccl-moe\[train\]"'):
        preflight.check_training_stack(cfg)


def test_training_stack_checks_megatron_for_megatron_entries_only(monkeypatch):
    monkeypatch.setattr(preflight, "megatron_version", lambda: None)
    with pytest.raises(PreflightError, match="Megatron-Core is not installed"):
        preflight.check_training_stack(compose(["recipe=tiny_cpu_moe"]))
    with pytest.raises(PreflightError):  # a Megatron-LM script needs it as well
        preflight.check_training_stack(compose(["recipe=tiny_cpu_moe", "train.entry=/x/pretrain_gpt.py"]))
    preflight.check_training_stack(compose(["recipe=tiny_cpu_moe", "train.entry=-m my_own_trainer"]))


def test_the_supported_range_matches_the_compat_layer():
    text = (Path(preflight.__file__).parents[1] / "megatron" / "_compat.py").read_text()
    lo, hi = preflight.MEGATRON_SUPPORTED
    assert f"{lo[0]}.{lo[1]}" in text and f"{hi[0]}.{hi[1]}" in text


def test_an_empty_knob_is_unset_as_the_ranks_read_it():
    check_env_knobs({"UCCL_MOE_TRANSPORT": "", "UCCL_MOE_TIMEOUT_S": ""})


@pytest.mark.parametrize("gpus,needle", [(0, "recipe=tiny_cpu_moe"), (2, "set platform.gpus_per_node=2")])
def test_too_few_gpus_for_the_platform_says_what_runs_here(monkeypatch, gpus, needle):
    """A GPU recipe on a host with fewer GPUs: the advice must be one that works (gpus_per_node=0 is refused)."""
    torch = pytest.importorskip("torch")
    from uccl_moe.errors import InvalidUsageError
    from uccl_moe.launch.local import check_devices

    cfg = compose(["recipe=dsv3_proxy_local"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(InvalidUsageError, match="per node") as e:
        check_devices(cfg)
    assert needle in str(e.value) and "gpus_per_node=0" not in str(e.value), str(e.value)
