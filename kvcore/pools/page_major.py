"""What the page-major pools share (:class:`PageMajorPages`) and how a pool lays its buffer over memory another owns
(:func:`lay_over`): one buffer whose unit is a page of every layer, optionally over a unified memory with virtual
pages."""

from __future__ import annotations

import torch

from kvcore.token_rows import TokenRows

__all__ = ["PageMajorPages", "lay_over"]


def lay_over(memory: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``shape`` of ``dtype`` over the first bytes of ``memory`` (a contiguous 1-D uint8 tensor on ``device`` that
    starts on an element boundary): how a pool lays its buffer over memory a composite owns (a unified memory)."""
    need = dtype.itemsize
    for extent in shape:
        need *= extent
    if memory.dtype != torch.uint8 or memory.dim() != 1 or not memory.is_contiguous():
        raise ValueError(f"memory must be a contiguous 1-D uint8 tensor, got {memory.dtype} {tuple(memory.shape)}")
    if memory.device.type != device.type or device.index not in (None, memory.device.index):
        raise ValueError(f"memory is on {memory.device}, the pool on {device}")
    if memory.numel() < need:
        raise ValueError(f"the pages need {need} bytes, memory holds {memory.numel()}")
    if memory.data_ptr() % dtype.itemsize:
        raise ValueError(f"memory must start on a {dtype.itemsize}-byte boundary for {dtype} rows")
    return memory[:need].view(dtype).view(shape)


class PageMajorPages:
    """What the page-major pools share (``kvcore_mha``'s and ``kvcore_mla``'s, mixed in before :class:`KVCache`):
    ``kv_cache`` is ``[1, pages + 1, ...]`` with one page of every layer contiguous; whole pages move and go to
    the host as blocks; and, built with virtual pages, every token goes through a virtual -> physical token table.

    The pool sets ``kv_cache``, ``_offsets`` (``arange(page_size)``), ``_token_of`` (the virtual -> physical
    token table, or None when tokens are physical: :meth:`_token_table`) and :meth:`_physical_rows` (its rows by
    physical token)."""

    def _physical_rows(self) -> TokenRows:
        raise NotImplementedError

    def _token_table(self, size: int, virtual_pages: int | None, padding_page: int) -> None:
        """Set ``_token_of``: None (tokens are physical), or with ``virtual_pages`` the virtual -> physical token
        table, every virtual page (``0 .. virtual_pages``) on physical page ``padding_page``."""
        page = self.page_size
        if virtual_pages is None:
            self._token_of = None
            return
        self._token_of = (torch.arange(page, device=self.device) + padding_page * page).repeat(int(virtual_pages) + 1)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """:meth:`KVCache.move_kv_cache`, virtual tokens translated to their physical ones first
        (:meth:`translate_loc`)."""
        if self._token_of is not None:
            tgt_loc, src_loc = self.translate_loc(tgt_loc), self.translate_loc(src_loc)
        super().move_kv_cache(tgt_loc, src_loc)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """One buffer: (pointer, bytes, bytes of one page of all layers)."""
        pages = self.kv_cache[0]
        return [pages.data_ptr()], [pages.nbytes], [pages[0].nbytes]

    # -- virtual pages (a pool built with virtual_pages=) --------------------------------------------------------

    def remap_pages(self, virtual: torch.Tensor, physical: torch.Tensor) -> None:
        """Map virtual pages ``virtual`` to physical pages ``physical`` (1-D int tensors of one length on the pool's
        device; a page not in use goes to a padding page, 0 unless the owner says otherwise): the stores, the
        reads through :meth:`translate_loc` and the row moves use the new places from the next launch on.  Moves
        no bytes (the caller copies a page's envelope with :meth:`move_pages` before remapping it).

        :raises ValueError: for a pool built without ``virtual_pages``, or tensors not 1-D of one length.
        """
        if self._token_of is None:
            raise ValueError(f"{type(self).__name__} was built without virtual_pages=: its tokens are physical")
        if virtual.shape != physical.shape or virtual.dim() != 1:
            raise ValueError(f"remap_pages takes two 1-D tensors of one length, got {tuple(virtual.shape)} and "
                             f"{tuple(physical.shape)}")  # fmt: skip
        page = self.page_size
        tokens = physical.to(torch.int64)[:, None] * page + self._offsets
        virtual = virtual.to(torch.int64)
        self._token_of.view(-1, page)[virtual] = tokens

    def translate_loc(self, loc: torch.Tensor) -> torch.Tensor:
        """The physical tokens of tokens ``loc`` (int64, ``loc``'s shape): what indexes the paged views
        ``get_key_buffer`` returns (page ``t // page_size``, row ``t % page_size``).  The tokens themselves when
        the pool has no virtual pages."""
        if self._token_of is None:
            return loc.to(torch.int64)
        return self._token_of[loc.long()]

    # -- whole pages ------------------------------------------------------------------------------------------

    def whole_pages(self, indices: torch.Tensor) -> torch.Tensor | None:
        """The physical pages tokens ``indices`` cover when they are whole pages, each in order (``p * page_size +
        0 ..``, after :meth:`translate_loc`); None otherwise.  Reads the indices (a host sync), as CPU offload does
        anyway."""
        flat = self.translate_loc(indices.reshape(-1))
        if flat.numel() == 0 or flat.numel() % self.page_size:
            return None
        grid = flat.view(-1, self.page_size)
        first = grid[:, 0]
        if not bool(((first % self.page_size == 0) & (grid == first[:, None] + self._offsets).all(1)).all()):
            return None
        return torch.div(first, self.page_size, rounding_mode="floor")

    def move_pages(self, tgt_pages: torch.Tensor, src_pages: torch.Tensor) -> None:
        """Copy whole physical pages (all layers) ``src_pages`` -> ``tgt_pages``: one block per page, as if every
        source were read first (overlapping sets are safe; targets distinct)."""
        self.kv_cache[0, tgt_pages.long()] = self.kv_cache[0, src_pages.long()]

    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices=None, req_pool_index=None):
        """Whole pages are copied as page blocks (``{"pages": [n, ...]}``, one contiguous block of all layers per
        page); other index sets row by row, as every pool does."""
        pages = self.whole_pages(indices)
        if pages is None:
            return super().get_cpu_copy(indices)
        return {"pages": self.kv_cache[0, pages].to("cpu")}  # a blocking copy: done when it returns

    def load_cpu_copy(self, kv_cache_cpu, indices: torch.Tensor, mamba_indices=None, req_pool_index=None) -> None:
        """Write a :meth:`get_cpu_copy` result back at tokens ``indices``: a copy of whole pages into as many whole
        pages, a copy of rows as every pool does.

        :raises ValueError: for a copy of whole pages and ``indices`` that are not as many whole pages."""
        if "pages" not in kv_cache_cpu:
            return super().load_cpu_copy(kv_cache_cpu, indices)
        pages = self.whole_pages(indices)
        blocks = kv_cache_cpu["pages"]
        if pages is None or pages.numel() != blocks.shape[0]:
            raise ValueError(f"a copy of {blocks.shape[0]} whole pages loads into as many whole pages, got "
                             f"{indices.numel()} locations that are not")  # fmt: skip
        self.kv_cache[0, pages] = blocks.to(self.kv_cache.device)
