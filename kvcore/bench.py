"""``kvcore bench``: the built-in pools' hot paths timed on the GPU at hand, each beside the torch path it replaces.

Two tables, both from one process so the ratios are comparable (host timings differ between machines by tens
of percent, ratios much less):

* **host cost** of one eager call (what an engine running without CUDA graphs pays per layer): the mean host
  time of calls issued back to back with no sync inside the loop (:func:`host_us`), for kvcore's pool method, for the
  same method with ``hardware.kernels=native`` (the torch path), and for a bare torch op (``x.add_(0)``).
  Methods that return new tensors (the gathers) are also set beside a bare torch op that allocates its
  output (``x.index_select(0, i)``): the least any eager call that returns a new tensor costs.
* **host cost at changing sizes**: the same, with the token count drawn at random on every call (1..8192; a
  move's slots 1..512, the range it takes in one launch), as an engine's prefill sizes and decode batches change
  from step to step (:func:`host_us_of_calls`);
* **an eager engine step** (:mod:`kvcore.bench_engine`): continuous batching on Llama-3-8B's pools at page 16,
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
import time
from collections.abc import Callable

import attrs
import torch

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


#: (table, title, (column head, width) ...) of the two tables, in print order; the widths are Row.as_text's.
TABLES = (
    ("host", "host time of one eager call (us): kvcore / torch path / bare torch op (x.add_(0)) / bare op that "
     "allocates (x.index_select(0, i), for methods returning new tensors), and the ratios",
     (("kvcore", 9), ("torch", 9), ("bare op", 9), ("/torch", 8), ("/bare", 8), ("alloc op", 9), ("/alloc", 8))),
    ("varied", "host time of one eager call when N changes on every call (drawn at random in the range shown; "
     "us): columns as above",
     (("kvcore", 9), ("torch", 9), ("bare op", 9), ("/torch", 8), ("/bare", 8), ("alloc op", 9), ("/alloc", 8))),
    ("engine", "an eager engine step, host time of kvcore's calls (us): kvcore / the same step storing through "
     "the torch path / floor (as many bare torch ops as the step launches, N a step)",
     (("kvcore", 9), ("torch", 9), ("floor", 9), ("/torch", 8), ("/floor", 8))),
    ("graph", "device time per call in CUDA-graph replay (us): kvcore / torch path; share of the copy ceiling",
     (("kvcore", 9), ("torch", 9), ("/torch", 8), ("of ceil", 9))),
)  # fmt: skip


@attrs.frozen
class Row:
    """One measured line of a table (times in microseconds)."""

    table: str
    op: str
    n: int
    kvcore_us: float
    torch_us: float
    bare_us: float | None = None
    of_ceiling: float | None = None
    alloc_us: float | None = None

    def as_text(self) -> str:
        ratio = self.kvcore_us / self.torch_us
        if self.table in ("host", "varied", "engine"):
            n = f"1-{self.n}" if self.table == "varied" else str(self.n)
            alloc = "" if self.alloc_us is None else f" {self.alloc_us:>9.2f} {self.kvcore_us / self.alloc_us:>8.2f}"
            return (f"{self.op:<34} {n:>6} {self.kvcore_us:>9.2f} {self.torch_us:>9.2f} {self.bare_us:>9.2f} "
                    f"{ratio:>8.2f} {self.kvcore_us / self.bare_us:>8.2f}{alloc}")  # fmt: skip
        ceil = "" if self.of_ceiling is None else f"{self.of_ceiling:>9.2f}"
        return f"{self.op:<34} {self.n:>6} {self.kvcore_us:>9.2f} {self.torch_us:>9.2f} {ratio:>8.2f} {ceil}"


def host_us(*fns: Callable[[], object], reps: int = 2000, rounds: int = 5) -> list[float]:
    """Host time of one call of each of ``fns``: in each of ``rounds`` rounds, every function in turn runs
    ``reps // rounds`` calls with no sync inside the loop; a function's time is its fastest round's mean.
    Interleaving the functions and keeping the fastest round keeps a burst of noise on a shared host from
    landing on one function only, which would skew the ratios."""
    for fn in fns:
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    best = [float("inf")] * len(fns)
    calls = max(1, reps // rounds)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return best


def host_us_of_calls(*call_lists: list[Callable[[], object]], passes: int = 8, rounds: int = 5) -> list[float]:
    """Host time of one call, for each list of calls (each made with its own arguments: a changing size): in each
    of ``rounds`` rounds, every list in turn runs ``passes`` times through, with the device waited for after each
    pass, outside the time (calls of thousands of tokens may take the device longer than the host: unwaited, the
    launch queue would fill and the host loop would time the device).  A list's time is its fastest round's
    mean."""
    for calls in call_lists:
        for fn in calls:
            fn()
    torch.cuda.synchronize()
    best = [float("inf")] * len(call_lists)
    for _ in range(rounds):
        for i, calls in enumerate(call_lists):
            spent = 0.0
            for _ in range(passes):
                start = time.perf_counter()
                for fn in calls:
                    fn()
                spent += time.perf_counter() - start
                torch.cuda.synchronize()
            best[i] = min(best[i], spent / (passes * len(calls)) * 1e6)
    return best


def graph_us(fn: Callable[[], object], calls: int = 20) -> float:
    """Device time of one call inside CUDA-graph replay (median of replays of ``calls`` captured calls)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / calls


def copy_ceiling_gbps() -> float:
    """The measured device-to-device copy rate (bytes read + written per second, GB/s)."""
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds = do_bench(lambda: y.copy_(x), warmup=20, rep=100, return_mode="median") * 1e-3
    return 2 * (1 << 30) / seconds / 1e9


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


def format_tables(rows: list[Row]) -> list[str]:
    """The two tables as text lines (a blank line and a title before each)."""
    lines = []
    for table, title, columns in TABLES:
        lines += ["", title, f"{'op':<34} {'N':>6} " + " ".join(f"{head:>{width}}" for head, width in columns)]
        lines += [r.as_text() for r in rows if r.table == table]
    return lines


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

    from kvcore.row_move import MOVE_MAX_TOKENS

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
        from kvcore.bench_engine import engine_rows

        rows += engine_rows(engine_steps)
    import triton

    out(f"kvcore bench on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__}); "
        f"copy ceiling {ceiling:.0f} GB/s")  # fmt: skip
    for line in format_tables(rows):
        out(line)
    return rows
