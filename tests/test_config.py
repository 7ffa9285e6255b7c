"""Config loading: defaults, group choice, dotlist overrides, engine files and group files, error messages
that name the full key path, cross-field checks, derived per-rank quantities, and the shipped model YAMLs
against the real Hugging Face ``config.json`` values.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from kvcore import ConfigError
from kvcore import load_config
from kvcore.config import EngineConfig

TINY_MODEL = """\
name: tiny
architecture: TinyForCausalLM
attention: mha
num_hidden_layers: 6
num_attention_heads: 4
num_key_value_heads: 2
head_dim: 16
hidden_size: 64
context_length: 512
num_parameters: 123456
dtype: float16
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# -- defaults, group choice, overrides --------------------------------------------------------------------


def test_defaults_are_qwen_small_on_cpu():
    cfg = load_config()
    assert isinstance(cfg, EngineConfig)
    assert cfg.model.name == "qwen2.5-0.5b"
    assert cfg.model.num_hidden_layers == 24
    assert cfg.hardware.name == "cpu"
    assert cfg.hardware.device == "cpu"
    assert cfg.hardware.memory_gib == 2.0
    assert cfg.kv_cache.dtype == "auto"
    assert cfg.kv_cache.page_size == 1
    assert cfg.kv_cache.backend == "auto"
    assert cfg.memory.mem_fraction_static == 0.88
    assert cfg.memory.max_total_tokens is None
    assert cfg.memory.max_running_requests is None
    assert cfg.memory.budget_gib is None
    assert (cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.pp_rank, cfg.parallel.dp_size) == (1, 1, 0, 1)
    # kv dtype "auto" follows the model dtype
    assert cfg.kv_dtype == torch.bfloat16 == cfg.model_dtype


def test_group_choice_model_and_hardware():
    cfg = load_config("model=llama-3-8b", "hardware=h200")
    assert cfg.model.name == "llama-3-8b"
    assert cfg.model.num_hidden_layers == 32
    assert cfg.hardware.name == "h200"
    assert cfg.hardware.device == "cuda"
    assert cfg.hardware.vendor == "nvidia"
    assert cfg.hardware.memory_gib == pytest.approx(140.401)


def test_later_group_choice_wins():
    cfg = load_config("model=llama-3-8b", "model=qwen2.5-7b")
    assert cfg.model.name == "qwen2.5-7b"


def test_dotlist_overrides():
    cfg = load_config(
        "kv_cache.dtype=float8_e4m3fn", "kv_cache.page_size=16", "memory.max_total_tokens=4096",
        "parallel.tp_size=2",
    )
    assert cfg.kv_cache.dtype == "float8_e4m3fn"
    assert cfg.kv_dtype == torch.float8_e4m3fn
    assert cfg.kv_cache.page_size == 16
    assert cfg.memory.max_total_tokens == 4096
    assert cfg.parallel.tp_size == 2


def test_dotlist_overrides_with_group_choice_tp8():
    cfg = load_config(
        "model=llama-3-8b", "kv_cache.dtype=float8_e4m3fn", "kv_cache.page_size=16",
        "memory.max_total_tokens=4096", "parallel.tp_size=8",
    )
    assert cfg.kv_dtype == torch.float8_e4m3fn
    assert cfg.kv_cache.page_size == 16
    assert cfg.memory.max_total_tokens == 4096
    assert cfg.parallel.tp_size == 8
    assert cfg.kv_heads_per_rank == 1  # 8 kv heads over 8 ranks


def test_dotlist_overrides_win_over_group_file():
    cfg = load_config("model=llama-3-8b", "model.context_length=1024", "hardware.memory_gib=3.5")
    assert cfg.model.context_length == 1024
    assert cfg.hardware.memory_gib == 3.5
    assert cfg.model.num_hidden_layers == 32  # the rest of the group file stays


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        load_config("kv_cache.page_size")


# -- engine files and group files -------------------------------------------------------------------------


