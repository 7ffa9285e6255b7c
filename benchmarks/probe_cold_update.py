"""A transformers cache update's host cost right after a decoder layer's work, on the CPU (issue 31): a proxy for what
``probe_launch_amid.py`` measures on a GPU's host.  Between two of a decode step's updates the model runs a whole
layer, which pushes what an update touches (its frames, the cache's and the head gather's objects, the C code it
calls) out of the CPU's caches; a call that costs a few µs back to back then costs several times as much.

kvcore's ``PagedKVCache`` (``kvbare``: its bound with no per-layer check; ``kvresident``: with ``resident_rows``)
on the Triton path with every
store-and-gather launch replaced by a recorder once planned (so that it runs on the CPU: the launch's own host work
is not in these numbers, its arguments are), and DynamicCache, for scale (its ``torch.cat`` copies a few KB here).
A Llama of 8 layers, hidden 512, batch 1, prompt 100, bf16.  Median µs over ``--calls`` whole decode steps (the rows
a token longer each, pages of 16 taken as they fill), best of 3 rounds, of a later layer's update (layers 1-7) and of
a decode step's first layer's, and the first layer's mean (which holds the steps that take a page or outgrow the
outputs), each after: nothing (``none``), one decoder layer's forward (``layer``), a sum over 2^18 Python ints
(``evict``).  kvcore's caches take their pages from a torch stand-in for the allocator (:func:`torch_pages`: the
allocator's kernel, interpreted here, would take milliseconds).

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


def torch_pages(cache) -> None:
    """Replace the cache's allocator's ``alloc`` / ``free`` by a torch stand-in that hands out consecutive slots from
    slot 1 on, from the start again when it reaches the end, and takes nothing back: what a page take costs the
    cache's Python (and one small torch op), not the allocator's kernel.  The slots' contents are never read (the
    launches are recorded)."""
    capacity, cursor = cache.capacity_tokens, [1]

    def alloc(n: int) -> torch.Tensor:
        if cursor[0] + n > capacity:
            cursor[0] = 1
        start, cursor[0] = cursor[0], cursor[0] + n
        return torch.arange(start, start + n, dtype=torch.int64)

    cache.allocator.alloc, cache.allocator.free = alloc, lambda slots: None


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
        torch_pages(cache)
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

    def timed(cache, pred) -> tuple[float, float, float]:
        """Median µs of a later layer's update and of a first layer's, and the first layer's mean, over ``--calls``
        whole decode steps."""
        extra = cache.get_seq_length() - PROMPT
        if extra:  # (the rows back to the prompt: a kvcore cache then starts its next step the full way)
            cache.crop(-extra)
        later, first = [], []
        for _ in range(args.calls):
            for layer in range(LAYERS):
                pred()
                start = clock()
                cache.update(*step_kv, layer)
                (later if layer else first).append((clock() - start) / 1e3)
        return statistics.median(later), statistics.median(first), statistics.fmean(first)

    print(f"CPU host µs of one update right after its predecessor (median over {args.calls} decode steps, best of 3 "
          f"rounds); Llama {LAYERS} x 512, batch 1, prompt {PROMPT}, launches recorded")  # fmt: skip
    columns = ("later", "first", "first mean")
    print(f"{'before':<8}" + "".join(f"{name + ' ' + which:>22}" for name in caches for which in columns))
    with torch.no_grad():
        for name in args.before.split(","):
            rounds = [[timed(cache, before[name]) for _ in range(3)] for cache in caches.values()]
            row = [min(times[which] for times in cache_rounds) for cache_rounds in rounds for which in (0, 1, 2)]
            print(f"{name:<8}" + "".join(f"{us:22.2f}" for us in row), flush=True)


if __name__ == "__main__":
    main()
