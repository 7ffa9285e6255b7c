"""Where a transformers decode step's host time goes, measured inside real steps (issue 31): DynamicCache and kvcore's
``PagedKVCache`` generate in lockstep (``bench_hf_generate.lockstep``: threads on one core taking turns a step each),
and each step is split by clocks on the model's own modules into

* ``update``: the cache's ``update`` calls (every layer), also shown split into ``update-0`` (the first layer's,
  which sets up the step) and ``update-1+`` (the others');
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
real steps, and its own ``update`` what kvcore's Python costs there.  Two more, on request: ``onegrid`` launches one
program instead (the launch's host work without its device work), ``zerogrid`` an empty grid (Triton's launcher
takes the arguments and launches nothing) and ``torchlaunch`` launches the same compiled kernel through torch's static
CUDA launcher (Inductor's ``cuLaunchKernel`` from C++) instead of Triton's.

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

PARTS = ("update", "update0", "update1", "attn", "layers")


class NoLaunch:
    """A kernel launcher whose planned direct launches call a no-op (the first launch of a plan still runs), or, with
    ``grid``, the real launch on that grid instead of the call's."""

    def __init__(self, launcher, grid=None):
        self._real, self._grid = launcher, grid

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __call__(self, *args, **kwargs):
        return self._real(*args, **kwargs)

    def entry(self, full_key):
        entry = self._real.entry(full_key)
        if entry is None:
            return None
        if self._grid is None:
            return _no_op, entry[1]
        real, grid = entry[0], self._grid

        def on_grid(_x, _y, _z, *rest):
            real(*grid, *rest)

        return on_grid, entry[1]


def _no_op(*args):
    pass


class TorchLaunch(NoLaunch):
    """A kernel launcher whose planned direct launches go through torch's static CUDA launcher (Inductor's:
    ``cuLaunchKernel`` from torch's C++, not Triton's launcher and its ``cuLaunchKernelEx``), for ``torchlaunch``."""

    def entry(self, full_key):
        entry = self._real.entry(full_key)
        if entry is None:
            return None
        return static_launch(self._real._compiled[full_key][2]), entry[1]


def static_launch(compiled):
    """``run(grid_x, grid_y, grid_z, stream, *head, *args)`` launching ``compiled`` through torch's static launcher."""
    import operator
    import tempfile

    try:
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    except ImportError:  # (torch before 2.13)
        from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel

    if not hasattr(compiled, "_cubin_path"):
        compiled._cubin_path = None
    kernel = StaticallyLaunchedCudaKernel(compiled)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        kernel.reload_cubin_from_raw(f.name)
    kernel.load_kernel(torch.cuda.current_device())
    src = compiled.src
    names = list(src.fn.arg_names)

    def index(key):
        return names.index(key) if isinstance(key, str) else key[0] if isinstance(key, tuple) else key

    signature = {index(key): ty for key, ty in src.signature.items()}
    constants = {index(key) for key in getattr(src, "constants", {})}
    keep = [i for i in sorted(signature) if signature[i] != "constexpr" and i not in constants]
    pick = operator.itemgetter(*keep)
    scratch = (None,) * (int(kernel.has_global_scratch) + int(kernel.has_profile_scratch))
    tys = kernel.arg_tys + "O" * len(scratch)
    launch, function, warps, shared = kernel.C_impl._launch_kernel, kernel.function, kernel.num_warps, kernel.shared
    compiled._kvcore_static = kernel  # kept: it owns the loaded module

    def run(grid_x, grid_y, grid_z, stream, *rest):
        launch(function, grid_x, grid_y, grid_z, warps, shared, tys, pick(rest[9:]) + scratch, stream)

    return run


class NoLaunchPagedKVCache(PagedKVCache):
    """kvcore's cache whose store-and-gather launches are no-ops once planned (``nolaunch``)."""

    grid = None

    def _wrap(self, launcher):
        return NoLaunch(launcher, self.grid)

    def _gather_for(self, dtype):
        fresh = dtype not in self._gathers
        gather = super()._gather_for(dtype)
        if fresh and gather.use_triton:  # (the CPU's torch path launches nothing)
            gather._store_launch = self._wrap(gather._store_launch)
        return gather


class TorchLaunchPagedKVCache(NoLaunchPagedKVCache):
    """kvcore's cache whose store-and-gather launches, once planned, go through torch's static launcher
    (``torchlaunch``)."""

    def _wrap(self, launcher):
        return TorchLaunch(launcher)


class OneProgram(NoLaunchPagedKVCache):
    """kvcore's cache whose store-and-gather launches, once planned, run one program (``onegrid``): the launch's host
    work, almost none of its device work (its outputs are garbage)."""

    grid = (1, 1, 1)


class NoProgram(NoLaunchPagedKVCache):
    """kvcore's cache whose store-and-gather launches, once planned, go to Triton's launcher with an empty grid
    (``zerogrid``): its argument handling without the driver's launch."""

    grid = (0, 1, 1)


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
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            start = time.perf_counter_ns()
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            took = time.perf_counter_ns() - start
            totals = parts.totals()
            totals["update"] += took
            totals["update0" if layer_idx == 0 else "update1"] += took
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
    parser.add_argument("--caches", default="dynamic,kvcore,nolaunch",
                        help="dynamic, kvcore and optionally nolaunch, onegrid, zerogrid, torchlaunch")
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
             "nolaunch": timed_update(NoLaunchPagedKVCache, parts), "onegrid": timed_update(OneProgram, parts),
             "zerogrid": timed_update(NoProgram, parts), "torchlaunch": timed_update(TorchLaunchPagedKVCache, parts)}
    names = args.caches.split(",")
    report = []
    extra = [name for name in names if name not in ("dynamic", "kvcore")]
    print(f"{'case':<22} {'part':<12} {'dynamic us':>11} {'kvcore us':>10} {'kvcore-dyn':>11}"
          + "".join(f" {name + ' us':>12}" for name in extra))
    for case in args.cases.split(","):
        dtype, batch, prompt, ids, mask = probe_case(model, case, args.device)

        def paged(cls):
            return cls.from_model(model, max_total_tokens=batch * (prompt + args.new + 64), page_size=16, dtype=dtype,
                                  max_batch_size=batch)  # fmt: skip

        makers = {"dynamic": lambda: timed["dynamic"](config=model.config),
                  **{name: (lambda name=name: paged(timed[name])) for name in ("kvcore", "nolaunch", "onegrid",
                                                                               "zerogrid", "torchlaunch")}}  # fmt: skip
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
            shown[name] = {"update": m["update"], "update-0": m["update0"], "update-1+": m["update1"],
                           "attn-rest": m["attn"] - m["update"], "layers-rest": m["layers"] - m["attn"],
                           "outside": m["step"] - m["layers"], "step": m["step"]}
        report.append(row)
        for label in shown["dynamic"]:
            d, k = shown["dynamic"][label], shown["kvcore"][label]
            print(f"{case:<22} {label:<12} {d:11.1f} {k:10.1f} {k - d:+11.1f}"
                  + "".join(f" {shown[name][label]:12.1f}" for name in extra), flush=True)  # fmt: skip
    out = os.path.join(os.environ.get("OUT", "/tmp"), "probe_hf_parts.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"per-case medians in {out}")


if __name__ == "__main__":
    main()