def test_engine_file_with_its_own_group_dir(tmp_path):
    write(tmp_path / "model" / "tiny.yaml", TINY_MODEL)
    engine = write(
        tmp_path / "engine.yaml",
        """\
        defaults:
          - model: tiny
          - hardware: cpu
        kv_cache:
          page_size: 4
        memory:
          max_total_tokens: 256
        """,
    )
    cfg = load_config(path=engine)
    assert cfg.model.name == "tiny"
    assert cfg.model.num_hidden_layers == 6
    assert cfg.model_dtype == torch.float16
    assert cfg.hardware.name == "cpu"  # not beside the engine file: from the packaged configs
    assert cfg.kv_cache.page_size == 4
    assert cfg.memory.max_total_tokens == 256
    # string paths work too, and overrides still win over the engine file's own keys
    cfg2 = load_config("kv_cache.page_size=8", path=str(engine))
    assert cfg2.kv_cache.page_size == 8


def test_engine_file_group_dir_shadows_packaged_option(tmp_path):
    write(tmp_path / "hardware" / "cpu.yaml", "name: cpu\ndevice: cpu\nvendor: local\nmemory_gib: 3.25\n")
    engine = write(tmp_path / "engine.yaml", "defaults:\n  - model: qwen2.5-0.5b\n  - hardware: cpu\n")
    cfg = load_config(path=engine)
    assert cfg.hardware.memory_gib == 3.25
    assert cfg.hardware.vendor == "local"


def test_engine_body_wins_over_group_file(tmp_path):
    engine = write(
        tmp_path / "engine.yaml",
        "defaults:\n  - model: llama-3-8b\n  - hardware: cpu\nmodel:\n  context_length: 2048\n",
    )
    cfg = load_config(path=engine)
    assert cfg.model.name == "llama-3-8b"
    assert cfg.model.context_length == 2048


def test_group_option_as_yaml_path(tmp_path):
    custom = write(tmp_path / "elsewhere" / "my-model.yaml", TINY_MODEL)
    cfg = load_config(f"model={custom}")
    assert cfg.model.name == "tiny"
    assert cfg.model.num_key_value_heads == 2


def test_unknown_group_option_lists_valid_options(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("model=llama-4-9000b")
    message = str(info.value)
    assert "llama-4-9000b" in message
    for option in ("llama-3-70b", "llama-3-8b", "qwen2.5-0.5b", "qwen2.5-7b"):
        assert option in message
    with pytest.raises(ConfigError) as info:
        load_config("hardware=b200")
    for option in ("cpu", "h100", "h200"):
        assert option in str(info.value)


def test_unknown_group_option_lists_engine_local_options(tmp_path):
    write(tmp_path / "model" / "tiny.yaml", TINY_MODEL)
    engine = write(tmp_path / "engine.yaml", "defaults:\n  - model: tiny\n")
    with pytest.raises(ConfigError) as info:
        load_config("model=missing", path=engine)
    assert "tiny" in str(info.value)
    assert "qwen2.5-0.5b" in str(info.value)


def test_missing_yaml_path_option_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="hardware="):
        load_config(f"hardware={tmp_path / 'nope.yaml'}")


def test_engine_defaults_name_unknown_group(tmp_path):
    engine = write(tmp_path / "engine.yaml", "defaults:\n  - tokenizer: fast\n")
    with pytest.raises(ConfigError, match="tokenizer"):
        load_config(path=engine)


def test_engine_without_defaults_takes_the_shipped_group_choices(tmp_path):
    engine = write(tmp_path / "engine.yaml", "kv_cache:\n  page_size: 4\n")
    cfg = load_config(path=engine)
    assert (cfg.model.name, cfg.hardware.name, cfg.kv_cache.page_size) == ("qwen2.5-0.5b", "cpu", 4)


def test_model_file_without_name_names_missing_key(tmp_path):
    model = write(tmp_path / "nameless.yaml", "architecture: X\nnum_hidden_layers: 2\n")
    with pytest.raises(ConfigError, match=r"model\.name"):
        load_config(f"model={model}")


