"""Token-slot allocators over a KV cache: hand out and take back cache locations, one token or one page at a time.

The behaviour follows SGLang's ``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator`` (same class,
method and keyword names), so an engine written against those can use these.

Shared rules:

* Slot 0 (page 0 when paged) is padding and is never handed out; the free list starts at 1.  A paged
  allocator over ``size`` tokens has ``size // page_size`` pages, ids ``1 .. num_pages``, and token indices up
  to ``(num_pages + 1) * page_size - 1``: the KV buffer needs ``size + page_size`` slots.
* Both allocators keep their pages in a :class:`kvcore.kernels.free_list.FreePageList` on their device, with a
  FREE / ALLOCATED state per page: no call of the decode loop (``alloc_decode`` with ``seq_lens_cpu``,
  ``alloc_extend`` with the CPU copies, ``alloc``, ``free``, ``free_group_end``) waits for the device, and each
  is one kernel launch on a GPU.  Only ``available_size`` (exact by design) and an allocation that a nearly
  full pool may not fit wait.  A free ignores slots that are not allocated (a slot freed twice, the padding
  slot); ``free_pages`` / ``release_pages`` are read back from the device, for inspection, and
  :meth:`~BaseTokenToKVPoolAllocator.backup_state` is a copy-on-write snapshot.
* An allocation that does not fit returns ``None`` and leaves the allocator as it was.
* Freed pages are handed out again in SGLang's order: the paged allocator puts the pages of one ``free`` (or
  one free group) at the head of ``free_pages`` in ascending page order, the token allocator appends the
  slots of one ``free`` in the order given.
* ``need_sort=True`` defers freed slots to ``release_pages`` (appended, each free's pages in the order
  above); they are merged into ``free_pages`` and sorted only when an allocation would otherwise fall short,
  so allocations stay as contiguous as they can.
* Between :meth:`~BaseTokenToKVPoolAllocator.free_group_begin` and
  :meth:`~BaseTokenToKVPoolAllocator.free_group_end`, frees are held back (staged on the device at once, so the
  caller may reuse its tensor) and released together at the end; groups do not nest.
* ``alloc_extend`` and ``alloc_decode`` take SGLang's positional order, each device tensor followed by its
  optional CPU copy (see :data:`ALLOC_EXTEND_ORDER`, :data:`ALLOC_DECODE_ORDER`).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from kvcore.kernels import allocator_kernels as _k
from kvcore.errors import ConfigError
from kvcore.kernels.kernel_mode import use_triton
from kvcore.kernels.free_list import FreePageList

__all__ = [
    "ALLOC_DECODE_ORDER",
    "ALLOC_EXTEND_ORDER",
    "BaseTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "alloc_first_slots",
    "fill_to_pages",
    "get_num_new_pages",
    "take_mapped_slots",
]


ALLOC_EXTEND_ORDER = "alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)"
ALLOC_DECODE_ORDER = "alloc_decode(seq_lens, seq_lens_cpu, last_loc)"


def get_num_new_pages(seq_lens: torch.Tensor, page_size: int, prefix_lens: torch.Tensor) -> int:
    """Pages requests growing from ``prefix_lens`` to ``seq_lens`` tokens open (SGLang's helper; lengths read on
    the host: pass the CPU copies)."""
    seq, prefix = seq_lens.cpu().long(), prefix_lens.cpu().long()
    return int((-(-seq // page_size) - -(-prefix // page_size)).sum())


def take_mapped_slots(mapping: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The slots tokens ``indices`` are mapped to in ``mapping`` (their entries above 0, in order), the tokens
    unmapped (their entries set to 0): a request's device slots handed over to its device buffer (SGLang's HiSparse
    allocators)."""
    held = mapping[indices.long()]
    mapping[indices.long()] = 0
    return held[held > 0]


