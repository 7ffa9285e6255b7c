"""Whether a Triton launch slows the host work after it (issue 31): one thread pinned to one core runs, layer after
layer, a cache update and then attention-like eager torch ops (GQA's repeat, two matmuls, the mask, softmax, the
output projection: what a transformers attention module does with the keys and values), and clocks the two apart.
The updates compared:

* ``none``: no update (the attention ops on the same keys and values);
* ``cat``: DynamicCache's, two ``torch.cat``;
* ``kvcore``: :meth:`HeadGather.store_and_gather`, the cache's one launch;
* ``nolaunch``: the same with its launch replaced by a Python no-op (its outputs left as they are);
* ``tiny``: a launch through Triton's dispatcher (``kernel[grid](...)``) of one program that stores one value, then
  ``nolaunch``'s work;
* ``torchone``: one torch kernel (a fill of one value: a launch through the CUDA runtime), then ``nolaunch``'s work;
* ``drvone``: ``tiny``'s compiled kernel launched by ``cuLaunchKernel`` (ctypes, the driver API with nothing of
  Triton's launcher around it), then ``nolaunch``'s work;
* ``rtone``: the same compiled kernel loaded and launched through the CUDA runtime (``cudaLibraryLoadData``,
  ``cudaLaunchKernel``; ctypes), as torch launches its own kernels, then ``nolaunch``'s work.

Every variant runs in rounds interleaved with the others; the device is synchronized every 8 layers, as a decode
step's end does.  Per variant: the median µs a layer of the update and of the attention ops after it, and the
attention's median over each round less ``none``'s in that round (the median and range over rounds: the host's
speed drifts between rounds far more than the differences sought).

    python benchmarks/probe_launch_after.py [--seq 100] [--batch 1]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from kvcore.kernels.head_gather import HeadGather


def _no_op(*args):
    pass


@triton.jit
def _one_store(out):
    tl.store(out, 1.0)


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def _library(part: str) -> str:
    """The path of the shared library whose name holds ``part``: the one this process has mapped, else one that
    NVIDIA's wheels installed beside torch (a torch whose CUDA runtime is linked in maps none)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if part in os.path.basename(path):
                return path
    site = os.path.dirname(torch.__path__[0])
    found = sorted(glob.glob(os.path.join(site, "nvidia", "**", part + "*"), recursive=True))
    if found:
        return found[0]
    raise RuntimeError(f"no {part} mapped in this process nor installed beside torch")


