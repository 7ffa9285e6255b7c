"""Plugin loading (entry points, allow/block lists, strict mode, broken plugins, plugin API versions), backend
selection and its explanation, vendor overrides of the core's firstresult hooks as used by ``plan_memory`` /
``build_pools``, and ``kvcore bench``'s cases as the plugins register them (``kvcore_bench_cases``).

The plugins are small modules under ``tests/fake_plugins``, loaded through fake ``kvcore`` entry points.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import attrs
import pytest
import torch

import kvcore
from kvcore import PluginError, SelectionError, load_config
from kvcore.plugins import CORE_PLUGIN_NAME, load_registry

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _fake_plugins_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def ep(name: str, value: str | None = None) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value or f"fake_plugins.{name}", group="kvcore")


MHA = metadata.EntryPoint(name="mha", value="kvcore_mha.plugin", group="kvcore")


def load(*eps, env=None, extra=()):
    return load_registry(entry_points=list(eps), env=env or {}, extra_plugins=list(extra))


# -- loading ------------------------------------------------------------------------------------------------


def test_installed_mha_entry_point_is_declared():
    installed = {e.name: e.value for e in metadata.entry_points(group="kvcore")}
    assert installed.get("mha") == "kvcore_mha.plugin"


def test_default_entry_points_load_mha():
    registry = load_registry(env={})
    assert "mha" in registry.plugins
    assert registry.backends["mha"].plugin == "mha"
    assert registry.failures == []


def test_mha_entry_point_loads():
    registry = load(MHA)
    assert registry.plugins == ["mha"]
    spec = registry.backends["mha"]
    assert spec.attention == ("mha",)
    assert spec.plugin == "mha"
    assert registry.failures == [] and registry.skipped == {}
    assert registry.manager.get_plugin(CORE_PLUGIN_NAME) is not None


def test_no_entry_points_no_backends():
    registry = load()
    assert dict(registry.backends) == {}
    assert registry.plugins == []


def test_backends_mapping_is_read_only():
    registry = load(MHA)
    with pytest.raises(TypeError):
        registry.backends["x"] = registry.backends["mha"]  # type: ignore[index]


def test_several_plugins_load_and_record_their_names():
    registry = load(MHA, ep("acme"), ep("plain"))
    assert sorted(registry.plugins) == ["acme", "mha", "plain"]
    assert {name: b.plugin for name, b in registry.backends.items()} == {"mha": "mha", "noop": "mha", "acme": "acme",
                                                                         "plain": "plain"}  # fmt: skip


def test_allow_list():
    registry = load(MHA, ep("acme"), ep("plain"), env={"KVCORE_PLUGINS": "mha, acme"})
    assert sorted(registry.plugins) == ["acme", "mha"]
    assert "plain" not in registry.backends
    assert "KVCORE_PLUGINS" in registry.skipped["plain"]


def test_block_list():
    registry = load(MHA, ep("acme"), ep("plain"), env={"KVCORE_DISABLE_PLUGINS": "acme,plain"})
    assert registry.plugins == ["mha"]
    assert set(registry.backends) == {"mha", "noop"}  # the mha plugin's two backends
    assert set(registry.skipped) == {"acme", "plain"}
    assert all("KVCORE_DISABLE_PLUGINS" in why for why in registry.skipped.values())


def test_block_list_wins_over_allow_list():
    registry = load(MHA, ep("acme"), env={"KVCORE_PLUGINS": "mha,acme", "KVCORE_DISABLE_PLUGINS": "acme"})
    assert registry.plugins == ["mha"]


def test_blocked_broken_plugin_is_never_imported():
    registry = load(MHA, ep("broken_import"), env={"KVCORE_DISABLE_PLUGINS": "broken_import"})
    assert registry.failures == []
    assert registry.plugins == ["mha"]


def test_empty_allow_list_means_no_filter():
    registry = load(MHA, ep("acme"), env={"KVCORE_PLUGINS": " "})
    assert sorted(registry.plugins) == ["acme", "mha"]


def test_import_failure_is_recorded_and_others_load():
    registry = load(ep("broken_import"), MHA, ep("acme"))
    assert sorted(registry.plugins) == ["acme", "mha"]
    assert set(registry.backends) == {"acme", "mha", "noop"}
    assert len(registry.failures) == 1
    failure = registry.failures[0]
    assert failure.plugin == "broken_import"
    assert failure.stage == "import"
    assert "kvcore_fake_dependency_that_is_not_installed" in failure.error
    assert registry.failure_of("broken_import") is failure
    assert "broken_import" in failure.describe()


def test_missing_module_is_an_import_failure():
    registry = load(ep("ghost", "fake_plugins.does_not_exist"), MHA)
    assert registry.plugins == ["mha"]
    assert registry.failure_of("ghost").stage == "import"


def test_strict_mode_raises_on_import_failure():
    with pytest.raises(PluginError) as info:
        load(MHA, ep("broken_import"), env={"KVCORE_STRICT_PLUGINS": "1"})
    assert "broken_import" in str(info.value)
    assert "KVCORE_STRICT_PLUGINS" in str(info.value)


def test_strict_mode_zero_is_lenient():
    registry = load(MHA, ep("broken_import"), env={"KVCORE_STRICT_PLUGINS": "0"})
    assert registry.plugins == ["mha"]
    assert registry.failure_of("broken_import") is not None


def test_misspelt_hookimpl_fails_loudly():
    registry = load(MHA, ep("misspelt"))
    assert registry.plugins == ["mha"]
    failure = registry.failure_of("misspelt")
    assert failure is not None
    assert failure.stage == "hooks"
    assert "kvcore_register_backend" in failure.error
    assert "misspelt" not in registry.backends
    assert registry.manager.get_plugin("misspelt") is None  # unregistered again


def test_misspelt_hookimpl_strict_raises():
    with pytest.raises(PluginError, match="misspelt"):
        load(MHA, ep("misspelt"), env={"KVCORE_STRICT_PLUGINS": "1"})


def test_undecorated_kvcore_function_is_an_error():
    registry = load(MHA, ep("undecorated"))
    assert registry.failure_of("undecorated") is not None


def test_malformed_record_names_plugin():
    registry = load(MHA, ep("malformed"))
    assert registry.plugins == ["mha"]
    failure = registry.failure_of("malformed")
    assert failure is not None
    assert failure.stage == "register"
    assert "dict" in failure.error and "BackendSpec" in failure.error
    assert "malformed" not in registry.backends
    assert "malformed" in failure.describe()


def test_hook_returning_a_dict_names_plugin():
    registry = load(MHA, ep("malformed_mapping"))
    assert registry.plugins == ["mha"]
    failure = registry.failure_of("malformed_mapping")
    assert failure is not None and failure.stage == "register"
    assert "BackendSpec" in failure.error


def test_hook_returning_a_dict_says_dict():
    registry = load(MHA, ep("malformed_mapping"))
    assert "dict" in registry.failure_of("malformed_mapping").error


def test_malformed_record_strict_raises():
    with pytest.raises(PluginError, match="malformed"):
        load(MHA, ep("malformed"), env={"KVCORE_STRICT_PLUGINS": "yes"})


def test_duplicate_backend_names_both_plugins():
    registry = load(ep("twin_a"), ep("twin_b"), MHA)
    assert registry.backends["twin"].plugin == "twin_a"  # entry points load in name order
    failure = registry.failure_of("twin_b")
    assert failure is not None and failure.stage == "register"
    assert "twin_a" in failure.error and "twin_b" in failure.error
    assert "'twin'" in failure.error
    assert "KVCORE_DISABLE_PLUGINS" in failure.error
    assert sorted(registry.plugins) == ["mha", "twin_a"]


def test_duplicate_backend_strict_raises():
    with pytest.raises(PluginError) as info:
        load(ep("twin_a"), ep("twin_b"), env={"KVCORE_STRICT_PLUGINS": "1"})
    assert "twin_a" in str(info.value) and "twin_b" in str(info.value)


def test_extra_plugin_duplicating_mha_fails_naming_both():
    from fake_plugins import _common

    class Clone:
        @kvcore.hookimpl
        def kvcore_register_backends(self):
            return [_common.spec("mha")]

    registry = load(MHA, extra=[("clone", Clone())])
    failure = registry.failure_of("clone")
    assert failure is not None
    assert "mha" in failure.error and "clone" in failure.error
    assert registry.backends["mha"].plugin == "mha"


def test_extra_plugin_object_registers():
    from fake_plugins import _common

    class Engine:
        @kvcore.hookimpl
        def kvcore_register_backends(self):
            return [_common.spec("engine-pool", vendors=("engineco",))]

    registry = load(MHA, extra=[("engine", Engine())])
    assert registry.backends["engine-pool"].plugin == "engine"
    assert registry.plugins == ["mha", "engine"]


# -- selection ------------------------------------------------------------------------------------------------


def test_mha_selected_by_default():
    registry = load(MHA, ep("acme"), ep("plain"))
    selection = kvcore.select(load_config("model=llama-3-8b"), registry)
    assert selection.backend.name == "mha"
    lines = selection.explain()
    assert lines[0].startswith("selected backend 'mha'")
    assert any(line.startswith("skipped 'acme'") and "vendor generic not in [acme]" in line for line in lines)
    assert any(line.startswith("skipped 'plain'") and "ranks lower" in line for line in lines)


def test_vendor_plugin_wins_for_its_vendor():
    registry = load(MHA, ep("acme"))
    cfg = load_config("model=llama-3-8b", "hardware.vendor=acme")
    selection = kvcore.select(cfg, registry)
    assert selection.backend.name == "acme"
    assert selection.backend.plugin == "acme"
    lines = selection.explain()
    assert "selected backend 'acme' (plugin acme)" in lines[0]
    assert "vendor acme" in lines[0]
    mha_lines = [line for line in lines if "'mha'" in line]
    assert len(mha_lines) == 1
    assert mha_lines[0].startswith("skipped 'mha' (plugin mha)")
    assert "ranks lower" in mha_lines[0] and "specificity 0" in mha_lines[0]


def test_vendor_backend_does_not_serve_other_attention():
    registry = load(MHA, ep("acme"))
    cfg = load_config("model=llama-3-8b", "hardware.vendor=acme", "model.attention=mla")
    with pytest.raises(SelectionError) as info:
        kvcore.select(cfg, registry)
    assert "acme" in str(info.value) and "mha" in str(info.value)
    assert "attention" in str(info.value)


def test_equal_rank_matches_is_an_error_naming_both():
    registry = load(MHA, ep("acme"), ep("tie"))
    cfg = load_config("model=llama-3-8b", "hardware.vendor=acme")
    with pytest.raises(SelectionError) as info:
        kvcore.select(cfg, registry)
    message = str(info.value)
    assert "'acme'" in message and "'acme-tie'" in message
    assert "kv_cache.backend" in message


def test_naming_a_backend_resolves_a_tie():
    registry = load(MHA, ep("acme"), ep("tie"))
    cfg = load_config("model=llama-3-8b", "hardware.vendor=acme", "kv_cache.backend=acme-tie")
    selection = kvcore.select(cfg, registry)
    assert selection.backend.name == "acme-tie"
    lines = selection.explain()
    assert any("'acme'" in line and "kv_cache.backend names another backend" in line for line in lines)


def test_named_backend_that_cannot_serve_says_why():
    registry = load(MHA, ep("acme"))
    cfg = load_config("model=llama-3-8b", "kv_cache.backend=acme")  # vendor generic
    with pytest.raises(SelectionError, match="vendor generic not in"):
        kvcore.select(cfg, registry)


def test_unregistered_backend_lists_registered():
    registry = load(MHA, ep("acme"))
    cfg = load_config("model=llama-3-8b", "kv_cache.backend=flashinfer")
    with pytest.raises(SelectionError) as info:
        kvcore.select(cfg, registry)
    message = str(info.value)
    assert "kv_cache.backend='flashinfer'" in message
    assert "acme, mha" in message


def test_backend_of_failed_plugin_raises_plugin_error_with_the_failure():
    registry = load(MHA, ep("broken_import"))
    cfg = load_config("model=llama-3-8b", "kv_cache.backend=broken_import")
    with pytest.raises(PluginError) as info:
        kvcore.select(cfg, registry)
    message = str(info.value)
    assert "broken_import" in message
    assert "import" in message
    assert "kvcore_fake_dependency_that_is_not_installed" in message


def test_no_match_error_lists_failed_plugins():
    registry = load(ep("broken_import"), ep("acme"))
    with pytest.raises(SelectionError) as info:
        kvcore.select(load_config("model=llama-3-8b"), registry)
    assert "acme" in str(info.value)
    assert "broken_import" in str(info.value)


def test_selection_with_fp8_and_pages():
    registry = load(MHA)
    cfg = load_config("model=llama-3-8b", "kv_cache.dtype=fp8_e4m3", "kv_cache.page_size=64")
    selection = kvcore.select(cfg, registry)
    assert selection.backend.name == "mha"
    assert selection.request.kv_dtype == torch.float8_e4m3fn
    assert selection.request.page_size == 64


# -- vendor overrides of the core's hooks ------------------------------------------------------------------


def test_tryfirst_buffer_layout_is_used_by_plan_memory():
    from fake_plugins import override

    registry = load(MHA, ep("override"))
    assert registry.failures == []
    before = override.calls["layout"]
    cfg = load_config("model=llama-3-8b", "hardware=h100", "hardware.vendor=ovr", "parallel.tp_size=2")
    plan = kvcore.plan_memory(cfg, registry=registry)
    assert override.calls["layout"] > before
    assert plan.backend == "ovr"
    assert override.NOTE in plan.layout.notes
    assert plan.bytes_per_token == 4 * (128 + 128) * 2 * 32


def test_override_hooks_leave_other_backends_to_the_core():
    registry = load(MHA, ep("override"))
    plan = kvcore.plan_memory(load_config("model=llama-3-8b", "hardware=h100"), registry=registry)
    assert plan.backend == "mha"
    assert "laid out by the ovr tryfirst hook" not in plan.layout.notes


def test_tryfirst_choose_allocator_is_used_by_build_pools():
    from fake_plugins import override

    registry = load(MHA, ep("override"))
    cfg = load_config("hardware.vendor=ovr", "memory.max_total_tokens=256", "memory.max_running_requests=4")
    before = override.calls["allocator"]
    pools = kvcore.build_pools(cfg, registry=registry)
    assert override.calls["allocator"] == before + 1
    assert isinstance(pools.token_to_kv_pool_allocator, override.OvrAllocator)
    assert pools.token_to_kv_pool_allocator.sizes == {"tokens": 256}
    assert pools.plan.backend == "ovr"
    assert override.NOTE in pools.plan.layout.notes
    assert pools.selection.backend.name == "ovr"
    assert pools.token_to_kv_pool_allocator.available_size() == 256


def test_build_pools_default_allocators():
    registry = load(MHA, ep("override"))
    from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    pools = kvcore.build_pools(load_config("memory.max_total_tokens=128", "memory.max_running_requests=2"),
                               registry=registry)
    assert type(pools.token_to_kv_pool_allocator) is TokenToKVPoolAllocator
    pools = kvcore.build_pools(
        load_config("memory.max_total_tokens=128", "memory.max_running_requests=2", "kv_cache.page_size=16"),
        registry=registry,
    )
    assert type(pools.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator
    assert pools.plan.max_total_num_tokens == 128


# -- plugin API versions ------------------------------------------------------------------------------------------


def _versioned(version):
    """A plugin object declaring ``KVCORE_API_VERSION = version`` (registering backend 'versioned')."""
    from fake_plugins import _common

    class Versioned:
        KVCORE_API_VERSION = version

        @kvcore.hookimpl
        def kvcore_register_backends(self):
            return [_common.spec("versioned", priority=-1)]

    return Versioned()


def _major(version: str) -> int:
    return int(version.split(".")[0])


def test_an_old_api_version_is_refused_by_name():
    from kvcore.hookspecs import API_VERSION

    registry = load(MHA, ep("old_api"))
    assert registry.plugins == ["mha"]
    assert "old_api" not in registry.backends
    assert registry.manager.get_plugin("old_api") is None  # none of its hooks was registered
    failure = registry.failure_of("old_api")
    assert failure is not None and failure.stage == "version"
    old = str(_major(API_VERSION) - 1)
    message = failure.describe()
    assert "'old_api'" in message
    assert f"plugin API {old} (KVCORE_API_VERSION = '{old}')" in message
    assert f"this kvcore's plugin API is {API_VERSION}" in message
    assert "install a release of plugin 'old_api'" in message and "KVCORE_DISABLE_PLUGINS=old_api" in message


def test_an_old_api_version_is_fatal_in_strict_mode():
    from kvcore.hookspecs import API_VERSION

    with pytest.raises(PluginError) as info:
        load(MHA, ep("old_api"), env={"KVCORE_STRICT_PLUGINS": "1"})
    text = str(info.value)
    assert "old_api" in text and f"plugin API is {API_VERSION}" in text and "KVCORE_STRICT_PLUGINS" in text


def test_kvcore_plugins_lists_a_refused_plugin_with_both_versions(monkeypatch, capsys):
    from kvcore.hookspecs import API_VERSION
    from kvcore.tools import cli

    import kvcore.plugins.manager

    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", load(MHA, ep("old_api"), ep("plain"), ep("current_api")))
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("plugin FAILED:")]
    assert len(failed) == 1 and "'old_api'" in failed[0]
    old = str(_major(API_VERSION) - 1)
    assert f"KVCORE_API_VERSION = '{old}'" in failed[0] and f"plugin API is {API_VERSION}" in failed[0]
    assert f"plugin API: {API_VERSION} (kvcore.hookspecs.API_VERSION)" in out
    assert "(loaded unchecked): plain" in out  # the one plugin without a declaration
    loaded = next(line for line in out.splitlines() if line.startswith("plugins loaded:"))
    assert loaded.split(":", 1)[1].strip().split(", ") == ["current_api", "mha", "plain"]


def test_the_core_api_version_loads():
    registry = load(MHA, ep("current_api"))
    assert sorted(registry.plugins) == ["current_api", "mha"]
    assert registry.backends["current_api"].plugin == "current_api"
    assert registry.failures == []
    from kvcore.hookspecs import API_VERSION

    assert registry.api_versions["current_api"] == API_VERSION


def test_a_plugin_declaring_no_version_loads_as_before():
    registry = load(MHA, ep("plain"))
    assert sorted(registry.plugins) == ["mha", "plain"] and registry.failures == []
    assert registry.api_versions["plain"] is None


@pytest.mark.parametrize("minor", ["0", "7"])
def test_only_the_major_is_compared(minor):
    from kvcore.hookspecs import API_VERSION

    registry = load(extra=[("versioned", _versioned(f"{_major(API_VERSION)}.{minor}"))])
    assert registry.plugins == ["versioned"] and registry.failures == []


@pytest.mark.parametrize("offset", [-1, 1])
def test_another_major_is_refused_either_way(offset):
    from kvcore.hookspecs import API_VERSION

    declared = str(_major(API_VERSION) + offset)
    registry = load(extra=[("versioned", _versioned(declared))])
    assert registry.plugins == [] and "versioned" not in registry.backends
    failure = registry.failure_of("versioned")
    assert failure.stage == "version" and f"KVCORE_API_VERSION = '{declared}'" in failure.error
    assert ("upgrade kvcore" if offset > 0 else "install a release") in failure.error


@pytest.mark.parametrize("declared", [4, "v4", "4.x", "", "4.1.2"])
def test_a_malformed_version_is_refused_saying_how_to_write_it(declared):
    registry = load(extra=[("versioned", _versioned(declared))])
    failure = registry.failure_of("versioned")
    assert failure is not None and failure.stage == "version"
    assert "not an API version" in failure.error and "major[.minor]" in failure.error


def test_every_installed_plugin_declares_the_core_version():
    """The built-in families and both example vendors declare the version they are written for."""
    from kvcore.hookspecs import API_VERSION

    registry = load_registry(env={})
    assert registry.failures == []
    for name in ("mha", "mla", "dsa", "swa", "mamba", "fp4", "k_only", "double_sparse", "acme", "zeta"):
        if name in registry.plugins:
            assert registry.api_versions[name] == API_VERSION, name
    assert {"mha", "mla", "dsa", "swa", "mamba", "fp4", "k_only", "double_sparse"} <= set(registry.plugins)


# -- kvcore bench's cases, registered by the plugins -----------------------------------------------------------

#: the rows ``kvcore bench`` times, by the plugin that registers them (RESULTS.md compares them by name)
BUILTIN_BENCH_CASES = {
    "mha": ["mha set_kv_buffer bf16", "mha set_kv_buffer fp8<-bf16", "move_kv_cache mha 32 layers",
            "mha set_kv_buffer bf16, page 16", "page-major set_kv_buffer bf16, page 16",
            "move_kv_cache mha 32 layers, page 16", "move_kv_cache page-major 32 layers, page 16"],
    "mla": ["mla set_mla_kv_buffer", "mla set_kv_buffer (concatenated)", "mla get_mla_kv_buffer",
            "mla get_mla_kv_buffer (out=)"],
    "dsa": ["dsa set_mla_kv_buffer (fp8 quantize)", "dsa get_mla_kv_buffer (dequantize)", "dsa get_mla_kv_buffer (out=)",
            "dsa set_index_k_scale_buffer", "dsa get_index_k_scale_buffer", "dsa get_index_k_scale_buffer (out=)"],
    "swa": ["swa set_kv_buffer (window, mapped)"],
    "fp4": ["nvfp4 set_kv_buffer (quantize)", "nvfp4 get_kv_buffer_by_loc", "nvfp4 get_kv_buffer_by_loc (out=)"],
    "mamba": ["mamba copy_from (36 layers)"],
    "minimax_sparse": [f"minimax-{d} {op}" for d in ("bf16", "fp8") for op in
                       ("set_index_kv_buffer", "set_index_k_buffer (keys only)", "set_fused_kv_index_buffer")],
}  # fmt: skip
BUILTIN = ("mha", "mla", "dsa", "swa", "mamba", "fp4", "k_only", "double_sparse", "minimax_sparse")


def builtin_entry_points():
    installed = {e.name: e for e in metadata.entry_points(group="kvcore")}
    return [installed[name] for name in BUILTIN]


def test_the_builtin_plugins_register_every_bench_case():
    from kvcore.hookspecs import GATHER, INTO, STATE
    from kvcore.tools.bench import collect

    suites = collect(load(*builtin_entry_points()))
    found = {}
    for suite in suites:
        found.setdefault(suite.plugin, []).extend(case.op for case in suite.cases)
        assert {case.pool for case in suite.cases} <= {pool.name for pool in suite.pools}
    assert found == BUILTIN_BENCH_CASES
    cases = {case.op: case for suite in suites for case in suite.cases}
    # what each row compares and times, as before the cases moved into the plugins
    assert [op for op, c in cases.items() if c.move] == [op for op in cases if op.startswith("move_kv_cache")]
    assert cases["mamba copy_from (36 layers)"].written == STATE
    assert cases["mamba copy_from (36 layers)"].sizes == (8, 256)
    assert {op for op, c in cases.items() if c.written == GATHER} == {
        "mla get_mla_kv_buffer", "dsa get_mla_kv_buffer (dequantize)", "dsa get_index_k_scale_buffer",
        "nvfp4 get_kv_buffer_by_loc"}  # fmt: skip
    assert {op for op, c in cases.items() if c.written == INTO} == {op for op in cases if op.endswith("(out=)")}
    # bytes per token of the copy-ceiling column (Llama-3-8B's 8 x 128 rows, DeepSeek's 512 + 64, gpt-oss's 8 x 64)
    assert cases["mha set_kv_buffer bf16"].bytes_per_token == 8192
    assert cases["page-major set_kv_buffer bf16, page 16"].bytes_per_token == 8200
    assert cases["swa set_kv_buffer (window, mapped)"].bytes_per_token == 4104
    assert cases["mla get_mla_kv_buffer (out=)"].bytes_per_token == 2304
    assert cases["dsa set_mla_kv_buffer (fp8 quantize)"].bytes_per_token == 1152 + 656
    assert cases["nvfp4 set_kv_buffer (quantize)"].bytes_per_token == 2 * 8 * 128 * 41 // 16
    assert cases["mamba copy_from (36 layers)"].bytes_per_token == 2 * 36 * (4096 * 3 * 2 + 16 * 128 * 128 * 4)
    # MiniMax's index rows of 128: read as bf16 (256 bytes), written as bf16 (256) or fp8 (128); K and V of 8 x 128
    assert cases["minimax-bf16 set_index_kv_buffer"].bytes_per_token == 2 * (256 + 256)
    assert cases["minimax-fp8 set_index_k_buffer (keys only)"].bytes_per_token == 256 + 128
    assert cases["minimax-fp8 set_fused_kv_index_buffer"].bytes_per_token == 8192 + 2 * (256 + 128)
    assert {op for op, c in cases.items() if c.bytes_per_token is None} == {
        "mha set_kv_buffer fp8<-bf16", "move_kv_cache mha 32 layers", "move_kv_cache mha 32 layers, page 16",
        "move_kv_cache page-major 32 layers, page 16", "dsa set_index_k_scale_buffer", "dsa get_index_k_scale_buffer",
        "dsa get_index_k_scale_buffer (out=)"}  # fmt: skip


def test_the_plugin_modules_stay_light():
    """``import kvcore_<family>.plugin`` imports no bench module: the hook imports it when ``kvcore bench`` runs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"for name in {BUILTIN!r}:\n"
        "    __import__(f'kvcore_{name}.plugin')\n"
        "loaded = sorted(m for m in sys.modules if m.endswith('.bench') or m == 'kvcore.tools.bench')\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_vendor_plugins_bench_cases_are_picked_up_and_checked(monkeypatch):
    from kvcore.tools.bench import build, check, collect, instances

    suites = collect(load(MHA, ep("bench_vendor")))
    assert [s.plugin for s in suites] == ["bench_vendor", "mha"]  # in the order the plugins registered (by name)
    vendor = [s for s in suites if s.plugin == "bench_vendor"]
    assert [c.op for c in vendor[0].cases] == ["vendor set_kv_buffer", "vendor get_key_buffer rows"]
    # what kvcore bench does with them before timing (here on the CPU): both pools, the same random bytes, every
    # case run on each and compared
    fast, ref = build(vendor, "triton"), build(vendor, "native")
    mine, theirs = fast["vendor_mha"].buffers(), ref["vendor_mha"].buffers()
    assert all(torch.equal(mine[b].view(torch.uint8), theirs[b].view(torch.uint8)) for b in ("k", "v"))
    for n in (1, 8, 64):
        for case, inputs in instances(vendor, n, n):
            ours, theirs = check(case, n, inputs, fast, ref)
            assert callable(ours) and callable(theirs)
    from fake_plugins import bench_vendor

    monkeypatch.setitem(bench_vendor.WRONG, "store", True)
    case, inputs = instances(vendor, 8, 8)[0]
    with pytest.raises(AssertionError, match="vendor set_kv_buffer at N=8 differs from the torch path"):
        check(case, 8, inputs, fast, ref)


