"""The records plugins and the core exchange: what a backend offers, and what a model asks for.

A plugin describes each pool backend it provides as a frozen :class:`BackendSpec` (yielded from the
``kvcore_register_backends`` hook).  The core turns a loaded config into a :class:`PoolRequest` and picks the
backend whose declared capabilities match it; :func:`kvcore.plugins.selection.select_backend` explains the choice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from kvcore.errors import ConfigError
from kvcore.kernels.addresses import shared_by_copies

ANY = "*"


def _tuple_of_str(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def _dtypes(value) -> tuple[torch.dtype, ...] | None:
    if value is None:
        return None
    return tuple(value)


def _frozen_mapping(value) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@attrs.frozen(kw_only=True)
class EngineMode:
    """How the engine runs the pools, beyond the model's dimensions (SGLang's server arguments that change what
    a pool or allocator is): disaggregation, speculative decoding and the unified memory.

    :param disaggregation: ``null``, ``prefill`` or ``decode`` (``disaggregation.mode``).
    :param pre_alloc_size: decode mode: request-table rows beyond the running requests, for requests whose KV
        is still arriving (SGLang's ``DecodeReqToTokenPool``); 0 otherwise.
    :param speculative: ``speculative.algorithm`` (``none`` without a draft).
    :param num_draft_tokens: draft tokens per step when drafting (0 without a draft): recurrent families keep
        as many intermediate states per running request.
    :param eagle_topk: branches per draft step (SGLang's ``speculative_eagle_topk``).
    :param is_draft_worker: the request is the draft model's (its pool shares the target's request table and
        token slots).
    :param unified_memory: ``memory.unified``: one memory shared by a hybrid model's two kinds of state (SGLang's
        ``enable_unified_memory``), built by the plugin that answers for it.
    """

    disaggregation: str = "null"
    pre_alloc_size: int = 0
    speculative: str = "none"
    num_draft_tokens: int = 0
    eagle_topk: int = 1
    is_draft_worker: bool = False
    unified_memory: bool = False

    @property
    def need_sort(self) -> bool:
        """Allocators defer and sort freed slots in both disaggregation worker modes, as SGLang's do."""
        return self.disaggregation in ("prefill", "decode")


@attrs.frozen(kw_only=True)
class PoolRequest:
    """What the engine asks a backend to hold, for one rank; a pure function of the config.

    The core fills in what every family shares.  A family reads its own model dimensions from
    :meth:`section` (the ``model.<name>`` sections its backend declares in ``BackendSpec.model_sections``) and
    its ``kv_cache.options`` from :attr:`options`, both validated by :meth:`BackendSpec.resolve` before the
    request reaches the backend's ``layout`` and ``create_pool``.

    :param layer_num: layers of this pipeline stage, global ids ``start_layer .. end_layer``.
    :param head_num: key/value heads this tensor-parallel rank stores (replicated when tp exceeds them), with
        ``head_dim`` / ``v_head_dim``: what families with per-head rows (MHA/GQA) store; others ignore them.
    :param tp_size: the tensor-parallel size, for families that split more than ``head_num`` over the ranks
        (a sliding-window section's own head count, recurrent state).
    :param cp_size: / ``cp_rank``: the context-parallel ranks and this one (``parallel.cp_size`` / ``cp_rank``):
        a family that shards its layers over them (DSA's layer split) stores only this rank's share.
    :param kv_format: the block-scaled format ``kv_cache.dtype`` names (``kv_dtype`` is then ``torch.uint8``),
        or None for a plain dtype.
    :param layout: ``kv_cache.layout``: ``token_major`` or ``page_major`` (served by backends declaring it).
    :param options: ``kv_cache.options``: the raw mapping until the selected backend resolves the request, then
        that backend's options object (None for a backend that takes no options).
    :param sections: the model's family sections by name (objects of the declaring plugin's schema); after
        resolution, exactly the backend's declared sections.
    :param mode: the engine's disaggregation and speculative-decoding settings (:class:`EngineMode`).
    """

    __deepcopy__ = shared_by_copies

    attention: str
    kv_dtype: torch.dtype
    model_dtype: torch.dtype
    device: str
    vendor: str
    page_size: int
    layer_num: int
    start_layer: int
    end_layer: int
    head_num: int
    head_dim: int
    v_head_dim: int
    kernels: str = "auto"
    backend: str = "auto"
    model_name: str = ""
    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    kv_format: str | None = None
    layout: str = "token_major"
    options: Any = attrs.field(factory=dict, converter=lambda v: _frozen_mapping(v) if isinstance(v, Mapping) else v)
    sections: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    mode: EngineMode = attrs.field(factory=EngineMode)

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def section(self, name: str) -> Any:
        """The model section ``model.<name>`` (e.g. ``request.section("mla").kv_lora_rank``).

        :raises ConfigError: naming ``model.<name>`` when the model file does not set it.
        """
        value = self.sections.get(name)
        if value is None:
            raise ConfigError(
                f"model.{name} is not set for model {self.model_name!r} (attention={self.attention}); "
                f"add a '{name}:' section with the dimensions from the model's config.json (`kvcore config` lists its keys)"
            )
        return value

    def pool_kwargs(self) -> dict[str, Any]:
        """The constructor keywords every :class:`kvcore.pools.KVCache` shares, for this request's rank."""
        return dict(
            page_size=self.page_size,
            dtype=self.kv_dtype,
            layer_num=self.layer_num,
            device=self.device,
            enable_memory_saver=False,
            start_layer=self.start_layer,
            end_layer=self.end_layer,
            kernels=self.kernels,
        )


