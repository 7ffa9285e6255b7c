"""The K-only pool: per-layer key rows ``[head_num, head_dim]`` and nothing else."""

from __future__ import annotations

import torch
from kvcore_mha.row_store import RowStore

from kvcore.pools import KVCache, tokens_of
from kvcore.sample import random_nonzero


class MHATokenToKOnlyPool(KVCache):
    """Keys of the layers that keep no values.

    ``k_buffer[i]`` is the ``[size + page_size, head_num, head_dim]`` rows of local layer ``i`` (a view of the
    stacked ``k_cache``; row 0, the first page, is padding).  fp8 caches are stored as uint8.  The store is one
    launch (:class:`kvcore_mha.row_store.RowStore`) or its torch reference, by the kernels mode.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str, enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None, kernels: str = "auto"):  # fmt: skip
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        self.head_num, self.head_dim = head_num, head_dim
        self.k_cache = torch.zeros((layer_num, size + page_size, head_num, head_dim), dtype=self.store_dtype, device=device)
        self.k_buffer = list(self.k_cache.unbind(0))
        self._store = RowStore([self.k_cache], dtype, self._use_triton, names=("cache_k",))
        self._finalize_allocation()

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache}

    def get_key_buffer(self, layer_id) -> torch.Tensor:
        local = self._read_layer(layer_id)
        buf = self.k_cache[local]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor | None = None,
                      k_scale=None, v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Store the keys ``cache_k`` (``[N, head_num, head_dim]``, or ``[N, head_num * head_dim]``) of
        ``loc.numel()`` tokens into ``layer``, converted to the cache dtype.

        :raises ValueError: for values (this pool keeps none), or a scale with keys that need converting (it
            stores unscaled keys).
        """
        if cache_v is not None:
            raise ValueError(f"{type(self).__name__} keeps keys only (kv_cache.backend=k_only): pass cache_v=None")
        if (k_scale is not None or v_scale is not None) and cache_k.dtype != self.dtype:
            raise ValueError(f"{type(self).__name__} stores unscaled keys: pass k_scale=None")
        local = self.local_layer(layer, layer_id_override)
        loc = tokens_of(loc)
        if cache_k.dim() == 2:
            cache_k = cache_k.view(-1, self.head_num, self.head_dim)
        try:
            self._store(local, loc if loc.dim() == 1 else loc.reshape(-1), cache_k)
        except ValueError as exc:
            raise ValueError(f"layer {self.start_layer + local}: {exc}") from None

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random keys through :meth:`set_kv_buffer` (from bf16 for fp8 caches, so the cast is exercised)."""
        source = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        keys = random_nonzero((loc.numel(), self.head_num, self.head_dim), source, generator, 2.0, self.device)
        self.set_kv_buffer(layer, loc, keys)
        return {"k": keys.to(self.dtype).view(self.store_dtype)}
