import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # `helpers` and `reference` packages


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        n_gpus = 0
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run on a GPU machine: tools/device)")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip)


def pytest_report_header(config):
    """One header line naming the optional tools this machine lacks (their tests skip, saying how to install)."""
    import shutil

    from helpers.requires import missing

    absent = [m for m in ("omegaconf", "megatron.core", "matplotlib") if missing(m)]
    absent += [t for t in ("shellcheck", "cmake") if shutil.which(t) is None]
    if absent:
        return f"uccl-moe: optional tools absent (their tests skip): {', '.join(absent)}"
    return "uccl-moe: every optional tool is present"
