"""DeepEP V1's own ``tests/test_intranode.py`` runs unmodified through our ``deep_ep`` shim on 2 and 4 GPUs (issues 29
and 32; each size needs that many GPUs).

Point ``UCCL_MOE_DEEPEP_V1_TESTS`` at the ``tests`` folder of a DeepEP V1 checkout (commit 567632d, or any V1 tree
whose ``tests/`` holds ``test_intranode.py`` with its ``utils.py`` and ``test_low_latency.py``); nothing of DeepEP is
copied into this repository. The shim is written into a temporary folder by ``python -m uccl_moe.deep_ep_compat
install --target`` and put first on ``PYTHONPATH``, so ``import deep_ep`` in DeepEP's files loads uccl-moe. The file
runs as DeepEP documents it (``python tests/test_intranode.py --num-processes 2``; its ``init_dist`` reads
MASTER_ADDR/MASTER_PORT, and WORLD_SIZE/RANK as node count and node rank) and must exit 0 with every correctness case
"passed". It sets ``torch.set_default_device("cuda")`` and ``set_default_dtype(bfloat16)`` itself.

    UCCL_MOE_DEEPEP_V1_TESTS=/path/to/DeepEP/tests python -m pytest -q tests/gpu/test_deepep_v1_intranode.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.mp import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "UCCL_MOE_DEEPEP_V1_TESTS"
# test_main's loops: previous event x async x {random BF16, rank-valued BF16, FP8 if sm90} x with/without top-k.
CASES_WITH_FP8, CASES_WITHOUT_FP8 = 24, 16


def _deepep_tests() -> Path:
    where = os.environ.get(ENV_VAR)
    if not where:
        pytest.skip(f"set {ENV_VAR} to the tests/ folder of a DeepEP V1 checkout (e.g. commit 567632d) to run "
                    f"DeepEP's own test_intranode.py through the deep_ep shim")
    path = Path(where)
    missing = [f for f in ("test_intranode.py", "utils.py", "test_low_latency.py") if not (path / f).is_file()]
    if missing:
        pytest.fail(f"{ENV_VAR}={where} is not a DeepEP V1 tests folder: {missing} missing (DeepEP's head keeps the "
                    f"V1 tests in tests/legacy/, which import deep_ep.utils.* modules of its own package; use the "
                    f"tests/ folder of commit 567632d)")
    return path


@pytest.mark.parametrize("procs", [2, 4])
def test_deepep_v1_test_intranode_passes_through_the_shim(tmp_path, procs):
    tests = _deepep_tests()
    if torch.cuda.device_count() < procs:
        pytest.skip(f"needs {procs} GPUs (DeepEP's test runs one process per GPU)")
    shim = tmp_path / "shim"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    subprocess.run([sys.executable, "-m", "uccl_moe.deep_ep_compat", "install", "--target", str(shim)], env=env,
                   check=True, capture_output=True, text=True)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
    # init_dist: one node (WORLD_SIZE/RANK are the node count and rank), a rendezvous port of our own.
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0"})
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(tests / "test_intranode.py"), "--num-processes", str(procs)], cwd=tests,
                          env=env, capture_output=True, text=True, timeout=1700)
    out = proc.stdout + proc.stderr
    probe = "import deep_ep, uccl_moe; print(deep_ep.Buffer is uccl_moe.Buffer)"
    loaded = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert loaded.stdout.strip() == "True", f"import deep_ep does not load the shim: {loaded.stdout}{loaded.stderr}"
    assert proc.returncode == 0, f"test_intranode.py exited {proc.returncode}:\n{out[-6000:]}"
    passed = out.count(" passed")
    assert passed in (CASES_WITH_FP8, CASES_WITHOUT_FP8), f"{passed} cases passed:\n{out[-6000:]}"
    assert "[tuning] Best combine" in out, out[-3000:]
