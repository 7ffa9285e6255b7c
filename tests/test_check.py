"""``kvcore check``: what it plans from a backend's declaration (targets, variants, refusals), and one whole run.
The vendor example (examples/vendor-plugin) runs it on an out-of-tree backend and on broken ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvcore.tools.check import CheckPlan, CheckVariant, plan_check
from kvcore import load_config
from kvcore.errors import ConfigError
from kvcore.plugins import load_registry

BUILTIN = {"mha", "mla", "dsa", "swa", "mamba", "fp4"}


@pytest.fixture(scope="module")
def registry():
    from importlib import metadata

    return load_registry(entry_points=[ep for ep in metadata.entry_points(group="kvcore") if ep.name in BUILTIN], env={})


def values(plan, field):
    return sorted({getattr(v, field) for t in plan.targets for v in t.variants}, key=str)


def test_variants_cover_every_dtype_page_size_and_kernels_mode_the_backend_declares(registry):
    spec = registry.backends["mha"]
    assert spec.kv_dtypes is None and spec.page_sizes is None  # so the defaults apply
    plan = plan_check(registry, "mha")
    (target,) = plan.targets
    assert plan.device == "cpu" and target.attention == "mha"
    assert values(plan, "dtype") == ["bfloat16", "float8_e4m3fn"]
    assert values(plan, "page_size") == [1, 16]
    assert values(plan, "kernels") == ["native", "triton"]
    assert spec.layouts == ("token_major", "page_major")
    layouts = [v for v in target.variants if v.overrides == ("kv_cache.layout=page_major",)]
    assert [v.kernels for v in layouts] == ["triton", "native"]  # the second layout, under each kernels mode
    assert len(target.variants) == 4 + 2  # each value at least once, not every combination
    assert len(plan_check(registry, "mha", exhaustive=True).targets[0].variants) == 2 * 2 * 2 * 2
    assert [v.page_size for v in target.allocator_variants] == [1, 16]  # the allocator once per page size


def test_block_formats_and_declared_page_sizes_are_what_gets_checked(registry):
    fp4 = plan_check(registry, "fp4")
    assert values(fp4, "dtype") == ["fp4_e2m1", "mxfp8", "nvfp4"]
    dsa = plan_check(registry, "dsa")
    assert values(dsa, "page_size") == [64]  # the indexer's page, from the backend's declaration


@pytest.mark.parametrize("backend", sorted(BUILTIN | {"fp4_mla"}))
def test_the_probe_model_has_the_attention_kind_and_stays_small(registry, backend):
    for target in plan_check(registry, backend).targets:
        model = load_config(*target.config, registry=registry).model
        assert model.attention == target.attention
        assert model.num_hidden_layers <= 8, target.config


def test_a_short_hybrid_model_is_preferred_to_cutting_a_long_one(registry):
    # tiny-gemma-3 has fewer parameters, but its 12 layers cut to 4 would lose every full-attention layer
    (target,) = plan_check(registry, "swa").targets
    assert target.config[0] == "model=tiny-swa"
    (target,) = plan_check(registry, "dsa").targets
    assert target.config[:2] == ("model=deepseek-v3.2", "model.num_hidden_layers=4")


def test_the_mla_hybrid_is_checked_on_tiny_kimi_linear(registry):
    (target,) = plan_check(registry, "mamba_mla").targets
    assert target.config[0] == "model=tiny-kimi-linear" and target.attention == "mamba_mla"


def test_a_backend_no_shipped_model_uses_is_refused(registry, monkeypatch):
    import kvcore.config

    monkeypatch.setattr(kvcore.config, "available_options", lambda group, *args: ["qwen2.5-0.5b", "tiny-qwen3-next"],
                        raising=False)  # fmt: skip
    with pytest.raises(ConfigError, match="no shipped model has attention=mamba_mla; name a small one of yours: "
                                          "kvcore check BACKEND model="):  # fmt: skip
        plan_check(registry, "mamba_mla")


def test_a_model_named_on_the_command_line_replaces_the_probe(registry):
    plan = plan_check(registry, "mamba_mla", overrides=["model=tiny-qwen3-next", "model.attention=mamba_mla",
                                                        "model.mla.kv_lora_rank=48", "model.mla.qk_rope_head_dim=16"])  # fmt: skip
    (target,) = plan.targets
    assert target.attention == "mamba_mla" and "model=tiny-qwen3-next" in target.config
    assert target.source == "the model named on the command line"


@pytest.mark.parametrize("kwargs, says", [
    (dict(backend="nope"), "no installed backend is named 'nope'; installed: dsa, fp4"),
    (dict(backend="fp4", dtypes=["bfloat16"]), "does not serve kv_cache.dtype bfloat16 (it serves fp4_e2m1, nvfp4, mxfp8)"),
    (dict(backend="dsa", page_sizes=[16]), "does not serve page size 16 (it serves 64); drop --page-size"),
])  # fmt: skip
def test_refusals_say_what_to_do(registry, kwargs, says):
    with pytest.raises(ConfigError) as err:
        plan_check(registry, **kwargs)
    assert says in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_is_refused(registry):
    with pytest.raises(ConfigError, match="--device cuda needs a visible CUDA device"):
        plan_check(registry, "mha", device="cuda")


def test_the_plan_crosses_into_the_child_process_intact(registry):
    plan = plan_check(registry, "fp4", plugins=["some.module"])
    again = CheckPlan.from_json(plan.to_json())
    assert again == plan and isinstance(again.targets[0].variants[0], CheckVariant)


def test_a_whole_run_reports_every_check_by_name_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCORE_PLUGINS")}
    device = ["--device", "cuda"] if os.environ.get("KVCORE_TEST_COMPILED") == "1" else ["--kernels", "triton"]
    run = subprocess.run([sys.executable, "-m", "kvcore.tools.cli", "check", "mla", "--dtype", "bfloat16", "--page-size", "4",
                          *device], env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "kvcore check mla: the conformance kit, through the hooks engines use"
    assert any(line.startswith("  ok    pool      mla       move_matches_gather_then_scatter[bfloat16-") for line in lines)
    assert any(line.startswith("  ok    allocator mla       random_request_lifetimes[bfloat16-") for line in lines)
    assert lines[-1].startswith("kvcore check: passed: ") and " 0 failed" in lines[-1]
