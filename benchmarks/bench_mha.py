"""GPU correctness and timing of the core + MHA hot paths, in one run.

    python benchmarks/bench_mha.py [--out DIR] [--quick]

First checks every compiled kernel against its torch reference on the GPU (random data, odd sizes,
overlapping moves, fp8, CUDA-graph capture), then times each op beside the torch path and the measured
device-copy ceiling, and prints one table (also written as JSON to ``--out``).  Needs a CUDA device.
Decode-sized ops are timed inside CUDA-graph replay; everything else with ``triton.testing.do_bench``
(median).  Model dimensions: one Llama-3-8B layer (8 KV heads x 128, bf16) unless stated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

from kvcore.kernels import row_move
from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore_mha import kernels
from kvcore_mha.pool import MHATokenToKVPool

HEADS, DIM, LAYERS = 8, 128, 32
ROWS: list[dict] = []


def row(op: str, size: str, ours_us: float, torch_us: float | None, moved_bytes: int | None, ceiling: float, note: str = ""):
    tbps = moved_bytes / (ours_us * 1e-6) / 1e12 if moved_bytes else None
    entry = {
        "op": op, "size": size, "kvcore_us": round(ours_us, 2),
        "torch_us": None if torch_us is None else round(torch_us, 2),
        "speedup_vs_torch": None if torch_us is None else round(torch_us / ours_us, 2),
        "tb_per_s": None if tbps is None else round(tbps, 3),
        "of_ceiling": None if tbps is None else round(tbps / ceiling, 3),
        "note": note,
    }
    ROWS.append(entry)
    print(json.dumps(entry), flush=True)


def finish(out_dir: str, name: str, ceiling: float) -> None:
    """Write the rows as ``<name>.json`` under ``out_dir`` and print them as one table."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "ceiling_tbps": ceiling, "rows": ROWS}, f, indent=1)
    op_w, size_w = max(len(r["op"]) for r in ROWS), max(len(r["size"]) for r in ROWS)
    print(f"\n{'op':<{op_w}} {'size':<{size_w}} {'kvcore us':>10} {'torch us':>10} {'x torch':>8} {'TB/s':>7} {'of ceil':>8}")
    for r in ROWS:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['op']:<{op_w}} {r['size']:<{size_w}} {r['kvcore_us']:>10.2f} {fmt(r['torch_us'], '>10.2f')} "
              f"{fmt(r['speedup_vs_torch'], '>8.2f')} {fmt(r['tb_per_s'], '>7.3f')} {fmt(r['of_ceiling'], '>8.3f')}")


def bench(fn, reps_ms: int = 200) -> float:
    """Median microseconds of ``fn`` (do_bench times with CUDA events, flushing L2 between runs)."""
    return do_bench(fn, warmup=25, rep=reps_ms, return_mode="median") * 1e3


