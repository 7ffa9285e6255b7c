"""``kvcore bench``: the plugins' pools' hot paths timed on the GPU at hand, each beside the torch path it replaces.

The cases come from the plugins, through the ``kvcore_bench_cases`` hook (:class:`kvcore.hookspecs.BenchCases`):
each family registers its pools at real model sizes, the calls to time, what they write and the bytes they move
(the built-in families' cases are in ``plugins/<family>/bench.py``); this module knows no family.  It runs
whatever the loaded plugins give (``KVCORE_PLUGINS`` / ``KVCORE_DISABLE_PLUGINS`` apply, as everywhere).

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

Every timed kvcore call is first checked against the torch path (the same call on a pool built with
``kernels="native"`` and filled with the same random bytes).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping

import attrs
import torch

from kvcore.errors import PluginError
from kvcore.hookspecs import GATHER, INTO, STATE, BenchCase, BenchCases
from kvcore.sample import random_nonzero
from kvcore.tools.timing import Row, copy_ceiling_gbps, format_tables, graph_us, host_us, host_us_of_calls

#: tokens of a pool timed at token granularity (a plugin's ``BenchPool.make`` builds its pools this size, and
#: draws its locations among them with :func:`locations`)
POOL_TOKENS = 1 << 16
#: the changing-size rows: token counts drawn from 1..VARIED_MAX_TOKENS (a move's slots from 1..MOVE_MAX_TOKENS),
#: VARIED_CALLS different counts a row, each call a new one
VARIED_MAX_TOKENS, VARIED_CALLS = 8192, 64


# -- what plugins' cases use ---------------------------------------------------------------------------------


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> torch.Tensor:
    """Random inputs, never zero (normal values x 2 drawn on the CPU from ``gen``), on ``device``."""
    return random_nonzero(shape, dtype, gen, scale=2.0, device=device)


def locations(n: int, gen: torch.Generator, pool_tokens: int = POOL_TOKENS, device: str = "cuda") -> torch.Tensor:
    """``n`` distinct token locations among ``pool_tokens``, past the first 64 (the padding page of any page size
    up to 64), in random order."""
    return (torch.randperm(pool_tokens - 64, generator=gen)[:n] + 64).to(device)


def at_loc(inputs) -> torch.Tensor:
    """``BenchCase.written`` of a call that writes the rows of its inputs' ``loc`` (a plugin's inputs record with a
    ``loc`` field, as :func:`locations` draws it)."""
    return inputs.loc


def into(pool, method: str, *args, shapes, dtype: torch.dtype = torch.bfloat16) -> Callable[[], object]:
    """``pool.method(*args, out=...)`` into outputs of ``shapes`` made now, on the pool's device: the call
    allocates nothing (a ``BenchCase.call`` of a gather with ``written=INTO``)."""
    out = tuple(torch.empty(shape, dtype=dtype, device=pool.device) for shape in shapes)
    return lambda: getattr(pool, method)(*args, out=out)


# -- collecting, building and checking ------------------------------------------------------------------------


def collect(registry=None) -> list[BenchCases]:
    """Every loaded plugin's :class:`~kvcore.hookspecs.BenchCases` (``plugin`` filled in), in the order the plugins
    were registered; nothing is built.

    :raises PluginError: naming the plugin, for a hook that raises, an item that is not a ``BenchCases``, a case
        naming a pool its record lacks, or an op or pool name another plugin (or record) already uses.
    """
    if registry is None:
        from kvcore.plugins import get_registry

        registry = get_registry()
    found: list[BenchCases] = []
    ops: dict[str, str] = {}
    pools: dict[str, str] = {}
    for impl in registry.hook.kvcore_bench_cases.get_hookimpls():
        name = impl.plugin_name
        try:
            result = impl.function()
            if isinstance(result, (Mapping, str, bytes)):
                raise TypeError(f"returned a {type(result).__name__}, not an iterable of BenchCases records")
            items = list(result or ())
        except Exception as exc:
            raise PluginError(f"plugin {name!r}: kvcore_bench_cases raised {type(exc).__name__}: {exc}") from exc
        for item in items:
            if not isinstance(item, BenchCases):
                raise PluginError(f"plugin {name!r}: kvcore_bench_cases returned {type(item).__name__} {item!r}; "
                                  "expected kvcore.hookspecs.BenchCases records")  # fmt: skip
            own = {p.name for p in item.pools}
            for pool in item.pools:
                if pool.name in pools:
                    raise PluginError(f"plugin {name!r}: bench pool {pool.name!r} is already registered by plugin "
                                      f"{pools[pool.name]!r}")  # fmt: skip
                pools[pool.name] = name
            for case in item.cases:
                if not isinstance(case, BenchCase):
                    raise PluginError(f"plugin {name!r}: a bench case is {type(case).__name__} {case!r}; expected "
                                      "kvcore.hookspecs.BenchCase")  # fmt: skip
                if case.pool not in own:
                    raise PluginError(f"plugin {name!r}: bench case {case.op!r} calls pool {case.pool!r}, which its "
                                      f"BenchCases does not build (it builds: {', '.join(sorted(own)) or 'none'})")
                if case.op in ops:
                    raise PluginError(f"plugin {name!r}: bench case {case.op!r} is already registered by plugin "
                                      f"{ops[case.op]!r}")  # fmt: skip
                ops[case.op] = name
            found.append(attrs.evolve(item, plugin=name))
    return found


def build(suites: Iterable[BenchCases], kernels: str) -> dict[str, object]:
    """Every pool of ``suites`` made with ``kernels`` (``"triton"`` or ``"native"``), its buffers filled with random
    bytes seeded by the pool's name (the same in both builds, so outputs compare), then ``prepare``-d."""
    pools = {}
    for suite in suites:
        for spec in suite.pools:
            pool = spec.make(kernels)
            for buf in pool.buffers().values():
                raw = buf.view(torch.uint8)
                gen = torch.Generator(device=raw.device).manual_seed(zlib.crc32(spec.name.encode()) % 1000)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=raw.device, generator=gen))
            if spec.prepare is not None:
                spec.prepare(pool)
            pools[spec.name] = pool
    return pools


