"""``kvcore bench``: the built-in pools' hot paths timed on the GPU at hand, each beside the torch path it replaces.

Four tables, all from one process so the ratios are comparable (host timings differ between machines by tens
of percent, ratios much less; how each is measured: :mod:`kvcore.tools.timing`):

* **host cost** of one eager call (what an engine running without CUDA graphs pays per layer): the mean host
  time of calls issued back to back with no sync inside the loop (:func:`host_us`), for kvcore's pool method, for the
  same method with ``hardware.kernels=native`` (the torch path), and for a bare torch op (``x.add_(0)``).
  Methods that return new tensors (the gathers) are also set beside a bare torch op that allocates its
  output (``x.index_select(0, i)``): the least any eager call that returns a new tensor costs.
* **host cost at changing sizes**: the same, with the token count drawn at random on every call (1..8192; a
  move's slots 1..512, the range it takes in one launch), as an engine's prefill sizes and decode batches change
  from step to step (:func:`host_us_of_calls`);
* **an eager engine step** (:mod:`kvcore.tools.bench_engine`): continuous batching on Llama-3-8B's pools at page 16,
  prefills, decodes of every layer and frees, against a floor of as many bare torch ops as the step launches;
* **device time** inside CUDA-graph replay (what a decode step costs on the GPU), for kvcore and the torch
  path, with the bytes moved over the measured device-copy ceiling.

Sizes are the real models': Llama-3-8B's MHA rows (8 KV heads x 128), DeepSeek-V3's latent rows (512 + 64),
DeepSeek-V3.2's fp8 rows and indexer, Llama-3-8B's rows as nvfp4 codes, gpt-oss's sliding-window layers (8 KV heads x 64), written through a
shuffled full -> window slot map as its allocator builds one, and Qwen3-Next's per-request states on a tp-2
rank (36 gated DeltaNet layers, 36.8 MiB a slot), copied between slots (at 8 and 256 slots only).  Every timed kvcore call is first checked against the torch path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcore.tools.timing import Row, copy_ceiling_gbps, format_tables, graph_us, host_us, host_us_of_calls

HEADS, HEAD_DIM = 8, 128  # Llama-3-8B
RANK, ROPE = 512, 64  # DeepSeek-V3 / V3.2
SWA_HEAD_DIM = 64  # gpt-oss (8 KV heads)
STATE_SLOTS = (8, 256)  # sizes of the state copy; its pool holds twice the larger
#: Qwen3-Next's DeltaNet state on one of two tensor-parallel ranks: conv window [4096, 3] bf16, temporal
#: [16, 128, 128] float32, 36 layers.
QWEN3_NEXT_STATE = dict(layers=36, conv=(4096, 3), temporal=(16, 128, 128))
POOL_TOKENS = 1 << 16  # of every pool timed; locations are drawn among them
#: the changing-size rows: token counts drawn from 1..VARIED_MAX_TOKENS (a move's slots from 1..MOVE_MAX_TOKENS),
#: VARIED_CALLS different counts a row, each call a new one
VARIED_MAX_TOKENS, VARIED_CALLS = 8192, 64


def _pools(kernels: str) -> dict[str, object]:
    from kvcore_dsa.pool import DSATokenToKVPool
    from kvcore_fp4.pool import MHATokenToKVPoolFP4
    from kvcore_mha.page_major import PageMajorMHATokenToKVPool
    from kvcore_mha.pool import MHATokenToKVPool
    from kvcore_mla.pool import MLATokenToKVPool
    from kvcore_mamba.layout import LinearStateParams, StateDtype, StateShape
    from kvcore_mamba.pool import MambaPool
    from kvcore_swa.pool import SWAKVPool

    common = dict(size=POOL_TOKENS, device="cuda", enable_memory_saver=False, kernels=kernels)
    return {
        "mha": MHATokenToKVPool(page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=32, **common),
        "mha_page_major": PageMajorMHATokenToKVPool(page_size=16, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                                                    layer_num=32, **common),
        "mha_page16": MHATokenToKVPool(page_size=16, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=32,
                                       **common),
        "mha_fp8": MHATokenToKVPool(page_size=1, dtype=torch.float8_e4m3fn, head_num=HEADS, head_dim=HEAD_DIM,
                                    layer_num=2, **common),
        "mla": MLATokenToKVPool(page_size=1, dtype=torch.bfloat16, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, layer_num=2,
                                **common),
        "dsa": DSATokenToKVPool(page_size=64, dtype=torch.float8_e4m3fn, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                                layer_num=2, index_head_dim=128, **common),
        "swa": _mapped(SWAKVPool(size_swa=POOL_TOKENS, page_size=1, dtype=torch.bfloat16, head_num=HEADS,
                                 head_dim=SWA_HEAD_DIM, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                                 **common)),
        "nvfp4": MHATokenToKVPoolFP4(page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=2,
                                     kv_format="nvfp4", **common),
        "mamba": MambaPool(size=2 * max(STATE_SLOTS), device="cuda", kernels=kernels, cache_params=LinearStateParams(
            layers=list(range(QWEN3_NEXT_STATE["layers"])),
            shape=StateShape(conv=[QWEN3_NEXT_STATE["conv"]], temporal=QWEN3_NEXT_STATE["temporal"]),
            dtype=StateDtype(conv=torch.bfloat16, temporal=torch.float32))),
    }  # fmt: skip


def _mapped(pool):
    """The SWA pool with a full -> window slot map, shuffled (the same in every process: a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(pool.size_swa, generator=g) + 1])
    pool.register_mapping(mapping.to(pool.device))
    return pool


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _cases(n: int, gen: torch.Generator) -> dict[str, tuple[str, Callable, torch.Tensor]]:
    """Per op: (pool name, ``pool -> call`` to time, the tokens whose rows the call writes).  Inputs are made
    once, random, never zero."""

    def rand(*shape, dtype=torch.bfloat16):
        x = torch.randn(shape, generator=gen) * 2
        return torch.where(x == 0, torch.ones_like(x), x).to(dtype).cuda()

    loc = (torch.randperm(POOL_TOKENS - 64, generator=gen)[:n] + 64).cuda()
    k, v = rand(n, HEADS, HEAD_DIM), rand(n, HEADS, HEAD_DIM)
    nope, rope, latent = rand(n, 1, RANK), rand(n, 1, ROPE), rand(n, 1, RANK + ROPE)
    swa_k, swa_v = rand(n, HEADS, SWA_HEAD_DIM), rand(n, HEADS, SWA_HEAD_DIM)
    slots = (torch.randperm(2 * max(STATE_SLOTS), generator=gen)[: 2 * n] + 1).cuda()
    half = max(1, n // 2)
    tgt, src = loc[:half], loc[n - half :]
    keys = rand(n, 128).to(torch.float8_e4m3fn)
    scales = torch.rand(n, generator=gen).add_(0.01).cuda()
    pages = torch.arange(1, 2 + n // 64, dtype=torch.int32).cuda()

    def into(method: str, *args, shapes, dtype=torch.bfloat16):
        """``pool -> call`` of ``pool.method(*args, out=...)`` into caller-provided outputs, made once per pool:
        the timed call allocates nothing."""

        def make(p):
            out = tuple(torch.empty(shape, dtype=dtype, device="cuda") for shape in shapes)
            return lambda: getattr(p, method)(*args, out=out)

        return make

    latent_into = into("get_mla_kv_buffer", 0, loc, shapes=((n, 1, RANK), (n, 1, ROPE)))
    return {
        "mha set_kv_buffer bf16": ("mha", lambda p: lambda: p.set_kv_buffer(0, loc, k, v), loc),
        "mha set_kv_buffer fp8<-bf16": ("mha_fp8", lambda p: lambda: p.set_kv_buffer(0, loc, k, v), loc),
        "move_kv_cache mha 32 layers": ("mha", lambda p: lambda: p.move_kv_cache(tgt, src), tgt),
        "mha set_kv_buffer bf16, page 16": ("mha_page16", lambda p: lambda: p.set_kv_buffer(0, loc, k, v), loc),
        "page-major set_kv_buffer bf16, page 16": ("mha_page_major", lambda p: lambda: p.set_kv_buffer(0, loc, k, v), loc),
        "move_kv_cache mha 32 layers, page 16": ("mha_page16", lambda p: lambda: p.move_kv_cache(tgt, src), tgt),
        "move_kv_cache page-major 32 layers, page 16": ("mha_page_major", lambda p: lambda: p.move_kv_cache(tgt, src), tgt),
        "mla set_mla_kv_buffer": ("mla", lambda p: lambda: p.set_mla_kv_buffer(0, loc, nope, rope), loc),
        "mla set_kv_buffer (concatenated)": ("mla", lambda p: lambda: p.set_kv_buffer(0, loc, latent, None), loc),
        "mla get_mla_kv_buffer": ("mla", lambda p: lambda: p.get_mla_kv_buffer(0, loc), None),
        "mla get_mla_kv_buffer (out=)": ("mla", latent_into, INTO),
        "dsa set_mla_kv_buffer (fp8 quantize)": ("dsa", lambda p: lambda: p.set_mla_kv_buffer(0, loc, nope, rope), loc),
        "dsa get_mla_kv_buffer (dequantize)": ("dsa", lambda p: lambda: p.get_mla_kv_buffer(0, loc), None),
        "dsa get_mla_kv_buffer (out=)": ("dsa", latent_into, INTO),
        "dsa set_index_k_scale_buffer": ("dsa", lambda p: lambda: p.set_index_k_scale_buffer(0, loc, keys, scales), loc),
        "dsa get_index_k_scale_buffer": ("dsa", lambda p: lambda: p.get_index_k_scale_buffer(0, n, pages), None),
        "dsa get_index_k_scale_buffer (out=)": ("dsa", into("get_index_k_scale_buffer", 0, n, pages,
                                                            shapes=((n, 128), (n, 4)), dtype=torch.uint8), INTO),
        "swa set_kv_buffer (window, mapped)": ("swa", lambda p: lambda: p.set_kv_buffer(0, loc, swa_k, swa_v), loc),
        "nvfp4 set_kv_buffer (quantize)": ("nvfp4", lambda p: lambda: p.set_kv_buffer(0, loc, k, v), loc),
        "nvfp4 get_kv_buffer_by_loc": ("nvfp4", lambda p: lambda: p.get_kv_buffer_by_loc(0, loc), None),
        "nvfp4 get_kv_buffer_by_loc (out=)": ("nvfp4", into("get_kv_buffer_by_loc", 0, loc,
                                                            shapes=((n, HEADS, HEAD_DIM),) * 2), INTO),
        **({"mamba copy_from (36 layers)": ("mamba", lambda p: lambda: p.copy_from(slots[:n], slots[n:]), STATE)}
           if n in STATE_SLOTS else {}),
    }


#: the ``written`` of a case whose call writes per-request state: every state buffer is compared.
STATE = "state"
#: the ``written`` of a gather into caller-provided outputs: compared as a gather, timed beside the bare op only.
INTO = "into"


def _bytes_moved(op: str, n: int) -> int | None:
    """Bytes a call must read + write (for the copy-ceiling ratio), where that is plain to count."""
    per_token = {
        "mha set_kv_buffer bf16": 2 * 2 * HEADS * HEAD_DIM * 2,
        "mha set_kv_buffer bf16, page 16": 2 * 2 * HEADS * HEAD_DIM * 2,
        "page-major set_kv_buffer bf16, page 16": 2 * 2 * HEADS * HEAD_DIM * 2 + 8,  # + the token -> row map entry
        "swa set_kv_buffer (window, mapped)": 2 * 2 * HEADS * SWA_HEAD_DIM * 2 + 8,  # + the map entry read
        # bf16 K and V in (2 bytes a value), codes and scales out (1/2 + 1/16), or back
        "nvfp4 set_kv_buffer (quantize)": 2 * HEADS * HEAD_DIM * 41 // 16,
        "nvfp4 get_kv_buffer_by_loc": 2 * HEADS * HEAD_DIM * 41 // 16,
        "nvfp4 get_kv_buffer_by_loc (out=)": 2 * HEADS * HEAD_DIM * 41 // 16,
        "mamba copy_from (36 layers)": 2 * QWEN3_NEXT_STATE["layers"] * (
            math.prod(QWEN3_NEXT_STATE["conv"]) * 2 + math.prod(QWEN3_NEXT_STATE["temporal"]) * 4),
        "mla set_mla_kv_buffer": 2 * (RANK + ROPE) * 2,
        "mla set_kv_buffer (concatenated)": 2 * (RANK + ROPE) * 2,
        "mla get_mla_kv_buffer": 2 * (RANK + ROPE) * 2,
        "mla get_mla_kv_buffer (out=)": 2 * (RANK + ROPE) * 2,
        "dsa set_mla_kv_buffer (fp8 quantize)": (RANK + ROPE) * 2 + 656,
        "dsa get_mla_kv_buffer (dequantize)": 656 + (RANK + ROPE) * 2,
        "dsa get_mla_kv_buffer (out=)": 656 + (RANK + ROPE) * 2,
    }.get(op)
    return None if per_token is None else per_token * n


def _check(op: str, n: int, ours: Callable, theirs: Callable, written, fast_pool, ref_pool) -> None:
    """One call of each, then the check that kvcore's output (or the rows it wrote, or every state) is the torch
    path's."""
    got, want = ours(), theirs()
    if written is None or written is INTO:
        ok = _same(got, want)
    elif written is STATE:
        mine, reference = fast_pool.buffers(), ref_pool.buffers()
        ok = all(_same(mine[b], reference[b]) for b in mine)
    else:  # a write: the rows it wrote, in every buffer, must be the torch path's
        mine, reference = fast_pool.token_rows(), ref_pool.token_rows()
        ok = all(_same(mine[b].take(written), reference[b].take(written)) for b in mine)
    if not ok:
        raise AssertionError(f"kvcore bench: {op} at N={n} differs from the torch path")


def _varied_rows(fast: dict, ref: dict, bare: Callable, alloc_bare: Callable) -> list[Row]:
    """The changing-size rows: every case but the state copy with a new token count each call, each call checked
    against the torch path, then timed (:func:`host_us_of_calls`)."""
    import random

    from kvcore.kernels.row_move import MOVE_MAX_TOKENS

    rng = random.Random(11)
    sizes = [rng.randint(1, VARIED_MAX_TOKENS) for _ in range(VARIED_CALLS)]
    move_sizes = [2 * rng.randint(1, MOVE_MAX_TOKENS) for _ in range(VARIED_CALLS)]  # a move case moves N // 2
    calls: dict[str, list] = {}
    for moves, counts in ((False, sizes), (True, move_sizes)):
        for i, n in enumerate(counts):
            for op, case in _cases(n, torch.Generator().manual_seed(1000 + i)).items():
                if op.startswith("move_kv_cache") == moves and case[2] is not STATE:
                    calls.setdefault(op, []).append((n, case))
    rows = []
    for op, entries in calls.items():
        ours, theirs = [], []
        for n, (pool, make, written) in entries:
            ours.append(make(fast[pool]))
            theirs.append(make(ref[pool]))
            _check(op, n, ours[-1], theirs[-1], written, fast[pool], ref[pool])
        allocating = entries[0][1][2] is None
        lists = [ours, theirs, [bare] * len(ours)] + ([[alloc_bare] * len(ours)] if allocating else [])
        times = host_us_of_calls(*lists)
        top = MOVE_MAX_TOKENS if op.startswith("move_kv_cache") else VARIED_MAX_TOKENS
        rows.append(Row("varied", op, top, *times[:3], alloc_us=times[3] if allocating else None))
    return rows


def run(host_sizes=(1, 8, 64, 4096), graph_sizes=(1, 8, 64, 256, 32768), reps: int = 2000, varied: bool = True,
        engine_steps: int = 300, out=print) -> list[Row]:  # fmt: skip
    """Check, then time every case; print the tables with ``out`` and return the rows.  ``varied``: the
    changing-size rows; ``engine_steps``: steps of each engine loop (0: none)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kvcore bench times kernels on a CUDA GPU and this machine has none")
    fast, ref = _pools("triton"), _pools("native")
    for pools in (fast, ref):  # the same random contents in both, so the outputs can be compared
        for name, pool in pools.items():
            gen = torch.Generator(device="cuda").manual_seed(hash(name) % 1000)
            for buf in pool.buffers().values():
                buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8,
                                                          device="cuda", generator=gen))  # fmt: skip
        if getattr(pools["nvfp4"], "global_scale", None) is not None:
            pools["nvfp4"].global_scale.fill_(1.0)  # a per-layer constant, not random bytes
    x = torch.zeros(16, device="cuda")
    one = torch.zeros(1, dtype=torch.int64, device="cuda")
    rows: list[Row] = []
    ceiling = copy_ceiling_gbps()
    for n in sorted(set(host_sizes) | set(graph_sizes)):
        for op, (pool, make, written) in _cases(n, torch.Generator().manual_seed(n)).items():
            ours, theirs = make(fast[pool]), make(ref[pool])
            _check(op, n, ours, theirs, written, fast[pool], ref[pool])
            if n in host_sizes and written is not STATE:  # a state copy's GPU time would stall the host loop
                fns = [ours, theirs, lambda: x.add_(0)] + ([lambda: x.index_select(0, one)] if written is None else [])
                times = host_us(*fns, reps=reps)
                rows.append(Row("host", op, n, *times[:3], alloc_us=times[3] if written is None else None))
            if n in graph_sizes:
                t_ours, t_ref = graph_us(ours), graph_us(theirs)
                moved = _bytes_moved(op, n)
                of_ceiling = None if moved is None else moved / (t_ours * 1e-6) / 1e9 / ceiling
                rows.append(Row("graph", op, n, t_ours, t_ref, of_ceiling=of_ceiling))
    if varied:
        rows += _varied_rows(fast, ref, lambda: x.add_(0), lambda: x.index_select(0, one))
    del fast, ref
    if engine_steps:
        from kvcore.tools.bench_engine import engine_rows

        rows += engine_rows(engine_steps)
    import triton

    out(f"kvcore bench on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__}); "
        f"copy ceiling {ceiling:.0f} GB/s")  # fmt: skip
    for line in format_tables(rows):
        out(line)
    return rows
