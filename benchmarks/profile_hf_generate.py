"""Where a transformers generation step goes on the GPU (issue 31): ``model.generate`` of a random-weight Llama (8 layers
of Llama-3-8B's attention shape, as ``bench_hf_generate.py``) under ``torch.profiler``, per cache, batch and prompt.

Per step (the prefill's share included): the wall time (a run without the profiler), the device's busy time (the
sum of its kernels' durations), the time the host spends in ``cache.update`` (every layer), and the kernels that take
the most device time.  A step whose device time is near its wall time is bound by the device (a cache's kernels then
count); one far below is bound by the host (a cache's host time then counts).

    python benchmarks/profile_hf_generate.py            # on the GPU; the tables also in $OUT/profile_hf_generate.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf_generate import CACHE_KW, build_model  # noqa: E402

from kvcore.integrations.transformers import PagedKVCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=32, help="new tokens per profiled generate")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompts", default="100,4000")
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--caches", default="dynamic,kvcore,contig")
    args = parser.parse_args()
    args.small, args.attn, args.device = False, "eager", "cuda"
    model = build_model(args)
    vocab, lines = model.config.vocab_size, []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"{'dtype':<14} {'batch':>5} {'prompt':>6} {'cache':<8} {'wall ms/step':>12} {'device ms/step':>14} "
        f"{'update us/step':>14}  top kernels (us/step)")  # fmt: skip
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for prompt in (int(p) for p in args.prompts.split(",")):
                ids = torch.randint(1, vocab, (batch, prompt), generator=torch.Generator().manual_seed(prompt)).cuda()
                mask = torch.ones_like(ids)
                if batch > 1:
                    mask[0, : prompt // 3] = 0
                capacity = batch * (prompt + args.new + 64)
                for name in args.caches.split(","):
                    if name == "dynamic" and dtype != "bfloat16":
                        continue  # DynamicCache keeps the model's dtype: one row for both cache dtypes

                    def make(name=name):
                        if name == "dynamic":
                            from transformers import DynamicCache

                            return DynamicCache(config=model.config)
                        return PagedKVCache.from_model(model, max_total_tokens=capacity, page_size=16, dtype=dtype,
                                                       max_batch_size=batch, contiguous_rows=name == "contig")  # fmt: skip

                    def run(cache, tokens):
                        with torch.no_grad():
                            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,
                                           min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                           **{CACHE_KW: cache})  # fmt: skip
                        torch.cuda.synchronize()

                    run(make(), 4)
                    update_ns = [0]
                    cache = make()
                    update = cache.update

                    def timed(*a, **k):
                        start = time.perf_counter_ns()
                        out = update(*a, **k)
                        update_ns[0] += time.perf_counter_ns() - start
                        return out

                    cache.update = timed
                    start = time.perf_counter()
                    run(cache, args.new)
                    wall = time.perf_counter() - start
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the device's kernels, another run
                        run(make(), args.new)
                    kernels = collections.Counter()
                    for event in prof.events():
                        if event.device_type == torch.autograd.DeviceType.CUDA:
                            kernels[event.name[:40]] += event.device_time
                    steps = args.new
                    device_ms = sum(kernels.values()) / 1e3 / steps
                    top = ", ".join(f"{k} {v / steps:.0f}" for k, v in kernels.most_common(4))
                    say(f"{dtype:<14} {batch:>5} {prompt:>6} {name:<8} {wall * 1e3 / steps:12.2f} {device_ms:14.2f} "
                        f"{update_ns[0] / 1e3 / steps:14.1f}  {top}")  # fmt: skip
    out = os.path.join(os.environ.get("OUT", "/tmp"), "profile_hf_generate.txt")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