def instances(suites: Iterable[BenchCases], n: int, seed: int, *, move: bool | None = None
              ) -> list[tuple[BenchCase, object]]:  # fmt: skip
    """``(case, inputs)`` of every case timed at ``n`` (``move``: only the moves, or only the others), each suite's
    inputs of ``n`` tokens drawn from a generator seeded ``seed`` (made only for a suite with such a case)."""
    found = []
    for suite in suites:
        cases = [c for c in suite.cases if (c.sizes is None or n in c.sizes) and (move is None or c.move == move)]
        if cases:
            inputs = suite.inputs(n, torch.Generator().manual_seed(seed))
            found += [(case, inputs) for case in cases]
    return found


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check(case: BenchCase, n: int, inputs, fast: Mapping[str, object], ref: Mapping[str, object]
          ) -> tuple[Callable[[], object], Callable[[], object]]:  # fmt: skip
    """Make the case's call on the kvcore pool and on the torch-path pool, run each once and check that kvcore's
    output (or the rows it wrote, or every buffer) is the torch path's; returns the two calls.

    :raises AssertionError: naming the op and N when they differ.
    """
    fast_pool, ref_pool = fast[case.pool], ref[case.pool]
    ours, theirs = case.call(fast_pool, inputs), case.call(ref_pool, inputs)
    got, want = ours(), theirs()
    if case.written in (GATHER, INTO):
        ok = _same(got, want)
    elif case.written == STATE:
        mine, reference = fast_pool.buffers(), ref_pool.buffers()
        ok = all(_same(mine[b], reference[b]) for b in mine)
    else:  # a write: the rows it wrote, in every buffer, must be the torch path's
        written = case.written(inputs)
        mine, reference = fast_pool.token_rows(), ref_pool.token_rows()
        ok = all(_same(mine[b].take(written), reference[b].take(written)) for b in mine)
    if not ok:
        raise AssertionError(f"kvcore bench: {case.op} at N={n} differs from the torch path")
    return ours, theirs


# -- the run --------------------------------------------------------------------------------------------------


