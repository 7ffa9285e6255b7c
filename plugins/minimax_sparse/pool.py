"""MiniMaxSparseKVPool: main K/V of every layer in an MHA pool, and the sparse layers' index rows beside it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore.kernels.dtypes import storage_dtype
from kvcore.pools import KVCache, buf_infos, check_pool_class, layer_id_of, tokens_of, unsupported
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_mha import MHATokenToKVPool, RowStore

_INDEX_KV, _INDEX_K_ONLY = ("index_k", "index_v"), "index_k_only"


class MiniMaxSparseKVPool(KVCache):
    """SGLang's ``MiniMaxSparseKVPool``, with its constructor keywords: keys and values of every layer of this rank
    in ``main_pool`` (an :class:`~kvcore_mha.MHATokenToKVPool`), and per token of each sparse layer an index key of
    one head of ``idx_head_dim`` with an index value (layers not in ``disable_value_sparse_layer_ids``) or without
    one (layers in it), in ``index_dtype`` (default: ``dtype``).

    Buffers: ``k`` / ``v`` (every layer), ``index_k`` / ``index_v`` (sparse layers with index values, stacked in
    ``index_kv_layer_id_mapping`` order) and ``index_k_only`` (the value-less ones, ``index_k_layer_id_mapping``
    order); each ``size + page_size`` rows, the first page padding, fp8 stored as uint8.  As in SGLang, transfer
    engines see the main K/V as the token buffers (:meth:`get_contiguous_buf_infos`) and the index rows through
    :meth:`get_state_buf_infos` (addressed by the same pages); moves and CPU offload cover all of them.  The index
    rows of one layer are written in one launch (:class:`~kvcore_mha.RowStore`), the main K/V in another.

    :param start_layer: this rank's first layer; ``end_layer`` is one past its last, as SGLang's configurator passes
        it here (the dense and sparse ids of this rank are those in ``start_layer <= id < end_layer``, and must
        cover that range once each).  Default: the span of the ids given.
    :param main_pool_cls: kvcore's :class:`~kvcore_mha.MHATokenToKVPool` (or a subclass); another class is a
        :class:`~kvcore.errors.ConfigError`.
    :param index_kv_pool_cls: / ``index_k_pool_cls``: None (kvcore keeps the index rows itself); a class is a
        ``ConfigError``.
    :param enable_hisparse: only False (HiSparse's host-resident tokens are not built yet); True is a ``ConfigError``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        idx_head_dim: int,
        dense_layer_ids: Sequence[int],
        sparse_layer_ids: Sequence[int],
        device: str,
        disable_value_sparse_layer_ids: Sequence[int] | None = None,
        enable_memory_saver: bool = False,
        index_dtype: torch.dtype | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        main_pool_cls: type | None = None,
        index_kv_pool_cls: Any = None,
        index_k_pool_cls: Any = None,
        enable_hisparse: bool = False,
        host_to_device_ratio: int = 2,
        kernels: str = "auto",
    ):
        owner = "MiniMaxSparseKVPool"
        if enable_hisparse:
            raise unsupported(owner, "enable_hisparse", enable_hisparse, "HiSparse (every token in host memory, a "
                              "share of them on the device)", "pass enable_hisparse=False")  # fmt: skip
        for name, value in (("index_kv_pool_cls", index_kv_pool_cls), ("index_k_pool_cls", index_k_pool_cls)):
            if value is not None:
                raise unsupported(owner, name, value, "another class for the index rows",
                                  f"pass {name}=None: kvcore keeps the index rows in the pool itself")  # fmt: skip
        main_cls = main_pool_cls or MHATokenToKVPool
        check_pool_class(owner, "main_pool_cls", main_cls, (MHATokenToKVPool,))
        dense, sparse = [int(i) for i in dense_layer_ids], [int(i) for i in sparse_layer_ids]
        every = sorted(dense + sparse)
        start = every[0] if start_layer is None else int(start_layer)
        end = every[-1] + 1 if end_layer is None else int(end_layer)
        dense = [i for i in dense if start <= i < end]
        sparse = [i for i in sparse if start <= i < end]
        if sorted(dense + sparse) != list(range(start, end)):
            raise ValueError(f"dense {dense} and sparse {sparse} layer ids must cover this rank's layers {start}..{end - 1} "
                             "once each")  # fmt: skip
        super().__init__(size, page_size, dtype, end - start, device, enable_memory_saver, start, end - 1, kernels)
        self.main_pool = main_cls(size=size, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
                                  layer_num=end - start, device=device, enable_memory_saver=enable_memory_saver,
                                  start_layer=start, end_layer=end - 1, kernels=kernels)  # fmt: skip
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, self.main_pool.v_head_dim
        self.idx_head_dim = idx_head_dim
        self.index_dtype = index_dtype or dtype
        self.dense_layer_ids = dense
        disabled = {int(i) for i in (disable_value_sparse_layer_ids or ())}
        with_value, no_value = [g for g in sparse if g not in disabled], [g for g in sparse if g in disabled]
        self.sparse_layer_id_mapping = {g: i for i, g in enumerate(sparse)}
        self.index_kv_layer_id_mapping = {g: i for i, g in enumerate(with_value)}
        self.index_k_layer_id_mapping = {g: i for i, g in enumerate(no_value)}
        store = storage_dtype(self.index_dtype)

        def stacked(layers: int) -> torch.Tensor:
            return torch.zeros((layers, size + page_size, 1, idx_head_dim), dtype=store, device=device)

        self._index: dict[str, torch.Tensor] = {}
        self._index_kv_store = self._index_k_store = None
        if with_value:
            self._index.update(index_k=stacked(len(with_value)), index_v=stacked(len(with_value)))
            self._index_kv_store = RowStore([self._index["index_k"], self._index["index_v"]], self.index_dtype,
                                            self._use_triton, names=("cache_idx_k", "cache_idx_v"))  # fmt: skip
        if no_value:
            self._index[_INDEX_K_ONLY] = stacked(len(no_value))
            self._index_k_store = RowStore([self._index[_INDEX_K_ONLY]], self.index_dtype, self._use_triton,
                                           names=("cache_idx_k",))  # fmt: skip
        self._finalize_allocation()

    # -- buffers ------------------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**self.main_pool.buffers(), **self._index}

    def token_buffers(self) -> dict[str, torch.Tensor]:
        """The main K/V (the index rows ride :meth:`get_state_buf_infos`, as in SGLang)."""
        return dict(self.main_pool.buffers())

    def token_rows(self) -> dict[str, TokenRows]:
        """Every per-token row: the main K/V and the index rows (moves and CPU offload carry them all)."""
        return {name: TokenRows(buf) for name, buf in self.buffers().items()}

    def layer_in_buffer(self, name: str, layer: int) -> int | None:
        if name in _INDEX_KV:
            return self.index_kv_layer_id_mapping.get(layer)
        if name == _INDEX_K_ONLY:
            return self.index_k_layer_id_mapping.get(layer)
        return super().layer_in_buffer(name, layer)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """SGLang's ``(K bytes, V bytes)``: the main pool's, plus the index keys to K and the index values to V."""
        k, v = self.main_pool.get_kv_size_bytes()
        index_k = sum(self._index[n].nbytes for n in ("index_k", _INDEX_K_ONLY) if n in self._index)
        return k + index_k, v + (self._index["index_v"].nbytes if "index_v" in self._index else 0)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        return self.main_pool.get_contiguous_buf_infos()

    def get_sparse_kv_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """SGLang's: the main K of every sparse layer, then their V (pointer, bytes, bytes of one page)."""
        return self._layer_kv_buf_infos(sorted(self.sparse_layer_id_mapping))

    def get_dense_kv_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """SGLang's: the same for the dense layers."""
        return self._layer_kv_buf_infos(self.dense_layer_ids)

    def _layer_kv_buf_infos(self, layers: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        views = [self.main_pool.get_key_buffer(g) for g in layers] + [self.main_pool.get_value_buffer(g) for g in layers]
        return buf_infos(views, self.page_size)

    def get_index_k_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """SGLang's: the index keys of the keys-only sparse layers, per layer (pointer, bytes, bytes of one page);
        empty without such layers."""
        return buf_infos(self._index[_INDEX_K_ONLY].unbind(0) if _INDEX_K_ONLY in self._index else [], self.page_size)

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The index rows, per layer and buffer: (pointer, bytes, bytes of one page), addressed by the main K/V's
        pages (they share token locations)."""
        return buf_infos([layer for buf in self._index.values() for layer in buf.unbind(0)], self.page_size)

    # -- reads --------------------------------------------------------------------------------------------

    def _index_view(self, name: str, local: int) -> torch.Tensor:
        buf = self._index[name][local]
        return buf.view(self.index_dtype) if buf.dtype != self.index_dtype else buf

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._read_layer(layer_id)
        return self.main_pool.get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._read_layer(layer_id)
        return self.main_pool.get_value_buffer(layer_id)

    def _index_kv_local(self, layer_id: int) -> int:
        """Where a sparse layer with index values sits in ``index_k`` / ``index_v``.

        :raises ValueError: for a dense layer, or one whose index keeps keys only."""
        local = self.index_kv_layer_id_mapping.get(layer_id)
        if local is None:
            raise ValueError(f"layer {layer_id} has no index values (it is dense, or its index keeps keys only); index "
                             f"layers with values: {list(self.index_kv_layer_id_mapping)}")  # fmt: skip
        return local

    def get_index_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index keys and values of a sparse layer with index values, ``[size + page_size, 1, idx_head_dim]`` each."""
        self._read_layer(layer_id)
        local = self._index_kv_local(layer_id)
        return self._index_view("index_k", local), self._index_view("index_v", local)

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        """Index keys of any sparse layer."""
        self._read_layer(layer_id)
        local = self.index_k_layer_id_mapping.get(layer_id)
        if local is not None:
            return self._index_view(_INDEX_K_ONLY, local)
        local = self.index_kv_layer_id_mapping.get(layer_id)
        if local is None:
            raise ValueError(f"layer {layer_id} is not a sparse attention layer; sparse layers: "
                             f"{list(self.sparse_layer_id_mapping)}")  # fmt: skip
        return self._index_view("index_k", local)

    # -- writes -------------------------------------------------------------------------------------------

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None,
                      v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Store the main K/V of ``loc`` into ``layer`` (dense or sparse), as :class:`~kvcore_mha.MHATokenToKVPool`."""
        layer_id = layer_id_override if layer_id_override is not None else layer_id_of(layer)
        self.main_pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=layer_id)

    def _scaled(self, x: torch.Tensor, scale) -> torch.Tensor:
        """``x / scale`` when it is converted to the index dtype and a scale is given (a new tensor), else ``x``."""
        return x / scale if scale is not None and x.dtype != self.index_dtype else x

    def set_index_kv_buffer(self, layer, loc: torch.Tensor, cache_idx_k: torch.Tensor, cache_idx_v: torch.Tensor,
                            k_scale=None, v_scale=None) -> None:  # fmt: skip
        """Store the index keys and values (``[N, 1, idx_head_dim]`` or ``[N, idx_head_dim]``) of ``loc`` into a
        sparse layer with index values, in one launch; inputs of another dtype are divided by the scales first."""
        local = self._index_kv_local(layer_id_of(layer))
        self._index_kv_store(local, self._flat(loc), self._rows(self._scaled(cache_idx_k, k_scale)),
                             self._rows(self._scaled(cache_idx_v, v_scale)))  # fmt: skip

    def set_index_k_buffer(self, layer, loc: torch.Tensor, cache_idx_k: torch.Tensor, k_scale=None) -> None:
        """Store the index keys of ``loc`` into a sparse layer whose index keeps no values."""
        layer_id = layer_id_of(layer)
        local = self.index_k_layer_id_mapping.get(layer_id)
        if local is None:
            raise ValueError(f"layer {layer_id} is not in the keys-only index group; those layers: "
                             f"{list(self.index_k_layer_id_mapping)}")  # fmt: skip
        self._index_k_store(local, self._flat(loc), self._rows(self._scaled(cache_idx_k, k_scale)))

    def set_fused_kv_index_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                                  cache_idx_k: torch.Tensor, cache_idx_v: torch.Tensor | None, k_scale=None,
                                  v_scale=None, idx_k_scale=None, idx_v_scale=None) -> None:  # fmt: skip
        """The main K/V and the index rows of a sparse layer (``cache_idx_v`` None for a keys-only index): two
        launches here (SGLang fuses them into one on CUDA)."""
        self.set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale)
        if cache_idx_v is None:
            self.set_index_k_buffer(layer, loc, cache_idx_k, idx_k_scale)
        else:
            self.set_index_kv_buffer(layer, loc, cache_idx_k, cache_idx_v, idx_k_scale, idx_v_scale)

    @staticmethod
    def _flat(loc) -> torch.Tensor:
        loc = tokens_of(loc)
        return loc if loc.dim() == 1 else loc.reshape(-1)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 1, self.idx_head_dim) if x.dim() == 2 else x

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random main K/V (:meth:`MHATokenToKVPool.self_test_write`) and, for a sparse layer, index rows, each
        through its store; fp8 rows written from bf16, so the casts are exercised."""
        written = self.main_pool.self_test_write(layer, loc, generator)
        source = torch.bfloat16 if self.index_dtype.itemsize == 1 else self.index_dtype
        names = _INDEX_KV if layer in self.index_kv_layer_id_mapping else (
            (_INDEX_K_ONLY,) if layer in self.index_k_layer_id_mapping else ())  # fmt: skip
        rows = {name: random_nonzero((loc.numel(), 1, self.idx_head_dim), source, generator, 2.0, self.device)
                for name in names}  # fmt: skip
        if names == _INDEX_KV:
            self.set_index_kv_buffer(layer, loc, rows["index_k"], rows["index_v"])
        elif names:
            self.set_index_k_buffer(layer, loc, rows[_INDEX_K_ONLY])
        store = storage_dtype(self.index_dtype)
        return {**written, **{name: x.to(self.index_dtype).view(store) for name, x in rows.items()}}
