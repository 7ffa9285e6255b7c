"""The acme pool: K and V interleaved per page, on kvcore's pool contract (:class:`kvcore.pools.KVCache`)."""

from __future__ import annotations

import torch

from kvcore.pools import KVCache
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_acme.kernels import store_kv_native, store_kv_triton
from kvcore_acme.layout import ACME_DTYPES


class AcmeKVPool(KVCache):
    """Keys and values of MHA/GQA layers, a page of K and a page of V side by side.

    ``kv_cache`` is ``[layer_num, pages + 1, 2, page_size, head_num, head_dim]`` (page 0 is padding).
    :meth:`get_key_buffer` / :meth:`get_value_buffer` return a layer's ``[pages + 1, page_size, head_num,
    head_dim]`` view of keys / values, the shape acme's paged attention reads.

    kvcore moves, offloads and checks the pool through :meth:`token_rows`: the buffer seen as rows of
    ``[head_num, head_dim]``, where each page is ``2 * page_size`` rows long, keys from row 0 and values from
    row ``page_size``.  That is all a pool with its own layout has to say for kvcore's row move, CPU offload
    and conformance kit to work on it.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool = False,
        start_layer: int | None = None,
        end_layer: int | None = None,
        kernels: str = "auto",
    ):
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        if dtype not in ACME_DTYPES:
            raise ValueError(f"AcmeKVPool stores {', '.join(map(str, ACME_DTYPES))}, not {dtype}")
        self.head_num, self.head_dim = head_num, head_dim
        pages = size // page_size + 1
        self.kv_cache = torch.zeros((layer_num, pages, 2, page_size, head_num, head_dim), dtype=dtype, device=device)
        self._store = store_kv_triton if self._use_triton else store_kv_native
        self._finalize_allocation()

    # -- what kvcore needs to know about the layout ---------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv_cache}

    def token_rows(self) -> dict[str, TokenRows]:
        layers, pages, _, page, heads, dim = self.kv_cache.shape
        rows = self.kv_cache.view(layers, pages * 2 * page, heads, dim)
        return {"k": TokenRows(rows, page, 2 * page, 0), "v": TokenRows(rows, page, 2 * page, page)}

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer: (pointer, bytes, bytes of one page): a page of K and V is one contiguous item."""
        layers = self.kv_cache.unbind(0)
        return [t.data_ptr() for t in layers], [t.nbytes for t in layers], [t[0].nbytes for t in layers]

    # -- reads and writes ---------------------------------------------------------------------------------

    def get_key_buffer(self, layer_id) -> torch.Tensor:
        return self._layer(layer_id)[:, 0]

    def get_value_buffer(self, layer_id) -> torch.Tensor:
        return self._layer(layer_id)[:, 1]

    def _layer(self, layer_id) -> torch.Tensor:
        local = self.local_layer(layer_id)
        self._wait_for_layer(local)  # layer-wise loading: attention reads wait for the layer's transfer
        return self.kv_cache[local]

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      k_scale=None, v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Store K and V (``[N, head_num, head_dim]``) of ``loc.numel()`` tokens into ``layer``.

        :raises ValueError: for a scale with an input that needs converting (acme stores unscaled values).
        """
        local = self.local_layer(layer, layer_id_override)
        if (k_scale is not None or v_scale is not None) and cache_k.dtype != self.dtype:
            raise ValueError("AcmeKVPool stores unscaled values: pass k_scale=None and v_scale=None")
        if loc.device != self.kv_cache.device:
            raise ValueError(f"loc is on {loc.device}, the pool on {self.kv_cache.device}")
        self._store(self.kv_cache, local, loc.reshape(-1), cache_k, cache_v)

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        rows = {name: random_nonzero((loc.numel(), self.head_num, self.head_dim), self.dtype, generator, 2.0, self.device)
                for name in ("k", "v")}  # fmt: skip
        self.set_kv_buffer(layer, loc, rows["k"], rows["v"])
        return rows
