"""DeepSeek-V4's model section, options and declared buffers; importing this needs no kernels.

A DeepSeek-V4 layer attends to a sliding window of its last ``sliding_window`` tokens and, by its compression
ratio (config.json's ``compress_ratios``, one per layer), also to compressed tokens: ratio 0 keeps only the window,
ratio 4 one compressed latent per 4 tokens chosen by a lightning indexer, ratio 128 one per 128 tokens.  The pool
(SGLang's ``DeepSeekV4TokenToKVPool``, default CUDA path: the "V4" FlashMLA pages, offline compression) keeps:

========================  ==============================================  ==============  =====================
buffer                    one row                                         layers          size group
========================  ==============================================  ==============  =====================
``swa_kv``                a window page of ``page_size`` latents           every layer     ``swa_tokens``
``c4_kv`` / ``c128_kv``   a page of ``page_size / r`` compressed latents  ratio-r layers  ``tokens`` (full)
``c4_index``              a page of ``page_size / 4`` indexer keys        ratio-4 layers  ``tokens``
``c4_state``              the ratio-4 compressor's running state          ratio-4 layers  ``swa_tokens``
``c4_index_state``        the indexer compressor's running state          ratio-4 layers  ``swa_tokens``
``c128_state``            the ratio-128 compressor's state ring           ratio-128       ``requests``
========================  ==============================================  ==============  =====================

A latent row (:data:`LATENT_BYTES_PER_TOKEN` = 584 bytes) is 448 fp8 nope values and 64 bf16 rope values (576
bytes), and 7 power-of-two scale bytes plus a padding byte kept after a page's data rows; a page is padded to a
multiple of 576 bytes.  An indexer key is 128 fp8 bytes, its float32 scale after the page's keys.  Compressed slot
``s`` of ratio ``r`` holds full tokens ``r*s .. r*s + r - 1``, so full location ``t`` has compressed slot ``t // r``
and pages line up: full page ``p`` is compressed page ``p`` of every ratio.

The compressors' states (float32 by default, ``kv_cache.options.compress_state_dtype``) keep a ring of raw tokens
per window page (ratio 4: 8 rows, 16 when drafting; each row kv and score of two overlapping windows) or per
request slot (ratio 128: 128 rows, 256 when drafting).  The request slots are the request table's rows
(``max_running_requests + 1``), so the ``requests`` group follows the running requests
(:attr:`~kvcore.layout.RequestStateSizing.per_request_table_row`).  Padding, exactly as SGLang allocates it:
``r`` logical pages per compressed buffer (its allocator's reserved page, counted in compressed slots), one page
of the window, and ``ring + 1`` state rows rounded up to the ratio.
"""

from __future__ import annotations

from typing import List

import attrs
import torch

from kvcore.backend import PoolRequest
from kvcore.config import key, positive
from kvcore.errors import ConfigError
from kvcore.layout import BufferLayout, PoolLayout, RequestStateSizing

BACKEND = "dsv4"
ATTENTION = "deepseek_v4"

#: the compression ratios of the default (V4) pool: window only, and the two compressed kinds
RATIOS = (0, 4, 128)
COMPRESSED_RATIOS = (4, 128)
#: the nope values of a latent are quantized per tile of this many, to a power-of-two ("ue8m0") scale byte
TILE = 64
#: bytes of a latent's data row (fp8 nope + bf16 rope), and of its scale row (a byte per nope tile, padded)
LATENT_DATA_BYTES = 576
LATENT_SCALE_BYTES = 8
LATENT_BYTES_PER_TOKEN = LATENT_DATA_BYTES + LATENT_SCALE_BYTES
#: a latent page is padded to a multiple of this many bytes (FlashMLA reads it by rows of 576)
PAGE_ALIGN = 576
#: a float32 scale per indexer key
INDEX_SCALE_BYTES = 4
#: SGLang's window share of the full tokens for DeepSeek-V4 (DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO)
DSV4_SWA_FULL_TOKENS_RATIO = 0.1
#: ``kv_cache.options.compress_state_dtype`` spellings
STATE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _ratios(instance, attribute, value) -> None:
    bad = sorted({r for r in value if r not in RATIOS})
    if not value or bad:
        raise ValueError(f"compress_ratios must list one of {list(RATIOS)} per layer, got {bad or value}")


