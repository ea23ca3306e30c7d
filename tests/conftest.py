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
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip)
