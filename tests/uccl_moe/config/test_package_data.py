"""The Hydra configs ship inside the package, so a plain (non-editable) install composes recipes.

Builds a wheel of the Python package (CMake off: the configs are what is checked, not the native module), unpacks
it as an install would, and composes a recipe from that copy with the checkout out of reach.
"""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.config import config_dir

ROOT = Path(__file__).resolve().parents[3]


def test_the_config_tree_lives_in_the_package_and_the_checkout_links_to_it():
    tree = config_dir()
    assert tree == (ROOT / "uccl_moe" / "configs").resolve() and (tree / "config.yaml").is_file()
    assert (ROOT / "configs").resolve() == tree  # `configs/` of the checkout keeps working


@pytest.mark.timeout(600)
def test_a_wheel_carries_the_configs_and_composes_a_recipe_when_installed(tmp_path):
    cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path / "dist"),
           "--config-settings=wheel.cmake=false", f"--config-settings=build-dir={tmp_path / 'build'}"]
    if importlib.util.find_spec("scikit_build_core") is not None:
        cmd.append("--no-build-isolation")  # else pip fetches the build backend
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=540, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("uccl_moe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    pkg = ROOT / "uccl_moe"
    want = {"uccl_moe/" + p.relative_to(pkg).as_posix() for p in (pkg / "configs").rglob("*.yaml")}
    assert want and want <= names, sorted(want - names)
    assert "uccl_moe/env_knobs.def" in names

    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    probe = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(installed)!r}]
        import uccl_moe
        from uccl_moe.config import compose, config_dir
        assert uccl_moe.__file__.startswith({str(installed)!r}), uccl_moe.__file__
        assert str(config_dir()).startswith({str(installed)!r}), config_dir()
        cfg = compose(["recipe=tiny_cpu_moe"])
        assert cfg.model.name == "tiny_moe" and cfg.meta.recipe == "tiny_cpu_moe"
        from uccl_moe.cli import main
        sys.exit(main(["slurm", "recipe=dsv3_h200_efa_4n", "--quiet", "--run-dir", {str(tmp_path / "run")!r}]))
    """)
    # -S: no .pth files, so no other uccl_moe (an editable install of another checkout) can answer the import;
    # the interpreter's site-packages come back through PYTHONPATH, after the unpacked wheel.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "UCCL_MOE_CONFIG_DIR")}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    r = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "run" / "job.sbatch").is_file()
