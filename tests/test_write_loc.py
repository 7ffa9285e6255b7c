"""Every builtin pool's stores take a ``KVWriteLoc`` (kvcore.pools.write_loc) as they take a bare ``loc``: an engine
written against SGLang 0.5.23, which hands every layer's store the step's write locations in one, can switch to any
kvcore pool.  Two pools built alike, one written with bare locations and one with the same locations in a
``KVWriteLoc``, by each pool's own write path (``self_test_write``, every store method it calls), hold the same
bytes; in checked mode too."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.pools import KVWriteLoc, tokens_of

SMALL = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3", "model.num_key_value_heads=3",
         "model.head_dim=24"]  # fmt: skip
DSA = ["model=deepseek-v3.2", "model.num_hidden_layers=2", "model.mla.kv_lora_rank=256", "parallel.tp_size=1",
       "memory.budget_gib=1"]  # fmt: skip
CONFIGS = {
    "mha": SMALL,
    "mha page-major": [*SMALL, "kv_cache.page_size=4", "kv_cache.layout=page_major"],
    "mla": ["model=tiny-mla"],
    "dsa fp8": DSA,
    "dsa hisparse": [*DSA, "kv_cache.options.host_to_device_ratio=2"],
    "nvfp4": [*SMALL, "model.head_dim=32", "kv_cache.dtype=nvfp4"],
    "nvfp4 mla": ["model=tiny-mla", "kv_cache.dtype=nvfp4"],
    "k_only": [*SMALL, "kv_cache.backend=k_only"],
    "double_sparse": [*SMALL, "kv_cache.backend=double_sparse", "kv_cache.options.heavy_channel_num=5"],
    "swa": ["model=tiny-swa"],
    "mamba hybrid": ["model=tiny-qwen3-next"],
    "minimax sparse": ["model=tiny-minimax-sparse"],
}
STORES = ("set_kv_buffer", "set_mla_kv_buffer", "set_index_kv_buffer", "set_index_k_buffer", "set_index_k_scale_buffer")


def _build(overrides, checked: bool):
    cfg = kvcore.load_config(*overrides, "hardware=cpu", "hardware.kernels=native", "memory.max_total_tokens=256",
                             "memory.max_running_requests=4", *(["hardware.checked=true"] if checked else []))  # fmt: skip
    return kvcore.build_pools(cfg).token_to_kv_pool


def _bundling(pool, counted: list[str]) -> None:
    """Make ``pool``'s own stores receive their locations in a KVWriteLoc (and count the calls); a hybrid
    linear-attention pool's own write path is its full-attention pool's, whose stores the hybrid routes to."""
    inner = getattr(pool, "unchecked", pool)
    if hasattr(inner, "mamba_pool"):
        inner = inner.full_kv_pool
    for name in STORES:
        method = getattr(inner, name, None)
        if method is None:
            continue

        def bundled(layer, loc, *args, _method=method, _name=name, **kwargs):
            counted.append(_name)
            return _method(layer, KVWriteLoc(loc), *args, **kwargs)

        setattr(inner, name, bundled)


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "checked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_kv_write_loc_stores_what_its_tokens_store(name, checked):
    plain, bundled = _build(CONFIGS[name], checked), _build(CONFIGS[name], checked)
    calls: list[str] = []
    _bundling(bundled, calls)
    page = plain.page_size
    loc = torch.randperm(plain.size, generator=torch.Generator().manual_seed(1))[:7] + page  # past the padding page
    for pool in (plain, bundled):
        for layer in pool.token_layers():
            pool.self_test_write(layer, loc, torch.Generator().manual_seed(layer))
    assert calls, f"{name}: its write path called none of {STORES}"
    for buf, got in zip(plain.buffers().values(), bundled.buffers().values()):
        assert torch.equal(buf.view(torch.uint8), got.view(torch.uint8)), f"{name}: a KVWriteLoc store differs"
    assert tokens_of(KVWriteLoc(loc, full_loc=loc + 1)) is not loc and tokens_of(loc) is loc