def test_bench_case_errors_name_the_plugin():
    from kvcore.hookspecs import BenchCase, BenchCases, BenchPool
    from kvcore.tools.bench import collect

    def records(*items):
        class Plugin:
            @kvcore.hookimpl
            def kvcore_bench_cases(self):
                return list(items)

        return Plugin()

    pool = BenchPool(name="p", make=lambda kernels: None)
    case = BenchCase(op="vendor set_kv_buffer", pool="p", call=lambda p, x: p, written=lambda x: x)
    with pytest.raises(PluginError, match="plugin 'bad': kvcore_bench_cases returned dict"):
        collect(load(extra=[("bad", records({"op": "x"}))]))
    lacking = BenchCases(pools=(), inputs=lambda n, gen: None, cases=(case,))
    with pytest.raises(PluginError, match="plugin 'bad': bench case 'vendor set_kv_buffer' calls pool 'p'"):
        collect(load(extra=[("bad", records(lacking))]))
    twin = BenchCases(pools=(BenchPool(name="q", make=lambda kernels: None),), inputs=lambda n, gen: None,
                      cases=(attrs.evolve(case, pool="q"),))  # fmt: skip
    with pytest.raises(PluginError, match="plugin 'twin': bench case 'vendor set_kv_buffer' is already registered by "
                                          "plugin 'bench_vendor'"):  # fmt: skip
        collect(load(ep("bench_vendor"), extra=[("twin", records(twin))]))
    with pytest.raises(ValueError, match="written='rows'"):
        BenchCase(op="x", pool="p", call=lambda p, x: p, written="rows")