def alloc_first_slots(allocator: Any, n: int) -> Optional[torch.Tensor]:
    """``n`` slots of ``allocator``: the first ``n`` of the whole pages taken for them, or None (nothing taken) when
    it has too few free pages."""
    page = allocator.page_size
    taken = allocator.alloc(-(-n // page) * page)
    return None if taken is None else taken[:n]


def fill_to_pages(held: torch.Tensor, need_size: int, allocator: Any) -> torch.Tensor:
    """``held`` slots (in order, fewer than ``need_size``, whole pages of ``allocator.page_size``) completed to
    ``need_size``: the rest of the last held page, then new pages from ``allocator`` (what SGLang's HiSparse
    allocators do for a request's device buffer).

    :raises RuntimeError: when ``allocator`` has too few free pages.
    """
    page = allocator.page_size
    n = held.numel()
    if n % page:  # the rest of the last held page belongs to the buffer too
        held = torch.cat([held, torch.arange(int(held[-1]) + 1, int(held[-1]) + 1 + page - n % page, device=held.device)])
    extra = allocator.alloc(need_size - held.numel())
    if extra is None:
        raise RuntimeError(f"{need_size - held.numel()} more device slots needed for a buffer of {need_size}, "
                           f"{allocator.available_size()} free")  # fmt: skip
    return torch.cat([held, extra.to(held.dtype)])


def _check_call(order: str, tensors: dict[str, Any], optional: dict[str, Any]) -> None:
    """Required tensors present, optional CPU copies tensors or None.  The error spells out SGLang's order,
    which is what a call written for another order trips over."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            got = "nothing" if value is None else type(value).__name__
            raise TypeError(f"{name} must be a tensor, got {got}; the arguments are {order}")
    for name, value in optional.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a CPU tensor or None, got {type(value).__name__}; the arguments are {order}")


def _check_decode_call(seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> None:
    """:func:`_check_call` for ``alloc_decode``, with a fast path for the usual call (it runs every step)."""
    if isinstance(seq_lens, torch.Tensor) and isinstance(last_loc, torch.Tensor):
        if seq_lens_cpu is None or isinstance(seq_lens_cpu, torch.Tensor):
            return
    _check_call(ALLOC_DECODE_ORDER, {"seq_lens": seq_lens, "last_loc": last_loc}, {"seq_lens_cpu": seq_lens_cpu})


def _check_extend_call(prefix_lens: Any, prefix_lens_cpu: Any, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> None:
    """:func:`_check_call` for ``alloc_extend``, with a fast path for the usual call (it runs every prefill)."""
    tensor = torch.Tensor
    if isinstance(prefix_lens, tensor) and isinstance(seq_lens, tensor) and isinstance(last_loc, tensor):
        if (prefix_lens_cpu is None or isinstance(prefix_lens_cpu, tensor)) and (
            seq_lens_cpu is None or isinstance(seq_lens_cpu, tensor)
        ):
            return
    _check_call(ALLOC_EXTEND_ORDER, {"prefix_lens": prefix_lens, "seq_lens": seq_lens, "last_loc": last_loc},
                {"prefix_lens_cpu": prefix_lens_cpu, "seq_lens_cpu": seq_lens_cpu})  # fmt: skip


def _given(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _token_count(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise TypeError(f"extend_num_tokens must be an int, got {value!r}; the arguments are {ALLOC_EXTEND_ORDER}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"extend_num_tokens must be an int, got {type(value).__name__}; the arguments are {ALLOC_EXTEND_ORDER}"
        ) from None


class BaseTokenToKVPoolAllocator:
    """State and bookkeeping shared by the token and paged allocators.

    Subclasses implement :meth:`clear`, :meth:`alloc`, :meth:`free`, :meth:`alloc_extend` and
    :meth:`alloc_decode`.  ``free_pages`` / ``release_pages`` hold *page* ids (token ids when
    ``page_size == 1``).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kvcache: Any,
        need_sort: bool,
        kernels: str = "auto",
    ):
        if int(size) <= 0:
            raise ConfigError(f"allocator size must be a positive number of tokens, got size={size}")
        if int(page_size) <= 0:
            raise ConfigError(f"page_size must be a positive number of tokens, got page_size={page_size}")
        self.size = int(size)
        self.page_size = int(page_size)
        self.dtype = dtype
        self.device = torch.device(device)
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.kernels = kernels
        # Resolved once: raises ConfigError here, not on the first allocation, for a mode the device cannot run.
        self._use_triton = use_triton(kernels, self.device)

        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    # -- queries ------------------------------------------------------------------------------------------

    def debug_print(self) -> str:
        """One line on the free lists, for logs."""
        return (
            f"{type(self).__name__}: {len(self.free_pages)} free and {len(self.release_pages)} deferred "
            f"page(s) of {self.page_size} token(s); {self.available_size()} of {self.size} tokens available"
        )

    def available_size(self) -> int:
        """Tokens that can still be allocated (free plus deferred-release pages, times ``page_size``)."""
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def get_kvcache(self) -> Any:
        """The KV cache object this allocator hands out locations of."""
        return self._kvcache

    # -- state (subclasses implement) ----------------------------------------------------------------------

    def backup_state(self) -> Any:
        """Snapshot of the free lists, for :meth:`restore_state`."""
        raise NotImplementedError

    def restore_state(self, state: Any) -> None:
        """Put back the free lists saved by :meth:`backup_state`; allocations made since are forgotten."""
        raise NotImplementedError

    def clear(self) -> None:
        """Back to the fresh state: every slot but the padding one free, no free group open."""
        raise NotImplementedError

    # -- free groups --------------------------------------------------------------------------------------

    def free_group_begin(self) -> None:
        """Start collecting frees; they are released together by :meth:`free_group_end`.

        :raises RuntimeError: when a group is already open (its pending frees would be lost, as SGLang also
            refuses); end it first.
        """
        if not self.is_not_in_free_group:
            pending = sum(int(t.numel()) for t in self.free_group)
            raise RuntimeError(
                f"free_group_begin: a free group is already open with {pending} pending location(s); "
                "call free_group_end first (free groups do not nest)"
            )
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        """Release everything freed since :meth:`free_group_begin` in one go."""
        self.is_not_in_free_group = True
        if self.free_group:
            group, self.free_group = self.free_group, []
            self.free(torch.cat(group))

    # -- free-list maintenance ----------------------------------------------------------------------------

    def merge_and_sort_free(self) -> None:
        """Move deferred releases into the free list and sort it (``need_sort`` mode)."""
        raise NotImplementedError

    def _hold_in_group(self, free_index: torch.Tensor) -> bool:
        """Inside a free group, keep a copy of ``free_index`` for :meth:`free_group_end` and return True.

        A copy, because engines reuse their index tensors before the group ends; keeping the caller's tensor
        would free whatever it holds by then (the padding slot, or nothing)."""
        if self.is_not_in_free_group:
            return False
        self.free_group.append(free_index.clone())
        return True

    # -- to implement -------------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def free(self, free_index: torch.Tensor) -> None:
        raise NotImplementedError

    def alloc_extend(
        self, prefix_lens, prefix_lens_cpu=None, seq_lens=None, seq_lens_cpu=None, last_loc=None, extend_num_tokens=None
    ) -> Optional[torch.Tensor]:
        """See :data:`ALLOC_EXTEND_ORDER`."""
        raise NotImplementedError

    def alloc_decode(self, seq_lens, seq_lens_cpu=None, last_loc=None) -> Optional[torch.Tensor]:
        """See :data:`ALLOC_DECODE_ORDER`."""
        raise NotImplementedError

    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices=None, req_pool_index=None):
        """Host copy of the KV rows at ``indices`` (delegates to the pool).

        ``mamba_indices`` / ``req_pool_index`` (SGLang's retraction path) are passed on only when given, so a
        pool without per-request state need not accept them."""
        return self._kvcache.get_cpu_copy(indices, **_given(mamba_indices=mamba_indices, req_pool_index=req_pool_index))

    def load_cpu_copy(self, kv_cache_cpu, indices: torch.Tensor, mamba_indices=None, req_pool_index=None) -> None:
        """Write a :meth:`get_cpu_copy` result back at ``indices`` (delegates to the pool, like
        :meth:`get_cpu_copy`)."""
        self._kvcache.load_cpu_copy(
            kv_cache_cpu, indices, **_given(mamba_indices=mamba_indices, req_pool_index=req_pool_index)
        )


