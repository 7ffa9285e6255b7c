"""The memory planner against an independent re-computation of the arithmetic of SGLang's KV-cache configurator.

Expected numbers come from the raw YAML files (read with PyYAML, not through kvcore) and the formulas of
``_profile_available_bytes`` / ``_apply_token_constraints`` / ``resolve_max_num_reqs`` written out here:

    pre     = int(memory_gib x 2^30)
    weights = ceil(num_parameters x 2 / (tp x pp))                    (bf16 weights)
    slack   = int(pre x (1 - mem_fraction_static))
    budget  = pre - weights - slack
    bpt     = kv_heads_per_rank x (head_dim + v_head_dim) x kv_bytes x layers_of_the_rank
    fixed   = page_size x bpt                                          (the padding page)
    tokens  = (budget - fixed) // bpt, capped by max_total_tokens, then rounded down to whole pages
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import yaml

import kvcore
from kvcore import PlanningError, load_config
from kvcore.plugins import load_registry

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GIB = 2**30


def raw(group: str, name: str) -> dict:
    return yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def registry():
    """The installed plugins, independent of the caller's KVCORE_* environment."""
    reg = load_registry(env={})
    assert "mha" in reg.backends
    return reg


def expected_tokens(model, hardware, *, tp=1, pp=1, page=1, kv_bytes=2, mfs=0.88, cap=None,
                    budget_gib=None, free=None, weights_loaded=False):
    """(bytes per token of the limiting rank, page-aligned tokens, kv budget, pre)."""
    m, hw = raw("model", model), raw("hardware", hardware)
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    kv_heads = max(1, m["num_key_value_heads"] // tp)
    layers = math.ceil(m["num_hidden_layers"] / pp)  # the largest stage limits everyone
    bpt = kv_heads * (head_dim + head_dim) * kv_bytes * layers
    if budget_gib is not None:
        pre, budget = int(budget_gib * GIB), int(budget_gib * GIB)
    else:
        pre = int(hw["memory_gib"] * GIB) if free is None else free
        weights = 0 if weights_loaded else math.ceil(m["num_parameters"] * 2 / (tp * pp))
        slack = int(pre * (1 - mfs))
        budget = pre - weights - slack
    fixed = page * bpt
    tokens = (budget - fixed) // bpt
    if cap is not None:
        tokens = min(tokens, cap)
    tokens = tokens // page * page
    return bpt, tokens, budget, pre


def expected_requests(tokens, context, user=None, dp=1):
    """SGLang's resolve_max_num_reqs."""
    estimated = int(tokens / context * 512)
    estimated = max(min(estimated, 4096), 2048)
    if user is not None:
        return min(user // dp, tokens // 2)
    return min(estimated, tokens // 2)


def check_plan_consistency(plan):
    assert plan.kv_cache_bytes == plan.layout.total_bytes(plan.sizes)
    assert plan.kv_cache_bytes <= plan.budget.kv_budget_bytes
    assert plan.sizes["tokens"] == plan.max_total_num_tokens
    assert plan.max_total_num_tokens % plan.page_size == 0
    # + padding row 0; each row holds the context and SGLang's headroom of 4 tokens (no speculative decoding here)
    assert plan.extra_context_len == 4 and plan.request_context_len == plan.context_length + 4
    assert plan.req_to_token_bytes == (plan.max_running_requests + 1) * (plan.context_length + 4) * 4


# -- the headline number ---------------------------------------------------------------------------------------


def test_llama3_70b_h200_tp8_default_registry():
    plan = kvcore.plan_memory(load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8"))
    assert plan.bytes_per_token == 40960 == 1 * (128 + 128) * 80 * 2
    bpt, tokens, budget, pre = expected_tokens("llama-3-70b", "h200", tp=8)
    assert bpt == 40960
    assert plan.max_total_num_tokens == tokens
    assert plan.budget.pre_model_load_bytes == pre == int(140.401 * GIB)
    assert plan.budget.weight_bytes == math.ceil(70553706496 * 2 / 8)
    assert plan.budget.slack_bytes == int(pre * (1 - 0.88))
    assert plan.budget.kv_budget_bytes == budget
    assert plan.backend == "mha"
    assert plan.page_size == 1
    assert plan.context_length == 8192
    assert plan.max_running_requests == expected_requests(tokens, 8192) == 4096
    assert plan.kv_cache_bytes == (tokens + 1) * 40960
    assert plan.warnings == ()
    check_plan_consistency(plan)


@pytest.mark.parametrize(
    "model, hardware, tp",
    [
        ("llama-3-8b", "h100", 1),
        ("llama-3-8b", "h200", 2),
        ("llama-3-8b", "h200", 16),  # kv heads replicated
        ("qwen2.5-7b", "h100", 1),
        ("qwen2.5-7b", "h200", 4),
        ("qwen2.5-0.5b", "cpu", 1),
        ("qwen2.5-0.5b", "h100", 2),
        ("llama-3-70b", "h200", 4),
    ],
)
def test_models_and_hardware(registry, model, hardware, tp):
    cfg = load_config(f"model={model}", f"hardware={hardware}", f"parallel.tp_size={tp}")
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, tokens, budget, _ = expected_tokens(model, hardware, tp=tp)
    context = raw("model", model)["context_length"]
    assert plan.bytes_per_token == bpt
    assert plan.budget.kv_budget_bytes == budget
    assert plan.max_total_num_tokens == tokens
    assert plan.max_running_requests == expected_requests(tokens, context)
    check_plan_consistency(plan)


def test_small_pool_requests_are_half_the_tokens(registry):
    # a 0.25 GiB budget for llama-3-8b: tokens / 2 < 2048, so the request count is half the tokens
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.budget_gib=0.25")
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, tokens, _, _ = expected_tokens("llama-3-8b", "h100", budget_gib=0.25)
    assert plan.max_total_num_tokens == tokens
    assert tokens // 2 < 2048
    assert plan.max_running_requests == tokens // 2


def test_request_estimate_between_clamps(registry):
    # qwen2.5-0.5b with 2.3 GiB: ~200k tokens, so tokens / 32768 x 512 lands between 2048 and 4096
    cfg = load_config("memory.budget_gib=2.3")
    plan = kvcore.plan_memory(cfg, registry=registry)
    _, tokens, _, _ = expected_tokens("qwen2.5-0.5b", "cpu", budget_gib=2.3)
    estimate = int(tokens / 32768 * 512)
    assert 2048 < estimate < 4096
    assert plan.max_total_num_tokens == tokens
    assert plan.max_running_requests == estimate


# -- page alignment -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [16, 64])
def test_page_alignment(registry, page):
    cfg = load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", f"kv_cache.page_size={page}")
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, tokens, budget, _ = expected_tokens("llama-3-70b", "h200", tp=8, page=page)
    assert plan.page_size == page
    assert plan.max_total_num_tokens == tokens
    assert tokens % page == 0
    # padding page + tokens fit; one more page would not (or the budget floor made it not fit)
    assert plan.kv_cache_bytes == (tokens + page) * bpt <= budget
    assert (tokens + page + page) * bpt > budget  # one more page would not fit
    check_plan_consistency(plan)


# -- user caps ----------------------------------------------------------------------------------------------


def test_user_cap_smaller_is_used(registry, caplog):
    cfg = load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", "memory.max_total_tokens=4096")
    with caplog.at_level(logging.WARNING):
        plan = kvcore.plan_memory(cfg, registry=registry)
    assert plan.max_total_num_tokens == 4096
    # the cap is below one request at the model's full context (8192): said, and nothing else
    assert len(plan.warnings) == 1 and "fewer than one request at the model's full context" in plan.warnings[0]
    assert not [r for r in caplog.records if "max_total_tokens" in r.getMessage()]
    assert plan.kv_cache_bytes == (4096 + 1) * 40960
    assert plan.max_running_requests == expected_requests(4096, 8192) == 2048
    check_plan_consistency(plan)


def test_user_cap_smaller_is_page_aligned(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.max_total_tokens=1000", "kv_cache.page_size=64")
    plan = kvcore.plan_memory(cfg, registry=registry)
    assert plan.max_total_num_tokens == 1000 // 64 * 64 == 960


def test_user_cap_larger_warns_and_uses_profiled_value(registry, caplog):
    cfg = load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", "memory.max_total_tokens=99999999")
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        plan = kvcore.plan_memory(cfg, registry=registry)
    _, tokens, _, _ = expected_tokens("llama-3-70b", "h200", tp=8)
    assert plan.max_total_num_tokens == tokens
    assert len(plan.warnings) == 1
    assert "memory.max_total_tokens=99999999" in plan.warnings[0]
    assert str(tokens) in plan.warnings[0]
    assert any("memory.max_total_tokens" in r.getMessage() for r in caplog.records)


def test_user_cap_larger_warning_names_the_value_actually_used(registry):
    cfg = load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", "kv_cache.page_size=16",
                      "memory.max_total_tokens=99999999")
    plan = kvcore.plan_memory(cfg, registry=registry)
    assert f"using {plan.max_total_num_tokens}" in plan.warnings[0]


def test_user_max_running_requests_divided_over_dp(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.max_running_requests=1000", "parallel.dp_size=4")
    plan = kvcore.plan_memory(cfg, registry=registry)
    _, tokens, _, _ = expected_tokens("llama-3-8b", "h100")
    assert plan.max_running_requests == expected_requests(tokens, 8192, user=1000, dp=4) == 250
    assert plan.warnings == ()


def test_user_max_running_requests_capped_at_half_the_tokens(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.max_total_tokens=1000",
                      "memory.max_running_requests=4000", "parallel.dp_size=2")
    plan = kvcore.plan_memory(cfg, registry=registry)
    assert plan.max_total_num_tokens == 1000
    assert plan.max_running_requests == expected_requests(1000, 8192, user=4000, dp=2) == 500
    reduced = [w for w in plan.warnings if "memory.max_running_requests reduced" in w]
    assert len(reduced) == 1 and "2000" in reduced[0] and "500" in reduced[0]
    # and the 1000-token cap is below one request at the full context (8192), which is said too
    assert len(plan.warnings) == 2 and any("fewer than one request at the model's full context" in w
                                           for w in plan.warnings)  # fmt: skip


def test_max_running_requests_below_dp_size_names_the_right_keys(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.max_running_requests=3", "parallel.dp_size=4")
    with pytest.raises(PlanningError) as info:
        kvcore.plan_memory(cfg, registry=registry)
    assert "parallel.dp_size" in str(info.value) or "memory.max_running_requests" in str(info.value)


def test_one_token_pool_cannot_serve_a_request(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.max_total_tokens=1")
    with pytest.raises(PlanningError, match="too few for one request"):
        kvcore.plan_memory(cfg, registry=registry)


# -- dtype, pipeline, explicit budget, profiled memory ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "fp8_e5m2"])
def test_fp8_halves_bytes_per_token(registry, dtype):
    base = kvcore.plan_memory(load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8"),
                              registry=registry)
    cfg = load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", f"kv_cache.dtype={dtype}")
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, tokens, _, _ = expected_tokens("llama-3-70b", "h200", tp=8, kv_bytes=1)
    assert plan.bytes_per_token == bpt == base.bytes_per_token // 2 == 20480
    assert plan.max_total_num_tokens == tokens
    # (budget // 20480) - 1 vs (budget // 40960) - 1: twice the tokens, plus the padding row's difference
    assert tokens - 2 * base.max_total_num_tokens in (1, 2)
    assert all(b.dtype.itemsize == 1 for b in plan.layout.buffers)
    check_plan_consistency(plan)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_pipeline_limiting_rank_sizes_everyone(registry, rank):
    cfg = load_config("model=llama-3-70b", "hardware=h200", "parallel.tp_size=8", "parallel.pp_size=3",
                      f"parallel.pp_rank={rank}")
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt27, tokens, budget, _ = expected_tokens("llama-3-70b", "h200", tp=8, pp=3)
    assert bpt27 == 1 * 256 * 2 * 27
    layers = [27, 27, 26][rank]
    assert plan.max_total_num_tokens == tokens  # same on every rank: set by a 27-layer rank
    assert plan.limiting_pp_rank in (0, 1)
    assert plan.bytes_per_token == 1 * 256 * 2 * layers  # this rank's own layout
    assert plan.layout.buffers[0].layers == layers
    assert plan.kv_cache_bytes == (tokens + 1) * 256 * 2 * layers <= budget
    check_plan_consistency(plan)


def test_explicit_budget_gib(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h200", "memory.budget_gib=1.5", "kv_cache.page_size=16")
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, tokens, budget, _ = expected_tokens("llama-3-8b", "h200", page=16, budget_gib=1.5)
    assert bpt == 8 * 256 * 2 * 32
    assert plan.budget.kv_budget_bytes == budget == int(1.5 * GIB)
    assert plan.budget.weight_bytes == 0
    assert plan.budget.slack_bytes == 0
    assert plan.max_total_num_tokens == tokens
    check_plan_consistency(plan)


def test_profiled_free_memory_with_weights_loaded(registry):
    free = 30 * GIB + 12345
    cfg = load_config("model=llama-3-8b", "hardware=h100")
    plan = kvcore.plan_memory(cfg, registry=registry, free_memory_bytes=free, weights_loaded=True)
    _, tokens, budget, _ = expected_tokens("llama-3-8b", "h100", free=free, weights_loaded=True)
    assert plan.budget.weight_bytes == 0
    assert plan.budget.kv_budget_bytes == budget == free - int(free * (1 - 0.88))
    assert plan.max_total_num_tokens == tokens


def test_profiled_free_memory_charges_weights(registry):
    free = 70 * GIB
    plan = kvcore.plan_memory(load_config("model=llama-3-8b", "hardware=h100"), registry=registry,
                              free_memory_bytes=free)
    _, tokens, budget, _ = expected_tokens("llama-3-8b", "h100", free=free)
    assert plan.budget.kv_budget_bytes == budget
    assert plan.max_total_num_tokens == tokens


def test_mem_fraction_static_changes_budget(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.mem_fraction_static=0.5")
    plan = kvcore.plan_memory(cfg, registry=registry)
    _, tokens, budget, _ = expected_tokens("llama-3-8b", "h100", mfs=0.5)
    assert plan.budget.kv_budget_bytes == budget
    assert plan.max_total_num_tokens == tokens


# -- errors -------------------------------------------------------------------------------------------------


def test_mem_fraction_too_low_suggests_a_value(registry):
    cfg = load_config("model=llama-3-70b", "hardware=h200")  # 131 GiB of weights on one 140 GiB device
    with pytest.raises(PlanningError) as info:
        kvcore.plan_memory(cfg, registry=registry)
    pre = int(140.401 * GIB)
    weights = math.ceil(70553706496 * 2)
    available = pre - weights
    suggested = math.ceil(1000 * (1 - available / pre)) / 1000
    message = str(info.value)
    assert "memory.mem_fraction_static" in message
    assert f"{suggested:.3f}" in message
    # and the suggestion works
    ok = kvcore.plan_memory(load_config("model=llama-3-70b", "hardware=h200",
                                        f"memory.mem_fraction_static={suggested}"), registry=registry)
    _, tokens, _, _ = expected_tokens("llama-3-70b", "h200", mfs=suggested)
    assert ok.max_total_num_tokens == tokens > 0


def test_weights_larger_than_memory_mentions_tp(registry):
    cfg = load_config("model=llama-3-70b", "hardware=h100")
    with pytest.raises(PlanningError) as info:
        kvcore.plan_memory(cfg, registry=registry)
    assert "parallel.tp_size" in str(info.value)
    assert "llama-3-70b" in str(info.value)


def test_budget_smaller_than_one_page_mentions_page_size(registry):
    cfg = load_config("model=llama-3-8b", "hardware=h100", "memory.budget_gib=0.01", "kv_cache.page_size=64")
    # 0.01 GiB = 10.7 MB; the padding page + one page of llama-3-8b is 2 x 64 x 128 KiB = 16 MiB
    assert int(0.01 * GIB) < 2 * 64 * 131072
    with pytest.raises(PlanningError) as info:
        kvcore.plan_memory(cfg, registry=registry)
    assert "kv_cache.page_size" in str(info.value)
    assert "64" in str(info.value)


def test_page_error_suggested_fraction_is_enough(registry):
    # choose mem_fraction_static so that the budget is ~1 MiB: positive, but less than one 64-token page
    m, hw = raw("model", "llama-3-8b"), raw("hardware", "h100")
    pre = int(hw["memory_gib"] * GIB)
    weights = math.ceil(m["num_parameters"] * 2)
    mfs = round((weights + (1 << 20)) / pre, 6)
    cfg = load_config("model=llama-3-8b", "hardware=h100", "kv_cache.page_size=64",
                      f"memory.mem_fraction_static={mfs}")
    with pytest.raises(PlanningError) as info:
        kvcore.plan_memory(cfg, registry=registry)
    message = str(info.value)
    assert "kv_cache.page_size" in message and "memory.mem_fraction_static" in message
    # the suggestion holds one request of the model's context: padding page + 8192 tokens, plus the weights
    needed = (64 + m["context_length"]) * 131072 + weights
    fraction = math.ceil(needed / pre * 1000) / 1000
    assert f"memory.mem_fraction_static={fraction:.3f}" in message
    plan = kvcore.plan_memory(load_config("model=llama-3-8b", "hardware=h100", "kv_cache.page_size=64",
                                          f"memory.mem_fraction_static={fraction}"), registry=registry)
    assert plan.max_total_num_tokens >= m["context_length"]


def test_plan_allocates_nothing(registry):
    # planning a 140 GiB device on this machine works because no tensor is created
    plan = kvcore.plan_memory(load_config("model=llama-3-8b", "hardware=h200"), registry=registry)
    assert plan.kv_cache_bytes > 100 * GIB
