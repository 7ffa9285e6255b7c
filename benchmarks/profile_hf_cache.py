"""Host cost of a transformers cache per layer and decode step (``python benchmarks/profile_hf_cache.py``), on the
CPU: DynamicCache beside kvcore's PagedKVCache (as built, and with ``contiguous_rows=True``), with tensors so small
that what is measured is what a GPU's host pays: Python, torch ops, kernel launches.

Two modes:

* ``update`` (the default): the cache alone.  A prompt is stored, then decode steps call ``cache.update(k, v,
  layer)`` for every layer, with one token's keys/values shaped as Llama hands them over (a contiguous K, a
  transposed view for V).  Reported per decode layer-step: host microseconds (the best of ``--rounds`` rounds, the
  caches interleaved, no garbage collection inside), torch (aten) ops, kvcore Triton launches; layers 1..L-1 apart
  from layer 0, which also allocates the step's slots.
* ``generate``: ``model.generate`` of a tiny random-weight Llama, every layer's ``update()`` timed inside it.

``--stub-launches`` (run with ``TRITON_INTERPRET=1``) takes the GPU's code path: ``kernels=triton``, and the
per-layer kernels (the K/V store, the head gather) become calls of a no-op through kvcore's direct-launch path, so
what is timed is the host's Python and torch ops around them; launches are counted, not timed (a direct launch is
a few microseconds of C on a GPU host).  The allocator's kernels run interpreted: their time is taken out of
layer 0's (and their torch ops from its counts), but what they leave behind (the interpreter's objects, a cold
CPU cache) still slows the calls after them: layer 0's time is rougher than the others'.  Outputs are garbage.
Without it the CPU's own ``native`` path runs (torch ops that copy every stored token in every layer: not what a
GPU runs).


``--baseline FILE`` adds another version of ``kvcore/integrations/transformers.py`` (e.g. ``git show
HEAD~1:kvcore/integrations/transformers.py > /tmp/before.py``), measured interleaved with the current one.
The Triton launch stubs and op counts reach into kvcore's launcher (``kvcore.kernels.launch``): a profiling aid,
not an API.

    TRITON_INTERPRET=1 python benchmarks/profile_hf_cache.py --stub-launches
    TRITON_INTERPRET=1 python benchmarks/profile_hf_cache.py --stub-launches --dtype float8_e4m3fn --batch 1 \
        --prompt 4000
    python benchmarks/profile_hf_cache.py --mode generate
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

#: the kernels a cache runs per layer and step: no-ops under ``--stub-launches``
_PER_LAYER_KERNELS = ("_store_kv_kernel", "_gather_heads_kernel", "_store_gather_heads_kernel")

#: kernel launches by kernel name, and the time spent inside launches that really ran (interpreted), in ns
LAUNCHES: collections.Counter = collections.Counter()
INTERPRETED_NS = [0]


def stub_triton_launches() -> None:
    """See the module docstring.  Must run before any pool is built."""
    from kvcore.kernels import launch

    if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels are defined, at import
        raise SystemExit("--stub-launches runs the allocator's kernels interpreted: run with TRITON_INTERPRET=1")
    dispatch, entry = launch.Launcher._dispatch, launch._entry

    class Stub:
        def __init__(self, name):
            self.name = name

    def stub_dispatch(self, grid, args, num_warps):
        name = self.kernel.__name__
        LAUNCHES[name] += 1
        if name in _PER_LAYER_KERNELS:
            return Stub(name)
        start = time.perf_counter_ns()
        with _disable_current_modes():  # the interpreter's own torch ops are not the cache's
            out = dispatch(self, grid, args, num_warps)
        INTERPRETED_NS[0] += time.perf_counter_ns() - start
        return out

    def stub_entry(compiled):
        if not isinstance(compiled, Stub):
            return entry(compiled)
        name = compiled.name

        def launch_(*args):
            LAUNCHES[name] += 1

        return launch_, ()

    launch._direct_on = lambda device: True
    launch._RAW_STREAM = lambda index: 0
    launch._entry = stub_entry
    launch.Launcher._dispatch = stub_dispatch


class CountOps(TorchDispatchMode):
    """Counts the aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_llama(layers: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval().to(device, torch.bfloat16)


def cache_makers(args, model) -> dict:
    from transformers import DynamicCache

    from kvcore.integrations import transformers as current

    versions = {"": current}
    if args.baseline:
        versions[" (baseline)"] = load_module(args.baseline, "kvcore_integrations_transformers_baseline")
    makers = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for suffix, module in versions.items():
        for label, contiguous in (("PagedKVCache", False), ("contiguous_rows", True)):

            def make(module=module, contiguous=contiguous):
                return module.PagedKVCache.from_model(
                    model, max_total_tokens=args.batch * (args.prompt + args.steps + 64) + 64,
                    page_size=args.page_size, dtype=args.dtype, max_batch_size=args.batch, kernels=args.kernels,
                    contiguous_rows=contiguous,
                )  # fmt: skip

            makers[label + suffix] = make
    return makers


# -- update mode --------------------------------------------------------------------------------------------------


def update_loop(cache, layers: int, prompt_kv, step_kv, steps: int, count: bool = False):
    """Store the prompt, then ``steps`` decode steps; returns ``(layer 0 ns, layers 1.. ns, ops of layer 0, ops of
    the others, launches of layer 0, launches of the others)``, the times without interpreted kernels."""
    for layer in range(layers):
        cache.update(*prompt_kv, layer)
    clock = time.perf_counter_ns
    first = rest = 0
    ops = [collections.Counter(), collections.Counter()]
    launches = [collections.Counter(), collections.Counter()]
    for _ in range(steps):
        for layer in range(layers):
            which = 0 if layer == 0 else 1
            before_launches, interpreted = LAUNCHES.copy(), INTERPRETED_NS[0]
            if count:
                with CountOps() as counter:
                    cache.update(*step_kv, layer)
                ops[which].update(counter.ops)
            else:
                start = clock()
                cache.update(*step_kv, layer)
                spent = clock() - start - (INTERPRETED_NS[0] - interpreted)
                if which:
                    rest += spent
                else:
                    first += spent
            launches[which].update(LAUNCHES - before_launches)
    return first, rest, ops, launches


def run_update(args, model) -> None:
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)

    def kv(q):  # as Llama hands them over: K fresh from the rotary embedding, V a transposed view of the projection
        k = torch.randn(args.batch, heads, q, dim, generator=gen).to(args.device, torch.bfloat16)
        v = torch.randn(args.batch, q, heads * dim, generator=gen).to(args.device, torch.bfloat16)
        return k, v.view(args.batch, q, heads, dim).transpose(1, 2)

    prompt_kv, step_kv = kv(args.prompt), kv(1)
    makers = cache_makers(args, model)
    layers = cfg.num_hidden_layers
    best = {name: [float("inf"), float("inf")] for name in makers}
    for name, make in makers.items():  # warm: every plan made
        update_loop(make(), layers, prompt_kv, step_kv, 20)
    for _ in range(args.rounds):
        for name, make in makers.items():
            cache = make()
            gc.collect()
            gc.disable()  # no collection inside a timed call
            try:
                first, rest, _, _ = update_loop(cache, layers, prompt_kv, step_kv, args.steps)
            finally:
                gc.enable()
            best[name][0] = min(best[name][0], first / args.steps / 1e3)
            best[name][1] = min(best[name][1], rest / args.steps / (layers - 1) / 1e3)
    print(f"{'cache':<28} {'us/layer-step':>14} {'ops':>6} {'launches':>9} {'| layer 0: us':>13} {'ops':>6} "
          f"{'launches':>9}")  # fmt: skip
    details = []
    for name, make in makers.items():
        _, _, ops, launches = update_loop(make(), layers, prompt_kv, step_kv, args.steps, count=True)
        per = [args.steps * (layers - 1), args.steps]
        n_ops = [sum(ops[1].values()) / per[0], sum(ops[0].values()) / per[1]]
        n_launch = [sum(launches[1].values()) / per[0], sum(launches[0].values()) / per[1]]
        print(f"{name:<28} {best[name][1]:14.1f} {n_ops[0]:6.1f} {n_launch[0]:9.2f} {best[name][0]:13.1f} "
              f"{n_ops[1]:6.1f} {n_launch[1]:9.2f}")  # fmt: skip
        details.append((name, ops, launches, per))
    print("\nper decode layer-step (layers 1..L-1 | layer 0):")
    for name, ops, launches, per in details:
        rest = {k: round(v / per[0], 2) for k, v in sorted((ops[1] + launches[1]).items(), key=lambda kv: -kv[1])}
        first = {k: round(v / per[1], 2) for k, v in sorted((ops[0] + launches[0]).items(), key=lambda kv: -kv[1])}
        print(f"  {name}: {rest} | {first}")


