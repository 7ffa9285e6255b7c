"""Multi-rank startup on the CPU with gloo: 2 and 4 processes, each rank given a different memory budget, must
build pools of the same agreed sizes (the minimum over the ranks), each for its own pipeline stage and heads;
and ``torchrun -m kvcore up`` starts two ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcore import load_config, plan_memory
from kvcore.planning.distributed import context_parallel_ranks, placement
from kvcore.errors import ConfigError

MODEL = ["model=qwen2.5-0.5b", "hardware=cpu", "hardware.kernels=native"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def budgets(world: int) -> list[float]:
    """A different KV budget per rank (GiB): rank 1 the smallest, so the limit is not always rank 0's."""
    return [0.03 + 0.01 * ((r + 1) % world) for r in range(world)]


def worker(rank: int, world: int, port: int, overrides: list[str], results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import kvcore

        cfg = load_config(*MODEL, *overrides, f"memory.budget_gib={budgets(world)[rank]}")
        pools = kvcore.build_pools(cfg)
        pool = pools.token_to_kv_pool
        results.put(dict(rank=rank, start=pool.start_layer, end=pool.end_layer, heads=pool.head_num,
                         tokens=pools.plan.max_total_num_tokens, sizes=dict(pools.plan.sizes), size=pool.size,
                         requests=pools.plan.max_running_requests, free=pools.token_to_kv_pool_allocator.available_size(),
                         kv_bytes=sum(b.nbytes for b in pool.buffers().values()), planned_bytes=pools.plan.kv_cache_bytes))  # fmt: skip
    except Exception as exc:  # reported to the parent, which fails the test with it
        results.put(dict(rank=rank, error=repr(exc)))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, overrides: list[str]) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, overrides, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r for r in out if "error" in r]
    assert not errors, errors
    return sorted(out, key=lambda r: r["rank"])


def expected(world: int, overrides: list[str]) -> dict:
    """Each rank's own plan (its stage, its budget), computed here without any process group, and their minimum."""
    base = load_config(*MODEL, *overrides)
    plans = []
    for rank in range(world):
        where = placement(base, rank, world)
        cfg = load_config(*MODEL, *overrides, f"memory.budget_gib={budgets(world)[rank]}", f"parallel.pp_rank={where.pp_rank}")
        plans.append(plan_memory(cfg))
    return dict(tokens=min(p.max_total_num_tokens for p in plans), requests=min(p.max_running_requests for p in plans),
                own=[p.max_total_num_tokens for p in plans])  # fmt: skip


@pytest.mark.parametrize("world, overrides", [
    (2, ["parallel.pp_size=2"]),
    (4, ["parallel.tp_size=2", "parallel.pp_size=2"]),
])  # fmt: skip
def test_ranks_agree_on_the_smallest_plan_and_keep_their_own_layers_and_heads(world, overrides):
    got = run_ranks(world, overrides)
    want = expected(world, overrides)
    assert len(set(want["own"])) > 1, "the ranks' own plans must differ, or agreement proves nothing"
    for r in got:
        assert r["tokens"] == r["size"] == want["tokens"], r
        assert r["sizes"] == {"tokens": want["tokens"]}
        assert r["requests"] == want["requests"]
        assert r["free"] == want["tokens"]
        assert r["kv_bytes"] == r["planned_bytes"]
    cfg = load_config(*MODEL, *overrides)
    for r in got:
        where = placement(cfg, r["rank"], world)
        start, end = attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel, pp_rank=where.pp_rank)).layer_range
        assert (r["start"], r["end"]) == (start, end - 1), r  # only this stage's layers
        assert r["heads"] == cfg.model.num_key_value_heads // cfg.parallel.tp_size


def test_a_group_of_the_wrong_size_names_the_keys():
    cfg = load_config(*MODEL, "parallel.pp_size=2")
    with pytest.raises(ConfigError, match=r"the process group has 3 ranks, but parallel.tp_size=1 x parallel.pp_size=2"):
        placement(cfg, 0, 3)
    assert [placement(load_config(*MODEL, "parallel.tp_size=2", "parallel.pp_size=2"), r, 4).pp_rank for r in range(4)] == [0, 0, 1, 1]


def test_context_parallel_ranks_sit_between_tensor_and_pipeline_ranks():
    """Global rank = ((dp * pp_size + pp) * cp_size + cp) * tp_size + tp; a context-parallel group is the ranks
    that differ in their cp rank alone."""
    cfg = load_config(*MODEL, "parallel.tp_size=2", "parallel.cp_size=2", "parallel.pp_size=2")
    where = [placement(cfg, r, 8) for r in range(8)]
    assert [(w.tp_rank, w.cp_rank, w.pp_rank) for w in where] == [
        (tp, cp, pp) for pp in range(2) for cp in range(2) for tp in range(2)]  # fmt: skip
    assert context_parallel_ranks(cfg, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert where[3].describe() == "rank 3 of 8 (tp rank 1, cp rank 1, pp rank 0, dp rank 0)"
    with pytest.raises(ConfigError, match=r"parallel.tp_size=2 x parallel.cp_size=2 x parallel.pp_size=2"):
        placement(cfg, 0, 4)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_torchrun_starts_kvcore_up_on_two_ranks():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCORE_TEST_COMPILED")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "kvcore", "up", "parallel.pp_size=2", "memory.budget_gib=0.02"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ready = [line for line in run.stdout.splitlines() if "kvcore up: ready" in line]
    assert len(ready) == 2 and len({line.split("] ", 1)[1] for line in ready}) == 1, ready  # same sizes on both
    assert "[rank 0] rank 0 of 2 (tp rank 0, pp rank 0, dp rank 0): layers 0..11" in run.stdout
    assert "[rank 1] rank 1 of 2 (tp rank 0, pp rank 1, dp rank 0): layers 12..23" in run.stdout
