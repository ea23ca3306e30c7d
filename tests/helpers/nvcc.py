"""nvcc compile checks of kernel files in builds the shipped module never compiles (the traced and stamped ones),
so that code behind their flags cannot rot unseen."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "native" / "src" / "kernels" / "intranode"
FLAGS = ["-DUCCL_MOE_WITH_CUDA=1", "-DUCCL_MOE_WITH_INTRANODE_KERNELS=1", f"-I{ROOT / 'native' / 'include'}",
         f"-I{ROOT / 'uccl_moe'}", "-O3", "-DNDEBUG", "--generate-code=arch=compute_90,code=sm_90", "-std=c++17",
         "-x", "cu", "-c"]


def compile_all(jobs: dict[str, tuple[str, list[str]]], out_dir: Path) -> None:
    """Compiles each job (name -> (kernel file in KERNELS, extra flags)) at once, into out_dir/<name>.o; asserts that
    every one compiled, naming the first that did not with the end of its output."""
    procs = {name: subprocess.Popen(["nvcc", *FLAGS, *extra, str(KERNELS / src), "-o", str(out_dir / f"{name}.o")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, (src, extra) in jobs.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
        assert (out_dir / f"{name}.o").stat().st_size > 0
