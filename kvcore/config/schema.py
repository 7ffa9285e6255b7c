"""The config schema: attrs classes for every section of an engine config, their validators and cross-field
checks (:func:`validate`), ``key`` (a documented field), the dtype names, a backend's ``kv_cache.options``
validated into its options class (:func:`structured_options`), and errors that name the full key path and what
would work.  Imports nothing of kvcore's but its errors and the kernel modes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import attrs
import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from kvcore.errors import ConfigError
from kvcore.kernels.kernel_mode import KERNEL_MODES


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
    num_nextn_predict_layers: Optional[int] = key(None, doc="multi-token-prediction (MTP) layers the checkpoint ships (config.json num_nextn_predict_layers): the draft of speculative.algorithm=nextn")


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
    swa_full_tokens_ratio: Optional[float] = key(None, doc="hybrid sliding-window models: window-layer tokens per full-attention token; default: the family's (SGLang's: 0.8, DeepSeek-V4 0.1)")
    budget_gib: Optional[float] = key(None, validator=positive, doc="an explicit KV budget in GiB, replacing the memory arithmetic")
    unified: bool = key(False, doc="hybrid models: one memory shared by the full-attention tokens and the per-request state (or sliding-window tokens), each growing from one end, instead of split pools of fixed sizes; `kvcore plan` prints what it holds and `kvcore up` builds it (kvcore_unified); not with a speculative draft")

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.swa_full_tokens_ratio is not None and not self.swa_full_tokens_ratio > 0.0:
            raise ValueError(f"swa_full_tokens_ratio must be positive (window-layer tokens per full-attention token; "
                             f"SGLang's default 0.8), got {self.swa_full_tokens_ratio}")  # fmt: skip


@attrs.define
class ParallelConfig:
    """How the model is split over devices; pools are sized per rank."""

    tp_size: int = key(1, validator=positive, doc="tensor-parallel ranks (KV heads are split over them)")
    pp_size: int = key(1, validator=positive, doc="pipeline stages (layers are split over them)")
    pp_rank: int = key(0, doc="this process's pipeline stage")
    dp_size: int = key(1, validator=positive, doc="data-parallel workers sharing memory.max_running_requests")
    cp_size: int = key(1, validator=positive, doc="context-parallel ranks of a prefill worker (SGLang's attention CP): they hold the same weights and split a prompt's tokens; a DSA model's KV and indexer layers are sharded over them (SGLang's layer split: each rank stores its ceil(layers / cp_size) layers and one scratch layer it receives the others' into), other pools are kept whole on every rank")
    cp_rank: int = key(0, doc="this process's context-parallel rank (under torch.distributed: from the rank)")


SPECULATIVE_ALGORITHMS = ("none", "eagle", "eagle3", "nextn", "standalone")


@attrs.define
class SpeculativeConfig:
    """Speculative decoding (SGLang's ``--speculative-*`` arguments): a draft model proposes tokens the target
    verifies.  The draft worker shares the target's request table and token slots and keeps its own KV pool for
    its own layers; the target's pools reserve what drafting needs (extra context per request, per-draft-token
    recurrent states, the draft's bytes per token in the budget)."""

    algorithm: str = key("none", validator=_one_of(*SPECULATIVE_ALGORITHMS), doc="none, eagle, eagle3, standalone (a draft model: speculative.draft_model) or nextn (the target's own multi-token-prediction layers, model.num_nextn_predict_layers)")
    num_draft_tokens: int = key(4, validator=positive, doc="tokens the draft proposes per step (SGLang's speculative_num_draft_tokens): extra context per request, and per running request the intermediate states of recurrent layers")
    eagle_topk: int = key(1, validator=positive, doc="branches kept per draft step (SGLang's speculative_eagle_topk)")
    draft_model: Optional[str] = key(None, doc="the draft's model: a shipped model name (configs/model/) or hf:PATH; for eagle, eagle3 and standalone")

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"


DISAGGREGATION_MODES = ("null", "prefill", "decode")


@attrs.define
class DisaggregationConfig:
    """Prefill/decode disaggregation (SGLang's ``--disaggregation-*`` arguments): a prefill worker computes the
    KV of a prompt and a decode worker receives it (:mod:`kvcore.transfer`)."""

    mode: str = key("null", validator=_one_of(*DISAGGREGATION_MODES), doc="null (one worker does both), prefill or decode; both worker modes keep freed slots sorted (the allocators' need_sort)")
    decode_extra_slots: Optional[int] = key(None, doc="decode mode: request-table rows beyond memory.max_running_requests for requests whose KV is still arriving (SGLang's disaggregation_decode_extra_slots; unset: twice the requests of a worker serving at most 32, else 0)")


@attrs.define
class EngineConfig:
    """The whole configuration: one section per concern."""

    model: ModelConfig = key(factory=ModelConfig, doc="the model's dimensions")
    hardware: HardwareConfig = key(factory=HardwareConfig, doc="the device profile")
    kv_cache: KVCacheConfig = key(factory=KVCacheConfig, doc="the cache")
    memory: MemoryConfig = key(factory=MemoryConfig, doc="the memory budget")
    parallel: ParallelConfig = key(factory=ParallelConfig, doc="the parallel layout")
    speculative: SpeculativeConfig = key(factory=SpeculativeConfig, doc="speculative decoding (a draft worker beside the target)")
    disaggregation: DisaggregationConfig = key(factory=DisaggregationConfig, doc="prefill/decode disaggregation")

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
    if not 0 <= p.cp_rank < p.cp_size:
        raise ConfigError(f"parallel.cp_rank={p.cp_rank} must be in [0, parallel.cp_size={p.cp_size})")
    if cfg.hardware.device not in ("cpu", "cuda"):
        raise ConfigError(f"hardware.device={cfg.hardware.device!r} is not one of: cpu, cuda")
    _ = cfg.model_dtype, cfg.kv_dtype, cfg.weight_bytes_per_rank  # names errors for unknown dtypes
    spec = cfg.speculative
    if spec.algorithm == "nextn":
        if not m.num_nextn_predict_layers:
            raise ConfigError(
                f"speculative.algorithm=nextn drafts with the model's own multi-token-prediction layers, and model "
                f"{m.name!r} declares none (model.num_nextn_predict_layers={m.num_nextn_predict_layers}): set it from "
                "config.json's num_nextn_predict_layers, or use speculative.algorithm=eagle3 with speculative.draft_model"
            )
        if spec.draft_model is not None:
            raise ConfigError(f"speculative.draft_model={spec.draft_model!r} is not used by speculative.algorithm=nextn "
                              "(the draft is the target's own MTP layers): leave it unset")  # fmt: skip
    elif spec.enabled and not spec.draft_model:
        raise ConfigError(
            f"speculative.algorithm={spec.algorithm} needs a draft model: set speculative.draft_model to a shipped "
            "model (e.g. llama-3-8b-eagle3, `kvcore config` lists them) or hf:PATH"
        )
    extra = cfg.disaggregation.decode_extra_slots
    if extra is not None and extra < 0:
        raise ConfigError(f"disaggregation.decode_extra_slots must be 0 or more, got {extra}")
    return cfg


def describe_error(exc: OmegaConfBaseException, schema: type | None = None) -> str:
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
    if default is attrs.NOTHING or isinstance(default, attrs.Factory) or default is None or default == MISSING:
        return f"; give {_a(type_name(field.type))}"
    return f"; give {_a(type_name(field.type))}, e.g. {key}={default}"


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
        problem = describe_error(exc)
    except (ValueError, TypeError) as exc:  # an attrs validator of the schema
        problem = str(exc)
    raise ConfigError(f"kv_cache.options.{problem} (backend {backend!r} takes: {valid})")


def type_name(tp: Any) -> str:
    name = getattr(tp, "__name__", None) or str(tp)
    text = str(tp).replace("typing.", "")
    if text.startswith("Optional[") or "| None" in text or "NoneType" in text:
        inner = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
        return f"{type_name(inner[0])} or null" if inner else text
    return name if name != "dict" else "mapping"
