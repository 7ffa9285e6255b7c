"""The page-major MHA pool (``kv_cache.layout=page_major``): one buffer whose unit is a page of all layers.

``kv_cache`` is ``[1, pages + 1, layer_num, 2, page_size, head_num, head_dim]``: page ``p`` holds, for every layer,
its ``page_size`` key rows then its value rows, so a page's bytes are contiguous and a transfer engine or the CPU
offload moves a whole page (all layers) as one block (``get_contiguous_buf_infos`` reports one item = one page of
all layers).  The leading 1 is the stacked-buffer dimension every kvcore buffer has (here: one "layer" of pages).

For kvcore's own paths the pool describes its rows (:meth:`token_rows`): the buffer seen as rows of
``[head_num, head_dim]`` with a layer stride of ``2 * page_size`` rows, where token ``t``'s key is row
``(t // page_size) * (layer_num * 2 * page_size) + t % page_size`` and its value ``page_size`` rows further.
Those views overlap between layers (distinct layers' rows never share bytes for the same token); the store
(:class:`kvcore_mha.KVStore`, one launch that computes the rows), the row moves, CPU offload and the conformance
kit all work through them.

**Pages over given memory, mapped** (``memory=`` and ``virtual_pages=``): a composite pool can lay the pages over a
byte range it owns (a unified memory shared with other state) and hand out *virtual* token ids whose pages it maps
to physical pages itself, moving pages as it compacts its range (:meth:`PageMajorMHATokenToKVPool.remap_pages`).
Every virtual token then goes through a virtual -> physical token table (on the pool's device; the store reads it
inside the launch, the row moves, CPU offload and the kit read it too); a virtual page not mapped is on the padding
page.  Attention reads the paged views by physical page:
:meth:`PageMajorMHATokenToKVPool.translate_loc` gives the physical tokens, and an engine that takes them once per
step passes them to the store as a :class:`~kvcore.pools.KVWriteLoc` marked physical, which reads no table.
"""

from __future__ import annotations

import torch

from kvcore.pools import KVCache, PageMajorPages, WriteLoc, check_post_capture, full_write_loc, lay_over
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_mha.kernels import KVStore


