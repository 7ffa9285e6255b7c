"""The MiniMax sparse family's model section and declared buffers; importing this needs no kernels.

A MiniMax sparse model (MiniMax-M3, ``MiniMaxM3SparseForCausalLM``) has dense attention layers and sparse ones.
Every layer keeps K and V per token (``k`` / ``v``, ``[head_num, head_dim]``); a sparse layer also keeps its
lightning indexer's key per token (``index_k``, one head of ``index_head_dim``) and, unless the layer's index is
value-less, an index value (``index_v``).  Layers are sorted into three groups, each stacked in its buffers:
every layer (``k``, ``v``), the sparse layers with an index value (``index_k``, ``index_v``) and the value-less
ones (``index_k_only``).
"""

from __future__ import annotations

from typing import List, Optional

import attrs

from kvcore.backend import PoolRequest
from kvcore.config import key, parse_dtype, positive
from kvcore.errors import ConfigError
from kvcore.kernels.dtypes import storage_dtype
from kvcore.layout import BufferLayout, PoolLayout
from kvcore_mha import mha_layout

BACKEND = "minimax_sparse"


@attrs.define
class MiniMaxSparseDims:
    """MiniMax sparse attention (model.minimax_sparse), from config.json's ``sparse_attention_config``."""

    index_head_dim: int = key(validator=positive, doc="width of a token's index key and value (sparse_index_dim)")
    sparse_attention_freq: List[int] = key(doc="one entry per layer: 1 for a sparse attention layer, 0 for a dense one (sparse_attention_freq; a shorter list repeats)")
    disable_index_value: Optional[List[int]] = key(None, doc="one entry per layer: 1 when a sparse layer's index keeps no value (sparse_disable_index_value); default: every index keeps one")
    index_dtype: Optional[str] = key(None, doc="dtype of the index rows (SGLang passes the model's dtype); default: model.dtype")


def layer_groups(dims: MiniMaxSparseDims, layers: range) -> tuple[list[int], list[int], list[int]]:
    """``(dense, sparse with an index value, sparse without one)`` global ids among ``layers``.  Layer ``i`` reads
    entry ``i`` of the per-layer lists (config.json gives one per layer; a shorter list repeats, as a pattern).

    :raises ConfigError: naming the key of an empty list.
    """
    for name, values in (("sparse_attention_freq", dims.sparse_attention_freq), ("disable_index_value", dims.disable_index_value)):
        if values is not None and not values:
            raise ConfigError(f"model.minimax_sparse.{name} is empty: give one entry per layer")
    freq, disabled = dims.sparse_attention_freq, dims.disable_index_value
    sparse = [i for i in layers if freq[i % len(freq)]]
    no_value = {i for i in sparse if disabled and disabled[i % len(disabled)]}
    return [i for i in layers if i not in sparse], [i for i in sparse if i not in no_value], sorted(no_value)


def index_dtype(request: PoolRequest):
    """The index rows' dtype: ``model.minimax_sparse.index_dtype``, else the model's."""
    dims: MiniMaxSparseDims = request.section("minimax_sparse")
    if dims.index_dtype is None:
        return request.model_dtype
    return parse_dtype(dims.index_dtype, "model.minimax_sparse.index_dtype")


def minimax_sparse_layout(request: PoolRequest) -> PoolLayout:
    """``k`` / ``v`` of every layer, ``index_k`` / ``index_v`` of the sparse layers with index values,
    ``index_k_only`` of the value-less ones; one row per token plus the padding page each."""
    dims: MiniMaxSparseDims = request.section("minimax_sparse")
    _, with_value, no_value = layer_groups(dims, range(request.start_layer, request.end_layer + 1))
    main = mha_layout(backend=BACKEND, page_size=request.page_size, dtype=request.kv_dtype, head_num=request.head_num,
                      head_dim=request.head_dim, v_head_dim=request.v_head_dim, layer_num=request.layer_num)  # fmt: skip
    store = storage_dtype(index_dtype(request))
    row = (1, dims.index_head_dim)
    common = dict(dtype=store, pad_tokens=request.page_size)
    index = []
    if with_value:
        index += [BufferLayout(name="index_k", layers=len(with_value), row_shape=row, **common),
                  BufferLayout(name="index_v", layers=len(with_value), row_shape=row, **common)]  # fmt: skip
    if no_value:
        index.append(BufferLayout(name="index_k_only", layers=len(no_value), row_shape=row, **common))
    notes = [*main.notes, f"{len(with_value) + len(no_value)} sparse layers ({len(no_value)} with value-less indexes), "
             f"{request.layer_num - len(with_value) - len(no_value)} dense; index rows of {dims.index_head_dim}"]
    return PoolLayout(backend=BACKEND, buffers=(*main.buffers, *index), notes=notes)
