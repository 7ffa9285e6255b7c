"""Where an fp8 PagedKVCache's logits part from the fp8-rounded DynamicCache's under SDPA (issue 31): the bench's
logit check (a prefill and two decode steps, ``bench_hf_generate.run_case``'s inputs) through both caches, every
``scaled_dot_product_attention`` call recorded, then the calls compared in order: the first whose query, keys,
values, mask or output differ, with the inputs' strides and alignment, and whether SDPA itself gives the same output
for equal inputs at the two caches' addresses.  A probe, not a product path.

    python benchmarks/probe_sdpa_inputs.py float8_e4m3fn:8:8000 bfloat16:8:8000
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import bench_hf_generate as bench  # noqa: E402


def recorded(run):
    """``(logits, calls)`` of ``run()`` with every SDPA call's inputs and output described and kept (host copies,
    so that long prompts fit beside the model)."""
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, *args, **kwargs):
        out = real(q, k, v, attn_mask, *args, **kwargs)
        calls.append({"t": [x.to("cpu", copy=True) if isinstance(x, torch.Tensor) else None
                            for x in (q, k, v, attn_mask, out)],
                      "args": args, "kwargs": dict(kwargs),
                      "desc": [None if x is None else (tuple(x.shape), x.stride(), x.dtype, x.data_ptr() % 256)
                               for x in (q, k, v, attn_mask)]})  # fmt: skip
        return out

    F.scaled_dot_product_attention = sdpa
    try:
        logits = run()
    finally:
        F.scaled_dot_product_attention = real
    return logits, calls


def same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def probe(model, case: str, device: str, against_itself: bool = False) -> None:
    dtype, batch, prompt = case.split(":")
    batch, prompt = int(batch), int(prompt)
    ids, mask, _ = bench.case_inputs(batch, prompt, model.config.vocab_size, device)
    layers = model.config.num_hidden_layers

    def three_steps(cache):
        return bench.three_steps(model, ids, mask, cache)

    def reference():
        return bench.reference_cache(model, dtype)

    def paged():
        return bench.PagedKVCache.from_model(model, max_total_tokens=batch * (prompt + 128), page_size=16, dtype=dtype,
                                             max_batch_size=batch)  # fmt: skip

    want, ref_calls = recorded(lambda: three_steps(reference()))
    got, kv_calls = recorded(lambda: three_steps(reference() if against_itself else paged()))
    equal = [torch.equal(a, b) for a, b in zip(want, got)]
    print(f"== {case}{' reference against itself' if against_itself else ''}: logits equal per step {equal}, "
          f"{len(ref_calls)} / {len(kv_calls)} SDPA calls")  # fmt: skip
    shown = 0
    for i, (r, g) in enumerate(zip(ref_calls, kv_calls)):
        eq = [same(a, b) for a, b in zip(r["t"], g["t"])]
        layouts_equal = [d and d[:3] for d in r["desc"]] == [d and d[:3] for d in g["desc"]]
        if all(eq) and layouts_equal and r["kwargs"] == g["kwargs"]:
            continue
        step, layer = divmod(i, layers)
        print(f"  call {i} (step {step}, layer {layer}): equal q,k,v,mask,out = {eq}")
        print(f"    ref  {r['desc']} {r['args']} {r['kwargs']}")
        print(f"    kv   {g['desc']} {g['args']} {g['kwargs']}")
        if all(eq[:4]) and not eq[4]:  # equal inputs, another output: SDPA's, at these addresses?
            q, k, v, m = (None if x is None else x.to(device) for x in r["t"][:4])
            again = [F.scaled_dot_product_attention(q, k, v, m, *r["args"], **r["kwargs"]).cpu() for _ in range(2)]
            print(f"    SDPA again on the reference's inputs equals ref out {torch.equal(again[0], r['t'][4])}, "
                  f"kv out {torch.equal(again[0], g['t'][4])}, itself {torch.equal(*again)}")  # fmt: skip
        elif not all(eq[1:3]):
            for name, a, b in (("k", r["t"][1], g["t"][1]), ("v", r["t"][2], g["t"][2])):
                if a.shape == b.shape and not torch.equal(a, b):
                    diff = (a != b).nonzero()
                    print(f"    {name}: {len(diff)} elements differ, first at {diff[:4].tolist()}: ref "
                          f"{a[tuple(diff[0])].item()} kv {b[tuple(diff[0])].item()}")  # fmt: skip
        shown += 1
        if shown == 3:
            break
    del ref_calls, kv_calls
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="dtype:batch:prompt")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--itself", action="store_true", help="the reference cache against a second run of itself")
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--small", action="store_true", help="the bench's small model (a CPU smoke run)")
    args = parser.parse_args()
    model = bench.build_model(args)
    print(torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch", torch.__version__)
    torch.use_deterministic_algorithms(args.deterministic)
    for case in args.cases:
        probe(model, case, args.device, args.itself)


if __name__ == "__main__":
    main()