LayoutFn = Callable[[PoolRequest], Any]
PoolFactory = Callable[..., Any]


@attrs.frozen(kw_only=True)
class BackendSpec:
    """One pool backend a plugin provides.

    :param name: unique backend name (``kv_cache.backend`` selects it explicitly).
    :param attention: attention kinds served (``"mha"``, ``"mla"``, ...).
    :param layout: ``layout(request) -> PoolLayout``: the buffers the pool will allocate; must not allocate.
    :param create_pool: ``create_pool(request, layout, sizes) -> KVCache``: builds the pool; ``sizes`` maps
        each size group of the layout (``"tokens"``, ...) to its planned size.
    :param kv_dtypes: cache dtypes served, or None for any (plain dtypes only: block formats are ``kv_formats``).
    :param kv_formats: block-scaled formats served (``kv_cache.dtype=fp4_e2m1``, ...); none by default.
    :param devices: device types served (``"cuda"``, ``"cpu"``), or ``("*",)``.
    :param vendors: hardware vendors served; ``("*",)`` for any.  A backend naming the requested vendor
        explicitly beats a generic one.
    :param page_sizes: page sizes served, or None for any.
    :param layouts: buffer layouts served (``kv_cache.layout``): ``token_major`` by default.
    :param priority: higher wins among equally specific matches.
    :param description: one line for ``kvcore plugins``.
    :param model_sections: the ``model.<name>`` sections this backend reads, each an attrs class whose fields
        (documented with :func:`kvcore.config.key`) become config keys; a family's backends share one class.
    :param options_schema: an attrs class of this backend's ``kv_cache.options``, or None for a backend that
        takes none (then any option is an error).
    :param plugin: the registering plugin's name; filled in by the plugin manager.
    """

    __deepcopy__ = shared_by_copies

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[A-Za-z0-9_.\-]+$"))
    attention: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    layout: LayoutFn = attrs.field(validator=attrs.validators.is_callable())
    create_pool: PoolFactory = attrs.field(validator=attrs.validators.is_callable())
    kv_dtypes: tuple[torch.dtype, ...] | None = attrs.field(default=None, converter=_dtypes)
    kv_formats: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    devices: tuple[str, ...] = attrs.field(default=(ANY,), converter=_tuple_of_str)
    vendors: tuple[str, ...] = attrs.field(default=(ANY,), converter=_tuple_of_str)
    page_sizes: tuple[int, ...] | None = attrs.field(default=None)
    layouts: tuple[str, ...] = attrs.field(default=("token_major",), converter=_tuple_of_str)
    priority: int = 0
    description: str = ""
    model_sections: Mapping[str, type] = attrs.field(factory=dict, converter=_frozen_mapping)
    options_schema: type | None = None
    plugin: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.attention:
            raise ValueError(f"backend {self.name!r} declares no attention kinds")
        if self.kv_dtypes is not None and not all(isinstance(d, torch.dtype) for d in self.kv_dtypes):
            raise TypeError(f"backend {self.name!r}: kv_dtypes must be torch dtypes, got {self.kv_dtypes!r}")
        for what, schema in [*self.model_sections.items(), ("options_schema", self.options_schema)]:
            if schema is not None and not attrs.has(schema):
                raise TypeError(f"backend {self.name!r}: {what} must be an attrs class, got {schema!r}")

    def resolve(self, request: PoolRequest) -> PoolRequest:
        """``request`` as this backend reads it: its declared model sections (each required) and its options
        validated into :attr:`options_schema`.

        :raises ConfigError: naming the ``model.<section>`` or ``kv_cache.options.<key>`` to fix.
        """
        from kvcore.config import structured_options

        sections = {name: request.section(name) for name in self.model_sections}
        options = structured_options(self.options_schema, request.options, self.name)
        return attrs.evolve(request, sections=sections, options=options)

    def mismatches(self, request: PoolRequest) -> list[str]:
        """Why this backend cannot serve ``request``; empty when it can."""
        reasons = []
        if request.attention not in self.attention:
            reasons.append(f"serves attention {'/'.join(self.attention)}, model needs {request.attention}")
        if request.kv_format is not None:
            if request.kv_format not in self.kv_formats:
                served = ", ".join(self.kv_formats) or "none"
                reasons.append(f"kv format {request.kv_format} not served (block formats: {served})")
        elif self.kv_dtypes is not None and request.kv_dtype not in self.kv_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.kv_dtypes) or "none: block formats only"
            reasons.append(f"kv dtype {str(request.kv_dtype).removeprefix('torch.')} not in [{names}]")
        if ANY not in self.devices and request.device_type not in self.devices:
            reasons.append(f"device {request.device_type} not in [{', '.join(self.devices)}]")
        if ANY not in self.vendors and request.vendor not in self.vendors:
            reasons.append(f"vendor {request.vendor} not in [{', '.join(self.vendors)}]")
        if request.layout not in self.layouts:
            reasons.append(f"layout {request.layout} not served (layouts: {', '.join(self.layouts)})")
        if self.page_sizes is not None and request.page_size not in self.page_sizes:
            reasons.append(f"page size {request.page_size} not in {list(self.page_sizes)} "
                           f"(set kv_cache.page_size={self.page_sizes[0]})")
        return reasons

    def specificity(self, request: PoolRequest) -> int:
        """2 when the backend names the requested vendor, 1 for the device, else 0."""
        if request.vendor in self.vendors:
            return 2
        if request.device_type in self.devices:
            return 1
        return 0
