"""GPU correctness and timing of the MLA and DSA pools' hot paths, in one run.

    python benchmarks/bench_mla_dsa.py [--out DIR]

Checks the compiled kernels against the torch reference path on the GPU (a Triton pool and a native pool
fed the same random inputs must hold the same bytes; DSA rows must equal the quantized concatenated row;
gathers in every destination dtype; indexer set/get at page boundaries; CUDA-graph capture), then times
every op beside the torch path and the measured device-copy ceiling, inside CUDA-graph replay.
Dimensions: DeepSeek-V3 latent rows (kv_lora_rank 512 + rope 64), DSA indexer keys of 128 dims.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

from bench_mha import check, copy_ceiling, finish, graph_time_us, row, same_size_copy_us
from kvcore_dsa import kernels as dsa_kernels
from kvcore_dsa.pool import DSATokenToKVPool
from kvcore_mla.pool import MLATokenToKVPool

RANK, ROPE, INDEX_DIM, PAGE = 512, 64, 128, 64


def mla_pool(kernels: str, dtype=torch.bfloat16, size: int = 1 << 16, layers: int = 1) -> MLATokenToKVPool:
    return MLATokenToKVPool(size=size, page_size=1, dtype=dtype, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                            layer_num=layers, device="cuda", enable_memory_saver=False, kernels=kernels)


def dsa_pool(kernels: str, dtype=torch.float8_e4m3fn, size: int = 1 << 16, layers: int = 1) -> DSATokenToKVPool:
    return DSATokenToKVPool(size=size, page_size=PAGE, kv_lora_rank=RANK, dtype=dtype, qk_rope_head_dim=ROPE,
                            layer_num=layers, device="cuda", index_head_dim=INDEX_DIM, enable_memory_saver=False,
                            kernels=kernels)


def parts(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """nope and rope as strided views of one projection output (as an engine produces them)."""
    full = torch.randn(n, 1, RANK + ROPE + 32, device="cuda", generator=g).to(torch.bfloat16) * 3
    return full[..., :RANK], full[..., RANK : RANK + ROPE]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def fill_same(a, b, g) -> None:
    for name, buf in a.buffers().items():
        raw = torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8, device="cuda", generator=g)
        buf.view(torch.uint8).copy_(raw)
        b.buffers()[name].view(torch.uint8).copy_(raw)


def correctness() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for make, dtype in ((mla_pool, torch.bfloat16), (mla_pool, torch.float8_e4m3fn), (dsa_pool, torch.float8_e4m3fn),
                        (dsa_pool, torch.bfloat16)):
        name = f"{make.__name__[:3]} {str(dtype).removeprefix('torch.')}"
        fast, ref = make("triton", dtype, size=8192, layers=2), make("native", dtype, size=8192, layers=2)
        fill_same(fast, ref, g)
        for n in (1, 33, 4099):
            loc = torch.randperm(8191, device="cuda", generator=g)[:n] + 1
            nope, rope = parts(n, g)
            fast.set_mla_kv_buffer(1, loc, nope, rope)
            ref.set_mla_kv_buffer(1, loc, nope, rope)
            check(f"{name} set_mla_kv_buffer n={n}", same_bytes(fast.kv_cache, ref.kv_cache), "triton == torch, bytes")
            if make is dsa_pool and dtype == torch.float8_e4m3fn:
                want = dsa_kernels.quantize_concatenated(torch.cat([nope, rope], -1).reshape(n, -1), RANK)
                check(f"{name} split == concatenated quantization n={n}",
                      same_bytes(fast.kv_cache[1, loc].reshape(n, -1), want.reshape(n, -1)))
            for dst in (torch.bfloat16, torch.float16, torch.float32):
                a, b = fast.get_mla_kv_buffer(1, loc, dst), ref.get_mla_kv_buffer(1, loc, dst)
                check(f"{name} get_mla_kv_buffer -> {str(dst).removeprefix('torch.')} n={n}",
                      same_bytes(a[0], b[0]) and same_bytes(a[1], b[1]))
        if make is dsa_pool:
            for seq_len in (63, 64, 65, 129, 4099):
                pages = torch.randperm(8192 // PAGE, device="cuda", generator=g)[: triton.cdiv(seq_len, PAGE)] + 1
                loc = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:seq_len]
                keys = torch.randint(0, 256, (seq_len, INDEX_DIM), dtype=torch.uint8, device="cuda", generator=g)
                scales = torch.rand(seq_len, device="cuda", generator=g) + 0.01
                for pool in (fast, ref):
                    pool.set_index_k_scale_buffer(1, loc, keys.view(torch.float8_e4m3fn), scales)
                got = fast.get_index_k_scale_buffer(1, seq_len, pages)
                want = ref.get_index_k_scale_buffer(1, seq_len, pages)
                check(f"{name} indexer set/get seq_len={seq_len}",
                      all(same_bytes(x, y) for x, y in zip(got, want)) and same_bytes(got[0].reshape(seq_len, -1), keys))
    # CUDA graph: DSA quantize-store and MLA store replayed on new inputs
    pool, mla = dsa_pool("triton", size=8192), mla_pool("triton", size=8192)
    loc = torch.arange(1, 65, device="cuda")
    nope, rope = parts(64, g)
    pool.set_mla_kv_buffer(0, loc, nope, rope)
    mla.set_mla_kv_buffer(0, loc, nope, rope)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_mla_kv_buffer(0, loc, nope, rope)
        mla.set_mla_kv_buffer(0, loc, nope, rope)
    fresh_nope, fresh_rope = parts(64, g)
    nope.copy_(fresh_nope)
    rope.copy_(fresh_rope)
    graph.replay()
    torch.cuda.synchronize()
    want = dsa_kernels.quantize_concatenated(torch.cat([nope, rope], -1).reshape(64, -1), RANK)
    check("cuda graph DSA + MLA store", same_bytes(pool.kv_cache[0, loc].reshape(64, -1), want.reshape(64, -1))
          and same_bytes(mla.kv_cache[0, loc].reshape(64, -1), torch.cat([nope, rope], -1).reshape(64, -1)))


def timings(ceiling: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    size = 1 << 16
    # name: (pool maker, cache dtype, store label, gather label, bytes of one cache row)
    kinds = {
        "mla": (mla_pool, torch.bfloat16, "MLA store bf16", "MLA gather -> bf16", (RANK + ROPE) * 2),
        "mla-fp8": (mla_pool, torch.float8_e4m3fn, "MLA store fp8 e4m3", "MLA fp8 gather -> bf16", RANK + ROPE),
        "dsa": (dsa_pool, torch.float8_e4m3fn, "DSA fp8 quantize+store", "DSA dequant gather -> bf16", 656),
    }
    pools = {name: (make("triton", dtype, size=size), make("native", dtype, size=size))
             for name, (make, dtype, *_) in kinds.items()}
    for n in (1, 64, 32768):
        loc = torch.randperm(size - 1, device="cuda", generator=g)[:n] + 1
        nope, rope = parts(n, g)
        for name, (fast, ref) in pools.items():
            _, _, store_label, gather_label, out_row = kinds[name]
            ours = graph_time_us(lambda: fast.set_mla_kv_buffer(0, loc, nope, rope), 4)
            base = graph_time_us(lambda: ref.set_mla_kv_buffer(0, loc, nope, rope), 4)
            moved = n * ((RANK + ROPE) * 2 + out_row + 8)
            note = f"same-size copy {same_size_copy_us(moved):.2f} us" if n >= 4096 else ""
            row(store_label, f"{n} tok", ours, base, moved, ceiling, note)
            if n >= 64:
                ours = graph_time_us(lambda: fast.get_mla_kv_buffer(0, loc, torch.bfloat16), 4)
                base = graph_time_us(lambda: ref.get_mla_kv_buffer(0, loc, torch.bfloat16), 4)
                row(gather_label, f"{n} tok", ours, base, moved, ceiling, note)
    # move_kv_cache of decode-sized sets over all 61 DeepSeek layers (DSA: latent rows plus indexer keys/scales)
    del pools
    for label, make, dtype, token_bytes in (("MLA", mla_pool, torch.bfloat16, (RANK + ROPE) * 2),
                                            ("DSA", dsa_pool, torch.float8_e4m3fn, 656 + INDEX_DIM + 4)):
        fast, ref = make("triton", dtype, size=size, layers=61), make("native", dtype, size=size, layers=61)
        perm = torch.randperm(size - PAGE, device="cuda", generator=g) + PAGE
        for n in (16, 4096):
            src, tgt = perm[:n], perm[n : 2 * n]
            ours = graph_time_us(lambda: fast.move_kv_cache(tgt, src), 2)
            base = graph_time_us(lambda: ref.move_kv_cache(tgt, src), 2)
            row(f"{label} move_kv_cache x 61 layers", f"{n} slots", ours, base, 2 * n * 61 * token_bytes, ceiling)
        del fast, ref
    fast, ref = dsa_pool("triton", size=size), dsa_pool("native", size=size)
    for n in (64, 32768):
        pages = torch.randperm(size // PAGE, device="cuda", generator=g)[: triton.cdiv(n, PAGE)] + 1
        loc = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:n]
        keys = torch.randint(0, 256, (n, INDEX_DIM), dtype=torch.uint8, device="cuda", generator=g).view(torch.float8_e4m3fn)
        scales = torch.rand(n, device="cuda", generator=g) + 0.01
        moved = 2 * n * (INDEX_DIM + 4) + n * 8
        ours = graph_time_us(lambda: fast.set_index_k_scale_buffer(0, loc, keys, scales), 4)
        base = graph_time_us(lambda: ref.set_index_k_scale_buffer(0, loc, keys, scales), 4)
        row("indexer set (fp8 keys + scales)", f"{n} tok", ours, base, moved, ceiling)
        ours = graph_time_us(lambda: fast.get_index_k_scale_buffer(0, n, pages), 4)
        base = graph_time_us(lambda: ref.get_index_k_scale_buffer(0, n, pages), 4)
        row("indexer get (keys + scales)", f"seq {n}", ours, base, moved, ceiling)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla_dsa needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    correctness()
    ceiling = copy_ceiling()
    print(f"device copy ceiling: {ceiling:.3f} TB/s (read + write)")
    timings(ceiling)
    finish(args.out, "bench_mla_dsa", ceiling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
