"""Sizing hybrid linear-attention pools: state slots reserved before the tokens by SGLang's rules (the
ratio split, an explicit size, one slot per request without a prefix cache), the request cap, the errors,
and the pools ``build_pools`` and ``kvcore up`` make."""

from __future__ import annotations

import pytest

import kvcore.plugins
from kvcore import build_pools, load_config, plan_memory
from kvcore.tools.cli import main
from kvcore.errors import PlanningError

GIB = 2**30


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def qwen3_next_bytes(tp: int) -> tuple[int, int]:
    """(state bytes per request, K/V bytes per token) of Qwen3-Next on one rank, from its config.json by hand:
    36 DeltaNet layers of conv (2 x 16 x 128 + 32 x 128 channels x 3 inputs, bf16) and temporal
    (32 heads x 128 x 128, float32) state; 12 attention layers of 2 KV heads x 256, K and V, bf16."""
    per_req = 36 * ((2 * 16 * 128 + 32 * 128) // tp * 3 * 2 + 32 // tp * 128 * 128 * 4)
    per_token = 12 * 2 * max(1, 2 // tp) * 256 * 2
    return per_req, per_token


def test_state_takes_its_share_of_the_budget_then_tokens_the_rest():
    cfg = load_config("model=qwen3-next-80b", "hardware=h200")  # tp 2 from the model file
    plan = plan_memory(cfg)
    per_req, per_token = qwen3_next_bytes(2)
    rest = plan.budget.kv_budget_bytes
    seed_slots = int(rest * 0.9 / 1.9 // per_req)  # SGLang: mamba budget = rest x r / (1 + r), // per request
    assert seed_slots - 1 <= plan.max_mamba_cache_size <= seed_slots  # kvcore also counts the padding slot
    state = (plan.max_mamba_cache_size + 1) * per_req
    tokens = (rest - state - per_token) // per_token  # one padding token row
    assert plan.max_total_num_tokens == tokens
    assert plan.max_running_requests == min(4096, max(2048, int(tokens / 262144 * 512)), plan.max_mamba_cache_size // 3)
    assert plan.kv_cache_bytes == state + (tokens + 1) * per_token <= rest


@pytest.mark.parametrize("options, slots, per_request", [
    (["kv_cache.options.max_mamba_cache_size=300"], 300, 3),
    (["kv_cache.options.max_mamba_cache_size=300", "kv_cache.options.mamba_extra_buffer=overlap"], 300, 5),
    (["kv_cache.options.max_mamba_cache_size=300", "kv_cache.options.mamba_extra_buffer=no_overlap"], 300, 4),
    (["kv_cache.options.disable_radix_cache=true", "memory.max_running_requests=40"], 40, 1),
])  # fmt: skip
def test_explicit_slots_and_slots_per_request(options, slots, per_request):
    plan = plan_memory(load_config("model=qwen3-next-80b", "hardware=h200", *options))
    assert plan.max_mamba_cache_size == slots
    assert plan.max_running_requests == min(slots // per_request, 2048 if per_request > 1 else 40)
    per_req, per_token = qwen3_next_bytes(2)
    assert plan.max_total_num_tokens == (plan.budget.kv_budget_bytes - (slots + 1) * per_req - per_token) // per_token


def test_data_parallel_workers_share_explicit_slots():
    plan = plan_memory(load_config("model=qwen3-next-80b", "hardware=h200", "parallel.dp_size=2",
                                   "kv_cache.options.max_mamba_cache_size=300"))  # fmt: skip
    assert plan.max_mamba_cache_size == 150


def test_state_that_leaves_nothing_names_the_keys():
    with pytest.raises(PlanningError, match="kv_cache.options.max_mamba_cache_size.*parallel.tp_size"):
        plan_memory(load_config("model=qwen3-next-80b", "hardware=h200", "kv_cache.options.max_mamba_cache_size=2000"))
    with pytest.raises(PlanningError, match="serve no request at 3 slots per running request"):
        plan_memory(load_config("model=tiny-qwen3-next", "hardware=cpu", "kv_cache.options.max_mamba_cache_size=2"))


def test_plan_reports_the_state(capsys):
    assert main(["plan", "model=qwen3-next-80b", "hardware=h200"]) == 0
    out = capsys.readouterr().out
    assert "state      max_mamba_cache_size = " in out and "reserved before the KV tokens" in out
    assert "12 full-attention and 36 linear-attention layers" in out


def test_build_pools_shares_the_state_between_the_two_pools():
    pools = build_pools(load_config("model=tiny-qwen3-next", "hardware=cpu", "memory.budget_gib=0.01"))
    kv, reqs = pools.token_to_kv_pool, pools.req_to_token_pool
    assert type(kv).__name__ == "HybridLinearKVPool" and type(reqs).__name__ == "HybridReqToTokenPool"
    assert reqs.mamba_pool is kv.mamba_pool and kv.mamba_pool.size == pools.plan.max_mamba_cache_size
    assert reqs.size == pools.plan.max_running_requests


def test_up_is_ready_on_the_cpu(capsys):
    assert main(["up", "model=tiny-qwen3-next", "hardware=cpu", "memory.budget_gib=0.02"]) == 0
    assert "kvcore up: ready" in capsys.readouterr().out


def test_speculative_decoding_solves_slots_and_draft_states_jointly():
    """SGLang's joint solve: slots = share // (per request x (1 + D / ratio)); the draft states of
    min(max_running_requests, slots // ratio) running requests come out of the same share."""
    draft, running = 4, 64
    plan = plan_memory(load_config("model=qwen3-next-80b", "hardware=h200", "memory.max_running_requests=64",
                                   f"kv_cache.options.speculative_num_draft_tokens={draft}"))  # fmt: skip
    per_req, per_token = qwen3_next_bytes(2)
    rest = plan.budget.kv_budget_bytes
    seed_slots = int(rest * 0.9 / 1.9 // (per_req * (1 + draft / 3)))
    # kvcore also counts the padding slot and the padding row of the draft states: a few slots fewer
    assert seed_slots - 3 <= plan.max_mamba_cache_size <= seed_slots
    drafting = min(running, plan.max_mamba_cache_size // 3)
    assert plan.max_running_requests == drafting == plan.sizes["running_requests"]
    reserved = (plan.max_mamba_cache_size + 1) * per_req + (drafting + 1) * draft * per_req
    assert plan.max_total_num_tokens == (rest - reserved - per_token) // per_token
    assert plan.kv_cache_bytes == reserved + (plan.max_total_num_tokens + 1) * per_token


def test_speculative_decoding_needs_the_running_requests():
    with pytest.raises(PlanningError, match="speculative_num_draft_tokens=4.*set memory.max_running_requests"):
        plan_memory(load_config("model=qwen3-next-80b", "hardware=h200", "kv_cache.options.speculative_num_draft_tokens=4"))


def test_speculative_pools_keep_draft_states_per_running_request():
    pools = build_pools(load_config("model=tiny-qwen3-next", "hardware=cpu", "memory.budget_gib=0.01",
                                    "memory.max_running_requests=8", "kv_cache.options.speculative_num_draft_tokens=3"))  # fmt: skip
    mamba = pools.token_to_kv_pool.mamba_pool
    spec = mamba.get_speculative_mamba2_params_all_layers()
    assert spec.intermediate_ssm.shape == (6, 8 + 1, 3, 4, 16, 32)  # [linear layers, running + 1, draft, ...]
    assert spec.intermediate_conv_window[0].shape == (6, 8 + 1, 3, 2 * 2 * 16 + 4 * 32, 3)
    assert pools.req_to_token_pool.mamba_ping_pong_track_buffer_size == 1
    layer = mamba.mamba2_layer_cache(0)
    assert layer.intermediate_ssm.data_ptr() == spec.intermediate_ssm[0].data_ptr()
    assert sum(b.nbytes for b in pools.token_to_kv_pool.buffers().values()) == pools.plan.kv_cache_bytes
