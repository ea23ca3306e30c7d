"""Environment knobs (``UCCL_MOE_*``), read from the one table ``env_knobs.def`` that C++ also compiles.

``uccl-moe env`` (or ``python -m uccl_moe.env``) prints every knob with its value and who set it (default or
environment).
Parsing is strict and identical to the native parser: ``UCCL_MOE_PROXY_THREADS=12abc`` is an error naming
the variable, never a silent 12. Unknown ``UCCL_MOE_*`` variables get a warning (likely typos).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Any

from .errors import InvalidUsageError

_PREFIX = "UCCL_MOE_"
#: UCCL_MOE_* variables that are not knobs: our launchers set them for the processes they start (uccl_moe.launch:
#: the Primus entry script's path), so they are never reported as unknown.
LAUNCHER_VARS = frozenset({"PRIMUS_ENTRY"})
_ROW = re.compile(
    r'^UCCL_MOE_KNOB\((?P<name>[A-Z0-9_]+),\s*(?P<type>INT|FLOAT|BOOL|STRING|CHOICE),\s*"(?P<default>[^"]*)",'
    r'\s*"(?P<min>[^"]*)",\s*"(?P<max>[^"]*)",\s*"(?P<doc>[^"]*)"\)\s*$'
)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Knob:
    """One row of env_knobs.def."""

    name: str  # without the prefix
    type: str  # INT | FLOAT | BOOL | STRING | CHOICE
    default: str
    min_or_choices: str
    max: str
    doc: str

    @property
    def var(self) -> str:
        return _PREFIX + self.name

    def parse(self, text: str) -> Any:
        """Parse `text` as this knob's type; raise InvalidUsageError naming the variable on bad input."""
        t = text.strip()

        def bad(want: str) -> InvalidUsageError:
            return InvalidUsageError(f'{self.var}="{text}" is invalid: expected {want}')

        if self.type == "INT":
            if not re.fullmatch(r"[+-]?(0[xX][0-9a-fA-F]+|[0-9]+)", t):
                raise bad("an integer")
            v: Any = int(t, 0) if not re.fullmatch(r"[+-]?0[0-9]+", t) else int(t, 8)
            if self.min_or_choices and v < int(self.min_or_choices, 0):
                raise bad(f"an integer >= {self.min_or_choices}")
            if self.max and v > int(self.max, 0):
                raise bad(f"an integer <= {self.max}")
            return v
        if self.type == "FLOAT":
            try:
                v = float(t)
            except ValueError:
                raise bad("a number") from None
            if not math.isfinite(v):
                raise bad("a number")
            if self.min_or_choices and v < float(self.min_or_choices):
                raise bad(f"a number >= {self.min_or_choices}")
            if self.max and v > float(self.max):
                raise bad(f"a number <= {self.max}")
            return v
        if self.type == "BOOL":
            if t.lower() in _TRUE:
                return True
            if t.lower() in _FALSE:
                return False
            raise bad("a boolean (1/0, true/false, yes/no, on/off)")
        if self.type == "CHOICE":
            choices = self.min_or_choices.split("|")
            if t not in choices:
                raise bad("one of " + self.min_or_choices)
            return t
        return text


def _def_path() -> Path:
    return Path(__file__).with_name("env_knobs.def")


def _load() -> dict[str, Knob]:
    knobs: dict[str, Knob] = {}
    for line in _def_path().read_text().splitlines():
        line = line.strip()
        if not line.startswith("UCCL_MOE_KNOB("):
            continue
        m = _ROW.match(line)
        if m is None:
            raise RuntimeError(f"malformed row in {_def_path()}: {line}")
        knobs[m["name"]] = Knob(m["name"], m["type"], m["default"], m["min"], m["max"], m["doc"])
    return knobs


KNOBS: dict[str, Knob] = _load()
_logged: set[str] = set()
_warned_unknown = False
#: name -> (the variable's stamp, its parsed value): hot paths read knobs per call, and parsing costs microseconds.
_parsed: dict[str, tuple[Any, Any]] = {}
# CPython's os.environ keeps its variables in a dict of encoded names and values (os._Environ._data), updated by
# every assignment through os.environ: one lookup there is the stamp, without os.environ.get's encode and decode on
# each call. Where os.environ has no such dict, or was replaced, the stamp is the text itself.
_ENVIRON = os.environ
_ENV_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_ENV_KEYS: dict[str, Any] = {}  # knob name -> its encoded variable name in _ENV_DATA


