"""`uccl-moe bench` is registered and takes the bench flags."""

import pytest
import torch
from helpers.requires import require

require("omegaconf")

from uccl_moe import cli


def test_bench_subcommand_parses_bench_flags():
    parser = cli.build_parser()
    assert "bench" in cli.registered()
    args = parser.parse_args(["bench", "--ranks", "2", "--tokens", "128,4096", "--dtypes", "fp8", "--iters", "25"])
    assert args.ranks == 2 and args.tokens == [128, 4096] and args.dtypes == "fp8" and args.iters == 25


def test_bench_writes_into_an_ignored_folder_by_default():
    import subprocess
    from pathlib import Path

    from uccl_moe.bench.__main__ import build_parser, output_paths

    root = Path(__file__).resolve().parents[3]
    json_path, png_path = output_paths(build_parser().parse_args([]), stamp="20260101-000000")
    assert json_path == "runs/bench/20260101-000000/bench.json" and png_path == "runs/bench/20260101-000000/bench.png"
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", json_path, png_path], check=False,
                             capture_output=True, text=True)
    assert ignored.returncode == 0, f"{json_path} is not git-ignored: the bench would write into the checkout"
    assert output_paths(build_parser().parse_args(["--json", "", "--png", "x.png"])) == ("", "x.png")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a host without GPUs")
@pytest.mark.parametrize("module, args", [("uccl_moe.bench.__main__", ["--ranks", "2"]),
                                          ("uccl_moe.bench.internode", ["--ranks", "2"]),
                                          ("uccl_moe.bench.fifo_gpu", ["--threads", "1"])])
def test_the_gpu_benches_say_what_runs_on_a_cpu_instead(module: str, args: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """On a host without GPUs the GPU benchmarks exit with 2 and say why and what to run there (the internode bench
    raised a ZeroDivisionError in each of its processes; the FIFO bench said only that it needs a GPU)."""
    import importlib

    assert importlib.import_module(module).main(args) == 2
    err = capsys.readouterr().err
    assert "needs CUDA or ROCm GPUs" in err and "buffer_cpu_gloo.py" in err and "tiny_cpu_moe" in err, err
