"""A decode step's store-and-gather on the device, at the shapes of the transformers generation bench (issue 31):
where the case bound by the device's copies (batch 8 x 4000 tokens) spends its time.

One layer of a Llama-3-8B-wide cache (8 KV heads, head dim 128), its token rows in pages of 16 laid out at random,
as the transformers cache's pool holds them; a decode step's one new token a row.  Per case (cache dtype, batch,
tokens), the device time of one call in CUDA-graph replay (median):

* ``kvcore``: :meth:`HeadGather.store_and_gather`, the cache's one launch (store the new rows, gather every row's
  tokens into the model's dtype), on rows of a request table wider than the length read, as the cache passes them;
* ``torch``: its torch reference, :func:`store_and_gather_native`;
* ``cat``: what DynamicCache does instead, two ``torch.cat`` of the tokens so far and the new ones (in the model's
  dtype whatever the cache's);
* ``ceiling``: the bytes the kvcore call must move (the rows read, the new rows read and stored, the outputs written,
  the locations read) at the measured device-copy rate.

kvcore's outputs are checked bit for bit against the reference's first.  Prints one table; ``--json`` writes the
rows.  ``--tiles`` / ``--warps`` / ``--heads`` time the kernel at other tile sizes (elements a program moves per step
of its head loop), warp counts and heads a step than the library's (:data:`~kvcore.kernels.head_gather._TILE_ELEMS`,
``_NUM_WARPS``, ``_HEADS_PER_TILE``), each checked too.

    python benchmarks/probe_store_gather_device.py [--tokens 100,4000,16000] [--batches 1,8] [--json PATH]
        [--tiles 2048,4096,8192] [--warps 4,8] [--heads 1,2]
    TRITON_INTERPRET=1 python benchmarks/probe_store_gather_device.py --check-only --tokens 5,37 --batches 1,3
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from kvcore.kernels import head_gather
from kvcore.kernels.head_gather import HeadGather, store_and_gather_native
from kvcore.tools.timing import copy_ceiling_gbps, graph_us

HEADS, DIM, PAGE = 8, 128, 16
MODEL_DTYPE = torch.bfloat16


def paged_locations(batch: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, width]`` int32 slots: each row's tokens in its own pages of :data:`PAGE` slots, the pages shuffled
    over the pool (slot 0, the padding, unused)."""
    pages_a_row = -(-width // PAGE)
    pages = torch.randperm(batch * pages_a_row, generator=gen).view(batch, pages_a_row) + 1
    slots = pages.repeat_interleave(PAGE, dim=1) * PAGE + torch.arange(PAGE).repeat(pages_a_row)
    return slots[:, :width].to(torch.int32)


@contextlib.contextmanager
def kernel_shape(tile: int | None, warps: int | None, heads: int | None):
    """Gathers built (and first called) inside use this tile size, warp count and heads a step (None: the
    library's)."""
    saved = head_gather._TILE_ELEMS, head_gather._NUM_WARPS, head_gather._HEADS_PER_TILE
    head_gather._TILE_ELEMS, head_gather._NUM_WARPS, head_gather._HEADS_PER_TILE = (
        tile or saved[0], warps or saved[1], heads or saved[2])
    try:
        yield
    finally:
        head_gather._TILE_ELEMS, head_gather._NUM_WARPS, head_gather._HEADS_PER_TILE = saved


def checked(cache_dtype: torch.dtype, batch: int, tokens: int, device: str, gen: torch.Generator,
            shapes=((None, None, None),)) -> dict:  # fmt: skip
    """A case's inputs, and kvcore's call at each kernel shape ``(tile, warps, heads)`` checked bit for bit against the
    reference (outputs and rows stored; storing the same rows again changes nothing)."""
    width = tokens + 256  # the request table's rows are wider than what is read
    rows = (batch * -(-width // PAGE) + 1) * PAGE
    k = (torch.randn(rows, HEADS, DIM, generator=gen) * 2).to(cache_dtype).to(device)
    v = (torch.randn(rows, HEADS, DIM, generator=gen) * 2).to(cache_dtype).to(device)
    table = paged_locations(batch, width, gen).to(device)
    k_new = torch.randn(batch, HEADS, 1, DIM, generator=gen).to(MODEL_DTYPE).to(device)
    v_new = torch.randn(batch, HEADS, 1, DIM, generator=gen).to(MODEL_DTYPE).to(device)
    k_ref, v_ref = k.clone(), v.clone()
    want = store_and_gather_native(k_ref, v_ref, table[:, :tokens], k_new, v_new, MODEL_DTYPE)
    gathers, exact = {}, {}
    for shape in shapes:
        with kernel_shape(*shape):
            gathers[shape] = HeadGather([k], [v], MODEL_DTYPE, use_triton=True)
            got = gathers[shape].store_and_gather(0, table, k_new, v_new, tokens)
        exact[shape] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip((*got, k, v), (*want, k_ref, v_ref)))  # fmt: skip
    return {"gathers": gathers, "k": k, "v": v, "table": table, "k_new": k_new, "v_new": v_new, "exact": exact}


def case(cache_dtype: torch.dtype, batch: int, tokens: int, ceiling_gbps: float, gen: torch.Generator,
         shapes=((None, None, None),)) -> dict:  # fmt: skip
    """One case's check and times (see the module docstring); ``kvcore`` at the first kernel shape, each other's
    time under ``kvcore_us_at``."""
    c = checked(cache_dtype, batch, tokens, "cuda", gen, shapes)
    k, v, table, k_new, v_new = c["k"], c["v"], c["table"], c["k_new"], c["v_new"]
    k_old = torch.randn(batch, HEADS, tokens - 1, DIM, generator=gen).to(MODEL_DTYPE).cuda()
    v_old = torch.randn(batch, HEADS, tokens - 1, DIM, generator=gen).to(MODEL_DTYPE).cuda()
    locs = table[:, :tokens]
    at = {}
    for shape, gather in c["gathers"].items():
        with kernel_shape(*shape):
            at[shape] = graph_us(lambda g=gather: g.store_and_gather(0, table, k_new, v_new, tokens))
    times = {
        "kvcore": at[shapes[0]],
        "torch": graph_us(lambda: store_and_gather_native(k, v, locs, k_new, v_new, MODEL_DTYPE)),
        "cat": graph_us(lambda: (torch.cat([k_old, k_new], -2), torch.cat([v_old, v_new], -2))),
    }
    cached, model = cache_dtype.itemsize, MODEL_DTYPE.itemsize
    moved = batch * HEADS * 2 * DIM * (tokens * cached + model + cached + tokens * model) + batch * tokens * 4
    times["ceiling"] = moved / (ceiling_gbps * 1e3)
    return {"cache_dtype": str(cache_dtype).removeprefix("torch."), "batch": batch, "tokens": tokens,
            "exact": all(c["exact"].values()), "mb_moved": moved / 1e6,
            **{f"{name}_us": us for name, us in times.items()},
            "kvcore_us_at": [{"tile": t, "warps": w, "heads": h, "us": us, "exact": c["exact"][t, w, h]}
                             for (t, w, h), us in at.items()]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="100,4000,16000", help="comma-separated lengths read (default %(default)s)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--tiles", default="", help="comma-separated tile sizes to time besides the library's")
    parser.add_argument("--warps", default="", help="comma-separated warp counts to time besides the library's")
    parser.add_argument("--heads", default="", help="comma-separated heads a step to time besides the library's")
    parser.add_argument("--check-only", action="store_true",
                        help="only check kvcore's calls against the reference, on the CPU too (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    batches, lengths = [int(b) for b in args.batches.split(",")], [int(t) for t in args.tokens.split(",")]
    cases = [(d, b, t) for d in (torch.bfloat16, torch.float8_e4m3fn) for b in batches for t in lengths]
    tiles = [None] + [int(x) for x in args.tiles.split(",") if x]
    warps = [None] + [int(x) for x in args.warps.split(",") if x]
    heads = [None] + [int(x) for x in args.heads.split(",") if x]
    shapes = [(t, w, h) for t in tiles for w in warps for h in heads]  # the library's first
    if args.check_only:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        bad = [c for c in cases if not all(checked(*c, device, gen, shapes)["exact"].values())]
        print(f"{len(cases) - len(bad)} of {len(cases)} cases exact on {device}" + (f"; differ: {bad}" if bad else ""))
        raise SystemExit(1 if bad else 0)
    if not torch.cuda.is_available():
        raise SystemExit("probe_store_gather_device: needs a CUDA device (it times CUDA-graph replays)")
    ceiling = copy_ceiling_gbps()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; device copy {ceiling:.0f} GB/s; {HEADS} KV "
          f"heads x {DIM}, pages of {PAGE}, one new token a row, out {MODEL_DTYPE}; us a call in CUDA-graph replay")
    head = (f"{'cache':<14} {'batch':>5} {'tokens':>6} {'exact':>5} {'MB':>7} {'kvcore':>8} {'torch':>8} {'cat':>8} "
            f"{'ceiling':>8} {'torch/kv':>8} {'cat/kv':>7} {'of ceil':>7}")  # fmt: skip
    print(head)
    rows = []
    for cache_dtype, batch, tokens in cases:
        r = case(cache_dtype, batch, tokens, ceiling, gen, shapes)
        rows.append(r)
        kv = r["kvcore_us"]
        print(f"{r['cache_dtype']:<14} {batch:>5} {tokens:>6} {str(r['exact']):>5} {r['mb_moved']:>7.2f} {kv:>8.2f} "
              f"{r['torch_us']:>8.2f} {r['cat_us']:>8.2f} {r['ceiling_us']:>8.2f} {r['torch_us'] / kv:>7.2f}x "
              f"{r['cat_us'] / kv:>6.2f}x {r['ceiling_us'] / kv:>7.2f}")  # fmt: skip
        for other in r["kvcore_us_at"][1:]:
            us = other["us"]
            shape = f"  tile {other['tile'] or 'lib'} w {other['warps'] or 'lib'} h {other['heads'] or 'lib'}"
            print(f"{shape:<27} {str(other['exact']):>5} {'':>7} {us:>8.2f} {'':>8} {'':>8} {'':>8} {kv / us:>7.2f}x "
                  f"{r['cat_us'] / us:>6.2f}x {r['ceiling_us'] / us:>7.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not all(r["exact"] for r in rows):
        raise SystemExit("probe_store_gather_device: kvcore's outputs differ from the reference's")


if __name__ == "__main__":
    main()
