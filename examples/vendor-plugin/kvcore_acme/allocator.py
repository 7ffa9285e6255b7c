"""The acme allocator: pages handed out most recently freed first (their lines are likeliest still in cache).

It implements the allocator API engines call (SGLang's names and argument order) on its own bookkeeping: a
device tensor of free page ids, the next to hand out at the front.  kvcore's allocator conformance
(:class:`kvcore.testing.BackendAllocatorConformance`) drives it through random request lifetimes.

For brevity it reads page counts back to the host (one sync per allocation); kvcore's own allocators use the
``*_cpu`` length copies engines pass instead.
"""

from __future__ import annotations

import torch


class AcmePageAllocator:
    """Hands out token locations of ``size // page_size`` pages (page 0 is the pool's padding, never handed out).

    :param size: tokens, whole pages.
    :param kvcache: the pool the locations index (``get_kvcache()``).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache=None):
        if size <= 0 or size % page_size:
            raise ValueError(f"AcmePageAllocator needs a positive whole number of pages, got {size} tokens of pages of {page_size}")
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, torch.device(device)
        self.num_pages = size // page_size
        self._kvcache = kvcache
        self.clear()

    # -- state ------------------------------------------------------------------------------------------------

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._group: list[torch.Tensor] | None = None

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def get_kvcache(self):
        return self._kvcache

    def backup_state(self) -> torch.Tensor:
        return self.free_pages  # never modified in place: every change assigns a new tensor

    def restore_state(self, state: torch.Tensor) -> None:
        self.free_pages = state

    # -- allocation -------------------------------------------------------------------------------------------

    def _take(self, pages: int) -> torch.Tensor | None:
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return taken

    def _first_tokens(self, pages: torch.Tensor) -> torch.Tensor:
        return pages * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` tokens of whole new pages, or None (nothing taken)."""
        if need_size % self.page_size:
            raise ValueError(f"alloc takes whole pages of {self.page_size} tokens, got {need_size}")
        pages = self._take(need_size // self.page_size)
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, device=self.device)
        return (self._first_tokens(pages)[:, None] + offsets).reshape(-1)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens: int):
        """Locations for tokens ``prefix_lens[i] .. seq_lens[i] - 1`` of every request: first the rest of its
        last page (after ``last_loc[i]``), then new pages.  None, taking nothing, when too few pages are free."""
        ps = self.page_size
        pre, seq = prefix_lens.long(), seq_lens.long()
        old_pages = torch.div(pre + ps - 1, ps, rounding_mode="floor")
        new_pages = torch.div(seq + ps - 1, ps, rounding_mode="floor") - old_pages
        pages = self._take(int(new_pages.sum()))
        if pages is None:
            return None
        counts = seq - pre
        req = torch.repeat_interleave(torch.arange(len(seq), device=self.device), counts, output_size=extend_num_tokens)
        first = torch.cumsum(counts, 0) - counts
        token = pre[req] + torch.arange(extend_num_tokens, device=self.device) - first[req]  # position in its request
        in_last_page = token < old_pages[req] * ps
        out = last_loc.long()[req] + (token - pre[req] + 1)
        if len(pages):
            page = (torch.cumsum(new_pages, 0) - new_pages)[req] + torch.div(token, ps, rounding_mode="floor") - old_pages[req]
            fresh = self._first_tokens(pages[page.clamp(0, len(pages) - 1)]) + token % ps
            out = torch.where(in_last_page, out, fresh)
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu=None, last_loc=None):
        """One location per request for its token ``seq_lens[i] - 1``: after ``last_loc[i]``, or the first
        token of a new page when that token starts one."""
        starts_page = (seq_lens.long() - 1) % self.page_size == 0
        pages = self._take(int(starts_page.sum()))
        if pages is None:
            return None
        out = last_loc.long() + 1
        if len(pages):
            fresh = self._first_tokens(pages[(torch.cumsum(starts_page.long(), 0) - 1).clamp(min=0)])
            out = torch.where(starts_page, fresh, out)
        return out

    # -- freeing ----------------------------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Free every page of ``free_index`` (all tokens of finished requests); they are handed out next."""
        if free_index.numel() == 0:
            return
        if self._group is not None:
            self._group.append(free_index.clone())
            return
        pages = torch.unique(torch.div(free_index.long(), self.page_size, rounding_mode="floor"))
        self.free_pages = torch.cat((pages, self.free_pages))

    def free_group_begin(self) -> None:
        if self._group is not None:
            raise RuntimeError(f"free_group_begin inside an open free group ({len(self._group)} frees pending)")
        self._group = []

    def free_group_end(self) -> None:
        group, self._group = self._group or [], None
        if group:
            self.free(torch.cat(group))
