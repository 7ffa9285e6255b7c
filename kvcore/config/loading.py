"""Loading an engine config: config groups, a defaults file, dotlist overrides, merged over the schema
(:mod:`kvcore.config.schema`) with omegaconf.

``load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", registry=...)`` composes, later winning:

1. the schema defaults;
2. the group files the defaults list of ``engine.yaml`` names (``model/<name>.yaml``,
   ``hardware/<name>.yaml``), or the ones chosen by ``model=NAME`` / ``hardware=NAME`` overrides;
3. the rest of ``engine.yaml`` (its own keys);
4. dotlist overrides (``kv_cache.page_size=16``).

Loading ends in ``OmegaConf.to_object`` so the attrs validators run; unknown keys and wrong types fail with
the full key path, and so do the checks of :func:`~kvcore.config.schema.validate`.  A group option may also be a
path to a YAML file.  A group file starting with ``# @package _global_`` is merged at the root, so it can set
other sections too (a model too large for one GPU names the ``parallel`` layout it needs; command-line
overrides still win).  Group files are searched next to the engine file first, then in the configs shipped with
kvcore.  The plugins' model sections and block formats come from the registry the caller passes
(:func:`kvcore.load_config` passes the installed plugins'): this package imports no plugin machinery.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import attrs
import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvcore.config.files import GROUPS, group_file, packaged_configs
from kvcore.config.schema import DTYPE_ALIASES, EngineConfig, describe_error, engine_schema, validate
from kvcore.errors import ConfigError


def _is_global_package(path: Path) -> bool:
    """A group file whose first line is ``# @package _global_`` is merged at the root (Hydra's convention):
    a model file can then carry the parallel layout it needs, e.g. ``parallel: {tp_size: 8}``."""
    with open(path, encoding="utf-8") as f:
        return f.readline().strip().replace(" ", "") == "#@package_global_"


def _load_yaml(path: Path) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{line}: {problem}") from None
    except PermissionError:
        raise ConfigError(f"cannot read config file {path}: permission denied; make it readable (chmod +r)") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; give the path of an engine YAML file") from None
    except (OSError, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping at top level, not a {type(loaded).__name__}")
    if len(loaded) == 0:
        raise ConfigError(f"config file {path} is empty: give it keys (e.g. `kv_cache: {{page_size: 16}}`) or leave it out")
    return loaded


def _split_defaults(engine: DictConfig, engine_file: Path) -> tuple[dict[str, str], DictConfig]:
    defaults = engine.get("defaults", [])
    chosen: dict[str, str] = {}
    for item in defaults or []:
        if not isinstance(item, DictConfig) or len(item) != 1:
            raise ConfigError(f"{engine_file}: every defaults entry must be a single 'group: option' mapping")
        ((group, option),) = item.items()
        if group not in GROUPS:
            raise ConfigError(f"{engine_file}: defaults names group {group!r}; valid groups: {', '.join(GROUPS)}")
        chosen[str(group)] = str(option)
    for group in GROUPS:  # `model: tiny-mla` in the file's body chooses a group option, as model=tiny-mla does
        if group in engine and isinstance(engine[group], str):
            chosen[group] = str(engine[group])
    body = OmegaConf.masked_copy(engine, [k for k in engine.keys() if k != "defaults" and k not in chosen
                                          or (k in GROUPS and not isinstance(engine[k], str))])  # fmt: skip
    return chosen, body


def load_config(*overrides: str, path: str | Path | None = None, registry) -> EngineConfig:
    """Compose and validate an :class:`EngineConfig`.

    :param overrides: ``group=option`` choices (``model=llama-3-8b``) and dotlist overrides
        (``kv_cache.page_size=16``).
    :param path: the engine YAML (default: the ``engine.yaml`` shipped with kvcore).
    :param registry: the plugins whose model sections the schema includes and whose block formats
        ``kv_cache.dtype`` may name (a :class:`~kvcore.plugins.Registry`; :func:`kvcore.load_config` passes the
        installed plugins').
    :raises ConfigError: naming the full key path of whatever is wrong.
    """
    schema = engine_schema(registry.model_sections)
    engine_file = Path(path) if path is not None else packaged_configs() / "engine.yaml"
    engine = _load_yaml(engine_file)
    chosen, body = _split_defaults(engine, engine_file)
    packaged = packaged_configs() / "engine.yaml"
    if engine_file.resolve() != packaged.resolve():
        # Groups a custom engine file leaves out default to the shipped engine.yaml's choices.
        chosen = {**_split_defaults(_load_yaml(packaged), packaged)[0], **chosen}

    dotlist: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. model=llama-3-8b, kv_cache.page_size=16)")
        key, value = item.split("=", 1)
        if key in GROUPS:
            chosen[key] = value
        else:
            _check_not_a_section(schema, key, value)
            dotlist.append(item)
    for key in body.keys():
        if not isinstance(body[key], DictConfig) and not OmegaConf.is_missing(body, key):
            _check_not_a_section(schema, str(key), body[key], where=f"{engine_file}: ")

    try:
        merged = OmegaConf.structured(schema)
        for group in GROUPS:
            if group in chosen:
                merged = OmegaConf.merge(merged, _group_keys(group, chosen[group], engine_file))
        merged = OmegaConf.merge(merged, body, OmegaConf.from_dotlist(dotlist))
        sections = {field.name: _to_object(merged[field.name], field.name) for field in attrs.fields(schema)}
    except OmegaConfBaseException as exc:
        raise ConfigError(describe_error(exc, schema)) from None
    cfg = validate(schema(**sections))
    if cfg.kv_format is not None and cfg.kv_format not in registry.kv_formats:
        formats = f"; block formats: {', '.join(registry.kv_formats)}" if registry.kv_formats else ""
        raise ConfigError(
            f"kv_cache.dtype={cfg.kv_cache.dtype!r} is neither a dtype nor a block format a plugin serves; use one "
            f"of: {', '.join(DTYPE_ALIASES)}{formats}"
        )
    return cfg


def load_model(option: str, *, registry, engine_file: str | Path | None = None) -> Any:
    """The model section a ``model=`` option names (a shipped model file, or ``hf:PATH``), validated against the
    schema with the registry's model sections: what a draft model of speculative decoding is read with.  A
    global-package model file's other sections (its page size, parallel layout) are not taken.

    :raises ConfigError: naming the option and what is wrong.
    """
    schema = engine_schema(registry.model_sections)
    engine_file = Path(engine_file) if engine_file is not None else packaged_configs() / "engine.yaml"
    try:
        keys = _group_keys("model", option, engine_file)
        merged = OmegaConf.merge(OmegaConf.structured(schema), {"model": keys["model"]})
        return _to_object(merged["model"], "model")
    except OmegaConfBaseException as exc:
        raise ConfigError(describe_error(exc, schema)) from None


def _group_keys(group: str, option: str, engine_file: Path) -> Any:
    """The config keys a ``group=option`` choice sets, rooted at the top level: a group file's keys under
    ``group`` (a global-package file's as they are: it may set other sections too), or, for ``model=hf:PATH``, a
    Hugging Face checkpoint's config.json converted to a model file's keys (:mod:`kvcore.config.hf`)."""
    if group == "model" and option.startswith("hf:"):
        from kvcore.config.hf import hf_model_config

        return {group: hf_model_config(option)}
    path = group_file(group, option, engine_file)
    group_cfg = _load_yaml(path)
    return group_cfg if _is_global_package(path) else {group: group_cfg}


def _check_not_a_section(schema: type, key: str, value: Any, where: str = "") -> None:
    """A section (``kv_cache``, ``memory``, ...) given one value instead of its keys: say which keys it has.  (The
    ``model`` and ``hardware`` groups take an option's name and never get here.)"""
    section = typing.get_type_hints(schema).get(key)
    if section is None or not attrs.has(section):
        return
    fields = attrs.fields(section)
    example = next((f"{key}.{f.name}={f.default}" for f in fields
                    if not isinstance(f.default, attrs.Factory) and f.default not in (None, MISSING)), None)  # fmt: skip
    raise ConfigError(
        f"{where}{key}={value!r}: {key} is a section of keys, not a value; set one of its keys "
        f"({', '.join(f.name for f in fields)}){f', e.g. {example}' if example else ''} (`kvcore config` lists every key)"
    )


def _to_object(node: DictConfig, path: str) -> Any:
    """``OmegaConf.to_object(node)``, with an attrs validator's error prefixed by the full key path: the
    validator names only its own field, so a failing nested section (``model.mla``) is found and named."""
    try:
        return OmegaConf.to_object(node)
    except (ValueError, TypeError) as exc:
        for name in node.keys():
            child = node._get_node(name)
            if isinstance(child, DictConfig) and not child._is_none():
                _to_object(child, f"{path}.{name}")  # raises with the deeper path if the error is in there
        raise ConfigError(f"{path}.{exc}") from None


def to_yaml(cfg: EngineConfig) -> str:
    """The resolved config as YAML (for reports and reproducing a run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
