"""Config schema (attrs) and loading (omegaconf): config groups, a defaults file, dotlist overrides.

``load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8")`` composes, later winning:

1. the schema defaults below;
2. the group files the defaults list of ``engine.yaml`` names (``model/<name>.yaml``,
   ``hardware/<name>.yaml``), or the ones chosen by ``model=NAME`` / ``hardware=NAME`` overrides;
3. the rest of ``engine.yaml`` (its own keys);
4. dotlist overrides (``kv_cache.page_size=16``).

Loading ends in ``OmegaConf.to_object`` so the attrs validators run; unknown keys and wrong types fail with
the full key path, and so do the checks below.  A group option may also be a path to a YAML file.  A group
file starting with ``# @package _global_`` is merged at the root, so it can set other sections too (a model
too large for one GPU names the ``parallel`` layout it needs; command-line overrides still win).
Group files are searched next to the engine file first, then in the configs shipped with kvcore.
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import attrs
import torch
import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from kvcore.errors import ConfigError
from kvcore.kernel_mode import KERNEL_MODES

GROUPS = ("model", "hardware")

# Names accepted for ``kv_cache.dtype`` and ``model.dtype``.
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
}


def parse_dtype(name: str, key: str) -> torch.dtype:
    """Resolve a dtype name from the config; the error names ``key`` and the valid names."""
    try:
        return DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ConfigError(f"{key}={name!r} is not a known dtype; use one of: {', '.join(DTYPE_ALIASES)}") from None


def _one_of(*options: str):
    def check(instance, attribute, value) -> None:
        if value not in options:
            raise ValueError(f"{attribute.name}={value!r} is not one of: {', '.join(options)}")

    return check


def positive(instance, attribute, value) -> None:
    """attrs validator: None, MISSING or a positive number (the error names the key)."""
    if value is not None and value != MISSING and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def key(default: Any = MISSING, doc: str = "", **kwargs) -> Any:
    """A config field with its documentation: every key of the schema says what it means (``kvcore config``
    prints them all).  Plugins declaring model sections and backend options document their keys the same way.
    ``factory=`` replaces ``default``."""
    if "factory" in kwargs:
        return attrs.field(metadata={"doc": doc}, **kwargs)
    return attrs.field(default=default, metadata={"doc": doc}, **kwargs)


@attrs.define
class ModelConfig:
    """A model's attention dimensions, from its ``config.json``; one YAML file per model under ``model/``.

    Only what every family shares lives here.  A family's own dimensions (MLA's latent ranks, DSA's indexer,
    ...) are sections its plugin declares (``BackendSpec.model_sections``), written ``model.<section>.<key>``;
    :func:`load_config` adds them to this schema.
    """

    name: str = key(doc="the model's name (its file under configs/model/)")
    architecture: str = key(doc="config.json's architecture (e.g. LlamaForCausalLM), for reports")
    attention: str = key("mha", doc="the attention family; selects the backends that can serve the model (mha, mla, dsa, ...)")
    num_hidden_layers: int = key(validator=positive, doc="transformer layers (config.json num_hidden_layers)")
    num_attention_heads: int = key(validator=positive, doc="query heads (config.json num_attention_heads)")
    num_key_value_heads: int = key(validator=positive, doc="key/value heads (config.json num_key_value_heads; = query heads without GQA)")
    head_dim: int = key(validator=positive, doc="width of one query/key head (config.json head_dim, or hidden_size / num_attention_heads)")
    v_head_dim: Optional[int] = key(None, validator=positive, doc="width of one value head when it differs from head_dim")
    hidden_size: int = key(validator=positive, doc="the model's hidden size (config.json hidden_size)")
    context_length: int = key(validator=positive, doc="longest sequence (config.json max_position_embeddings); sizes the request table")
    num_parameters: int = key(validator=positive, doc="parameter count; weights per rank are charged against the memory budget")
    dtype: str = key("bfloat16", doc="compute dtype; kv_cache.dtype=auto follows it")
    weight_dtype: Optional[str] = key(None, doc="the checkpoint's weight dtype when it differs from dtype (DeepSeek-V3 ships fp8 weights)")
    weight_bytes: Optional[int] = key(None, validator=positive, doc="the checkpoint's weight bytes, for mixed-precision checkpoints (gpt-oss's MXFP4 experts); replaces num_parameters x the weight dtype's bytes")


@attrs.define
class HardwareConfig:
    """A device profile: what ``plan`` assumes and where ``up`` allocates."""

    name: str = key(doc="the profile's name (its file under configs/hardware/)")
    device: str = key("cpu", doc="where pools are allocated: cpu or cuda")
    vendor: str = key("generic", doc="hardware vendor; a backend that names it wins over generic ones")
    memory_gib: float = key(validator=positive, doc="device memory in GiB, before the model loads (an engine may pass what it profiled instead)")
    kernels: str = key("auto", validator=_one_of(*KERNEL_MODES), doc="hot-path kernels: auto (Triton on CUDA, torch on the CPU), triton or native (torch)")
    checked: bool = key(False, doc="check every pool and allocator call before it runs (ranges, padding, double frees; slow: for debugging); KVCORE_CHECKED=1 does the same")


@attrs.define
class KVCacheConfig:
    """The cache itself: element type, page size and (optionally) an explicit backend."""

    dtype: str = key("auto", doc="cache dtype: auto (model.dtype), bfloat16, float16, float32, float8_e4m3fn, float8_e5m2 (fp8 is stored as uint8), or a block-scaled format a plugin serves (fp4_e2m1, nvfp4, mxfp8)")
    page_size: int = key(1, validator=positive, doc="tokens per page; 1 uses the token allocator, more the paged one")
    backend: str = key("auto", doc="auto (the best matching backend), or a backend name from `kvcore plugins`")
    layout: str = key("token_major", validator=_one_of("token_major", "page_major"),
                      doc="token_major (a stacked buffer per K/V: [layers, tokens, heads, dim]) or page_major (one buffer "
                      "whose unit is a page of all layers, moved and offloaded whole; backends that declare it)")
    options: dict[str, Any] = key(factory=dict, doc="the selected backend's own options (kv_cache.options.<name>; `kvcore config` lists each backend's)")


@attrs.define
class MemoryConfig:
    """Budget knobs, with the meanings of SGLang's KV-cache configurator."""

    mem_fraction_static: float = key(0.88, doc="share of device memory for weights + KV cache; the rest is runtime slack")
    max_total_tokens: Optional[int] = key(None, validator=positive, doc="cap on the KV pool's tokens (a warning when it exceeds what fits)")
    max_running_requests: Optional[int] = key(None, validator=positive, doc="cap on concurrent requests, over all data-parallel workers")
    swa_full_tokens_ratio: float = key(0.8, doc="hybrid sliding-window models: window-layer tokens per full-attention token")
    budget_gib: Optional[float] = key(None, validator=positive, doc="an explicit KV budget in GiB, replacing the memory arithmetic")

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")


