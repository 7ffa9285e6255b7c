"""What one cache update costs the host right after other work (issue 31).  ``bench_hf_generate.py``'s host-time loop
times each update after one of the model's MLPs with nothing waited for, so that the device's queue may fill; this
probe waits for the device every 8 calls (outside the timing) and times, on the host, one call of each kind right
after each kind of predecessor.  ``layer`` (a whole decoder layer's forward, no cache: what runs between two updates
in a real step) and ``evict`` (a sum over a million Python ints: the CPU's caches hold little else afterwards) tell
how much a call costs because what it touches is no longer in the CPU's caches.

Predecessors: ``none``; ``mlp`` (the model's MLP: three cuBLAS GEMMs and two elementwise kernels); ``ew`` (three torch
elementwise kernels); ``bmm`` (one batched matmul, what attention's scores are); ``layer``; ``evict``.  Each also with
``+sync`` (the device waited for before the timed call: an idle GPU, nothing queued).  Calls: ``cat``
(DynamicCache's update: two ``torch.cat``), ``copy`` (one torch copy kernel), ``kvcore`` (a later layer's
``PagedKVCache.update``), ``kvbare`` (its bound: the store-and-gather launched with no check), ``one`` (the same
launch, called directly, on a grid of one program).  Median µs of 300 calls.

    python benchmarks/probe_launch_amid.py [--batch 1] [--prompt 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf_generate import BarePagedKVCache, build_model  # noqa: E402

from kvcore.integrations.transformers import PagedKVCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    model = build_model(argparse.Namespace(small=False, attn="eager", device="cuda"))
    cfg = model.config
    batch, prompt, layers = args.batch, args.prompt, cfg.num_hidden_layers
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, batch, heads, prompt + 1, dim, generator=gen).to("cuda", torch.bfloat16)
    prompt_kv, step_kv = (kv[0, :, :, :prompt], kv[1, :, :, :prompt]), (kv[0, :, :, prompt:], kv[1, :, :, prompt:])
    hidden = torch.randn(batch, 1, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    scores_q = torch.randn(batch * cfg.num_attention_heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    scores_k = torch.randn(batch * cfg.num_attention_heads, dim, prompt, device="cuda", dtype=torch.bfloat16)
    mlp = model.model.layers[0].mlp
    old_k, old_v = prompt_kv
    copy_dst = torch.empty_like(step_kv[0])

    def ready(cache_cls):
        cache = cache_cls.from_model(model, max_total_tokens=batch * (prompt + 64), page_size=16, max_batch_size=batch)
        with torch.no_grad():
            for layer in range(layers):
                cache.update(*prompt_kv, layer)
            for layer in range(layers):  # a decode step: the first layer's launch to repeat
                cache.update(*step_kv, layer)
        return cache

    caches = {"kvcore": ready(PagedKVCache), "kvbare": ready(BarePagedKVCache)}

    def later_update(cache):
        layer = cache.layers[3]

        def call():
            layer.seq_len -= 1  # (the layer again, as if not yet stored this step)
            cache.update(*step_kv, 3)

        return call

    bare = caches["kvbare"]
    gather = bare._step.gather
    last, spare = gather._last_launch, gather._spare
    kp, vp = gather._addresses[3]

    def one_program():
        last[11](1, 1, 1, last[13](last[14]), *last[15], kp, vp, spare[10], spare[11], last[2],
                 step_kv[0].data_ptr(), step_kv[1].data_ptr(), *last[16])  # fmt: skip

    calls = {
        "cat": lambda: (torch.cat([old_k, step_kv[0]], dim=-2), torch.cat([old_v, step_kv[1]], dim=-2)),
        "copy": lambda: copy_dst.copy_(step_kv[0]),
        "kvcore": later_update(caches["kvcore"]),
        "kvbare": later_update(bare),
        "one": one_program,
    }
    decoder = model.model.layers[1]
    positions = torch.full((1, 1), prompt, device="cuda", dtype=torch.long)
    rotary = model.model.rotary_emb(hidden, positions)
    objects = list(range(1 << 20))  # about 36 MB of Python ints: what a sum over them reads leaves little else cached

    before = {
        "none": lambda: None,
        "mlp": lambda: mlp(hidden),
        "ew": lambda: torch.nn.functional.silu(hidden * 2 + 1),
        "bmm": lambda: torch.bmm(scores_q, scores_k),
        "layer": lambda: decoder(hidden, position_embeddings=rotary),
        "evict": lambda: sum(objects),
    }
    clock = time.perf_counter_ns
    print(f"{torch.cuda.get_device_name()}: host µs of one call after its predecessor (median of {args.calls}); "
          f"batch {batch}, prompt {prompt}")
    print(f"{'before':<10}" + "".join(f"{name:>9}" for name in calls))
    with torch.no_grad():
        for pred_name, pred in before.items():
            for waited in (False, True):
                row = []
                for call in calls.values():
                    times = []
                    for i in range(args.calls + 16):
                        if i % 8 == 0:
                            torch.cuda.synchronize()
                        pred()
                        if waited:
                            torch.cuda.synchronize()
                        start = clock()
                        call()
                        took = clock() - start
                        if i >= 16:
                            times.append(took / 1e3)
                    row.append(statistics.median(times))
                torch.cuda.synchronize()
                print(f"{pred_name + ('+sync' if waited else ''):<10}" + "".join(f"{t:9.1f}" for t in row), flush=True)


if __name__ == "__main__":
    main()