@attrs.define
class DeepSeekV4Dims:
    """DeepSeek-V4's compressed attention (model.deepseek_v4), from the model's config.json."""

    compress_ratios: List[int] = key(validator=_ratios, doc="one compression ratio per layer (config.json compress_ratios; 0: sliding window only, 4 or 128: also compressed tokens); entries past the model's layers are its multi-token-prediction layers'")
    sliding_window: int = key(128, validator=positive, doc="tokens each layer's window keeps (config.json sliding_window)")
    qk_nope_head_dim: int = key(448, validator=positive, doc="nope width of a latent (config.json head_dim - qk_rope_head_dim); the V4 pages need 448")
    qk_rope_head_dim: int = key(64, validator=positive, doc="rope width of a latent (config.json qk_rope_head_dim); the V4 pages need 64")
    index_head_dim: int = key(128, validator=positive, doc="the lightning indexer's key width (config.json index_head_dim)")


def _state_dtype_name(instance, attribute, value) -> None:
    if str(value).lower() not in STATE_DTYPES:
        raise ValueError(f"compress_state_dtype={value!r} is not one of: {', '.join(STATE_DTYPES)}")


@attrs.define
class DeepSeekV4Options:
    """kv_cache.options of the dsv4 backend."""

    compress_state_dtype: str = key(
        "float32", validator=_state_dtype_name,
        doc="the compressors' running states (SGLang's SGLANG_DSV4_COMPRESS_STATE_DTYPE): float32 or bfloat16",
    )  # fmt: skip
    host_to_device_ratio: int = key(
        1, validator=attrs.validators.ge(1),
        doc="HiSparse (SGLang's enable_hisparse): 2 or more keeps every ratio-4 compressed latent in pinned host memory "
            "and this many per device slot, the device holding the hot ones (kvcore_dsv4.hisparse); 1: all on the "
            "device",
    )  # fmt: skip


def host_to_device_ratio(request: PoolRequest) -> int:
    """``kv_cache.options.host_to_device_ratio``: HiSparse above 1."""
    return int(request.options.host_to_device_ratio)


def state_dtype(request: PoolRequest) -> torch.dtype:
    return STATE_DTYPES[str(request.options.compress_state_dtype).lower()]