# -- generate mode ------------------------------------------------------------------------------------------------


def run_generate(args, model) -> None:
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    cache_kw = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"

    ids = torch.randint(3, 256, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(args.device)
    mask = torch.ones_like(ids)
    if args.batch > 1:  # a padded batch, as generate sees one: row 0 is shorter
        mask[0, : args.prompt // 3] = 0
    timed = collections.defaultdict(int)
    calls = collections.defaultdict(int)
    original = {}

    def wrap(cls, name):
        update = original[name] = cls.update

        def timed_update(self, key_states, value_states, layer_idx, *a, **k):
            kind = "prefill" if key_states.shape[-2] != 1 else ("decode 0" if layer_idx == 0 else "decode")
            start = time.perf_counter_ns()
            out = update(self, key_states, value_states, layer_idx, *a, **k)
            timed[name, kind] += time.perf_counter_ns() - start
            calls[name, kind] += 1
            return out

        cls.update = timed_update

    makers = cache_makers(args, model)
    print(f"{'cache':<28} {'decode us/layer-step':>21} {'layer 0':>9} {'prefill us/layer':>17} "
          f"{'generate ms/step':>17}")
    for name, make in makers.items():
        best = None
        for i in range(args.rounds + 1):
            cache = make()
            cls = type(cache)
            if i:
                wrap(cls, name)
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.steps, min_new_tokens=args.steps,
                               do_sample=False, pad_token_id=0, **{cache_kw: cache})  # fmt: skip
            seconds = time.perf_counter() - start
            if i:
                cls.update = original.pop(name)
                us = {kind: timed[name, kind] / max(calls[name, kind], 1) / 1e3
                      for kind in ("decode", "decode 0", "prefill")}
                if best is None or seconds < best[0]:
                    best = (seconds, us)
                timed.clear()
                calls.clear()
        seconds, us = best
        print(f"{name:<28} {us['decode']:21.1f} {us['decode 0']:9.1f} {us['prefill']:17.1f} "
              f"{seconds * 1e3 / args.steps:17.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("update", "generate"), default="update")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--steps", type=int, default=128, help="decode steps (new tokens)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", help="PagedKVCache's dtype (the model runs in bf16)")
    parser.add_argument("--kernels", default="auto", help="PagedKVCache's kernels: auto, native or triton")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, caches interleaved; the best is kept")
    parser.add_argument("--stub-launches", action="store_true", help="the GPU's code path (see above)")
    parser.add_argument("--baseline", help="another transformers.py to measure beside the current one")
    args = parser.parse_args()
    if args.stub_launches:
        stub_triton_launches()
        args.kernels = "triton"
    torch.set_num_threads(1)  # tiny ops: one thread is the least noisy
    model = tiny_llama(args.layers, args.device)
    print(f"{args.mode}: batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, {args.layers} layers, "
          f"cache {args.dtype}, page {args.page_size}, kernels {args.kernels}"
          f"{' (launches stubbed)' if args.stub_launches else ''}, {args.device}")  # fmt: skip
    (run_update if args.mode == "update" else run_generate)(args, model)


if __name__ == "__main__":
    main()
