"""A hybrid sliding-window model on one unified memory (:func:`init_unified_swa_pools`): full-attention KV pages on
the low side, window KV pages on the high side, so the split between full and window tokens follows the workload
instead of a ratio fixed at start-up.

The pools keep the split pools' interfaces (:class:`~kvcore_swa.pool.SWAKVPool`,
:class:`~kvcore_swa.allocator.SWATokenToKVPoolAllocator`): the engine allocates, stores, moves and offloads by *full
locations*, as before.  Those are virtual tokens now: a page keeps its ids while the sides compact and move
its bytes.  What an engine changes is how its attention kernels read the paged views (``get_key_buffer(layer)`` /
``get_value_buffer(layer)``, indexed ``[t // page_size, t % page_size]`` by a physical token ``t``):

* full-attention layers at ``token_to_kv_pool.translate_loc(full_locs)`` (the full sub-pool's physical tokens);
* sliding-window layers at ``token_to_kv_pool.translate_loc_from_full_to_swa(full_locs)`` (full location -> window
  virtual token through the allocator's map -> the window sub-pool's physical token; the allocator's method of that
  name gives the same tokens, as int64).

Both change when the memory compacts (an allocation of either side may, ``memory.flush()`` does): translate after
the step's allocations and frees, before the kernels that read; the stores take the same translations as a
:class:`~kvcore.pools.KVWriteLoc` (``allocator.translate_write_loc`` and ``translate_loc_from_full_to_swa``).  Tokens that slid out of the window (``free_swa``) and the
padding location read the window side's padding page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from kvcore_mha.page_major import PageMajorMHATokenToKVPool
from kvcore_swa.allocator import SWATokenToKVPoolAllocator
from kvcore_swa.pool import SWAKVPool

from kvcore.errors import ConfigError
from kvcore.kernels import allocator_kernels as _k
from kvcore.pools import GB, KVWriteLoc, check_post_capture, unsupported
from kvcore.token_rows import TokenRows
from kvcore_unified.allocator import HIGH, LOW
from kvcore_unified.bundle import UnifiedPoolBundle
from kvcore_unified.full_pages import UnifiedPagedAllocator, kv_page_bytes, written_into
from kvcore_unified.memory import ALIGN, UnifiedMemory

__all__ = ["UnifiedSWAKVPool", "UnifiedSWATokenToKVPoolAllocator", "init_unified_swa_pools", "unified_swa_kv_pool"]


def _check_both_kinds(owner: str, full_ids: Sequence[int], swa_ids: Sequence[int]) -> None:
    if not full_ids or not swa_ids:
        raise ConfigError(f"{owner} needs full-attention and sliding-window layers, got full {list(full_ids)} and "
                          f"window layers {list(swa_ids)}: build the split pools (memory.unified=false)")  # fmt: skip


class UnifiedSWAKVPool(SWAKVPool):
    """:class:`~kvcore_swa.pool.SWAKVPool` over ``memory``: its full sub-pool a
    :class:`~kvcore_mha.PageMajorMHATokenToKVPool` laid over the low side (``memory.side_memory(LOW)``), its window
    sub-pool one laid over the high side, each with the side's virtual ids as its ``virtual_pages`` (every one on
    the side's padding page until the allocator maps it).  Pair it with a
    :class:`UnifiedSWATokenToKVPoolAllocator`; :func:`init_unified_swa_pools` builds both and the memory.

    ``memory``'s low unit must be one page of every full-attention layer and its high unit one page of every window
    layer (:func:`kv_page_bytes`).  Stores (:meth:`set_kv_buffer`), :meth:`move_kv_cache` and the CPU copies take
    full locations, as SWAKVPool's do; reads translate first (the module docstring, :meth:`translate_loc`,
    :meth:`translate_loc_from_full_to_swa`).  ``size`` is the tokens of the low side's pages (the full locations'
    space, when the memory has as many low ids, as it does by default), ``size_swa`` the tokens of the window
    sub-pool's buffer (the pages of the high unit in the whole range).  The other parameters are SWAKVPool's; both
    kinds of layers are required.

    :raises ConfigError: for a memory whose units are not those pages, or no full-attention or no window layers.
    """

    def __init__(self, memory: UnifiedMemory, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 swa_attention_layer_ids: Sequence[int], full_attention_layer_ids: Sequence[int], device: str,
                 enable_memory_saver: bool = False, v_head_dim: int | None = None, swa_head_num: int | None = None,
                 swa_head_dim: int | None = None, swa_v_head_dim: int | None = None, start_layer: int | None = None,
                 end_layer: int | None = None, kernels: str = "auto"):  # fmt: skip
        _check_both_kinds("UnifiedSWAKVPool", full_attention_layer_ids, swa_attention_layer_ids)
        units = {LOW: kv_page_bytes(len(full_attention_layer_ids), page_size, head_num, head_dim, dtype),
                 HIGH: kv_page_bytes(len(swa_attention_layer_ids), page_size, swa_head_num or head_num,
                                     swa_head_dim or head_dim, dtype)}  # fmt: skip
        for side, unit in units.items():
            if memory.unit_bytes(side) != unit:
                raise ConfigError(f"UnifiedSWAKVPool: the memory's {side} unit is {memory.unit_bytes(side)} bytes, "
                                  f"a page of its layers {unit}: build the memory with kv_page_bytes")  # fmt: skip
        self.memory = memory
        ids = {side: memory.allocator.ids(side) for side in (LOW, HIGH)}
        low_pages = memory.capacity // memory.low_unit
        super().__init__(
            low_pages * page_size, memory.high_pages * page_size, page_size, dtype, head_num, head_dim,
            swa_attention_layer_ids, full_attention_layer_ids, device, enable_memory_saver,
            token_to_kv_pool_class=PageMajorMHATokenToKVPool, v_head_dim=v_head_dim, swa_head_num=swa_head_num,
            swa_head_dim=swa_head_dim, swa_v_head_dim=swa_v_head_dim, start_layer=start_layer, end_layer=end_layer,
            kernels=kernels, full_pool_kwargs=dict(memory=memory.low_memory(), virtual_pages=ids[LOW]),
            swa_pool_kwargs=dict(memory=memory.high_memory(), virtual_pages=ids[HIGH],
                                 padding_page=memory.padding_page(HIGH)),
        )  # fmt: skip
        self.mem_usage = memory.buffer.nbytes / GB  # the sub-pools' buffers share these bytes

    def translate_loc(self, loc: torch.Tensor) -> torch.Tensor:
        """Full-attention reads: the physical tokens (int64, ``loc``'s shape) of full locations ``loc`` in the full
        layers' paged views (the full sub-pool's :meth:`~kvcore_mha.PageMajorMHATokenToKVPool.translate_loc`)."""
        return self.full_kv_pool.translate_loc(loc)

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """Window reads: the *physical* window tokens (int32, as SWAKVPool's) of full locations ``kv_indices`` in the
        window layers' paged views: the registered map's window token, through the window sub-pool's
        :meth:`~kvcore_mha.PageMajorMHATokenToKVPool.translate_loc`.  A token that slid out of the window reads the
        high side's padding page."""
        return self.swa_kv_pool.translate_loc(super().translate_loc_from_full_to_swa(kv_indices)).to(torch.int32)

    def _window_write_loc(self, loc_info: KVWriteLoc) -> KVWriteLoc | None:
        """SWAKVPool's, refusing physical full tokens without their window tokens (the window side maps virtual
        full locations only)."""
        if loc_info.swa_loc is None and loc_info.physical:
            raise ValueError("a KVWriteLoc marked physical reached a sliding-window layer without swa_loc: pass "
                             "swa_loc=allocator.translate_loc_from_full_to_swa(out_cache_loc) beside "
                             "loc=allocator.translate_write_loc(out_cache_loc)")  # fmt: skip
        return super()._window_write_loc(loc_info)

    def token_rows(self) -> dict[str, TokenRows]:
        """SWAKVPool's, with the window rows behind full location -> window token -> physical token: that map is
        taken now, so the rows stay valid until the memory next compacts (what CPU offload needs of them)."""
        rows = super().token_rows()
        window = self.swa_kv_pool
        mapping = self.full_to_swa_index_mapping
        index_map = None if mapping is None else window.translate_loc(mapping)
        for name, own in window.token_rows().items():  # named as SWAKVPool names the window sub-pool's buffers
            rows["swa_" + name] = TokenRows(own.rows, own.tokens_per_page, own.rows_per_page, own.first_row,
                                            own.index_map if index_map is None else index_map)  # fmt: skip
        return rows

    def buffers(self) -> dict[str, torch.Tensor]:
        """The memory itself (named ``unified``): both sub-pools' pages are views over it."""
        return {"unified": self.memory.buffer}

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """SGLang's ``(K bytes, V bytes)`` of the memory: every page of either side is half keys, half values."""
        half = self.memory.buffer.nbytes // 2
        return half, half

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The full sub-pool's (one buffer, one page of every full layer per item), as SGLang's unified pool: the
        window sub-pool's (:meth:`get_state_buf_infos`) lie over the same bytes."""
        return self.full_kv_pool.get_contiguous_buf_infos()


class UnifiedSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):
    """:class:`~kvcore_swa.allocator.SWATokenToKVPoolAllocator` over ``kvcache``'s memory: its full side a
    :class:`~kvcore_unified.full_pages.UnifiedPagedAllocator` of the low side, its window side one of the high side,
    both taking their pages from the same free bytes.  Its API is SWATokenToKVPoolAllocator's; what differs:

    * :meth:`available_size` counts the tokens whose full page and window page both fit; ``full_available_size()``
      / ``swa_available_size()`` what either side alone could take, each shrinking as the other takes bytes.
    * An allocation that does not fit returns None and changes nothing: its new pages are checked against both
      sides' ids and the shared free bytes before either side allocates.
    * :meth:`free` and :meth:`free_swa` do not wait for the device: the freed pages reach the sides at their next
      query or allocation (as UnifiedPagedAllocator's ``free``), after the work queued on ``forward_stream`` when
      one is given; the memory compacts as it was built to (lazily by default).
    * :meth:`translate_loc_from_full_to_swa` gives physical window tokens (the pool's), not window slots; the window
      slots are ``full_to_swa_index_mapping``'s.
    * ``backup_state`` / ``restore_state`` raise NotImplementedError (``supports_backup`` is False): a compaction
      moves pages, so no snapshot stays valid.

    :param kvcache: a :class:`UnifiedSWAKVPool`; the page size, dtype and device are its own.
    :param need_sort: accepted (freed pages go straight back to the shared range).
    :param kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``native``.
    :param forward_stream: the CUDA stream the forward runs on under overlap scheduling, or None: each free makes
        the current stream wait for it before compacting (a move must not race a kernel reading the pages).
    """

    def __init__(self, kvcache: UnifiedSWAKVPool, need_sort: bool = False, kernels: str = "auto",
                 forward_stream: Any = None):  # fmt: skip
        memory, page = kvcache.memory, kvcache.page_size
        super().__init__(memory.allocator.ids(LOW) * page, memory.allocator.ids(HIGH) * page, page, kvcache.dtype,
                         kvcache.device, kvcache, need_sort, kernels)  # fmt: skip
        self.memory, self.forward_stream = memory, forward_stream

    #: no snapshots (the conformance kit reads this and drives none)
    supports_backup = False

    # -- hooks of SWATokenToKVPoolAllocator --------------------------------------------------------------------

    def _new_side(self, tokens: int, swa: bool) -> UnifiedPagedAllocator:
        """The side's UnifiedPagedAllocator, mapping pages in the pool's sub-pool of that side (it sizes itself from
        the memory: ``tokens`` is the side's virtual ids' tokens)."""
        pool = self._kvcache
        side, pages = (HIGH, pool.swa_kv_pool) if swa else (LOW, pool.full_kv_pool)
        return UnifiedPagedAllocator(pool.memory, pages, self.page_size, self.dtype, self.device, self.need_sort,
                                     self.kernels, side=side)  # fmt: skip

    def _full_undo(self) -> Callable[[torch.Tensor], None]:
        """Free the full pages just taken: those of the locations at offset 0 of their page (a request continuing a
        page starts past its offset 0), the low side's top, so nothing moves.  Not reached while the checks before
        each allocation hold."""
        return lambda full: self.full_attn_allocator.free(full[full % self.page_size == 0])

    # -- queries ------------------------------------------------------------------------------------------------

    def _joint_pages(self) -> int:
        """New pages an allocation can open: each takes a full page and a window page of the shared bytes."""
        self.memory.settle_frees()
        ends = self.memory.allocator
        both = ends.unit_bytes(LOW) + ends.unit_bytes(HIGH)
        return min(ends.free_bytes() // both, ends.available(LOW), ends.available(HIGH))

    def available_size(self) -> int:
        """Tokens of new pages that fit on both sides together (a full page and a window page each)."""
        return self._joint_pages() * self.page_size

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor, *, out: Optional[torch.Tensor] = None
                                       ) -> torch.Tensor:  # fmt: skip
        """Physical window tokens (int64) of full locations, as :meth:`UnifiedSWAKVPool.translate_loc_from_full_to_swa`
        gives them; negative locations (``-1`` for "none") stay as they are.  ``out``: an int64 tensor of their
        shape written in place and returned."""
        slots = self._window_slots(kv_indices)
        return written_into(out, torch.where(slots >= 0, self._kvcache.swa_kv_pool.translate_loc(slots.clamp(min=0)),
                                             slots))  # fmt: skip

    def translate_kv_loc(self, loc: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full-attention layers' physical tokens (int64) of full locations ``loc`` (the full side's
        :meth:`~kvcore_unified.full_pages.UnifiedPagedAllocator.translate_kv_loc`)."""
        return self.full_attn_allocator.translate_kv_loc(loc, out=out)

    def translate_write_loc(self, loc: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                            out_width: Optional[int] = None) -> torch.Tensor:  # fmt: skip
        """The full-attention side's physical tokens of a step's write locations
        (:meth:`~kvcore_unified.full_pages.UnifiedPagedAllocator.translate_write_loc`); the window layers' are
        :meth:`translate_loc_from_full_to_swa` of the same locations, the ``swa_loc`` of the step's
        :class:`~kvcore.pools.KVWriteLoc`."""
        return self.full_attn_allocator.translate_write_loc(loc, out=out, out_width=out_width)

    # -- allocation and frees -----------------------------------------------------------------------------------

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: Optional[torch.Tensor] = None,
                     seq_lens: Optional[torch.Tensor] = None, seq_lens_cpu: Optional[torch.Tensor] = None,
                     last_loc: Optional[torch.Tensor] = None, extend_num_tokens: Optional[int] = None,
                     ) -> Optional[torch.Tensor]:  # fmt: skip
        """SWATokenToKVPoolAllocator's; the pages it opens are counted on the host first (from the CPU copies of
        the lengths; without them the device tensors are read, a sync) and checked to fit on both sides."""
        pages = _k.num_new_pages_extend(prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu,
                                        seq_lens if seq_lens_cpu is None else seq_lens_cpu, self.page_size)  # fmt: skip
        if pages > self._joint_pages():
            return None
        return super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: Optional[torch.Tensor] = None,
                     last_loc: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:  # fmt: skip
        """SWATokenToKVPoolAllocator's; the pages it opens are counted (from ``seq_lens_cpu``, else a sync) and
        checked to fit on both sides first."""
        counted = seq_lens if seq_lens_cpu is None else seq_lens_cpu
        if _k.num_new_pages_decode(counted, self.page_size) > self._joint_pages():
            return None
        return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def free(self, free_index: torch.Tensor) -> None:
        """SWATokenToKVPoolAllocator's: both sides' pages back (at their next query or allocation, without waiting
        for the device); inside a free group, at ``free_group_end``."""
        self._after_forward()
        super().free(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """SWATokenToKVPoolAllocator's (whole window pages back, their full pages kept), without waiting for the
        device."""
        self._after_forward()
        super().free_swa(free_index)

    def _after_forward(self) -> None:
        if self.forward_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.forward_stream)


def init_unified_swa_pools(
    *,
    device: str,
    kv_cache_dtype: torch.dtype,
    head_num: int,
    head_dim: int,
    v_head_dim: int,
    swa_head_num: int,
    swa_head_dim: int,
    swa_v_head_dim: int,
    page_size: int,
    start_layer: int,
    end_layer: int,
    swa_attention_layer_ids: Sequence[int],
    full_attention_layer_ids: Sequence[int],
    full_max_total_num_tokens: Optional[int] = None,
    swa_max_total_num_tokens: Optional[int] = None,
    total_bytes: Optional[int] = None,
    enable_memory_saver: bool = False,
    post_capture_active: bool = False,
    need_sort: bool = False,
    forward_stream: Any = None,
    lazy_compaction: bool = True,
    model_context_len: Optional[int] = None,
    sliding_window_size: Optional[int] = None,
    fused_draft: Any = None,
    kernels: str = "auto",
) -> UnifiedPoolBundle:
    """The pools of a hybrid sliding-window model over one memory: a :class:`UnifiedSWAKVPool` and its
    :class:`UnifiedSWATokenToKVPoolAllocator`, returned as ``UnifiedPoolBundle(memory, pool, allocator,
    req_to_token_pool=None)`` (SGLang's configurator builds the request table itself).

    SGLang's keywords, with its meaning.  The memory holds ``total_bytes``, or what the split pools would:
    ``full_max_total_num_tokens`` full-attention tokens and ``swa_max_total_num_tokens`` window tokens at their
    bytes per token; either kind may then take all of it.  ``end_layer`` is exclusive, as the configurator passes
    it: the two layer lists together are this rank's layers ``start_layer .. end_layer - 1``.  ``forward_stream`` is
    honoured (each free waits for it); ``lazy_compaction`` (SGLang's default, True): a side compacts only when the
    other needs the bytes its frees left (False: at every free).  ``need_sort`` is accepted.  ``kernels`` is kvcore's (``auto``, ``triton`` or ``native``).

    :raises ConfigError: naming the keyword, for what kvcore does not build: the memory saver, backing after
        CUDA-graph capture, a fused draft, the batch-of-one floor check (``model_context_len`` /
        ``sliding_window_size``), V rows of another width than K (``v_head_dim``, ``swa_v_head_dim``), a window page
        that is not a multiple of 16 bytes, no full-attention or no window layers, no size, or a budget under one
        page of each kind.
    :raises ValueError: when the layer lists are not this rank's layers.
    """
    owner = "init_unified_swa_pools"
    if enable_memory_saver:
        raise unsupported(owner, "enable_memory_saver", True, "torch_memory_saver", "pass enable_memory_saver=False")
    check_post_capture(owner, post_capture_active)
    for keyword, value, feature in (("fused_draft", fused_draft, "a draft model's K/V fused into the memory"),
                                    ("model_context_len", model_context_len, "the batch-of-one floor check"),
                                    ("sliding_window_size", sliding_window_size, "the batch-of-one floor check")):
        if value is not None:
            raise unsupported(owner, keyword, value, feature, f"pass {keyword}=None")
    for keyword, v_dim, k_dim in (("v_head_dim", v_head_dim, head_dim),
                                  ("swa_v_head_dim", swa_v_head_dim, swa_head_dim)):  # fmt: skip
        if v_dim not in (None, k_dim):
            raise unsupported(owner, keyword, v_dim, "V rows of another width than K rows in a page-major page",
                              f"pass {keyword}={k_dim}, or build the split pools (memory.unified=false)")  # fmt: skip
    full_ids, swa_ids = [int(i) for i in full_attention_layer_ids], [int(i) for i in swa_attention_layer_ids]
    _check_both_kinds(owner, full_ids, swa_ids)
    if sorted(full_ids + swa_ids) != list(range(start_layer, end_layer)):
        raise ValueError(f"{owner}: full {full_ids} and window {swa_ids} layer ids must together be this rank's layers "
                         f"start_layer={start_layer} .. end_layer={end_layer} (exclusive), each once")  # fmt: skip
    if total_bytes is None and (full_max_total_num_tokens is None or swa_max_total_num_tokens is None):
        raise ConfigError(f"{owner}: pass total_bytes, or both full_max_total_num_tokens and "
                          "swa_max_total_num_tokens")  # fmt: skip
    pool = unified_swa_kv_pool(
        owner, device=device, kv_cache_dtype=kv_cache_dtype, page_size=page_size, head_num=head_num,
        head_dim=head_dim, swa_head_num=swa_head_num, swa_head_dim=swa_head_dim, v_head_dim=v_head_dim,
        swa_v_head_dim=swa_v_head_dim, full_attention_layer_ids=full_ids,
        swa_attention_layer_ids=swa_ids, start_layer=start_layer, end_layer=end_layer - 1, kernels=kernels,
        total_bytes=total_bytes, tokens=(full_max_total_num_tokens, swa_max_total_num_tokens),
        lazy_compaction=lazy_compaction,
    )  # fmt: skip
    memory = pool.memory
    allocator = UnifiedSWATokenToKVPoolAllocator(pool, need_sort=need_sort, kernels=kernels,
                                                 forward_stream=forward_stream)  # fmt: skip
    return UnifiedPoolBundle(memory, pool, allocator, None)


def unified_swa_kv_pool(owner: str, *, device: str, kv_cache_dtype: torch.dtype, page_size: int, head_num: int,
                        head_dim: int, swa_head_num: Optional[int], swa_head_dim: Optional[int],
                        v_head_dim: Optional[int], swa_v_head_dim: Optional[int],
                        full_attention_layer_ids: Sequence[int], swa_attention_layer_ids: Sequence[int],
                        start_layer: int, end_layer: int, kernels: str = "auto", total_bytes: Optional[int] = None,
                        tokens: tuple[Optional[int], Optional[int]] = (None, None),
                        lazy_compaction: bool = True) -> UnifiedSWAKVPool:  # fmt: skip
    """A :class:`UnifiedSWAKVPool` over a new memory of ``total_bytes``, or of ``tokens`` = (full tokens, window
    tokens) at their page bytes (the split pools' bytes); ``end_layer`` inclusive.  What
    :func:`init_unified_swa_pools` and the plugin build.

    :raises ConfigError: naming ``owner``, for a window page that is not a multiple of 16 bytes, or a budget under
        one page of each kind.
    """
    low = kv_page_bytes(len(full_attention_layer_ids), page_size, head_num, head_dim, kv_cache_dtype)
    high = kv_page_bytes(len(swa_attention_layer_ids), page_size, swa_head_num or head_num, swa_head_dim or head_dim,
                         kv_cache_dtype)  # fmt: skip
    if high % ALIGN:
        raise ConfigError(f"{owner}: a window page of every window layer is {high} bytes, not a multiple of "
                          f"{ALIGN}: choose a page_size that makes it one, or build the split pools "
                          "(memory.unified=false)")  # fmt: skip
    if total_bytes is None:
        total_bytes = (tokens[0] * low + tokens[1] * high) // page_size
    if total_bytes < low + high:
        raise ConfigError(f"{owner}: a unified memory of {total_bytes} bytes holds not one full-attention page "
                          f"({low} bytes) and one window page ({high}): raise full_max_total_num_tokens / "
                          "swa_max_total_num_tokens (or total_bytes)")  # fmt: skip
    memory = UnifiedMemory(total_bytes, low, high, device, lazy_compaction=lazy_compaction)
    return UnifiedSWAKVPool(memory, page_size, kv_cache_dtype, head_num, head_dim, swa_attention_layer_ids,
                            full_attention_layer_ids, device, v_head_dim=v_head_dim, swa_head_num=swa_head_num,
                            swa_head_dim=swa_head_dim, swa_v_head_dim=swa_v_head_dim, start_layer=start_layer,
                            end_layer=end_layer, kernels=kernels)  # fmt: skip