@attrs.define
class ParallelConfig:
    """How the model is split over devices; pools are sized per rank."""

    tp_size: int = key(1, validator=positive, doc="tensor-parallel ranks (KV heads are split over them)")
    pp_size: int = key(1, validator=positive, doc="pipeline stages (layers are split over them)")
    pp_rank: int = key(0, doc="this process's pipeline stage")
    dp_size: int = key(1, validator=positive, doc="data-parallel workers sharing memory.max_running_requests")


@attrs.define
class EngineConfig:
    """The whole configuration: one section per concern."""

    model: ModelConfig = key(factory=ModelConfig, doc="the model's dimensions")
    hardware: HardwareConfig = key(factory=HardwareConfig, doc="the device profile")
    kv_cache: KVCacheConfig = key(factory=KVCacheConfig, doc="the cache")
    memory: MemoryConfig = key(factory=MemoryConfig, doc="the memory budget")
    parallel: ParallelConfig = key(factory=ParallelConfig, doc="the parallel layout")

    # -- derived, per-rank quantities (pure functions of the config) -------------------------------------

    @property
    def model_dtype(self) -> torch.dtype:
        return parse_dtype(self.model.dtype, "model.dtype")

    @property
    def kv_format(self) -> str | None:
        """The block-scaled format named by ``kv_cache.dtype`` (``fp4_e2m1``, ...: what a plugin's backends
        declare in ``kv_formats``), or None for a plain dtype."""
        name = self.kv_cache.dtype.lower()
        return None if name == "auto" or name in DTYPE_ALIASES else name

    @property
    def kv_dtype(self) -> torch.dtype:
        """The cache's element dtype; ``torch.uint8`` (bytes) for a block-scaled format."""
        if self.kv_cache.dtype.lower() == "auto":
            return self.model_dtype
        if self.kv_format is not None:
            return torch.uint8
        return parse_dtype(self.kv_cache.dtype, "kv_cache.dtype")

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads one tensor-parallel rank stores (heads are replicated when tp exceeds them)."""
        return max(1, self.model.num_key_value_heads // self.parallel.tp_size)

    @property
    def layer_range(self) -> tuple[int, int]:
        """``(start_layer, end_layer)`` (end exclusive) of this pipeline rank, split as evenly as possible."""
        layers, pp, rank = self.model.num_hidden_layers, self.parallel.pp_size, self.parallel.pp_rank
        base, extra = divmod(layers, pp)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    @property
    def weight_bytes_per_rank(self) -> int:
        """Model weights one rank holds: ``model.weight_bytes`` (or parameters x weight dtype bytes) / (tp x pp)."""
        weight_dtype = parse_dtype(self.model.weight_dtype, "model.weight_dtype") if self.model.weight_dtype else self.model_dtype
        total = self.model.weight_bytes or self.model.num_parameters * weight_dtype.itemsize
        return math.ceil(total / (self.parallel.tp_size * self.parallel.pp_size))


@functools.lru_cache(maxsize=64)
def engine_schema(model_sections: tuple[tuple[str, type], ...] = ()) -> type[EngineConfig]:
    """:class:`EngineConfig` with the plugins' model sections added to ``model`` (each ``Optional``, None when a
    model file leaves it out), so loading validates them like every other key.

    :param model_sections: ``(name, attrs class)`` pairs, sorted by name (the registry's
        :attr:`~kvcore.plugins.Registry.model_sections`).
    """
    if not model_sections:
        return EngineConfig
    fields = {
        name: attrs.field(default=None, type=Optional[schema], metadata={"doc": (schema.__doc__ or "").strip().splitlines()[0]})
        for name, schema in model_sections
    }
    model = attrs.make_class("ModelConfig", fields, bases=(ModelConfig,))
    model.__doc__ = ModelConfig.__doc__
    engine = attrs.make_class(
        "EngineConfig",
        {"model": attrs.field(factory=model, type=model, metadata={"doc": "the model's dimensions"})},
        bases=(EngineConfig,),
    )
    engine.__doc__ = EngineConfig.__doc__
    return engine


def validate(cfg: EngineConfig) -> EngineConfig:
    """Cross-field checks; every error names the key to change."""
    m, p = cfg.model, cfg.parallel
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
            f"model.num_key_value_heads={m.num_key_value_heads}"
        )
    kv = m.num_key_value_heads
    if m.num_attention_heads % p.tp_size:
        raise ConfigError(
            f"parallel.tp_size={p.tp_size} does not divide model.num_attention_heads={m.num_attention_heads}; "
            f"use a divisor of {m.num_attention_heads}"
        )
    if (kv >= p.tp_size and kv % p.tp_size) or (kv < p.tp_size and p.tp_size % kv):
        raise ConfigError(
            f"parallel.tp_size={p.tp_size} cannot split model.num_key_value_heads={kv}: use a divisor or a multiple of {kv}"
        )
    if p.pp_size > m.num_hidden_layers:
        raise ConfigError(f"parallel.pp_size={p.pp_size} exceeds model.num_hidden_layers={m.num_hidden_layers}")
    if not 0 <= p.pp_rank < p.pp_size:
        raise ConfigError(f"parallel.pp_rank={p.pp_rank} must be in [0, parallel.pp_size={p.pp_size})")
    if cfg.hardware.device not in ("cpu", "cuda"):
        raise ConfigError(f"hardware.device={cfg.hardware.device!r} is not one of: cpu, cuda")
    _ = cfg.model_dtype, cfg.kv_dtype, cfg.weight_bytes_per_rank  # names errors for unknown dtypes
    return cfg


# -- loading -----------------------------------------------------------------------------------------------


def packaged_configs() -> Path:
    """The configs directory shipped with kvcore."""
    return Path(str(resources.files("kvcore.configs")))


def _group_dirs(group: str, engine_file: Path) -> list[Path]:
    dirs = [engine_file.parent / group, packaged_configs() / group]
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def available_options(group: str, engine_file: Path | None = None) -> list[str]:
    """Option names of a config group (``model`` or ``hardware``)."""
    engine_file = engine_file or packaged_configs() / "engine.yaml"
    names = {p.stem for d in _group_dirs(group, engine_file) if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names)


def _group_file(group: str, option: str, engine_file: Path) -> Path:
    candidate = Path(option)
    if candidate.suffix in (".yaml", ".yml"):
        for path in (candidate, engine_file.parent / candidate):
            if path.is_file():
                return path
    for d in _group_dirs(group, engine_file):
        path = d / f"{option}.yaml"
        if path.is_file():
            return path
    raise ConfigError(
        f"{group}={option!r} is not a known {group} config; "
        f"valid options: {', '.join(available_options(group, engine_file))} (or a path to a .yaml file)"
    )


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
    body = OmegaConf.masked_copy(engine, [k for k in engine.keys() if k != "defaults"])
    return chosen, body


def load_config(*overrides: str, path: str | Path | None = None, registry=None) -> EngineConfig:
    """Compose and validate an :class:`EngineConfig`.

    :param overrides: ``group=option`` choices (``model=llama-3-8b``) and dotlist overrides
        (``kv_cache.page_size=16``).
    :param path: the engine YAML (default: the ``engine.yaml`` shipped with kvcore).
    :param registry: the plugins whose model sections the schema includes (default: the installed ones).
    :raises ConfigError: naming the full key path of whatever is wrong.
    """
    if registry is None:
        from kvcore.plugins import get_registry

        registry = get_registry()
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
            dotlist.append(item)

    try:
        merged = OmegaConf.structured(schema)
        for group in GROUPS:
            if group == "model" and chosen.get(group, "").startswith("hf:"):
                # a Hugging Face checkpoint's config.json, converted to a model file's keys (kvcore/hf.py)
                from kvcore.hf import hf_model_config

                merged = OmegaConf.merge(merged, {group: hf_model_config(chosen[group])})
            elif group in chosen:
                path = _group_file(group, chosen[group], engine_file)
                group_cfg = _load_yaml(path)
                merged = OmegaConf.merge(merged, group_cfg if _is_global_package(path) else {group: group_cfg})
        merged = OmegaConf.merge(merged, body, OmegaConf.from_dotlist(dotlist))
        sections = {field.name: _to_object(merged[field.name], field.name) for field in attrs.fields(schema)}
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe_omegaconf_error(exc, schema)) from None
    cfg = validate(schema(**sections))
    if cfg.kv_format is not None and cfg.kv_format not in registry.kv_formats:
        formats = f"; block formats: {', '.join(registry.kv_formats)}" if registry.kv_formats else ""
        raise ConfigError(
            f"kv_cache.dtype={cfg.kv_cache.dtype!r} is neither a dtype nor a block format a plugin serves; use one "
            f"of: {', '.join(DTYPE_ALIASES)}{formats}"
        )
    return cfg


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


def _describe_omegaconf_error(exc: OmegaConfBaseException, schema: type | None = None) -> str:
    """OmegaConf's error with the key it is about and, where the schema knows one, what would work: the keys
    valid at that level for an unknown key, the expected type and the default for a value of the wrong type."""
    key = getattr(exc, "full_key", None)
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and not isinstance(cause, OmegaConfBaseException):
        message = f"{message}: {cause}"
    hint = _hint(schema, str(key), isinstance(exc, ConfigKeyError)) if key and schema is not None else ""
    return (f"{key}: {message}" if key else message) + hint


def _hint(schema: type, key: str, unknown: bool) -> str:
    """``; valid keys here: ...`` for an unknown key, ``; give a <type>, e.g. key=<default>`` for a bad value."""
    parts = key.split(".")
    level: Any = schema
    for part in parts[:-1]:
        fields = {f.name: f for f in attrs.fields(level)} if attrs.has(level) else {}
        if part not in fields or not attrs.has(_resolve_type(fields[part].type)):
            return ""
        level = _resolve_type(fields[part].type)
    if not attrs.has(level):
        return ""
    fields = {f.name: f for f in attrs.fields(level)}
    if unknown or parts[-1] not in fields:
        where = ".".join(parts[:-1]) or "the top level"
        return f"; valid keys at {where}: {', '.join(fields)} (`kvcore config` lists every key)"
    field = fields[parts[-1]]
    default = field.default
    if default is attrs.NOTHING or isinstance(default, attrs.Factory) or default is None:
        return f"; give {_a(_type_name(field.type))}"
    return f"; give {_a(_type_name(field.type))}, e.g. {key}={default}"


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _resolve_type(annotation: Any) -> Any:
    """An attrs field's type, with ``Optional[X]`` unwrapped (strings are looked up in this module)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, globals())  # noqa: S307 - the schema's own annotations
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return args[0] if len(args) == 1 else annotation


