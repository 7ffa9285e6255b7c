"""Where a transformers decode step's host time goes, per cache (issue 31): ``cProfile`` over one ``model.generate``
of each cache (after a warm-up), then the functions whose own time differs most between DynamicCache and kvcore's
``PagedKVCache``, per decode step; a difference in ``synchronize``/``item`` is the host waiting for the device.  It
names the calls each cache makes and what they cost under the profiler, which charges every call (many small ones
look dearer than they run) and runs the two caches one after the other: it cannot rank a difference of a few percent
(on the H200, 2026-12-03, the model's own ``linear`` moved by 8% between the two profiles).  Lockstep runs of
``bench_hf_generate.py`` can.

    python benchmarks/probe_hf_step.py            # on the GPU; the full tables also in $OUT/probe_hf_step.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf_generate import CACHE_KW, build_model, probe_case, sync  # noqa: E402

from kvcore.integrations.transformers import PagedKVCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--cases", default="bfloat16:1:100,float8_e4m3fn:8:100")
    args = parser.parse_args()
    args.attn = "eager"
    model = build_model(args)
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_hf_step.txt"), "w")
    for case in args.cases.split(","):
        dtype, batch, prompt, ids, mask = probe_case(model, case, args.device)
        makers = {
            "dynamic": lambda: DynamicCache(config=model.config),
            "kvcore": lambda: PagedKVCache.from_model(model, max_total_tokens=batch * (prompt + args.new + 64),
                                                      page_size=16, dtype=dtype, max_batch_size=batch),
        }  # fmt: skip

        def generate(cache) -> None:
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                               do_sample=False, pad_token_id=0, **{CACHE_KW: cache})  # fmt: skip
            sync(args.device)

        own: dict[str, dict] = {}
        for name, make in makers.items():
            generate(make())
            profiler = cProfile.Profile()
            cache = make()
            profiler.enable()
            generate(cache)
            profiler.disable()
            stats = pstats.Stats(profiler)
            own[name] = {f"{os.path.basename(f)}:{line}({fn})": (v[1], v[2], v[3])
                         for (f, line, fn), v in stats.stats.items()}  # fmt: skip
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
            log.write(f"===== {case} {name}\n{text.getvalue()}\n")
            print(f"{case} {name}: {stats.total_tt / args.new * 1e3:.2f} ms a step under the profiler", flush=True)
        keys = set(own["dynamic"]) | set(own["kvcore"])
        moved = {k: own["kvcore"].get(k, (0, 0, 0))[1] - own["dynamic"].get(k, (0, 0, 0))[1] for k in keys}
        diff = sorted(keys, key=lambda k: -abs(moved[k]))
        print(f"{case}: own time per step, us (calls per step): dynamic / kvcore / difference")
        for key in diff[:22]:
            d, k = own["dynamic"].get(key, (0, 0, 0)), own["kvcore"].get(key, (0, 0, 0))
            print(f"  {key[:78]:78} {d[1] / args.new * 1e6:8.1f} ({d[0] / args.new:5.1f}) {k[1] / args.new * 1e6:8.1f} "
                  f"({k[0] / args.new:5.1f}) {(k[1] - d[1]) / args.new * 1e6:+8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
