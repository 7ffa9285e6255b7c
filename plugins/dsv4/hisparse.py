"""DeepSeek-V4 with HiSparse (SGLang's ``HiSparseC4DevicePool`` and ``DeepSeekV4HiSparseTokenToKVPoolAllocator``): the
ratio-4 layers' compressed latents live for every compressed token in pinned host memory, and the device keeps
``1 / host_to_device_ratio`` of them hot.

The ratio-4 layers attend to the compressed tokens their indexer selects, so the latents of the others need not be on
the device.  The engine addresses *logical* compressed slots (full location ``t`` is slot ``t // 4``, ``c128_size x
32`` of them, as without HiSparse; the indexer keys keep all of them on the device); a logical slot is hot when
``full_to_hisparse_device_index_mapping`` maps it to a device slot (one of ``c4_size``), cold otherwise (0, the padding
slot).  The window, the ratio-128 latents and every state are as in :class:`~kvcore_dsv4.pool.DeepSeekV4TokenToKVPool`.

* Stores and reads of the ratio-4 latents by logical slot go to its device slot
  (:meth:`HiSparseC4DevicePool.set_key_buffer_fused`, the pool's ``set_extra_key_buffer_fused``).
* :meth:`HiSparseC4DevicePool.backup_to_host` copies hot slots' latents (data and scale rows, every layer) to the host
  mirror; :meth:`HiSparseC4DevicePool.load_from_host` gathers cold ones back into device slots and maps them.
* :class:`DeepSeekV4HiSparseTokenToKVPoolAllocator` wraps the window pairing
  (:class:`kvcore_swa.SWATokenToKVPoolAllocator`): a prefill takes full locations, window slots and device slots for
  its compressed tokens; a decode step takes full locations and window slots only (the engine gives a request its
  device slots with :meth:`~DeepSeekV4HiSparseTokenToKVPoolAllocator.alloc_device_buffer`); freeing gives back all.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvcore.allocators import (BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, alloc_first_slots,
                               fill_to_pages, get_num_new_pages, take_mapped_slots)  # fmt: skip
from kvcore.errors import ConfigError
from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.row_move import copy_rows
from kvcore_dsv4.pool import DeepSeekV4SingleKVPool

__all__ = ["COMPRESS_RATIO", "DeepSeekV4HiSparseTokenToKVPoolAllocator", "HiSparseC4DevicePool"]

#: the compression ratio of the latents HiSparse keeps on the host
COMPRESS_RATIO = 4


class HiSparseC4DevicePool(KeepsAddresses, DeepSeekV4SingleKVPool):
    """The ratio-4 latents' device pages (``size`` slots) for ``logical_size`` logical compressed slots, and their
    pinned host mirror (see the module docstring).  Until an allocator registers its map, logical slot ``s`` below
    the device's rows is device slot ``s`` and the rest are cold.

    :param stacked: the device pages, ``[layers, pages, page_bytes]`` uint8 (``c4_kv``).
    :param size: device slots.
    :param logical_size: logical compressed slots (``c128_size x 32``).
    :param global_page_size: the full page (``page_size`` of the full locations): the host mirror, like the device
        pages, adds the allocator's reserved page.
    """

    compress_ratio = COMPRESS_RATIO

    def __init__(self, stacked: torch.Tensor, page_size: int, use_triton: bool, size: int, logical_size: int,
                 global_page_size: int):  # fmt: skip
        super().__init__(stacked, page_size, use_triton)
        self.size, self.logical_size = size, logical_size
        self.device = stacked.device
        layers, _, page_bytes = stacked.shape
        host_pages = -(-(logical_size + global_page_size) // page_size)
        pinned = torch.cuda.is_available() and stacked.device.type == "cuda"
        self.host_kv_cache = torch.zeros((layers, host_pages, page_bytes), dtype=torch.uint8, pin_memory=pinned)
        self._host = DeepSeekV4SingleKVPool(self.host_kv_cache, page_size, use_triton=False)
        self._bind_addresses()
        device_slots = stacked.shape[1] * page_size
        logical_slots = logical_size + page_size  # the full locations' range, compressed (its reserved page too)
        identity = torch.arange(min(device_slots, logical_slots), device=self.device)
        rest = logical_slots - identity.numel()
        #: logical slot -> device slot (0: cold); the trailing -1 is what a last slot of -1 translates to
        self.full_to_hisparse_device_index_mapping = torch.cat([
            identity, torch.zeros(rest, dtype=torch.int64, device=self.device),
            torch.full((1,), -1, dtype=torch.int64, device=self.device)])  # fmt: skip

    def _bind_addresses(self) -> None:
        """``data_ptrs``: each layer's device pages' address (uint64, on the device), as SGLang's transfer kernels
        take them."""
        self.data_ptrs = torch.tensor([x.data_ptr() for x in self.kv_buffer], dtype=torch.uint64, device=self.device)

    # -- the map ------------------------------------------------------------------------------------------

    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor) -> None:
        """Use the allocator's logical slot -> device slot map (``logical_size + page_size + 1`` int64 entries, the
        last -1)."""
        want = self.full_to_hisparse_device_index_mapping.shape
        if full_to_hisparse_device_index_mapping.shape != want:
            raise ValueError(f"a map of {want[0]} entries (logical slots, a page, the trailing -1) is needed, got "
                             f"{tuple(full_to_hisparse_device_index_mapping.shape)}")  # fmt: skip
        self.full_to_hisparse_device_index_mapping = full_to_hisparse_device_index_mapping

    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor) -> torch.Tensor:
        """The compressed slots completed by full locations ``full_indices``: ``t // 4`` of every ``t`` that is the
        last of its block of 4 (a boolean selection: it reads the count back from the device)."""
        completes = (full_indices + 1) % COMPRESS_RATIO == 0
        return full_indices[completes] // COMPRESS_RATIO

    def _translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """Device slots (int64) of logical slots (0 when cold, -1 for -1)."""
        return self.full_to_hisparse_device_index_mapping[compressed_indices.long()]

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """Device slots (int32, as the attention kernels take them) of logical slots."""
        return self._translate_loc_to_hisparse_device(compressed_indices).to(torch.int32)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor) -> torch.Tensor:
        return self._translate_loc_to_hisparse_device(self.translate_loc_from_full_to_compressed(full_indices))

    # -- stores and reads by logical slot -----------------------------------------------------------------

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, freqs_cis=None) -> None:
        """Quantize ``cache_k`` ``[n, 512]`` into the device slots of logical slots ``loc`` (a cold slot writes the
        padding slot: make it hot first)."""
        super().set_key_buffer_fused(layer_id, self.translate_loc_to_hisparse_device(loc), cache_k, freqs_cis)

    def read(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Dequantized latents of logical slots ``loc`` (from their device slots)."""
        return super().read(layer_id, self._translate_loc_to_hisparse_device(loc))

    # -- the host mirror ----------------------------------------------------------------------------------

    def _copy(self, src: DeepSeekV4SingleKVPool, dst: DeepSeekV4SingleKVPool, src_slots: torch.Tensor,
              dst_slots: torch.Tensor) -> None:  # fmt: skip
        """Every layer's data and scale rows of slots ``src_slots`` of ``src`` to ``dst_slots`` of ``dst``, one launch
        a row kind."""
        src_rows, dst_rows = src.token_rows(), dst.token_rows()
        for part in ("data", "scales"):
            s, d = src_rows[part], dst_rows[part]
            copy_rows(s.rows, d.rows, s.row_of(src_slots).to(self.device), d.row_of(dst_slots).to(self.device),
                      self._use_triton)  # fmt: skip

    def backup_to_host(self, loc: torch.Tensor) -> None:
        """Copy the latents of hot logical slots ``loc`` (every layer) to the host mirror (on the current stream:
        the host sees them once it has finished)."""
        loc = loc.reshape(-1).long()
        self._copy(self, self._host, self._translate_loc_to_hisparse_device(loc), loc)

    def load_from_host(self, loc: torch.Tensor, slots: torch.Tensor) -> None:
        """Gather the host mirror's latents of logical slots ``loc`` (every layer) into device slots ``slots`` and map
        them there (:meth:`DeepSeekV4HiSparseTokenToKVPoolAllocator.load_to_device` takes the slots)."""
        loc, slots = loc.reshape(-1).long(), slots.reshape(-1).long()
        self._copy(self._host, self, loc, slots)
        self.full_to_hisparse_device_index_mapping[loc.to(self.device)] = slots.to(self.device)

    def read_host(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Dequantized latents of logical slots ``loc`` as the host mirror holds them (torch; for checks)."""
        return self._host.read(layer_id, loc.cpu())


class DeepSeekV4HiSparseTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """SGLang's ``DeepSeekV4HiSparseTokenToKVPoolAllocator``: the window pairing ``logical_attn_allocator`` (full
    locations and window slots) and, for the ratio-4 latents' device slots, a paged allocator of pages of
    ``page_size // 4`` (``hisparse_attn_allocator``), with the logical -> device map registered with the pool.

    ``page_size`` stays the full page; the device side's is ``hisparse_page_size``.  ``available_size()`` is what
    both sides can take (a full token needs a quarter of a device slot).

    :param logical_attn_allocator: a :class:`kvcore_swa.SWATokenToKVPoolAllocator` over a
        :class:`~kvcore_dsv4.pool.DeepSeekV4TokenToKVPool` built with ``enable_hisparse=True``.
    :raises ConfigError: for another allocator or pool.
    """

    def __init__(self, logical_attn_allocator: Any):
        from kvcore_dsv4.pool import DeepSeekV4TokenToKVPool

        kvcache = logical_attn_allocator.get_kvcache()
        if not isinstance(kvcache, DeepSeekV4TokenToKVPool) or not isinstance(kvcache.c4_kv_pool, HiSparseC4DevicePool):
            raise ConfigError("DeepSeekV4HiSparseTokenToKVPoolAllocator wraps the allocator of a DeepSeekV4TokenToKVPool "
                              f"built with enable_hisparse=True and ratio-4 layers; got one of {type(kvcache).__name__}"
                              " (set kv_cache.options.host_to_device_ratio=2 or more on a model with ratio-4 layers)")  # fmt: skip
        la = logical_attn_allocator
        super().__init__(la.size, la.page_size, la.dtype, la.device, kvcache, la.need_sort, la.kernels)
        self.compress_ratio = COMPRESS_RATIO
        self.logical_attn_allocator = la
        self.hisparse_kvcache: HiSparseC4DevicePool = kvcache.c4_kv_pool
        self.hisparse_page_size = self.hisparse_kvcache.page_size
        self._size_hisparse = self.hisparse_kvcache.size
        self.hisparse_attn_allocator = PagedTokenToKVPoolAllocator(
            self._size_hisparse, self.hisparse_page_size, la.dtype, la.device, kvcache, la.need_sort, la.kernels)  # fmt: skip
        self.full_to_hisparse_device_index_mapping = torch.zeros(kvcache.c4_logical_size + self.hisparse_page_size + 1,
                                                                 dtype=torch.int64, device=self.device)  # fmt: skip
        self.full_to_hisparse_device_index_mapping[-1] = -1
        self.hisparse_kvcache.register_mapping(self.full_to_hisparse_device_index_mapping)

    # -- sizes and the window side --------------------------------------------------------------------

    @property
    def size_full(self) -> int:
        return self.logical_attn_allocator.size

    @property
    def size_swa(self) -> int:
        return self.logical_attn_allocator.size_swa

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        return self.logical_attn_allocator.full_to_swa_index_mapping

    def debug_print(self) -> str:
        return (f"{self.logical_attn_allocator.debug_print()}; hisparse: {self.hisparse_attn_allocator.available_size()} "
                f"of {self._size_hisparse} device slots free")  # fmt: skip

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.logical_attn_allocator.translate_loc_from_full_to_swa(kv_indices)

    def full_available_size(self) -> int:
        """Full tokens both sides can take: each needs a quarter of a device slot."""
        return min(self.logical_attn_allocator.full_available_size(),
                   self.hisparse_attn_allocator.available_size() * COMPRESS_RATIO)  # fmt: skip

    def swa_available_size(self) -> int:
        return self.logical_attn_allocator.swa_available_size()

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(),
                   self.hisparse_attn_allocator.available_size() * COMPRESS_RATIO)  # fmt: skip

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.logical_attn_allocator.free_swa(free_index)

    def clear(self) -> None:
        """Everything free on every side, every logical slot cold, no free group open."""
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1].zero_()
        self.is_not_in_free_group, self.free_group = True, []

    # -- allocation ---------------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Whole pages of full locations with their window slots and the device slots of the compressed slots they
        hold, mapped (SGLang refuses a direct allocation: its engine grows requests through :meth:`alloc_extend` and
        :meth:`alloc_decode`; kvcore's is for callers that take pages).

        :raises ValueError: when ``need_size`` is not whole pages.
        """
        if need_size % self.page_size:
            raise ValueError(f"need_size={need_size}: DeepSeekV4HiSparseTokenToKVPoolAllocator.alloc takes whole pages "
                             f"of {self.page_size} (requests grow through alloc_extend and alloc_decode)")  # fmt: skip
        if need_size > self.available_size():
            return None
        logical = self.logical_attn_allocator.alloc(need_size)
        if logical is None:
            return None
        compressed = logical[COMPRESS_RATIO - 1 :: COMPRESS_RATIO] // COMPRESS_RATIO  # pages are runs of locations
        device = self.hisparse_attn_allocator.alloc(compressed.numel())  # whole device pages, in the same order
        if device is None:
            self.logical_attn_allocator.free(logical)
            return None
        self.full_to_hisparse_device_index_mapping[compressed.long()] = device.long()
        return logical

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu=None, seq_lens=None, seq_lens_cpu=None, last_loc=None,
                           extend_num_tokens=None) -> Optional[torch.Tensor]:  # fmt: skip
        """Full locations and window slots of an extension, no device slot (SGLang's, for decode-side extends)."""
        return self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                                        extend_num_tokens)  # fmt: skip

    def alloc_extend(self, prefix_lens, prefix_lens_cpu=None, seq_lens=None, seq_lens_cpu=None, last_loc=None,
                     extend_num_tokens=None) -> Optional[torch.Tensor]:  # fmt: skip
        """Full locations and window slots of an extension (as the window pairing's ``alloc_extend``) and device
        slots for the compressed slots they complete (each request continuing its last device page), mapped.  None,
        with nothing taken, when either side lacks the pages (counted from the host's lengths)."""
        prefix_cpu = (prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu).cpu().long()
        seq_cpu = (seq_lens if seq_lens_cpu is None else seq_lens_cpu).cpu().long()
        r = COMPRESS_RATIO
        if get_num_new_pages(seq_cpu, self.page_size, prefix_cpu) * self.page_size > self.logical_attn_allocator.available_size():
            return None
        device_pages = get_num_new_pages(seq_cpu // r, self.hisparse_page_size, prefix_cpu // r)
        if device_pages * self.hisparse_page_size > self.hisparse_attn_allocator.available_size():
            return None
        undo = self.logical_attn_allocator.backup_state()
        logical = self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                           last_loc, extend_num_tokens)  # fmt: skip
        if logical is None:
            return None
        compressed = self.hisparse_kvcache.translate_loc_from_full_to_compressed(logical)
        device = self.hisparse_attn_allocator.alloc_extend(
            prefix_lens // r, prefix_cpu // r, seq_lens // r, seq_cpu // r, self.get_last_loc_hisparse_device(last_loc),
            compressed.numel())  # fmt: skip
        if device is None:  # a cold last slot's device page is not continued: one page more than counted
            self.logical_attn_allocator.restore_state(undo)  # (freeing would give back the request's own last page)
            return None
        self.full_to_hisparse_device_index_mapping[compressed.long()] = device.long()
        return logical

    def alloc_decode(self, seq_lens, seq_lens_cpu=None, last_loc=None) -> Optional[torch.Tensor]:
        """Full locations and window slots of one token per request (no device slot: see
        :meth:`alloc_device_buffer`)."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        """The last whole compressed slot of a prefix ending at full location ``last_locs`` (-1 stays -1)."""
        return torch.div(last_locs - (COMPRESS_RATIO - 1), COMPRESS_RATIO, rounding_mode="floor")

    def get_last_loc_hisparse_device(self, last_locs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if last_locs is None:
            return None
        return self.hisparse_kvcache._translate_loc_to_hisparse_device(self.get_last_loc_compressed(last_locs))

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int) -> torch.Tensor:
        """A request's device buffer of ``need_size`` slots (whole device pages) for its logical slots
        ``allocated_indices``: the device slots they hold (unmapped from them), the newest kept among the first
        ``need_size - page`` ones, the surplus pages given back and missing pages taken (SGLang's).

        :raises ValueError: when ``need_size`` is not whole device pages.
        :raises RuntimeError: when the device has too few free pages.
        """
        page = self.hisparse_page_size
        if need_size % page:
            raise ValueError(f"need_size={need_size} must be whole device pages of {page}")
        held = take_mapped_slots(self.full_to_hisparse_device_index_mapping, allocated_indices)
        keep = need_size - page  # the slots before the buffer's last page
        n = held.numel()
        if n > keep + 1:  # the newest slot moves into the kept part, in place of the one there
            held = held.clone()
            held[keep], held[n - 1] = held[n - 1].clone(), held[keep].clone()
        if n >= need_size:
            buffer, surplus = held[:need_size], held[need_size:]
            if surplus.numel():
                surplus_pages = torch.unique(torch.div(surplus, page, rounding_mode="floor"))
                kept_pages = torch.unique(torch.div(buffer, page, rounding_mode="floor"))
                lone = surplus_pages[~torch.isin(surplus_pages, kept_pages)]
                if lone.numel():
                    self.hisparse_attn_allocator.free(lone * page)
            return buffer
        return fill_to_pages(held, need_size, self.hisparse_attn_allocator)

    def load_to_device(self, loc: torch.Tensor) -> Optional[torch.Tensor]:
        """Bring cold logical slots ``loc`` back: device slots for them (whole pages, the first ``len(loc)`` slots of
        the pages taken), their latents gathered from the host mirror, the map updated.  Returns the slots, or None
        (nothing changed) when the device has too few free pages."""
        slots = alloc_first_slots(self.hisparse_attn_allocator, loc.numel())
        if slots is not None:
            self.hisparse_kvcache.load_from_host(loc, slots)
        return slots

    # -- freeing ------------------------------------------------------------------------------------------

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        """Give back device slots (the padding page's ignored)."""
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices >= self.hisparse_page_size])

    def free_compressed(self, compressed_indices: torch.Tensor) -> None:
        """Make logical slots cold: their device slots back, their map entries 0 (their latents stay on the host)."""
        slots = self.hisparse_kvcache._translate_loc_to_hisparse_device(compressed_indices)
        self.free_hisparse_indices(slots[slots > 0])
        self.full_to_hisparse_device_index_mapping[compressed_indices.long()] = 0

    def free_hisparse(self, free_indices: torch.Tensor) -> None:
        """:meth:`free_compressed` of the compressed slots full locations ``free_indices`` complete."""
        self.free_compressed(self.hisparse_kvcache.translate_loc_from_full_to_compressed(free_indices.reshape(-1)))

    def free(self, free_index: torch.Tensor) -> None:
        """Full locations, their window slots and their compressed slots' device slots back (held until
        :meth:`free_group_end` inside a group)."""
        if free_index.numel() == 0 or self._hold_in_group(free_index):
            return
        self.logical_attn_allocator.free(free_index)
        self.free_hisparse(free_index)

    supports_backup = False
    #: why the conformance kit's model of random request lifetimes does not describe this allocator
    lifetime_model_mismatch = ("its available_size() counts the ratio-4 latents' device slots, which alloc_extend "
                               "takes and alloc_decode does not (SGLang's: the engine gives decoded tokens their "
                               "device slots through alloc_device_buffer); kvcore_dsv4's tests drive its lifetimes")

    def backup_state(self) -> Any:
        raise NotImplementedError("DeepSeekV4HiSparseTokenToKVPoolAllocator keeps no snapshot (its map moves with "
                                  "every call)")  # fmt: skip

    def restore_state(self, state: Any) -> None:
        raise NotImplementedError("DeepSeekV4HiSparseTokenToKVPoolAllocator keeps no snapshot (its map moves with "
                                  "every call)")  # fmt: skip

