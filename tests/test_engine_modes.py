"""The configurator's two engine modes: speculative decoding (a draft worker sharing the target's request table
and token slots, its bytes per token in the plan's cell size) and prefill/decode disaggregation (sorted frees,
the decode worker's pre-allocated request rows).  Expected sizes are computed here from the model files'
dimensions, independently of the planner."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

import kvcore
import kvcore.plugins
from kvcore.errors import ConfigError
from kvcore.planning.planner import extra_context_len
from kvcore.pools import DecodeReqToTokenPool, ReqToTokenPool
from kvcore.testing.tensors import addresses_kept
from kvcore.tools.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GIB = 2**30
EAGLE3 = ("speculative.algorithm=eagle3", "speculative.draft_model=tiny-eagle3")


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS", "KVCORE_CHECKED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def model_file(name: str) -> dict:
    data = yaml.safe_load((CONFIGS / "model" / f"{name}.yaml").read_text())
    return data.get("model", data)


def mha_bytes_per_token(m: dict, layers: int | None = None, tp: int = 1) -> int:
    """K and V of every layer, bf16."""
    return (layers or m["num_hidden_layers"]) * 2 * max(1, m["num_key_value_heads"] // tp) * m["head_dim"] * 2


# -- config ------------------------------------------------------------------------------------------------


def test_the_modes_are_off_by_default():
    cfg = kvcore.load_config()
    assert cfg.speculative.algorithm == "none" and not cfg.speculative.enabled
    assert cfg.disaggregation.mode == "null"
    pools = kvcore.build_pools(kvcore.load_config("memory.max_total_tokens=4096"))
    assert pools.draft is None and pools.plan.draft_layout is None
    assert pools.plan.extra_context_len == 4  # SGLang's headroom of the request table without drafts
    assert not pools.token_to_kv_pool_allocator.need_sort
    assert type(pools.req_to_token_pool) is ReqToTokenPool


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["speculative.algorithm=eagle3"], ["speculative.algorithm=eagle3", "speculative.draft_model"]),
        (["speculative.algorithm=nextn"], ["model.num_nextn_predict_layers", "qwen2.5-0.5b"]),
        (["model=tiny-mla", "speculative.algorithm=nextn", "speculative.draft_model=tiny-eagle3"],
         ["speculative.draft_model='tiny-eagle3'", "nextn"]),
        (["speculative.algorithm=medusa"], ["algorithm", "eagle3", "nextn"]),
        (["disaggregation.mode=both"], ["mode", "prefill", "decode"]),
        (["disaggregation.mode=decode", "disaggregation.decode_extra_slots=-1"], ["disaggregation.decode_extra_slots"]),
    ],
)
def test_mode_errors_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        kvcore.load_config(*overrides)
    for word in words:
        assert word in str(err.value)


def test_an_unknown_draft_model_names_the_key_and_the_choices():
    cfg = kvcore.load_config("speculative.algorithm=eagle3", "speculative.draft_model=no-such-draft")
    with pytest.raises(ConfigError, match=r"speculative.draft_model='no-such-draft'.*valid options:.*tiny-eagle3"):
        kvcore.plan_memory(cfg)


# -- speculative decoding: the plan -------------------------------------------------------------------------


def test_the_cell_size_adds_the_eagle3_drafts_bytes_per_token():
    """Llama-3-8B with its one-layer EAGLE3 draft on an H200, by hand: both models' weights charged, the budget
    divided by target + draft bytes per token (one padding token per buffer)."""
    target, draft = model_file("llama-3-8b"), model_file("llama-3-8b-eagle3")
    cfg = kvcore.load_config("model=llama-3-8b", "hardware=h200", "speculative.algorithm=eagle3",
                             "speculative.draft_model=llama-3-8b-eagle3")  # fmt: skip
    plan = kvcore.plan_memory(cfg)
    target_bpt, draft_bpt = mha_bytes_per_token(target), mha_bytes_per_token(draft)
    assert (target_bpt, draft_bpt) == (131072, 4096)
    assert (plan.bytes_per_token, plan.draft_bytes_per_token, plan.cell_bytes_per_token) == (131072, 4096, 135168)
    pre = int(140.401 * GIB)
    weights = math.ceil(target["num_parameters"] * 2) + math.ceil(draft["num_parameters"] * 2)
    budget = pre - weights - int(pre * (1 - 0.88))
    assert plan.budget.kv_budget_bytes == budget
    assert plan.max_total_num_tokens == budget // (target_bpt + draft_bpt) - 1
    assert plan.draft_kv_cache_bytes == (plan.max_total_num_tokens + 1) * draft_bpt
    # against the same target without a draft: fewer tokens, by the ratio of the cells (and the draft's weights)
    alone = kvcore.plan_memory(kvcore.load_config("model=llama-3-8b", "hardware=h200"))
    assert alone.max_total_num_tokens == (budget + math.ceil(draft["num_parameters"] * 2)) // target_bpt - 1


def test_the_cell_size_adds_deepseeks_mtp_layer():
    """DeepSeek-V3 with nextn: one MLA layer (kv_lora_rank 512 + rope 64, bf16) beside the 61 of the target, page
    64 (the model file's), tp 8; the MTP layer's weights are the target's mean layer."""
    m = model_file("deepseek-v3")
    cfg = kvcore.load_config("model=deepseek-v3", "hardware=h200", "speculative.algorithm=nextn")
    plan = kvcore.plan_memory(cfg)
    row = (512 + 64) * 2
    assert (plan.bytes_per_token, plan.draft_bytes_per_token) == (61 * row, row)
    assert plan.draft_layout.backend == "mla"
    tp = cfg.parallel.tp_size
    mtp_params = m["num_parameters"] // 61
    assert plan.draft_weight_bytes == math.ceil(mtp_params / tp)  # fp8 weights: one byte each
    pre = int(140.401 * GIB)
    budget = pre - math.ceil(m["num_parameters"] / tp) - math.ceil(mtp_params / tp) - int(pre * (1 - 0.88))
    assert plan.budget.kv_budget_bytes == budget
    page = cfg.kv_cache.page_size
    assert plan.max_total_num_tokens == (budget // (62 * row) - page) // page * page


@pytest.mark.parametrize(
    "page, topk, draft, expected",
    [
        (1, 1, 4, 8),  # 4 + draft tokens
        (16, 1, 4, 23),  # 2 x max(3 steps, 4 tokens) + 15
        (16, 4, 4, 271),  # 2 x ((15 + 3 + 15) // 16 = 2 pages x 16 tokens x 4 branches) + 15
        (64, 1, 8, 79),  # 2 x 8 + 63
    ],
)
def test_the_request_table_reserves_sglangs_headroom_for_drafts(page, topk, draft, expected):
    cfg = kvcore.load_config(*EAGLE3, f"kv_cache.page_size={page}", f"speculative.eagle_topk={topk}",
                             f"speculative.num_draft_tokens={draft}")  # fmt: skip
    assert extra_context_len(cfg) == expected


# -- speculative decoding: the pools ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, draft_class, draft_layers",
    [
        (("memory.max_total_tokens=2048", *EAGLE3), "MHATokenToKVPool", 1),
        (("model=tiny-mla", "speculative.algorithm=nextn", "kv_cache.page_size=16", "memory.max_total_tokens=2048"),
         "MLATokenToKVPool", 1),
        (("model=deepseek-v3.2", "hardware=cpu", "memory.budget_gib=0.05", "memory.max_running_requests=2",
          "speculative.algorithm=nextn"), "DSATokenToKVPool", 1),
        (("model=tiny-swa", "memory.max_total_tokens=2048", *EAGLE3), "MHATokenToKVPool", 1),
        (("model=tiny-qwen3-next", "memory.max_total_tokens=2048", "memory.max_running_requests=8",
          "model.num_nextn_predict_layers=1", "speculative.algorithm=nextn"), "MHATokenToKVPool", 1),
    ],
    ids=["mha-eagle3", "mla-nextn", "dsa-nextn", "swa-eagle3", "mamba-nextn"],
)
def test_the_draft_shares_the_targets_table_and_slots(overrides, draft_class, draft_layers):
    pools = kvcore.build_pools(kvcore.load_config(*overrides))
    draft = pools.draft
    assert draft.req_to_token_pool is pools.req_to_token_pool
    assert draft.token_to_kv_pool_allocator is pools.token_to_kv_pool_allocator
    pool = draft.token_to_kv_pool
    assert type(pool).__name__ == draft_class and pool.layer_num == draft_layers
    assert pool.size == pools.plan.max_total_num_tokens
    assert sum(b.nbytes for b in pool.buffers().values()) == pools.plan.draft_kv_cache_bytes
    assert pools.req_to_token_pool.req_to_token.shape[1] == pools.plan.context_length + pools.plan.extra_context_len
    # a location the shared allocator hands out is writable in the draft's pool
    page = pool.page_size
    loc = pools.token_to_kv_pool_allocator.alloc(page)
    written = pool.self_test_write(pool.start_layer, loc, torch.Generator().manual_seed(0))
    rows = pool.token_rows()
    for name, expected in written.items():
        assert torch.equal(rows[name].take(loc, pool.layer_in_buffer(name, pool.start_layer)).view(torch.uint8),
                           expected.contiguous().view(torch.uint8))  # fmt: skip


def test_a_copy_of_an_engines_pools_keeps_what_the_draft_shares():
    """``copy.deepcopy`` of ``build_pools``' result copies the pools, the allocator and the request table (the
    draft's pool in the copy shares the copy's table and allocator, as the original's does) and shares the frozen
    records (the plan and the selection, whose read-only mappings could not be copied)."""
    pools = kvcore.build_pools(kvcore.load_config("memory.max_total_tokens=2048", *EAGLE3))
    twin = copy.deepcopy(pools)
    assert twin.plan is pools.plan and twin.selection is pools.selection
    for name in ("req_to_token_pool", "token_to_kv_pool", "token_to_kv_pool_allocator"):
        assert getattr(twin, name) is not getattr(pools, name), f"the copy shares the original's {name}"
    assert twin.draft.req_to_token_pool is twin.req_to_token_pool
    assert twin.draft.token_to_kv_pool_allocator is twin.token_to_kv_pool_allocator
    assert twin.token_to_kv_pool_allocator.get_kvcache() is twin.token_to_kv_pool
    assert not addresses_kept(twin, pools)


def test_a_hybrid_target_keeps_states_per_draft_token():
    """speculative.num_draft_tokens reaches the linear-attention states: every running request keeps that many
    intermediate states (as kv_cache.options.speculative_num_draft_tokens did)."""
    base = ("model=tiny-qwen3-next", "memory.max_total_tokens=2048", "memory.max_running_requests=4")
    pools = kvcore.build_pools(kvcore.load_config(*base, *EAGLE3, "speculative.num_draft_tokens=3"))
    assert pools.plan.sizes["running_requests"] == 4
    spec = pools.req_to_token_pool.mamba_pool.get_speculative_mamba2_params_all_layers()
    assert spec.intermediate_ssm.shape[2] == 3
    older = kvcore.plan_memory(kvcore.load_config(*base, "kv_cache.options.speculative_num_draft_tokens=3"))
    assert {b.name: b.row_shape for b in older.layout.buffers} == {b.name: b.row_shape for b in pools.plan.layout.buffers}


def test_kvcore_plan_prints_both_bytes_per_token(capsys):
    assert main(["plan", "model=llama-3-8b", "hardware=h200", "speculative.algorithm=eagle3",
                 "speculative.draft_model=llama-3-8b-eagle3"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "131072 target + 4096 draft = 135168 bytes per token" in out
    assert "speculative eagle3: draft llama-3-8b-eagle3" in out


@pytest.mark.parametrize("overrides", [EAGLE3, ("model=tiny-mla", "speculative.algorithm=nextn")])
def test_kvcore_up_self_checks_the_draft_pool(capsys, overrides):
    assert main(["up", "memory.max_total_tokens=4096", *overrides]) == 0
    out = capsys.readouterr().out
    for check in ("alloc", "write/read", "move", "free"):
        assert f"ok   draft {check}" in out
    assert "kvcore up: ready" in out


# -- disaggregation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("model, page", [("qwen2.5-0.5b", 1), ("qwen2.5-0.5b", 16), ("tiny-swa", 16)])
def test_both_worker_modes_sort_frees(mode, model, page):
    pools = kvcore.build_pools(kvcore.load_config(f"model={model}", f"kv_cache.page_size={page}",
                                                  "memory.max_total_tokens=4096", f"disaggregation.mode={mode}"))  # fmt: skip
    allocator = pools.token_to_kv_pool_allocator
    assert allocator.need_sort
    loc = allocator.alloc(4 * page)
    allocator.free(loc)
    sides = [allocator.full_attn_allocator, allocator.swa_attn_allocator] if model == "tiny-swa" else [allocator]
    for side in sides:  # each list defers the freed pages, as need_sort does
        assert side.need_sort and side.release_pages.numel() == 4


@pytest.mark.parametrize(
    "overrides, pre_alloc",
    [
        (("memory.max_running_requests=16",), 32),  # unset: twice a worker's share of at most 32
        (("memory.max_running_requests=64", "parallel.dp_size=1"), 0),  # a share above 32: none
        ((), 0),  # no cap: none
        (("memory.max_running_requests=64", "disaggregation.decode_extra_slots=5"), 5),
    ],
)
def test_the_decode_worker_pre_allocates_request_rows(overrides, pre_alloc):
    cfg = kvcore.load_config("memory.max_total_tokens=100000", "disaggregation.mode=decode", *overrides)
    pools = kvcore.build_pools(cfg)
    table = pools.req_to_token_pool
    assert type(table) is DecodeReqToTokenPool and table.pre_alloc_size == pre_alloc
    running = pools.plan.max_running_requests
    assert table.size == running and table.req_to_token.shape[0] == running + pre_alloc + 1
    assert pools.plan.req_to_token_bytes == table.req_to_token.nbytes
    slots = table.alloc(running + pre_alloc)
    assert sorted(slots) == list(range(1, running + pre_alloc + 1)) and table.alloc(1) is None
    table.clear()
    assert table.available_size() == running + pre_alloc


def test_decode_req_to_token_pool_takes_the_seeds_keywords():
    table = DecodeReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False, pre_alloc_size=2)
    assert table.req_to_token.shape == (7, 16) and table.available_size() == 6
    with pytest.raises(ValueError, match="pre_alloc_size"):
        DecodeReqToTokenPool(size=4, max_context_len=16, device="cpu", pre_alloc_size=-1)


def test_the_hybrid_decode_table_has_state_slots_for_arriving_requests():
    cfg = kvcore.load_config("model=tiny-qwen3-next", "memory.max_total_tokens=4096", "memory.max_running_requests=4",
                             "kv_cache.options.disable_radix_cache=true", "disaggregation.mode=decode")  # fmt: skip
    pools = kvcore.build_pools(cfg)
    table = pools.req_to_token_pool
    assert type(table).__name__ == "HybridMambaDecodeReqToTokenPool" and table.pre_alloc_size == 8
    # one state slot per running request (disable_radix_cache), raised for the 8 pre-allocated ones, said so
    assert pools.plan.sizes["requests"] == 12 and table.mamba_pool.size == 12
    assert any("state slots raised from 4 to 12" in w for w in pools.plan.warnings)

    class Req:
        mamba_pool_idx = None

    reqs = [Req() for _ in range(12)]
    rows = table.alloc(12, reqs)
    assert sorted(rows) == list(range(1, 13)) and len({r.mamba_pool_idx for r in reqs}) == 12


def test_the_hybrid_decode_table_refuses_what_kvcore_lacks():
    from kvcore_mamba.decode import HybridMambaDecodeReqToTokenPool
    from kvcore_mamba.layout import rank_state_params

    cfg = kvcore.load_config("model=tiny-qwen3-next", "memory.max_total_tokens=4096", "memory.max_running_requests=4")
    params = rank_state_params(kvcore.make_request(cfg))
    seed_call = dict(size=4, max_context_len=64, device="cpu", enable_memory_saver=False, cache_params=params,
                     mamba_layer_ids=list(params.layers), speculative_num_draft_tokens=None,
                     enable_mamba_extra_buffer=False, pre_alloc_size=2, enable_overlap_schedule=True, mamba_size=3,
                     start_layer=0)  # fmt: skip
    table = HybridMambaDecodeReqToTokenPool(**seed_call)
    assert table.mamba_pool.size == 6  # raised from 3: 6 requests x 1 slot
    for keyword, value in (("short_conv_layer_ids", [0]), ("ngram_context_len", 8), ("enable_linear_replayssm_spec", True)):
        with pytest.raises(ConfigError, match=keyword):
            HybridMambaDecodeReqToTokenPool(**seed_call, **{keyword: value})


def test_kvcore_up_is_ready_as_a_decode_worker(capsys):
    assert main(["up", "disaggregation.mode=decode", "memory.max_running_requests=16", "memory.max_total_tokens=8192"]) == 0
    out = capsys.readouterr().out
    assert "disaggregation decode worker" in out and "32 pre-allocated" in out and "kvcore up: ready" in out


def test_hf_configs_give_the_mtp_layers_and_a_draft_model():
    data = Path(__file__).parent / "data" / "hf"
    cfg = kvcore.load_config(f"model=hf:{data / 'deepseek-r1-0528'}", "hardware=h200", "parallel.tp_size=8",
                             "speculative.algorithm=nextn")  # fmt: skip
    assert cfg.model.num_nextn_predict_layers == 1
    assert kvcore.plan_memory(cfg).draft_bytes_per_token == (512 + 64) * 2
    # a draft read from a checkpoint's config.json: Llama-3-8B drafting for itself (standalone), 32 layers
    cfg = kvcore.load_config("model=llama-3-8b", "hardware=h200", "speculative.algorithm=standalone",
                             f"speculative.draft_model=hf:{data / 'llama-3-8b'}")  # fmt: skip
    plan = kvcore.plan_memory(cfg)
    assert plan.draft_bytes_per_token == plan.bytes_per_token == 131072
