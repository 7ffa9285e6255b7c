"""Where the host time of one allocator decode step goes, on a GPU: the step (``alloc_decode`` of 256 requests then
one ``free`` of the previous step's locations) beside its parts: the output allocation, the two launches, and
each call with its launch replaced by a no-op (the Python around the launch); and a gather's new output made two
ways.  The probe behind the allocator rows of benchmarks/RESULTS.md; best of 21 runs of 500 calls, the garbage
collector off.

    python3 benchmarks/probe_alloc_step.py
"""

import gc
import time

import torch

from kvcore.allocators import PagedTokenToKVPoolAllocator

BS, CALLS, RUNS = 256, 500, 21


def host_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    best = float("inf")
    try:
        for _ in range(RUNS):
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            best = min(best, (time.perf_counter() - start) / CALLS * 1e6)
            torch.cuda.synchronize()
    finally:
        gc.enable()
    return best


class _NoLaunch:
    """What a launch plan reads of its launcher, launching nothing."""

    direct, _stream, _device_index = False, None, 0

    def __call__(self, *args, **kwargs) -> None:
        pass


def allocator(page_size: int, stub: bool):
    size = 1 << 25  # room for every call's pages where nothing is given back (alloc_decode alone, stubbed)
    a = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cuda", None, need_sort=False)
    if stub:  # the Python of each call without its launch (the counts then drift: a large pool absorbs it)
        a._decode_step._launch = a._pages._launch = _NoLaunch()  # before the first call makes its plans
    return a


def main() -> None:
    res = {}
    x = torch.zeros(1, device="cuda")
    res["bare x.add_(0)"] = host_us(lambda: x.add_(0))
    ring = torch.zeros(16, dtype=torch.int64, device="cuda")
    dev = ring.device
    res["torch.empty((256,), dtype, device)"] = host_us(lambda: torch.empty((BS,), dtype=torch.int64, device=dev))
    res["ring.new_empty(256)"] = host_us(lambda: ring.new_empty(BS))
    # a gather's output (MLA, 8 tokens) as the pools make it, and through a template's new_empty
    res["torch.empty_strided((8, 1, 512), bf16)"] = host_us(
        lambda: torch.empty_strided((8, 1, 512), (512, 512, 1), dtype=torch.bfloat16, device=dev))
    bf16 = torch.zeros(0, dtype=torch.bfloat16, device=dev)
    res["bf16 template.new_empty((8, 1, 512))"] = host_us(lambda: bf16.new_empty((8, 1, 512)))
    for page_size in (1, 16):
        seq = torch.full((BS,), 3 * page_size + 1, dtype=torch.int64)
        seq_dev, last = seq.cuda(), (torch.arange(BS, device="cuda") + 1000) * page_size
        for stub in (False, True):
            tag = f"page {page_size}{', launch stubbed' if stub else ''}"
            a = allocator(page_size, stub)
            prev = [a.alloc_decode(seq_dev, seq, last)]

            def step():
                out = a.alloc_decode(seq_dev, seq, last)
                a.free(prev[0])
                prev[0] = out

            res[f"decode+free, {tag}"] = host_us(step)
            a = allocator(page_size, stub)
            res[f"alloc_decode, {tag}"] = host_us(lambda: a.alloc_decode(seq_dev, seq, last))
            a = allocator(page_size, stub)
            loc = a.alloc(BS * page_size)
            res[f"free (pages already free), {tag}"] = host_us(lambda: a.free(loc))
    for name, us in res.items():
        print(f"{name:48s} {us:7.2f} us")


if __name__ == "__main__":
    main()