class _DeviceListAllocator(BaseTokenToKVPoolAllocator):
    """What the token and paged allocators share: their pages in a :class:`~kvcore.kernels.free_list.FreePageList`.

    ``free_pages`` / ``release_pages`` are read back from the device (for inspection; they wait for it).
    Frees inside a free group are staged on the device at once (the caller may reuse its tensor) and moved to
    the free list by :meth:`free_group_end`, so a group costs one launch per free plus one (an empty group,
    what most decode steps end, costs none).
    """

    _to_front = False  # where freed pages go in the free list
    _sort_each_free = False  # the pages of one free go in ascending order (else in order of first occurrence)

    def clear(self) -> None:
        if getattr(self, "_pages", None) is None:
            self._pages = FreePageList(self.size // self.page_size, self.page_size, self.device,
                                       use_triton=self._use_triton, to_front=self._to_front,
                                       need_sort=self.need_sort, sort_each_free=self._sort_each_free)  # fmt: skip
        else:
            self._pages.clear()
        self.is_not_in_free_group = True
        self.free_group = []

    @property
    def free_pages(self) -> torch.Tensor:
        """The free page ids in the order they will be handed out (waits for the device: for inspection)."""
        return self._pages.ids()

    @property
    def release_pages(self) -> torch.Tensor:
        """Freed pages deferred by ``need_sort`` (waits for the device: for inspection)."""
        return self._pages.held_ids()

    def available_size(self) -> int:
        """Exact: waits for the device on a GPU (the only call here that does, besides the inspections)."""
        free, held = self._pages.exact()
        return (free + held) * self.page_size

    def backup_state(self) -> tuple:
        """A copy-on-write snapshot: free until the next allocation or free, which copies the lists once."""
        return self._pages.snapshot()

    def restore_state(self, state: tuple) -> None:
        self._pages.restore(state)

    def merge_and_sort_free(self) -> None:
        if self._pages.exact()[1]:
            self._pages.merge_held()

    def _ensure_free_pages(self, num_pages: int) -> bool:
        """True when ``num_pages`` pages can be taken from the head of the free list; merges held pages when
        that is what makes them fit.  Decides from the host's counts: no wait while they show enough pages;
        only a nearly full pool waits for the device."""
        pages = self._pages
        if num_pages <= pages.known:
            return True
        for wait in (False, True):
            pages.refresh(wait)
            if num_pages <= pages.known:
                return True
            if num_pages <= pages.known + pages.held_known:
                pages.merge_held()
                return True
        return False

    def _source(self):
        self._pages.before_write()
        return self._pages.source()

    def _take_pages(self, num_pages: int) -> Optional[torch.Tensor]:
        """The token indices of ``num_pages`` whole pages from the head, or None when they do not fit."""
        if not self._ensure_free_pages(num_pages):
            return None
        out = self._pages_impl(self._source(), num_pages, self.page_size)
        self._pages.took(num_pages)
        return out

    # -- freeing ------------------------------------------------------------------------------------------

    def free_group_begin(self) -> None:
        """Start a group: frees are staged and given back together by :meth:`free_group_end`.

        :raises RuntimeError: when a group is already open; end it first (groups do not nest).
        """
        if not self.is_not_in_free_group:
            raise RuntimeError(
                "free_group_begin: a free group is already open (its frees are pending); call free_group_end "
                "first (free groups do not nest)"
            )
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        """Give back everything freed since :meth:`free_group_begin` as one free: its pages go in the order
        :meth:`free` gives the pages of one call (one launch; none for an empty group)."""
        if not self.is_not_in_free_group:
            self.is_not_in_free_group = True
            self._pages.commit_staged()

    def free(self, free_index: torch.Tensor) -> None:
        """Give back the pages holding ``free_index``, each allocated page once (slots that are not allocated,
        the padding one included, are ignored), in SGLang's order: the paged allocator puts them at the head of
        the free list in ascending page order (its ``torch.unique``), the token allocator at the tail in the
        order of their first occurrence; under ``need_sort`` they go to the end of ``release_pages`` in that
        same order.

        Empty input is a no-op; inside a free group the pages are staged until :meth:`free_group_end`, which
        gives them all back as one free.  Never waits for the device.
        """
        if free_index.numel():
            self._pages.release(free_index, staged=not self.is_not_in_free_group)


