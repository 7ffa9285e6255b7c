"""The MLA plugin through kvcore's public entry points: registration, selection, planning and ``kvcore up``.

Expected numbers are derived here from the raw YAML files (PyYAML, not kvcore's loader) and the budget
formula of SGLang's KV-cache configurator, written out independently of kvcore.planning.planner:

    pre     = int(memory_gib x 2^30)
    weights = ceil(num_parameters x weight_bytes / (tp x pp))
    slack   = int(pre x (1 - mem_fraction_static))
    budget  = pre - weights - slack                     (or memory.budget_gib x 2^30)
    bpt     = (kv_lora_rank + qk_rope_head_dim) x kv_bytes x layers_of_the_rank   (one latent row, any tp)
    tokens  = (budget - page_size x bpt) // bpt, rounded down to whole pages
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import pytest
import torch
import yaml

import kvcore
from kvcore.testing.tensors import test_device
import kvcore.plugins
from kvcore import load_config
from kvcore.tools.cli import main
from kvcore.errors import ConfigError
from kvcore.plugins import load_registry
from kvcore_mla.pool import MLATokenToKVPool


CONFIGS = Path(str(resources.files("kvcore.configs")))
GIB = 2**30
SELF_CHECKS = ("alloc", "write/read", "move", "cpu offload", "padding", "free")
WEIGHT_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}


def raw(group: str, name: str) -> dict:
    """A config file as plain YAML; global-package model files keep the model under ``model:``."""
    data = yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())
    return data["model"] if group == "model" and "model" in data else data


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    """Use the installed plugins, whatever KVCORE_* switches the caller's environment holds."""
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


@pytest.fixture(scope="module")
def registry():
    return load_registry(env={})


def expected(model, hardware, *, tp, pp=1, page=1, kv_bytes=2, mfs=0.88, budget_gib=None):
    """(bytes per token of the limiting rank, page-aligned tokens)."""
    m, hw = raw("model", model), raw("hardware", hardware)
    layers = math.ceil(m["num_hidden_layers"] / pp)  # the largest stage limits everyone
    bpt = (m["mla"]["kv_lora_rank"] + m["mla"]["qk_rope_head_dim"]) * kv_bytes * layers
    if budget_gib is not None:
        budget = int(budget_gib * GIB)
    else:
        pre = int(hw["memory_gib"] * GIB)
        weight_bytes = WEIGHT_BYTES[m.get("weight_dtype") or m["dtype"]]
        weights = math.ceil(m["num_parameters"] * weight_bytes / (tp * pp))
        budget = pre - weights - int(pre * (1 - mfs))
    tokens = (budget - page * bpt) // bpt // page * page
    return bpt, tokens


def test_registered_through_the_entry_point(registry):
    backend = registry.backends["mla"]
    assert backend.plugin == "mla" and backend.attention == ("mla",)
    assert "mla" in registry.plugins


