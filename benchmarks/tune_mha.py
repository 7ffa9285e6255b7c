"""Tile and warp sweep for the MHA store and large-move kernels on a GPU (prints one table).

    python benchmarks/tune_mha.py

The chosen defaults live in ``kvcore_mha.kernels`` (STORE_TILE_ELEMS, STORE_COPY_TILE_ELEMS, _STORE_NUM_WARPS)
and ``kvcore.kernels.row_move`` (_COPY_TILE_WORDS, _COPY_NUM_WARPS); this script shows the neighbourhood they were
picked from.
"""

from __future__ import annotations

import itertools

import torch

from bench_mha import DIM, HEADS, LAYERS, copy_ceiling, graph_time_us
from kvcore.kernels import row_move
from kvcore_mha import kernels


def main() -> None:
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.3f} TB/s")
    n = 32768
    rows = 65537
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        store = torch.uint8 if dtype.itemsize == 1 else dtype
        k = torch.zeros(1, rows, HEADS, DIM, dtype=store, device="cuda")
        v = torch.zeros_like(k)
        loc = torch.randperm(rows - 1, device="cuda")[:n] + 1
        ck = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        moved = 2 * n * HEADS * DIM * (2 + dtype.itemsize) + n * 8
        for tile, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8)):
            kernels.STORE_TILE_ELEMS = kernels.STORE_COPY_TILE_ELEMS = tile
            kernels._STORE_NUM_WARPS = warps
            us = graph_time_us(lambda: kernels.store_kv_triton(k, v, 0, loc, ck, ck, cache_dtype=dtype), 4)
            print(f"store {dtype} 32k tile={tile} warps={warps}: {us:.1f} us {moved / us / 1e6 / ceiling:.3f} of ceiling")
        del k, v
    k = torch.zeros(LAYERS, 1 << 15, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    for n in (1024, 4096):
        perm = torch.randperm((1 << 15) - 1, device="cuda") + 1
        moved = 2 * n * HEADS * DIM * 2 * LAYERS * 2
        for tile, warps in itertools.product((4096, 8192, 16384), (4, 8, 16)):
            row_move._COPY_TILE_WORDS, row_move._COPY_NUM_WARPS = tile, warps
            for pattern, (tgt, src) in {"disjoint": (perm[n : 2 * n], perm[:n]), "shift": (perm[:n], perm[1 : n + 1])}.items():
                us = graph_time_us(lambda: row_move.move_rows_triton(k, v, tgt, src), 2)
                print(f"move {pattern} {n} tile={tile} warps={warps}: {us:.1f} us {moved / us / 1e6 / ceiling:.3f} of ceiling")


if __name__ == "__main__":
    main()
