"""What :class:`kvcore.integrations.transformers.PagedKVCache` reads of a transformers model and builds for it:
its KV dimensions (:func:`model_dimensions`), the ``load_config`` overrides that describe it
(:func:`config_overrides`), the cache dtype it accepts, and the pools built through kvcore's hooks at the sizes
given (no memory planning: :func:`pools_for_model`, :func:`build_pools_at`).  Imports no transformers: it reads
configs by attribute.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.config import parse_dtype
from kvcore.errors import ConfigError, KVCoreError

__all__ = ["BACKEND", "SUPPORTED_DTYPES", "build_pools_at", "config_overrides", "model_dimensions", "pools_for_model",
           "resolve_dtype"]

#: cache dtypes :class:`PagedKVCache` accepts (fp8 is stored as uint8 by the pool).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


#: transformers layer types the cache can serve.
_FULL_ATTENTION = ("full_attention",)


#: the backend :meth:`PagedKVCache.from_model` builds (by name: its pools hand out per-layer K and V buffers)
BACKEND = "mha"


def resolve_dtype(dtype: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype of ``dtype`` (``None``/``"auto"``: the model's), one of :data:`SUPPORTED_DTYPES`."""
    if dtype is None or dtype == "auto":
        resolved = model_dtype
    elif isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = parse_dtype(dtype, "dtype")
    if resolved not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ConfigError(f"dtype={resolved} is not a supported cache dtype; use one of: {names}")
    return resolved


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def model_dimensions(config: Any) -> dict[str, int]:
    """The KV dimensions of a transformers model config: ``layers``, ``kv_heads``, ``head_dim``,
    ``context_length`` (``max_position_embeddings``, 0 when absent).

    :raises ConfigError: for layers the cache cannot serve (sliding-window, linear attention, shared KV).
    """
    cfg = _text_config(config)
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in _FULL_ATTENTION})
    if other or getattr(cfg, "kv_sharing_modes", None):
        what = ", ".join(other) if other else "shared-KV layers"
        raise ConfigError(
            f"PagedKVCache serves full-attention layers only; this model also has {what} "
            "(use transformers' DynamicCache for it)"
        )
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": int(head_dim),
        "context_length": int(getattr(cfg, "max_position_embeddings", 0) or 0),
    }


def config_overrides(model: Any) -> list[str]:
    """``load_config`` overrides that describe a transformers ``model`` to kvcore (its ``model.*`` keys), so
    :meth:`PagedKVCache.from_config` can plan for it::

        cfg = kvcore.load_config(*config_overrides(model), "kv_cache.page_size=16", "memory.max_total_tokens=8192")
        cache = PagedKVCache.from_config(cfg, model=model)
    """
    dims = model_dimensions(model.config)
    cfg = _text_config(model.config)
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
    name = getattr(model.config, "name_or_path", "") or getattr(cfg, "model_type", "") or type(model).__name__
    return [
        f"model.name={name}",
        f"model.architecture={architectures[0]}",
        "model.attention=mha",
        f"model.num_hidden_layers={dims['layers']}",
        f"model.num_attention_heads={int(cfg.num_attention_heads)}",
        f"model.num_key_value_heads={dims['kv_heads']}",
        f"model.head_dim={dims['head_dim']}",
        "model.v_head_dim=null",
        f"model.hidden_size={int(cfg.hidden_size)}",
        f"model.context_length={dims['context_length'] or 4096}",
        f"model.num_parameters={int(model.num_parameters())}",
        f"model.dtype={dtype}",
        "model.weight_dtype=null",
        "model.weight_bytes=null",
    ]


