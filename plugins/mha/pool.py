"""MHA/GQA token-to-KV pool: per-layer K and V rows of ``[head_num, head_dim]`` (V may be narrower)."""

from __future__ import annotations

import torch

from kvcore.pools import KVCache, KVWriteLoc, check_post_capture, tokens_of
from kvcore.sample import random_nonzero
from kvcore_mha.kernels import KVStore


class MHATokenToKVPool(KVCache):
    """Keys and values of multi-head / grouped-query attention layers.

    ``k_buffer[i]`` / ``v_buffer[i]`` are the ``[size + page_size, head_num, head_dim]`` rows of local layer
    ``i``, views of the stacked ``k_cache`` / ``v_cache``.  Row 0 (the first page) is padding.

    SGLang's constructor keywords, as its engines pass them:

    :param enable_alt_stream: SGLang overlaps the K copy and the V copy of a store on a second stream during
        CUDA-graph capture.  kvcore's store writes K and V in one launch, so there is nothing to overlap: either
        value is accepted, and no side stream is created (``alt_stream`` is None).
    :param enable_kv_cache_copy: SGLang prepares its KV-copy kernel only when this is True (its
        ``move_kv_cache`` fails otherwise).  kvcore's :meth:`move_kv_cache` always exists (the row-move kernels are
        set up at the first move), so either value is accepted.
    :param post_capture_active: only False: kvcore allocates the pool when it is built; True (backing the
        buffers after CUDA-graph capture) is a :class:`~kvcore.errors.ConfigError`.
    :param kernels: ``auto`` (Triton on CUDA), ``triton`` or ``native`` (torch reference).
    """

    #: SGLang's side stream for overlapped K/V copies; kvcore stores both in one launch and keeps none.
    alt_stream = None

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        v_head_dim: int | None = None,
        swa_head_num: int | None = None,
        swa_head_dim: int | None = None,
        swa_v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_alt_stream: bool = True,
        enable_kv_cache_copy: bool = False,
        post_capture_active: bool = False,
        kernels: str = "auto",
    ):
        check_post_capture(type(self).__name__, post_capture_active)
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        # The swa_* dimensions let a sliding-window sub-pool differ from the full-attention one.
        self.head_num = swa_head_num if swa_head_num is not None else head_num
        self.head_dim = swa_head_dim if swa_head_dim is not None else head_dim
        if swa_v_head_dim is not None:
            self.v_head_dim = swa_v_head_dim
        else:
            self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        rows = size + page_size
        self.k_cache = torch.zeros((layer_num, rows, self.head_num, self.head_dim), dtype=self.store_dtype, device=device)
        self.v_cache = torch.zeros((layer_num, rows, self.head_num, self.v_head_dim), dtype=self.store_dtype, device=device)
        self.k_buffer = list(self.k_cache.unbind(0))
        self.v_buffer = list(self.v_cache.unbind(0))
        self._store = KVStore(self.k_cache, self.v_cache, dtype, self._use_triton)
        self._finalize_allocation()

    # -- layout and sizes --------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) over all layers, padding included."""
        return self.k_cache.nbytes, self.v_cache.nbytes

    # -- reads -------------------------------------------------------------------------------------------

    def _view(self, stacked: torch.Tensor, layer_id: int) -> torch.Tensor:
        local = self._read_layer(layer_id)
        buf = stacked[local]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_cache, layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_cache, layer_id)

    # -- writes ------------------------------------------------------------------------------------------

    @property
    def set_kv_buffer_writes_rows(self) -> bool:
        """True (see :class:`~kvcore.pools.KVCache`), unless a subclass stores otherwise."""
        return type(self).set_kv_buffer is MHATokenToKVPool.set_kv_buffer

    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor | KVWriteLoc,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        layer_id_override: int | None = None,
        index_map: torch.Tensor | None = None,
    ) -> None:
        """Store K and V of ``loc.numel()`` tokens into ``layer`` (an int, anything with ``layer_id``, or None
        with ``layer_id_override``).

        Inputs of another dtype than the cache are divided by ``k_scale`` / ``v_scale`` (when given; float32
        division, one rounding) and converted inside the kernel; inputs already in the cache dtype are copied
        and the scales ignored, as in SGLang.  Unlike SGLang, the inputs themselves are never modified.

        :param loc: the tokens, or a :class:`~kvcore.pools.KVWriteLoc` (its ``full_loc`` or else ``loc``).
        :param index_map: write rows ``index_map[loc]`` instead of ``loc``, translated inside the same launch
            (a sliding-window sub-pool stores full-pool locations this way; kvcore's extension).
        """
        if layer.__class__ is int and layer_id_override is None and self.start_layer <= layer <= self.end_layer:
            local = layer - self.start_layer  # local_layer's common case, inlined: this runs per layer and step
        else:
            local = self.local_layer(layer, layer_id_override)
        if loc.__class__ is KVWriteLoc:  # this pool's tokens are physical: the bundle's full-side tokens
            loc = tokens_of(loc)
        if cache_k.dim() == 2:  # [N, H * D], as some attention backends hand them over
            cache_k = cache_k.view(-1, self.head_num, self.head_dim)
            cache_v = cache_v.view(-1, self.head_num, self.v_head_dim)
        try:
            self._store(local, loc if loc.dim() == 1 else loc.reshape(-1), cache_k, cache_v, k_scale, v_scale, index_map)
        except ValueError as exc:
            raise ValueError(f"layer {self.start_layer + local}: {exc}") from None

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random K/V rows through :meth:`set_kv_buffer` (from bf16 for fp8 caches, so the cast is exercised)."""
        source_dtype = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        rows = {
            name: random_nonzero((loc.numel(), self.head_num, width), source_dtype, generator, 2.0, self.device)
            for name, width in (("k", self.head_dim), ("v", self.v_head_dim))
        }
        self.set_kv_buffer(layer, loc, rows["k"], rows["v"])
        return {name: x.to(self.dtype).view(self.store_dtype) for name, x in rows.items()}
