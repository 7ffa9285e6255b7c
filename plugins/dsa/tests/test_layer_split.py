"""DSA's layer split (kvcore_dsa.layer_split): the shards of a context-parallel group own contiguous, even shares of
the layers; a rank's plan and pool hold its share and one scratch layer; writes to others' layers are dropped; and
across two processes (gloo) every rank reads every layer as an unsplit pool holding the same writes would, each
layer fetched once until it is written again.  The conformance kit runs on a shard; ``torchrun -m kvcore up`` with
``parallel.cp_size=2`` shards the layers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kvcore_dsa.layer_split import LayerSplitDSATokenToKVPool, layer_owner, layer_shard_range, stacked_layers
from kvcore_dsa.pool import DSATokenToKVPool

import kvcore
from kvcore.errors import ConfigError
from kvcore.testing import KVCacheConformance, Variant
from kvcore.testing.tensors import compiled

DSV32 = ["model=deepseek-v3.2", "hardware=cpu", "memory.budget_gib=4", "parallel.tp_size=1"]
# DeepSeek-V3.2's row: 512 fp8 nope + 4 float32 scales + 64 bf16 rope; its indexer page: 64 fp8 keys of 128 + 64 scales
ROW_BYTES, INDEX_PAGE_BYTES = 512 + 4 * 4 + 64 * 2, 64 * 128 + 64 * 4


def test_the_shards_own_contiguous_even_shares():
    for layers, shards in ((61, 2), (5, 3), (8, 4), (3, 2)):
        ranges = [layer_shard_range(r, shards, layers) for r in range(shards)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges  # contiguous, in rank order
        sizes = [end - start for start, end in ranges]
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1, sizes
        assert [layer_owner(i, shards, layers) for i in range(layers)] == [
            r for r, n in enumerate(sizes) for _ in range(n)]  # fmt: skip
        assert [stacked_layers(r, shards, layers) for r in range(shards)] == [n + 1 for n in sizes]
    assert layer_shard_range(0, 2, 61) == (0, 31) and layer_shard_range(1, 2, 61) == (31, 61)


@pytest.mark.parametrize("cp_rank, owned", [(0, 31), (1, 30)])
def test_a_shards_plan_holds_its_layers_and_a_scratch(cp_rank, owned):
    """Bytes per token: (owned + 1 scratch) layers of a 656-byte row and a 64th of an indexer page; about twice the
    tokens of the unsplit plan for the same budget."""
    whole = kvcore.plan_memory(kvcore.load_config(*DSV32))
    split = kvcore.plan_memory(kvcore.load_config(*DSV32, "parallel.cp_size=2", f"parallel.cp_rank={cp_rank}"))
    assert whole.layout.bytes_per_token == 61 * (ROW_BYTES + INDEX_PAGE_BYTES // 64)
    assert split.layout.bytes_per_token == (owned + 1) * (ROW_BYTES + INDEX_PAGE_BYTES // 64)
    assert 1.8 < split.max_total_num_tokens / whole.max_total_num_tokens < 2.0
    assert any(f"stores layers {cp_rank * 31}..{cp_rank * 31 + owned - 1} of 61" in note for note in split.layout.notes)


def _pool(kernels: str = "native", rank: int = 0, shards: int = 2, group=None, layers: int = 3, size: int = 128):
    kw = dict(size=size, page_size=64, kv_lora_rank=128, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
              layer_num=layers, device="cpu", index_head_dim=128, enable_memory_saver=False, kernels=kernels)  # fmt: skip
    if shards == 1:
        return DSATokenToKVPool(**kw)
    return LayerSplitDSATokenToKVPool(**kw, layer_shard_rank=rank, layer_shard_size=shards, layer_shard_group=group)


def _write(pool, layer: int, seed: int, loc: torch.Tensor) -> None:
    """The same rows on every rank for the same seed: latent parts and the indexer's keys and scales."""
    gen = torch.Generator().manual_seed(seed)
    n = loc.numel()
    nope, rope = torch.randn((n, 1, 128), generator=gen), torch.randn((n, 1, 64), generator=gen)
    pool.set_mla_kv_buffer(layer, loc, nope, rope)
    keys = (torch.randn((n, 128), generator=gen) * 4).to(torch.float8_e4m3fn)
    pool.set_index_k_scale_buffer(layer, loc, keys, torch.rand((n,), generator=gen) + 0.5)


