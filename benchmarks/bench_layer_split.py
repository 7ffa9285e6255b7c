"""DSA's layer split across the ranks of one host (issue 30): what a read of a layer another rank stores costs.

    torchrun --nproc-per-node 2 benchmarks/bench_layer_split.py              # two GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/bench_layer_split.py --one-gpu    # one GPU (gloo): part 3 only is real
    torchrun --nproc-per-node 2 benchmarks/bench_layer_split.py --device cpu --small   # a smoke run (gloo)

Every rank builds its shard of DeepSeek-V3.2's fp8 DSA pool (``LayerSplitDSATokenToKVPool``: 61 layers, 656-byte
latent rows, 128-wide fp8 indexer keys, pages of 64; rank 0 stores layers 0..30, rank 1 layers 31..60, each one
scratch layer more) of ``--tokens`` slots, writes rank 0's first layer and rank 1's (each owner's write lands), and
then, every rank making the same calls:

1. **Correctness**: every rank reads a layer of each owner (latent rows dequantized at random locations, and the
   indexer pages) and compares them with what the owner reads of its own layer (sent to it): the same bytes.
2. **Fetch**: a layer another rank stores, brought into the scratch (its latent rows and indexer pages, one
   broadcast each), beside the ceiling: one broadcast of the same number of bytes as a single tensor.
3. **Reads and stores at N tokens** (rank 0's view): ``get_mla_kv_buffer`` of its own layer and of the fetched one
   (the same launch: the split adds nothing once a layer is here), ``set_mla_kv_buffer`` of its own layer and of
   another's (dropped: host time only), beside the torch path (a pool built with ``kernels="native"``) and, on a
   GPU, the measured copy ceiling (656 fp8 + 1152 bf16 bytes a token).  Every rank makes each call once together
   (a read may be collective: it fetches the layer when the scratch holds another); rank 0 then times its repeats
   alone, in CUDA-graph replay (``kvcore.tools.timing.graph_us``; the wall clock on the CPU), while the others
   wait: the repeats are local, and leave every rank's scratch as the first call did.

``--one-gpu`` puts every rank on the first GPU and links them with gloo: the fetch then goes through the host (not
what NCCL between two GPUs does), but the reads and stores of part 3 are timed as on two GPUs (rank 0 alone on the
device).

Rank 0 prints the table; each rank's own lines go to ``$OUT/layer_split_rank<r>.txt``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from kvcore.tools.timing import copy_ceiling_gbps, graph_us, median_ms
from kvcore_dsa.layer_split import LayerSplitDSATokenToKVPool, layer_shard_range

LAYERS, RANK, ROPE, INDEX_DIM, PAGE = 61, 512, 64, 128, 64
#: bytes a token of a latent read or store moves: the fp8 row with its scales and bf16 rope, and the bf16 row
ROW_BYTES = 656 + (RANK + ROPE) * 2


def build(args, rank: int, world: int, device: str, kernels: str) -> LayerSplitDSATokenToKVPool:
    return LayerSplitDSATokenToKVPool(
        size=args.tokens, page_size=PAGE, dtype=torch.float8_e4m3fn, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
        layer_num=args.layers, device=device, index_head_dim=INDEX_DIM, enable_memory_saver=False, kernels=kernels,
        layer_shard_rank=rank, layer_shard_size=world, layer_shard_group=dist.group.WORLD,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=131072, help="slots of each rank's pool")
    parser.add_argument("--small", action="store_true", help="4 layers and 2048 slots (a smoke run)")
    parser.add_argument("--one-gpu", action="store_true", help="every rank on the first GPU, linked by gloo")
    args = parser.parse_args()
    args.layers = 4 if args.small else LAYERS
    args.tokens = 2048 if args.small else args.tokens
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda and not args.one_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", rank)))
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), f"layer_split_rank{rank}.txt"), "w")

    def timed(fn) -> float:  # median ms of 20 runs, every rank starting together
        return median_ms(fn, 20, cuda=cuda, before_each=dist.barrier)

    def say(line: str) -> None:
        log.write(line + "\n")
        log.flush()
        if rank == 0:
            print(line, flush=True)

    pool = build(args, rank, world, device, "triton" if cuda else "native")
    torch_pool = build(args, rank, world, device, "native")
    first, last = layer_shard_range(0, world, args.layers)
    where = (f"{torch.cuda.get_device_name()} x {world} ranks" + (" on one GPU (gloo)" if args.one_gpu else " (NCCL)")
             if cuda else f"cpu x {world} ranks (gloo)")  # fmt: skip
    say(f"{where}; DeepSeek-V3.2 DSA, {args.layers} layers, {args.tokens} slots a rank; rank 0 stores layers "
        f"{first}..{last - 1}")  # fmt: skip

    gen = torch.Generator().manual_seed(0)  # the same on every rank: the same locations and inputs
    loc_all = torch.randperm(args.tokens - PAGE, generator=gen)[: args.tokens // 2] + PAGE
    # every rank makes the same collective calls: the layers read are rank 0's first and rank 1's first, on every
    # rank; each rank writes them (the owner's writes land, the others' are dropped)
    own, remote = (layer_shard_range(r, world, args.layers)[0] for r in (0, 1))
    for layer in (own, remote):
        for p in (pool, torch_pool):
            nope = torch.randn(len(loc_all), 1, RANK, generator=gen).to(device, torch.bfloat16)
            rope = torch.randn(len(loc_all), 1, ROPE, generator=gen).to(device, torch.bfloat16)
            keys = torch.randn(len(loc_all), INDEX_DIM, generator=gen).to(device).to(torch.float8_e4m3fn)
            scales = torch.rand(len(loc_all), generator=gen).add_(0.01).to(device)
            p.set_mla_kv_buffer(layer, loc_all.to(device), nope, rope)
            p.set_index_k_scale_buffer(layer, loc_all.to(device), keys, scales)

    # 1. correctness: a layer of each owner, read everywhere, against the owner's own read
    loc = loc_all[:4096].to(device)
    for owner, layer in enumerate((own, remote)):
        got = [*pool.get_mla_kv_buffer(layer, loc, torch.float32), pool.get_index_k_with_scale_buffer(layer)]
        for mine in got:  # compared as bytes: the owner's sent to every rank
            mine = mine.contiguous().view(torch.uint8)
            theirs = mine.clone()
            dist.broadcast(theirs, src=owner)
            assert torch.equal(mine, theirs), f"rank {rank} reads layer {layer} otherwise than its owner"
    say("correctness: every rank reads every owner's layer as its owner does")

    # 2. fetching a layer another rank stores, beside one broadcast of as many bytes
    layer_bytes = sum(b[0].nbytes for b in pool.buffers().values())
    block = torch.empty(layer_bytes, dtype=torch.uint8, device=device)

    def fetch():
        pool.invalidate_index_buffer_for_layer(remote)
        pool.prefetch_kv_buffer(remote)

    t_fetch, t_ceil = timed(fetch), timed(lambda: dist.broadcast(block, src=1))
    say(f"fetch of layer {remote} (rank 1's) into every scratch: {layer_bytes / 1e6:.1f} MB, {t_fetch:.3f} ms "
        f"({layer_bytes / t_fetch / 1e6:.1f} GB/s); one broadcast of as many bytes {t_ceil:.3f} ms: "
        f"{t_ceil / t_fetch:.2f} of it")  # fmt: skip

    # 3. reads and stores at N tokens: rank 0's own layer and rank 1's, kvcore and the torch path.  Every rank makes
    # a call once (a read of a layer the scratch does not hold is collective: its owner broadcasts it); rank 0 then
    # times its repeats alone (they are local, and leave the scratch as the first call did) while the others wait.
    def alone(fn):
        result = fn() if rank == 0 else None
        dist.barrier()
        return result

    def local_us(fn) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return alone(lambda: graph_us(fn) if cuda else median_ms(fn, 20, cuda=False) * 1e3)

    ceiling = alone(copy_ceiling_gbps) if cuda else None
    if ceiling:
        say(f"copy ceiling (rank 0's device alone): {ceiling:.0f} GB/s")
    say(f"{'op (rank 0)':<48} {'N':>6} {'kvcore us':>10} {'of ceiling':>10} {'torch us':>9} {'torch/kvcore':>13}")
    for n in (256, 4096, 32768):
        if n > len(loc_all):
            continue
        at = loc_all[:n].to(device)
        nope = torch.randn(n, 1, RANK, generator=gen).to(device, torch.bfloat16)
        rope = torch.randn(n, 1, ROPE, generator=gen).to(device, torch.bfloat16)
        rows = (
            (f"get_mla_kv_buffer, own layer {own}", lambda p: p.get_mla_kv_buffer(own, at), True),
            (f"get_mla_kv_buffer, fetched layer {remote}", lambda p: p.get_mla_kv_buffer(remote, at), True),
            (f"set_mla_kv_buffer, own layer {own}", lambda p: p.set_mla_kv_buffer(own, at, nope, rope), True),
            (f"set_mla_kv_buffer, layer {remote} (dropped on rank 0)",
             lambda p: p.set_mla_kv_buffer(remote, at, nope, rope), False),
        )  # fmt: skip
        for name, op, moves in rows:
            us_ours, us_torch = local_us(lambda: op(pool)), local_us(lambda: op(torch_pool))
            if rank == 0:
                share = f"{n * ROW_BYTES / us_ours / 1e3 / ceiling:10.2f}" if ceiling and moves else f"{'-':>10}"
                say(f"{name:<48} {n:>6} {us_ours:>10.2f} {share} {us_torch:>9.2f} {us_torch / us_ours:>13.2f}")
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
