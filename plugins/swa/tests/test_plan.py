"""Sizing hybrid sliding-window pools: the full / window token split against SGLang's formula, the window
minimum and the ratio that reaches it, and the command line (plan, plugins --explain, up)."""

from __future__ import annotations

import math

import pytest

import kvcore.plugins
from kvcore import load_config, plan_memory
from kvcore.tools.cli import main
from kvcore.errors import PlanningError
from kvcore_swa.layout import attention_layer_ids

GIB = 2**30


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def seed_split(budget: int, page: int, cell_full: int, cell_swa: int, n_full: int, n_swa: int, ratio: float):
    """SGLang's split of a hybrid pool, from the configurator's arithmetic: the tokens an all-full pool of
    ``n_full + n_swa`` layers would hold, re-spread as ``full * n_full + ratio * full * n_swa`` layer-tokens;
    less the padding page both sub-pools keep (kvcore plans exact bytes)."""
    per_layer_token = cell_full  # bytes of one token in one layer (same heads for both kinds here)
    padding = page * (n_full * cell_full + n_swa * cell_swa)
    all_full_tokens = (budget - padding) // (per_layer_token * (n_full + n_swa))
    full = int(all_full_tokens * (n_full + n_swa) / (ratio * n_swa + n_full))
    return full // page * page, int(full // page * page * ratio) // page * page


@pytest.mark.parametrize("model, hardware, tp, page", [("gpt-oss-120b", "h200", 1, 1), ("gpt-oss-20b", "h100", 1, 16),
                                                       ("gemma-3-27b", "h200", 2, 64), ("tiny-swa", "cpu", 1, 1)])  # fmt: skip
def test_full_and_window_tokens_follow_the_seeds_split(model, hardware, tp, page):
    cfg = load_config(f"model={model}", f"hardware={hardware}", f"parallel.tp_size={tp}", f"kv_cache.page_size={page}")
    plan = plan_memory(cfg)
    m = cfg.model
    full_ids, swa_ids = attention_layer_ids(m.num_hidden_layers, m.swa.full_attention_interval)
    cell = 2 * max(1, m.num_key_value_heads // tp) * m.head_dim * 2  # K and V, bf16
    full, window = seed_split(plan.budget.kv_budget_bytes, page, cell, cell, len(full_ids), len(swa_ids), 0.8)
    assert plan.full_max_total_num_tokens == plan.max_total_num_tokens
    # SGLang rounds the ratio's product down once more than kvcore's exact search: at most a page apart
    assert 0 <= plan.full_max_total_num_tokens - full <= page
    assert abs(plan.swa_max_total_num_tokens - window) <= page
    # exact: the plan fits, one more page of full tokens (with its window share) would not
    layout = plan.layout
    assert plan.kv_cache_bytes == layout.total_bytes(plan.sizes) <= plan.budget.kv_budget_bytes
    bigger = plan.full_max_total_num_tokens + page
    assert layout.total_bytes({"tokens": bigger, "swa_tokens": int(bigger * 0.8)}) > plan.budget.kv_budget_bytes


def test_a_window_that_does_not_fit_names_the_ratio_that_would():
    args = ["model=tiny-swa", "hardware=cpu", "memory.budget_gib=0.001", "kv_cache.page_size=16"]
    with pytest.raises(PlanningError) as err:
        plan_memory(load_config(*args, "memory.swa_full_tokens_ratio=0.01"))
    message = str(err.value)
    assert "swa_tokens" in message and "model.swa.sliding_window=64" in message and "plus a page" in message
    ratio = float(message.split("memory.swa_full_tokens_ratio=")[1].split(" ")[0])
    plan = plan_memory(load_config(*args, f"memory.swa_full_tokens_ratio={ratio}"))
    assert plan.swa_max_total_num_tokens >= (math.ceil(64 / 16) + 1) * 16  # the window in pages, plus a page
    with pytest.raises(PlanningError):  # and it is the smallest such ratio, to 3 decimals
        plan_memory(load_config(*args, f"memory.swa_full_tokens_ratio={ratio - 0.002}"))


def test_plan_reports_both_sides(capsys):
    assert main(["plan", "model=gpt-oss-120b", "hardware=h200"]) == 0
    out = capsys.readouterr().out
    assert "full_max_total_num_tokens" in out and "swa_max_total_num_tokens" in out
    assert "18 full-attention and 18 sliding-window layers (window 128 tokens)" in out
    assert "(swa_tokens)" in out


def test_explain_says_why_swa_serves_gpt_oss(capsys):
    assert main(["plugins", "--explain", "model=gpt-oss-120b", "hardware=h200"]) == 0
    out = capsys.readouterr().out
    assert "selected backend 'swa'" in out and "skipped 'mha' (plugin mha): serves attention mha, model needs swa" in out


@pytest.mark.parametrize("model, overrides", [("tiny-swa", []), ("tiny-gemma-3", ["kv_cache.page_size=16"]),
                                              ("tiny-swa", ["kv_cache.page_size=16", "model.swa.full_attention_interval=0"])],
                         ids=["gpt-oss-like", "gemma-3-like-paged", "all-sliding-paged"])  # fmt: skip
def test_up_is_ready_on_the_cpu(capsys, model, overrides):
    assert main(["up", f"model={model}", "hardware=cpu", "memory.budget_gib=0.02", *overrides]) == 0
    out = capsys.readouterr().out
    assert "SWAKVPool, SWATokenToKVPoolAllocator" in out and "kvcore up: ready" in out
