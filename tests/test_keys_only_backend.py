"""The pool contract from the outside: a keys-only backend written as a test plugin (tests/fake_plugins/keys_only.py,
one small file with its layout) passes the whole conformance kit through the fixtures that derive the request,
layout and pools from the backend's name, with no value buffer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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


def test_keys_only_pool_has_no_values(registry):
    import kvcore

    cfg = kvcore.load_config("model=qwen2.5-0.5b", "kv_cache.backend=keys_only", "memory.max_total_tokens=64",
                             registry=registry)  # fmt: skip
    pools = kvcore.build_pools(cfg, registry=registry)
    assert set(pools.token_to_kv_pool.buffers()) == {"k"}
    with pytest.raises(NotImplementedError, match="keeps keys only"):
        pools.token_to_kv_pool.get_value_buffer(0)
