"""The explicit pool contract: documented config keys (schema, plugin sections, backend options), the README's
generated key table, option validation for every backend, model-section ownership, layout descriptions, and the
conformance kit's own set-up."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import attrs
import pytest
import torch

import kvcore
from kvcore import BackendSpec, BufferLayout, ConfigError, load_config
from kvcore.tools.cli import main
from kvcore.config import all_keys
from kvcore.plugins import load_registry
from kvcore_mla.layout import MLADims



@pytest.fixture(scope="module")
def registry():
    return load_registry(env={})


def test_every_key_is_documented(registry):
    keys = all_keys(registry)
    undocumented = [k.path for k in keys if not k.doc.strip()]
    assert not undocumented, f"config keys without a doc: {undocumented}"
    paths = {k.path for k in keys}
    # the plugins' sections and options are keys like any other
    assert {"model.mla.kv_lora_rank", "model.dsa.index_head_dim", "kv_cache.options.index_dtype"} <= paths
    assert {"memory.mem_fraction_static", "parallel.tp_size", "hardware.kernels"} <= paths


def test_config_command_lists_keys_with_defaults(capsys, monkeypatch):
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("kv_cache.options.index_dtype"))
    assert "[fp8]" in line and "backend dsa" in line
    assert re.search(r"^memory\.mem_fraction_static\s+float\s+\[0\.88\]", out, re.M)


@pytest.mark.parametrize("model", ["llama-3-8b", "tiny-mla"])
def test_backends_without_options_reject_any(registry, model):
    cfg = load_config(f"model={model}", "hardware=h200", "kv_cache.options.foo=1", registry=registry)
    with pytest.raises(ConfigError, match=r"kv_cache\.options\.foo is not an option of backend '(mha|mla)', which takes none"):
        kvcore.plan_memory(cfg, registry=registry)


def test_a_section_has_one_schema(registry):
    @attrs.define
    class OtherMLA:
        kv_lora_rank: int = 1

    class Rogue:
        @staticmethod
        @kvcore.hookimpl
        def kvcore_register_backends():
            return [BackendSpec(name="rogue", attention=("mla",), layout=lambda r: None, create_pool=lambda *a: None,
                                model_sections={"mla": OtherMLA})]  # fmt: skip

    reg = load_registry(env={}, extra_plugins=[("rogue", Rogue)])
    (failure,) = [f for f in reg.failures if f.plugin == "rogue"]
    assert "declares model section 'mla' as" in failure.error and "backend 'mla'" in failure.error
    assert "rogue" not in reg.backends and reg.model_sections == registry.model_sections

    class Friend:
        @staticmethod
        @kvcore.hookimpl
        def kvcore_register_backends():  # a vendor's MLA backend reuses the family's class
            return [BackendSpec(name="friend", attention=("mla",), layout=lambda r: None, create_pool=lambda *a: None,
                                model_sections={"mla": MLADims}, vendors=("acme",))]  # fmt: skip

    reg = load_registry(env={}, extra_plugins=[("friend", Friend)])
    assert "friend" in reg.backends and not reg.failures


def test_request_carries_typed_sections_and_options(registry):
    cfg = load_config("model=deepseek-v3.2", "kv_cache.options.index_dtype=bfloat16", registry=registry)
    request = kvcore.make_request(cfg, registry=registry)
    assert set(request.sections) == {"mla", "dsa"}
    assert request.section("mla").kv_lora_rank == 512 and request.section("dsa").index_head_dim == 128
    assert request.options.index_dtype == "bfloat16"
    mha = kvcore.make_request(load_config("model=llama-3-8b", registry=registry), registry=registry)
    assert dict(mha.sections) == {} and mha.options is None


@pytest.mark.parametrize(
    "buffer, line",
    [
        (BufferLayout("k", 32, (8, 128), torch.bfloat16), "k [8, 128] bfloat16 per token x 32 layers = 65536 B/token"),
        (BufferLayout("index_k", 61, (8448,), torch.uint8, tokens_per_row=64),
         "index_k [8448] uint8 per 64 tokens x 61 layers = 8052 B/token"),
        (BufferLayout("swa_v", 2, (4,), torch.float32, sized_by="swa_tokens"),
         "swa_v [4] float32 per token x 2 layers = 32 B/token (swa_tokens)"),
    ],
)  # fmt: skip
def test_layouts_describe_themselves(buffer, line):
    assert buffer.describe() == line


def test_plan_report_describes_the_layout_not_heads(capsys, monkeypatch):
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)
    assert main(["plan", "model=deepseek-v3.2", "hardware=h200"]) == 0
    out = capsys.readouterr().out
    assert "KV head" not in out and "dsa attention, 61 layers" in out
    assert "buffer   kv [1, 656] uint8 per token x 61 layers = 40016 B/token" in out


def test_kit_sets_up_interpreted_triton_itself():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCORE_TEST_COMPILED")}
    code = "import os, kvcore.testing; print(os.environ.get('TRITON_INTERPRET'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    env["KVCORE_TEST_COMPILED"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"


def test_launcher_sees_an_empty_hook_chain_as_no_hook(monkeypatch):
    """Triton keeps a HookChain in its launch-hook knobs; only a chain with hooks (a profiler) must send
    launches through the dispatcher, or every call pays the dispatcher's host time."""
    import triton

    from kvcore.kernels import launch

    runtime = triton.knobs.runtime
    if hasattr(runtime.launch_enter_hook, "calls"):
        assert not launch.launch_hooks_installed()
        hook = lambda *args: None  # noqa: E731
        runtime.launch_enter_hook.add(hook)
        try:
            assert launch.launch_hooks_installed()
        finally:
            runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(runtime, "launch_exit_hook", lambda *args: None)
    assert launch.launch_hooks_installed()
    monkeypatch.setattr(runtime, "launch_exit_hook", None)
    monkeypatch.setattr(runtime, "launch_enter_hook", None)
    assert not launch.launch_hooks_installed()


