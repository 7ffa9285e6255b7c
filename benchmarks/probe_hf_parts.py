"""Where a transformers decode step's host time goes, measured inside real steps (issue 31): DynamicCache and kvcore's
``PagedKVCache`` generate in lockstep (``bench_hf_generate.lockstep``: threads on one core taking turns a step each),
and each step is split by clocks on the model's own modules into

* ``update``: the cache's ``update`` calls (every layer);
* ``attn-rest``: the attention modules less their ``update`` (projections, rotary, attention, the output projection:
  what reads the keys and values the cache hands back);
* ``layers-rest``: the decoder layers less their attention (norms, MLPs);
* ``outside``: the step less its decoder layers (generate's own work, masks, the head, the logits processors, the
  wait for the device at the step's end).

Every clock runs for both caches alike, so a part that differs between them is where kvcore's step costs more or
less than DynamicCache's.  Per case: each part's median per step, µs, DynamicCache / kvcore / difference.

A third cache, ``nolaunch`` (on by default; ``--caches dynamic,kvcore`` leaves it out), is kvcore's with every
store-and-gather launch replaced by a call of a Python no-op once planned (its outputs are never written: its tokens
are garbage, its times are not): kvcore's ``update`` less its ``update`` is what the kernel launches cost inside
real steps, and its own ``update`` what kvcore's Python costs there.

    python benchmarks/probe_hf_parts.py           # on the GPU; per-step parts also in $OUT/probe_hf_parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf_generate import TurnClock, build_model, lockstep, probe_case  # noqa: E402

from kvcore.integrations.transformers import PagedKVCache  # noqa: E402

PARTS = ("update", "attn", "layers")


class NoLaunch:
    """A kernel launcher whose planned direct launches call a no-op (the first launch of a plan still runs)."""

    def __init__(self, launcher):
        self._real = launcher

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __call__(self, *args, **kwargs):
        return self._real(*args, **kwargs)

    def entry(self, full_key):
        entry = self._real.entry(full_key)
        return None if entry is None else (_no_op, entry[1])


def _no_op(*args):
    pass


class NoLaunchPagedKVCache(PagedKVCache):
    """kvcore's cache whose store-and-gather launches are no-ops once planned (``nolaunch``)."""

    def _gather_for(self, dtype):
        fresh = dtype not in self._gathers
        gather = super()._gather_for(dtype)
        if fresh and gather.use_triton:  # (the CPU's torch path launches nothing)
            gather._store_launch = NoLaunch(gather._store_launch)
        return gather


class Parts:
    """Nanoseconds spent in each clocked part, per thread (each generate runs in its own), summed until
    :meth:`take` hands them over."""

    def __init__(self):
        self.local = threading.local()

    def totals(self) -> dict:
        totals = getattr(self.local, "totals", None)
        if totals is None:
            totals = self.local.totals = dict.fromkeys(PARTS, 0)
        return totals

    def take(self) -> dict:
        totals = self.totals()
        self.local.totals = dict.fromkeys(PARTS, 0)
        return totals

    def clock(self, module: torch.nn.Module, part: str) -> None:
        """Time ``module``'s forward into ``part``."""
        starts = threading.local()

        def pre(*_):
            starts.at = time.perf_counter_ns()

        def post(*_):
            self.totals()[part] += time.perf_counter_ns() - starts.at

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def timed_update(cls, parts: Parts):
    """``cls`` with its ``update`` clocked into ``parts``."""

    class Timed(cls):
        def update(self, *args, **kwargs):
            start = time.perf_counter_ns()
            out = super().update(*args, **kwargs)
            parts.totals()["update"] += time.perf_counter_ns() - start
            return out

    Timed.__name__ = f"Timed{cls.__name__}"
    return Timed


class PartsClock(TurnClock):
    """A lockstep turn clock that also hands over each step's parts."""

    def __init__(self, *args, parts: Parts, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts, self.per_step = parts, []

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)  # the step's end noted; the turn back
        self.per_step.append(self.parts.take())  # this step's parts (noted before the next one starts)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2, help="lockstep runs per case")
    parser.add_argument("--caches", default="dynamic,kvcore,nolaunch", help="dynamic, kvcore and optionally nolaunch")
    parser.add_argument("--cases", default="bfloat16:1:100,bfloat16:8:100,float8_e4m3fn:1:100,float8_e4m3fn:1:4000,"
                        "float8_e4m3fn:8:100,bfloat16:8:4000")
    args = parser.parse_args()
    args.attn = "eager"
    model = build_model(args)
    parts = Parts()
    for layer in model.model.layers:
        parts.clock(layer.self_attn, "attn")
        parts.clock(layer, "layers")
    timed = {"dynamic": timed_update(DynamicCache, parts), "kvcore": timed_update(PagedKVCache, parts),
             "nolaunch": timed_update(NoLaunchPagedKVCache, parts)}  # fmt: skip
    names = args.caches.split(",")
    report = []
    print(f"{'case':<22} {'part':<12} {'dynamic us':>11} {'kvcore us':>10} {'kvcore-dyn':>11}"
          + (f" {'nolaunch us':>12}" if "nolaunch" in names else ""))
    for case in args.cases.split(","):
        dtype, batch, prompt, ids, mask = probe_case(model, case, args.device)

        def paged(cls):
            return cls.from_model(model, max_total_tokens=batch * (prompt + args.new + 64), page_size=16, dtype=dtype,
                                  max_batch_size=batch)  # fmt: skip

        makers = {"dynamic": lambda: timed["dynamic"](config=model.config),
                  "kvcore": lambda: paged(timed["kvcore"]), "nolaunch": lambda: paged(timed["nolaunch"])}  # fmt: skip
        makers = {name: makers[name] for name in names}
        steps = {name: [] for name in makers}
        for run in range(args.runs + 1):  # the first run warms up
            clocks = {}

            def make_clock(turns, who, tokens, device, _clocks=clocks, _names=list(makers)):
                clock = _clocks[_names[who]] = PartsClock(turns, who, tokens, device, parts=parts)
                return clock

            times = lockstep(model, {name: make() for name, make in makers.items()}, ids, mask, args.new, args.device,
                             clock_cls=make_clock)  # fmt: skip
            if not run:
                continue
            for name, clock in clocks.items():
                # clock.steps()[i] ran from resumed[i] to stamps[i + 1]: its parts are those taken at stamps[i + 1]
                for seconds, part in zip(times[name], clock.per_step[1:]):
                    steps[name].append({"step": seconds * 1e9, **part})
        row = {"case": case}
        shown = {}  # per cache, the parts as printed: each clocked part less the one inside it
        for name in makers:
            m = row[name] = {key: statistics.median(s[key] for s in steps[name]) / 1e3 for key in ("step", *PARTS)}
            shown[name] = {"update": m["update"], "attn-rest": m["attn"] - m["update"],
                           "layers-rest": m["layers"] - m["attn"], "outside": m["step"] - m["layers"], "step": m["step"]}
        report.append(row)
        for label in shown["dynamic"]:
            d, k = shown["dynamic"][label], shown["kvcore"][label]
            print(f"{case:<22} {label:<12} {d:11.1f} {k:10.1f} {k - d:+11.1f}"
                  + (f" {shown['nolaunch'][label]:12.1f}" if "nolaunch" in names else ""), flush=True)  # fmt: skip
    out = os.path.join(os.environ.get("OUT", "/tmp"), "probe_hf_parts.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"per-case medians in {out}")


if __name__ == "__main__":
    main()
