"""How ``kvcore bench`` measures and prints: host time of eager calls (:func:`host_us`, and
:func:`host_us_of_calls` for calls of changing sizes), device time in CUDA-graph replay (:func:`graph_us`), the
median of timed eager runs (:func:`median_ms`, for benchmarks of moves too large for a graph), the device-copy
ceiling (:func:`copy_ceiling_gbps`), and the rows and tables of the report (:class:`Row`, :func:`format_tables`).
Knows no pool: :mod:`kvcore.tools.bench` and :mod:`kvcore.tools.bench_engine` time theirs with it."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch


#: (table, title, (column head, width) ...) of the tables, in print order; the widths are Row.as_text's.
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


def median_ms(fn: Callable[[], object], repeats: int = 5, *, cuda: bool = True,
              before_each: Callable[[], object] | None = None) -> float:
    """Median milliseconds of ``repeats`` runs of ``fn`` after one untimed run: CUDA events around each run, the
    device waited for (``cuda``), or the wall clock.  ``before_each`` (a barrier between ranks, say) runs before each
    timed run, outside the time."""
    fn()
    times = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    middle = len(times) // 2
    return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2


def copy_ceiling_gbps() -> float:
    """The measured device-to-device copy rate (bytes read + written per second, GB/s)."""
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds = do_bench(lambda: y.copy_(x), warmup=20, rep=100, return_mode="median") * 1e-3
    return 2 * (1 << 30) / seconds / 1e9


def format_tables(rows: list[Row]) -> list[str]:
    """The two tables as text lines (a blank line and a title before each)."""
    lines = []
    for table, title, columns in TABLES:
        lines += ["", title, f"{'op':<34} {'N':>6} " + " ".join(f"{head:>{width}}" for head, width in columns)]
        lines += [r.as_text() for r in rows if r.table == table]
    return lines
