"""``model=hf:PATH``: a Hugging Face checkpoint's own ``config.json`` as the model spec (kvcore/config/hf.py).

The files under tests/data/hf are real released configs (tests/data/hf/SOURCES.md says where each came from).
For every model with a shipped YAML, the spec built from its config.json must give the YAML's attention
dimensions and sections and the same plan (tokens, bytes per token, requests) on the same hardware and
parallel layout, which the test reads from the YAML itself.  Models without a YAML (mistral, qwen3,
qwen3_moe) are checked against values computed here from their config.json.  Then the paths (file,
directory, HF cache snapshot), the safetensors index, the DSA variant, the errors and the CLI, and DeepSeek-V4
and MiniMax-M3, whose parameter counts are checked against their released checkpoints' tensor lists.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml

from kvcore import ConfigError
from kvcore.api import plan_memory
from kvcore.tools.cli import main
from kvcore import load_config
from kvcore.config import packaged_configs
from kvcore.config.hf import hf_model_config

DATA = Path(__file__).parent / "data" / "hf"
REPO = DATA.parent.parent.parent

#: the DeepSeek-V4 pool (plugin ``dsv4``) declares ``model.deepseek_v4``: what loads and plans DeepSeek-V4 needs it
HAS_DSV4 = importlib.util.find_spec("kvcore_dsv4") is not None and any(
    entry.name == "dsv4" for entry in importlib.metadata.entry_points(group="kvcore"))
needs_dsv4 = pytest.mark.skipif(not HAS_DSV4, reason="the dsv4 plugin (kvcore_dsv4) is not installed")

#: stored config -> the shipped YAML describing the same architecture (see SOURCES.md for the two stand-ins:
#: DeepSeek-R1-0528's file for DeepSeek-V3, the Qwen2.5-0.5B base file for the Instruct YAML)
PAIRS = {
    "llama-3-8b": "llama-3-8b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen2.5-0.5b": "qwen2.5-0.5b",
    "deepseek-r1-0528": "deepseek-v3",
    "deepseek-v3.2": "deepseek-v3.2",
    "gpt-oss-120b": "gpt-oss-120b",
    "gemma-3-27b-it": "gemma-3-27b",
    "qwen3-next-80b-a3b": "qwen3-next-80b",
    "deepseek-v4-flash": "deepseek-v4-flash",
    "deepseek-v4-pro": "deepseek-v4-pro",
    "minimax-m3": "minimax-m3",
}
#: the pairs whose family is the dsv4 plugin's
DSV4_PAIRS = ("deepseek-v4-flash", "deepseek-v4-pro")


def pair_params() -> list:
    return [pytest.param(name, marks=needs_dsv4) if name in DSV4_PAIRS else name for name in sorted(PAIRS)]

#: the shared ModelConfig keys that describe the attention and the budget (not name / architecture)
DIMENSIONS = ("attention", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_size", "context_length", "dtype", "weight_dtype", "weight_bytes")  # fmt: skip
SECTIONS = ("mla", "dsa", "swa", "mamba", "deepseek_v4", "minimax_sparse")


def hf(name: str) -> str:
    return f"model=hf:{DATA / name}"


def raw(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())


def yaml_layout(model: str) -> list[str]:
    """What a shipped model YAML sets outside ``model`` (a ``# @package _global_`` file's kv_cache and
    parallel keys), as dotlist overrides: the layout the YAML assumes, applied to the hf: spec too."""
    data = yaml.safe_load((packaged_configs() / "model" / f"{model}.yaml").read_text())
    if "model" not in data:
        return []
    return [f"{section}.{key}={value}" for section, keys in data.items() if section != "model" for key, value in keys.items()]


def plan_summary(plan) -> dict:
    return {
        "backend": plan.backend,
        "bytes_per_token": plan.bytes_per_token,
        "max_total_num_tokens": plan.max_total_num_tokens,
        "max_running_requests": plan.max_running_requests,
        "sizes": dict(plan.sizes),
        "kv_cache_bytes": plan.kv_cache_bytes,
        "buffers": [buffer.describe() for buffer in plan.layout.buffers],
    }


def test_every_stored_config_has_a_source():
    sources = (DATA / "SOURCES.md").read_text()
    stored = sorted(p.name for p in DATA.iterdir() if (p / "config.json").is_file())
    assert stored and all(f"`{name}`" in sources for name in stored)


# -- against the shipped YAMLs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", pair_params())
def test_spec_matches_the_shipped_yaml(name):
    layout = yaml_layout(PAIRS[name])
    ours = load_config(hf(name), "hardware=h200", *layout).model
    shipped = load_config(f"model={PAIRS[name]}", "hardware=h200", *layout).model
    assert {k: getattr(ours, k) for k in DIMENSIONS} == {k: getattr(shipped, k) for k in DIMENSIONS}
    assert (ours.v_head_dim or ours.head_dim) == (shipped.v_head_dim or shipped.head_dim)
    assert {s: getattr(ours, s, None) for s in SECTIONS} == {s: getattr(shipped, s, None) for s in SECTIONS}
    assert ours.architecture == shipped.architecture
    assert ours.num_nextn_predict_layers == shipped.num_nextn_predict_layers
    assert ours.name == name  # the checkpoint's directory


@pytest.mark.parametrize("name", pair_params())
def test_plan_matches_the_shipped_yaml(name):
    layout = yaml_layout(PAIRS[name])
    ours = plan_memory(load_config(hf(name), "hardware=h200", *layout))
    shipped = plan_memory(load_config(f"model={PAIRS[name]}", "hardware=h200", *layout))
    assert plan_summary(ours) == plan_summary(shipped)


@pytest.mark.parametrize("name", pair_params())
def test_parameter_count_matches_the_shipped_yaml(name):
    """Both count the served language model from the config's shapes.  One known difference: the shipped
    qwen3-next-80b.yaml counts 6144 parameters more than the converter does (79674397440 vs 79674391296;
    transformers' Qwen3NextForCausalLM built on the meta device from this config.json also has 79674391296).
    That is 12 KiB of bf16 weights over two ranks and moves no token of the plan (checked above)."""
    ours = load_config(hf(name)).model.num_parameters
    shipped = load_config(f"model={PAIRS[name]}").model.num_parameters
    if name == "qwen3-next-80b-a3b":
        assert 0 < shipped - ours < 1e-6 * shipped
    else:
        assert ours == shipped
    assert load_config(hf(name)).model.weight_bytes == load_config(f"model={PAIRS[name]}").model.weight_bytes


def test_yaml_layout_reads_the_global_package_sections():
    assert yaml_layout("deepseek-v3") == ["parallel.tp_size=8"]
    assert set(yaml_layout("deepseek-v3.2")) == {"kv_cache.page_size=64", "kv_cache.dtype=float8_e4m3fn", "parallel.tp_size=8"}
    assert set(yaml_layout("deepseek-v4-flash")) == {"kv_cache.page_size=256", "kv_cache.dtype=float8_e4m3fn", "parallel.tp_size=2"}
    assert yaml_layout("minimax-m3") == ["parallel.tp_size=8"]
    assert yaml_layout("llama-3-8b") == []


# -- model types without a shipped YAML: expectations computed from the config.json ----------------------------


def kv_bytes_per_token(c: dict, layers: int, head_dim: int, itemsize: int = 2) -> int:
    return 2 * layers * c["num_key_value_heads"] * head_dim * itemsize  # K and V


def test_mistral_keeps_every_token_as_sglang_does():
    """Mistral 7B v0.1 slides a window over every layer; attention applies it, the pool keeps all tokens (mha)."""
    c = raw("mistral-7b-v0.1")
    assert c["sliding_window"]
    cfg = load_config(hf("mistral-7b-v0.1"), "hardware=h200")
    m = cfg.model
    assert (m.attention, m.num_hidden_layers, m.num_key_value_heads) == ("mha", c["num_hidden_layers"], c["num_key_value_heads"])
    assert m.head_dim == c["hidden_size"] // c["num_attention_heads"]  # no head_dim key in the file
    assert m.context_length == c["max_position_embeddings"]
    assert plan_memory(cfg).bytes_per_token == kv_bytes_per_token(c, c["num_hidden_layers"], m.head_dim)


def test_qwen3_dense():
    c = raw("qwen3-8b")
    cfg = load_config(hf("qwen3-8b"), "hardware=h200")
    m = cfg.model
    assert (m.attention, m.head_dim, m.num_key_value_heads) == ("mha", c["head_dim"], c["num_key_value_heads"])
    assert plan_memory(cfg).bytes_per_token == kv_bytes_per_token(c, c["num_hidden_layers"], c["head_dim"])
    # untied embedding and head, q/k/v/o without biases, q/k norms, SwiGLU, two norms a layer, final norm
    h, d, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = 2 * h * q + 2 * h * kv + 2 * d + 3 * h * c["intermediate_size"] + 2 * h
    assert m.num_parameters == 2 * c["vocab_size"] * h + layers * per_layer + h


def test_qwen3_moe():
    c = raw("qwen3-30b-a3b")
    cfg = load_config(hf("qwen3-30b-a3b"), "hardware=h200")
    m = cfg.model
    assert (m.attention, m.head_dim, m.num_attention_heads) == ("mha", c["head_dim"], c["num_attention_heads"])
    assert plan_memory(cfg).bytes_per_token == kv_bytes_per_token(c, c["num_hidden_layers"], c["head_dim"])
    h, d, layers, e = c["hidden_size"], c["head_dim"], c["num_hidden_layers"], c["num_experts"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    moe = e * 3 * h * c["moe_intermediate_size"] + h * e  # experts and router; every layer (mlp_only_layers empty)
    per_layer = 2 * h * q + 2 * h * kv + 2 * d + moe + 2 * h
    assert m.num_parameters == 2 * c["vocab_size"] * h + layers * per_layer + h


# -- paths ---------------------------------------------------------------------------------------------------


def test_file_and_directory_paths_give_the_same_spec():
    assert hf_model_config(f"hf:{DATA / 'gpt-oss-120b'}") == hf_model_config(f"hf:{DATA / 'gpt-oss-120b' / 'config.json'}")


def test_relative_path(monkeypatch):
    monkeypatch.chdir(DATA.parent.parent.parent)
    assert load_config("model=hf:tests/data/hf/llama-3-8b").model.name == "llama-3-8b"


def test_hf_cache_snapshot_is_named_after_the_repository(tmp_path):
    snapshot = tmp_path / "models--meta-llama--Meta-Llama-3-8B" / "snapshots" / "62bd457b6fe961a42a631306577e622c83876cb6"
    snapshot.mkdir(parents=True)
    shutil.copy(DATA / "llama-3-8b" / "config.json", snapshot)
    assert load_config(f"model=hf:{snapshot}").model.name == "meta-llama/Meta-Llama-3-8B"


def test_overrides_still_win():
    cfg = load_config(hf("llama-3-8b"), "model.context_length=4096", "model.name=mine")
    assert (cfg.model.context_length, cfg.model.name) == (4096, "mine")


# -- the safetensors index -------------------------------------------------------------------------------------


def with_index(tmp_path: Path, name: str, total_size: int) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(DATA / name / "config.json", folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": {}}))
    return folder


def test_index_total_size_gives_the_parameters(tmp_path):
    params = load_config("model=llama-3-8b").model.num_parameters
    folder = with_index(tmp_path, "llama-3-8b", 2 * params + 1)  # bf16: two bytes a parameter
    m = load_config(f"model=hf:{folder}").model
    assert m.num_parameters == params and m.weight_bytes is None


def test_index_total_size_is_the_weights_of_a_mixed_precision_checkpoint(tmp_path):
    total = 65_000_000_000
    m = load_config(f"model=hf:{with_index(tmp_path, 'gpt-oss-120b', total)}").model
    assert m.weight_bytes == total and m.num_parameters == total // 2


def test_index_of_an_fp8_checkpoint_counts_one_byte_a_parameter(tmp_path):
    m = load_config(f"model=hf:{with_index(tmp_path, 'deepseek-r1-0528', 700_000_000_000)}").model
    assert (m.num_parameters, m.weight_dtype) == (700_000_000_000, "float8_e4m3fn")


def test_bad_index_names_the_key(tmp_path):
    folder = with_index(tmp_path, "llama-3-8b", 0)
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json.*metadata\.total_size"):
        load_config(f"model=hf:{folder}")


# -- DeepSeek's DSA variant ------------------------------------------------------------------------------------


def test_deepseek_v32_is_dsa():
    """DeepSeek-V3.2's released config.json is DeepSeek-V3's architecture (the stored DeepSeek-R1-0528 file) plus
    the lightning indexer: the same MLA section, a DSA section from index_head_dim, and the indexer's weights
    counted on top of V3's, computed here from the file's own keys."""
    v32, v3 = load_config(hf("deepseek-v3.2")).model, load_config(hf("deepseek-r1-0528")).model
    assert (v32.attention, v3.attention) == ("dsa", "mla")
    assert v32.mla == v3.mla and v32.dsa.index_head_dim == raw("deepseek-v3.2")["index_head_dim"]
    # per layer: wq_b (q_lora_rank -> heads x dim), wk (hidden -> dim), the k LayerNorm (weight, bias), weights_proj
    c = raw("deepseek-v3.2")
    h, dim, heads = c["hidden_size"], c["index_head_dim"], c["index_n_heads"]
    indexer = c["num_hidden_layers"] * (c["q_lora_rank"] * heads * dim + h * dim + 2 * dim + h * heads)
    assert v32.num_parameters - v3.num_parameters == indexer


# -- errors ----------------------------------------------------------------------------------------------------


def write_config(tmp_path: Path, data: dict | str) -> Path:
    path = tmp_path / "ckpt" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v32", "qwen3_next",
             "deepseek_v4", "minimax_m3_vl")


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    path = write_config(tmp_path, {**raw("llama-3-8b"), "model_type": "gpt2"})
    with pytest.raises(ConfigError) as err:
        load_config(f"model=hf:{path}")
    message = str(err.value)
    assert str(path) in message and "'gpt2'" in message
    assert all(kind in message for kind in SUPPORTED)


def test_missing_model_type(tmp_path):
    data = raw("llama-3-8b")
    del data["model_type"]
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError, match="'model_type' is missing") as err:
        load_config(f"model=hf:{path}")
    assert str(path) in str(err.value) and "qwen3_next" in str(err.value)


@pytest.mark.parametrize("name, key", [("llama-3-8b", "num_hidden_layers"), ("qwen3-next-80b-a3b", "linear_num_value_heads"),
                                       ("deepseek-r1-0528", "kv_lora_rank"), ("gpt-oss-120b", "sliding_window"),
                                       ("deepseek-v4-flash", "compress_ratios"), ("deepseek-v4-pro", "o_lora_rank")])  # fmt: skip
def test_missing_key_names_file_and_key(tmp_path, name, key):
    data = raw(name)
    del data[key]
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_config(f"model=hf:{path.parent}")
    assert str(path) in str(err.value) and f"'{key}'" in str(err.value) and "missing" in str(err.value)


def test_null_key_names_file_and_key(tmp_path):
    path = write_config(tmp_path, {**raw("llama-3-8b"), "hidden_size": None})
    with pytest.raises(ConfigError, match=r"key 'hidden_size' is null"):
        load_config(f"model=hf:{path}")


def test_missing_nested_key_names_its_path(tmp_path):
    data = raw("gemma-3-27b-it")
    del data["text_config"]["num_key_value_heads"]
    del data["text_config"]["num_attention_heads"]
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError, match=r"key 'text_config\.num_attention_heads' is missing"):
        load_config(f"model=hf:{path}")


def test_wrong_value_type_names_the_key(tmp_path):
    path = write_config(tmp_path, {**raw("llama-3-8b"), "num_key_value_heads": "8"})
    with pytest.raises(ConfigError, match=r"'num_key_value_heads' must be an integer"):
        load_config(f"model=hf:{path}")


def test_not_a_file(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(ConfigError, match="neither a file nor a directory") as err:
        load_config(f"model=hf:{missing}")
    assert str(missing) in str(err.value)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json") as err:
        load_config(f"model=hf:{tmp_path}")
    assert str(tmp_path) in str(err.value)


def test_empty_path():
    with pytest.raises(ConfigError, match="names no checkpoint"):
        load_config("model=hf:")


def test_invalid_json_names_the_file_and_line(tmp_path):
    path = write_config(tmp_path, '{\n  "model_type": "llama",\n  "hidden_size": 4096,,\n}')
    with pytest.raises(ConfigError, match=r"is not valid JSON \(line 3") as err:
        load_config(f"model=hf:{path}")
    assert str(path) in str(err.value)


def test_json_that_is_not_an_object(tmp_path):
    with pytest.raises(ConfigError, match="JSON object at top level"):
        load_config(f"model=hf:{write_config(tmp_path, '[1, 2]')}")


def test_layer_types_without_a_period_are_refused(tmp_path):
    data = raw("gpt-oss-120b")
    data["layer_types"][0] = "full_attention"
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError, match=r"'layer_types' does not repeat one pattern") as err:
        load_config(f"model=hf:{path}")
    assert str(path) in str(err.value)


def test_qwen_sliding_window_layers_are_refused(tmp_path):
    path = write_config(tmp_path, {**raw("qwen2.5-7b-instruct"), "use_sliding_window": True})
    with pytest.raises(ConfigError, match=r"'use_sliding_window' is true"):
        load_config(f"model=hf:{path}")


def test_unknown_quantization_needs_the_index(tmp_path):
    data = {**raw("llama-3-8b"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError, match=r"'quantization_config.quant_method'='awq'.*model.safetensors.index.json"):
        load_config(f"model=hf:{path}")
    (path.parent / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 5_000_000_000}}))
    assert load_config(f"model=hf:{path}").model.num_parameters == 2_500_000_000


def test_other_groups_are_unaffected():
    assert load_config("model=llama-3-8b", "hardware=h200").model.name == "llama-3-8b"


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_plan(capsys):
    rc = main(["plan", f"model=hf:{DATA / 'llama-3-8b'}", "hardware=h200"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "llama-3-8b (LlamaForCausalLM)" in out
    shipped = plan_memory(load_config("model=llama-3-8b", "hardware=h200"))
    assert f"max_total_num_tokens = {shipped.max_total_num_tokens}" in out


def test_cli_reports_a_bad_checkpoint(tmp_path, capsys):
    path = write_config(tmp_path, {**raw("llama-3-8b"), "model_type": "gpt2"})
    assert main(["plan", f"model=hf:{path}"]) == 2
    assert "not supported" in capsys.readouterr().err


def test_a_config_written_by_save_pretrained_plans_with_its_model_type_and_the_default_dtype(tmp_path, caplog):
    """A bare config's ``save_pretrained`` writes ``architectures: [None]`` (or none) and no dtype: the model class
    comes from ``model_type`` and the dtype is transformers' default, each said once."""
    import logging

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048)  # fmt: skip
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert not (written.get("architectures") or [None])[0] and written.get("dtype") is None
    with caplog.at_level(logging.WARNING, logger="kvcore.config.hf"):
        cfg = load_config(f"model=hf:{tmp_path}")
        load_config(f"model=hf:{tmp_path}")
    assert cfg.model.architecture == "LlamaForCausalLM" and cfg.model.dtype == "float32"
    said = [r.getMessage() for r in caplog.records]
    assert sum("names no model class" in m and "model_type 'llama'" in m for m in said) == 1
    assert sum("gives no dtype" in m and "float32" in m for m in said) == 1
    assert plan_memory(cfg).bytes_per_token == 4 * 2 * 2 * 32 * 4  # layers x (K, V) x KV heads x head dim x fp32


