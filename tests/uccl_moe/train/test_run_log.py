"""The run's story: one log per rank (tee of the file descriptors, C-level writes included), progress, summary."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.requires import require

require("megatron.core")  # the module lives in uccl_moe.megatron, whose import loads Megatron-Core

from uccl_moe.train import run_log

ROOT = Path(__file__).resolve().parents[3]


def test_tee_copies_python_and_c_level_output_to_the_rank_log_and_the_console(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from uccl_moe.train import run_log
        path = run_log.tee_to_file(Path({str(tmp_path / "logs")!r}), 3)
        print("from python stdout")
        print("from python stderr", file=sys.stderr)
        os.write(1, b"from fd 1\\n")
        os.write(2, b"from fd 2\\n")
        raise SystemExit(7)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 7
    log = (tmp_path / "logs" / "rank3.log").read_text()
    for line in ("from python stdout", "from python stderr", "from fd 1", "from fd 2"):
        assert line in log, log
    assert "from python stdout" in r.stdout and "from fd 1" in r.stdout  # stdout stays stdout
    assert "from python stderr" in r.stderr and "from fd 2" in r.stderr  # and stderr stays stderr


def test_progress_prints_on_one_rank_only(capsys):
    run_log.progress("building the model", rank=1)
    assert capsys.readouterr().out == ""
    run_log.progress("building the model", rank=0)
    out = capsys.readouterr().out
    assert out.startswith("[train_gpt +") and out.rstrip().endswith("s] building the model")


def _rows(losses, tps, secs):
    return [{"iteration": i + 1, "loss": x, "tokens_per_s": t, "seconds": s}
            for i, (x, t, s) in enumerate(zip(losses, tps, secs))]


def test_summary_counts_steps_losses_and_steady_throughput(tmp_path):
    s = run_log.run_summary(_rows([5.5, 5.4, 5.2], [10.0, 300.0, 500.0], [6.0, 0.3, 0.2]), 9.5, 2, "cpu")
    assert s["steps"] == 3 and s["loss_first"] == 5.5 and s["loss_last"] == 5.2
    assert s["tokens_per_s"] == pytest.approx(400.0)  # steps 2+: the first one warms up
    assert s["first_step_s"] == 6.0 and s["wall_s"] == 9.5 and s["world_size"] == 2
    v = s["versions"]
    import torch

    import uccl_moe

    assert v["uccl_moe"] == uccl_moe.__version__ and v["torch"] == torch.__version__
    assert v["devices"].startswith("CPU (")
    text = run_log.format_summary(s)
    lines = text.splitlines()
    assert lines[0] == ("[train_gpt] done: 3 steps in 9.5 s wall, first step 6.0 s | lm loss 5.5000 -> 5.2000 | "
                        "400 tokens/s (steps 2+)")
    assert lines[1].startswith(f"[train_gpt] versions: uccl-moe {uccl_moe.__version__}, torch {torch.__version__}, "
                               f"megatron-core ")
    assert lines[2] == "[train_gpt] devices: " + v["devices"] + ", 2 rank(s)"
    path = run_log.write_summary(tmp_path, s)
    assert json.loads(path.read_text()) == s


def test_summary_of_a_rank_without_losses_and_of_one_step():
    s = run_log.run_summary(_rows([math.nan], [50.0], [2.0]), 3.0, 1, "cpu")
    assert s["loss_first"] is None and s["tokens_per_s"] == 50.0
    line = run_log.format_summary(s).splitlines()[0]
    assert "lm loss n/a" in line and "(steps 2+)" not in line


def test_train_gpt_refuses_zero_steps_and_finds_its_log_dir_early():
    from uccl_moe.errors import InvalidUsageError
    from uccl_moe.train import train_gpt

    with pytest.raises(InvalidUsageError, match="--train-iters 0: give at least 1 step"):
        train_gpt.setup(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                         "--train-iters", "0"])
    assert train_gpt._log_dir_of(["--lr", "1", "--log-dir", "/r/logs"]) == "/r/logs"
    assert train_gpt._log_dir_of(["--log-dir=/r/x"]) == "/r/x" and train_gpt._log_dir_of(["--lr", "1"]) is None
