"""Tile and warp sizes of the two quantizing stores of 128-value rows (issue 30), timed the way ``kvcore bench``
times them: device time per call in CUDA-graph replay (:func:`kvcore.tools.timing.graph_us`, 20 calls a graph), and
the share of the measured copy ceiling (:func:`kvcore.tools.timing.copy_ceiling_gbps`).

* DeepSeek-V4's indexer store (``kvcore_dsv4.kernels.IndexStore``): a bf16 key of 128 values read (256 bytes), its
  fp8 codes and float32 scale written (132 bytes), in pages of 64 slots; keys a program x warps.
* The MHA family's row store (``kvcore_mha.RowStore``) of one fp8 buffer, as MiniMax's keys-only index uses it: a
  bf16 row of 128 read, its fp8 cast written (384 bytes a token); elements a program x warps.

Each at N = 256 and 32768 tokens at random distinct slots; the shipped setting is marked ``*``.

    python benchmarks/tune_row_stores.py
"""

from __future__ import annotations

import torch

import kvcore_dsv4.kernels as dsv4
import kvcore_mha.row_store as row_store
from kvcore.tools.timing import copy_ceiling_gbps, graph_us

DIM, PAGE, POOL = 128, 64, 1 << 16


def main() -> None:
    ceiling = copy_ceiling_gbps()
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; copy ceiling {ceiling:.0f} GB/s; us per call in graph replay (share of "
          "the ceiling)")  # fmt: skip
    shipped = {"index": (dsv4._INDEX_BLOCK_N, dsv4._INDEX_NUM_WARPS),
               "rows": (row_store.FP8_TILE_ELEMS, row_store._FP8_NUM_WARPS)}  # fmt: skip
    for n in (256, 32768):
        loc = (torch.randperm(POOL - PAGE, generator=gen)[:n] + PAGE).cuda()
        x = torch.randn(n, DIM, generator=gen).to("cuda", torch.bfloat16)

        # DeepSeek-V4's indexer store
        buf = torch.zeros(POOL // PAGE, PAGE * (DIM + 4), dtype=torch.uint8, device="cuda")
        for block in (4, 8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                dsv4._INDEX_BLOCK_N, dsv4._INDEX_NUM_WARPS = block, warps
                store = dsv4.IndexStore()
                us = graph_us(lambda: store(buf, loc, x, PAGE))
                mark = "*" if (block, warps) == shipped["index"] else " "
                print(f"dsv4 index store     N={n:6}{mark} keys/program {block:3} warps {warps}: {us:7.2f} us "
                      f"({n * (2 * DIM + DIM + 4) / us / 1e3 / ceiling:.2f})")  # fmt: skip
        dsv4._INDEX_BLOCK_N, dsv4._INDEX_NUM_WARPS = shipped["index"]

        # the row store of one fp8 buffer (MiniMax's keys-only index)
        cache = torch.zeros(1, POOL, 1, DIM, dtype=torch.uint8, device="cuda")
        rows = x.view(n, 1, DIM)
        for tile in (512, 1024, 2048, 4096, 8192):
            for warps in (1, 2, 4, 8):
                row_store.FP8_TILE_ELEMS, row_store._FP8_NUM_WARPS = tile, warps
                store = row_store.RowStore([cache], torch.float8_e4m3fn, True)
                us = graph_us(lambda: store(0, loc, rows))
                mark = "*" if (tile, warps) == shipped["rows"] else " "
                print(f"fp8 row store (128)  N={n:6}{mark} elems/program {tile:5} warps {warps}: {us:7.2f} us "
                      f"({n * 3 * DIM / us / 1e3 / ceiling:.2f})")  # fmt: skip
        row_store.FP8_TILE_ELEMS, row_store._FP8_NUM_WARPS = shipped["rows"]


if __name__ == "__main__":
    main()
