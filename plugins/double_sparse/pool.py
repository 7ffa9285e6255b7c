"""The DoubleSparse pool: K and V rows ``[head_num, head_dim]`` and label rows ``[head_num, heavy_channel_num]``
per token, all three written by one launch."""

from __future__ import annotations

import torch
from kvcore_mha.row_store import RowStore

from kvcore.pools import KVCache, tokens_of
from kvcore.sample import random_nonzero


class DoubleSparseTokenToKVPool(KVCache):
    """Keys, values and heavy-channel labels of every layer (SGLang's constructor and accessors).

    ``k_buffer[i]`` / ``v_buffer[i]`` / ``label_buffer[i]`` are local layer ``i``'s rows, views of the stacked
    ``k_cache`` / ``v_cache`` / ``label_cache`` (``size + page_size`` rows: the first page is padding; SGLang
    gives the labels ``size + 1`` rows, one padding row, which at page sizes above 1 leaves the last page's
    labels short).  fp8 caches are stored as uint8, labels included.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str, heavy_channel_num: int, enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None, kernels: str = "auto"):  # fmt: skip
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        if not 0 < heavy_channel_num <= head_dim:
            raise ValueError(f"heavy_channel_num must be in 1..head_dim={head_dim}, got {heavy_channel_num}")
        self.head_num, self.head_dim, self.heavy_channel_num = head_num, head_dim, heavy_channel_num
        rows = size + page_size

        def stacked(width: int) -> torch.Tensor:
            return torch.zeros((layer_num, rows, head_num, width), dtype=self.store_dtype, device=device)

        self.k_cache, self.v_cache, self.label_cache = stacked(head_dim), stacked(head_dim), stacked(heavy_channel_num)
        self.k_buffer = list(self.k_cache.unbind(0))
        self.v_buffer = list(self.v_cache.unbind(0))
        self.label_buffer = list(self.label_cache.unbind(0))
        self._store = RowStore([self.k_cache, self.v_cache, self.label_cache], dtype, self._use_triton)
        self._finalize_allocation()

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache, "label": self.label_cache}

    def _view(self, stacked: torch.Tensor, layer_id) -> torch.Tensor:
        local = self._read_layer(layer_id)
        buf = stacked[local]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id) -> torch.Tensor:
        return self._view(self.k_cache, layer_id)

    def get_value_buffer(self, layer_id) -> torch.Tensor:
        return self._view(self.v_cache, layer_id)

    def get_label_buffer(self, layer_id) -> torch.Tensor:
        """Layer ``layer_id``'s labels, ``[size + page_size, head_num, heavy_channel_num]``."""
        return self._view(self.label_cache, layer_id)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      cache_label: torch.Tensor, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Store K, V (``[N, head_num, head_dim]``) and labels (``[N, head_num, heavy_channel_num]``) of
        ``loc.numel()`` tokens into ``layer``, converted to the cache dtype, in one launch."""
        local = self.local_layer(layer, layer_id_override)
        loc = tokens_of(loc)
        try:
            self._store(local, loc if loc.dim() == 1 else loc.reshape(-1), cache_k, cache_v, cache_label)
        except ValueError as exc:
            raise ValueError(f"layer {self.start_layer + local}: {exc}") from None

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        source = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        rows = {name: random_nonzero((loc.numel(), self.head_num, width), source, generator, 2.0, self.device)
                for name, width in (("k", self.head_dim), ("v", self.head_dim), ("label", self.heavy_channel_num))}  # fmt: skip
        self.set_kv_buffer(layer, loc, rows["k"], rows["v"], rows["label"])
        return {name: x.to(self.dtype).view(self.store_dtype) for name, x in rows.items()}
