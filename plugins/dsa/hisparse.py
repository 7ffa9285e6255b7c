"""HiSparse DSA (SGLang's ``HiSparseDSATokenToKVPool`` and ``HiSparseTokenToKVPoolAllocator``): every token of the
pool lives in pinned host memory, and the device keeps ``1 / host_to_device_ratio`` of them hot.

DeepSeek's sparse attention reads only the tokens its indexer selects (a top-k per query), so the latent rows of the
others need not be on the device.  The engine addresses *logical* tokens (``size * host_to_device_ratio`` of them,
the allocator's locations, as a plain DSA pool's); a logical token is hot when
``full_to_hisparse_device_index_mapping`` maps it to a device slot (one of ``size``), cold otherwise (0, the padding
slot).  The indexer's pages cover every logical token on the device (it scores them all); the latent rows cover the
device slots, and the pinned host mirror (``host_kv_cache``) covers every logical token.

* Stores and reads by logical token go to its device slot (:meth:`HiSparseDSATokenToKVPool.set_mla_kv_buffer`, ...).
* :meth:`HiSparseDSATokenToKVPool.backup_to_host` copies hot tokens' rows to the host mirror, one launch.
* :meth:`HiSparseTokenToKVPoolAllocator.free_hisparse` gives back tokens' device slots (they stay on the host);
  :meth:`HiSparseTokenToKVPoolAllocator.load_to_device` brings selected cold tokens back: device slots taken, every
  layer's rows gathered from the host mirror in one launch (the kernel reads pinned memory over the bus).
* As SGLang's allocator: a prefill (``alloc_extend``) takes device slots for its tokens, a decode step
  (``alloc_decode``) and ``alloc_logical_only`` take logical tokens only; the engine gives a request its device
  buffer with :meth:`HiSparseTokenToKVPoolAllocator.alloc_device_buffer`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvcore.allocators import (BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator,
                               alloc_first_slots, fill_to_pages, get_num_new_pages, take_mapped_slots)  # fmt: skip
from kvcore.kernels.row_move import RowMover, copy_rows, move_token_rows_native
from kvcore.pools import pair_by_layers, tokens_of, unsupported
from kvcore.token_rows import TokenRows
from kvcore_dsa.pool import DSATokenToKVPool

__all__ = ["HiSparseDSATokenToKVPool", "HiSparseTokenToKVPoolAllocator"]


class HiSparseDSATokenToKVPool(DSATokenToKVPool):
    """A :class:`~kvcore_dsa.pool.DSATokenToKVPool` of ``size`` device slots for ``size * host_to_device_ratio``
    logical tokens (see the module docstring); SGLang's keywords.

    Buffers: ``kv`` (latent rows of the device slots), ``index_k`` (indexer pages of every logical token); the host
    mirror ``host_kv_cache`` (``[layers, logical tokens + page_size, 1, kv_cache_dim]``, pinned when CUDA is there)
    is no device buffer.  :meth:`token_rows` is by logical token (the latent rows through the mapping), so moves,
    CPU offload and the conformance kit address tokens as the engine does.  Until an allocator registers its map,
    logical token ``t < size + page_size`` is device slot ``t`` and the rest are cold.

    :param host_to_device_ratio: logical tokens per device slot, 2 or more.
    :param index_kpool: / ``index_kpool_compress`` / ``tail_extra_slots`` / ``skip_topk_layers``: only their defaults
        (kvcore keeps one plain indexer per layer); others are a :class:`~kvcore.errors.ConfigError`.
    :param max_running_requests: accepted (informational).
    """

    def __init__(self, size: int, page_size: int, kv_lora_rank: int, dtype: torch.dtype, qk_rope_head_dim: int,
                 layer_num: int, device: str, index_head_dim: int, enable_memory_saver: bool,
                 kv_cache_dim: Optional[int] = None, start_layer: Optional[int] = None, end_layer: Optional[int] = None,
                 index_kpool: int = 1, index_kpool_compress: bool = False, tail_extra_slots: int = 0,
                 max_running_requests: Optional[int] = None, skip_topk_layers: Optional[list] = None,
                 host_to_device_ratio: int = 2, kernels: str = "auto", index_dtype: Any = None):  # fmt: skip
        owner = "HiSparseDSATokenToKVPool"
        for keyword, value, default in (("index_kpool", index_kpool, 1), ("index_kpool_compress", index_kpool_compress,
                                         False), ("tail_extra_slots", tail_extra_slots, 0)):  # fmt: skip
            if value != default:
                raise unsupported(owner, keyword, value, "an indexer of several or compressed key pools",
                                  f"pass {keyword}={default!r}")  # fmt: skip
        if skip_topk_layers is not None and any(skip_topk_layers):
            raise unsupported(owner, "skip_topk_layers", skip_topk_layers, "layers that skip the top-k selection",
                              "pass skip_topk_layers=None")  # fmt: skip
        if int(host_to_device_ratio) < 2:
            raise unsupported(owner, "host_to_device_ratio", host_to_device_ratio, "a host no larger than the device",
                              "pass host_to_device_ratio=2 or more, or build a DSATokenToKVPool")  # fmt: skip
        self.host_to_device_ratio = int(host_to_device_ratio)
        self.logical_size = size * self.host_to_device_ratio
        self.max_running_requests = max_running_requests
        super().__init__(size, page_size, kv_lora_rank, dtype, qk_rope_head_dim, layer_num, device, index_head_dim,
                         enable_memory_saver, start_layer, end_layer, kernels=kernels, index_dtype=index_dtype,
                         kv_cache_dim=kv_cache_dim)  # fmt: skip
        rows = self.logical_size + page_size
        pinned = torch.cuda.is_available() and torch.device(device).type == "cuda"
        self.host_kv_cache = torch.zeros((self.kv_cache.shape[0], rows, *self.kv_cache.shape[2:]),
                                         dtype=self.kv_cache.dtype, pin_memory=pinned)  # fmt: skip
        #: logical token -> device slot (0: cold); the trailing entry -1 is what a last_loc of -1 translates to
        identity = torch.arange(size + page_size, device=self.device)
        self._latent_mover = None
        self.full_to_hisparse_device_index_mapping = torch.cat([
            identity, torch.zeros(rows - identity.numel(), dtype=torch.int64, device=self.device),
            torch.full((1,), -1, dtype=torch.int64, device=self.device)])  # fmt: skip

    def _index_tokens(self) -> int:
        return self.size * self.host_to_device_ratio

    # -- the map ------------------------------------------------------------------------------------------

    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor) -> None:
        """Use the allocator's logical token -> device slot map (``logical tokens + page_size + 1`` int64 entries)."""
        if full_to_hisparse_device_index_mapping.shape != self.full_to_hisparse_device_index_mapping.shape:
            raise ValueError(f"a map of {self.full_to_hisparse_device_index_mapping.numel()} entries is needed, got "
                             f"{tuple(full_to_hisparse_device_index_mapping.shape)}")  # fmt: skip
        self.full_to_hisparse_device_index_mapping = full_to_hisparse_device_index_mapping

    def translate_loc_to_hisparse_device(self, indices: torch.Tensor) -> torch.Tensor:
        """The device slots of logical tokens ``indices`` (their shape; 0 for a cold token, -1 for -1)."""
        return self.full_to_hisparse_device_index_mapping[indices.long()]

    _translate_loc_to_hisparse_device = translate_loc_to_hisparse_device
    translate_loc_from_full_to_hisparse_device = translate_loc_to_hisparse_device

    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor) -> torch.Tensor:
        """SGLang's: the tokens themselves (no compression here)."""
        return full_indices

    # -- stores and reads by logical token ----------------------------------------------------------------

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope, layer_id_override: int | None = None) -> None:
        super().set_mla_kv_buffer(layer, self.translate_loc_to_hisparse_device(tokens_of(loc)), cache_k_nope, cache_k_rope,
                                  layer_id_override)  # fmt: skip

    def set_kv_buffer(self, layer, loc, cache_k, cache_v=None, k_scale=None, v_scale=None,
                      layer_id_override: int | None = None) -> None:  # fmt: skip
        super().set_kv_buffer(layer, self.translate_loc_to_hisparse_device(tokens_of(loc)), cache_k, cache_v, k_scale, v_scale,
                              layer_id_override)  # fmt: skip

    def get_mla_kv_buffer(self, layer, loc, dst_dtype: torch.dtype | None = None, *, out=None):
        return super().get_mla_kv_buffer(layer, self.translate_loc_to_hisparse_device(tokens_of(loc)), dst_dtype, out=out)

    def token_rows(self) -> dict[str, TokenRows]:
        """DSA's rows, the latent ones by logical token through the map (the indexer's are by logical token)."""
        rows = super().token_rows()
        rows["kv"] = TokenRows(self.kv_cache, index_map=self.full_to_hisparse_device_index_mapping)
        return rows

    # -- the host mirror ------------------------------------------------------------------------------------

    def backup_to_host(self, loc: torch.Tensor) -> None:
        """Copy the latent rows of hot logical tokens ``loc`` (every layer) to the host mirror, one launch (on the
        current stream: the host sees them once it has finished)."""
        loc = loc.reshape(-1).long()
        copy_rows(self.kv_cache, self.host_kv_cache, self.translate_loc_to_hisparse_device(loc),
                  loc.to(self.kv_cache.device), self._use_triton)  # fmt: skip

    def load_from_host(self, loc: torch.Tensor, slots: torch.Tensor) -> None:
        """Gather the host mirror's rows of logical tokens ``loc`` (every layer) into device slots ``slots`` and map
        the tokens there, one launch (:meth:`HiSparseTokenToKVPoolAllocator.load_to_device` takes the slots)."""
        loc, slots = loc.reshape(-1).long(), slots.reshape(-1).long()
        copy_rows(self.host_kv_cache, self.kv_cache, loc.to(self.kv_cache.device), slots, self._use_triton)
        self.full_to_hisparse_device_index_mapping[loc] = slots

    # -- moves: by logical token ----------------------------------------------------------------------------

    def move_groups(self) -> list[tuple[TokenRows, TokenRows | None]]:
        """The indexer's rows (by logical token); :meth:`move_kv_cache` moves the latent rows itself."""
        if self._move_groups is None:
            self._move_groups = pair_by_layers(r for name, r in super().token_rows().items() if name != "kv")
        return self._move_groups

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Move logical tokens ``src_loc`` to ``tgt_loc``: their indexer keys, the latent rows of their device slots
        (both tokens hot; a cold source moves the padding slot's rows) and their rows of the host mirror."""
        super().move_kv_cache(tgt_loc, src_loc)
        tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
        if tgt.numel() == 0:
            return
        mapping = self.full_to_hisparse_device_index_mapping
        if self._latent_mover is None:
            self._latent_mover = RowMover(TokenRows(self.kv_cache)) if self._use_triton else None
        if self._latent_mover is None:
            move_token_rows_native(TokenRows(self.kv_cache), None, mapping[tgt], mapping[src])
        else:
            self._latent_mover(mapping[tgt], mapping[src])
        copy_rows(self.host_kv_cache, self.host_kv_cache, src.cpu(), tgt.cpu(), use_triton=False)


class HiSparseTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """SGLang's ``HiSparseTokenToKVPoolAllocator``: logical tokens (``size * host_to_device_ratio``, what the engine
    holds) and device slots (``size``), each from an allocator of its own, and the map between them, registered with
    the pool.

    ``alloc`` and ``alloc_extend`` take both sides: a prefilled token is hot (its KV is written on the device);
    ``alloc_decode`` and :meth:`alloc_logical_only` take logical tokens only, as SGLang's (the engine gives a request
    its device buffer with :meth:`alloc_device_buffer`).  :meth:`free_hisparse` makes tokens cold (their device pages
    back; call :meth:`HiSparseDSATokenToKVPool.backup_to_host` first), :meth:`load_to_device` hot again,
    :meth:`free` gives both back.  Device slots come by whole pages (``page_size``): a cold token brought
    back takes a slot of the pages its call takes, and a page goes back when a token on it is made cold, so make a
    request's tokens cold together.

    :param size: device slots (the pool's ``size``).
    :param kvcache: a :class:`HiSparseDSATokenToKVPool`.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: Any, kvcache: HiSparseDSATokenToKVPool,
                 need_sort: bool = False, host_to_device_ratio: int = 2, kernels: str = "auto"):  # fmt: skip
        ratio = int(host_to_device_ratio)
        if ratio != kvcache.host_to_device_ratio:
            raise ValueError(f"host_to_device_ratio={ratio}, but the pool was built with {kvcache.host_to_device_ratio}")
        super().__init__(size * ratio, page_size, dtype, device, kvcache, need_sort, kernels)
        side = PagedTokenToKVPoolAllocator if page_size > 1 else TokenToKVPoolAllocator
        self.logical_attn_allocator = self._side(side, size * ratio)
        self.hisparse_attn_allocator = self._side(side, size)
        self._size_full, self._size_hisparse = size * ratio, size
        self.full_to_hisparse_device_index_mapping = torch.zeros(size * ratio + page_size + 1, dtype=torch.int64,
                                                                 device=self.device)  # fmt: skip
        self.full_to_hisparse_device_index_mapping[-1] = -1
        kvcache.register_mapping(self.full_to_hisparse_device_index_mapping)
        self._spec_scratch_capacity = self._spec_device_buffer_size = 0

    def _side(self, cls, tokens: int):
        if cls is TokenToKVPoolAllocator:
            return cls(tokens, self.dtype, self.device, self._kvcache, self.need_sort, self.kernels)
        return cls(tokens, self.page_size, self.dtype, self.device, self._kvcache, self.need_sort, self.kernels)

    @property
    def size_full(self) -> int:
        return self._size_full

    def available_size(self) -> int:
        """Tokens an allocation can take: hot ones, so the smaller of the two sides' free tokens."""
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size())

    def clear(self) -> None:
        """Everything free on both sides, every logical token cold."""
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1].zero_()
        self.is_not_in_free_group, self.free_group = True, []

    # -- allocation: logical tokens, hot ------------------------------------------------------------------

    def _hot(self, logical: Optional[torch.Tensor], device_slots: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if logical is None:
            return None
        if device_slots is None:
            self.logical_attn_allocator.free(logical)
            return None
        self.full_to_hisparse_device_index_mapping[logical.long()] = device_slots.long()
        return logical

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size > self.available_size():
            return None
        return self._hot(self.logical_attn_allocator.alloc(need_size), self.hisparse_attn_allocator.alloc(need_size))

    def alloc_extend(self, prefix_lens, prefix_lens_cpu=None, seq_lens=None, seq_lens_cpu=None, last_loc=None,
                     extend_num_tokens=None) -> Optional[torch.Tensor]:  # fmt: skip
        """SGLang's ``alloc_extend`` on both sides (the device side continues each request's last device page).  The
        new pages are counted on the host first (SGLang's check); None, with nothing taken, when either side lacks
        them."""
        prefix_cpu = prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu
        seq_cpu = seq_lens if seq_lens_cpu is None else seq_lens_cpu
        need = get_num_new_pages(seq_cpu, self.page_size, prefix_cpu) * self.page_size
        if need > self.logical_attn_allocator.available_size() or need > self.hisparse_attn_allocator.available_size():
            return None
        undo = self.logical_attn_allocator.backup_state()
        logical = self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                           last_loc, extend_num_tokens)  # fmt: skip
        if logical is None:
            return None
        hot = self.hisparse_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                        self._device_last(last_loc), extend_num_tokens)  # fmt: skip
        if hot is None:  # a cold last token's device page is not continued: one page more than counted
            self.logical_attn_allocator.restore_state(undo)  # (freeing would give back the request's own last page)
            return None
        self.full_to_hisparse_device_index_mapping[logical.long()] = hot.long()
        return logical

    def alloc_decode(self, seq_lens, seq_lens_cpu=None, last_loc=None) -> Optional[torch.Tensor]:
        """SGLang's ``alloc_decode``: logical tokens only (a decoded token's device slot is in its request's device
        buffer: :meth:`alloc_device_buffer`)."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu=None, seq_lens=None, seq_lens_cpu=None, last_loc=None,
                           extend_num_tokens=None) -> Optional[torch.Tensor]:  # fmt: skip
        """Logical tokens of an extension, no device slot (SGLang's, for decode-side extends)."""
        return self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                                        extend_num_tokens)  # fmt: skip

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int) -> torch.Tensor:
        """A request's device buffer of ``need_size`` slots (whole pages) for its logical tokens ``allocated_indices``:
        the device slots they hold (unmapped from them), the first ``need_size`` kept and the rest given back, or,
        when they hold fewer, the rest of their last page and new pages (SGLang's).

        :raises ValueError: when ``need_size`` is not whole pages.
        :raises RuntimeError: when the device has too few free pages.
        """
        page = self.page_size
        if need_size % page:
            raise ValueError(f"need_size={need_size} must be whole pages of {page}")
        held = take_mapped_slots(self.full_to_hisparse_device_index_mapping, allocated_indices)
        if held.numel() >= need_size:
            self.free_hisparse_indices(held[need_size:])
            return held[:need_size]
        return fill_to_pages(held, need_size, self.hisparse_attn_allocator)

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        """Give back device slots (the padding page's ignored)."""
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices >= self.page_size])

    def configure_spec_scratch(self, capacity: int, *, device_buffer_size: int = 0) -> None:
        """SGLang's speculative-decoding reservation: ``capacity`` scratch slots per new request and a device buffer
        of ``device_buffer_size`` (both whole pages; read by :meth:`request_slot_reserve`).

        :raises ValueError: for a size that is negative or not whole pages.
        """
        if any(size < 0 or size % self.page_size for size in (capacity, device_buffer_size)):
            raise ValueError(f"HiSparse spec scratch and device buffer sizes must be non-negative multiples of "
                             f"page_size={self.page_size}, got {capacity} and {device_buffer_size}")  # fmt: skip
        self._spec_scratch_capacity = capacity
        self._spec_device_buffer_size = device_buffer_size if capacity else 0

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        """Device slots a request must leave free beyond its prefill's pages: its buffer's missing slots, and its
        scratch when it has no request slot yet (SGLang's)."""
        paged_prefill = -(-prefill_tokens // self.page_size) * self.page_size
        scratch = 0 if has_req_pool_slot else self._spec_scratch_capacity
        return max(self._spec_device_buffer_size - paged_prefill, 0) + scratch

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        """The tokens themselves (no compression in DSA)."""
        return last_locs

    def get_last_loc_hisparse_device(self, last_locs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The device slots of the requests' last tokens (-1 stays -1)."""
        return self._device_last(last_locs)

    def _device_last(self, last_loc: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The device slots of the requests' last tokens (-1 stays -1; a cold last token's page is not continued)."""
        if last_loc is None:
            return None
        return self.full_to_hisparse_device_index_mapping[last_loc.long()]

    # -- hot and cold ---------------------------------------------------------------------------------------

    def free_hisparse(self, free_indices: torch.Tensor) -> None:
        """Make logical tokens cold: their device pages back, their map entries 0 (their rows stay on the host)."""
        mapping = self.full_to_hisparse_device_index_mapping
        self.free_hisparse_indices(mapping[free_indices.long()])
        mapping[free_indices.long()] = 0

    def load_to_device(self, loc: torch.Tensor) -> Optional[torch.Tensor]:
        """Bring cold logical tokens ``loc`` back: device slots for them (whole pages, the first ``len(loc)`` slots
        of the pages taken), their rows gathered from the host mirror in one launch, the map updated.  Returns the
        slots, or None (nothing changed) when the device has too few free pages."""
        slots = alloc_first_slots(self.hisparse_attn_allocator, loc.numel())
        if slots is not None:
            self._kvcache.load_from_host(loc, slots)
        return slots

    def free(self, free_index: torch.Tensor) -> None:
        """Both sides back (no free group: the map is cleared at once, as SGLang's)."""
        if free_index.numel() == 0:
            return
        self.free_hisparse(free_index)
        self.logical_attn_allocator.free(free_index)

    def free_group_begin(self) -> None:
        """Nothing held: a free clears the map at once (SGLang's)."""

    def free_group_end(self) -> None:
        """Nothing held."""

    supports_backup = False
    #: why the conformance kit's model of random request lifetimes does not describe this allocator
    lifetime_model_mismatch = ("its available_size() counts the device slots, which alloc_extend takes and "
                               "alloc_decode does not (SGLang's: the engine gives decoded tokens their device slots "
                               "through alloc_device_buffer); kvcore_dsa's tests drive its lifetimes")

    def backup_state(self) -> Any:
        raise NotImplementedError("HiSparseTokenToKVPoolAllocator keeps no snapshot (its map moves with every call)")

    def restore_state(self, state: Any) -> None:
        raise NotImplementedError("HiSparseTokenToKVPoolAllocator keeps no snapshot (its map moves with every call)")