# -- error messages name the full key path ------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.bogus=1", "model.bogus"),
        ("kv_cache.bogus=1", "kv_cache.bogus"),
        ("kv_cache.page_size=abc", "kv_cache.page_size"),  # wrong type
        ("memory.budget_gib=lots", "memory.budget_gib"),  # wrong type
        ("hardware.kernels=cuda-graphs", "hardware.kernels"),  # validator
        ("kv_cache.page_size=0", "kv_cache.page_size"),  # validator
        ("parallel.tp_size=-2", "parallel.tp_size"),
        ("memory.max_total_tokens=-5", "memory.max_total_tokens"),
        ("memory.mem_fraction_static=1.5", "memory.mem_fraction_static"),
        ("memory.mem_fraction_static=0", "memory.mem_fraction_static"),
        ("model.num_hidden_layers=0", "model.num_hidden_layers"),
        ("hardware.memory_gib=-1", "hardware.memory_gib"),
        ("hardware.device=tpu", "hardware.device"),
        ("kv_cache.dtype=int8", "kv_cache.dtype"),
        ("model.dtype=bf17", "model.dtype"),
        ("parallel.pp_rank=1", "parallel.pp_rank"),
    ],
)
def test_errors_name_full_key_path(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(override)
    assert key in str(info.value)


def test_unknown_key_in_group_file_names_full_path(tmp_path):
    bad = write(tmp_path / "bad.yaml", TINY_MODEL + "bogus: 3\n")
    with pytest.raises(ConfigError, match=r"model\.bogus"):
        load_config(f"model={bad}")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config("kv_cache.page_size=0")


# -- cross-field checks and derived quantities --------------------------------------------------------------


def test_tp_that_does_not_divide_heads():
    # qwen2.5-0.5b has 14 attention heads
    with pytest.raises(ConfigError) as info:
        load_config("parallel.tp_size=4")
    message = str(info.value)
    assert "parallel.tp_size=4" in message
    assert "14" in message


def test_tp_that_cannot_split_kv_heads(tmp_path):
    # 12 attention heads, 4 kv heads, tp=6: 6 divides 12 but neither divides nor is a multiple of 4
    model = TINY_MODEL.replace("num_attention_heads: 4", "num_attention_heads: 12").replace(
        "num_key_value_heads: 2", "num_key_value_heads: 4"
    )
    path = write(tmp_path / "m.yaml", model)
    with pytest.raises(ConfigError, match=r"model\.num_key_value_heads"):
        load_config(f"model={path}", "parallel.tp_size=6")


@pytest.mark.parametrize(
    "model, tp, expected",
    [
        ("llama-3-8b", 1, 8),
        ("llama-3-8b", 2, 4),
        ("llama-3-8b", 8, 1),
        ("llama-3-8b", 16, 1),  # tp > kv heads: each rank stores one (replicated) head
        ("llama-3-8b", 32, 1),
        ("qwen2.5-7b", 4, 1),
        ("qwen2.5-7b", 2, 2),
        ("qwen2.5-0.5b", 7, None),  # 7 divides 14 heads but cannot split 2 kv heads
        ("qwen2.5-0.5b", 14, 1),
    ],
)
def test_kv_heads_per_rank(model, tp, expected):
    if expected is None:
        with pytest.raises(ConfigError, match="num_key_value_heads"):
            load_config(f"model={model}", f"parallel.tp_size={tp}")
        return
    cfg = load_config(f"model={model}", f"parallel.tp_size={tp}")
    assert cfg.kv_heads_per_rank == expected


def test_pp_layer_range_80_layers_over_3():
    ranges = [load_config("model=llama-3-70b", "parallel.pp_size=3", f"parallel.pp_rank={r}").layer_range
              for r in range(3)]
    assert ranges == [(0, 27), (27, 54), (54, 80)]
    assert [end - start for start, end in ranges] == [27, 27, 26]


@pytest.mark.parametrize("layers, pp", [(80, 3), (32, 5), (24, 24), (28, 1), (7, 4)])
def test_pp_layer_ranges_cover_all_layers_evenly(tmp_path, layers, pp):
    path = write(tmp_path / "m.yaml", TINY_MODEL.replace("num_hidden_layers: 6", f"num_hidden_layers: {layers}"))
    ranges = [load_config(f"model={path}", f"parallel.pp_size={pp}", f"parallel.pp_rank={r}").layer_range
              for r in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    counts = [end - start for start, end in ranges]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the larger stages come first


def test_pp_larger_than_layers_is_rejected(tmp_path):
    path = write(tmp_path / "m.yaml", TINY_MODEL)  # 6 layers
    with pytest.raises(ConfigError, match=r"parallel\.pp_size"):
        load_config(f"model={path}", "parallel.pp_size=7")


def test_weight_bytes_per_rank():
    cfg = load_config("model=llama-3-70b", "parallel.tp_size=8", "parallel.pp_size=3")
    assert cfg.weight_bytes_per_rank == math.ceil(70553706496 * 2 / 24)
    cfg = load_config("model=llama-3-8b", "model.dtype=float32")
    assert cfg.weight_bytes_per_rank == 8030261248 * 4


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("BF16", torch.bfloat16),
        ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16),
        ("float32", torch.float32), ("fp32", torch.float32),
        ("float8_e4m3fn", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2), ("fp8_e5m2", torch.float8_e5m2),
    ],
)
def test_dtype_aliases(name, dtype):
    assert load_config(f"kv_cache.dtype={name}").kv_dtype == dtype
    assert load_config(f"model.dtype={name}").model_dtype == dtype