def get(name: str) -> Any:
    """Typed value of knob `name` (without prefix): the environment's if set and non-empty, else the default."""
    global _warned_unknown
    if not _warned_unknown:
        _warned_unknown = True
        _warn_unknown()
    knob = KNOBS[name]
    if _ENV_DATA is not None and os.environ is _ENVIRON:
        key = _ENV_KEYS.get(name)
        if key is None:
            key = _ENV_KEYS[name] = os.environ.encodekey(knob.var)
        stamp = ("data", _ENV_DATA.get(key))
    else:
        stamp = ("text", os.environ.get(knob.var, ""))
    hit = _parsed.get(name)
    if hit is not None and hit[0] == stamp:  # the environment may change at run time: its value is the key
        return hit[1]
    text = os.environ.get(knob.var, "")
    value = knob.parse(text if text != "" else knob.default)  # a bad value raises here, every time
    _parsed[name] = (stamp, value)
    if text != "" and name not in _logged:
        _logged.add(name)
        logging.getLogger("uccl_moe.env").info("%s=%s (default %s)", knob.var, text, knob.default)
    return value


def _warn_unknown() -> None:
    """One warning naming every UCCL_MOE_* variable that is neither a knob nor a launcher's, each with the knobs its
    name is close to, pointed at the first frame outside this package (the user's code, not ours)."""
    import difflib

    unknown = sorted(k for k in os.environ if k.startswith(_PREFIX) and k[len(_PREFIX):] not in KNOBS
                     and k[len(_PREFIX):] not in LAUNCHER_VARS)
    if not unknown:
        return
    described = []
    for var in unknown:  # names compared without the prefix they all share
        close = [_PREFIX + n for n in difflib.get_close_matches(var[len(_PREFIX):], list(KNOBS), n=2, cutoff=0.7)]
        described.append(f"{var} (did you mean {' or '.join(close)}?)" if close else var)
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    # stacklevel 2 is our caller; warnings.warn does not count the import machinery's frames (above an `import
    # uccl_moe`), so neither does this
    level = 2
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name
        if not internal and not os.path.abspath(name).startswith(package):
            break
        level, frame = level + (0 if internal else 1), frame.f_back
    warnings.warn(f"unknown uccl-moe environment variables: {', '.join(described)}; `uccl-moe env` lists the known "
                  f"ones", stacklevel=level)


def source(name: str) -> str:
    """'env' if the variable is set (non-empty), else 'default'."""
    return "env" if os.environ.get(KNOBS[name].var, "") else "default"


def configure_logging() -> None:
    """Give the ``uccl_moe`` Python loggers the level of UCCL_MOE_LOG_LEVEL (WARN by default)."""
    level = {"NONE": logging.CRITICAL + 10, "ERROR": logging.ERROR, "WARN": logging.WARNING, "INFO": logging.INFO,
             "DEBUG": logging.DEBUG, "TRACE": logging.DEBUG}[get("LOG_LEVEL")]
    logging.getLogger("uccl_moe").setLevel(level)


def prepare_cuda_module_loading() -> bool:
    """Ask CUDA for eager kernel loading when the loopback transport will copy with copy engines.

    With ``UCCL_MOE_LOOPBACK_GPU_COPY=1`` the CPU proxy issues CUDA copies that spinning kernels wait for. With lazy
    loading (CUDA's default) a kernel's first launch can wait for those kernels to finish: a deadlock. So this sets
    ``CUDA_MODULE_LOADING=EAGER`` unless the user set it or CUDA already started in this process (then the native
    runtime refuses the GPU-copy mode with an explanation). Returns whether it set it.
    """
    if not get("LOOPBACK_GPU_COPY") or "CUDA_MODULE_LOADING" in os.environ:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    return True


def main(argv: list[str] | None = None) -> int:
    """Print every knob, its value, who set it and its doc."""
    rows = []
    status = 0
    for name, knob in KNOBS.items():
        try:
            value = repr(get(name))
        except InvalidUsageError as e:
            value, status = f"ERROR: {e}", 1
        rows.append((knob.var, value, source(name), knob.doc))
    w0 = max(len(r[0]) for r in rows)
    w1 = min(24, max(len(r[1]) for r in rows))
    for var, value, src, doc in rows:
        print(f"{var:<{w0}}  {value:<{w1}}  {src:<7}  {doc}")
    return status


if __name__ == "__main__":
    sys.exit(main())
