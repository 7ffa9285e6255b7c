"""Whether a Triton launch slows the host work after it (issue 31): one thread pinned to one core runs, layer after
layer, a cache update and then attention-like eager torch ops (GQA's repeat, two matmuls, the mask, softmax, the
output projection: what a transformers attention module does with the keys and values), and clocks the two apart.
The updates compared:

* ``none``: no update (the attention ops on the same keys and values);
* ``cat``: DynamicCache's, two ``torch.cat``;
* ``kvcore``: :meth:`HeadGather.store_and_gather`, the cache's one launch;
* ``nolaunch``: the same with its launch replaced by a Python no-op (its outputs left as they are);
* ``tiny``: a Triton launch of one program that stores one value, then ``nolaunch``'s work.

Every variant runs in rounds interleaved with the others; the device is synchronized every 8 layers, as a decode
step's end does.  Per variant: the median µs a layer of the update and of the attention ops after it.

    python benchmarks/probe_launch_after.py [--seq 100] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from kvcore.kernels.head_gather import HeadGather


def _no_op(*args):
    pass


@triton.jit
def _one_store(out):
    tl.store(out, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    dev, dt = "cuda", torch.bfloat16
    b, kvh, h, d, layers = args.batch, 8, 32, 128, args.layers
    rows = b * (args.seq + args.steps + 64)
    k_layers = [torch.randn(rows, kvh, d, device=dev, dtype=dt) for _ in range(layers)]
    v_layers = [torch.randn(rows, kvh, d, device=dev, dtype=dt) for _ in range(layers)]
    table = torch.randperm(rows - 1, device=dev)[: b * (args.seq + args.steps + 8)].view(b, -1).to(torch.int32) + 1
    o_proj = torch.nn.Linear(h * d, h * d, bias=False, device=dev, dtype=dt)
    q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
    flag = torch.zeros(1, device=dev)

    def attention(k, v):
        n_rep = h // kvh
        seq = k.shape[2]
        k = k[:, :, None].expand(b, kvh, n_rep, seq, d).reshape(b, h, seq, d)
        v = v[:, :, None].expand(b, kvh, n_rep, seq, d).reshape(b, h, seq, d)
        w = torch.matmul(q, k.transpose(2, 3)) * (d**-0.5)
        w = w + mask[:, :, :, :seq]
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(dt)
        out = torch.matmul(w, v).transpose(1, 2).contiguous().reshape(b, 1, h * d)
        return o_proj(out)

    mask = torch.zeros(b, 1, 1, args.seq + args.steps + 1, device=dev, dtype=dt)
    new = [(torch.randn(b, kvh, 1, d, device=dev, dtype=dt), torch.randn(b, kvh, 1, d, device=dev, dtype=dt))
           for _ in range(layers)]  # fmt: skip

    def variant(name):
        """A generator of one decode step's updates for ``name``: ``update(layer, k_new, v_new) -> (keys, values)``."""
        if name in ("kvcore", "nolaunch", "tiny"):
            gather = HeadGather(k_layers, v_layers, dt, use_triton=True, reuse_outputs=True)
            state = {"end": args.seq}

            def update(layer, k_new, v_new):
                if layer == 0:
                    state["end"] += 1
                if name == "tiny":
                    _one_store[(1,)](flag)
                return gather.store_and_gather(layer, table, k_new, v_new, state["end"])

            for layer in range(3):  # planned, then launched directly
                update(layer, *new[layer])
            if name != "kvcore":
                for plan in gather._store_plans.values():
                    plan.entry = (_no_op, plan.entry[1])
                gather._last_launch = None
            return update
        if name == "cat":
            caches = [[torch.randn(b, kvh, args.seq, d, device=dev, dtype=dt)] * 2 for _ in range(layers)]

            def update(layer, k_new, v_new):
                pair = caches[layer]
                pair[0] = torch.cat([pair[0], k_new], dim=-2)
                pair[1] = torch.cat([pair[1], v_new], dim=-2)
                return pair[0], pair[1]

            return update
        fixed = (torch.randn(b, kvh, args.seq, d, device=dev, dtype=dt),) * 2
        return lambda layer, k_new, v_new: fixed

    names = ["none", "cat", "kvcore", "nolaunch", "tiny"]
    times = {name: ([], []) for name in names}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name in names:
                update = variant(name)
                clock = time.perf_counter_ns
                for step in range(args.steps):
                    for layer in range(layers):
                        t0 = clock()
                        k, v = update(layer, *new[layer])
                        t1 = clock()
                        attention(k, v)
                        t2 = clock()
                        del k, v
                        if step >= 10:
                            times[name][0].append(t1 - t0)
                            times[name][1].append(t2 - t1)
                    torch.cuda.synchronize()
    print(f"batch {b}, {args.seq}+ tokens, {layers} layers: median µs a layer")
    print(f"{'update':<10} {'update':>8} {'attention after':>16} {'sum':>8}")
    base = statistics.median(times["none"][1]) / 1e3
    for name in names:
        u, a = (statistics.median(x) / 1e3 for x in times[name])
        print(f"{name:<10} {u:8.2f} {a:16.2f} {u + a:8.2f}   attention vs none {a - base:+.2f}")


if __name__ == "__main__":
    main()
