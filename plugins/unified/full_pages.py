"""SGLang's paged token allocator over one side of a unified memory (:class:`UnifiedPagedAllocator`): the
full-attention pages of a hybrid model on the low side, or a sliding-window model's window pages on the high side.

The engine holds *virtual* token ids: page ``v`` (a virtual id of the allocator's side) holds tokens
``v * page_size .. v * page_size + page_size - 1``, whatever physical page its envelope sits on.  The allocator
takes pages from the shared range (so they compete with the high side's units for its bytes), maps them in the
page-major pool laid over the memory (``remap_pages``), and when its side compacts it copies the moved
envelopes (``move_pages``) and maps their virtual pages to the new places, in that order on the pool's device:
ids the engine holds stay valid, their bytes unchanged.

``alloc_extend`` and ``alloc_decode`` hand out locations in SGLang's order (a request fills its last page from
``last_loc + 1``, then takes new pages), computed by kvcore's allocation kernels from the pages taken.  They count
the pages a call needs on the host, from the CPU copies of the lengths (``prefix_lens_cpu`` / ``seq_lens_cpu``,
which SGLang passes; without them the counts are read from the device, a sync).  ``free`` does not wait for the
device: the freed locations reach the host behind the queued work and their pages go back at the side's next query
or allocation (:meth:`~kvcore_unified.memory.UnifiedMemory.free_later`); the memory compacts as it was built to
(lazily by default: when the other side needs the bytes, or at ``flush``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from kvcore.allocators import BaseTokenToKVPoolAllocator
from kvcore.errors import ConfigError
from kvcore.kernels import allocator_kernels as _k
from kvcore.kernels.dtypes import storage_dtype
from kvcore.kernels.free_list import PageSource
from kvcore_unified.allocator import LOW
from kvcore_unified.memory import UnifiedMemory

__all__ = ["UnifiedPagedAllocator", "kv_page_bytes", "latent_page_bytes", "written_into"]


def kv_page_bytes(layers: int, page_size: int, head_num: int, head_dim: int, dtype: torch.dtype) -> int:
    """One page of every layer of a page-major MHA pool (its K and V rows): a unit of a unified memory's side."""
    return layers * 2 * page_size * head_num * head_dim * storage_dtype(dtype).itemsize


def latent_page_bytes(layers: int, page_size: int, kv_cache_dim: int, dtype: torch.dtype) -> int:
    """One page of every layer of a page-major MLA pool (its latent rows of ``kv_cache_dim``)."""
    return layers * page_size * kv_cache_dim * storage_dtype(dtype).itemsize