def test_deepseek_v3_on_h200(registry):
    cfg = load_config("model=deepseek-v3", "hardware=h200")
    assert cfg.parallel.tp_size == 8  # from the model file (global package)
    plan = kvcore.plan_memory(cfg, registry=registry)
    m = raw("model", "deepseek-v3")
    assert plan.bytes_per_token == (m["mla"]["kv_lora_rank"] + m["mla"]["qk_rope_head_dim"]) * m["num_hidden_layers"] * 2
    assert plan.bytes_per_token == 576 * 61 * 2 == 70272
    bpt, tokens = expected("deepseek-v3", "h200", tp=8)
    assert bpt == 70272
    assert plan.backend == "mla"
    assert plan.budget.weight_bytes == math.ceil(671026419200 / 8)  # fp8 weights, 1 byte each
    assert plan.max_total_num_tokens == tokens
    assert plan.kv_cache_bytes == (tokens + 1) * 70272 <= plan.budget.kv_budget_bytes
    assert plan.max_running_requests == min(max(min(int(tokens / 163840 * 512), 4096), 2048), tokens // 2)
    (buf,) = plan.layout.buffers
    assert buf.name == "kv" and buf.row_shape == (1, 576) and buf.layers == 61


@pytest.mark.parametrize(
    "overrides, kw",
    [
        (["kv_cache.dtype=float8_e4m3fn"], {"kv_bytes": 1}),
        (["kv_cache.page_size=64"], {"page": 64}),
        (["parallel.pp_size=2", "parallel.pp_rank=1"], {"pp": 2}),  # 31 + 30 layers: rank 0 limits
        (["parallel.tp_size=16"], {"tp": 16}),  # more ranks: less weight each, same latent rows
    ],
    ids=["fp8", "page64", "pp2", "tp16"],
)
def test_deepseek_v3_variants(registry, overrides, kw):
    cfg = load_config("model=deepseek-v3", "hardware=h200", *overrides)
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, tokens = expected("deepseek-v3", "h200", **{"tp": 8, **kw})
    assert plan.max_total_num_tokens == tokens
    if cfg.parallel.pp_size == 1:
        assert plan.bytes_per_token == bpt


def test_plan_cli_prints_the_mla_numbers(capsys):
    rc = main(["plan", "model=deepseek-v3", "hardware=h200"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    _, tokens = expected("deepseek-v3", "h200", tp=8)
    assert "70272 bytes per token" in out
    assert f"max_total_num_tokens = {tokens}" in out
    assert "buffer   kv [1, 576] bfloat16 per token x 61 layers = 70272 B/token" in out


def test_explain_picks_mla_and_says_why_not_mha(capsys):
    rc = main(["plugins", "--explain", "model=deepseek-v3"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "explain for model=deepseek-v3" in out
    assert "selected backend 'mla' (plugin mla)" in out
    assert "skipped 'mha' (plugin mha): serves attention mha, model needs mla" in out
    # and the other way round: an MHA model skips mla
    selection = kvcore.api.select(load_config("model=llama-3-8b"))
    assert selection.backend.name == "mha"
    explained = selection.explain()
    assert any("skipped 'mla'" in line and "serves attention mla, model needs mha" in line for line in explained)


def test_mla_section_errors_name_the_key(registry, capsys):
    with pytest.raises(ConfigError, match=r"model\.mla\.kv_lora_rank"):
        load_config("model=tiny-mla", "model.mla.kv_lora_rank=null")
    with pytest.raises(ConfigError, match=r"model\.mla\.kv_lora_rnak.*kv_lora_rank"):  # a typo: omegaconf suggests
        load_config("model=tiny-mla", "model.mla.kv_lora_rnak=3")
    cfg = load_config("model=tiny-mla", "model.mla=null")
    with pytest.raises(ConfigError, match=r"model\.mla is not set for model 'tiny-mla' \(attention=mla\)"):
        kvcore.plan_memory(cfg, registry=registry)
    rc = main(["plan", "model=tiny-mla", "model.mla.qk_rope_head_dim=0"])
    _, err = capsys.readouterr()
    assert rc == 2 and "model.mla.qk_rope_head_dim must be positive" in err


def test_mla_takes_no_options(registry):
    with pytest.raises(ConfigError, match=r"kv_cache\.options\.foo is not an option of backend 'mla', which takes none"):
        kvcore.plan_memory(load_config("model=tiny-mla", "kv_cache.options.foo=1"), registry=registry)


@pytest.mark.parametrize("kernels, page", [("native", 16), ("triton", 1)])
def test_build_pools_for_a_pipeline_stage(registry, kernels, page):
    device = test_device()  # Triton kernels run interpreted on the CPU, or compiled on CUDA
    cfg = load_config("model=tiny-mla", "hardware=cpu", "memory.budget_gib=0.01", "parallel.pp_size=2",
                      "parallel.pp_rank=1", f"hardware.kernels={kernels}", f"kv_cache.page_size={page}",
                      f"hardware.device={device}")  # fmt: skip
    pools = kvcore.build_pools(cfg, registry=registry)
    pool = pools.token_to_kv_pool
    assert isinstance(pool, MLATokenToKVPool)
    assert (pool.start_layer, pool.end_layer, pool.layer_num) == (2, 3, 2)
    assert pool.kernels == kernels and pool.page_size == page
    assert pool.kv_cache.shape == (2, pools.plan.max_total_num_tokens + page, 1, 160)
    assert pool.get_kv_size_bytes() == pools.plan.kv_cache_bytes
    _, tokens = expected("tiny-mla", "cpu", tp=1, pp=2, page=page, budget_gib=0.01)
    assert pools.plan.max_total_num_tokens == tokens
    loc = pools.token_to_kv_pool_allocator.alloc(3 * page)
    nope = torch.randn(loc.numel(), 1, 128).to(device)
    rope = torch.randn(loc.numel(), 1, 32).to(device)
    pool.set_mla_kv_buffer(3, loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(3, loc, torch.float32)
    assert torch.equal(got_nope, nope.to(torch.bfloat16).float())
    assert torch.equal(got_rope, rope.to(torch.bfloat16).float())


def test_up_tiny_mla_on_cpu(capsys):
    rc = main(["up", "model=tiny-mla", "hardware=cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    checks = {}
    for line in out.splitlines():
        words = line.split(None, 1)
        if words and words[0] in ("ok", "FAIL"):
            for name in SELF_CHECKS:
                if words[1].startswith(name):
                    checks[name] = words[0]
    assert checks == {name: "ok" for name in SELF_CHECKS}, out
    assert "selected backend 'mla'" in out and "MLATokenToKVPool" in out
    _, tokens = expected("tiny-mla", "cpu", tp=1)
    assert out.splitlines()[-1].startswith(f"kvcore up: ready: {tokens} tokens")
