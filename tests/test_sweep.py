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


def test_a_sweep_over_models_or_hardware_is_titled_by_what_is_fixed(capsys):
    from kvcore.tools.sweep import title

    assert title("llama-3-8b", "h200", [("parallel.tp_size", ["1"])]) == "llama-3-8b on h200: parallel.tp_size"
    assert title("llama-3-8b", "h200", [("model", ["a"]), ("kv_cache.dtype", ["b"])]) == "on h200: model x kv_cache.dtype"
    assert title("llama-3-8b", "h200", [("model", ["a"]), ("hardware", ["b"])]) == "model x hardware"
    assert main(["plan", "--sweep", "model=llama-3-8b,qwen2.5-0.5b", "--sweep", "hardware=cpu,h200"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("sweep      model x hardware (4 plans")


def test_a_long_reason_is_cut_at_a_word_end():
    from kvcore.tools.sweep import ERROR_WIDTH, SweepPoint

    reason = "word " * 100
    row = table([SweepPoint((("model", "m"),), error=reason.strip())])[1]
    shown = row.split("-", 4)[-1].strip()
    assert shown.endswith(" ...") and len(shown) <= ERROR_WIDTH and shown[: -len(" ...")].split()[-1] == "word"


def test_the_plot_draws_no_line_through_a_point_without_a_plan(tmp_path, monkeypatch):
    """A combination without a plan breaks its series' line: the value drawn there is NaN, not the next point's."""
    import math

    import matplotlib.axes

    from kvcore.tools.sweep import SweepPoint, plot

    drawn = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, **kw: drawn.append((list(x), list(y))) or
                        original(self, x, y, **kw))  # fmt: skip
    points = [SweepPoint((("parallel.tp_size", v),), tokens=t, error="" if t else "no plan")
              for v, t in (("1", 100), ("2", None), ("4", 400))]  # fmt: skip
    plot(points, tmp_path / "p.png", "t")
    (x, y), = drawn
    assert x == [1.0, 2.0, 4.0] and y[0] == 100 and math.isnan(y[1]) and y[2] == 400


def test_a_plot_into_a_missing_folder_is_one_error(tmp_path, capsys):
    target = tmp_path / "no" / "such" / "x.png"
    assert main(["plan", *BASE, "--sweep", "parallel.tp_size=1,2", "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--plot {target}: cannot write the plot there" in err