class TokenToKVPoolAllocator(_DeviceListAllocator):
    """Allocator of single token slots ``1 .. size`` (``page_size == 1``).

    Slots are taken from the head of the free list and freed slots go to its tail, in the order given (SGLang's
    order; a slot given twice, or not allocated, is dropped).

    :param size: number of allocatable token slots; the KV buffer needs ``size + 1`` (slot 0 is padding).
    :param dtype: KV cache dtype (recorded for the engine).
    :param device: device of the index tensors.
    :param kvcache: the KV cache object, returned by :meth:`get_kvcache`.
    :param need_sort: defer frees and hand out sorted slots (see the module docstring).
    :param kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``native``.
    :raises ConfigError: for a non-positive size or an unknown / unrunnable kernel mode.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kvcache: Any,
        need_sort: bool,
        kernels: str = "auto",
    ):
        super().__init__(size, 1, dtype, device, kvcache, need_sort, kernels)
        self._pages_impl = _k.alloc_pages_triton if self._use_triton else _k.alloc_pages_native
        self._pages = None
        self.clear()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Take ``need_size`` token slots from the head of the free list.

        :returns: int64 ``[need_size]`` token indices, or ``None`` (nothing changed) when fewer are free.
        """
        return self._take_pages(need_size)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        seq_lens_cpu: Optional[torch.Tensor] = None,
        last_loc: Optional[torch.Tensor] = None,
        extend_num_tokens: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """With one-token pages an extend is ``alloc(extend_num_tokens)``; the lengths are only checked for
        presence (SGLang's order, see :data:`ALLOC_EXTEND_ORDER`)."""
        _check_extend_call(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        return self.alloc(_token_count(extend_num_tokens))

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor] = None,
        last_loc: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """With one-token pages a decode step is ``alloc(len(seq_lens))`` (SGLang's order, see
        :data:`ALLOC_DECODE_ORDER`)."""
        _check_decode_call(seq_lens, seq_lens_cpu, last_loc)
        return self.alloc(seq_lens.numel())