def structured_options(schema: type | None, raw: Any, backend: str) -> Any:
    """``kv_cache.options`` validated into a backend's options class (an instance of ``schema``), or None for a
    backend that takes no options.

    :raises ConfigError: naming ``kv_cache.options.<key>``, the backend and the options it takes.
    """
    if schema is not None and isinstance(raw, schema):
        return raw
    raw = dict(raw or {})
    if schema is None:
        if raw:
            raise ConfigError(
                f"kv_cache.options.{sorted(raw)[0]} is not an option of backend {backend!r}, which takes none; "
                "remove it from kv_cache.options"
            )
        return None
    valid = ", ".join(f.name for f in attrs.fields(schema))
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except ConfigKeyError as exc:
        raise ConfigError(f"kv_cache.options.{exc.full_key} is not an option of backend {backend!r}; its options: {valid}") from None
    except OmegaConfBaseException as exc:
        problem = _describe_omegaconf_error(exc)
    except (ValueError, TypeError) as exc:  # an attrs validator of the schema
        problem = str(exc)
    raise ConfigError(f"kv_cache.options.{problem} (backend {backend!r} takes: {valid})")


@attrs.frozen
class KeyDoc:
    """One config key, for ``kvcore config``: its dotted path, type, default and meaning."""

    path: str
    type: str
    default: str
    doc: str