# -- Kimi-Linear (no verbatim config.json is stored: its keys as public conversion code reproduces them) ------------

KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 72, "intermediate_size": 9216, "model_max_length": 1048576,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 1024, "first_k_dense_replace": 1, "moe_layer_freq": 1, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                           "short_conv_kernel_size": 4},
}  # fmt: skip


def test_kimi_linear_config_gives_the_shipped_yaml(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LINEAR))
    ours = load_config(f"model=hf:{tmp_path}", "hardware=h200")
    shipped = load_config("model=kimi-linear-48b", "hardware=h200")
    assert {k: getattr(ours.model, k) for k in DIMENSIONS} == {k: getattr(shipped.model, k) for k in DIMENSIONS}
    assert ours.model.v_head_dim == shipped.model.v_head_dim == 128
    assert {s: getattr(ours.model, s) for s in SECTIONS} == {s: getattr(shipped.model, s) for s in SECTIONS}
    assert ours.model.num_parameters == shipped.model.num_parameters
    assert plan_summary(plan_memory(ours)) == plan_summary(plan_memory(shipped))


def test_kimi_linear_full_layers_out_of_range_name_the_key(tmp_path):
    bad = dict(KIMI_LINEAR, linear_attn_config=dict(KIMI_LINEAR["linear_attn_config"], full_attn_layers=[0, 28]))
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="linear_attn_config.full_attn_layers"):
        load_config(f"model=hf:{tmp_path}")


