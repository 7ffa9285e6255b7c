"""Tile and warp sweep for the MLA store/gather and the DSA quantize-store/dequant-gather kernels on a GPU.

    python benchmarks/tune_mla_dsa.py

Times each kernel at 32k tokens of DeepSeek-V3 rows (512 + 64) inside CUDA-graph replay, for every setting
of its tuning constants, and prints the share of the measured copy ceiling, then the best setting per
kernel.  The chosen defaults live in ``kvcore_mla.kernels`` (TILE_ELEMS, COPY_TILE_ELEMS, MAX_BLOCK_C,
ELEMS_PER_WARP; the MLA kernels are swept at 1, 64 and 32k tokens, with the decode-size row kernel that stores up to
ROW_KERNEL_MAX_TOKENS tokens turned off, so every size runs the tiles these constants shape) and
``kvcore_dsa.scaled_rows`` (_STORE_BLOCK_N, _STORE_NUM_WARPS, _GATHER_BLOCK_N, _GATHER_NUM_WARPS); this script shows
the neighbourhood they were picked from.
"""

from __future__ import annotations

import itertools

import torch

from bench_mha import copy_ceiling, graph_time_us, same_size_copy_us
from kvcore_dsa.layout import scaled_row_bytes
from kvcore_dsa import scaled_rows as dsa
from kvcore_mla import kernels as mla

RANK, ROPE, N, ROWS = 512, 64, 32768, 65537


def sweep(name: str, settings, apply, op, moved: int, ceiling: float) -> None:
    """Time ``op`` under every setting (``apply(setting)`` installs it) and print the best, beside a plain
    copy of the same bytes (small transfers do not reach the 1 GiB copy rate)."""
    results = []
    for setting in settings:
        apply(setting)
        us = graph_time_us(op, 4)
        share = moved / us / 1e6 / ceiling
        results.append((share, setting, us))
        print(f"{name} {setting}: {us:.2f} us {share:.3f} of ceiling", flush=True)
    share, setting, us = max(results)
    apply(setting)
    copy_us = same_size_copy_us(moved)
    print(f"BEST {name} {setting}: {us:.2f} us {share:.3f} of ceiling; a copy of the same {moved / 1e6:.1f} MB "
          f"takes {copy_us:.2f} us ({copy_us / us:.3f} of it)", flush=True)


def main() -> None:
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.3f} TB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    loc = torch.randperm(ROWS - 1, device="cuda", generator=g)[:N] + 1
    # nope and rope as strided views of one projection output, as an engine produces them
    full = torch.randn(N, 1, RANK + ROPE + 32, device="cuda", generator=g).to(torch.bfloat16)
    nope, rope = full[..., :RANK], full[..., RANK : RANK + ROPE]
    nope_out = torch.empty(N, 1, RANK, device="cuda", dtype=torch.bfloat16)
    rope_out = torch.empty(N, 1, ROPE, device="cuda", dtype=torch.bfloat16)

    mla.ROW_KERNEL_MAX_TOKENS = 0  # the tiles at every size (each call builds its own launch keys)

    def mla_apply(setting):
        mla.COPY_TILE_ELEMS = mla.TILE_ELEMS = setting[0]
        mla.MAX_BLOCK_C, mla.ELEMS_PER_WARP, mla.MAX_WARPS = setting[1], setting[2], 8

    # (elements per program, widest column tile, elements per warp); bf16, the dtype of the decode targets,
    # at decode sizes and at 32k tokens
    mla_settings = list(itertools.product((2048, 4096, 8192), (128, 256, 512), (512, 1024, 2048)))
    cache = torch.zeros(1, ROWS, 1, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    for n in (1, 64, N):
        moved = n * ((RANK + ROPE) * 4 + 8)
        sweep(f"mla store bf16 N={n}", mla_settings, mla_apply,
              lambda: mla.store_nope_rope_triton(cache, 0, loc[:n], nope[:n], rope[:n], cache_dtype=torch.bfloat16),
              moved, ceiling)
        sweep(f"mla gather bf16 N={n}", mla_settings, mla_apply,
              lambda: mla.gather_nope_rope_triton(cache, 0, loc[:n], nope_out[:n], rope_out[:n], cache_dtype=torch.bfloat16),
              moved, ceiling)  # fmt: skip
    del cache

    width = scaled_row_bytes(RANK, ROPE)
    cache = torch.zeros(1, ROWS, 1, width, dtype=torch.uint8, device="cuda")
    moved = N * ((RANK + ROPE) * 2 + width + 8)
    dsa_settings = list(itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)))

    def store_apply(setting):
        dsa._STORE_BLOCK_N, dsa._STORE_NUM_WARPS = setting

    def gather_apply(setting):
        dsa._GATHER_BLOCK_N, dsa._GATHER_NUM_WARPS = setting

    kw = {"kv_lora_rank": RANK, "qk_rope_head_dim": ROPE}
    sweep("dsa quantize+store", dsa_settings, store_apply,
          lambda: dsa.store_dsa_fp8_triton(cache, 0, loc, nope, rope, **kw), moved, ceiling)
    sweep("dsa dequant gather->bf16", dsa_settings, gather_apply,
          lambda: dsa.gather_dsa_fp8_triton(cache, 0, loc, nope_out, rope_out, **kw), moved, ceiling)
    del cache


if __name__ == "__main__":
    main()
