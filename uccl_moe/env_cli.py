"""``uccl-moe env``: every UCCL_MOE_* knob, its value, who set it (the environment or the default) and what it does
(uccl_moe.env.main). Exits with 1 where a variable holds a value its knob refuses."""

from __future__ import annotations

import argparse

from . import env
from .cli import subcommand


@subcommand("env", "list every UCCL_MOE_* knob: its value, who set it, what it does")
def show(args: argparse.Namespace) -> int:
    return env.main([])
