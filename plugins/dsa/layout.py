"""The DSA pool's row formats and declared buffers; importing this needs no kernels (the planner uses it anywhere).

DSA (DeepSeek sparse attention, DeepSeek-V3.2) is MLA plus a *lightning indexer* that keeps one small key per
token.  A DSA pool therefore holds two stacked buffers:

``kv`` (token-indexed, one row per token, the MLA latent row)
    * fp8 cache (``float8_e4m3fn``): :func:`calculate_mla_kv_cache_dim` bytes per token and layer, 656 for
      DeepSeek-V3.2 (kv_lora_rank 512, rope 64)::

          bytes [0, R)              the R nope values in fp8 e4m3fn, quantized per 128-value tile
          bytes [R, R + 4R/128)     one float32 scale per tile (the dequantization multiplier)
          bytes [R + 4R/128, ...)   the rope values in bfloat16 (never quantized)

      with R = kv_lora_rank.  A tile's scale is ``max(amax / 448, 2**-126)`` (amax = largest |value| of the
      tile in float32, ``/`` an IEEE division): the clamp is the **zero-tile guard**.  An all-zero tile
      (amax 0) would otherwise get scale 0 and quantize 0/0 = NaN; clamped, it stores zeros with scale
      2**-126, which dequantizes back to exact zeros.  The floor is float32's smallest *normal* number so the
      scale is never subnormal (GPUs that flush subnormals and torch agree on it); it only changes tiles
      whose amax is below 448 * 2**-126 (about 5.3e-36), i.e. zero tiles in practice.
    * any other cache dtype: the plain MLA row, ``kv_lora_rank + qk_rope_head_dim`` values of that dtype
      (fp8 e5m2 stored as uint8, unscaled), exactly as the MLA family stores it.

``index_k`` (page-indexed, one row per page of 64 tokens, the indexer's keys)
    * fp8 indexer (default): per layer ``(size + page_size + 1) // page_size`` pages of 8448 bytes; token
      ``t`` of a page has its 128 fp8 key bytes at byte ``t * 128`` and its float32 scale at byte
      ``8192 + 4 * t`` (64 x 128 key bytes, then 64 scales).
    * bf16 indexer (``kv_cache.options.index_dtype: bfloat16``): the same pages with bf16 keys and no scales,
      64 x 128 x 2 = 16384 bytes a page; token ``t``'s key at byte ``t * 256``.

The indexer's page is 64 tokens and its pages line up with the token pool's pages (token ``loc`` lives in
index page ``loc // 64`` at slot ``loc % 64``), so the pool's page size must be 64.
"""

from __future__ import annotations

import attrs
import torch

from kvcore.config import key, positive
from kvcore.kernels.dtypes import storage_dtype
from kvcore.errors import ConfigError
from kvcore.layout import BufferLayout, PoolLayout

#: values per fp8 quantization tile of the nope part (one float32 scale each).
QUANT_BLOCK_SIZE = 128
#: the dtype the rope part is kept in inside an fp8 row.
ROPE_STORAGE_DTYPE = torch.bfloat16
#: the zero-tile guard: scales are clamped to float32's smallest normal number.
SCALE_MIN = 2.0**-126
#: tokens per indexer page; the pool's page size must equal it.
INDEX_PAGE_SIZE = 64
#: the indexer's key width (one head).
INDEX_HEAD_DIM = 128
#: bytes of one indexer scale (float32).
INDEX_SCALE_BYTES = 4

#: ``kv_cache.options.index_dtype`` spellings.
INDEX_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@attrs.define
class DSADims:
    """DeepSeek sparse attention's lightning indexer (model.dsa), from the model's config.json."""

    index_head_dim: int = key(validator=positive, doc="indexer key width (config.json index_head_dim); DSA pools need 128")


def _index_dtype_name(instance, attribute, value) -> None:
    if str(value).lower() not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={value!r} is not one of: {', '.join(INDEX_DTYPES)}")


