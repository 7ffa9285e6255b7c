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

import math
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import attrs
import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

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


def _positive(instance, attribute, value) -> None:
    if value is not None and value != MISSING and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.define
class ModelConfig:
    """A model's attention dimensions, from its ``config.json``; one YAML file per model under ``model/``."""

    name: str = MISSING
    architecture: str = MISSING
    attention: str = "mha"
    num_hidden_layers: int = attrs.field(default=MISSING, validator=_positive)
    num_attention_heads: int = attrs.field(default=MISSING, validator=_positive)
    num_key_value_heads: int = attrs.field(default=MISSING, validator=_positive)
    head_dim: int = attrs.field(default=MISSING, validator=_positive)
    v_head_dim: Optional[int] = attrs.field(default=None, validator=_positive)
    hidden_size: int = attrs.field(default=MISSING, validator=_positive)
    context_length: int = attrs.field(default=MISSING, validator=_positive)
    num_parameters: int = attrs.field(default=MISSING, validator=_positive)
    dtype: str = "bfloat16"
    # The checkpoint's weight dtype when it differs from the compute dtype (DeepSeek-V3 ships fp8 weights).
    weight_dtype: Optional[str] = None
    # MLA / DSA (DeepSeek latent attention); unused by MHA models.
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    index_head_dim: Optional[int] = None
    # Hybrid sliding-window attention: window length and which layers use it.
    sliding_window: Optional[int] = None
    swa_layer_ids: Optional[list[int]] = None


@attrs.define
class HardwareConfig:
    """A device profile: what ``plan`` assumes and where ``up`` allocates."""

    name: str = MISSING
    device: str = "cpu"
    vendor: str = "generic"
    memory_gib: float = attrs.field(default=MISSING, validator=_positive)
    kernels: str = attrs.field(default="auto", validator=_one_of(*KERNEL_MODES))


@attrs.define
class KVCacheConfig:
    """The cache itself: element type, page size and (optionally) an explicit backend."""

    dtype: str = "auto"
    page_size: int = attrs.field(default=1, validator=_positive)
    backend: str = "auto"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class MemoryConfig:
    """Budget knobs, with the seed configurator's meanings."""

    mem_fraction_static: float = 0.88
    max_total_tokens: Optional[int] = attrs.field(default=None, validator=_positive)
    max_running_requests: Optional[int] = attrs.field(default=None, validator=_positive)
    swa_full_tokens_ratio: float = 0.8
    budget_gib: Optional[float] = attrs.field(default=None, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")


@attrs.define
class ParallelConfig:
    tp_size: int = attrs.field(default=1, validator=_positive)
    pp_size: int = attrs.field(default=1, validator=_positive)
    pp_rank: int = 0
    dp_size: int = attrs.field(default=1, validator=_positive)


@attrs.define
class EngineConfig:
    model: ModelConfig = attrs.field(factory=ModelConfig)
    hardware: HardwareConfig = attrs.field(factory=HardwareConfig)
    kv_cache: KVCacheConfig = attrs.field(factory=KVCacheConfig)
    memory: MemoryConfig = attrs.field(factory=MemoryConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)

    # -- derived, per-rank quantities (pure functions of the config) -------------------------------------

    @property
    def model_dtype(self) -> torch.dtype:
        return parse_dtype(self.model.dtype, "model.dtype")

    @property
    def kv_dtype(self) -> torch.dtype:
        if self.kv_cache.dtype.lower() == "auto":
            return self.model_dtype
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
        """Model weights one rank holds: parameters x weight bytes / (tp x pp)."""
        weight_dtype = parse_dtype(self.model.weight_dtype, "model.weight_dtype") if self.model.weight_dtype else self.model_dtype
        total = self.model.num_parameters * weight_dtype.itemsize
        return math.ceil(total / (self.parallel.tp_size * self.parallel.pp_size))


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
    except (OSError, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
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


def load_config(*overrides: str, path: str | Path | None = None) -> EngineConfig:
    """Compose and validate an :class:`EngineConfig`.

    :param overrides: ``group=option`` choices (``model=llama-3-8b``) and dotlist overrides
        (``kv_cache.page_size=16``).
    :param path: the engine YAML (default: the ``engine.yaml`` shipped with kvcore).
    :raises ConfigError: naming the full key path of whatever is wrong.
    """
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
        merged = OmegaConf.structured(EngineConfig)
        for group in GROUPS:
            if group in chosen:
                path = _group_file(group, chosen[group], engine_file)
                group_cfg = _load_yaml(path)
                merged = OmegaConf.merge(merged, group_cfg if _is_global_package(path) else {group: group_cfg})
        merged = OmegaConf.merge(merged, body, OmegaConf.from_dotlist(dotlist))
        sections = {}
        for field in attrs.fields(EngineConfig):
            try:
                sections[field.name] = OmegaConf.to_object(merged[field.name])
            except (ValueError, TypeError) as exc:  # an attrs validator: prefix the section for the full key
                raise ConfigError(f"{field.name}.{exc}") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe_omegaconf_error(exc)) from None
    return validate(EngineConfig(**sections))


def _describe_omegaconf_error(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and not isinstance(cause, OmegaConfBaseException):
        message = f"{message}: {cause}"
    return f"{key}: {message}" if key else message


def to_yaml(cfg: EngineConfig) -> str:
    """The resolved config as YAML (for reports and reproducing a run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