def _ctypes_launchers(compiled, flag: torch.Tensor):
    """``(driver_launch, runtime_launch)``: no-argument callables launching ``compiled`` (one pointer argument,
    ``flag``, then its scratch pointers as null) on the current stream, by the driver API and by the runtime's."""
    libcuda = ctypes.CDLL(_library("libcuda.so"))
    libcudart = ctypes.CDLL(_library("libcudart.so"))
    warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    slots = (ctypes.c_void_p * 4)(flag.data_ptr(), None, None, None)
    params = (ctypes.c_void_p * 4)(*(ctypes.addressof(slots) + 8 * i for i in range(4)))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    function = ctypes.c_void_p(compiled.function)
    cu_launch = libcuda.cuLaunchKernel
    cu_launch.restype = ctypes.c_int
    cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def driver_launch(_keep=slots):  # params points into slots: kept alive with the launcher
        rc = cu_launch(function, 1, 1, 1, 32 * warps, 1, 1, shared, stream, params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel: {rc}")

    library, kernel = ctypes.c_void_p(), ctypes.c_void_p()
    cubin = compiled.asm["cubin"]
    rc = libcudart.cudaLibraryLoadData(ctypes.byref(library), ctypes.c_char_p(cubin), None, None, 0, None, None, 0)
    if rc:
        raise RuntimeError(f"cudaLibraryLoadData: {rc}")
    rc = libcudart.cudaLibraryGetKernel(ctypes.byref(kernel), library, compiled.metadata.name.encode())
    if rc:
        raise RuntimeError(f"cudaLibraryGetKernel: {rc}")
    rt_launch = libcudart.cudaLaunchKernel
    rt_launch.restype = ctypes.c_int
    rt_launch.argtypes = [ctypes.c_void_p, _Dim3, _Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    grid, block = _Dim3(1, 1, 1), _Dim3(32 * warps, 1, 1)

    def runtime_launch(_keep=slots):
        rc = rt_launch(kernel, grid, block, params, shared, stream)
        if rc:
            raise RuntimeError(f"cudaLaunchKernel: {rc}")

    return driver_launch, runtime_launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    dev, dt = "cuda", torch.bfloat16
    b, kvh, h, d, layers = args.batch, 8, 32, 128, args.layers
    rows = b * (args.seq + args.steps + 64)
    k_layers = [torch.randn(rows, kvh, d, device=dev, dtype=dt) for _ in range(layers)]
    v_layers = [torch.randn(rows, kvh, d, device=dev, dtype=dt) for _ in range(layers)]
    table = torch.randperm(rows - 1, device=dev)[: b * (args.seq + args.steps + 8)].view(b, -1).to(torch.int32) + 1
    o_proj = torch.nn.Linear(h * d, h * d, bias=False, device=dev, dtype=dt)
    q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
    flag = torch.zeros(1, device=dev)
    compiled = _one_store[(1,)](flag)
    extra = {"tiny": lambda: _one_store[(1,)](flag), "torchone": lambda: flag.fill_(1.0)}
    try:
        launchers = dict(zip(("drvone", "rtone"), _ctypes_launchers(compiled, flag)))
    except (OSError, RuntimeError, AttributeError, KeyError) as error:  # no library, or a Triton without them
        print(f"the ctypes launches left out: {error}")
        launchers = {}
    for name, launch in launchers.items():  # each must store its 1.0 (a launch that fails stops the probe)
        flag.zero_()
        launch()
        if flag.item() != 1.0:
            raise RuntimeError(f"{name} stored nothing")
        extra[name] = launch

    def attention(k, v):
        n_rep = h // kvh
        seq = k.shape[2]
        k = k[:, :, None].expand(b, kvh, n_rep, seq, d).reshape(b, h, seq, d)
        v = v[:, :, None].expand(b, kvh, n_rep, seq, d).reshape(b, h, seq, d)
        w = torch.matmul(q, k.transpose(2, 3)) * (d**-0.5)
        w = w + mask[:, :, :, :seq]
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(dt)
        out = torch.matmul(w, v).transpose(1, 2).contiguous().reshape(b, 1, h * d)
        return o_proj(out)

    mask = torch.zeros(b, 1, 1, args.seq + args.steps + 1, device=dev, dtype=dt)
    new = [(torch.randn(b, kvh, 1, d, device=dev, dtype=dt), torch.randn(b, kvh, 1, d, device=dev, dtype=dt))
           for _ in range(layers)]  # fmt: skip

    def variant(name):
        """A generator of one decode step's updates for ``name``: ``update(layer, k_new, v_new) -> (keys, values)``."""
        if name in ("kvcore", "nolaunch", *extra):
            gather = HeadGather(k_layers, v_layers, dt, use_triton=True, reuse_outputs=True)
            state = {"end": args.seq}

            def update(layer, k_new, v_new):
                if layer == 0:
                    state["end"] += 1
                if name in extra:
                    extra[name]()
                return gather.store_and_gather(layer, table, k_new, v_new, state["end"])

            for layer in range(3):  # planned, then launched directly
                update(layer, *new[layer])
            if name != "kvcore":
                for plan in gather._store_plans.values():
                    plan.entry = (_no_op, plan.entry[1])
                gather._last_launch = gather.repeat = None
            return update
        if name == "cat":
            caches = [[torch.randn(b, kvh, args.seq, d, device=dev, dtype=dt)] * 2 for _ in range(layers)]

            def update(layer, k_new, v_new):
                pair = caches[layer]
                pair[0] = torch.cat([pair[0], k_new], dim=-2)
                pair[1] = torch.cat([pair[1], v_new], dim=-2)
                return pair[0], pair[1]

            return update
        fixed = (torch.randn(b, kvh, args.seq, d, device=dev, dtype=dt),) * 2
        return lambda layer, k_new, v_new: fixed

    names = ["none", "cat", "kvcore", "nolaunch", *extra]
    times = {name: ([], []) for name in names}
    rounds = {name: [] for name in names}  # per round: (median update, median attention after), ns
    gc.collect()
    gc.disable()
    with torch.no_grad():
        for _ in range(args.rounds):
            names = names[1:] + names[:1]  # no variant always runs first
            for name in names:
                update = variant(name)
                clock = time.perf_counter_ns
                mark = len(times[name][0])
                for step in range(args.steps):
                    for layer in range(layers):
                        t0 = clock()
                        k, v = update(layer, *new[layer])
                        t1 = clock()
                        attention(k, v)
                        t2 = clock()
                        del k, v
                        if step >= 10:
                            times[name][0].append(t1 - t0)
                            times[name][1].append(t2 - t1)
                    torch.cuda.synchronize()
                rounds[name].append(tuple(statistics.median(x[mark:]) for x in times[name]))
    gc.enable()
    print(f"batch {b}, {args.seq}+ tokens, {layers} layers: median µs a layer")
    print(f"{'update':<10} {'update':>8} {'attention after':>16} {'sum':>8}   attention after, vs none's: median "
          "[range] of the rounds' medians")
    base = [a for _, a in rounds["none"]]
    for name in sorted(names, key=["none", "cat", "kvcore", "nolaunch", *extra].index):
        u, a = (statistics.median(x) / 1e3 for x in times[name])
        more = sorted((a - b) / 1e3 for (_, a), b in zip(rounds[name], base))
        print(f"{name:<10} {u:8.2f} {a:16.2f} {u + a:8.2f}   {statistics.median(more):+6.2f} "
              f"[{more[0]:+.2f}, {more[-1]:+.2f}]")


if __name__ == "__main__":
    main()
