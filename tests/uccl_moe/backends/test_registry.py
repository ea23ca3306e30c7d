"""The backend registry (STYLE R12): built-in backends load by name on first use; an unknown name lists the
registered ones."""

import subprocess
import sys

import pytest
import torch

from uccl_moe import Buffer, InvalidUsageError
from uccl_moe.backends import available_backends, backend_factory, register_backend


def test_registry_imports_no_backend_until_one_is_asked_for():
    code = ("import sys, uccl_moe.backends as b; "
            "assert b.available_backends() == ['native', 'reference'], b.available_backends(); "
            "assert not any(m in sys.modules for m in ('uccl_moe.backends.native', 'uccl_moe.backends.reference', "
            "'uccl_moe.backends.internode')), sorted(m for m in sys.modules if m.startswith('uccl_moe.backends')); "
            "b.backend_factory('reference'); "
            "assert 'uccl_moe.backends.reference' in sys.modules and 'uccl_moe.backends.native' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


def test_unknown_backend_lists_the_registered_ones(monkeypatch):
    from uccl_moe.backends import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    want = r"unknown uccl-moe backend 'bogus'; registered: \['native', 'reference'\]"
    with pytest.raises(InvalidUsageError, match=want):
        backend_factory("bogus")
    register_backend("mine", backend_factory("reference"))
    assert "mine" in available_backends()
    assert backend_factory("mine") is backend_factory("reference")


def test_public_helpers_the_megatron_adapter_uses():
    assert Buffer.get_supported_dtypes("native").combine == (torch.bfloat16,)
    assert torch.float32 in Buffer.get_supported_dtypes("reference").combine
    assert torch.float8_e4m3fn in Buffer.get_supported_dtypes().dispatch
    with pytest.raises(InvalidUsageError, match="registered"):
        Buffer.get_supported_dtypes("bogus")
    hint = Buffer.get_internode_rdma_size_hint(4096, 7168, 8, 2)
    assert hint % 4096 == 0 and hint > 2 * 2 * 4096 * 7168 * 2
    assert Buffer.get_internode_rdma_size_hint(8192, 7168, 8, 2) > hint
    with pytest.raises(InvalidUsageError, match="hidden > 0"):
        Buffer.get_internode_rdma_size_hint(16, 0, 8, 2)