class PagedTokenToKVPoolAllocator(_DeviceListAllocator):
    """Allocator of whole pages of ``page_size`` token slots; pages ``1 .. size // page_size``.

    Token index of offset ``o`` in page ``p`` is ``p * page_size + o``; the KV buffer needs
    ``(size // page_size + 1) * page_size`` slots (page 0 is padding).  The pages of one free (or of one free
    group) go to the head of the free list in ascending page order, reused first, as in SGLang (its ``free``
    puts ``torch.unique`` of the pages in front).

    :param size: allocatable tokens (rounded down to whole pages).
    :param page_size: tokens per page.
    :param dtype: KV cache dtype (recorded for the engine).
    :param device: device of the index tensors.
    :param kvcache: the KV cache object, returned by :meth:`get_kvcache`.
    :param need_sort: defer frees and hand out sorted pages (see the module docstring).
    :param kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``native``.
    :raises ConfigError: for a non-positive size or page size, a size under one page, or an unknown /
        unrunnable kernel mode.
    """

    _to_front = True
    _sort_each_free = True

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kvcache: Any,
        need_sort: bool,
        kernels: str = "auto",
    ):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort, kernels)
        self.num_pages = self.size // self.page_size
        if self.num_pages == 0:
            raise ConfigError(
                f"size={size} holds no whole page of page_size={page_size}; give a size of at least one page"
            )
        self._pages_impl = _k.alloc_pages_triton if self._use_triton else _k.alloc_pages_native
        self._pages = None
        self.clear()
        self._extend_step = _k.ExtendStep(self._pages, self.page_size, self._use_triton)
        self._decode_step = _k.DecodeStep(self._pages, self.page_size, self._use_triton)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Take ``need_size // page_size`` whole pages and return their token indices, page after page.

        :raises ValueError: when ``need_size`` is not a multiple of ``page_size``.
        :returns: int64 ``[need_size]``, or ``None`` (nothing changed) when too few pages are free.
        """
        if need_size % self.page_size != 0:
            raise ValueError(
                f"paged alloc needs whole pages: need_size={need_size} is not a multiple of "
                f"page_size={self.page_size}; round it up, or use alloc_extend for a partial last page"
            )
        return self._take_pages(need_size // self.page_size)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        seq_lens_cpu: Optional[torch.Tensor] = None,
        last_loc: Optional[torch.Tensor] = None,
        extend_num_tokens: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """Locations for tokens ``prefix_lens[i] .. seq_lens[i]-1`` of each request, concatenated in order.

        Each request first fills the rest of its last prefix page (from ``last_loc[i] + 1``), then takes
        new pages from the free list in request order.  The arguments are SGLang's, in its order
        (:data:`ALLOC_EXTEND_ORDER`); the CPU copies are optional.

        :param prefix_lens: ``[bs]`` tokens already cached per request (device).
        :param prefix_lens_cpu: CPU copy of ``prefix_lens``; with ``seq_lens_cpu`` it lets the page count be
            taken without a device sync (without them the device tensors are read, which syncs).
        :param seq_lens: ``[bs]`` sequence lengths after the extend (device).
        :param seq_lens_cpu: CPU copy of ``seq_lens``.
        :param last_loc: ``[bs]`` token index of each request's last prefix token (read only when the prefix
            ends inside a page; ``-1`` otherwise by habit).
        :param extend_num_tokens: ``sum(seq_lens - prefix_lens)``.
        :returns: int64 ``[extend_num_tokens]``, or ``None`` (nothing changed) when too few pages are free.
        """
        _check_extend_call(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        extend_num_tokens = extend_num_tokens if type(extend_num_tokens) is int else _token_count(extend_num_tokens)
        if prefix_lens_cpu is not None and seq_lens_cpu is not None:
            # Cheap on the CPU, and the token count catches a mismatch that would otherwise write past the output.
            total, num_new_pages = _k.extend_counts(prefix_lens_cpu, seq_lens_cpu, self.page_size)
            if total != extend_num_tokens:
                raise ValueError(
                    f"extend_num_tokens={extend_num_tokens} but sum(seq_lens_cpu - prefix_lens_cpu)={total}; "
                    "pass the number of tokens being extended"
                )
        else:
            num_new_pages = _k.num_new_pages_extend(prefix_lens, seq_lens, self.page_size)  # syncs with the device
        if not self._ensure_free_pages(num_new_pages):
            return None
        out = self._extend_step(prefix_lens, seq_lens, last_loc, extend_num_tokens)
        self._pages.took(num_new_pages)
        return out

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor] = None,
        last_loc: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """One new token location per request; ``seq_lens`` already counts the new token.

        Request ``i`` takes a new page iff ``(seq_lens[i] - 1) % page_size == 0`` (its location is then
        ``new_page * page_size``), else its location is ``last_loc[i] + 1``.  SGLang's order
        (:data:`ALLOC_DECODE_ORDER`).

        :param seq_lens: ``[bs]`` sequence lengths including the new token (device, each >= 1).
        :param seq_lens_cpu: CPU copy of ``seq_lens``, to count new pages without a device sync when the pool
            is nearly full (optional; otherwise the step's pages are counted on the device).
        :param last_loc: ``[bs]`` token index of each request's previous last token.
        :returns: int64 ``[bs]``, or ``None`` (nothing changed) when too few pages are free.
        """
        _check_decode_call(seq_lens, seq_lens_cpu, last_loc)
        most = seq_lens.numel()  # every request may open a page: if that fits, nothing is counted on the host
        pages = self._pages
        if most > pages.known and most > pages.refresh():
            most = _k.num_new_pages_decode(seq_lens_cpu if seq_lens_cpu is not None else seq_lens, self.page_size)
            if not self._ensure_free_pages(most):
                return None
        return self._decode_step(seq_lens, last_loc, most)
