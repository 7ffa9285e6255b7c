"""The pool contract from the outside: a keys-only backend written as a test plugin (tests/fake_plugins/keys_only.py,
one small file with its layout) passes the whole conformance kit through the fixtures that derive the request,
layout and pools from the backend's name, with no value buffer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kvcore
from kvcore.plugins import load_registry
from kvcore.testing import KVCacheConformance, Variant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_plugins import keys_only  # noqa: E402


@pytest.fixture(scope="module")
def registry():
    return load_registry(env={}, extra_plugins=[("keys_only", keys_only)])


class TestKeysOnlyConformance(KVCacheConformance):
    backend = "keys_only"
    config = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3"]
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "native", 16)]

    @pytest.fixture
    def kv_registry(self, registry):
        return registry


def small_config(registry):
    return kvcore.load_config("model=qwen2.5-0.5b", "model.num_hidden_layers=2", "kv_cache.backend=keys_only",
                              "memory.max_total_tokens=64", registry=registry)  # fmt: skip


def test_keys_only_pool_has_no_values(registry):
    pools = kvcore.build_pools(small_config(registry), registry=registry)
    assert set(pools.token_to_kv_pool.buffers()) == {"k"}
    with pytest.raises(NotImplementedError, match="keeps keys only"):
        pools.token_to_kv_pool.get_value_buffer(0)


def test_the_kit_catches_a_layout_that_disagrees_with_its_pool(registry):
    """The kit builds the pool and the layout through the backend itself: a layout declaring other rows than
    the pool allocates fails the layout test (before, a hand-built kv_layout hid this until `kvcore up`)."""
    import attrs
    import torch

    from kvcore import make_request
    from kvcore.testing import BaseLayoutTests

    request = make_request(small_config(registry), registry=registry)
    pool = keys_only.create_pool(request, None, {"tokens": 64})
    honest = keys_only.layout(request)
    BaseLayoutTests().test_layout_bytes_equal_allocated_bytes(pool, honest)
    (k,) = honest.buffers
    lying = attrs.evolve(honest, buffers=(attrs.evolve(k, dtype=torch.float32),))
    with pytest.raises(AssertionError, match="buffer k: dtype torch.bfloat16 != layout torch.float32"):
        BaseLayoutTests().test_layout_bytes_equal_allocated_bytes(pool, lying)

