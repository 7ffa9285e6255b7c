"""The page-major MLA pool: one buffer whose unit is a page of all layers' latent rows.

``kv_cache`` is ``[1, pages + 1, layer_num, page_size, kv_cache_dim]``: page ``p`` holds, for every layer, the latent
rows of its ``page_size`` tokens, so a page's bytes are contiguous and a transfer engine, the CPU offload or the
owner of the memory moves a whole page (all layers) as one block (``get_contiguous_buf_infos`` reports one item =
one page of all layers).  Page 0 is padding; the leading 1 is the stacked-buffer dimension every kvcore buffer has.
:func:`~kvcore_mla.layout.mla_layout` with ``page_major=True`` declares it (the same bytes per token as the
token-major pool's).

For kvcore's own paths the pool describes its rows (:meth:`PageMajorMLATokenToKVPool.token_rows`): the buffer seen
as rows of ``[1, kv_cache_dim]`` with a layer stride of ``page_size`` rows, where token ``t``'s row is ``(t //
page_size) * (layer_num * page_size) + t % page_size``.  Those views overlap between layers (distinct layers' rows
never share bytes for the same token).  The stores and gathers are :class:`MLATokenToKVPool`'s (the same checks,
the same one-launch kernels) over those rows, a token's row computed inside the launch; the row moves, CPU offload
and the conformance kit work through the same rows.

**Pages over given memory, mapped** (``memory=`` and ``virtual_pages=``): a composite pool can lay the pages over a
byte range it owns (a unified memory shared with other state) and hand out *virtual* token ids whose pages it maps
to physical pages itself, moving pages as it compacts its range (:meth:`PageMajorMLATokenToKVPool.remap_pages`).
Every virtual token then goes through a virtual -> physical token table (on the pool's device; the stores, the
gathers, the row moves, CPU offload and the kit read it: one gather before the launch); a virtual page not mapped
is on the padding page.  Attention reads the paged views by physical page:
:meth:`PageMajorMLATokenToKVPool.translate_loc` gives the physical tokens, and an engine that takes them once per
step passes them to the stores and gathers as a :class:`~kvcore.pools.KVWriteLoc` marked physical, which reads
no table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcore.pools import PageMajorPages, full_write_loc, lay_over
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_mla.kernels import LatentRows
from kvcore_mla.pool import MLATokenToKVPool, _latent_output_check

__all__ = ["PageMajorMLATokenToKVPool"]


class PageMajorMLATokenToKVPool(PageMajorPages, MLATokenToKVPool):
    """Latent KV rows of MLA layers, page-major (see the module docstring): :class:`MLATokenToKVPool`'s
    constructor keywords with the same meaning (fp8 stored as uint8, ``kv_cache_dim`` widening the row), and its
    stores and reads with the same semantics (:meth:`set_kv_buffer`, :meth:`set_mla_kv_buffer`,
    :meth:`get_mla_kv_buffer`), by token.  A subclass of it, so a composite that takes an ``MLATokenToKVPool``
    class (``HybridLinearKVPool``'s ``full_kv_pool_class``) takes this one too.

    ``kv_buffer[i]`` is local layer ``i``'s paged view ``[pages + 1, page_size, 1, kv_cache_dim]`` (its page stride
    spans all layers), which :meth:`get_key_buffer` returns as ``dtype``; :meth:`get_value_buffer` is its first
    ``kv_lora_rank`` columns.  The views are indexed by physical page (:meth:`translate_loc`).

    :param memory: a contiguous 1-D uint8 tensor on ``device`` the buffer is laid over, from its first byte (it
        must hold the buffer's bytes and start on an element boundary of the storage dtype); None: a zeroed
        buffer of the pool's own.
    :param virtual_pages: the highest virtual page id the owner hands out (ids ``0 .. virtual_pages``, 0 padding):
        every token is then virtual, mapped by :meth:`remap_pages`; None: tokens are physical.
    :param padding_page: with ``virtual_pages``: the physical page every virtual page sits on until it is mapped
        (the owner's padding page; 0 by default).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None, kv_cache_dim: int | None = None, kernels: str = "auto",
                 memory: torch.Tensor | None = None, virtual_pages: int | None = None,
                 padding_page: int = 0):  # fmt: skip
        # what _create_buffers lays out
        self._given_memory, self._virtual_pages, self._padding_page = memory, virtual_pages, padding_page
        super().__init__(size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device,
                         enable_memory_saver, start_layer, end_layer, kv_cache_dim, kernels)  # fmt: skip

    def _create_buffers(self) -> None:
        """The page-major buffer, its per-layer paged views, its rows and the token -> row table."""
        page, layers, width = self.page_size, self.layer_num, self.kv_cache_dim
        pages = self.size // page + 1
        shape = (1, pages, layers, page, width)
        if self._given_memory is None:
            self.kv_cache = torch.zeros(shape, dtype=self.store_dtype, device=self.device)
        else:
            self.kv_cache = lay_over(self._given_memory, shape, self.store_dtype, torch.device(self.device))
        self.kv_buffer = [self.kv_cache[0, :, layer].unsqueeze(2) for layer in range(layers)]
        self.rows_per_page = layers * page
        rows = (pages - 1) * self.rows_per_page + page  # the last layer's last row, plus one
        self._latent_rows = self.kv_cache.as_strided((layers, rows, 1, width), (page * width, width, width, 1),
                                                     self.kv_cache.storage_offset())  # fmt: skip
        #: the rows by physical token
        self._rows_by_physical_token = TokenRows(self._latent_rows, page, self.rows_per_page)
        self._token_table(self.size, self._virtual_pages, self._padding_page)
        #: stores and gathers by physical token (rows computed in the launch)
        self._physical_io = LatentRows(self._latent_rows, self.dtype, self._use_triton,
                                       pages=(page, self.rows_per_page))  # fmt: skip
        #: by the pool's tokens: virtual ones through the token table first
        self._rows = self._physical_io if self._token_of is None else _RowsByToken(self._physical_io, self._token_of)
        self._out_check = _latent_output_check(self.kv_lora_rank, self.qk_rope_head_dim)
        self._offsets = torch.arange(page, device=self.device)

    # -- layout -----------------------------------------------------------------------------------------------

    def token_rows(self) -> dict[str, TokenRows]:
        return {"kv": TokenRows(self._latent_rows, self.page_size, self.rows_per_page, index_map=self._token_of)}

    def _physical_rows(self) -> TokenRows:
        return self._rows_by_physical_token

    def _rows_at(self, loc_info):
        """A :class:`~kvcore.pools.KVWriteLoc` marked physical goes to the rows by physical token (no table
        read); one not marked, through the pool's tokens."""
        loc, physical = full_write_loc(loc_info)
        return (self._physical_io if physical else self._rows), loc

    def move_groups(self) -> list[tuple[TokenRows, TokenRows | None]]:
        """The latent rows by physical token (:meth:`move_kv_cache` translates virtual tokens)."""
        if self._move_groups is None:
            self._move_groups = [(self._rows_by_physical_token, None)]
        return self._move_groups

    # -- writes -----------------------------------------------------------------------------------------------

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """As :meth:`MLATokenToKVPool.self_test_write` (random rows through :meth:`set_mla_kv_buffer`, from nope/rope
        views of one wider projection), the rows before and after found through :meth:`token_rows`."""
        source_dtype = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        rank, width = self.kv_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim
        values = random_nonzero((loc.numel(), 1, width + 3), source_dtype, generator, 2.0, self.device)
        expected = self.token_rows()["kv"].take(loc, self.local_layer(layer))  # columns past the rope key stay
        self.set_mla_kv_buffer(layer, loc, values[..., :rank], values[..., rank:width])
        expected[..., :width] = values[..., :width].to(self.dtype).view(self.store_dtype)
        return {"kv": expected}

class _RowsByToken:
    """A pool's :class:`~kvcore_mla.kernels.LatentRows` by physical token, addressed by virtual token: every
    call's ``loc`` becomes physical tokens ``token_of[loc]`` (one gather on the device, no host sync), then the
    same launch as :class:`MLATokenToKVPool`'s.  Only the calls the pool makes, with their arguments."""

    __slots__ = ("rows", "token_of")

    def __init__(self, rows: LatentRows, token_of: torch.Tensor):
        self.rows, self.token_of = rows, token_of

    def store(self, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
              ) -> None:  # fmt: skip
        self.rows.store(layer_index, self.token_of[loc], cache_k_nope, cache_k_rope)

    def store_rows(self, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        self.rows.store_rows(layer_index, self.token_of[loc], cache_k)

    def gather_new(self, layer_index: int, loc: torch.Tensor, dtype: torch.dtype, a_width: int, b_width: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return self.rows.gather_new(layer_index, self.token_of[loc], dtype, a_width, b_width)

    def gather(self, layer_index: int, loc: torch.Tensor, out_nope: torch.Tensor, out_rope: torch.Tensor,
               check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> None:  # fmt: skip
        self.rows.gather(layer_index, self.token_of[loc], out_nope, out_rope, check=check)
