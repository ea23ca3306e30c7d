"""Child process for test_launch_megatron_args.py: parse rendered argvs with Megatron's own argument parser.

stdin: JSON ``{"install": bool, "items": [{"name": str, "argv": [str], "dests": [str]}]}``.
stdout (last line): JSON ``{"version": str, "installed": bool, "results": [{"name", "values"} | {"name", "error"}]}``.
Exit 3 when ``megatron.training`` is not importable (the wheel of megatron-core <= 0.16 does not ship it).

Run in a child so that ``uccl_moe.megatron.install()`` patches a throw-away interpreter and so that a Megatron
checkout or unpacked wheel can be put first on PYTHONPATH (``UCCL_MOE_TEST_MEGATRON_PATH``).
"""

from __future__ import annotations

import io
import json
import sys
import typing


def main() -> int:
    req = json.load(sys.stdin)
    if not hasattr(typing, "override"):  # megatron.training >= 0.19 uses typing.override (3.12); test-only shim
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    try:
        from megatron.training.arguments import parse_args
    except ImportError as e:
        print(json.dumps({"error": f"megatron.training not importable: {e}"}))
        return 3
    import megatron.core

    installed = False
    if req["install"]:
        import uccl_moe.megatron

        uccl_moe.megatron.install()
        installed = True
    results = []
    for item in req["items"]:
        sys.argv = ["pretrain_gpt.py", *item["argv"]]
        err = io.StringIO()
        old, sys.stderr = sys.stderr, err
        try:
            args = parse_args()
        except SystemExit as e:
            results.append({"name": item["name"], "error": f"exit {e.code}: {err.getvalue()[-2000:]}"})
            continue
        finally:
            sys.stderr = old
        values = {k: getattr(args, k, "<<missing>>") for k in item["dests"]}
        results.append({"name": item["name"], "values": values})
    print(json.dumps({"version": megatron.core.__version__, "installed": installed, "results": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
