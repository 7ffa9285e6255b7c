"""The ``kvcore`` command line: ``plan``, ``plugins`` (with ``--explain``), ``up``, error exit codes, and
``python -m kvcore.tools.cli`` in a subprocess.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvcore.plugins
from kvcore.tools.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GIB = 2**30
SELF_CHECKS = ("alloc", "write/read", "move", "cpu offload", "padding", "free")


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    """The CLI uses the process-wide registry: load it fresh from the installed plugins, no KVCORE_* switches."""
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def raw(group: str, name: str) -> dict:
    return yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())


def expected_tokens(model: str, hardware: str, tp: int) -> int:
    m, hw = raw("model", model), raw("hardware", hardware)
    bpt = max(1, m["num_key_value_heads"] // tp) * 2 * (m["hidden_size"] // m["num_attention_heads"]) * 2 \
        * m["num_hidden_layers"]
    pre = int(hw["memory_gib"] * GIB)
    budget = pre - math.ceil(m["num_parameters"] * 2 / tp) - int(pre * (1 - 0.88))
    return (budget - bpt) // bpt


def test_plan_prints_bytes_per_token_and_tokens(capsys):
    rc = main(["plan", "model=llama-3-70b", "hardware=h200", "parallel.tp_size=8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "40960 bytes per token" in out
    tokens = expected_tokens("llama-3-70b", "h200", 8)
    assert f"max_total_num_tokens = {tokens}" in out
    assert "llama-3-70b" in out and "h200" in out
    assert "max_running_requests = 4096" in out
    assert err == ""


def test_plan_default_config(capsys):
    rc = main(["plan"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "qwen2.5-0.5b" in out
    m = raw("model", "qwen2.5-0.5b")
    bpt = m["num_key_value_heads"] * 2 * (m["hidden_size"] // m["num_attention_heads"]) * 2 * m["num_hidden_layers"]
    assert f"{bpt} bytes per token" in out
    assert f"max_total_num_tokens = {expected_tokens('qwen2.5-0.5b', 'cpu', 1)}" in out


def test_plan_with_engine_file(tmp_path, capsys):
    engine = tmp_path / "my-engine.yaml"
    engine.write_text("defaults:\n  - model: llama-3-8b\n  - hardware: h100\nkv_cache:\n  page_size: 64\n")
    rc = main(["plan", str(engine), "memory.max_total_tokens=1000"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "llama-3-8b" in out
    assert "max_total_num_tokens = 960 (page-aligned to 64" in out


def test_plan_prints_warnings(capsys):
    rc = main(["plan", "model=llama-3-8b", "hardware=h100", "memory.max_total_tokens=999999999"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "warning" in out and "memory.max_total_tokens=999999999" in out


def test_plugins_lists_mha(capsys):
    rc = main(["plugins"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "backends:" in out
    assert any(line.split()[:2] == ["mha", "plugin=mha"] for line in out.splitlines())
    assert "plugins loaded:" in out and "mha" in out.split("plugins loaded:")[1]


def test_plugins_respects_block_list(monkeypatch, capsys):
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", "mha")
    rc = main(["plugins"])
    out, _ = capsys.readouterr()
    assert rc == 0
    loaded = next(line for line in out.splitlines() if line.startswith("plugins loaded:"))
    assert "mha" not in loaded.split(":", 1)[1].split(", ")
    assert "plugin skipped: mha" in out


def test_plugins_explain(capsys):
    rc = main(["plugins", "--explain", "model=llama-3-8b"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "explain for model=llama-3-8b hardware=cpu" in out
    assert "selected backend 'mha'" in out


@pytest.mark.parametrize(
    "argv, key",
    [
        (["plan", "kv_cache.page_size=abc"], "kv_cache.page_size"),
        (["plan", "model.bogus=1"], "model.bogus"),
        (["plan", "hardware.kernels=fast"], "hardware.kernels"),
        (["plan", "nonsense"], "key=value"),
        (["plugins", "--explain", "parallel.tp_size=4"], "parallel.tp_size"),
        (["up", "memory.mem_fraction_static=2"], "memory.mem_fraction_static"),
        (["plan", "model=llama-3-70b", "hardware=h100"], "parallel.tp_size"),  # a planning error
    ],
)
def test_bad_override_exits_2(argv, key, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("kvcore: error:")
    assert key in err


def test_unknown_model_lists_models(capsys):
    """One line: the bad option and the group's valid options (not the other group's)."""
    rc = main(["plan", "model=gpt-5"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert "kvcore: error: model='gpt-5'" in err and "valid options:" in err and "llama-3-8b" in err
    assert "h200" not in err


def test_missing_engine_file_exits_2(tmp_path, capsys):
    rc = main(["plan", str(tmp_path / "absent.yaml")])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "absent.yaml" in err


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def _check_up_output(out: str) -> None:
    lines = out.splitlines()
    checks = {}
    for line in lines:
        stripped = line.strip()
        for name in SELF_CHECKS:
            if stripped.startswith(("ok", "FAIL")) and stripped.split(None, 1)[1].startswith(name):
                checks[name] = stripped.split()[0]
    assert set(checks) == set(SELF_CHECKS), out
    assert all(status == "ok" for status in checks.values()), out
    assert "FAIL" not in out
    assert lines[-1].startswith("kvcore up: ready:")


def test_up_small_budget(capsys):
    rc = main(["up", "memory.budget_gib=0.02"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    _check_up_output(out)
    m = raw("model", "qwen2.5-0.5b")
    bpt = m["num_key_value_heads"] * 2 * (m["hidden_size"] // m["num_attention_heads"]) * 2 * m["num_hidden_layers"]
    tokens = (int(0.02 * GIB) - bpt) // bpt
    assert f"ready: {tokens} tokens" in out


def test_up_native_kernels_paged(capsys):
    rc = main(["up", "memory.budget_gib=0.01", "hardware.kernels=native", "kv_cache.page_size=16",
               "memory.max_running_requests=8"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    _check_up_output(out)
    assert "PagedTokenToKVPoolAllocator" in out


def test_module_entry_point_subprocess(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvcore.tools.cli", "plan", "model=llama-3-8b", "hardware=h100"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "llama-3-8b" in result.stdout
    assert "131072 bytes per token" in result.stdout  # 8 kv heads x (128 + 128) x 2 bytes x 32 layers


def test_bench_needs_a_gpu_and_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_tables_line_up():
    from kvcore.tools.timing import TABLES, Row, format_tables

    rows = [
        Row("host", "mha set_kv_buffer bf16", 8, 9.5, 18.4, 6.0),
        Row("host", "mla get_mla_kv_buffer", 8, 12.0, 48.0, 6.0, alloc_us=8.0),
        Row("varied", "mla get_mla_kv_buffer", 8192, 12.0, 96.0, 6.0, alloc_us=8.0),
        Row("engine", "engine step: steady batch of 64", 33, 300.0, 600.0, 250.0),
        Row("graph", "mla get_mla_kv_buffer", 64, 1.73, 6.33, of_ceiling=0.02),
    ]
    lines = format_tables(rows)
    titles = [lines.index(title) for _, title, _ in TABLES]
    head = {table: lines[i + 1] for (table, _, _), i in zip(TABLES, titles)}
    body = {table: lines[i + 2 : i + 2 + sum(r.table == table for r in rows)] for (table, _, _), i in zip(TABLES, titles)}
    write_row, read_row = body["host"]
    assert write_row.split() == ["mha", "set_kv_buffer", "bf16", "8", "9.50", "18.40", "6.00", "0.52", "1.58"]
    assert read_row.split()[-7:] == ["12.00", "48.00", "6.00", "0.25", "2.00", "8.00", "1.50"]
    assert body["varied"][0].split()[-8:] == ["1-8192", "12.00", "96.00", "6.00", "0.12", "2.00", "8.00", "1.50"]
    assert body["engine"][0].split()[-6:] == ["33", "300.00", "600.00", "250.00", "0.50", "1.20"]
    assert body["graph"][0].split()[-4:] == ["1.73", "6.33", "0.27", "0.02"]
    for table in head:
        widest = max(body[table], key=len)
        assert len(head[table]) == len(widest), f"a column head of {table} does not sit over its column"

def test_version(capsys):
    import kvcore

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"kvcore {kvcore.__version__}"


@pytest.mark.parametrize("command", ["up", "plan"])
def test_help_describes_the_command_with_examples_and_what_is_shipped(capsys, command):
    from kvcore.config import available_options

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "examples:" in out and f"kvcore {command} model=llama-3-8b hardware=h200" in out
    assert all(name in out for name in available_options("model")) and "shipped hardware: cpu, h100, h200" in out


def test_help_and_bad_arguments_do_not_import_torch():
    """`kvcore --help` answers without importing torch (the library is imported by the commands that use it)."""
    code = ("import sys\nfrom kvcore.tools.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'kvcore --help imported torch'\n"
            "import kvcore, kvcore.config, kvcore.plugins\nassert 'torch' not in sys.modules, 'import kvcore imported torch'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