def test_kv_dtype_auto_follows_model_dtype():
    cfg = load_config("model.dtype=fp16")
    assert cfg.kv_dtype == torch.float16


# -- the shipped model YAMLs are the real models -------------------------------------------------------------

# From each model's Hugging Face config.json (context = max_position_embeddings).
REAL = {
    "llama-3-8b": dict(layers=32, heads=32, kv_heads=8, hidden=4096, context=8192,
                       vocab=128256, intermediate=14336, tied=False, qkv_bias=False),
    "llama-3-70b": dict(layers=80, heads=64, kv_heads=8, hidden=8192, context=8192,
                        vocab=128256, intermediate=28672, tied=False, qkv_bias=False),
    "qwen2.5-7b": dict(layers=28, heads=28, kv_heads=4, hidden=3584, context=32768,
                       vocab=152064, intermediate=18944, tied=False, qkv_bias=True),
    "qwen2.5-0.5b": dict(layers=24, heads=14, kv_heads=2, hidden=896, context=32768,
                         vocab=151936, intermediate=4864, tied=True, qkv_bias=True),
}


def parameter_count(layers, heads, kv_heads, hidden, vocab, intermediate, tied, qkv_bias, **_):
    """Parameters of a Llama/Qwen2 decoder: embeddings (+ untied lm_head), attention, SwiGLU MLP, RMSNorms."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    attention = hidden * hidden + 2 * hidden * kv + hidden * hidden + (hidden + 2 * kv if qkv_bias else 0)
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return embeddings + layers * per_layer + hidden


@pytest.mark.parametrize("name", sorted(REAL))
def test_shipped_model_dims_match_config_json(name):
    real = REAL[name]
    m = load_config(f"model={name}").model
    assert m.name == name
    assert m.attention == "mha"
    assert m.num_hidden_layers == real["layers"]
    assert m.num_attention_heads == real["heads"]
    assert m.num_key_value_heads == real["kv_heads"]
    assert m.hidden_size == real["hidden"]
    assert m.context_length == real["context"]
    assert m.head_dim == real["hidden"] // real["heads"]
    assert m.v_head_dim in (None, m.head_dim)
    assert m.dtype == "bfloat16"
    assert m.num_parameters == parameter_count(**real)


GLOBAL_MODEL = """\
# @package _global_
model:
  name: big
  architecture: X
  num_hidden_layers: 4
  num_attention_heads: 8
  num_key_value_heads: 8
  head_dim: 64
  hidden_size: 512
  context_length: 4096
  num_parameters: 1000000
  weight_dtype: float8_e4m3fn
parallel:
  tp_size: 2
"""


def test_global_package_model_file_sets_parallel_and_overrides_still_win(tmp_path):
    model = write(tmp_path / "big.yaml", GLOBAL_MODEL)
    cfg = load_config(f"model={model}")
    assert cfg.parallel.tp_size == 2
    # fp8 weights: one byte per parameter, split over tp=2
    assert cfg.weight_bytes_per_rank == 1_000_000 // 2
    assert load_config(f"model={model}", "parallel.tp_size=4").parallel.tp_size == 4


def test_plain_model_file_cannot_reach_other_sections(tmp_path):
    model = write(tmp_path / "plain.yaml", GLOBAL_MODEL.replace("# @package _global_\n", ""))
    with pytest.raises(ConfigError, match=r"model\.model"):
        load_config(f"model={model}")


def test_unknown_weight_dtype_names_key():
    with pytest.raises(ConfigError, match=r"model\.weight_dtype"):
        load_config("model.weight_dtype=int3")
