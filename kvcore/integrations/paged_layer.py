"""One decoder layer's view of a :class:`~kvcore.integrations.transformers.PagedKVCache`: the
``transformers.cache_utils.CacheLayerMixin`` each attention layer of a model talks to (its ``update``, lengths and
edits go to the shared cache), what a forward's first layer works out for the others (:class:`ForwardStep`), and
the geometry of the strided views of reserved runs (:func:`run_geometry`).  Needs ``transformers``, as that module
does."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["ForwardStep", "PagedKVLayer", "run_geometry"]


class PagedKVLayer(CacheLayerMixin):
    """One decoder layer's view of a :class:`~kvcore.integrations.transformers.PagedKVCache`: it counts the tokens
    the layer has stored and writes / gathers them through the shared pool.  ``keys`` / ``values`` read the stored
    rows back (a gathered copy, ``[batch, kv_heads, seq, head_dim]``, in the cache dtype)."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: Cache, layer_id: int):
        self._cache = cache
        self.layer_id = layer_id
        self.seq_len = 0
        super().__init__()

    @property
    def seq_len(self) -> int:
        """Tokens this layer has stored (kept in the cache's list of every layer's, which a forward's later layers'
        update reads and writes)."""
        return self._cache._lengths[self.layer_id]

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        self._cache._lengths[self.layer_id] = value

    def __repr__(self) -> str:
        return f"PagedKVLayer(layer_id={self.layer_id}, seq_len={self.seq_len})"

    # transformers' base __init__ assigns keys/values = None; here they are derived from the pool.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._cache._read(self.layer_id, "k", self.seq_len) if self.seq_len else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("PagedKVLayer.keys live in the kvcore pool; write them through update()")

    @property
    def values(self) -> torch.Tensor | None:
        return self._cache._read(self.layer_id, "v", self.seq_len) if self.seq_len else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("PagedKVLayer.values live in the kvcore pool; write them through update()")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens' keys/values and return those of every token so far (in the dtype of
        ``key_states``): :meth:`~kvcore.integrations.transformers.PagedKVCache.update` of this layer.  Extra
        arguments (``cache_kwargs`` of older transformers) are not needed."""
        return self._cache._update(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every past token plus the new ones.  Takes the query length (recent
        transformers) or the ``cache_position`` tensor (5.0's signature)."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.seq_len + int(query_length), 0

    def get_max_length(self) -> int:
        """-1: no fixed maximum (the pool's free slots are the limit)."""
        return -1

    get_max_cache_shape = get_max_length  # the same question under transformers 5.0's name

    def reset(self) -> None:
        self.seq_len = 0
        self.is_initialized = False

    def crop(self, max_length: int) -> None:
        self._cache.crop(max_length)

    def offload(self) -> None:  # the pool stays where it is
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("reorder a PagedKVCache as a whole: cache.reorder_cache(beam_idx)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._cache.batch_select_indices(indices)


class ForwardStep:
    """What the first layer of a forward works out for every layer of it
    (:meth:`~kvcore.integrations.transformers.PagedKVCache._begin_step`).

    ``end``, ``q``: the rows' length after the forward and its new tokens.  ``live``: the batch rows that store
    (None: all of them).  ``write_locs``: the new tokens' locations, live row after live row (``[rows]`` or
    ``[rows, q]``: entries of the request table, often a view of it; int64 copies on the torch path).  Attention
    reads ``gather(layer, read_locs)`` (``read_locs``: ``[batch, end]`` locations, freed rows at the padding slot)
    or, when ``gather`` is None, strided views of the reserved runs, ``[*view_shape, dim]``.  ``fused``: the layers
    store and read in one launch, ``gather.store_and_gather(layer, read_locs, keys, values)`` (every row live, a
    pool whose ``set_kv_buffer`` only writes its rows, the Triton path), which then reads ``read_locs[:, :length]``
    (``length``: None, or ``end`` when ``read_locs`` are the batch's whole rows of the request table: the same tensor
    every step)."""

    __slots__ = ("end", "q", "live", "write_locs", "read_locs", "length", "gather", "view_shape", "fused")

    def __init__(self, end: int, q: int):
        self.end, self.q = end, q
        self.live = self.write_locs = self.read_locs = self.length = self.gather = self.view_shape = None
        self.fused = False


def run_geometry(buffer: torch.Tensor, base: int, cap: int) -> tuple:
    """``(buffer, head dim, strides, storage offset)`` of the view ``[batch, heads, length, dim]`` of a layer's token
    rows ``[rows, heads, dim]`` over runs of ``cap`` slots reserved from slot ``base`` on (row ``b``'s token ``t`` is
    slot ``base + b * cap + t``)."""
    row, head, elem = buffer.stride()
    return buffer, buffer.shape[2], (cap * row, head, row, elem), buffer.storage_offset() + base * row