@attrs.define
class DSAOptions:
    """kv_cache.options of the dsa backend."""

    index_dtype: str = key(
        "fp8", validator=_index_dtype_name,
        doc="the indexer's key cache: fp8 (128 fp8 bytes + a float32 scale per token, SGLang's format) or bfloat16",
    )  # fmt: skip
    host_to_device_ratio: int = key(
        1, validator=attrs.validators.ge(1),
        doc="HiSparse (SGLang's enable_hisparse): 2 or more keeps every token in pinned host memory and this many "
            "tokens per device slot, the device holding the hot ones' latent rows and every token's indexer keys "
            "(kvcore_dsa.hisparse); 1: every token on the device",
    )  # fmt: skip


def uses_scaled_fp8(dtype: torch.dtype) -> bool:
    """True when a DSA cache of ``dtype`` stores the scaled fp8 row (float8_e4m3fn only, as in SGLang)."""
    return dtype == torch.float8_e4m3fn


def scaled_row_bytes(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one scaled fp8 row: fp8 nope, a float32 scale per 128-value tile, bf16 rope (656 for 512 / 64)."""
    return kv_lora_rank + kv_lora_rank // QUANT_BLOCK_SIZE * 4 + qk_rope_head_dim * ROPE_STORAGE_DTYPE.itemsize


def calculate_mla_kv_cache_dim(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype, is_dsa: bool) -> int:
    """Width of one MLA/DSA latent row in elements of the storage dtype (bytes for fp8 caches).

    SGLang's KV-cache configurator's ``calculate_mla_kv_cache_dim``: ``kv_lora_rank + qk_rope_head_dim`` for
    MLA and for DSA with a non-e4m3 cache; for a DSA float8_e4m3fn cache, :func:`scaled_row_bytes`.

    :raises ConfigError: a DSA fp8 cache whose kv_lora_rank is not a multiple of the 128-value tile.
    """
    if not (is_dsa and uses_scaled_fp8(dtype)):
        return kv_lora_rank + qk_rope_head_dim
    if kv_lora_rank % QUANT_BLOCK_SIZE:
        raise ConfigError(
            f"model.mla.kv_lora_rank={kv_lora_rank} must be a multiple of {QUANT_BLOCK_SIZE} for a DSA fp8 cache "
            f"(one scale per {QUANT_BLOCK_SIZE}-value tile)"
        )
    return scaled_row_bytes(kv_lora_rank, qk_rope_head_dim)


def index_page_bytes_of(key_bytes: int, has_scale: bool) -> int:
    """Bytes of one indexer page: 64 keys of ``key_bytes``, then (fp8 keys) 64 float32 scales."""
    return INDEX_PAGE_SIZE * (key_bytes + (INDEX_SCALE_BYTES if has_scale else 0))


def index_page_bytes(index_dtype: torch.dtype, index_head_dim: int = INDEX_HEAD_DIM) -> int:
    """Bytes of one indexer page of ``index_dtype`` keys (8448 for fp8, 16384 for bf16)."""
    fp8 = index_dtype == torch.float8_e4m3fn
    return index_page_bytes_of(index_head_dim * (1 if fp8 else index_dtype.itemsize), fp8)


def index_pages(size: int, page_size: int) -> int:
    """Indexer pages per layer for a pool of ``size`` tokens (SGLang's ``(size + page_size + 1) // page_size``)."""
    return (size + page_size + 1) // page_size


def resolve_index_dtype(value) -> torch.dtype:
    """An indexer dtype (a name of :data:`INDEX_DTYPES`, a torch dtype, or None for the default fp8) as a dtype."""
    if value is None:
        return torch.float8_e4m3fn
    if isinstance(value, torch.dtype):
        if value in (torch.float8_e4m3fn, torch.bfloat16):
            return value
        raise ConfigError(f"kv_cache.options.index_dtype={value} is not supported; use float8_e4m3fn or bfloat16")
    try:
        return INDEX_DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(
            f"kv_cache.options.index_dtype={value!r} is not one of: {', '.join(INDEX_DTYPES)}"
        ) from None


def check_dsa_dims(*, page_size: int, kv_lora_rank: int, index_head_dim: int) -> None:
    """The shapes a DSA pool needs, whatever its cache dtype; every error names the config key to change.

    :raises ConfigError: page size other than 64, kv_lora_rank not a multiple of 128, index_head_dim not 128.
    """
    if page_size != INDEX_PAGE_SIZE:
        raise ConfigError(
            f"kv_cache.page_size must be {INDEX_PAGE_SIZE} for DSA (the indexer's page), got {page_size}; "
            f"set kv_cache.page_size={INDEX_PAGE_SIZE}"
        )
    if kv_lora_rank is None or kv_lora_rank % QUANT_BLOCK_SIZE:
        raise ConfigError(
            f"model.mla.kv_lora_rank={kv_lora_rank} must be a multiple of {QUANT_BLOCK_SIZE} for DSA "
            f"(the fp8 row keeps one scale per {QUANT_BLOCK_SIZE}-value tile)"
        )
    if index_head_dim != INDEX_HEAD_DIM:
        raise ConfigError(
            f"model.dsa.index_head_dim={index_head_dim} must be {INDEX_HEAD_DIM} for DSA (one indexer head of 128)"
        )


def dsa_layout(
    *,
    backend: str,
    page_size: int,
    dtype: torch.dtype,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    index_head_dim: int,
    layer_num: int,
    index_dtype: torch.dtype | None = None,
    host_to_device_ratio: int = 1,
) -> PoolLayout:
    """The buffers of a :class:`~kvcore_dsa.pool.DSATokenToKVPool`: the MLA ``kv`` rows and the ``index_k`` pages;
    with ``host_to_device_ratio`` > 1 (:class:`~kvcore_dsa.hisparse.HiSparseDSATokenToKVPool`) the size is the device
    slots and the indexer's pages cover that many tokens per slot.

    :raises ConfigError: see :func:`check_dsa_dims` (page size 64 is checked here, before anything else,
        so ``kvcore plan`` reports it).
    """
    from kvcore_mla.layout import mla_layout

    check_dsa_dims(page_size=page_size, kv_lora_rank=kv_lora_rank, index_head_dim=index_head_dim)
    index_dtype = resolve_index_dtype(index_dtype)
    kv_cache_dim = calculate_mla_kv_cache_dim(kv_lora_rank, qk_rope_head_dim, dtype, is_dsa=True)
    mla = mla_layout(
        backend=backend, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, kv_cache_dim=kv_cache_dim,
    )  # fmt: skip
    index = BufferLayout(
        name="index_k",
        layers=layer_num,
        row_shape=(index_page_bytes(index_dtype, index_head_dim),),
        dtype=torch.uint8,
        tokens_per_row=INDEX_PAGE_SIZE,
        pad_tokens=page_size + 1,
        size_multiple=host_to_device_ratio,
    )
    notes = list(mla.notes)
    if uses_scaled_fp8(dtype):
        notes.append(
            f"DSA fp8 row: {kv_lora_rank} fp8 nope + {kv_lora_rank // QUANT_BLOCK_SIZE} fp32 tile scales "
            f"+ {qk_rope_head_dim} bf16 rope = {kv_cache_dim} bytes"
        )
    if host_to_device_ratio > 1:
        notes.append(f"HiSparse: {host_to_device_ratio} tokens per device slot; every token's latent row also in "
                     f"pinned host memory ({kv_cache_dim * storage_dtype(dtype).itemsize} bytes a token per layer, "
                     "not in the device budget); the indexer keeps every token on the device")  # fmt: skip
    index_name = "fp8 keys + fp32 scales" if index_dtype == torch.float8_e4m3fn else "bf16 keys"
    notes.append(f"indexer: pages of {INDEX_PAGE_SIZE} tokens, {index_name}, {index.row_bytes} bytes a page")
    if storage_dtype(dtype) != dtype and "fp8 stored as uint8" not in notes:
        notes.append("fp8 stored as uint8")
    return PoolLayout(backend=backend, buffers=(*mla.buffers, index), notes=tuple(notes))