# -- DeepSeek-V4 (the dsv4 plugin's model.deepseek_v4) ---------------------------------------------------------

DSV4 = ("deepseek-v4-flash", "deepseek-v4-pro")
#: the released checkpoints' tensor lists (public model reports of local snapshots, SOURCES.md): elements of every
#: tensor (fp4 expert weights stored two a byte, block scales, the MTP layer included) and the bytes, in GiB rounded
#: to two places as the reports print them
DSV4_CHECKPOINTS = {"deepseek-v4-flash": (158069433298, 148.65), "deepseek-v4-pro": (861608274846, 805.32)}
#: bytes of an element of each stored dtype
ITEMSIZE = {"bf16": 2, "f32": 4, "fp8": 1, "e8m0": 1, "i8": 1, "i64": 8}


def dsv4_tensors(c: dict):
    """``(name, shape, dtype)`` of each tensor of a DeepSeek-V4 checkpoint, as the published tensor lists show them
    (DeepSeek's reference inference/model.py: an fp8 projection with 128 x 128 ue8m0 block scales, an fp4 expert
    projection stored ``[out, in / 2]`` with a ue8m0 scale per 32 inputs)."""
    d, heads, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    q_rank, groups, o_rank = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    experts, inter, hc, vocab = c["n_routed_experts"], c["moe_intermediate_size"], c["hc_mult"], c["vocab_size"]
    ih, idim, layers, mix = c["index_n_heads"], c["index_head_dim"], c["num_hidden_layers"], (2 + c["hc_mult"]) * c["hc_mult"]

    def fp8(name, out, inp):
        yield name, (out, inp), "fp8"
        yield name + ".scale", (-(-out // 128), -(-inp // 128)), "e8m0"

    def block(p, layer):
        ratio = c["compress_ratios"][layer]
        yield p + "attn.attn_sink", (heads,), "f32"
        yield from fp8(p + "attn.wq_a", q_rank, d)
        yield from fp8(p + "attn.wq_b", heads * hd, q_rank)
        yield from fp8(p + "attn.wkv", hd, d)
        yield from fp8(p + "attn.wo_a", groups * o_rank, heads * hd // groups)
        yield from fp8(p + "attn.wo_b", d, groups * o_rank)
        for name, n in (("attn.q_norm", q_rank), ("attn.kv_norm", hd), ("attn_norm", d), ("ffn_norm", d)):
            yield p + name, (n,), "bf16"
        if ratio:
            width = hd * (2 if ratio == 4 else 1)
            yield p + "attn.compressor.ape", (ratio, width), "f32"
            yield p + "attn.compressor.wkv", (width, d), "bf16"
            yield p + "attn.compressor.wgate", (width, d), "bf16"
            yield p + "attn.compressor.norm", (hd,), "bf16"
        if ratio == 4:
            yield from fp8(p + "attn.indexer.wq_b", ih * idim, q_rank)
            yield p + "attn.indexer.weights_proj", (ih, d), "bf16"
            yield p + "attn.indexer.compressor.ape", (4, 2 * idim), "f32"
            yield p + "attn.indexer.compressor.wkv", (2 * idim, d), "bf16"
            yield p + "attn.indexer.compressor.wgate", (2 * idim, d), "bf16"
            yield p + "attn.indexer.compressor.norm", (idim,), "bf16"
        yield p + "ffn.gate.weight", (experts, d), "bf16"
        if layer < c["num_hash_layers"]:
            yield p + "ffn.gate.tid2eid", (vocab, c["num_experts_per_tok"]), "i64"
        else:
            yield p + "ffn.gate.bias", (experts,), "f32"
        for w, (out, inp) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            for e in range(experts):
                yield f"{p}ffn.experts.{e}.{w}", (out, inp // 2), "i8"
                yield f"{p}ffn.experts.{e}.{w}.scale", (out, inp // 32), "e8m0"
            yield from fp8(f"{p}ffn.shared_experts.{w}", out, inp)
        for site in ("attn", "ffn"):
            yield f"{p}hc_{site}_fn", (mix, hc * d), "f32"
            yield f"{p}hc_{site}_base", (mix,), "f32"
            yield f"{p}hc_{site}_scale", (3,), "f32"

    def head(p):
        yield p + "hc_head_fn", (hc, hc * d), "f32"
        yield p + "hc_head_base", (hc,), "f32"
        yield p + "hc_head_scale", (1,), "f32"

    yield "embed.weight", (vocab, d), "bf16"
    yield "head.weight", (vocab, d), "bf16"
    yield "norm.weight", (d,), "bf16"
    yield from head("")
    for layer in range(layers):
        yield from block(f"layers.{layer}.", layer)
    for m in range(c["num_nextn_predict_layers"]):
        p = f"mtp.{m}."
        yield from block(p, layers + m)
        yield from fp8(p + "e_proj", d, d)
        yield from fp8(p + "h_proj", d, d)
        for name in ("enorm", "hnorm", "norm"):
            yield p + name, (d,), "bf16"
        yield from head(p)


def numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("name", DSV4)
def test_deepseek_v4_spec_is_the_config_json(name):
    """Dimensions and the model.deepseek_v4 section as config.json gives them (no plugin needed to build the spec);
    compress_ratios is kept whole, its entries past the layers being the MTP layers'."""
    c, spec = raw(name), hf_model_config(f"hf:{DATA / name}")
    assert c["architectures"] == [spec["architecture"]] == ["DeepseekV4ForCausalLM"]
    assert spec["attention"] == "deepseek_v4"
    assert [spec[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")] == \
        [c[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")]
    assert (spec["num_key_value_heads"], spec["head_dim"]) == (1, 512)
    assert spec["context_length"] == c["max_position_embeddings"]
    assert (spec["dtype"], spec["weight_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert spec["num_nextn_predict_layers"] == c["num_nextn_predict_layers"] == 1
    assert "v_head_dim" not in spec
    assert len(c["compress_ratios"]) == c["num_hidden_layers"] + c["num_nextn_predict_layers"]
    assert spec["deepseek_v4"] == {"compress_ratios": c["compress_ratios"], "sliding_window": c["sliding_window"],
                                   "qk_nope_head_dim": c["head_dim"] - c["qk_rope_head_dim"],
                                   "qk_rope_head_dim": c["qk_rope_head_dim"], "index_head_dim": c["index_head_dim"]}  # fmt: skip
    assert (spec["deepseek_v4"]["qk_nope_head_dim"], spec["deepseek_v4"]["qk_rope_head_dim"]) == (448, 64)


@pytest.mark.parametrize("name", DSV4)
def test_deepseek_v4_count_is_the_released_tensor_list(name):
    """The tensors built here from config.json are the released checkpoint's: their elements are the published
    total exactly and their bytes its size.  The converter counts the main model (no MTP layer, no block scales, no
    hash tables; fp4 weights one parameter each) and charges its bytes as stored."""
    c = raw(name)
    tensors = list(dsv4_tensors(c))
    elements, gib = DSV4_CHECKPOINTS[name]
    assert sum(numel(shape) for _, shape, _ in tensors) == elements
    assert round(sum(numel(shape) * ITEMSIZE[dtype] for _, shape, dtype in tensors) / 2**30, 2) == gib
    main_model = [t for t in tensors if not t[0].startswith("mtp.")]
    parameters = sum(numel(shape) * (2 if dtype == "i8" else 1) for n, shape, dtype in main_model
                     if dtype not in ("e8m0", "i64"))  # fmt: skip
    spec = hf_model_config(f"hf:{DATA / name}")
    assert spec["num_parameters"] == parameters
    assert spec["weight_bytes"] == sum(numel(shape) * ITEMSIZE[dtype] for _, shape, dtype in main_model)
    # DeepSeek's published totals count the main model: 284B (Flash), 1.6T (Pro)
    published = {"deepseek-v4-flash": 284e9, "deepseek-v4-pro": 1.6e12}[name]
    assert abs(parameters - published) < 0.02 * published


def test_deepseek_v4_experts_are_fp4_in_the_release_files_too(tmp_path):
    """The Pro file and Flash's first revision name no expert_dtype, yet their checkpoints ship fp4 experts (the
    published tensor lists): an fp8 file without the key is sized as one with ``expert_dtype: fp4``.  A bf16 file
    without it stores its experts as its other projections, at two bytes a weight."""
    data = raw("deepseek-v4-flash")
    flash = hf_model_config(f"hf:{DATA / 'deepseek-v4-flash'}")
    first_revision = {k: v for k, v in data.items() if k != "expert_dtype"}
    assert hf_model_config(f"hf:{write_config(tmp_path, first_revision)}") == {**flash, "name": "ckpt"}
    bf16 = {k: v for k, v in first_revision.items() if k != "quantization_config"}
    spec = hf_model_config(f"hf:{write_config(tmp_path, bf16)}")
    assert spec["num_parameters"] == flash["num_parameters"] and "weight_dtype" not in spec
    routed = data["num_hidden_layers"] * data["n_routed_experts"] * 3 * data["hidden_size"] * data["moe_intermediate_size"]
    assert spec["weight_bytes"] > 2 * routed  # bf16 experts
    assert routed > flash["weight_bytes"] > routed // 2 + routed // 32  # fp4 experts: packed values and ue8m0 scales


def test_deepseek_v4_unknown_expert_dtype_names_the_key(tmp_path):
    path = write_config(tmp_path, {**raw("deepseek-v4-flash"), "expert_dtype": "int2"})
    with pytest.raises(ConfigError, match=r"'expert_dtype'='int2'"):
        hf_model_config(f"hf:{path}")


def test_deepseek_v4_short_compress_ratios_name_the_key(tmp_path):
    data = raw("deepseek-v4-flash")
    path = write_config(tmp_path, {**data, "compress_ratios": data["compress_ratios"][:10]})
    with pytest.raises(ConfigError, match=r"'compress_ratios' must list .* each of the 43 layers"):
        hf_model_config(f"hf:{path}")


@needs_dsv4
def test_cli_plans_deepseek_v4_flash_from_its_config_json(capsys, monkeypatch):
    """`kvcore plan model=hf:tests/data/hf/deepseek-v4-flash` with the cache and layout DeepSeek-V4 needs (what the
    shipped deepseek-v4-flash.yaml sets) plans the dsv4 pool, as the shipped file does."""
    monkeypatch.chdir(REPO)
    layout = yaml_layout("deepseek-v4-flash")
    rc = main(["plan", "model=hf:tests/data/hf/deepseek-v4-flash", "hardware=h200", *layout])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "deepseek-v4-flash (DeepseekV4ForCausalLM)" in out and "dsv4" in out
    shipped = plan_memory(load_config("model=deepseek-v4-flash", "hardware=h200"))
    assert shipped.backend == "dsv4"
    assert f"max_total_num_tokens = {shipped.max_total_num_tokens}" in out


@needs_dsv4
def test_the_tiny_deepseek_v4_has_the_released_latent_and_cache_layout():
    """The synthetic tiny-deepseek-v4 keeps what the dsv4 pool fixes (the 448 + 64 latent, 128-wide index keys, fp8
    pages of 256 tokens, every compression ratio) and states its count's formula."""
    tiny, flash = load_config("model=tiny-deepseek-v4", "hardware=cpu"), load_config("model=deepseek-v4-flash")
    t, f = tiny.model.deepseek_v4, flash.model.deepseek_v4
    assert (t.qk_nope_head_dim, t.qk_rope_head_dim, t.index_head_dim) == (f.qk_nope_head_dim, f.qk_rope_head_dim, f.index_head_dim)
    assert set(t.compress_ratios) == {0, 4, 128} and len(t.compress_ratios) == tiny.model.num_hidden_layers
    assert (tiny.kv_cache.page_size, tiny.kv_cache.dtype) == (flash.kv_cache.page_size, flash.kv_cache.dtype) == (256, "float8_e4m3fn")
    m = tiny.model
    h, latent, layers = m.hidden_size, m.head_dim, m.num_hidden_layers
    attention = h * m.num_attention_heads * latent + h * latent + m.num_attention_heads * latent * h
    assert m.num_parameters == layers * (attention + 3 * h * 512 + 2 * h) + 2 * 32000 * h + h


# -- MiniMax-M3 (the minimax_sparse plugin's model.minimax_sparse) ---------------------------------------------

#: the released MiniMax-M3 checkpoint's tensor list sums to this (SOURCES.md): language model and vision parts
MINIMAX_M3_PARAMETERS = 427040140160


def minimax_vision_parameters(c: dict) -> int:
    """The checkpoint's parameters outside the language model, as its tensor list shows them: the CLIP-style vision
    tower (a 3-D patch embedding over temporal_patch_size frames, no biases there, pre-LayerNorm, biased attention
    and MLP), the two-layer projector and the patch-merge MLP over spatial_merge_size^2 patches."""
    v, text = c["vision_config"], c["text_config"]["hidden_size"]
    vh, vi, merge = v["hidden_size"], v["intermediate_size"], v["img_token_compression_config"]
    patch = vh * v["num_channels"] * merge["temporal_patch_size"] * v["patch_size"] ** 2
    layer = 4 * vh + 2 * vi * vh + vi + vh + 4 * (vh * vh + vh)  # two LayerNorms, fc1, fc2, q/k/v/out
    tower = patch + 2 * vh + v["num_hidden_layers"] * layer
    projector = vh * text + text + text * text + text
    patch_merge = merge["spatial_merge_size"] ** 2 * text * text + text + text * text + text
    return tower + projector + patch_merge


def test_minimax_m3_spec_is_the_text_config():
    c = raw("minimax-m3")
    t, sparse = c["text_config"], c["text_config"]["sparse_attention_config"]
    spec = hf_model_config(f"hf:{DATA / 'minimax-m3'}")
    assert spec["attention"] == "minimax_sparse" and sparse["use_sparse_attention"]
    assert spec["architecture"] == c["architectures"][0]
    assert [spec[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")] == \
        [t[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")]
    assert (spec["context_length"], spec["dtype"]) == (t["max_position_embeddings"], c["torch_dtype"])
    assert spec["num_nextn_predict_layers"] == t["num_nextn_predict_layers"]
    assert spec["minimax_sparse"] == {"index_head_dim": sparse["sparse_index_dim"],
                                      "sparse_attention_freq": sparse["sparse_attention_freq"],
                                      "disable_index_value": sparse["sparse_disable_index_value"]}  # fmt: skip
    assert "weight_dtype" not in spec and "weight_bytes" not in spec


def test_minimax_m3_count_is_the_released_tensor_list_less_the_vision_parts():
    c = raw("minimax-m3")
    t = c["text_config"]
    assert hf_model_config(f"hf:{DATA / 'minimax-m3'}")["num_parameters"] == MINIMAX_M3_PARAMETERS - minimax_vision_parameters(c)
    # and computed here from the language model's shapes, as the tensor list shows them
    h, d, layers, sparse = t["hidden_size"], t["head_dim"], t["num_hidden_layers"], t["sparse_attention_config"]
    attention = 2 * h * t["num_attention_heads"] * d + 2 * h * t["num_key_value_heads"] * d + 2 * d  # q, o, k, v, q/k norms
    moe = t["num_local_experts"] * (3 * h * t["intermediate_size"] + h + 1) + 3 * h * t["shared_intermediate_size"]
    dense = 3 * h * t["dense_intermediate_size"]
    indexer = h * sparse["sparse_num_index_heads"] * sparse["sparse_index_dim"] + h * sparse["sparse_index_dim"] + 2 * sparse["sparse_index_dim"]
    language = 2 * t["vocab_size"] * h + h + sum(
        attention + 2 * h + (moe if t["moe_layer_freq"][i] else dense) + (indexer if sparse["sparse_attention_freq"][i] else 0)
        for i in range(layers)
    )
    assert language + minimax_vision_parameters(c) == MINIMAX_M3_PARAMETERS


def test_minimax_m3_text_only_config_and_dense_attention(tmp_path):
    """A text-only config (``minimax_m3``, the language model's keys at the top) gives the same language model; with
    use_sparse_attention false every layer is dense attention, a plain mha pool, without the indexers' weights."""
    c = raw("minimax-m3")
    vl = hf_model_config(f"hf:{DATA / 'minimax-m3'}")
    text = {**c["text_config"], "model_type": "minimax_m3", "torch_dtype": "bfloat16"}
    spec = hf_model_config(f"hf:{write_config(tmp_path, text)}")
    assert {**spec, "name": vl["name"], "architecture": vl["architecture"]} == vl
    assert spec["architecture"] == "MiniMaxM3SparseForCausalLM"
    sparse = c["text_config"]["sparse_attention_config"]
    dense_config = {**text, "sparse_attention_config": {**sparse, "use_sparse_attention": False}}
    dense = hf_model_config(f"hf:{write_config(tmp_path, dense_config)}")
    assert dense["attention"] == "mha" and "minimax_sparse" not in dense
    indexers = sum(sparse["sparse_attention_freq"]) * (text["hidden_size"] * sparse["sparse_index_dim"] * (sparse["sparse_num_index_heads"] + 1)
                                                      + 2 * sparse["sparse_index_dim"])  # fmt: skip
    assert vl["num_parameters"] - dense["num_parameters"] == indexers


def test_minimax_m3_missing_nested_key_names_its_path(tmp_path):
    data = raw("minimax-m3")
    del data["text_config"]["sparse_attention_config"]["sparse_index_dim"]
    with pytest.raises(ConfigError, match=r"key 'text_config\.sparse_attention_config\.sparse_index_dim' is missing"):
        hf_model_config(f"hf:{write_config(tmp_path, data)}")


def test_cli_plans_minimax_m3_from_its_config_json(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc = main(["plan", "model=hf:tests/data/hf/minimax-m3", "hardware=h200", *yaml_layout("minimax-m3")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "minimax-m3 (MiniMaxM3SparseForConditionalGeneration)" in out and "minimax_sparse" in out
    shipped = plan_memory(load_config("model=minimax-m3", "hardware=h200"))
    assert f"max_total_num_tokens = {shipped.max_total_num_tokens}" in out
