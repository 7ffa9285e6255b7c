"""Bad configurations and inputs: every one ends in one error (never a traceback) that names the key and, where
one exists, a value that works, written as an override; where the error suggests one, the suggestion is applied
and the plan then succeeds."""

from __future__ import annotations

import re

import pytest

import kvcore.plugins
from kvcore import load_config, plan_memory
from kvcore.tools.cli import main
from kvcore.errors import KVCoreError


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def error_of(*args: str) -> str:
    with pytest.raises(KVCoreError) as err:
        plan_memory(load_config(*args))
    return str(err.value)


def suggested(message: str, key: str, overrides: list[str]) -> str:
    """The ``key=value`` override an error suggests (not the value the overrides gave, which it may quote)."""
    given = {o for o in overrides if o.startswith(f"{key}=")}
    for found in re.finditer(rf"{re.escape(key)}=([0-9][0-9.]*|[A-Za-z0-9_.]+)", message):
        fix = f"{key}={found.group(1).rstrip('.')}"
        if fix not in given:
            return fix
    raise AssertionError(f"no {key}=... suggested in: {message}")


# (overrides, what the message must say); the key named first
CASES = [
    (["bogus.key=1"], ["bogus", "valid keys at the top level: hardware, kv_cache, memory, parallel, speculative, disaggregation, model"]),
    (["memory.bogus=1"], ["memory.bogus", "valid keys at memory: mem_fraction_static"]),
    (["model=deepseek-v3", "model.mla.bogus=1"], ["model.mla.bogus", "valid keys at model.mla: kv_lora_rank"]),
    (["model=nope"], ["model='nope'", "valid options: deepseek-v3"]),
    (["hardware=nope"], ["hardware='nope'", "valid options: cpu, h100, h200"]),
    (["memory.mem_fraction_static=1.5"], ["mem_fraction_static", "(0, 1]"]),
    (["kv_cache.page_size=0"], ["kv_cache.page_size must be positive"]),
    (["model.num_hidden_layers=-1"], ["model.num_hidden_layers must be positive"]),
    (["parallel.dp_size=0"], ["parallel.dp_size must be positive"]),
    (["memory.max_running_requests=0"], ["memory.max_running_requests must be positive"]),
    (["hardware.kernels=fast"], ["hardware.kernels='fast'", "auto, triton, native"]),
    (["kv_cache.dtype=int8"], ["kv_cache.dtype='int8'", "bfloat16", "block formats: fp4_e2m1, mxfp8, nvfp4"]),
    (["kv_cache.backend=nope"], ["kv_cache.backend='nope'", "is not a registered backend; registered: ", "dsa, ", "fp4, ", " mha, ", " noop, ", "(see `kvcore plugins`)"]),
    (["kv_cache.options.foo=1"], ["kv_cache.options.foo", "backend 'mha'", "remove it"]),
    (["model=deepseek-v3.2", "kv_cache.options.index_dtype=fp16"], ["kv_cache.options.index_dtype='fp16'", "bfloat16"]),
    (["parallel.tp_size=3"], ["parallel.tp_size=3", "use a divisor of 14"]),
    (["parallel.pp_size=100"], ["parallel.pp_size=100 exceeds model.num_hidden_layers=24"]),
    (["parallel.pp_size=2", "parallel.pp_rank=5"], ["parallel.pp_rank=5", "[0, parallel.pp_size=2)"]),
    (["model=qwen3-next-80b", "hardware=h200", "kv_cache.options.max_mamba_cache_size=100000"],
     ["kv_cache.options.max_mamba_cache_size", "memory.max_running_requests"]),
    (["kv_cache=16"], ["kv_cache='16'", "is a section of keys, not a value", "page_size", "e.g. kv_cache.dtype=auto"]),
    (["memory=3"], ["memory='3'", "is a section of keys", "mem_fraction_static"]),
    (["kv_cache.page_size=100000"], ["kv_cache.page_size=100000 is larger than the model's whole context",
                                     "kv_cache.page_size=64"]),
    (["model=tiny-swa", "memory.swa_full_tokens_ratio=-1"], ["memory.swa_full_tokens_ratio must be positive", "0.8"]),
]  # fmt: skip


