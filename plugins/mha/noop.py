"""The no-op pool for prefill-only serving (``kv_cache.backend=noop``; SGLang's ``--prefill-only-disable-kv-cache``).

An engine that only prefills (embeddings, scoring, rerankers) never reads the KV cache back, yet its scheduler
admits requests by the pool's token capacity.  This pool keeps that view (``size`` tokens, an ordinary allocator
hands out locations) and allocates only a placeholder page per layer; any store or read raises, naming the key
that chose the pool.  The planner sees a layout with no bytes per token, so the capacity comes from
``memory.max_total_tokens`` (or ``memory.max_running_requests`` x the context), not from memory.
"""

from __future__ import annotations

import torch

from kvcore.pools import KVCache, check_post_capture

REASON = ("stores nothing: kv_cache.backend=noop (prefill-only serving) selected it; set kv_cache.backend=mha "
          "(or auto) to keep the KV cache")  # fmt: skip


class NoOpMHATokenToKVPool(KVCache):
    """Capacity without storage: ``size`` tokens for admission, a placeholder page of K and V per layer.

    Takes :class:`~kvcore_mha.MHATokenToKVPool`'s constructor keywords, with the same meaning (``swa_*`` widths
    replace the others; ``enable_alt_stream`` and ``enable_kv_cache_copy`` are accepted either way, there being
    nothing to store or move; ``post_capture_active=True`` is a :class:`~kvcore.errors.ConfigError`).
    ``k_buffer[i]`` / ``v_buffer[i]`` are the placeholders (``[page_size, head_num, head_dim]``), so code that
    sizes itself from them still runs.

    :raises RuntimeError: from every store, read, move and CPU copy.
    """

    alt_stream = None

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str, enable_memory_saver: bool = False, v_head_dim: int | None = None,
                 swa_head_num: int | None = None, swa_head_dim: int | None = None, swa_v_head_dim: int | None = None,
                 start_layer: int | None = None, end_layer: int | None = None, enable_alt_stream: bool = True,
                 enable_kv_cache_copy: bool = False, post_capture_active: bool = False, kernels: str = "auto"):  # fmt: skip
        check_post_capture(type(self).__name__, post_capture_active)
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        head_num = swa_head_num if swa_head_num is not None else head_num
        head_dim = swa_head_dim if swa_head_dim is not None else head_dim
        v_head_dim = swa_v_head_dim if swa_v_head_dim is not None else v_head_dim
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, v_head_dim or head_dim
        self.k_cache = torch.zeros((layer_num, page_size, head_num, head_dim), dtype=self.store_dtype, device=device)
        self.v_cache = torch.zeros((layer_num, page_size, head_num, self.v_head_dim), dtype=self.store_dtype, device=device)
        self.k_buffer, self.v_buffer = list(self.k_cache.unbind(0)), list(self.v_cache.unbind(0))
        self._finalize_allocation()

    def _refuse(self, what: str):
        raise RuntimeError(f"{type(self).__name__}.{what}: this pool {REASON}")

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) of the placeholders (SGLang's pair, as every MHA-shaped pool's)."""
        return self.k_cache.nbytes, self.v_cache.nbytes

    def token_buffers(self) -> dict[str, torch.Tensor]:
        return {}  # no buffer is indexed by token: nothing to move, offload or transfer

    def get_key_buffer(self, layer_id) -> torch.Tensor:
        self.local_layer(layer_id)  # an out-of-range layer is still an IndexError
        self._refuse("get_key_buffer")

    def get_value_buffer(self, layer_id) -> torch.Tensor:
        self._refuse("get_value_buffer")

    def set_kv_buffer(self, layer, loc, cache_k, cache_v=None, *args, **kwargs) -> None:
        self._refuse("set_kv_buffer")

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        self._refuse("move_kv_cache")

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        self._refuse("get_cpu_copy")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None) -> None:
        self._refuse("load_cpu_copy")

    def self_test_write(self, layer, loc, generator):
        self._refuse("self_test_write")
