"""Kimi-Linear on the mamba_mla backend: MLA latent rows for its full-attention layers (every 4th and the last, a
listed set), Kimi Delta Attention states elsewhere, in SGLang's shapes (KimiLinearStateShape: the convolution
window [conv_kernel - 1, q + k + v channels], the temporal state [heads, head_dim, head_dim] in float32)."""

from __future__ import annotations

import pytest

import kvcore
import kvcore.plugins
from kvcore.tools.cli import main
from kvcore_mamba.layout import layer_kinds, rank_layers, rank_state_params


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def test_kimi_linear_48b_layers_and_state_by_hand():
    cfg = kvcore.load_config("model=kimi-linear-48b", "hardware=h200")
    request = kvcore.make_request(cfg)
    full, linear = rank_layers(request)
    assert full == [3, 7, 11, 15, 19, 23, 26] and len(linear) == 20  # config.json's full_attn_layers, less one
    params = rank_state_params(request)
    assert params.shape.conv == [(3, 3 * 32 * 128)] and params.shape.temporal == (32, 128, 128)
    per_layer = 3 * 3 * 32 * 128 * 2 + 32 * 128 * 128 * 4  # bf16 window, fp32 temporal state
    assert params.mamba_cache_per_req == 20 * per_layer
    plan = kvcore.plan_memory(cfg)
    assert plan.backend == "mamba_mla" and plan.bytes_per_token == 7 * (512 + 64) * 2


def test_kimi_linear_state_splits_over_tensor_ranks():
    cfg = kvcore.load_config("model=kimi-linear-48b", "hardware=h200", "parallel.tp_size=4")
    params = rank_state_params(kvcore.make_request(cfg))
    assert params.shape.conv == [(3, 3 * 32 * 128 // 4)] and params.shape.temporal == (8, 128, 128)


def test_listed_full_layers_replace_the_interval():
    assert layer_kinds(7, 4, [3, 6]) == ([3, 6], [0, 1, 2, 4, 5])
    assert layer_kinds(8, 4) == ([3, 7], [0, 1, 2, 4, 5, 6])


def test_tiny_kimi_linear_is_ready(capsys):
    assert main(["up", "model=tiny-kimi-linear", "memory.max_total_tokens=4096", "memory.max_running_requests=8"]) == 0
    out = capsys.readouterr().out
    assert "HybridLinearKVPool" in out and "kvcore up: ready" in out and "backend mamba_mla" in out
    pools = kvcore.build_pools(kvcore.load_config("model=tiny-kimi-linear", "memory.max_total_tokens=4096",
                                                  "memory.max_running_requests=8"))  # fmt: skip
    assert pools.token_to_kv_pool.full_attention_layer_ids == [3, 6]
