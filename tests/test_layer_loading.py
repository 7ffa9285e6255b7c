"""Layer-wise loading (``KVCache.register_layer_transfer_counter``): a read of a layer's rows waits until that
layer's host -> device load is done, by its local index; writes do not wait."""

from __future__ import annotations

import torch

from kvcore.testing.tensors import test_device
from kvcore_dsa.pool import DSATokenToKVPool
from kvcore_fp4.pool import MHATokenToKVPoolFP4
from kvcore_mha.pool import MHATokenToKVPool
from kvcore_mla.pool import MLATokenToKVPool

DEVICE = test_device()


class _Counter:
    def __init__(self):
        self.waited: list[int] = []

    def wait_until(self, local_layer: int) -> None:
        self.waited.append(local_layer)


def test_reads_wait_for_their_layer_and_writes_do_not():
    common = dict(device=DEVICE, enable_memory_saver=False, kernels="triton", start_layer=3)
    pools = {
        "mha": MHATokenToKVPool(size=16, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=2,
                                **common),
        "mla": MLATokenToKVPool(size=16, page_size=1, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=16,
                                layer_num=2, **common),
        "dsa": DSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                                qk_rope_head_dim=64, layer_num=2, index_head_dim=128, **common),
        "nvfp4": MHATokenToKVPoolFP4(size=16, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                     layer_num=2, kv_format="nvfp4", **common),
    }  # fmt: skip
    loc = torch.tensor([1, 2], device=DEVICE)
    for name, pool in pools.items():
        counter = _Counter()
        pool.register_layer_transfer_counter(counter)
        pool.self_test_write(4, loc, torch.Generator().manual_seed(1))
        assert counter.waited == [], name
        if hasattr(pool, "get_mla_kv_buffer"):
            pool.get_mla_kv_buffer(4, loc)
        elif hasattr(pool, "get_kv_buffer_by_loc"):
            pool.get_kv_buffer_by_loc(4, loc)
        else:
            pool.get_key_buffer(4)
        assert counter.waited == [1], name
