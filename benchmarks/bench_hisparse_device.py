"""HiSparse's transfers between the host mirror and the device on a GPU (``python benchmarks/bench_hisparse_device.py``).

DeepSeek-V3.2's fp8 latent rows (656 bytes, 61 layers), a HiSparse pool of 32768 device slots and 65536 logical
tokens (``host_to_device_ratio=2``, the host mirror pinned).  For N scattered tokens:

- **load** (``load_from_host``, what ``load_to_device`` launches): every layer's rows of N random logical tokens
  gathered from pinned host memory into N random device slots, one launch reading over the bus;
- **backup** (``backup_to_host``): the reverse, device slots to the host mirror, one launch writing over the bus;

each beside the torch path (a gather on the host, one copy across the bus, a scatter on the device; and back) and
the bus's copy ceiling, measured as one contiguous pinned copy of the same bytes in each direction.  Correctness
first: both launches must give torch's bytes.
"""

from __future__ import annotations

import torch

from kvcore.kernels.row_move import copy_rows
from kvcore_dsa.hisparse import HiSparseDSATokenToKVPool

LAYERS, ROW, SLOTS, RATIO = 61, 656, 32768, 2


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of ``fn`` (CUDA events, the device waited for)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    pool = HiSparseDSATokenToKVPool(SLOTS, 64, 512, torch.float8_e4m3fn, 64, LAYERS, "cuda", 128, False,
                                    host_to_device_ratio=RATIO, kernels="triton")  # fmt: skip
    host, device = pool.host_kv_cache, pool.kv_cache
    assert host.is_pinned(), "the host mirror must be pinned"
    gen = torch.Generator().manual_seed(0)
    host.view(-1).copy_(torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, generator=gen))
    print(f"{torch.cuda.get_device_name()}; {LAYERS} layers x {ROW} bytes a token; device {SLOTS} slots, host "
          f"{SLOTS * RATIO} tokens ({host.nbytes / 2**30:.1f} GiB pinned)")
    print(f"{'op':>7} {'tokens':>7} {'MB':>8} {'kvcore ms':>10} {'torch ms':>9} {'ceiling ms':>11} {'kvcore/ceil':>12} "
          f"{'torch/ceil':>11}")  # fmt: skip
    for n in (2048, 8192, 32000):
        loc = (torch.randperm(SLOTS * RATIO - 64, generator=gen)[:n] + 64).cuda()
        slots = (torch.randperm(SLOTS - 64, generator=gen)[:n] + 64).cuda()
        nbytes = n * LAYERS * ROW
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        block_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        loc_cpu = loc.cpu()

        def torch_load():
            device[:, slots] = host[:, loc_cpu].to("cuda", non_blocking=True)

        def torch_backup():
            host[:, loc_cpu] = device[:, slots].to("cpu")

        copy_rows(host, device, loc, slots)
        torch.cuda.synchronize()
        assert torch.equal(device[:, slots].cpu(), host[:, loc_cpu]), f"load of {n} tokens differs from torch's"
        device[:, slots] = torch.randint(0, 256, (LAYERS, n, 1, ROW), dtype=torch.uint8, device="cuda")
        copy_rows(device, host, slots, loc)
        torch.cuda.synchronize()
        assert torch.equal(host[:, loc_cpu], device[:, slots].cpu()), f"backup of {n} tokens differs from torch's"
        rows = (("load", lambda: copy_rows(host, device, loc, slots), torch_load, lambda: block_dev.copy_(block, non_blocking=True)),
                ("backup", lambda: copy_rows(device, host, slots, loc), torch_backup, lambda: block.copy_(block_dev, non_blocking=True)))  # fmt: skip
        for op, ours, theirs, ceiling in rows:
            t_ours, t_torch, t_ceil = timed(ours), timed(theirs), timed(ceiling)
            print(f"{op:>7} {n:>7} {nbytes / 1e6:>8.1f} {t_ours:>10.3f} {t_torch:>9.3f} {t_ceil:>11.3f} "
                  f"{t_ceil / t_ours:>12.2f} {t_ceil / t_torch:>11.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