def graph_time_us(fn, inner: int) -> float:
    """Median microseconds per call of ``fn`` captured ``inner`` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return bench(graph.replay) / inner


def copy_ceiling() -> float:
    """Device-to-device copy rate, bytes read + written per second (TB/s)."""
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    tbps = 2 * n / (us * 1e-6) / 1e12
    return tbps


def same_size_copy_us(moved_bytes: int) -> float:
    """Microseconds of a plain device copy that reads and writes ``moved_bytes`` in all, in a CUDA graph like
    the kernels: transfers of tens of MB do not reach the 1 GiB copy rate of :func:`copy_ceiling`."""
    src = torch.empty(moved_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return graph_time_us(lambda: dst.copy_(src), 4)


# -- correctness ---------------------------------------------------------------------------------------


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"check {'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        raise SystemExit(f"GPU correctness check failed: {name} {detail}")


def correctness() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype, scale in ((torch.bfloat16, None), (torch.float16, None), (torch.float8_e4m3fn, 0.37), (torch.float8_e5m2, None)):
        for n, heads, dk, dv in ((1, 8, 128, 128), (33, 3, 72, 40), (4099, 8, 128, 128)):
            store = torch.uint8 if dtype.itemsize == 1 else dtype
            rows = n * 2 + 16
            k = torch.randint(0, 255, (3, rows, heads, dk), dtype=torch.uint8, device="cuda", generator=g).view(store) if store == torch.uint8 else torch.randn(3, rows, heads, dk, device="cuda", generator=g).to(store)
            v = torch.randint(0, 255, (3, rows, heads, dv), dtype=torch.uint8, device="cuda", generator=g).view(store) if store == torch.uint8 else torch.randn(3, rows, heads, dv, device="cuda", generator=g).to(store)
            loc = torch.randperm(rows - 1, device="cuda", generator=g)[:n] + 1
            ck = torch.randn(n, heads, dk, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16) * 4
            cv = torch.randn(n, heads, dv, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16) * 4
            k_ref, v_ref = k.clone(), v.clone()
            kernels.store_kv_native(k_ref, v_ref, 2, loc, ck, cv, k_scale=scale, v_scale=scale, cache_dtype=dtype)
            kernels.store_kv_triton(k, v, 2, loc, ck, cv, k_scale=scale, v_scale=scale, cache_dtype=dtype)
            same = torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8)) and torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))
            check(f"store {dtype} n={n} H={heads} Dk={dk} Dv={dv}", same, "bit-exact vs torch")
    for n in (1, 7, 16, 300, 4096, 5000):
        k = torch.randn(4, 2 * n + 8, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(4, 2 * n + 8, 8, 96, device="cuda", generator=g).to(torch.bfloat16)
        base = torch.randperm(2 * n + 7, device="cuda", generator=g)[: n + 1] + 1
        for pattern, (tgt, src) in {"disjoint": (base[1:], torch.randperm(2 * n + 7, device="cuda", generator=g)[:n] + 1),
                                    "shift": (base[:-1], base[1:]), "cycle": (base[:n].roll(1), base[:n])}.items():
            if pattern == "disjoint":
                src = src[~torch.isin(src, tgt)][: n]
                tgt = tgt[: src.numel()]
            k_ref, v_ref = k.clone(), v.clone()
            row_move.move_rows_native(k_ref, v_ref, tgt, src)
            kk, vv = k.clone(), v.clone()
            row_move.move_rows_triton(kk, vv, tgt, src)
            check(f"move {pattern} n={tgt.numel()}", torch.equal(kk, k_ref) and torch.equal(vv, v_ref), "vs torch gather-then-scatter")
    # allocator kernels: triton vs torch reference on the GPU
    for page in (1, 16, 64):
        bs = 37
        prefix = torch.randint(0, 300, (bs,), generator=g, device="cuda")
        seq = prefix + torch.randint(1, 200, (bs,), generator=g, device="cuda")
        results = []
        for mode in ("triton", "native"):
            cls = TokenToKVPoolAllocator if page == 1 else PagedTokenToKVPoolAllocator
            kwargs = {} if page == 1 else {"page_size": page}
            alloc = cls(1 << 16, dtype=torch.bfloat16, device="cuda", kvcache=None, need_sort=False, kernels=mode, **kwargs)
            # give every request a prefix ending at a random place inside its own last page
            last = (torch.arange(bs, device="cuda") + 1) * page * 64 + (prefix % page) - 1
            last = torch.where(prefix > 0, last, torch.full_like(last, -1))
            out = alloc.alloc_extend(prefix, None, seq, None, last, int((seq - prefix).sum()))
            dec = alloc.alloc_decode(seq + 1, None, out[torch.cumsum(seq - prefix, 0) - 1])
            results.append((out, dec))
        check(f"allocator page={page} extend+decode", torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1]), "triton vs native")
    # CUDA-graph capture of store and move through the pool
    pool = MHATokenToKVPool(size=4096, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=4,
                            device="cuda", enable_memory_saver=False, kernels="triton")
    loc = torch.arange(1, 65, device="cuda")
    ck = torch.randn(64, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    pool.set_kv_buffer(3, loc, ck, ck)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(3, loc, ck, ck)
        pool.move_kv_cache(loc + 100, loc)
    ck.copy_(torch.randn_like(ck))
    graph.replay()
    torch.cuda.synchronize()
    check("cuda graph store+move", torch.equal(pool.k_buffer[3][loc + 100], ck) and torch.equal(pool.v_buffer[3][loc], ck), "replayed with new data")
    # CPU offload round trip through the pipelined device<->host path, small pieces so several overlap
    pool.k_cache.copy_(torch.randn_like(pool.k_cache))
    pool.v_cache.copy_(torch.randn_like(pool.v_cache))
    pool.cpu_offloading_piece_bytes = 64 * HEADS * DIM * 2
    pool.cpu_offloading_chunk_size = 1000
    src = torch.randperm(4095, device="cuda")[:2500] + 1
    dst = torch.randperm(4095, device="cuda")[:2500] + 1
    want_k, want_v = pool.k_cache[:, src].clone(), pool.v_cache[:, src].clone()
    host = pool.get_cpu_copy(src)
    pool.k_cache.zero_()
    pool.v_cache.zero_()
    pool.load_cpu_copy(host, dst)
    check("cpu offload round trip", torch.equal(pool.k_cache[:, dst], want_k) and torch.equal(pool.v_cache[:, dst], want_v), "2500 rows, 3 chunks, 1-layer pieces")


# -- timing --------------------------------------------------------------------------------------------


def time_store(ceiling: float, quick: bool) -> None:
    sizes = (1, 64, 1024, 8192, 32768) if not quick else (1, 32768)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for n in sizes:
            rows = max(2 * n, 65536) + 1
            store = torch.uint8 if dtype.itemsize == 1 else dtype
            k = torch.zeros(1, rows, HEADS, DIM, dtype=store, device="cuda")
            v = torch.zeros_like(k)
            loc = (torch.randperm(rows - 1, device="cuda")[:n] + 1).to(torch.int64)
            ck = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            cv = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            ours_fn = lambda: kernels.store_kv_triton(k, v, 0, loc, ck, cv, cache_dtype=dtype)  # noqa: E731
            ref_fn = lambda: kernels.store_kv_native(k, v, 0, loc, ck, cv, cache_dtype=dtype)  # noqa: E731
            ours, ref = graph_time_us(ours_fn, 4), graph_time_us(ref_fn, 4)
            eager = bench(ours_fn)
            moved = 2 * n * HEADS * DIM * (2 + dtype.itemsize) + n * 8
            row(f"store {str(dtype).removeprefix('torch.')}", f"{n} tok", ours, ref, moved, ceiling,
                f"graph replay; eager call {eager:.1f} us")


def time_decode_graph(ceiling: float) -> None:
    pool = MHATokenToKVPool(size=1 << 16, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                            device="cuda", enable_memory_saver=False, kernels="triton")
    native = MHATokenToKVPool(size=1 << 16, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                              device="cuda", enable_memory_saver=False, kernels="native")
    for n in (1, 16, 64):
        loc = torch.randperm(1 << 16, device="cuda")[:n] + 1
        ck = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)

        def all_layers(p):
            def run():
                for layer in range(LAYERS):
                    p.set_kv_buffer(layer, loc, ck, ck)
            return run

        ours = graph_time_us(all_layers(pool), 4) / LAYERS
        ref = graph_time_us(all_layers(native), 4) / LAYERS
        row("decode store in graph", f"{n} tok/layer", ours, ref, 2 * n * HEADS * DIM * 4, ceiling, "per layer, 32 layers per replay")


def time_move(ceiling: float, sweep: bool) -> None:
    """move_kv_cache over 32 layers of K and V, disjoint slots (and, with ``sweep``, both large-N paths)."""
    default_limit = row_move.MOVE_MAX_TOKENS
    sizes = (16, 64, 256, 512, 1024, 2048, 4096, 8192) if sweep else (16, 256, 512, 1024, 4096, 8192)
    pool = MHATokenToKVPool(size=1 << 15, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                            device="cuda", enable_memory_saver=False, kernels="triton")
    for n in sizes:
        perm = torch.randperm((1 << 15) - 1, device="cuda") + 1
        moved = 2 * n * HEADS * DIM * 2 * LAYERS * 2
        # disjoint slots, and a compaction by one slot (every target but the last is another's source)
        patterns = {"disjoint": (perm[n : 2 * n], perm[:n]), "shift": (perm[:n], perm[1 : n + 1])}
        limits = {"default": default_limit}
        if sweep:
            limits = {"flagged": 0}
            if n <= 2048:
                limits["one-launch"] = 2048  # the register path forced up to 2048 slots
        ref_done = False
        for pattern, (tgt, src) in patterns.items():
            for label, limit in limits.items():
                row_move.MOVE_MAX_TOKENS = limit
                fn = lambda: row_move.move_rows_triton(pool.k_cache, pool.v_cache, tgt, src)  # noqa: E731
                ours = graph_time_us(fn, 4)
                ref = None
                if not ref_done:
                    ref = bench(lambda: row_move.move_rows_native(pool.k_cache, pool.v_cache, tgt, src))
                    ref_done = True
                row(f"move_kv_cache 32L {pattern}", f"{n} slots [{label}]", ours, ref, moved, ceiling, "graph replay")
    row_move.MOVE_MAX_TOKENS = default_limit


def time_allocator() -> None:
    for page in (1, 16):
        cls = TokenToKVPoolAllocator if page == 1 else PagedTokenToKVPoolAllocator
        kwargs = {} if page == 1 else {"page_size": page}
        alloc = cls(1 << 20, dtype=torch.bfloat16, device="cuda", kvcache=None, need_sort=False, kernels="triton", **kwargs)
        bs = 256
        seq_cpu = torch.randint(100, 4000, (bs,))
        seq = seq_cpu.cuda()
        last = torch.arange(bs, device="cuda") * 4096 + 17
        for _ in range(20):
            out = alloc.alloc_decode(seq, seq_cpu, last)
            alloc.free(out)
        torch.cuda.synchronize()
        iters = 200
        start = time.perf_counter()
        for _ in range(iters):
            out = alloc.alloc_decode(seq, seq_cpu, last)
            alloc.free(out)
        host_us = (time.perf_counter() - start) / iters * 1e6
        torch.cuda.synchronize()
        row(f"alloc_decode+free page={page}", "256 req", host_us, None, None, 1.0, "host time per step")


def time_offload(ceiling: float) -> None:
    pool = MHATokenToKVPool(size=1 << 16, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                            device="cuda", enable_memory_saver=False, kernels="triton")
    idx = torch.randperm(1 << 16, device="cuda")[:8192] + 1
    nbytes = 8192 * HEADS * DIM * 2 * 2 * LAYERS
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned_d2h = bench(lambda: host.copy_(dev, non_blocking=True))
    pinned_h2d = bench(lambda: dev.copy_(host, non_blocking=True))
    copy = pool.get_cpu_copy(idx)
    d2h = bench(lambda: pool.get_cpu_copy(idx))
    h2d = bench(lambda: pool.load_cpu_copy(copy, idx))
    row("cpu offload d2h", "8192 tok x 32 layers", d2h, None, nbytes, nbytes / (pinned_d2h * 1e-6) / 1e12, f"vs pinned copy {nbytes / pinned_d2h / 1e3:.1f} GB/s")
    row("cpu offload h2d", "8192 tok x 32 layers", h2d, None, nbytes, nbytes / (pinned_h2d * 1e-6) / 1e12, f"vs pinned copy {nbytes / pinned_h2d / 1e3:.1f} GB/s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--move-sweep", action="store_true", help="time both move paths at every size")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mha needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} python {platform.python_version()}")
    correctness()
    ceiling = copy_ceiling()
    print(f"device copy ceiling: {ceiling:.3f} TB/s (read + write)")
    time_store(ceiling, args.quick)
    time_decode_graph(ceiling)
    time_move(ceiling, args.move_sweep)
    time_allocator()
    time_offload(ceiling)
    finish(args.out, "bench_mha", ceiling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
