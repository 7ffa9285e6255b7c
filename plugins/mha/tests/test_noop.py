"""The no-op pool for prefill-only serving: the kit's layout checks (nothing else applies: it stores nothing),
refusals that name the key, capacity from the caps, and `kvcore up` / `kvcore plugins --explain` on it."""

from __future__ import annotations

import pytest
import torch

import kvcore.plugins
from kvcore import build_pools, load_config, plan_memory
from kvcore.tools.cli import main
from kvcore.errors import PlanningError
from kvcore.testing import BaseLayoutTests, Variant

CONFIG = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3"]


class TestNoOpConformance(BaseLayoutTests):
    """The kit's layout and size checks: the only ones that apply to a pool that stores nothing (the store, move,
    offload and buffer-info checks need token rows; `kvcore check noop` reports them skipped by capability)."""

    backend = "noop"
    config = CONFIG
    variants = [Variant("bfloat16", "native", 1), Variant("float8_e4m3fn", "auto", 16)]


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def test_capacity_comes_from_the_caps_not_memory():
    base = ["model=llama-3-8b", "hardware=h200", "kv_cache.backend=noop", "kv_cache.page_size=16"]
    plan = plan_memory(load_config(*base, "memory.max_total_tokens=1000000"))
    m = load_config(*base).model
    assert plan.bytes_per_token == 0 and plan.max_total_num_tokens == 1000000 // 16 * 16
    assert plan.kv_cache_bytes == 2 * m.num_hidden_layers * 16 * m.num_key_value_heads * m.head_dim * 2  # placeholders
    by_requests = plan_memory(load_config(*base, "memory.max_running_requests=64"))
    assert by_requests.max_total_num_tokens == 64 * m.context_length
    with pytest.raises(PlanningError, match=r"stores no KV .* set memory\.max_total_tokens \(e\.g\. memory\.max_total_tokens="):
        plan_memory(load_config(*base))


def test_every_store_and_read_names_the_key():
    pools = build_pools(load_config(*CONFIG, "kv_cache.backend=noop", "memory.max_total_tokens=4096"))
    pool, allocator = pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    assert pool.size == 4096 and allocator.available_size() == 4096  # admission sees the capacity
    loc = allocator.alloc(4)
    x = torch.zeros(4, pool.head_num, pool.head_dim, dtype=torch.bfloat16)
    for call in (lambda: pool.set_kv_buffer(0, loc, x, x), lambda: pool.get_key_buffer(0), lambda: pool.get_value_buffer(1),
                 lambda: pool.move_kv_cache(loc, loc), lambda: pool.get_cpu_copy(loc)):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"stores nothing: kv_cache\.backend=noop \(prefill-only serving\)"):
            call()
    assert sum(b.nbytes for b in pool.buffers().values()) == pools.plan.kv_cache_bytes


def test_up_and_explain(capsys):
    assert main(["up", *CONFIG, "kv_cache.backend=noop", "memory.max_total_tokens=8192"]) == 0
    out = capsys.readouterr().out
    assert "NoOpMHATokenToKVPool stores no KV: write, move and offload skipped" in out
    assert "kvcore up: ready: 8192 tokens" in out
    assert main(["plugins", "--explain", *CONFIG, "kv_cache.backend=noop"]) == 0
    assert "selected backend 'noop' (plugin mha): named by kv_cache.backend" in capsys.readouterr().out
