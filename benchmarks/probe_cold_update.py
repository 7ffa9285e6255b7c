"""A transformers cache update's host cost right after a decoder layer's work, on the CPU (issue 31): a proxy for what
``probe_launch_amid.py`` measures on a GPU's host.  Between two of a decode step's updates the model runs a whole
layer, which pushes what an update touches (its frames, the cache's and the head gather's objects, the C code it
calls) out of the CPU's caches; a call that costs a few µs back to back then costs several times as much.

kvcore's ``PagedKVCache`` (``kvbare``: its bound with no per-layer check; ``kvresident``: with ``resident_rows``)
on the Triton path with every
store-and-gather launch replaced by a recorder once planned (so that it runs on the CPU: the launch's own host work
is not in these numbers, its arguments are), and DynamicCache, for scale (its ``torch.cat`` copies a few KB here).
A Llama of 8 layers, hidden 512, batch 1, prompt 100, bf16.  Median µs of ``--calls`` calls, best of 3 rounds, of
a later layer's update (layer 3) and of a decode step's first layer's, after: nothing (``none``), one decoder layer's
forward (``layer``), a sum over 2^18 Python ints (``evict``).

    python benchmarks/probe_cold_update.py [--calls 400] [--before none,layer,evict]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # (the plans are made through the interpreter, then recorded)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf_generate import BarePagedKVCache  # noqa: E402

from kvcore.integrations.transformers import PagedKVCache  # noqa: E402

LAYERS, PROMPT, HEADS, DIM = 8, 100, 2, 64


def recorded(cache, step_kv) -> None:
    """Replace the cache's store-and-gather launches by a recorder once planned, until a forward's first layer
    leaves a repeat for the others."""
    gather = cache._step.gather
    for _ in range(3):  # (a decode step's plan is made by its first forward, then recorded)
        for plan in gather._store_plans.values():
            plan.entry, plan.raw_stream = (lambda *args: None, ("HEAD",)), lambda index: 0
        for layer in cache.layers:
            layer.seq_len = PROMPT
        for layer in range(LAYERS):
            cache.update(*step_kv, layer)
    if gather.repeat is None:
        raise RuntimeError("no repeat of the first layer's launch was made")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--before", default="none,layer,evict")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=HEADS, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 1, HEADS, PROMPT + 1, DIM, generator=gen).to(torch.bfloat16)
    prompt_kv, step_kv = (kv[0, :, :, :PROMPT], kv[1, :, :, :PROMPT]), (kv[0, :, :, PROMPT:], kv[1, :, :, PROMPT:])

    def paged(cls, resident_rows=False):
        cache = cls.from_model(model, max_total_tokens=1024, page_size=16, max_batch_size=1, kernels="triton",
                               device="cpu", resident_rows=resident_rows)  # fmt: skip
        with torch.no_grad():
            for layer in range(LAYERS):
                cache.update(*prompt_kv, layer)
            recorded(cache, step_kv)
        return cache

    def dynamic():
        cache = DynamicCache(config=config)
        for layer in range(LAYERS):
            cache.update(*prompt_kv, layer)
        return cache

    caches = {"kvcore": paged(PagedKVCache), "kvbare": paged(BarePagedKVCache),
              "kvresident": paged(PagedKVCache, resident_rows=True), "dynamic": dynamic()}  # fmt: skip
    decoder = model.model.layers[1]
    hidden = torch.randn(1, 1, config.hidden_size, generator=gen).to(torch.bfloat16)
    rotary = model.model.rotary_emb(hidden, torch.full((1, 1), PROMPT))
    objects = list(range(1 << 18))
    before = {"none": lambda: None, "layer": lambda: decoder(hidden, position_embeddings=rotary),
              "evict": lambda: sum(objects)}  # fmt: skip
    clock = time.perf_counter_ns

    def timed(cache, layer_idx: int, pred) -> float:
        if layer_idx and not isinstance(cache, DynamicCache):  # a step at PROMPT + 1 begun: its later layers to time
            for layer in cache.layers:
                layer.seq_len = PROMPT
            cache.update(*step_kv, 0)
        times = []
        for i in range(args.calls):
            if isinstance(cache, DynamicCache):  # (the layer's keys back to the prompt's: a cat of as many each call)
                cache.layers[layer_idx].keys, cache.layers[layer_idx].values = prompt_kv
            else:  # the layer(s) not stored yet at this length (a first layer: lengths alternate, one page held)
                for layer in cache.layers if layer_idx == 0 else (cache.layers[layer_idx],):
                    layer.seq_len = PROMPT + (i & 1 if layer_idx == 0 else 0)
            pred()
            start = clock()
            cache.update(*step_kv, layer_idx)
            times.append((clock() - start) / 1e3)
        return statistics.median(times)

    print(f"CPU host µs of one update right after its predecessor (median of {args.calls}, best of 3 rounds); "
          f"Llama {LAYERS} x 512, batch 1, prompt {PROMPT}, launches recorded")  # fmt: skip
    print(f"{'before':<8}" + "".join(f"{name + ' ' + which:>18}" for name in caches for which in ("later", "first")))
    with torch.no_grad():
        for name in args.before.split(","):
            row = [min(timed(cache, layer, before[name]) for _ in range(3)) for cache in caches.values()
                   for layer in (3, 0)]  # fmt: skip
            print(f"{name:<8}" + "".join(f"{us:18.2f}" for us in row), flush=True)


if __name__ == "__main__":
    main()
