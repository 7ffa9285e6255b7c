"""SWATokenToKVPoolAllocator: full-attention and sliding-window slot allocators in step, and the map between them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from kvcore.allocators import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


class SWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Hands out *full* locations (what engines index requests with) and, with each, a sliding-window slot.

    Two sub-allocators move in step: ``full_attn_allocator`` over ``size`` tokens and ``swa_attn_allocator``
    over ``size_swa``, both token allocators for ``page_size == 1`` and paged ones otherwise (a token keeps its
    offset within its page on both sides).  ``full_to_swa_index_mapping[t]`` is the window slot of full
    location ``t``; entry 0 stays 0, so a padding or absent location maps to the padding slot.  Tokens that
    slid out of every window give their window slots back early with :meth:`free_swa` (their full slots stay
    until :meth:`free`); the window side gives back whole pages, so every token of such a page then maps to the
    padding slot.  A model whose layers all slide uses the full side only as location space.

    Every call has the signature of :class:`~kvcore.allocators.PagedTokenToKVPoolAllocator`'s; an allocation
    that does not fit on either side returns None and leaves both sides as they were.

    :param kvcache: the :class:`~kvcore_swa.pool.SWAKVPool`; the mapping is registered with it.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kvcache: Any,
        need_sort: bool,
        kernels: str = "auto",
    ):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort, kernels)
        self.size_swa = int(size_swa)
        self.full_attn_allocator = self._new_side(self.size, swa=False)
        self.swa_attn_allocator = self._new_side(self.size_swa, swa=True)
        self.full_to_swa_index_mapping = torch.zeros(self.size + self.page_size, dtype=torch.int64, device=self.device)
        # The map as one row per full page (page 0, the padding one, included): a view, so clearing a row clears
        # the registered map.  Pages past the last whole one are never handed out and have no row.
        rows = self.size // self.page_size + 1
        self._mapping_by_full_page = self.full_to_swa_index_mapping[: rows * self.page_size].view(rows, self.page_size)
        register = getattr(kvcache, "register_mapping", None)
        if register is not None:
            register(self.full_to_swa_index_mapping)

    @classmethod
    def for_plan(cls, request: Any, pool: Any, sizes: Any) -> SWATokenToKVPoolAllocator:
        """The allocator a plugin's ``kvcore_choose_allocator`` pairs with ``pool``: the plan's ``tokens`` and
        ``swa_tokens``, the request's page, dtype, device, kernels and sorting (both disaggregation modes)."""
        return cls(sizes["tokens"], sizes["swa_tokens"], page_size=request.page_size, dtype=request.kv_dtype,
                   device=request.device, kvcache=pool, need_sort=request.mode.need_sort, kernels=request.kernels)  # fmt: skip

    # -- queries ------------------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Tokens that can be allocated: the smaller side."""
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def debug_print(self) -> str:
        return (f"SWATokenToKVPoolAllocator: full {self.full_available_size()} of {self.size}, "
                f"sliding-window {self.swa_available_size()} of {self.size_swa} tokens available")  # fmt: skip

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """Window slots of full locations (negative locations, ``-1`` for "none", stay as they are)."""
        return self._window_slots(kv_indices)

    # -- hooks (a subclass over other sub-allocators overrides them) ----------------------------------------

    def _new_side(self, tokens: int, swa: bool) -> BaseTokenToKVPoolAllocator:
        """The full (``swa=False``) or window sub-allocator of ``tokens`` tokens, built once each by the
        constructor: a token allocator for ``page_size == 1``, a paged one otherwise."""
        if self.page_size == 1:
            return TokenToKVPoolAllocator(tokens, self.dtype, self.device, self._kvcache, self.need_sort, self.kernels)
        return PagedTokenToKVPoolAllocator(tokens, self.page_size, self.dtype, self.device, self._kvcache,
                                           self.need_sort, self.kernels)  # fmt: skip

    def _full_undo(self) -> Callable[[torch.Tensor], None]:
        """Called before the full side allocates: what takes that allocation back (given the full locations it
        handed out) when the window side then does not fit.  Restores a :meth:`backup_state` of the full side
        taken now."""
        state = self.full_attn_allocator.backup_state()
        return lambda full: self.full_attn_allocator.restore_state(state)

    def _window_slots(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """The window sub-allocator's slots of full locations, what its ``last_loc`` is given in (negative
        locations stay as they are)."""
        idx = kv_indices.long()
        return torch.where(idx >= 0, self.full_to_swa_index_mapping[idx.clamp(min=0)], idx)

    # -- state --------------------------------------------------------------------------------------------

    def backup_state(self):
        """Both sides' free lists and a copy of the full -> window map (SGLang keeps no copy of the map, so a
        request freed after its backup would come back live but mapped to the padding slot, and its window
        slots would leak when it is freed again)."""
        return (self.full_attn_allocator.backup_state(), self.swa_attn_allocator.backup_state(),
                self.full_to_swa_index_mapping.clone())  # fmt: skip

    def restore_state(self, state) -> None:
        full, swa, mapping = state
        self.full_attn_allocator.restore_state(full)
        self.swa_attn_allocator.restore_state(swa)
        self.full_to_swa_index_mapping.copy_(mapping)

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping.zero_()
        self.is_not_in_free_group = True
        self.free_group = []

    def merge_and_sort_free(self) -> None:
        self.full_attn_allocator.merge_and_sort_free()
        self.swa_attn_allocator.merge_and_sort_free()

    # -- allocation ---------------------------------------------------------------------------------------

    def _pair(self, full: Optional[torch.Tensor], undo: Callable[[torch.Tensor], None],
              swa_call) -> Optional[torch.Tensor]:  # fmt: skip
        """Finish an allocation: the window side's, or roll the full side back when it does not fit."""
        if full is None:
            return None
        swa = swa_call()
        if swa is None:
            undo(full)
            return None
        self.full_to_swa_index_mapping[full] = swa
        return full

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` full locations (whole pages when paged), each with a window slot."""
        if need_size > self.available_size():
            return None
        undo = self._full_undo()
        return self._pair(self.full_attn_allocator.alloc(need_size), undo, lambda: self.swa_attn_allocator.alloc(need_size))

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        seq_lens_cpu: Optional[torch.Tensor] = None,
        last_loc: Optional[torch.Tensor] = None,
        extend_num_tokens: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """As :meth:`PagedTokenToKVPoolAllocator.alloc_extend`, on both sides (the window side continues each
        request's last window page, found through the mapping)."""
        undo = self._full_undo()
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )  # fmt: skip
        return self._pair(full, undo, lambda: self.swa_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, self._window_slots(last_loc),
            extend_num_tokens,
        ))  # fmt: skip

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: Optional[torch.Tensor] = None, last_loc: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """As :meth:`PagedTokenToKVPoolAllocator.alloc_decode`, on both sides."""
        undo = self._full_undo()
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        return self._pair(full, undo, lambda: self.swa_attn_allocator.alloc_decode(
            seq_lens, seq_lens_cpu, self._window_slots(last_loc)
        ))  # fmt: skip

    # -- freeing ------------------------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Give back full locations and their window slots (held until :meth:`free_group_end` inside a group)."""
        if free_index.numel() == 0 or self._hold_in_group(free_index):
            return
        self.full_attn_allocator.free(free_index)
        self.free_swa(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Give back the window slots of full locations ``free_index`` (tokens that slid out of every window);
        their full slots stay allocated until :meth:`free`.

        The window side gives slots back by whole pages, so with ``page_size > 1`` *every* token of each full
        page holding one of ``free_index`` loses its window slot and maps to the padding slot from then on, not
        only the tokens named (as SGLang): a window page given back must not stay mapped by its other tokens,
        which would write into it, or free it again, after it was handed to another request.  Free a prefix
        of a request's tokens ending at a page boundary to keep the rest of the page in the window.

        Idempotent: a location whose page was cleared (or never allocated, or the padding one) maps to the
        padding slot, which the window side ignores.  Locations outside the map are ignored too.  Never waits
        for the device (fixed-shape gathers and scatters, no masks).  Not held by a free group: the window
        slots come back at once, as in SGLang (:meth:`free` inside a group holds both sides).
        """
        if free_index.numel() == 0:
            return
        pages = self._full_pages_of(free_index)
        # A request fills each of its pages from offset 0, and the entries of a page are cleared together, so
        # the first entry of a page is its window page's first slot while the page holds one, and 0 after.
        self.swa_attn_allocator.free(self._mapping_by_full_page[pages, 0])
        self._mapping_by_full_page[pages] = 0

    def _full_pages_of(self, free_index: torch.Tensor) -> torch.Tensor:
        """The full page of each location of ``free_index`` (flat int64; a location no page holds, negative
        or past the last whole page, counts as the padding page 0)."""
        idx = free_index.reshape(-1).long()
        inside = (idx >= 0) & (idx < self._mapping_by_full_page.numel())
        return torch.where(inside, idx, torch.zeros_like(idx)) // self.page_size