def _type_name(tp: Any) -> str:
    name = getattr(tp, "__name__", None) or str(tp)
    text = str(tp).replace("typing.", "")
    if text.startswith("Optional[") or "| None" in text or "NoneType" in text:
        inner = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
        return f"{_type_name(inner[0])} or null" if inner else text
    return name if name != "dict" else "mapping"


def _default_text(field: attrs.Attribute) -> str:
    if isinstance(field.default, attrs.Factory):
        return "{}" if field.default.factory is dict else ""
    if field.default is MISSING:
        return "required"
    return "null" if field.default is None else str(field.default)


def describe_keys(schema: type, prefix: str = "") -> list[KeyDoc]:
    """Every key of an attrs config schema, depth first: nested sections (``model.mla``) are expanded."""
    import typing

    hints = typing.get_type_hints(schema)
    keys: list[KeyDoc] = []
    for field in attrs.fields(schema):
        tp = hints.get(field.name, field.type)
        nested = [a for a in (getattr(tp, "__args__", None) or (tp,)) if isinstance(a, type) and attrs.has(a)]
        path = f"{prefix}{field.name}"
        if nested:
            keys += describe_keys(nested[0], f"{path}.")
        else:
            keys.append(KeyDoc(path, _type_name(tp), _default_text(field), field.metadata.get("doc", "")))
    return keys


def all_keys(registry=None) -> list[KeyDoc]:
    """Every key a config may set with the installed plugins: the core schema, the plugins' model sections,
    and each backend's ``kv_cache.options`` (the doc names the backend)."""
    if registry is None:
        from kvcore.plugins import get_registry

        registry = get_registry()
    keys = describe_keys(engine_schema(registry.model_sections))
    for backend in sorted(registry.backends.values(), key=lambda b: b.name):
        if backend.options_schema is not None:
            for k in describe_keys(backend.options_schema, "kv_cache.options."):
                keys.append(attrs.evolve(k, doc=f"backend {backend.name}: {k.doc}"))
    sections = [f.name for f in attrs.fields(EngineConfig)]
    return sorted(keys, key=lambda k: sections.index(k.path.split(".")[0]))  # stable: each section in order


def keys_markdown(keys: list[KeyDoc]) -> str:
    """The keys as the markdown table README.md carries (``kvcore config --markdown``)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k.path}` | {k.type} | {k.default} | {k.doc} |" for k in keys]
    return "\n".join(rows) + "\n"


def to_yaml(cfg: EngineConfig) -> str:
    """The resolved config as YAML (for reports and reproducing a run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