def build_pools_at(request: Any, *, size: int, requests: int, max_context_len: int, need_sort: bool, registry: Any):
    """``(pool, allocator, request table)`` for ``request`` (which names the backend), built through the hooks
    :func:`kvcore.build_pools` calls, with ``size`` tokens and ``requests`` request slots (no memory planning)."""
    from kvcore.errors import PluginError
    from kvcore.layout import PoolLayout
    from kvcore.plugins import get_registry
    from kvcore.plugins.selection import select_backend

    registry = registry or get_registry()
    try:
        backend = select_backend(registry, request).backend
    except KVCoreError as exc:
        raise type(exc)(f"PagedKVCache builds kvcore's {request.backend!r} backend: {exc}") from exc
    request = backend.resolve(request)
    hook = registry.hook
    layout = hook.kvcore_buffer_layout(backend=backend, request=request)
    if not isinstance(layout, PoolLayout):
        raise PluginError(f"plugin {backend.plugin!r}: the buffer layout of backend {backend.name!r} is "
                          f"{type(layout).__name__}, expected kvcore.layout.PoolLayout")  # fmt: skip
    other = sorted(set(layout.groups) - {"tokens"})
    if other:
        raise ConfigError(f"backend {backend.name!r} sizes buffers by {', '.join(other)}; PagedKVCache sizes tokens only")
    sizes = {"tokens": size}
    pool = hook.kvcore_create_pool(backend=backend, request=request, layout=layout, sizes=sizes)
    req_to_token_pool = hook.kvcore_create_req_to_token_pool(
        backend=backend, request=request, size=requests, max_context_len=max_context_len, sizes=sizes, pool=pool
    )
    if need_sort:
        from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

        if request.page_size == 1:
            allocator = TokenToKVPoolAllocator(size, request.kv_dtype, request.device, pool, True, request.kernels)
        else:
            allocator = PagedTokenToKVPoolAllocator(size, request.page_size, request.kv_dtype, request.device, pool,
                                                    True, request.kernels)  # fmt: skip
    else:
        allocator = hook.kvcore_choose_allocator(backend=backend, request=request, pool=pool, sizes=sizes)
    for what, value in (("pool", pool), ("allocator", allocator), ("request pool", req_to_token_pool)):
        if value is None:
            raise PluginError(f"no plugin created the {what} for backend {backend.name!r}")
    return pool, allocator, req_to_token_pool


def pools_for_model(model: Any, *, max_total_tokens: int, page_size: int, dtype: Any, max_batch_size: int,
                    max_context_len: int | None, device: Any, kernels: str, need_sort: bool, registry: Any):
    """``(pool, allocator, request table)`` of the ``mha`` backend for every layer of ``model`` (anything with
    ``.config``), at the sizes ``PagedKVCache.from_model`` documents for the same arguments: whole pages of
    ``max_total_tokens``, ``max_batch_size`` request slots, rows of ``max_context_len`` tokens (default: the model's
    context, at most the pool's size)."""
    import kvcore

    dims = model_dimensions(model.config)
    model_dtype = getattr(model, "dtype", None) or torch.float32
    cache_dtype = resolve_dtype(dtype, model_dtype)
    device = torch.device(device if device is not None else getattr(model, "device", "cpu"))
    page_size = int(page_size)
    if page_size <= 0:
        raise ConfigError(f"page_size must be positive, got {page_size}")
    size = int(max_total_tokens) // page_size * page_size
    if size <= 0:
        raise ConfigError(f"max_total_tokens={max_total_tokens} holds no whole page of page_size={page_size}")
    if max_context_len is None:
        max_context_len = min(dims["context_length"] or size, size)
    request = kvcore.PoolRequest(
        attention="mha", kv_dtype=cache_dtype, model_dtype=model_dtype, device=str(device), vendor="generic",
        page_size=page_size, layer_num=dims["layers"], start_layer=0, end_layer=dims["layers"] - 1,
        head_num=dims["kv_heads"], head_dim=dims["head_dim"], v_head_dim=dims["head_dim"], kernels=kernels,
        backend=BACKEND, model_name=getattr(model.config, "name_or_path", "") or type(model).__name__,
    )  # fmt: skip
    return build_pools_at(request, size=size, requests=int(max_batch_size), max_context_len=int(max_context_len),
                          need_sort=need_sort, registry=registry)  # fmt: skip
