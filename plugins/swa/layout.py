"""The sliding-window family's model section and declared buffers; importing this needs no kernels.

A hybrid sliding-window model has full-attention layers, which keep every token of a request, and
sliding-window layers, which only ever read the last ``sliding_window`` tokens.  The pool keeps the two
kinds in separate MHA sub-pools: the full one sized by the ``tokens`` group, the window one by the
``swa_tokens`` group (SGLang's ``swa_full_tokens_ratio`` times fewer tokens, since slots of tokens that slid
out of every window are freed early).  The planner sizes both from this layout alone.
"""

from __future__ import annotations

from typing import Optional

import attrs

from kvcore.backend import PoolRequest
from kvcore.config import key, positive
from kvcore.layout import PoolLayout
from kvcore_mha.layout import mha_layout, page_major_layout


def _non_negative(instance, attribute, value) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be 0 or more, got {value}")


@attrs.define
class SWADims:
    """Sliding-window attention (model.swa), from the model's config.json."""

    sliding_window: int = key(validator=positive, doc="tokens a sliding-window layer attends to (config.json sliding_window)")
    full_attention_interval: int = key(
        validator=_non_negative,
        doc="layer i (from 0) attends to every token when (i + 1) % n == 0: 2 for gpt-oss (layer_types alternate "
        "sliding, full), 6 for Gemma 3 (sliding_window_pattern); 0 when every layer slides",
    )  # fmt: skip
    swa_num_key_value_heads: Optional[int] = key(None, validator=positive, doc="KV heads of the sliding-window layers when they differ from model.num_key_value_heads")
    swa_head_dim: Optional[int] = key(None, validator=positive, doc="key head width of the sliding-window layers when it differs from model.head_dim")
    swa_v_head_dim: Optional[int] = key(None, validator=positive, doc="value head width of the sliding-window layers when it differs")


def attention_layer_ids(num_layers: int, full_attention_interval: int) -> tuple[list[int], list[int]]:
    """``(full_attention_layer_ids, swa_attention_layer_ids)`` of a model, global ids in order."""
    n = full_attention_interval
    full = [i for i in range(num_layers) if n and (i + 1) % n == 0]
    return full, [i for i in range(num_layers) if not (n and (i + 1) % n == 0)]


@attrs.frozen
class SWAShape:
    """What one rank's sliding-window pool holds: its layers of each kind and the window layers' heads."""

    full_attention_layer_ids: tuple[int, ...]
    swa_attention_layer_ids: tuple[int, ...]
    swa_head_num: int
    swa_head_dim: int
    swa_v_head_dim: int
    sliding_window: int


def swa_shape(request: PoolRequest) -> SWAShape:
    """The layers of this rank (``start_layer .. end_layer``) split by kind, and the window layers' per-rank
    heads (replicated, like the full layers', when tensor parallelism exceeds them)."""
    dims: SWADims = request.section("swa")
    total = request.end_layer + 1  # ids past this rank's range do not matter
    full, swa = attention_layer_ids(total, dims.full_attention_interval)
    mine = range(request.start_layer, request.end_layer + 1)
    heads = request.head_num
    if dims.swa_num_key_value_heads is not None:
        heads = max(1, dims.swa_num_key_value_heads // request.tp_size)
    head_dim = dims.swa_head_dim or request.head_dim
    return SWAShape(
        full_attention_layer_ids=tuple(i for i in full if i in mine),
        swa_attention_layer_ids=tuple(i for i in swa if i in mine),
        swa_head_num=heads,
        swa_head_dim=head_dim,
        swa_v_head_dim=dims.swa_v_head_dim or (head_dim if dims.swa_head_dim else request.v_head_dim),
        sliding_window=dims.sliding_window,
    )


def window_tokens(sliding_window: int, page_size: int) -> int:
    """The least sliding-window tokens one request needs: its window, in whole pages, plus one page (a window
    that does not start on a page boundary spans one page more)."""
    return (-(-sliding_window // page_size) + 1) * page_size


def swa_layout(*, backend: str, request: PoolRequest) -> PoolLayout:
    """The buffers of a :class:`~kvcore_swa.pool.SWAKVPool`: the full layers' ``k`` / ``v`` (``tokens``
    group) and the window layers' ``swa_k`` / ``swa_v`` (``swa_tokens`` group), each an MHA pool's layout
    (page-major under ``kv_cache.layout=page_major``: ``kv`` and ``swa_kv``)."""
    shape = swa_shape(request)
    common = dict(backend=backend, page_size=request.page_size, dtype=request.kv_dtype)
    sub_pool_layout = page_major_layout if request.layout == "page_major" else mha_layout
    buffers, notes = [], []
    if shape.full_attention_layer_ids:
        full = sub_pool_layout(head_num=request.head_num, head_dim=request.head_dim, v_head_dim=request.v_head_dim,
                          layer_num=len(shape.full_attention_layer_ids), **common)  # fmt: skip
        buffers += full.buffers
        notes += full.notes
    if shape.swa_attention_layer_ids:
        window = sub_pool_layout(head_num=shape.swa_head_num, head_dim=shape.swa_head_dim, v_head_dim=shape.swa_v_head_dim,
                            layer_num=len(shape.swa_attention_layer_ids), sized_by="swa_tokens", prefix="swa_",
                            **common)  # fmt: skip
        buffers += window.buffers
        notes += [n for n in window.notes if n not in notes]
    notes.append(
        f"{len(shape.full_attention_layer_ids)} full-attention and {len(shape.swa_attention_layer_ids)} "
        f"sliding-window layers (window {shape.sliding_window} tokens)"
    )
    minimum = window_tokens(shape.sliding_window, request.page_size)
    min_sizes = {}
    if shape.swa_attention_layer_ids:
        why = f"model.swa.sliding_window={shape.sliding_window} in pages of kv_cache.page_size={request.page_size}, plus a page"
        min_sizes["swa_tokens"] = (minimum, why)
    return PoolLayout(backend=backend, buffers=buffers, notes=notes, min_sizes=min_sizes)
