"""Compose a run config from the config tree (``uccl_moe/configs/``, package data; ``configs/`` in a checkout links
to it) with Hydra's compose API, and turn Hydra's errors into ours.

``compose(["recipe=dsv3_h200_efa_4n", "parallel.micro_batch_size=2"])`` returns the typed ``DictConfig``
(schema :class:`uccl_moe.config.schema.Config`) with ``meta`` filled in: the recipe, the overrides and the
group choices, so everything rendered from it can say where it came from.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from ..errors import InvalidUsageError
from . import schema

CONFIG_DIR_ENV = "UCCL_MOE_CONFIG_DIR"
"""Environment variable naming the config tree to use instead of the package's ``uccl_moe/configs/``."""


class ConfigError(InvalidUsageError):
    """A config did not compose: unknown key, bad value, unknown group option, missing mandatory value.

    ``key`` is the full key (``parallel.expert_model_parallel_size``) or group (``platform``) when known.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def config_dir() -> Path:
    """The config tree: ``$UCCL_MOE_CONFIG_DIR`` if set, else ``uccl_moe/configs/`` (shipped in the wheel, so a
    plain ``pip install`` finds it as an editable install or a checkout does)."""
    env = os.environ.get(CONFIG_DIR_ENV, "")
    if env:
        path = Path(env).expanduser().resolve()
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{CONFIG_DIR_ENV}={env} has no config.yaml; point it at uccl-moe's configs/ folder")
        return path
    path = Path(__file__).resolve().parents[1] / "configs"
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"no config tree found at {path} (the uccl-moe install is incomplete: reinstall it) or set "
            f"{CONFIG_DIR_ENV} to a configs/ folder"
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
        raise _as_config_error(e, overrides, directory) from None
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if not str(k).startswith("hydra") and v}
    with open_dict(cfg):
        del cfg["hydra"]
    extra = unknown_keys(cfg)
    if extra:
        raise _unknown_key_error(extra[0], _override_for(extra[0], overrides))
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
        raise _as_config_error(e, overrides, directory) from None
    return cfg


def to_object(cfg: DictConfig) -> schema.Config:
    """The composed config as schema dataclass instances (enums as ``Enum`` members)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as e:
        raise _as_config_error(e, list(cfg.meta.overrides)) from None
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
        raise _as_config_error(e, list(overrides)) from None
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


_NOISE = ("full_key:", "reference_type=", "object_type=", "$VALUE", "Config search path", "provider=",
          "Error merging override", "To append to your config use", "Available options in")


def _schema_class(key: str) -> type | None:
    """The schema dataclass holding `key`'s last part (``model.hidden_size`` -> ModelConfig), or None."""
    cls: Any = schema.Config
    for part in key.split(".")[:-1]:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        cls = hints.get(part)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None
    return cls if isinstance(cls, type) else None


def did_you_mean(word: str, candidates: Sequence[str], prefix: str = "") -> str:
    """``; did you mean 'x'?`` for the closest of `candidates` (shown with `prefix`), or ''."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _in_map(key: str) -> bool:
    """Whether `key`'s parent is a map field of the schema (``platform.env``, ``platform.uccl_env``): any key goes."""
    parent, _, _ = key.rpartition(".")
    cls, _, field = parent.rpartition(".")
    holder = _schema_class(parent) if cls else schema.Config
    hint = typing.get_type_hints(holder).get(field) if holder is not None else None
    return typing.get_origin(hint) in (dict, collections.abc.Mapping)


