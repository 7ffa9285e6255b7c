"""SWAKVPool: a hybrid sliding-window pool composed of two token pools (full-attention and sliding-window)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from kvcore.pools import (KVCache, KVWriteLoc, WriteLoc, check_pool_class, check_post_capture, layer_id_of, tokens_of,
                          unsupported)  # fmt: skip
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_mha.page_major import PageMajorMHATokenToKVPool
from kvcore_mha.pool import MHATokenToKVPool

SWA_PREFIX = "swa_"


class SWAKVPool(KVCache):
    """Keys and values of a hybrid sliding-window model: full-attention layers in one sub-pool of ``size``
    tokens, sliding-window layers in another of ``size_swa`` tokens, both of ``token_to_kv_pool_class`` (MHA by
    default; the window layers may have their own heads and widths, ``swa_head_num`` / ``swa_head_dim`` /
    ``swa_v_head_dim``).

    Engines address tokens by their *full* location (the allocator's); a window layer's slot of full location
    ``t`` is ``full_to_swa_index_mapping[t]``, which the :class:`~kvcore_swa.allocator.SWATokenToKVPoolAllocator`
    registers (:meth:`register_mapping`).  Until one is registered, full locations address the window
    sub-pool directly (SGLang's behaviour).  Writes to window layers translate inside the store kernel (one
    launch); moves, CPU offload (:meth:`token_rows` carries the mapping) and buffer infos cover both
    sub-pools.

    ``layers_mapping[global layer id] = (index in its sub-pool, is_swa)``.  Buffers are named as the
    sub-pools name them, the window one's prefixed ``swa_`` (``k``, ``v``, ``swa_k``, ``swa_v`` for MHA).
    A model whose layers all slide has no full sub-pool (``full_kv_pool is None``); one without window layers
    has no window sub-pool.

    :param size: full-attention tokens (the allocator's location space).  0 with no full-attention layers (what
        SGLang's configurator passes when every layer slides) makes the location space the ``size_swa`` window
        slots.
    :param size_swa: sliding-window tokens.
    :param swa_attention_layer_ids: global ids of this rank's sliding-window layers.
    :param full_attention_layer_ids: global ids of this rank's full-attention layers; together the two lists
        must be exactly this rank's layers ``start_layer .. end_layer``.
    :param token_to_kv_pool_class: the class both sub-pools are built with: kvcore's
        :class:`~kvcore_mha.MHATokenToKVPool` (the default) or :class:`~kvcore_mha.PageMajorMHATokenToKVPool`
        (SGLang's page-major switch), or a subclass of either; any other class (another engine's pool, a pool of
        another family, the no-op pool) is a :class:`~kvcore.errors.ConfigError`.
    :param enable_kv_cache_copy: accepted either way: :meth:`move_kv_cache` always exists (SGLang prepares its
        copy kernel only when True).
    :param post_capture_active: only False (kvcore allocates both sub-pools when built); True is a
        :class:`~kvcore.errors.ConfigError`.
    :param enable_kvcache_transpose: only False (SGLang's own pool refuses True too).
    :param full_pool_kwargs: keywords for the full sub-pool's constructor alone (default None: none), on top of
        the shared ones: a page-major sub-pool's ``memory=`` / ``virtual_pages=``, say.
    :param swa_pool_kwargs: the same for the window sub-pool.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        swa_attention_layer_ids: Sequence[int],
        full_attention_layer_ids: Sequence[int],
        device: str,
        enable_memory_saver: bool = False,
        token_to_kv_pool_class: type | None = None,
        v_head_dim: int | None = None,
        swa_head_num: int | None = None,
        swa_head_dim: int | None = None,
        swa_v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_kvcache_transpose: bool = False,
        enable_kv_cache_copy: bool = False,
        post_capture_active: bool = False,
        kernels: str = "auto",
        full_pool_kwargs: dict[str, Any] | None = None,
        swa_pool_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        check_post_capture("SWAKVPool", post_capture_active)
        if enable_kvcache_transpose:
            raise unsupported("SWAKVPool", "enable_kvcache_transpose", enable_kvcache_transpose,
                              "a transposed KV cache", "pass enable_kvcache_transpose=False")  # fmt: skip
        cls = token_to_kv_pool_class or MHATokenToKVPool
        check_pool_class("SWAKVPool", "token_to_kv_pool_class", cls, (MHATokenToKVPool, PageMajorMHATokenToKVPool))
        full_ids, swa_ids = [int(i) for i in full_attention_layer_ids], [int(i) for i in swa_attention_layer_ids]
        ids = sorted(full_ids + swa_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"layer ids must be distinct and not empty: full {full_ids}, sliding-window {swa_ids}")
        start = ids[0] if start_layer is None else start_layer
        if ids != list(range(start, start + len(ids))):
            raise ValueError(
                f"full {full_ids} and sliding-window {swa_ids} layer ids must together be layers {start}.. of this "
                f"rank, each once"
            )
        if size == 0 and not full_ids:  # SGLang's call for a model whose layers all slide: no full tokens
            size = size_swa  # locations are then the window slots themselves (no mapping registered)
        super().__init__(size, page_size, dtype, len(ids), device, enable_memory_saver, start,
                         start + len(ids) - 1 if end_layer is None else end_layer, kernels)  # fmt: skip
        if swa_ids and (size_swa <= 0 or size_swa % page_size):
            raise ValueError(f"size_swa={size_swa} must be a positive number of whole pages of {page_size}")
        self.size_swa = size_swa
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        self.full_attention_layer_ids, self.swa_attention_layer_ids = full_ids, swa_ids
        self.full_layer_nums, self.swa_layer_nums = len(full_ids), len(swa_ids)
        common = dict(page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim, device=device,
                      enable_memory_saver=enable_memory_saver, v_head_dim=v_head_dim, kernels=kernels, **kwargs)  # fmt: skip
        self.full_kv_pool = (cls(size=size, layer_num=len(full_ids), **common, **(full_pool_kwargs or {}))
                             if full_ids else None)  # fmt: skip
        self.swa_kv_pool = (
            cls(size=size_swa, layer_num=len(swa_ids), swa_head_num=swa_head_num, swa_head_dim=swa_head_dim,
                swa_v_head_dim=swa_v_head_dim, **common, **(swa_pool_kwargs or {}))  # fmt: skip
            if swa_ids else None
        )
        self.layers_mapping: dict[int, tuple[int, bool]] = {gid: (i, False) for i, gid in enumerate(full_ids)}
        self.layers_mapping.update({gid: (i, True) for i, gid in enumerate(swa_ids)})
        self.full_to_swa_index_mapping: torch.Tensor | None = None
        #: the last KVWriteLoc a window layer stored by, and what its window sub-pool took of it
        self._last_write_loc: tuple[KVWriteLoc | None, KVWriteLoc | None] = (None, None)
        self._maps_in_store = self.swa_kv_pool is not None and "index_map" in inspect.signature(
            type(self.swa_kv_pool).set_kv_buffer
        ).parameters
        self._finalize_allocation()

    # -- the mapping --------------------------------------------------------------------------------------

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Use the allocator's full -> window slot map (``int64 [size + page_size]``, entry 0 = 0) from now on."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self._move_groups = self._movers = None

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """Window slots (int32) of full locations ``kv_indices``; 0 for tokens that slid out of the window."""
        if self.full_to_swa_index_mapping is None:
            raise RuntimeError("no full -> sliding-window mapping registered; build the pool's SWATokenToKVPoolAllocator")
        return self.full_to_swa_index_mapping[kv_indices].to(torch.int32)

    # -- layers -------------------------------------------------------------------------------------------

    def _route(self, layer: Any, layer_id_override: int | None = None) -> tuple[KVCache, int, bool]:
        if layer_id_override is not None:
            layer_id = layer_id_override
        else:
            layer_id = layer if type(layer) is int else layer_id_of(layer)
        route = self.layers_mapping.get(layer_id)
        if route is None:
            raise IndexError(
                f"layer {layer_id} is not stored by this SWAKVPool: full-attention layers {self.full_attention_layer_ids}, "
                f"sliding-window layers {self.swa_attention_layer_ids}"
            )
        self._wait_for_layer(layer_id - self.start_layer)
        index, is_swa = route
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), index, is_swa

    def layer_in_buffer(self, name: str, layer: int) -> int | None:
        route = self.layers_mapping.get(layer)
        if route is None or route[1] != name.startswith(SWA_PREFIX):
            return None
        return route[0]

    # -- buffers ------------------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        found = {} if self.full_kv_pool is None else dict(self.full_kv_pool.buffers())
        if self.swa_kv_pool is not None:
            found.update({SWA_PREFIX + name: buf for name, buf in self.swa_kv_pool.buffers().items()})
        return found

    def size_groups(self) -> dict[str, int]:
        sizes = {"tokens": self.size}
        if self.swa_kv_pool is not None:
            sizes["swa_tokens"] = self.size_swa
        return sizes

    def token_rows(self) -> dict[str, TokenRows]:
        """The full sub-pool's rows, and the window sub-pool's behind the full -> window mapping."""
        rows = {} if self.full_kv_pool is None else dict(self.full_kv_pool.token_rows())
        if self.swa_kv_pool is not None:
            for name, window in self.swa_kv_pool.token_rows().items():
                rows[SWA_PREFIX + name] = TokenRows(window.rows, window.tokens_per_page, window.rows_per_page,
                                                    window.first_row, self.full_to_swa_index_mapping)  # fmt: skip
        return rows

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """SGLang's ``(K bytes, V bytes)``, each summed over both sub-pools (MHA-shaped, each answering a pair)."""
        parts = [p.get_kv_size_bytes() for p in (self.full_kv_pool, self.swa_kv_pool) if p is not None]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The full sub-pool's buffer infos, then the window sub-pool's (each as its pool reports them: per layer
        and buffer, or per page of all layers for page-major sub-pools)."""
        infos = [p.get_contiguous_buf_infos() for p in (self.full_kv_pool, self.swa_kv_pool) if p is not None]
        return tuple([x for info in infos for x in info[i]] for i in range(3))  # type: ignore[return-value]

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The window sub-pool's buffer infos alone (SGLang's split; :meth:`get_contiguous_buf_infos` lists both)."""
        return self.swa_kv_pool.get_contiguous_buf_infos() if self.swa_kv_pool is not None else ([], [], [])

    # -- reads and writes ---------------------------------------------------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, index, _ = self._route(layer_id)
        return pool.get_key_buffer(index)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, index, _ = self._route(layer_id)
        return pool.get_value_buffer(index)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, index, _ = self._route(layer_id)
        return pool.get_kv_buffer(index)

    def set_kv_buffer(self, layer, loc: WriteLoc, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None,
                      v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Store K/V of full locations ``loc`` into ``layer`` (routed by layer; window layers write slots
        ``full_to_swa_index_mapping[loc]``, translated inside the store's launch).

        ``loc`` may be a :class:`~kvcore.pools.KVWriteLoc`: full-attention layers get it as it is (their
        sub-pool reads its ``full_loc`` or ``loc``), window layers write its ``swa_loc`` when it has one (the
        window tokens, mapped once per step) and else map its full locations as above."""
        pool, index, is_swa = self._route(layer, layer_id_override)
        if loc.__class__ is KVWriteLoc:
            if not is_swa:
                pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=index)
                return
            window = self._window_write_loc(loc)
            if window is not None:
                pool.set_kv_buffer(None, window, cache_k, cache_v, k_scale, v_scale, layer_id_override=index)
                return
            loc = tokens_of(loc)
        mapping = self.full_to_swa_index_mapping if is_swa else None
        if mapping is None:
            pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=index)
        elif self._maps_in_store:
            pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=index, index_map=mapping)
        else:  # a sub-pool class without index_map: translate first
            pool.set_kv_buffer(None, mapping[loc.long()], cache_k, cache_v, k_scale, v_scale, layer_id_override=index)

    def _window_write_loc(self, loc_info: KVWriteLoc) -> KVWriteLoc | None:
        """What the window sub-pool's store takes of ``loc_info``: its ``swa_loc`` with its mark (made once per
        ``loc_info``, for all the window layers of a step), or None when it has none."""
        if loc_info.swa_loc is None:
            return None
        if self._last_write_loc[0] is not loc_info:
            self._last_write_loc = (loc_info, KVWriteLoc(loc_info.swa_loc, physical=loc_info.physical))
        return self._last_write_loc[1]

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Move full locations ``src_loc`` to ``tgt_loc`` in both sub-pools (window slots through the mapping;
        tokens that slid out of the window map to the padding slot, whose contents do not matter)."""
        if tgt_loc.numel() != src_loc.numel():
            raise ValueError(f"move_kv_cache: {tgt_loc.numel()} targets but {src_loc.numel()} sources")
        if self.full_kv_pool is not None:
            self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)
        if self.swa_kv_pool is not None:
            mapping = self.full_to_swa_index_mapping
            if mapping is not None:
                tgt_loc, src_loc = mapping[tgt_loc.long()], mapping[src_loc.long()]
            self.swa_kv_pool.move_kv_cache(tgt_loc, src_loc)

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random K/V rows of full locations ``loc`` through :meth:`set_kv_buffer` (from bf16 for fp8 caches)."""
        pool, _, is_swa = self._route(layer)
        source_dtype = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        rows = {
            name: random_nonzero((loc.numel(), pool.head_num, width), source_dtype, generator, 2.0, self.device)
            for name, width in (("k", pool.head_dim), ("v", pool.v_head_dim))
        }
        self.set_kv_buffer(layer, loc, rows["k"], rows["v"])
        prefix = SWA_PREFIX if is_swa else ""
        return {prefix + name: x.to(self.dtype).view(self.store_dtype) for name, x in rows.items()}
