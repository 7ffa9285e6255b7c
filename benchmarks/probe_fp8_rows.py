"""Where the time of the fp8 row store of one 128-wide buffer goes (MiniMax's keys-only index, issue 30): the shipped
:class:`kvcore_mha.RowStore` beside minimal one-buffer kernels that differ from it in one thing each, timed the way
``kvcore bench`` times (device time per call in CUDA-graph replay, 20 calls a graph), as shares of the measured copy
ceiling.  A probe, not a product path: it tells which part of the shipped kernel costs what.

* ``rowstore``: the shipped ``RowStore([cache], float8_e4m3fn)`` (its fp8 tile's elements x warps swept);
* ``tile``: one buffer through the shipped tile function (``kvcore_mha.kernels._store_tile``) without RowStore's
  three-buffer dispatch;
* ``encode``: a minimal kernel (no column mask, no layer offset) with the shipped encoder
  (``f32_to_fp8_bits_hw``: the GPU's conversion plus torch's overflow and NaN patches);
* ``branch``: the same with a candidate encoder: the patches (in int32) run only in a tile that holds a NaN or a
  magnitude past 464 (one integer max an element finds out), the GPU's conversion alone otherwise (put in the product
  it failed the compiled suite, RESULTS.md, seventeenth session: kept as a cost probe only);
* ``finite``: the same with the values clamped to +-448 and the GPU's conversion alone (NaN differs: a cost probe);
* ``copy``: the same rows as bf16 into a bf16 buffer (the scatter's own cost, no conversion);
* ``dsv4``: DeepSeek-V4's indexer store (``IndexStore``, shipped setting), which also computes a scale a row.

Correctness first: the shipped store must write torch's bytes, and ``tile``, ``encode`` and ``branch`` the shipped
store's (``x`` holds values past 448, NaN of both signs and +-inf).  A probe's data is no proof of an encoder: two
cheaper encoders passed this check and failed the compiled suite (RESULTS.md, sixteenth session), and ``branch`` a
third (seventeenth session).

    python benchmarks/probe_fp8_rows.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kvcore_dsv4.kernels as dsv4
import kvcore_mha.row_store as row_store
from kvcore.kernels import dtypes
from kvcore.kernels.fp8 import f32_to_fp8_bits_hw, finite_f32_to_e4m3fn_bytes, torch_e4m3fn_saturates
from kvcore.tools.timing import copy_ceiling_gbps, graph_us
from kvcore_mha.kernels import _store_tile

DIM, POOL, N = 128, 1 << 16, 32768


@triton.jit
def _encode_branch(x, SATURATE: tl.constexpr):
    """A candidate: the shipped encoder's patches (``f32_to_fp8_bits_hw``, in int32) only in a tile that needs them
    (NaN's bits lie above every other magnitude's)."""
    r = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    worst = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    if SATURATE:
        odd = worst > 0x7F800000
    else:
        odd = worst > 0x43E80000
    if odd:
        sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.int32)
        if not SATURATE:
            r = tl.where(tl.abs(x) > 464.0, sign | 0x7F, r)
        r = tl.where(x != x, sign | 0x7F, r)
    return r


@triton.jit
def _probe_kernel(dst, src, loc_ptr, n, D: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
                  SATURATE: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = offs < n
    rows = tl.load(loc_ptr + offs, mask=keep, other=0).to(tl.int64)
    cols = tl.arange(0, D)
    x = tl.load(src + offs.to(tl.int64)[:, None] * D + cols[None, :], mask=keep[:, None], other=0)
    out = dst + rows[:, None] * D + cols[None, :]
    if MODE == 0:
        tl.store(out, f32_to_fp8_bits_hw(x.to(tl.float32), 4, SATURATE).to(tl.uint8), mask=keep[:, None])
    elif MODE == 4:
        tl.store(out, _encode_branch(x.to(tl.float32), SATURATE).to(tl.uint8), mask=keep[:, None])
    elif MODE == 1:
        q = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        tl.store(out, finite_f32_to_e4m3fn_bytes(q, SATURATE, True), mask=keep[:, None])
    else:
        tl.store(out, x, mask=keep[:, None])


@triton.jit
def _tile_kernel(dst, src, loc_ptr, n, D: tl.constexpr, BLOCK_N: tl.constexpr, OUT: tl.constexpr,
                 SATURATE: tl.constexpr):  # fmt: skip
    _store_tile(dst, src, loc_ptr, 1, loc_ptr, n, tl.program_id(0), 0, D, D, 1, loc_ptr, 1.0, D, D, D, True, OUT,
                SATURATE, 0, BLOCK_N, D, True, False, 1, 0)  # fmt: skip


def main() -> None:
    ceiling = copy_ceiling_gbps()
    saturate = torch_e4m3fn_saturates()
    gen = torch.Generator().manual_seed(0)
    loc = (torch.randperm(POOL - 64, generator=gen)[:N] + 64).cuda()
    x = torch.randn(N, DIM, generator=gen) * 100
    x[0, :6] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 500.0, -500.0])
    x = x.to("cuda", torch.bfloat16)
    fp8 = torch.zeros(POOL, DIM, dtype=torch.uint8, device="cuda")
    bf16 = torch.zeros(POOL, DIM, dtype=torch.bfloat16, device="cuda")
    out_code = dtypes.conversion_code(torch.bfloat16, torch.float8_e4m3fn)
    fp8_bytes, bf16_bytes = N * 3 * DIM, N * 4 * DIM
    print(f"{torch.cuda.get_device_name()}; copy ceiling {ceiling:.0f} GB/s; {N} rows of {DIM} at random slots; us per "
          "call in graph replay (share of the ceiling)")  # fmt: skip

    shipped = torch.zeros(1, POOL, 1, DIM, dtype=torch.uint8, device="cuda")
    row_store.RowStore([shipped], torch.float8_e4m3fn, True)(0, loc, x.view(N, 1, DIM))
    want = shipped[0, :, 0]
    assert torch.equal(want[loc], x.to(torch.float8_e4m3fn).view(torch.uint8)), "RowStore differs from torch's cast"
    for name, launch in (("tile", lambda: _tile_kernel[(N // 32,)](fp8, x, loc, N, DIM, 32, out_code, saturate)),
                         ("encode", lambda: _probe_kernel[(N // 32,)](fp8, x, loc, N, DIM, 32, 0, saturate))):  # fmt: skip
        fp8.zero_()
        launch()
        torch.cuda.synchronize()
        assert torch.equal(fp8, want), f"{name} writes other bytes than the shipped RowStore"
    print("tile and encode write the shipped store's bytes")
    for block in (8, 32):
        fp8.zero_()
        _probe_kernel[(N // block,)](fp8, x, loc, N, DIM, block, 4, saturate)
        torch.cuda.synchronize()
        bad = (fp8 != want).sum().item()
        print(f"branch ({block} rows a program): " + ("the shipped store's bytes" if not bad else f"{bad} BYTES DIFFER"))

    def report(name: str, setting: str, us: float, nbytes: int) -> None:
        print(f"{name:9} {setting:24} {us:7.2f} us ({nbytes / us / 1e3 / ceiling:.2f})")

    for tile in (1024, 2048, 4096):
        for warps in (1, 2, 4, 8):
            row_store.FP8_TILE_ELEMS, row_store._FP8_NUM_WARPS = tile, warps
            store = row_store.RowStore([shipped], torch.float8_e4m3fn, True)
            report("rowstore", f"{tile // DIM} rows x {warps} warps", graph_us(lambda: store(0, loc, x.view(N, 1, DIM))),
                   fp8_bytes)  # fmt: skip
    for block in (8, 16, 32, 64):
        grid = (triton.cdiv(N, block),)
        for warps in (1, 2, 4, 8):
            setting = f"{block} rows x {warps} warps"
            report("tile", setting, graph_us(lambda: _tile_kernel[grid](fp8, x, loc, N, DIM, block, out_code, saturate,
                                                                        num_warps=warps)), fp8_bytes)  # fmt: skip
            for mode, name, buf, nbytes in ((0, "encode", fp8, fp8_bytes), (4, "branch", fp8, fp8_bytes),
                                            (1, "finite", fp8, fp8_bytes),
                                            (2, "copy", bf16, bf16_bytes)):  # fmt: skip
                report(name, setting, graph_us(lambda: _probe_kernel[grid](buf, x, loc, N, DIM, block, mode, saturate,
                                                                           num_warps=warps)), nbytes)  # fmt: skip
    paged = torch.zeros(POOL // 64, 64 * (DIM + 4), dtype=torch.uint8, device="cuda")
    index = dsv4.IndexStore()
    report("dsv4", f"{dsv4._INDEX_BLOCK_N} rows x {dsv4._INDEX_NUM_WARPS} warps",
           graph_us(lambda: index(paged, loc, x, 64)), N * (2 * DIM + DIM + 4))  # fmt: skip


if __name__ == "__main__":
    main()