def _unknown_key_error(key: str, override: str | None) -> ConfigError:
    if override is not None and not override.startswith("+") and _in_map(key):  # the override names this very key
        parent = key.rpartition(".")[0]
        value = override.split("=", 1)[1] if "=" in override else "VALUE"
        return ConfigError(f"'{key}' is not in '{parent}' yet\n  rule: '{parent}' is a map, and a new key is added "
                           f"with a leading '+'; fix: +{key}={value}", key=key)
    cls = _schema_class(key)
    names = [f.name for f in dataclasses.fields(cls)] if cls is not None else []
    parent, _, leaf = key.rpartition(".")
    where = f"'{parent}'" if parent else "the config root"
    hint = did_you_mean(leaf, names, parent + "." if parent else "")
    src = f" (override {override})" if override and override.startswith("+") else ""
    fix = ("correct the spelling" if hint else "remove it") + "; all keys: uccl-moe train --show-config --dry-run"
    return ConfigError(f"unknown key '{key}'{src}{hint}\n  rule: {where} takes only the keys of its schema; fix: {fix}",
                       key=key)


def _override_for(key: str | None, overrides: Sequence[str]) -> str | None:
    if not key:
        return None
    for o in overrides:
        if o.lstrip("+~").split("=", 1)[0] == key:
            return o
    return None


def _as_config_error(e: BaseException, overrides: Sequence[str], directory: Path | None = None) -> ConfigError:
    """Turn Hydra's / OmegaConf's exception chain into a message of at most five lines: key, value, rule, fix."""
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
    override = _override_for(key, overrides)
    src = f" (override {override})" if override else ""

    m = re.search(r"Could not find '([^']+)/([^'/]+)'", msg)
    if m:  # an option of a config group that does not exist
        group, option = m.groups()
        try:
            options = available(group, directory)
        except ConfigError:
            options = []
        return ConfigError(
            f"{group}={option}: group '{group}' has no option '{option}'{did_you_mean(option, options)}\n"
            f"  fix: choose one of {', '.join(options) or '(none found)'}", key=group)
    m = re.search(r"Key '([^']+)' (?:not in|is not in struct)", msg) or re.search(r"Could not override '([^']+)'", msg)
    if m:
        return _unknown_key_error(key or m.group(1), override)
    m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", msg)
    if m and key:
        value, got, want = m.groups()
        kind = {"Integer": "a whole number", "Float": "a number", "Boolean": "true or false"}.get(want, want)
        return ConfigError(f"{key}={value} is not {kind} (got a {got})\n  rule: {key} takes {kind}; "
                           f"fix: e.g. {key}={_example(want)}", key=key)
    m = re.search(r"Value '(.*)' is not a valid bool", msg)
    if m and key:
        return ConfigError(f"{key}={m.group(1)} is not true or false\n  rule: {key} takes true or false; "
                           f"fix: {key}=true or {key}=false", key=key)
    m = re.search(r"Invalid value '(.*)', expected one of \[(.*)\]", msg)
    if m and key:
        value, choices = m.groups()
        names = [c.strip() for c in choices.split(",")]
        return ConfigError(f"{key}={value} is not a valid choice{did_you_mean(value, names, key + '=')}\n"
                           f"  fix: choose one of {', '.join(names)}", key=key)
    lines: list[str] = []
    for ln in msg.splitlines():
        ln = ln.strip()
        if ln and ln != "None" and ln not in lines and not any(n in ln for n in _NOISE):
            lines.append(ln)
    head = f"bad config{src or ' (overrides: ' + (' '.join(overrides) or 'none') + ')'}"
    if key:
        head += f": key '{key}'"
    return ConfigError("\n".join([head, *(f"  {ln}" for ln in lines[:4])]), key=key)


def _example(kind: str) -> str:
    return {"Integer": "64", "Float": "0.001", "Boolean": "true"}.get(kind, "...")


def unknown_keys(cfg: Any, cls: type = schema.Config, prefix: str = "") -> list[str]:
    """Keys of composed `cfg` that its schema does not declare (``+parallel.foo=1`` adds one; Hydra lets it in).
    Dict-typed fields (``platform.env``) take any key."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for k in cfg:
        full = f"{prefix}{k}"
        if k not in hints:
            out.append(full)
            continue
        sub = hints[k]
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and isinstance(cfg[k], DictConfig):
            out.extend(unknown_keys(cfg[k], sub, full + "."))
    return out
