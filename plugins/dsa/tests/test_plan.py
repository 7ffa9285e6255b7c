"""DSA through kvcore's planner, selection and command line, against numbers derived from the model YAML.

Expected values come from the raw YAML (read with PyYAML, not through kvcore) and the arithmetic of SGLang's KV-cache configurator:

    kv row      = kv_lora_rank + kv_lora_rank / 128 * 4 + qk_rope_head_dim * 2      (656 bytes, fp8 cache)
    indexer     = index_head_dim + 4 bytes per token (fp8 key + float32 scale)       (132 bytes)
    bpt         = (kv row + indexer) x layers                                        (788 x 61 = 48068)
    pool bytes  = layers x ((size + 64) x kv row + (size + 65) // 64 x 64 x 132)
    budget      = pre - ceil(params x 1 / tp) - int(pre x (1 - 0.88))                (fp8 weights)
    tokens      = the largest size (whole pages of 64) whose pool bytes fit the budget
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

import kvcore
import kvcore.plugins
from kvcore import load_config
from kvcore.tools.cli import main
from kvcore.errors import ConfigError
from kvcore.plugins import load_registry

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
GIB = 2**30
MODEL = "deepseek-v3.2"


def raw(group: str, name: str) -> dict:
    return yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def registry():
    reg = load_registry(env={})
    assert "dsa" in reg.backends
    return reg


def yaml_config(*overrides):
    """The model's config; its own kv_cache section (page 64, fp8) takes effect through the _global_ package."""
    return load_config(f"model={MODEL}", "hardware=h200", *overrides)


def expected_bytes_per_token(index_key_bytes=128 + 4):
    m = raw("model", MODEL)["model"]
    rank, rope = m["mla"]["kv_lora_rank"], m["mla"]["qk_rope_head_dim"]
    row = rank + rank // 128 * 4 + rope * 2
    assert row == 656 and m["dsa"]["index_head_dim"] + 4 == 132
    return (row + index_key_bytes) * m["num_hidden_layers"], row


def expected_tokens(index_page_bytes=8448):
    doc, hw = raw("model", MODEL), raw("hardware", "h200")
    m, tp = doc["model"], doc["parallel"]["tp_size"]
    _, row = expected_bytes_per_token()
    layers = m["num_hidden_layers"]
    pre = int(hw["memory_gib"] * GIB)
    budget = pre - math.ceil(m["num_parameters"] * 1 / tp) - int(pre * (1 - 0.88))

    def pool_bytes(size):
        return layers * ((size + 64) * row + (size + 65) // 64 * index_page_bytes)

    per_token = layers * (row + index_page_bytes / 64)
    size = int(budget // per_token) // 64 * 64  # an upper bound (no padding counted), then step down a page
    while pool_bytes(size) > budget:
        size -= 64
    return size, budget, pool_bytes(size)


def test_bytes_per_token_and_tokens_on_h200(registry):
    cfg = yaml_config()
    plan = kvcore.plan_memory(cfg, registry=registry)
    bpt, _ = expected_bytes_per_token()
    assert bpt == (656 + 132) * 61 == 48068
    assert plan.backend == "dsa"
    assert plan.bytes_per_token == bpt
    tokens, budget, pool_bytes = expected_tokens()
    assert plan.budget.kv_budget_bytes == budget
    assert plan.max_total_num_tokens == tokens
    assert plan.kv_cache_bytes == pool_bytes
    assert tokens % 64 == 0 and plan.kv_cache_bytes <= budget


def test_bf16_indexer_option(registry):
    plan = kvcore.plan_memory(yaml_config("kv_cache.options.index_dtype=bfloat16"), registry=registry)
    bpt, _ = expected_bytes_per_token(index_key_bytes=256)
    assert plan.bytes_per_token == bpt == (656 + 256) * 61
    assert plan.max_total_num_tokens == expected_tokens(index_page_bytes=16384)[0]
    with pytest.raises(ConfigError, match=r"kv_cache\.options\.index_dtype='int4' is not one of.*backend 'dsa'"):
        kvcore.plan_memory(yaml_config("kv_cache.options.index_dtype=int4"), registry=registry)
    with pytest.raises(ConfigError, match=r"kv_cache\.options\.foo is not an option of backend 'dsa'; its options: index_dtype"):
        kvcore.plan_memory(yaml_config("kv_cache.options.foo=1"), registry=registry)


def test_bf16_cache_rows_are_plain_mla(registry):
    plan = kvcore.plan_memory(yaml_config("kv_cache.dtype=bfloat16"), registry=registry)
    assert plan.bytes_per_token == (576 * 2 + 132) * 61


def test_selection_picks_dsa_for_attention_dsa(registry):
    selection = kvcore.api.select(yaml_config(), registry)
    assert selection.backend.name == "dsa"
    assert selection.request.attention == "dsa"
    assert "mla" not in (c.backend.name for c in selection.candidates if c.matches)


def test_yaml_dims_reach_the_request(registry):
    cfg = yaml_config()
    m, doc = cfg.model, raw("model", MODEL)["model"]
    for key in ("num_hidden_layers", "num_parameters", "context_length", "weight_dtype"):
        assert getattr(m, key) == doc[key]
    for section, keys in (("mla", ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")), ("dsa", ("index_head_dim",))):
        for key in keys:
            assert getattr(getattr(m, section), key) == doc[section][key]
    assert m.attention == "dsa" and m.head_dim == m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    request = kvcore.make_request(cfg, registry=registry)
    assert request.section("mla") == m.mla and request.section("dsa") == m.dsa
    assert request.options.index_dtype == "fp8"


def test_yaml_kv_cache_section_takes_effect():
    cfg = load_config(f"model={MODEL}", "hardware=h200")
    assert cfg.kv_cache.page_size == 64
    assert str(cfg.kv_dtype) == "torch.float8_e4m3fn"


@pytest.fixture
def fresh_cli_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def test_cli_page_size_error(fresh_cli_registry, capsys):
    rc = main(["plan", f"model={MODEL}", "kv_cache.page_size=16"])
    _, err = capsys.readouterr()
    assert rc == 2
    # The backend declares its one page size, so selection says which page size it serves and what to set.
    assert "backend 'dsa' (plugin dsa) serves it but: page size 16 not in [64] (set kv_cache.page_size=64)" in err


def test_cli_plan_prints_dsa_plan(fresh_cli_registry, capsys):
    rc = main(["plan", f"model={MODEL}", "hardware=h200", "kv_cache.page_size=64", "kv_cache.dtype=float8_e4m3fn"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "48068 bytes per token" in out
    assert f"max_total_num_tokens = {expected_tokens()[0]}" in out
    assert "buffer   index_k [8448] uint8 per 64 tokens x 61 layers = 8052 B/token" in out
