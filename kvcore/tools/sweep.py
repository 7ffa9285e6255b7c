"""Capacity at a glance: plan one config over the product of several keys' values (``kvcore plan --sweep``).

Each point is a full :func:`kvcore.plan_memory` of the config with that point's overrides (nothing is allocated);
a point no backend serves, or whose plan fails, keeps the reason instead of numbers, so a table shows what
each setting buys and why the others cannot work.  :func:`plot` draws tokens against the first swept key, one
line per combination of the others (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import attrs

from kvcore.errors import ConfigError, KVCoreError
from kvcore.planning.planner import GiB

__all__ = ["SweepPoint", "parse_sweep", "plot", "run_sweep", "table", "title"]

#: the most characters of a failed point's reason a table row shows
ERROR_WIDTH = 160


@attrs.frozen
class SweepPoint:
    """One combination of the swept values and its plan (or why there is none)."""

    values: tuple[tuple[str, str], ...]
    tokens: int | None = None
    requests: int | None = None
    bytes_per_token: int | None = None
    kv_gib: float | None = None
    backend: str = ""
    error: str = ""

    def value(self, key: str) -> str:
        return dict(self.values)[key]


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``"parallel.tp_size=1,2,4"`` -> ``("parallel.tp_size", ["1", "2", "4"])``.

    :raises ConfigError: for anything else, with an example.
    """
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key or not items:
        raise ConfigError(f"--sweep {text!r} must look like KEY=V1,V2,... (e.g. --sweep parallel.tp_size=1,2,4,8)")
    if len(set(items)) != len(items):
        raise ConfigError(f"--sweep {key}: a value is listed twice in {values!r}")
    return key, items


def run_sweep(overrides: Sequence[str], sweeps: Sequence[tuple[str, Sequence[str]]], *, path: str | None = None,
              registry=None) -> list[SweepPoint]:  # fmt: skip
    """Plan ``overrides`` at every combination of ``sweeps`` (the last key varies fastest).

    :raises ConfigError: when a swept key is given twice, or the base config itself is invalid.
    """
    from kvcore.api import plan_memory
    from kvcore.api import load_config

    keys = [key for key, _ in sweeps]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--sweep names a key twice: {', '.join(keys)}")
    load_config(*overrides, path=path, registry=registry)  # the base must be valid on its own
    points = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        values = tuple(zip(keys, combo))
        try:
            cfg = load_config(*overrides, *(f"{k}={v}" for k, v in values), path=path, registry=registry)
            plan = plan_memory(cfg, registry=registry)
        except KVCoreError as exc:
            points.append(SweepPoint(values, error=str(exc).splitlines()[0]))
            continue
        points.append(SweepPoint(values, plan.max_total_num_tokens, plan.max_running_requests, plan.bytes_per_token,
                                 plan.kv_cache_bytes / GiB, plan.backend))  # fmt: skip
    return points


def title(base_model: str, base_hardware: str, sweeps: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A sweep's title: the base config's model and hardware where they are not swept, then the swept keys
    (``llama-3-8b on h200: parallel.tp_size``, ``on h200: model x kv_cache.dtype``)."""
    keys = [key for key, _ in sweeps]
    model = "" if "model" in keys else base_model
    hardware = "" if "hardware" in keys else f"on {base_hardware}"
    where = " ".join(part for part in (model, hardware) if part)
    return f"{where + ': ' if where else ''}{' x '.join(keys)}"


def table(points: Sequence[SweepPoint]) -> list[str]:
    """The points as an aligned text table, one row per point."""
    keys = [k for k, _ in points[0].values]
    width = {k: max(len(k), *(len(p.value(k)) for p in points)) for k in keys}
    head = "  ".join(f"{k:<{width[k]}}" for k in keys)
    lines = [f"{head}  {'tokens':>12} {'requests':>9} {'bytes/token':>12} {'KV GiB':>9}  backend"]
    for p in points:
        cells = "  ".join(f"{p.value(k):<{width[k]}}" for k in keys)
        if p.error:  # the reason, shortened at a word's end
            lines.append(f"{cells}  {'-':>12} {'-':>9} {'-':>12} {'-':>9}  "
                         f"{textwrap.shorten(p.error, ERROR_WIDTH, placeholder=' ...')}")  # fmt: skip
        else:
            lines.append(f"{cells}  {p.tokens:>12} {p.requests:>9} {p.bytes_per_token:>12} {p.kv_gib:>9.2f}  {p.backend}")
    return lines


def plot(points: Sequence[SweepPoint], file: str | Path, title: str) -> Path:
    """Tokens against the first swept key (numeric keys on a numeric axis), one line per combination of the
    other keys; points without a plan are left out (the table says why).

    :raises ConfigError: when matplotlib is not installed, saying how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvcore[plot]' (or pip install matplotlib)") from None
    keys = [k for k, _ in points[0].values]
    x_key, series_keys = keys[0], keys[1:]
    x_values = list(dict.fromkeys(p.value(x_key) for p in points))
    numeric = all(v.replace(".", "", 1).isdigit() for v in x_values)
    position = {v: (float(v) if numeric else i) for i, v in enumerate(x_values)}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    series: dict[tuple[str, ...], list[SweepPoint]] = {}
    for p in points:
        series.setdefault(tuple(p.value(k) for k in series_keys), []).append(p)
    for label, members in series.items():
        if any(not p.error for p in members):  # a point without a plan breaks the line (NaN): none is drawn through it
            ax.plot([position[p.value(x_key)] for p in members], [math.nan if p.error else p.tokens for p in members],
                    marker="o", label=", ".join(f"{k}={v}" for k, v in zip(series_keys, label)) or "tokens")  # fmt: skip
    if numeric:
        ax.set_xscale("log", base=2) if all(float(v) > 0 for v in x_values) else None
        ax.set_xticks([position[v] for v in x_values], x_values)
    else:
        ax.set_xticks(list(position.values()), x_values)
    ax.set_xlabel(x_key)
    ax.set_ylabel("max_total_num_tokens (per rank)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if series_keys:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(file)
    try:
        fig.savefig(out)
    except (OSError, ValueError) as exc:  # a missing folder, no permission, an unknown file type
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"--plot {file}: cannot write the plot there ({reason}); give a file in an existing, "
                          "writable folder, ending in .png, .pdf or .svg") from None
    finally:
        plt.close(fig)
    return out
