"""A decode step's parts on the CPU, kvcore against DynamicCache (issue 31): ``probe_hf_parts.py``'s split of a
lockstep step (the cache's ``update``, the attention modules less it, the decoder layers less attention, the rest)
without a GPU, plus the attention less its update per layer.

kvcore's cache runs its Triton path (the interpreter) with every store-and-gather launch a no-op call once planned, as
the direct launch is on a GPU (``nolaunch``; its outputs are filled with random values when made, so the attention
after it reads numbers, not uninitialized memory). What is timed is the host's work of both caches and of the model
around them, on one core: a Llama of 8 layers, hidden 256, bf16, eager, batch 1, prompt 100, 128 new tokens, the
caches' generates taking turns a step each (``bench_hf_generate.lockstep``), the first run a warm-up. Medians per
step, µs.

Caches: ``dynamic``, ``dynamic_b`` (DynamicCache again: the control), ``nolaunch`` (kvcore's ``PagedKVCache``),
``noresident`` (with ``resident_rows``), ``dynshadow0`` (DynamicCache whose first layer also runs kvcore's first-layer
update on a second cache: what that work costs the attention after it). ``--mode`` changes ``nolaunch`` and
``noresident``: ``clone`` hands attention clones of the cache's outputs (fresh tensors, as ``torch.cat``'s are);
``alldyn`` makes them a DynamicCache behind kvcore's object (nothing of kvcore's runs).

    python benchmarks/probe_cpu_parts.py [--caches dynamic,dynamic_b,nolaunch] [--mode clone] [--runs 6]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # (a plan's first launch runs through the interpreter)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import probe_hf_parts as parts_probe  # noqa: E402
from bench_hf_generate import lockstep  # noqa: E402

LAYERS, PROMPT = 8, 100
parts_probe.PARTS = (*parts_probe.PARTS, *(f"attn{i}" for i in range(LAYERS)), *(f"update{i}." for i in range(LAYERS)))


class CpuNoLaunch(parts_probe.NoLaunch):
    """A launcher whose plans launch directly, as on a GPU, into a no-op once the first launch ran."""

    direct = True
    _stream = staticmethod(lambda index: 0)

    def entry(self, full_key):
        return parts_probe._no_op, ("HEAD",)


class RandomOutputs:
    """A head gather's template whose ``new_empty`` gives random values (launches that never write them would leave
    attention reading uninitialized memory: NaN or denormal numbers slow the CPU's matmuls)."""

    def __init__(self, template: torch.Tensor):
        self.device, self.dtype = template.device, template.dtype

    def new_empty(self, shape):
        return (torch.randn(shape) * 0.5).to(self.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", default="dynamic,dynamic_b,nolaunch")
    parser.add_argument("--mode", default="", choices=("", "clone", "alldyn"))
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    parts = parts_probe.Parts()
    for i, layer in enumerate(model.model.layers):
        parts.clock(layer.self_attn, "attn")
        parts.clock(layer, "layers")
        parts.clock(layer.self_attn, f"attn{i}")
    ids = torch.randint(1, 512, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    mode = args.mode

    class Kvcore(parts_probe.NoLaunchPagedKVCache):
        shadow = None

        def _wrap(self, launcher):
            return CpuNoLaunch(launcher)

        def _gather_for(self, dtype):
            fresh = dtype not in self._gathers
            gather = super()._gather_for(dtype)
            if fresh:
                gather._template = RandomOutputs(gather._template)
            return gather

        def update(self, key_states, value_states, layer_idx, *rest, **kwargs):
            if mode == "alldyn":
                if self.shadow is None:
                    self.shadow = DynamicCache()
                out = self.shadow.update(key_states, value_states, layer_idx)
                self.layers[layer_idx].seq_len = out[0].shape[-2]
                return out
            out = super().update(key_states, value_states, layer_idx, *rest, **kwargs)
            return (out[0].clone(), out[1].clone()) if mode == "clone" else out

    def paged(cls, **kwargs):
        return cls.from_model(model, max_total_tokens=PROMPT + args.new + 64, page_size=16, max_batch_size=1,
                              kernels="triton", device="cpu", **kwargs)  # fmt: skip

    class DynShadow0(DynamicCache):
        shadow = None

        def update(self, key_states, value_states, layer_idx, *rest, **kwargs):
            if layer_idx == 0:
                if self.shadow is None:
                    self.shadow = paged(Kvcore)
                self.shadow.update(key_states, value_states, 0)
            return super().update(key_states, value_states, layer_idx, *rest, **kwargs)

    def timed(cls):
        base = parts_probe.timed_update(cls, parts)

        class PerLayer(base):
            def update(self, key_states, value_states, layer_idx, *rest, **kwargs):
                start = time.perf_counter_ns()
                out = super().update(key_states, value_states, layer_idx, *rest, **kwargs)
                parts.totals()[f"update{layer_idx}."] += time.perf_counter_ns() - start
                return out

        return PerLayer

    makers = {"dynamic": lambda: timed(DynamicCache)(config=config),
              "dynamic_b": lambda: timed(DynamicCache)(config=config),
              "nolaunch": lambda: paged(timed(Kvcore)), "noresident": lambda: paged(timed(Kvcore), resident_rows=True),
              "dynshadow0": lambda: timed(DynShadow0)(config=config)}  # fmt: skip
    names = args.caches.split(",")
    steps: dict[str, list[dict]] = {name: [] for name in names}
    for run in range(args.runs + 1):  # the first run warms up
        clocks = {}

        def make_clock(turns, who, tokens, device, _clocks=clocks):
            clock = _clocks[names[who]] = parts_probe.PartsClock(turns, who, tokens, device, parts=parts)
            return clock

        times = lockstep(model, {name: makers[name]() for name in names}, ids, torch.ones_like(ids), args.new, "cpu",
                         clock_cls=make_clock)  # fmt: skip
        if run:
            for name, clock in clocks.items():
                for seconds, part in zip(times[name], clock.per_step[1:]):
                    steps[name].append({"step": seconds * 1e9, **part})

    def median(name, value) -> float:
        return statistics.median(value(s) for s in steps[name]) / 1e3

    print(f"CPU, one core; Llama {LAYERS} x 256, batch 1, prompt {PROMPT}, {args.new} new tokens, {args.runs} lockstep "
          f"runs; mode {mode or 'as built'}; median µs a decode step")  # fmt: skip
    print(f"{'part':<14}" + "".join(f"{name:>12}" for name in names))
    rows = {
        "update": lambda s: s["update"], "update-0": lambda s: s["update0"], "update-1+": lambda s: s["update1"],
        "attn-rest": lambda s: s["attn"] - s["update"], "layers-rest": lambda s: s["layers"] - s["attn"],
        "outside": lambda s: s["step"] - s["layers"], "step": lambda s: s["step"],
        **{f"attn-rest {i}": (lambda s, i=i: s[f"attn{i}"] - s[f"update{i}."]) for i in range(LAYERS)},
    }  # fmt: skip
    for label, value in rows.items():
        print(f"{label:<14}" + "".join(f"{median(name, value):12.1f}" for name in names), flush=True)


if __name__ == "__main__":
    main()