def test_launcher_gives_the_dispatcher_tensors_for_addresses():
    """Hot paths pass their pointers as addresses; whenever the dispatcher (or the launch check) needs the
    arguments, the Launcher puts the tensors back in the named positions, calling a function for them only
    then."""
    import triton
    import triton.language as tl

    from kvcore.kernels.launch import Launcher

    @triton.jit
    def add_one(dst_ptr, n, src_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) + 1, mask=mask)

    from kvcore.testing.tensors import test_device

    device = test_device()  # the CPU under the interpreter; CUDA in compiled runs (then the 2nd call is direct)
    with pytest.raises(ValueError, match=r"no parameters \['out_ptr'\]"):
        Launcher(add_one, device, ("out_ptr",))
    launcher = Launcher(add_one, device, ("dst_ptr", "src_ptr"))
    src = torch.arange(5, dtype=torch.float32, device=device)
    dst = torch.zeros(5, device=device)
    assert launcher._with_tensors((1, 5, 2, 8), (dst, src)) == [dst, 5, src, 8]
    made = []
    assert launcher._with_tensors((1, 5, 2, 8), lambda: made.append(1) or (dst, src)) == [dst, 5, src, 8]
    assert made == [1]
    with pytest.raises(ValueError):
        launcher._with_tensors((1, 5, 2, 8), (dst,))  # one tensor short
    for _ in range(2):
        launcher("key", 1, 1, (dst.data_ptr(), 5, src.data_ptr(), 8), lambda: (dst, src))
        assert torch.equal(dst, src + 1)
        src = dst.clone()


def test_importing_kvcore_leaves_triton_unimported():
    """``import kvcore`` (its API, config, planner, checked mode) must not import Triton: ``@triton.jit`` picks
    interpreted or compiled kernels when a kernel module is imported, so the kit must set TRITON_INTERPRET
    first."""
    code = "import sys, kvcore, kvcore.api, kvcore.checked, kvcore.planning.planner; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_public_names_import_from_the_packages():
    """Engines import the pools from their family's package and the rest from kvcore; the packages stay light
    (no Triton) until a pool class is asked for."""
    code = (
        "import sys\n"
        "import kvcore, kvcore_mha, kvcore_mla, kvcore_dsa, kvcore_swa, kvcore_mamba, kvcore_fp4\n"
        "light = 'triton' not in sys.modules\n"
        "from kvcore import build_pools, load_config, plan_memory, ReqToTokenPool, TokenToKVPoolAllocator, "
        "PagedTokenToKVPoolAllocator\n"
        "from kvcore_mha import MHATokenToKVPool\n"
        "from kvcore_mla import MLATokenToKVPool\n"
        "from kvcore_dsa import DSATokenToKVPool, NSATokenToKVPool\n"
        "from kvcore_swa import SWAKVPool, SWATokenToKVPoolAllocator\n"
        "from kvcore_mamba import MambaPool, HybridReqToTokenPool, HybridLinearKVPool\n"
        "from kvcore_fp4 import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4\n"
        "print(light, MHATokenToKVPool.__module__, ReqToTokenPool.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "kvcore_mha.pool", "kvcore.pools.base"]
    import kvcore

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kvcore.Nope  # noqa: B018
