"""`deep_ep` shim: Megatron's imports resolve to uccl-moe, in-process and on disk."""

from __future__ import annotations

import subprocess
import sys

import uccl_moe
import uccl_moe.deep_ep_compat as compat


def test_install_in_process():
    compat.install()
    try:
        import deep_ep
        from deep_ep.utils import EventHandle, EventOverlap

        assert deep_ep.Buffer is uccl_moe.Buffer and deep_ep.Config is uccl_moe.Config
        assert EventHandle is uccl_moe.EventHandle and EventOverlap is uccl_moe.EventOverlap
        assert deep_ep.topk_idx_t is uccl_moe.topk_idx_t
        # Megatron's pattern works on CPU too
        ev = EventOverlap(EventHandle())
        ev.current_stream_wait()
    finally:
        compat.uninstall()
    assert "deep_ep" not in sys.modules


def test_install_does_not_replace_a_real_deep_ep(monkeypatch):
    import types

    real = types.ModuleType("deep_ep")
    monkeypatch.setitem(sys.modules, "deep_ep", real)
    assert compat.install() is real
    assert sys.modules["deep_ep"] is real


def test_on_disk_shim(tmp_path):
    root = str(__import__("pathlib").Path(uccl_moe.__file__).parent.parent)
    def run(*a: str) -> None:
        subprocess.run([sys.executable, "-m", "uccl_moe.deep_ep_compat", *a, "--target", str(tmp_path)],
                       check=True, capture_output=True, text=True, cwd=root)
    run("install")
    code = ("import deep_ep, uccl_moe; from deep_ep.utils import EventHandle, EventOverlap; "
            "assert deep_ep.Buffer is uccl_moe.Buffer; print('ok')")
    env = {"PYTHONPATH": f"{tmp_path}:{root}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert out.stdout.strip() == "ok", out.stderr
    run("uninstall")
    assert not (tmp_path / "deep_ep").exists()


def test_install_after_megatron_was_imported_rebinds_its_deep_ep_names():
    """Megatron-Core binds deep_ep when megatron.core is first imported (fused_a2a); install() afterwards must still
    give flex's token dispatcher our Buffer (a fresh interpreter, so the import order is the one under test)."""
    import pytest

    pytest.importorskip("megatron.core")
    probe = (
        "import megatron.core\n"
        "from megatron.core.transformer.moe import fused_a2a, token_dispatcher as td\n"
        "assert not fused_a2a.HAVE_DEEP_EP and td.fused_dispatch is None\n"
        "import uccl_moe, uccl_moe.deep_ep_compat as shim\n"
        "shim.install()\n"
        "assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is uccl_moe.Buffer\n"
        "assert td.fused_dispatch is fused_a2a.fused_dispatch is not None\n"
        "assert td.fused_combine is fused_a2a.fused_combine is not None\n"
        "print('rebound')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "rebound" in out.stdout, out.stdout + out.stderr[-3000:]