def _varied_rows(suites, fast: dict, ref: dict, bare: Callable, alloc_bare: Callable) -> list[Row]:
    """The changing-size rows: every case but the state copies with a new token count each call, each call checked
    against the torch path, then timed (:func:`host_us_of_calls`)."""
    import random

    from kvcore.kernels.row_move import MOVE_MAX_TOKENS

    rng = random.Random(11)
    sizes = [rng.randint(1, VARIED_MAX_TOKENS) for _ in range(VARIED_CALLS)]
    move_sizes = [2 * rng.randint(1, MOVE_MAX_TOKENS) for _ in range(VARIED_CALLS)]  # a move case moves N // 2
    entries: dict[str, list] = {}
    for moves, counts in ((False, sizes), (True, move_sizes)):
        for i, n in enumerate(counts):
            for case, inputs in instances(suites, n, 1000 + i, move=moves):
                if case.written != STATE:
                    entries.setdefault(case.op, []).append((n, case, inputs))
    rows = []
    for op, calls in entries.items():
        ours, theirs = [], []
        for n, case, inputs in calls:
            mine, reference = check(case, n, inputs, fast, ref)
            ours.append(mine)
            theirs.append(reference)
        case = calls[0][1]
        allocating = case.written == GATHER
        lists = [ours, theirs, [bare] * len(ours)] + ([[alloc_bare] * len(ours)] if allocating else [])
        times = host_us_of_calls(*lists)
        top = MOVE_MAX_TOKENS if case.move else VARIED_MAX_TOKENS
        rows.append(Row("varied", op, top, *times[:3], alloc_us=times[3] if allocating else None))
    return rows


def run(host_sizes=(1, 8, 64, 4096), graph_sizes=(1, 8, 64, 256, 32768), reps: int = 2000, varied: bool = True,
        engine_steps: int = 300, out=print, registry=None) -> list[Row]:  # fmt: skip
    """Check, then time every case the plugins give (:func:`collect`); print the tables with ``out`` and return the
    rows.  ``varied``: the changing-size rows; ``engine_steps``: steps of each engine loop (0: none); ``registry``:
    the plugins (default: the installed ones)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kvcore bench times kernels on a CUDA GPU and this machine has none")
    suites = collect(registry)
    fast, ref = build(suites, "triton"), build(suites, "native")
    x = torch.zeros(16, device="cuda")
    one = torch.zeros(1, dtype=torch.int64, device="cuda")
    rows: list[Row] = []
    ceiling = copy_ceiling_gbps()
    for n in sorted(set(host_sizes) | set(graph_sizes)):
        for case, inputs in instances(suites, n, n):
            ours, theirs = check(case, n, inputs, fast, ref)
            if n in host_sizes and case.written != STATE:  # a state copy's GPU time would stall the host loop
                gather = case.written == GATHER
                fns = [ours, theirs, lambda: x.add_(0)] + ([lambda: x.index_select(0, one)] if gather else [])
                times = host_us(*fns, reps=reps)
                rows.append(Row("host", case.op, n, *times[:3], alloc_us=times[3] if gather else None))
            if n in graph_sizes:
                t_ours, t_ref = graph_us(ours), graph_us(theirs)
                moved = None if case.bytes_per_token is None else case.bytes_per_token * n
                of_ceiling = None if moved is None else moved / (t_ours * 1e-6) / 1e9 / ceiling
                rows.append(Row("graph", case.op, n, t_ours, t_ref, of_ceiling=of_ceiling))
    if varied:
        rows += _varied_rows(suites, fast, ref, lambda: x.add_(0), lambda: x.index_select(0, one))
    del fast, ref
    if engine_steps:
        from kvcore.tools.bench_engine import engine_rows

        rows += engine_rows(engine_steps)
    import triton

    plugins = ", ".join(f"{s.plugin} ({len(s.cases)})" for s in suites) or "none"
    out(f"kvcore bench on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__}); "
        f"copy ceiling {ceiling:.0f} GB/s; cases of plugins: {plugins}")  # fmt: skip
    for line in format_tables(rows):
        out(line)
    return rows
