"""HiSparse's transfers between the host mirror and the device on a GPU (``python benchmarks/bench_hisparse_device.py``).

DeepSeek-V3.2's fp8 latent rows (656 bytes, 61 layers), a HiSparse pool of 32768 device slots and 65536 logical
tokens (``host_to_device_ratio=2``, the host mirror pinned).  For N scattered tokens:

- **load** (``load_from_host``, what ``load_to_device`` launches): every layer's rows of N random logical tokens
  gathered from pinned host memory into N random device slots, one launch reading over the bus;
- **backup** (``backup_to_host``): the reverse, device slots to the host mirror, one launch writing over the bus;

each beside the torch path (a gather on the host, one copy across the bus, a scatter on the device; and back) and
the bus's copy ceiling, measured as one contiguous pinned copy of the same bytes in each direction.  Correctness
first: both launches must give torch's bytes.

Then DeepSeek-V4-Flash's ratio-4 latents (``kvcore_dsv4.hisparse.HiSparseC4DevicePool``: 21 layers, 584 bytes a
compressed slot (a 576-byte data row and an 8-byte scale row), pages of 64 slots; 32768 device slots, 65536 logical
ones): ``load_from_host`` (two launches, data rows and scale rows, plus the map update) and ``backup_to_host``, the
same way.
"""

from __future__ import annotations

import torch

from kvcore.kernels.row_move import copy_rows
from kvcore.tools.timing import median_ms as timed
from kvcore_dsa.hisparse import HiSparseDSATokenToKVPool
from kvcore_dsv4.hisparse import HiSparseC4DevicePool

LAYERS, ROW, SLOTS, RATIO = 61, 656, 32768, 2
#: DeepSeek-V4-Flash's ratio-4 layers, bytes a compressed slot, and slots a page of the compressed latents
V4_LAYERS, V4_SLOT_BYTES, V4_PAGE = 21, 584, 64


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
            report(op, n, nbytes, timed(ours), timed(theirs), timed(ceiling))
    deepseek_v4(gen)


def report(op: str, n: int, nbytes: int, t_ours: float, t_torch: float, t_ceil: float) -> None:
    print(f"{op:>7} {n:>7} {nbytes / 1e6:>8.1f} {t_ours:>10.3f} {t_torch:>9.3f} {t_ceil:>11.3f} "
          f"{t_ceil / t_ours:>12.2f} {t_ceil / t_torch:>11.2f}")  # fmt: skip


def same_bytes(pool: HiSparseC4DevicePool, slots: torch.Tensor, loc: torch.Tensor) -> bool:
    """Whether device slots ``slots`` hold the host mirror's bytes of logical slots ``loc`` (data and scale rows, every
    layer)."""
    device, host = pool.token_rows(), pool._host.token_rows()
    return all(torch.equal(device[part].rows[:, device[part].row_of(slots)].cpu(),
                           host[part].rows[:, host[part].row_of(loc.cpu())]) for part in ("data", "scales"))  # fmt: skip


def deepseek_v4(gen: torch.Generator) -> None:
    """DeepSeek-V4's ratio-4 latents: ``load_from_host`` and ``backup_to_host`` of N scattered compressed slots."""
    page_bytes = -(-V4_PAGE * V4_SLOT_BYTES // 576) * 576  # a page's slots, padded to whole 576-byte data rows
    stacked = torch.zeros(V4_LAYERS, SLOTS // V4_PAGE + 1, page_bytes, dtype=torch.uint8, device="cuda")
    pool = HiSparseC4DevicePool(stacked, V4_PAGE, True, SLOTS, SLOTS * RATIO, 4 * V4_PAGE)
    host = pool.host_kv_cache
    assert host.is_pinned(), "the host mirror must be pinned"
    host.view(-1).copy_(torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, generator=gen))
    print(f"DeepSeek-V4-Flash ratio-4 latents: {V4_LAYERS} layers x {V4_SLOT_BYTES} bytes a slot; device {SLOTS} slots, "
          f"host {SLOTS * RATIO} ({host.nbytes / 2**30:.2f} GiB pinned)")  # fmt: skip
    for n in (2048, 8192, 32000):
        loc = (torch.randperm(SLOTS * RATIO - V4_PAGE, generator=gen)[:n] + V4_PAGE).cuda()
        slots = (torch.randperm(SLOTS - V4_PAGE, generator=gen)[:n] + V4_PAGE).cuda()
        nbytes = n * V4_LAYERS * V4_SLOT_BYTES
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        block_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pool.load_from_host(loc, slots)
        torch.cuda.synchronize()
        assert same_bytes(pool, slots, loc), f"load of {n} slots differs from the host mirror's bytes"
        assert torch.equal(pool.full_to_hisparse_device_index_mapping[loc], slots), "load_from_host left the map"
        pool.stacked[:, 1:].random_(0, 256)  # new device bytes (the padding page stays zero) for the backup
        pool.backup_to_host(loc)
        torch.cuda.synchronize()
        assert same_bytes(pool, slots, loc), f"backup of {n} slots differs from the device's bytes"

        def with_torch(fn):
            def run():
                pool._use_triton = False
                try:
                    fn()
                finally:
                    pool._use_triton = True
            return run

        load, backup = (lambda: pool.load_from_host(loc, slots)), (lambda: pool.backup_to_host(loc))
        report("v4 load", n, nbytes, timed(load), timed(with_torch(load)),
               timed(lambda: block_dev.copy_(block, non_blocking=True)))  # fmt: skip
        report("v4 back", n, nbytes, timed(backup), timed(with_torch(backup)),
               timed(lambda: block.copy_(block_dev, non_blocking=True)))  # fmt: skip


if __name__ == "__main__":
    main()
