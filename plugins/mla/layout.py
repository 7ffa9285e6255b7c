"""The MLA pool's declared buffers; importing this needs no kernels (the planner uses it on any machine).

Multi-head latent attention (DeepSeek-V2/V3) caches one latent row per token and layer, shared by every
head and every tensor-parallel rank: the compressed KV (``kv_lora_rank`` values) followed by the decoupled
rope key (``qk_rope_head_dim`` values), e.g. 512 + 64 = 576 values for DeepSeek-V3.
"""

from __future__ import annotations

import attrs
import torch

from kvcore.config import key, positive
from kvcore.kernels.dtypes import storage_dtype
from kvcore.layout import BufferLayout, PoolLayout


@attrs.define
class MLADims:
    """Multi-head latent attention dimensions (model.mla), from the model's config.json."""

    kv_lora_rank: int = key(validator=positive, doc="width of the compressed KV (config.json kv_lora_rank), the 'nope' part of a latent row")
    qk_rope_head_dim: int = key(validator=positive, doc="width of the decoupled rope key (config.json qk_rope_head_dim), the rest of the row")
    qk_nope_head_dim: int | None = key(None, validator=positive, doc="per-head query/key width without rope (config.json qk_nope_head_dim); not cached, for reports")


def mla_row_dim(kv_lora_rank: int, qk_rope_head_dim: int, kv_cache_dim: int | None = None) -> int:
    """Elements of one latent row: ``kv_cache_dim`` when given (a family packing its own row format, such as
    DSA's fp8 rows with scales), else ``kv_lora_rank + qk_rope_head_dim``."""
    if kv_lora_rank <= 0 or qk_rope_head_dim <= 0:
        raise ValueError(f"kv_lora_rank and qk_rope_head_dim must be positive, got {kv_lora_rank}, {qk_rope_head_dim}")
    if kv_cache_dim is None:
        return kv_lora_rank + qk_rope_head_dim
    if kv_cache_dim <= 0:
        raise ValueError(f"kv_cache_dim must be positive, got {kv_cache_dim}")
    return kv_cache_dim


def mla_layout(
    *,
    backend: str,
    page_size: int,
    dtype: torch.dtype,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    layer_num: int,
    kv_cache_dim: int | None = None,
    sized_by: str = "tokens",
    name: str = "kv",
    page_major: bool = False,
) -> PoolLayout:
    """The buffers of an :class:`~kvcore_mla.pool.MLATokenToKVPool` (or, ``page_major``, of a
    :class:`~kvcore_mla.page_major.PageMajorMLATokenToKVPool`): one latent buffer ``kv``.

    :param dtype: the cache dtype (fp8 is declared as its ``torch.uint8`` storage).
    :param kv_cache_dim: row width in elements of the storage dtype, overriding ``kv_lora_rank +
        qk_rope_head_dim`` (see :func:`mla_row_dim`).
    :param sized_by: the size group (``"tokens"``, or ``"swa_tokens"`` for a sliding-window sub-pool).
    :param name: the buffer's name (a family combining several pools may prefix it).
    :param page_major: one row per page instead, every layer's rows of ``page_size`` tokens (the same bytes per
        token).
    :returns: one buffer ``[layer_num, size + page_size, 1, row_dim]``: one row per token plus the padding page;
        ``page_major``: ``[1, size / page_size + 1, layer_num, page_size, row_dim]``.
    """
    store = storage_dtype(dtype)
    row_dim = mla_row_dim(kv_lora_rank, qk_rope_head_dim, kv_cache_dim)
    notes = ["latent KV rows are replicated on every tensor-parallel rank"]
    if store != dtype:
        notes.append("fp8 stored as uint8")
    if page_major:
        notes.insert(0, "page-major: a page of all layers contiguous")
        geometry = dict(layers=1, row_shape=(layer_num, page_size, row_dim), tokens_per_row=page_size)
    else:
        geometry = dict(layers=layer_num, row_shape=(1, row_dim))
    return PoolLayout(
        backend=backend,
        buffers=(BufferLayout(name=name, dtype=store, sized_by=sized_by, pad_tokens=page_size, **geometry),),
        notes=tuple(notes),
    )