def written_into(out: Optional[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """``values``, or copied into ``out`` (a caller's fixed buffer, a captured graph's) and ``out`` returned."""
    if out is None:
        return values
    out.copy_(values)
    return out


class UnifiedPagedAllocator(BaseTokenToKVPoolAllocator):
    """Token pages from one side of ``memory`` (see the module docstring).

    :param memory: the unified memory; this allocator registers itself as the mover of its side.
    :param kvcache: a page-major pool laid over ``memory.side_memory(side)`` with ``virtual_pages`` = the side's
        virtual ids and ``padding_page`` = ``memory.padding_page(side)``
        (:class:`kvcore_mha.PageMajorMHATokenToKVPool`): anything with ``remap_pages`` over pages of
        the side's unit (whose bytes the memory moves, :meth:`UnifiedMemory.move_units`).
    :param page_size: tokens per page (the pool's).
    :param dtype: the KV dtype (recorded for the engine).
    :param device: the pool's device.
    :param need_sort: accepted as SGLang's paged allocator takes it; the unified pages are always handed out
        packed at the low end, so there is no deferred release to sort (``merge_and_sort_free`` does nothing).
    :param kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``native``.
    :param side: :data:`~kvcore_unified.allocator.LOW` (default) or :data:`~kvcore_unified.allocator.HIGH`.
    :param page_pool: the page-major pool the pages are mapped in, when ``kvcache`` (what :meth:`get_kvcache` returns
        to the engine) is a composite holding it (a hybrid model's KV pool); default ``kvcache`` itself.
    """

    def __init__(self, memory: UnifiedMemory, kvcache: Any, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, need_sort: bool = False, kernels: str = "auto", side: str = LOW,
                 page_pool: Any = None):  # fmt: skip
        pages = memory.allocator.available(side)
        if pages <= 0:
            raise ConfigError(f"the unified memory of {memory.capacity} bytes holds no page of "
                              f"{memory.unit_bytes(side)} bytes")  # fmt: skip
        super().__init__(pages * page_size, page_size, dtype, device, kvcache, need_sort, kernels)
        self.memory, self.side = memory, side
        self._page_pool = kvcache if page_pool is None else page_pool
        self._ends = memory.allocator
        self._offsets = torch.arange(page_size, device=self.device)
        memory.on_move(side, self._move)
        self.clear()

    # -- queries ------------------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Tokens the shared range can still give this side (the high side's units take from the same bytes)."""
        self.memory.settle_frees()
        return self._ends.available(self.side) * self.page_size

    @property
    def free_pages(self) -> torch.Tensor:
        """How many pages are free, as a tensor of that many ids: the ids the next allocations take (inspection)."""
        self.memory.settle_frees()
        count = self._ends.available(self.side)
        return torch.as_tensor(self._ends.free_ids(self.side)[:count], dtype=torch.int64)

    @property
    def release_pages(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64)

    # -- state --------------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free (their virtual pages back on the padding page); no free group open."""
        self.memory.settle_frees()
        used = self._ends.virtual(self.side)
        if used.size:
            self._free_tokens((used[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1))
        self.is_not_in_free_group = True
        self.free_group = []

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: freed pages go straight back to the shared range."""

    #: no ``backup_state`` / ``restore_state``: a free moves envelopes, so a snapshot of the tables would not
    #: describe the bytes later (the conformance kit reads this and leaves them out)
    supports_backup = False

    def backup_state(self) -> Any:
        raise NotImplementedError("a unified memory's allocator keeps no snapshot: its frees move envelopes")

    def restore_state(self, state: Any) -> None:
        raise NotImplementedError("a unified memory's allocator keeps no snapshot: its frees move envelopes")

    # -- translation (virtual tokens -> physical tokens) --------------------------------------------------------

    def translate_kv_loc(self, loc: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The physical tokens (int64, ``loc``'s shape) of this side's tokens ``loc``: what the pool's paged views
        are indexed by (page ``t // page_size``, row ``t % page_size``), the page-major pool's
        :meth:`~kvcore.pools.PageMajorPages.translate_loc`.  ``out``: an int64 tensor of ``loc``'s shape written
        in place (a captured graph's fixed buffer) and returned.  Valid until the memory next compacts (an
        allocation of either side may, and :meth:`UnifiedMemory.flush` does)."""
        return written_into(out, self._page_pool.translate_loc(loc))

    def translate_write_loc(self, loc: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                            out_width: Optional[int] = None) -> torch.Tensor:  # fmt: skip
        """The physical tokens of a step's write locations ``loc`` (``out_cache_loc``), taken once per step after its
        allocations and frees: wrap them in a :class:`~kvcore.pools.KVWriteLoc` marked ``physical`` for the
        stores, which then read no table.  ``out`` as :meth:`translate_kv_loc`'s; ``out_width`` (SGLang's, for a
        decode-context-parallel widening) is refused unless None or ``loc``'s length."""
        if out_width is not None and out_width != loc.numel():
            raise ValueError(f"translate_write_loc: out_width={out_width} widens the write ids for decode context "
                             f"parallelism, which the unified memory does not shard; pass out_width=None")  # fmt: skip
        return self.translate_kv_loc(loc, out=out)

    # -- allocation ---------------------------------------------------------------------------------------

    def _take(self, count: int) -> Optional[torch.Tensor]:
        """``count`` new virtual pages, mapped in the pool: int64 on the device, or None (nothing taken)."""
        self.memory.settle_frees()
        ids = self._ends.alloc(self.side, count)
        if ids is None:
            return None
        if not count:
            return torch.from_numpy(ids).to(self.device)
        # the virtual pages and their physical pages in one copy to the device
        both = torch.from_numpy(np.stack([ids, self.memory.page_of(self.side, self._ends.physical(self.side, ids))]))
        pages, physical = both.to(self.device).unbind(0)
        self._page_pool.remap_pages(pages, physical)
        return pages

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Whole pages for ``need_size`` tokens (a multiple of ``page_size``): their tokens, page after page."""
        if need_size % self.page_size:
            raise ValueError(f"alloc takes whole pages: need_size={need_size} is not a multiple of {self.page_size}")
        pages = self._take(need_size // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu=None, seq_lens=None, seq_lens_cpu=None, last_loc=None,
                     extend_num_tokens=None) -> Optional[torch.Tensor]:  # fmt: skip
        """SGLang's ``alloc_extend`` (:data:`kvcore.allocators.ALLOC_EXTEND_ORDER`); None when the shared range
        has too few free bytes."""
        pre = prefix_lens_cpu if prefix_lens_cpu is not None else prefix_lens
        seq = seq_lens_cpu if seq_lens_cpu is not None else seq_lens
        pages = self._take(_k.num_new_pages_extend(pre, seq, self.page_size))
        if pages is None:
            return None
        return self._extend_impl(prefix_lens, seq_lens, last_loc, PageSource.of(pages), self.page_size,
                                 int(extend_num_tokens))  # fmt: skip

    def alloc_decode(self, seq_lens, seq_lens_cpu=None, last_loc=None) -> Optional[torch.Tensor]:
        """SGLang's ``alloc_decode`` (:data:`kvcore.allocators.ALLOC_DECODE_ORDER`); None when the shared range
        has too few free bytes."""
        pages = self._take(_k.num_new_pages_decode(seq_lens_cpu if seq_lens_cpu is not None else seq_lens,
                                                   self.page_size))  # fmt: skip
        if pages is None:
            return None
        return self._decode_impl(seq_lens, last_loc, PageSource.of(pages), self.page_size)

    @property
    def _extend_impl(self):
        return _k.alloc_extend_triton if self._use_triton else _k.alloc_extend_native

    @property
    def _decode_impl(self):
        return _k.alloc_decode_triton if self._use_triton else _k.alloc_decode_native

    # -- frees and compaction -----------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Give back the pages of tokens ``free_index`` (inside a free group, at :meth:`free_group_end`).  Does not
        wait for the device: the tokens reach the host behind the queued work and the pages are given back at the
        side's next query or allocation (:meth:`UnifiedMemory.free_later`)."""
        if free_index.numel() == 0 or self._hold_in_group(free_index):
            return
        self.memory.free_later(free_index, self._free_tokens)

    def _free_tokens(self, tokens: np.ndarray) -> None:
        """The pages of host ``tokens`` back to the side (the padding page and pages not allocated ignored)."""
        pages = np.unique(tokens // self.page_size)
        pages = pages[pages > 0]
        self._ends.free(self.side, pages)
        if pages.size:  # the freed virtual pages back on the padding page: a stray write lands nowhere live
            freed = torch.from_numpy(pages).to(self.device)
            self._page_pool.remap_pages(freed, torch.full_like(freed, self.memory.padding_page(self.side)))

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Compaction of the side: copy physical units ``src`` to ``dst``, then map their virtual pages there."""
        moved = self._ends.virtual(self.side)[src]  # the virtual pages living at src, before the tables change
        self.memory.move_units(self.side, src, dst)  # a page of every layer is one unit of the side
        dst_pages = torch.from_numpy(self.memory.page_of(self.side, dst)).to(self.device)
        self._page_pool.remap_pages(torch.from_numpy(moved).to(self.device), dst_pages)
