"""Compose a run config from ``configs/`` with Hydra's compose API, and turn Hydra's errors into ours.

``compose(["recipe=dsv3_h200_efa_4n", "parallel.micro_batch_size=2"])`` returns the typed ``DictConfig``
(schema :class:`uccl_moe.config.schema.Config`) with ``meta`` filled in: the recipe, the overrides and the
group choices, so everything rendered from it can say where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from ..errors import InvalidUsageError
from . import schema

CONFIG_DIR_ENV = "UCCL_MOE_CONFIG_DIR"
"""Environment variable naming the config tree to use instead of the repository's ``configs/``."""


class ConfigError(InvalidUsageError):
    """A config did not compose: unknown key, bad value, unknown group option, missing mandatory value.

    ``key`` is the full key (``parallel.expert_model_parallel_size``) or group (``platform``) when known.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def config_dir() -> Path:
    """The config tree: ``$UCCL_MOE_CONFIG_DIR`` if set, else ``configs/`` next to the ``uccl_moe`` package
    (a source checkout or an editable install)."""
    env = os.environ.get(CONFIG_DIR_ENV, "")
    if env:
        path = Path(env).expanduser().resolve()
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{CONFIG_DIR_ENV}={env} has no config.yaml; point it at uccl-moe's configs/ folder")
        return path
    path = Path(__file__).resolve().parents[2] / "configs"
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"no config tree found at {path}; run from a uccl-moe checkout (or an editable install) or set "
            f"{CONFIG_DIR_ENV} to the configs/ folder"
        )
    return path


def available(group: str, directory: Path | None = None) -> list[str]:
    """Names of the options of config group `group` (``recipe``, ``model``, ...)."""
    d = (directory or config_dir()) / group
    return sorted(p.stem for p in d.glob("*.yaml"))


def compose(overrides: Sequence[str] = (), directory: Path | None = None) -> DictConfig:
    """Compose ``config.yaml`` with `overrides` (Hydra syntax) and fill ``meta``.

    Raises:
        ConfigError: naming the key or group that failed and Hydra's reason.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema.register()
    directory = directory or config_dir()
    overrides = [str(o) for o in overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory), version_base="1.3", job_name="uccl_moe"):
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra raises several unrelated types; all of them are usage errors here
        raise _as_config_error(e, overrides) from e
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if not str(k).startswith("hydra") and v}
    with open_dict(cfg):
        del cfg["hydra"]
    cfg.meta.recipe = choices.get("recipe", "none")
    cfg.meta.overrides = overrides
    cfg.meta.choices = {k: choices[k] for k in sorted(choices) if k != "base_config"}
    if not cfg.meta.description:
        cfg.meta.description = str(cfg.model.description)
    _resolve_platform_defaults(cfg)
    missing = _missing_keys(cfg)
    if missing:
        raise ConfigError(
            f"config has no value for {', '.join(missing)}; set it in the group file or on the command line "
            f"(e.g. {missing[0]}=...)",
            key=missing[0],
        )
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:
        raise _as_config_error(e, overrides) from e
    return cfg


def to_object(cfg: DictConfig) -> schema.Config:
    """The composed config as schema dataclass instances (enums as ``Enum`` members)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as e:
        raise _as_config_error(e, list(cfg.meta.overrides)) from e
    assert isinstance(obj, schema.Config)
    return obj


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML (what a run records and prints at start)."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def expand_sweeps(overrides: Sequence[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax into one override list per combination, in order.

    ``["recipe=r", "dispatcher=uccl,alltoall", "nodes=2,4"]`` gives four lists. Non-sweep overrides are kept
    as they are. Raises ConfigError for overrides Hydra cannot parse.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides([str(o) for o in overrides])
    except Exception as e:
        raise _as_config_error(e, list(overrides)) from e
    combos: list[list[str]] = [[]]
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            values = [f"{key}={v}" for v in o.sweep_string_iterator()]
            combos = [c + [v] for c in combos for v in values]
        else:
            combos = [c + [str(o.input_line)] for c in combos]
    return combos


# ---------------------------------------------------------------------------------------------------------------


def _resolve_platform_defaults(cfg: DictConfig) -> None:
    """Platform-dependent defaults that a group file cannot express: on CPU the uccl backend 'auto' (or unset)
    becomes 'reference', the torch.distributed backend that runs on gloo."""
    d = cfg.dispatcher
    if (
        cfg.platform.accelerator == schema.Accelerator.cpu
        and d.moe_token_dispatcher_type == schema.DispatcherType.uccl
        and d.moe_uccl_backend in (None, schema.UcclBackend.auto)
    ):
        d.moe_uccl_backend = schema.UcclBackend.reference


def _missing_keys(cfg: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    for key in cfg:
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(cfg, key):
            out.append(full)
            continue
        value = cfg[key]
        if isinstance(value, DictConfig):
            out.extend(_missing_keys(value, full + "."))
    return out


def _as_config_error(e: BaseException, overrides: Sequence[str]) -> ConfigError:
    """Flatten Hydra's exception chain into one message that names the key."""
    parts: list[str] = []
    key: str | None = None
    cur: BaseException | None = e
    while cur is not None:
        text = str(cur).strip()
        if text and text not in parts:
            parts.append(text)
        full_key = getattr(cur, "full_key", None)
        if full_key and key is None:
            key = str(full_key)
        cur = cur.__cause__ or cur.__context__
    msg = "\n".join(parts)
    if key is None:
        for line in msg.splitlines():
            line = line.strip()
            if line.startswith("full_key:"):
                key = line.split(":", 1)[1].strip() or None
                break
    head = f"bad config (overrides: {' '.join(overrides) or 'none'})"
    if key:
        head += f": key '{key}'"
    return ConfigError(f"{head}\n{msg}", key=key)
