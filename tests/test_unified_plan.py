"""memory.unified=true in the plan: what one range shared by a hybrid model's two kinds of state holds at each
extreme, beside the split pools, computed here from the layouts' declared bytes; refusals that name the key."""

from __future__ import annotations


import pytest

import kvcore
import kvcore.plugins
from kvcore.errors import ConfigError, PlanningError
from kvcore.tools.cli import main


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


@pytest.mark.parametrize("page", [1, 16])
def test_a_mamba_hybrid_in_one_range(page):
    cfg = kvcore.load_config("model=tiny-qwen3-next", "memory.unified=true", f"kv_cache.page_size={page}")
    plan = kvcore.plan_memory(cfg)
    u, layout = plan.unified, plan.layout
    # by hand, from the declared buffers: K and V of the full layers per token, conv and temporal per slot
    per_token = sum(b.layers * b.row_bytes for b in layout.buffers if b.sized_by == "tokens")
    # a slot's envelope: each state buffer's layers in a block that starts on a 16-byte boundary
    per_slot = sum(-(-b.layers * b.row_bytes // 16) * 16 for b in layout.buffers if b.sized_by == "requests")
    # the range is the split pools' bytes: their token pages and their state slots
    budget = -(-plan.sizes["tokens"] // page) * per_token * page + plan.sizes["requests"] * per_slot
    assert budget <= plan.budget.kv_budget_bytes
    assert (u.token_page_bytes, u.other_unit_bytes, u.other) == (per_token * page, per_slot, "requests")
    assert u.budget_bytes == budget and u.memory_bytes == (per_token * page + budget) // 16 * 16 + per_slot
    assert plan.kv_cache_bytes == u.memory_bytes
    assert u.max_tokens == budget // (per_token * page) * page and u.max_other == budget // per_slot
    assert (u.split_tokens, u.split_other) == (plan.sizes["tokens"], plan.sizes["requests"])
    # the split pools use part of what the range could hold of each kind
    assert u.split_tokens < u.max_tokens and u.split_other < u.max_other


def test_a_sliding_window_hybrid_in_one_range():
    plan = kvcore.plan_memory(kvcore.load_config("model=tiny-swa", "memory.unified=true", "kv_cache.page_size=16"))
    u, layout = plan.unified, plan.layout
    full = sum(b.layers * b.row_bytes for b in layout.buffers if b.sized_by == "tokens")
    window = sum(b.layers * b.row_bytes for b in layout.buffers if b.sized_by == "swa_tokens")
    budget = plan.sizes["tokens"] // 16 * full * 16 + plan.sizes["swa_tokens"] // 16 * window * 16
    assert (u.other, u.token_page_bytes, u.other_unit_bytes) == ("swa_tokens", full * 16, window * 16)
    assert u.max_tokens == budget // (full * 16) * 16 and u.max_other == budget // (window * 16) * 16
    assert u.split_other == plan.sizes["swa_tokens"]


def test_speculative_states_stay_outside_the_range():
    cfg = kvcore.load_config("model=tiny-qwen3-next", "memory.unified=true", "memory.max_running_requests=8",
                             "speculative.algorithm=eagle3", "speculative.draft_model=tiny-eagle3")  # fmt: skip
    plan = kvcore.plan_memory(cfg)
    running = sum(b.total_bytes(8) for b in plan.layout.group("running_requests"))
    assert running > 0 and plan.kv_cache_bytes == plan.unified.memory_bytes + running


def test_refusals_name_the_key():
    with pytest.raises(PlanningError, match=r"memory.unified=true .* backend 'mha' keeps only \['tokens'\]"):
        kvcore.plan_memory(kvcore.load_config("memory.unified=true"))
    with pytest.raises(ConfigError, match="memory.unified=true with speculative.algorithm=eagle3"):
        kvcore.build_pools(kvcore.load_config("model=tiny-qwen3-next", "memory.unified=true",
                                              "speculative.algorithm=eagle3", "speculative.draft_model=tiny-eagle3"))  # fmt: skip


def test_kvcore_plan_prints_the_unified_figures(capsys):
    assert main(["plan", "model=tiny-qwen3-next", "memory.unified=true"]) == 0
    out = capsys.readouterr().out
    assert "unified   one range of" in out and "full-attention tokens (no state slots)" in out


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-swa", "tiny-kimi-linear"])
def test_kvcore_up_builds_the_unified_pools(model, capsys):
    assert main(["up", f"model={model}", "memory.unified=true", "kv_cache.page_size=16", "memory.budget_gib=0.25"]) == 0
    out = capsys.readouterr().out
    assert "unified   one range of" in out and "kvcore up: ready" in out and "Unified" in out


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_disaggregated_workers_build_the_unified_memory(mode):
    """A decode worker's request table keeps its pre-allocated rows, its state slots in the unified memory."""
    pools = kvcore.build_pools(kvcore.load_config("model=tiny-qwen3-next", "memory.unified=true",
                                                  f"disaggregation.mode={mode}", "memory.max_running_requests=8",
                                                  "memory.max_total_tokens=256"))  # fmt: skip
    table, memory = pools.req_to_token_pool, pools.token_to_kv_pool.memory
    pre_alloc = pools.plan.pre_alloc_size
    assert (pre_alloc > 0) == (mode == "decode")
    assert table.req_to_token.shape[0] == 8 + pre_alloc + 1  # the running requests, the pre-allocated ones, padding
    slots = table.mamba_pool.alloc(2)
    assert memory.allocator.used("high") == 2 and table.mamba_pool.translate(slots).tolist() != [0, 0]