def latent_page_bytes(page_size: int) -> int:
    """Bytes of one latent page of ``page_size`` slots: data rows, scale rows, padded to 576 (149760 for 256)."""
    raw = page_size * LATENT_BYTES_PER_TOKEN
    return -(-raw // PAGE_ALIGN) * PAGE_ALIGN


def index_page_bytes(page_size: int, index_head_dim: int) -> int:
    """Bytes of one indexer page of ``page_size`` fp8 keys and their float32 scales."""
    return page_size * (index_head_dim + INDEX_SCALE_BYTES)


def ring_size(ratio: int, drafting: bool) -> int:
    """State rows of one ring (SGLang's ``get_compress_state_ring_size``, offline compression)."""
    if ratio == 4:
        return 16 if drafting else 8
    if ratio == 128:
        return 256 if drafting else 128
    raise ValueError(f"no compressor state for compression ratio {ratio}")


def state_pad_rows(ratio: int, ring: int) -> int:
    """Rows a state buffer keeps beyond its rings: ``ring + 1`` (a spare ring and the empty row -1), rounded up to
    the ratio, as SGLang's ``CompressStatePool`` pads them."""
    return -(-(ring + 1) // ratio) * ratio


def state_row_width(ratio: int, head_dim: int) -> int:
    """Values of one state row: kv and score of ``head_dim`` each, twice for ratio 4's overlapping windows."""
    return 2 * (2 if ratio == 4 else 1) * head_dim


def check_page_size(page_size: int) -> None:
    if page_size % 128:
        raise ConfigError(
            f"kv_cache.page_size={page_size}: DeepSeek-V4's compressed pages hold page_size / 128 ratio-128 latents, "
            "so the page must be a multiple of 128 (SGLang runs 256): set kv_cache.page_size=256"
        )


def layer_ratios(dims: DeepSeekV4Dims, start_layer: int, end_layer: int) -> list[int]:
    """The compression ratio of each of layers ``start_layer .. end_layer`` (inclusive).

    :raises ConfigError: when ``compress_ratios`` has fewer entries than the layers.
    """
    if len(dims.compress_ratios) <= end_layer:
        raise ConfigError(f"model.deepseek_v4.compress_ratios has {len(dims.compress_ratios)} entries, but layer "
                          f"{end_layer} needs one: give one ratio per layer")  # fmt: skip
    return list(dims.compress_ratios[start_layer : end_layer + 1])


def check_latent_dims(dims: DeepSeekV4Dims) -> None:
    if dims.qk_nope_head_dim != 448 or dims.qk_rope_head_dim != 64:
        raise ConfigError(
            f"model.deepseek_v4: qk_nope_head_dim={dims.qk_nope_head_dim}, qk_rope_head_dim={dims.qk_rope_head_dim}: "
            "the V4 pages hold 448 nope and 64 rope values (576 data bytes a latent); set 448 and 64"
        )


def dsv4_layout(request: PoolRequest) -> PoolLayout:
    """The buffers of this rank's layers (see the module docstring)."""
    dims: DeepSeekV4Dims = request.section("deepseek_v4")
    check_latent_dims(dims)
    page = request.page_size
    check_page_size(page)
    ratios = layer_ratios(dims, request.start_layer, request.end_layer)
    drafting = request.mode.num_draft_tokens > 0
    states = state_dtype(request)
    latent = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    u8 = torch.uint8
    buffers = [BufferLayout(name="swa_kv", layers=len(ratios), row_shape=(latent_page_bytes(page),), dtype=u8,
                            sized_by="swa_tokens", tokens_per_row=page, pad_tokens=page)]  # fmt: skip
    n4, n128 = ratios.count(4), ratios.count(128)
    hisparse = host_to_device_ratio(request)
    if hisparse > 1 and not n4:
        raise ConfigError(f"kv_cache.options.host_to_device_ratio={hisparse} (HiSparse) keeps ratio-4 latents on the "
                          f"host, but layers {request.start_layer}..{request.end_layer} have none; set it to 1")  # fmt: skip
    for r in COMPRESSED_RATIOS:
        n = ratios.count(r)
        if n:  # HiSparse: the device keeps the ratio-4 latents of one full page in host_to_device_ratio
            buffers.append(BufferLayout(name=f"c{r}_kv", layers=n, row_shape=(latent_page_bytes(page // r),), dtype=u8,
                                        tokens_per_row=page, pad_tokens=r * page,
                                        size_divisor=hisparse if r == 4 else 1))  # fmt: skip
    if n4:
        ring = ring_size(4, drafting)
        common = dict(layers=n4, dtype=states, sized_by="swa_tokens", tokens_per_row=page // ring,
                      pad_tokens=state_pad_rows(4, ring) * page // ring)  # fmt: skip
        buffers += [
            BufferLayout(name="c4_index", layers=n4, row_shape=(index_page_bytes(page // 4, dims.index_head_dim),),
                         dtype=u8, tokens_per_row=page, pad_tokens=4 * page),  # fmt: skip
            BufferLayout(name="c4_state", row_shape=(state_row_width(4, latent),), **common),
            BufferLayout(name="c4_index_state", row_shape=(state_row_width(4, dims.index_head_dim),), **common),
        ]
    if n128:
        ring = ring_size(128, drafting)
        buffers.append(BufferLayout(name="c128_state", layers=n128, row_shape=(state_row_width(128, latent),),
                                    dtype=states, sized_by="requests", size_multiple=ring,
                                    pad_tokens=state_pad_rows(128, ring)))  # fmt: skip
    window = -(-dims.sliding_window // page) * page + page
    notes = [f"{len(ratios)} layers: {ratios.count(0)} window-only, {n4} ratio 4, {n128} ratio 128; window pages of "
             f"{page} latents ({LATENT_BYTES_PER_TOKEN} B each, fp8 nope with power-of-two scales, bf16 rope)",
             f"compressed tokens: c4 = tokens / 4, c128 = tokens / 128; compressor states {str(states)[6:]}"]  # fmt: skip
    if hisparse > 1:
        notes.append(f"HiSparse: the ratio-4 latents' device slots are tokens / {4 * hisparse} (whole pages), every "
                     f"compressed token's latent also in pinned host memory ({LATENT_BYTES_PER_TOKEN} bytes a ratio-4 "
                     "slot per layer, not in the device budget); the indexer keeps every one on the device")  # fmt: skip
    return PoolLayout(
        backend=BACKEND, buffers=buffers, notes=notes, swa_full_tokens_ratio=DSV4_SWA_FULL_TOKENS_RATIO,
        min_sizes={"swa_tokens": (window, f"model.deepseek_v4.sliding_window={dims.sliding_window} in whole pages of "
                                          f"{page}, plus a page")},
        request_state=RequestStateSizing(per_request_table_row=True, keys=("memory.max_running_requests", "", "")),
        derived_sizes={f"c{r}_max_total_num_tokens": ("tokens", r * (hisparse if r == 4 else 1))
                       for r in COMPRESSED_RATIOS if r in ratios},
    )  # fmt: skip