@pytest.mark.parametrize("overrides, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_errors_name_the_key(overrides, says):
    message = error_of(*overrides)
    for part in says:
        assert part in message, f"{part!r} not in: {message}"


# (overrides, the key whose value the error suggests)
FIXABLE = [
    (["kv_cache.page_size=abc"], "kv_cache.page_size"),
    (["memory.mem_fraction_static=high"], "memory.mem_fraction_static"),
    (["model=deepseek-v3.2", "hardware=h200", "kv_cache.page_size=16"], "kv_cache.page_size"),
    (["model=llama-3-8b", "hardware=cpu"], "hardware.memory_gib"),
    (["model=llama-3-8b", "hardware=cpu"], "memory.budget_gib"),
    (["model=deepseek-v3", "hardware=h200", "parallel.tp_size=2"], "parallel.tp_size"),
    (["model=llama-3-70b", "hardware=h200"], "parallel.tp_size"),
    (["memory.mem_fraction_static=0.01"], "memory.mem_fraction_static"),
    (["memory.budget_gib=0.000001"], "memory.budget_gib"),
    (["memory.max_total_tokens=1"], "memory.max_total_tokens"),
    (["memory.max_total_tokens=10", "kv_cache.page_size=64"], "memory.max_total_tokens"),
    (["model=tiny-swa", "hardware=cpu", "memory.budget_gib=0.001", "kv_cache.page_size=16",
      "memory.swa_full_tokens_ratio=0.01"], "memory.swa_full_tokens_ratio"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, key", FIXABLE, ids=[f"{' '.join(c[0])} -> {c[1]}" for c in FIXABLE])
def test_suggested_overrides_work(overrides, key):
    message = error_of(*overrides)
    fix = suggested(message, key, overrides)
    plan = plan_memory(load_config(*[o for o in overrides if not o.startswith(f"{key}=")], fix))
    assert plan.max_total_num_tokens > 0


def test_a_value_with_no_default_is_not_suggested_as_missing():
    """A key whose schema default is MISSING (hardware.memory_gib, set by every hardware file) gets its type in
    the error, never ``e.g. hardware.memory_gib=???``."""
    message = error_of("hardware.memory_gib=abc")
    assert message.startswith("hardware.memory_gib") and "give a float" in message and "???" not in message


def test_no_fraction_above_one_is_suggested():
    """When one request's context does not fit even the whole memory, no mem_fraction_static is suggested."""
    message = error_of("hardware.memory_gib=1.2", "kv_cache.page_size=32768")  # a page of the whole context
    assert "less than one page" in message and "memory.budget_gib=" in message
    assert "mem_fraction_static" not in message, "a fraction above 1 suggested"


@pytest.mark.parametrize("body", ["model: tiny-mla\nkv_cache:\n  page_size: 16\n",
                                  "defaults:\n  - model: tiny-swa\nmodel: tiny-mla\n"])
def test_an_engine_file_names_a_group_option_as_the_command_line_does(tmp_path, body):
    """``model: tiny-mla`` in an engine file chooses the option (over the file's defaults list), as
    ``model=tiny-mla`` on the command line does; the file's other keys still apply."""
    path = tmp_path / "engine.yaml"
    path.write_text(body)
    cfg = load_config(path=path)
    assert cfg.model.name == "tiny-mla" and cfg.model.attention == "mla"
    assert cfg.kv_cache.page_size == (16 if "page_size" in body else 1)
    assert load_config("model=tiny-swa", path=path).model.name == "tiny-swa", "the command line still wins"


def test_an_engine_file_giving_a_section_one_value_names_the_file_and_the_keys(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("kv_cache: 16\n")
    with pytest.raises(KVCoreError, match=r"engine.yaml: kv_cache=16: kv_cache is a section of keys.*page_size"):
        load_config(path=path)


def test_a_model_too_big_for_the_cpu_points_at_memory_not_parallelism():
    message = error_of("model=llama-3-8b", "hardware=cpu")
    assert "parallel." not in message and "hardware.memory_gib=" in message and "memory.budget_gib=" in message


def test_a_cap_larger_than_what_fits_warns_with_the_key():
    plan = plan_memory(load_config("memory.max_total_tokens=99999999999"))
    assert any("memory.max_total_tokens=99999999999 is larger than" in w for w in plan.warnings)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "corrupt.yaml").write_text("model: [unclosed\nkv_cache: 1\n")
    (tmp_path / "locked.yaml").write_text("kv_cache:\n  page_size: 16\n")
    return tmp_path


@pytest.mark.parametrize("name, says", [
    ("list.yaml", "must hold a mapping at top level, not a ListConfig"),
    ("empty.yaml", "is empty"),
    ("corrupt.yaml", "is not valid YAML (line 2, column 9)"),
    ("missing.yaml", "does not exist"),
])  # fmt: skip
def test_bad_engine_files_end_in_one_error_line(capsys, files, name, says):
    assert main(["plan", str(files / name)]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and str(files / name) in captured.err
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1


def test_an_unreadable_file_says_so(capsys, files, monkeypatch):
    import omegaconf

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(omegaconf.OmegaConf, "load", refuse)
    assert main(["plan", str(files / "locked.yaml")]) == 2
    err = capsys.readouterr().err
    assert "permission denied; make it readable" in err and "Traceback" not in err


def test_up_on_a_gpu_profile_without_a_gpu_is_one_error_before_any_plan(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["up", "model=llama-3-8b", "hardware=h200"]) == 2
    out, err = capsys.readouterr()
    assert out == "", "up printed the config or a plan before refusing"
    assert err.count("\n") == 1 and "no CUDA device is visible" in err and "hardware=cpu" in err


def test_a_cuda_device_on_the_cpu_profile_is_told_to_set_the_device_back(capsys, monkeypatch):
    """hardware=cpu with hardware.device=cuda: the fix is the device key, not the profile the config already has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["up", "hardware.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "set hardware.device=cpu" in err and "choose a CPU profile" not in err


def test_no_backend_for_the_config_puts_the_fix_first_and_the_rest_behind_explain(capsys):
    overrides = ["plan", "model=deepseek-v3.2", "kv_cache.page_size=16"]
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "kv_cache.page_size=64" in err[0] and "--explain" in err[1]
    assert main([*overrides, "--explain"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache.page_size=64" in err.splitlines()[0] and "  - mha (mha): serves attention mha, model needs dsa" in err


def test_up_counts_the_backends_not_chosen_and_explain_lists_them(capsys):
    from kvcore.plugins import get_registry

    others = len(get_registry().backends) - 1
    assert main(["up", "memory.max_total_tokens=256"]) == 0
    out = capsys.readouterr().out
    assert f"{others} other backends not chosen (`--explain` says why each is not)" in out and "skipped '" not in out
    assert main(["up", "memory.max_total_tokens=256", "--explain"]) == 0
    assert capsys.readouterr().out.count("skipped '") == others


def test_more_tensor_ranks_than_kv_heads_says_the_heads_are_replicated():
    plan = plan_memory(load_config("model=llama-3-8b", "hardware=h200", "parallel.tp_size=16"))
    assert any("parallel.tp_size=16 exceeds model.num_key_value_heads=8" in w and "replicated on 2 ranks" in w
               for w in plan.warnings)  # fmt: skip
    assert not any("replicated" in w for w in plan_memory(load_config("model=llama-3-8b", "hardware=h200")).warnings)


def test_a_pool_smaller_than_one_full_context_request_says_so():
    plan = plan_memory(load_config("model=gemma-3-27b", "hardware=h100"))
    assert plan.max_total_num_tokens < 131072
    assert any(f"the pool holds {plan.max_total_num_tokens} tokens, fewer than one request at the model's full "
               "context (model.context_length=131072)" in w for w in plan.warnings)  # fmt: skip


def test_check_refuses_a_page_size_of_zero_as_an_argument(capsys):
    with pytest.raises(SystemExit) as done:
        main(["check", "mha", "--page-size", "0"])
    assert done.value.code == 2 and "argument --page-size: '0': each value must be a positive int" in capsys.readouterr().err


def test_a_request_table_larger_than_an_explicit_budget_is_reported_beside_it(capsys):
    """SGLang's request table is outside the KV budget: the plan says what it adds, and warns (naming the keys
    that shrink it) when it outweighs the budget."""
    plan = plan_memory(load_config("memory.budget_gib=0.02"))
    assert plan.req_to_token_bytes > plan.budget.kv_budget_bytes
    assert any("the request table" in w and "memory.max_running_requests" in w for w in plan.warnings)
    assert main(["plan", "memory.budget_gib=0.02"]) == 0
    out = capsys.readouterr().out
    assert f"the request table ({plan.req_to_token_bytes / 2**30:.2f} GiB) comes on top" in out
    roomy = plan_memory(load_config("memory.budget_gib=1"))
    assert not any("the request table" in w for w in roomy.warnings)
