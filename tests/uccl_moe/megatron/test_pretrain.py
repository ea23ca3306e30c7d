"""python -m uccl_moe.megatron.pretrain <script> <args>: installs, then runs the unmodified script as __main__."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = textwrap.dedent(
    """
    import sys
    from megatron.core.transformer.transformer_config import TransformerConfig
    import helper_next_to_script  # the script's folder is on sys.path, as with `python script.py`
    assert __name__ == "__main__"
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=4,
                            moe_router_topk=2, moe_token_dispatcher_type=sys.argv[2])
    print("ARGV", sys.argv[1:], "TYPE", cfg.moe_token_dispatcher_type)
    """
)


def _run(tmp_path, *args):
    (tmp_path / "my_pretrain.py").write_text(SCRIPT)
    (tmp_path / "helper_next_to_script.py").write_text("")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "uccl_moe.megatron.pretrain", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_pretrain_launcher_installs_then_runs_script(tmp_path):
    r = _run(tmp_path, str(tmp_path / "my_pretrain.py"), "--moe-token-dispatcher-type", "uccl")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ARGV ['--moe-token-dispatcher-type', 'uccl'] TYPE uccl" in r.stdout


def test_pretrain_launcher_reports_missing_script(tmp_path):
    r = _run(tmp_path, str(tmp_path / "nope.py"))
    assert r.returncode == 2 and "no such script" in r.stderr