class PageMajorMHATokenToKVPool(PageMajorPages, KVCache):
    """Keys and values of MHA/GQA layers, page-major (see the module docstring); :class:`MHATokenToKVPool`'s
    constructor keywords, with the same meaning (``enable_alt_stream`` and ``enable_kv_cache_copy`` accepted
    either way: one launch stores K and V, and :meth:`move_kv_cache` always exists; ``post_capture_active=True`` is
    a :class:`~kvcore.errors.ConfigError`).

    ``get_key_buffer(layer)`` / ``get_value_buffer(layer)`` return that layer's ``[pages + 1, page_size, head_num,
    head_dim]`` strided view (the paged shape attention kernels read; its page stride spans all layers).

    :param memory: / ``virtual_pages``: the pages over given memory, with virtual pages (the module docstring).
    :param padding_page: with ``virtual_pages``: the physical page every virtual page sits on until it is mapped
        (the owner's padding page; 0 by default).
    :raises ValueError: when ``v_head_dim`` differs from ``head_dim`` (K and V share a page's rows).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str, enable_memory_saver: bool = False, v_head_dim: int | None = None,
                 swa_head_num: int | None = None, swa_head_dim: int | None = None, swa_v_head_dim: int | None = None,
                 start_layer: int | None = None, end_layer: int | None = None, enable_alt_stream: bool = True,
                 enable_kv_cache_copy: bool = False, post_capture_active: bool = False, kernels: str = "auto",
                 memory: torch.Tensor | None = None, virtual_pages: int | None = None,
                 padding_page: int = 0):  # fmt: skip
        check_post_capture(type(self).__name__, post_capture_active)
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        # the swa_* dimensions let a sliding-window sub-pool differ from the full-attention one, as in MHA's pool
        head_num = swa_head_num if swa_head_num is not None else head_num
        if swa_head_dim is not None:
            head_dim, v_head_dim = swa_head_dim, swa_v_head_dim
        if v_head_dim not in (None, head_dim):
            raise ValueError(f"a page-major pool keeps K and V rows alike: v_head_dim={v_head_dim} != head_dim={head_dim}")
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
        pages = size // page_size + 1
        shape = (1, pages, layer_num, 2, page_size, head_num, head_dim)
        if memory is None:
            self.kv_cache = torch.zeros(shape, dtype=self.store_dtype, device=device)
        else:
            self.kv_cache = lay_over(memory, shape, self.store_dtype, torch.device(device))
        self.rows_per_page = layer_num * 2 * page_size
        row = head_num * head_dim
        rows = (pages - 1) * self.rows_per_page + page_size  # the last layer's last key row, plus one
        base = self.kv_cache.storage_offset()
        self._k_rows = self.kv_cache.as_strided((layer_num, rows, head_num, head_dim), (2 * page_size * row, row, head_dim, 1), base)
        self._v_rows = self.kv_cache.as_strided((layer_num, rows, head_num, head_dim), (2 * page_size * row, row, head_dim, 1),
                                                base + page_size * row)  # fmt: skip
        self._token_table(size, virtual_pages, padding_page)
        pages = (page_size, self.rows_per_page)
        #: stores by physical token: rows computed in the launch (no table read)
        self._physical_store = KVStore(self._k_rows, self._v_rows, dtype, self._use_triton, pages=pages)
        #: stores by the pool's tokens: virtual ones through the token table in the launch, then their rows
        self._store = self._physical_store if virtual_pages is None else KVStore(
            self._k_rows, self._v_rows, dtype, self._use_triton, index_map=self._token_of, pages=pages)  # fmt: skip
        self._offsets = torch.arange(page_size, device=device)
        self._finalize_allocation()

    # -- layout -----------------------------------------------------------------------------------------------

    alt_stream = None

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv_cache}

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """SGLang's ``(K bytes, V bytes)``: a page holds as many key rows as value rows, so half the buffer each."""
        half = self.kv_cache.nbytes // 2
        return half, half

    def token_rows(self) -> dict[str, TokenRows]:
        virtual = getattr(self, "_token_of", None)
        return {"k": TokenRows(self._k_rows, self.page_size, self.rows_per_page, index_map=virtual),
                "v": TokenRows(self._v_rows, self.page_size, self.rows_per_page, index_map=virtual)}  # fmt: skip

    def _physical_rows(self) -> TokenRows:
        return TokenRows(self._k_rows, self.page_size, self.rows_per_page)

    def move_groups(self) -> list[tuple[TokenRows, TokenRows | None]]:
        """K and V rows by physical token, moved together (:meth:`move_kv_cache` translates virtual tokens)."""
        if self._move_groups is None:
            self._move_groups = [(TokenRows(self._k_rows, self.page_size, self.rows_per_page),
                                  TokenRows(self._v_rows, self.page_size, self.rows_per_page))]  # fmt: skip
        return self._move_groups

    # -- reads and writes -------------------------------------------------------------------------------------

    def _view(self, layer_id, part: int) -> torch.Tensor:
        local = self._read_layer(layer_id)
        buf = self.kv_cache[0, :, local, part]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id) -> torch.Tensor:
        return self._view(layer_id, 0)

    def get_value_buffer(self, layer_id) -> torch.Tensor:
        return self._view(layer_id, 1)

    @property
    def set_kv_buffer_writes_rows(self) -> bool:
        """True (see :class:`~kvcore.pools.KVCache`) without virtual pages (whose tokens are not the views' rows),
        unless a subclass stores otherwise."""
        return self._store is self._physical_store and type(self).set_kv_buffer is PageMajorMHATokenToKVPool.set_kv_buffer

    def set_kv_buffer(self, layer, loc: WriteLoc, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      k_scale=None, v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """As :meth:`MHATokenToKVPool.set_kv_buffer` (SGLang's arguments; one launch).  ``loc`` is the pool's tokens
        (virtual ones found through the token table inside the launch), or a
        :class:`~kvcore.pools.KVWriteLoc` whose tokens marked physical (:meth:`translate_loc` of the pool's,
        taken once per step) are written without a table read."""
        local = self.local_layer(layer, layer_id_override)
        loc, physical = full_write_loc(loc)
        store = self._physical_store if physical else self._store
        if cache_k.dim() == 2:
            cache_k = cache_k.view(-1, self.head_num, self.head_dim)
            cache_v = cache_v.view(-1, self.head_num, self.v_head_dim)
        try:
            store(local, loc if loc.dim() == 1 else loc.reshape(-1), cache_k, cache_v, k_scale, v_scale)
        except ValueError as exc:
            raise ValueError(f"layer {self.start_layer + local}: {exc}") from None

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        source = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        rows = {name: random_nonzero((loc.numel(), self.head_num, self.head_dim), source, generator, 2.0, self.device)
                for name in ("k", "v")}  # fmt: skip
        self.set_kv_buffer(layer, loc, rows["k"], rows["v"])
        return {name: x.to(self.dtype).view(self.store_dtype) for name, x in rows.items()}
