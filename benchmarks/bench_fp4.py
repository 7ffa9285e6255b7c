"""Block-scaled KV caches on a GPU (issue: FP4 / MXFP8 caches): quantize-store and dequantize-gather by location.

For each format (``fp4_e2m1``, ``nvfp4``, ``mxfp8``): Llama-3-8B-sized K/V rows (8 KV heads x 128, bf16 in and
out), a pool of 200k tokens, ``N`` random distinct locations.  Per format and size:

- correctness first: after the store, the Triton pool's codes and scales at those rows equal the torch pool's,
  and the gather of the same rows is bit-equal (``ok``); a row that is not ok is still timed, and flagged;
- device time of one store and one gather in CUDA-graph replay (median, :func:`kvcore.tools.bench.graph_us`), the
  torch path (``kernels="native"``) beside, and the share of the measured copy ceiling on the bytes the call
  must move (bf16 K and V, codes and scales, the locations);
- then the gathered read of 4096 rows set against SGLang's whole-layer dequantize of the same layer
  (``get_key_buffer`` + ``get_value_buffer``: every row of the pool), both with ``triton.testing.do_bench``.

``--tile TxW`` sets the tokens per program and warps used from ``LARGE_FROM`` tokens on, in both directions
and every format (``TxWxrows``: programs of whole rows, every head of their tokens; a sweep point; without it
the tiles chosen in ``kvcore_fp4.kernels.LARGE_TILES``).

    python benchmarks/bench_fp4.py [--formats nvfp4,mxfp8] [--sizes 1,64,32768] [--tile 16]
"""

from __future__ import annotations

import argparse
import sys

import torch

HEADS, HEAD_DIM = 8, 128  # Llama-3-8B
POOL_TOKENS = 200_000
FORMATS = ("fp4_e2m1", "nvfp4", "mxfp8")
SIZES = (1, 8, 64, 256, 4096, 32768)
READ_OF_WHOLE = 4096  # rows of the gathered read set against the whole-layer dequantize


def make_pools(kv_format: str, device: str, pool_tokens: int = POOL_TOKENS):
    """``(triton pool, torch pool)`` of one format, two layers; nvfp4 gets a calibrated global scale."""
    from kvcore_fp4.pool import MHATokenToKVPoolFP4

    args = dict(size=pool_tokens, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=2,
                device=device, enable_memory_saver=False, kv_format=kv_format)  # fmt: skip
    pools = MHATokenToKVPoolFP4(kernels="triton", **args), MHATokenToKVPoolFP4(kernels="native", **args)
    if pools[0].global_scale is not None:
        for pool in pools:  # amax / (6 x 448) of rows drawn as below (|x| < 6 sigma = 24)
            pool.set_kv_global_scale(1, 24 / (6 * 448), 24 / (6 * 448))
    return pools


def inputs(n: int, pool_tokens: int, device: str, seed: int):
    """Random bf16 K and V ``[n, 8, 128]`` (normal, sigma 4) and ``n`` distinct locations in ``1 .. pool_tokens``."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, HEADS, HEAD_DIM, generator=g) * 4).to(torch.bfloat16).to(device)
    v = (torch.randn(n, HEADS, HEAD_DIM, generator=g) * 4).to(torch.bfloat16).to(device)
    loc = (torch.randperm(pool_tokens, generator=g)[:n] + 1).to(device)
    return k, v, loc


def same_rows(fast, ref, loc: torch.Tensor) -> bool:
    """The two pools' codes and scales of layer 1 at ``loc``, byte for byte, and their gathers, bit for bit."""
    for name, buf in fast.token_buffers().items():
        if not torch.equal(buf[1, loc], ref.token_buffers()[name][1, loc]):
            return False
    got, want = fast.get_kv_buffer_by_loc(1, loc), ref.get_kv_buffer_by_loc(1, loc)
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))


def bytes_moved(kv_format: str, n: int) -> int:
    """What a store (or a gather) of ``n`` rows must read and write: bf16 K and V, their codes and scales, the
    int64 locations."""
    from kvcore_fp4.formats import RECIPES

    r = RECIPES[kv_format]
    per_row = HEADS * (2 * HEAD_DIM + r.data_bytes(HEAD_DIM) + r.scale_bytes(HEAD_DIM))
    return n * (2 * per_row + 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--tile", default=None,
                        help="TOKENSxWARPS[xrows] a program from LARGE_FROM tokens on (xrows: whole rows), e.g. 16x1")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp4 times kernels on a GPU; this machine has no CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    import kvcore_fp4.kernels as kernels
    from kvcore.tools.bench import copy_ceiling_gbps, graph_us

    if args.tile is not None:
        tokens, warps, *rows = args.tile.split("x")
        tile = (int(tokens), int(warps), rows == ["rows"])
        kernels.LARGE_TILES = {key: tile for key in kernels.LARGE_TILES}
    formats = args.formats.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    ceiling = copy_ceiling_gbps()
    print(f"bench_fp4 on {torch.cuda.get_device_name()} (torch {torch.__version__}); copy ceiling {ceiling:.0f} GB/s; "
          f"tiles (tokens, warps, whole rows) from {kernels.LARGE_FROM} tokens: {kernels.LARGE_TILES}")  # fmt: skip
    print("device us per call in CUDA-graph replay: kvcore / torch path, torch/kvcore, share of the copy ceiling")
    print(f"{'format':<9} {'op':<7} {'N':>6} {'kvcore':>9} {'torch':>10} {'x torch':>8} {'of ceil':>8} {'ok':>4}")
    for kv_format in formats:
        fast, ref = make_pools(kv_format, "cuda")
        for n in sizes:
            k, v, loc = inputs(n, POOL_TOKENS, "cuda", seed=n)
            for pool in (fast, ref):
                pool.set_kv_buffer(1, loc, k, v)
            ok = same_rows(fast, ref, loc)
            moved = bytes_moved(kv_format, n)
            for op, call in (("store", lambda p: lambda: p.set_kv_buffer(1, loc, k, v)),
                             ("gather", lambda p: lambda: p.get_kv_buffer_by_loc(1, loc))):  # fmt: skip
                ours, theirs = graph_us(call(fast)), graph_us(call(ref))
                share = moved / (ours * 1e-6) / 1e9 / ceiling
                print(f"{kv_format:<9} {op:<7} {n:>6} {ours:>9.2f} {theirs:>10.2f} {theirs / ours:>8.1f} {share:>8.2f} "
                      f"{str(ok):>4}")  # fmt: skip
        read = inputs(READ_OF_WHOLE, POOL_TOKENS, "cuda", seed=1)[2]
        gathered = do_bench(lambda: fast.get_kv_buffer_by_loc(1, read), return_mode="median") * 1e3
        whole = do_bench(lambda: (ref.get_key_buffer(1), ref.get_value_buffer(1)), return_mode="median") * 1e3
        print(f"{kv_format:<9} gathered read of {READ_OF_WHOLE} rows of {POOL_TOKENS}: {gathered:.2f} us; "
              f"whole-layer dequantize (SGLang's accessors): {whole:.1f} us; {whole / gathered:.0f}x")  # fmt: skip
        del fast, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
