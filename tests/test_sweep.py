"""``kvcore plan --sweep``: one plan per combination of the swept values, a row per plan (or the reason there is
none), and ``--plot`` drawing tokens against the first key."""

from __future__ import annotations

import pytest

import kvcore.plugins
from kvcore import load_config, plan_memory
from kvcore.tools.cli import main
from kvcore.errors import ConfigError
from kvcore.tools.sweep import parse_sweep, run_sweep, table

BASE = ["model=llama-3-8b", "hardware=h200"]


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def test_parse_sweep():
    assert parse_sweep("parallel.tp_size=1,2, 4") == ("parallel.tp_size", ["1", "2", "4"])
    for bad in ("parallel.tp_size", "=1,2", "parallel.tp_size=", "kv_cache.page_size=1,1"):
        with pytest.raises(ConfigError, match="--sweep"):
            parse_sweep(bad)


def test_every_combination_is_the_plan_of_that_config():
    sweeps = [("kv_cache.dtype", ["bfloat16", "float8_e4m3fn"]), ("kv_cache.page_size", ["1", "64"])]
    points = run_sweep(BASE, sweeps)
    assert [p.values for p in points] == [
        (("kv_cache.dtype", d), ("kv_cache.page_size", s)) for d in ("bfloat16", "float8_e4m3fn") for s in ("1", "64")
    ]
    for p in points:
        plan = plan_memory(load_config(*BASE, *(f"{k}={v}" for k, v in p.values)))
        assert (p.tokens, p.requests, p.bytes_per_token, p.backend) == (
            plan.max_total_num_tokens, plan.max_running_requests, plan.bytes_per_token, plan.backend)
    bf16, fp8 = points[0], points[2]
    assert bf16.bytes_per_token == 2 * fp8.bytes_per_token  # fp8 halves the bytes


def test_a_combination_without_a_plan_keeps_its_reason():
    points = run_sweep(["model=llama-3-70b", "hardware=h200"], [("parallel.tp_size", ["1", "8"])])
    assert points[0].tokens is None and "leave no memory for the KV cache" in points[0].error
    assert points[1].tokens > 0 and not points[1].error
    rows = table(points)
    assert rows[1].startswith("1 ") and "leave no memory" in rows[1] and rows[2].split()[1] == str(points[1].tokens)


def test_cli_prints_one_row_per_plan(capsys):
    rc = main(["plan", *BASE, "--sweep", "kv_cache.dtype=bfloat16,float8_e4m3fn,nvfp4", "--sweep", "parallel.tp_size=1,2"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0].startswith("sweep      llama-3-8b on h200: kv_cache.dtype x parallel.tp_size (6 plans")
    assert len(out) == 2 + 6 and out[1].split()[:3] == ["kv_cache.dtype", "parallel.tp_size", "tokens"]


def test_cli_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    target = tmp_path / "capacity.png"
    rc = main(["plan", "model=llama-3-70b", "hardware=h200", "--sweep", "parallel.tp_size=2,4,8",
               "--sweep", "kv_cache.dtype=bfloat16,float8_e4m3fn", "--plot", str(target)])  # fmt: skip
    assert rc == 0 and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and target.stat().st_size > 10_000
    assert f"plot       {target}" in capsys.readouterr().out


def test_cli_refuses_plot_without_sweep_and_a_key_twice(capsys):
    assert main(["plan", *BASE, "--plot", "x.png"]) == 2
    assert "--plot draws a sweep: add --sweep KEY=V1,V2" in capsys.readouterr().err
    assert main(["plan", *BASE, "--sweep", "parallel.tp_size=1,2", "--sweep", "parallel.tp_size=4"]) == 2
    assert "--sweep names a key twice: parallel.tp_size, parallel.tp_size" in capsys.readouterr().err