def test_one_process_writes_its_layers_and_drops_the_others():
    pool = _pool(rank=1)  # owns layer 2 of 0..2
    assert pool.token_layers() == [2] and pool.layer_shard_start == 2
    assert pool.kv_cache.shape[0] == pool.index_k_with_scale_cache.shape[0] == 2  # layer 2 and the scratch
    loc = torch.arange(64, 70)
    before = {name: buf.clone() for name, buf in pool.buffers().items()}
    _write(pool, 0, 1, loc)
    assert all(torch.equal(buf, before[name]) for name, buf in pool.buffers().items()), "a dropped write landed"
    _write(pool, 2, 1, loc)
    ref = _pool(shards=1)
    _write(ref, 2, 1, loc)
    assert torch.equal(pool.get_key_buffer(2).view(torch.uint8), ref.get_key_buffer(2).view(torch.uint8))
    assert torch.equal(pool.get_index_k_with_scale_buffer(2), ref.get_index_k_with_scale_buffer(2))
    with pytest.raises(RuntimeError, match="stored by layer shard 0: reading it needs the shards' torch.distributed"):
        pool.get_key_buffer(0)
    infos = pool.get_contiguous_buf_infos()
    assert infos[0] == [pool.kv_cache[0].data_ptr()] and pool.get_state_buf_infos()[1] == [pool.index_k_with_scale_cache[0].nbytes]
    with pytest.raises(ConfigError, match="layer_shard_size=1"):
        LayerSplitDSATokenToKVPool(size=128, page_size=64, kv_lora_rank=128, dtype=torch.bfloat16, qk_rope_head_dim=64,
                                   layer_num=3, device="cpu", index_head_dim=128, enable_memory_saver=False,
                                   layer_shard_rank=0, layer_shard_size=1)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        pool, ref = _pool(rank=rank, group=dist.group.WORLD, layers=5), _pool(shards=1, layers=5)
        loc = torch.tensor([64, 65, 66, 100, 127, 130, 191])
        for layer in range(5):  # every rank writes every layer (each keeps its own)
            for p in (pool, ref):
                _write(p, layer, 10 + layer, loc)
        calls = []
        broadcast = dist.broadcast
        dist.broadcast = lambda *a, **k: (calls.append(k.get("src")), broadcast(*a, **k))[1]
        same = []
        for layer in (0, 1, 3, 4, 2, 4):  # owners: 0 0 1 1 0 1 (rank 0 owns 0..2)
            got = [pool.get_mla_kv_buffer(layer, loc, torch.float32), pool.get_index_k_with_scale_buffer(layer)]
            want = [ref.get_mla_kv_buffer(layer, loc, torch.float32), ref.get_index_k_with_scale_buffer(layer)]
            same.append(all(torch.equal(a, b) for a, b in zip([*got[0], got[1]], [*want[0], want[1]])))
            pool.get_key_buffer(layer)  # the same layer again: no more broadcasts
        _write(pool, 4, 99, loc)  # a write to layer 4: its scratch copy is stale
        _write(ref, 4, 99, loc)
        fresh = torch.equal(pool.get_key_buffer(4).view(torch.uint8), ref.get_key_buffer(4).view(torch.uint8))
        dist.broadcast = broadcast
        results.put(dict(rank=rank, same=same, calls=calls, fresh=fresh))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(dict(rank=rank, error=repr(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(compiled(), reason="gloo between CPU processes: the CPU suite covers it")
def test_every_rank_reads_every_layer_from_its_owner():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted((results.get(timeout=240) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    assert not [r for r in out if "error" in r], out
    for r in out:
        assert r["same"] == [True] * 6, r
        # two buffers (latent rows, indexer pages) per layer fetched: layers 0, 1, 3, 4, 2, then 4 again after the
        # read of 2 replaced it in the scratch, then 4 once more after its write
        assert r["calls"] == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], r
        assert r["fresh"], r


class TestLayerSplitDSAConformance(KVCacheConformance):
    """The kit on a shard of DeepSeek-V3.2 shrunk to 3 layers (cp rank 0 owns 2, rank 1 owns 1)."""

    backend = "dsa"
    config = ["model=deepseek-v3.2", "model.num_hidden_layers=3", "model.mla.kv_lora_rank=256", "parallel.tp_size=1",
              "parallel.cp_size=2"]  # fmt: skip
    variants = [Variant("float8_e4m3fn", "triton", 64), Variant("float8_e4m3fn", "native", 64, ["parallel.cp_rank=1"])]

    @pytest.fixture
    def kv_pool_size(self):
        return 3 * 64


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_torchrun_shards_a_dsa_models_layers():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCORE_TEST_COMPILED")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_free_port()), "-m", "kvcore", "up", "model=deepseek-v3.2", "hardware=cpu",
                          "parallel.tp_size=1", "parallel.cp_size=2", "memory.budget_gib=1",
                          "memory.max_total_tokens=256"], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rank 0 of 2 (tp rank 0, cp rank 0, pp rank 0, dp rank 0)" in run.stdout
    assert "this rank (cp rank 0) stores layers 0..30 of 61" in run.stdout  # rank 0 prints the plan
    assert "[rank 0] ok   write/read   64 tokens x 31 layers" in run.stdout  # each rank checks the layers it stores
    assert "[rank 1] ok   write/read   64 tokens x 30 layers" in run.stdout
    ready = [line.split("] ", 1)[1] for line in run.stdout.splitlines() if "kvcore up: ready" in line]
    assert len(ready) == 2 and len(set(ready)) == 1, ready  # the same agreed sizes on both
