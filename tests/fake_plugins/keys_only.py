"""A keys-only backend (keys, no values): the smallest family the pool contract allows, as a worked example.

One stacked buffer and one write path; moves, CPU offload, buffer infos and sizes come from ``KVCache``.
"""

from __future__ import annotations

import torch

from kvcore import BackendSpec, BufferLayout, PoolLayout, hookimpl
from kvcore.kernels.dtypes import storage_dtype
from kvcore.pools import KVCache
from kvcore.sample import random_nonzero


def layout(request) -> PoolLayout:
    keys = BufferLayout(name="k", layers=request.layer_num, row_shape=(request.head_num, request.head_dim),
                        dtype=storage_dtype(request.kv_dtype), pad_tokens=request.page_size)  # fmt: skip
    return PoolLayout(backend="keys_only", buffers=(keys,))


class KeysOnlyPool(KVCache):
    def __init__(self, size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                 start_layer=None, end_layer=None, kernels="auto"):  # fmt: skip
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        self.k_cache = torch.zeros((layer_num, size + page_size, head_num, head_dim), dtype=self.store_dtype, device=device)
        self._finalize_allocation()

    def buffers(self):
        return {"k": self.k_cache}

    def get_key_buffer(self, layer_id):
        return self.k_cache[self.local_layer(layer_id)].view(self.dtype)

    def set_kv_buffer(self, layer, loc, cache_k):
        self.k_cache[self.local_layer(layer), loc.long()] = cache_k.to(self.dtype).view(self.store_dtype)

    def self_test_write(self, layer, loc, generator):
        keys = random_nonzero((loc.numel(), *self.k_cache.shape[2:]), torch.float32, generator, 2.0, self.device)
        self.set_kv_buffer(layer, loc, keys)
        return {"k": keys.to(self.dtype).view(self.store_dtype)}


def create_pool(request, layout, sizes):
    return KeysOnlyPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim, **request.pool_kwargs())


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name="keys_only", attention=("mha",), layout=layout, create_pool=create_pool)]
