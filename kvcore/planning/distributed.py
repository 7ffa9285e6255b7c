"""Multi-rank startup: every rank of a ``torch.distributed`` process group plans its own pools, and all agree.

Under an initialised process group of ``parallel.tp_size x parallel.pp_size x parallel.dp_size`` ranks
(global rank = ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``, pipeline stages outside tensor ranks):

1. :func:`rank_config` gives each rank its own ``parallel.pp_rank``, so it plans and allocates only its stage's
   layers (``start_layer`` / ``end_layer``); each tensor rank stores ``kv_heads / tp_size`` heads.
2. Each rank plans from its own profiled memory (its free bytes, or the hardware profile's).
3. :func:`agree` all-reduces every planned size (the token capacity, the sliding-window tokens, the state slots)
   and ``max_running_requests`` with MIN over the group, as SGLang syncs its token capacity, so every rank
   builds pools of the same sizes: the smallest any rank can hold.

:func:`kvcore.build_pools` does all three by itself when a process group of more than one rank is initialised;
:func:`init_from_env` starts one from ``torchrun``'s environment (``kvcore up`` calls it).
"""

from __future__ import annotations

import logging
import os

import attrs
import torch

from kvcore.config import EngineConfig
from kvcore.errors import ConfigError
from kvcore.planning.planner import MemoryPlan, req_to_token_bytes

logger = logging.getLogger(__name__)

__all__ = ["RankPlacement", "active", "agree", "context_parallel_group", "context_parallel_ranks", "init_context_parallel",
           "init_from_env", "placement", "rank_config"]


@attrs.frozen
class RankPlacement:
    """Where one global rank sits in the parallel layout."""

    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0
    cp_size: int = 1

    def describe(self) -> str:
        cp = f", cp rank {self.cp_rank}" if self.cp_size > 1 else ""
        return (f"rank {self.rank} of {self.world_size} (tp rank {self.tp_rank}{cp}, pp rank {self.pp_rank}, dp rank "
                f"{self.dp_rank})")  # fmt: skip


def active(group=None) -> bool:
    """True inside an initialised process group of more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def placement(cfg: EngineConfig, rank: int, world_size: int) -> RankPlacement:
    """This rank's tensor, context-parallel, pipeline and data-parallel ranks (global rank = ``((dp_rank * pp_size +
    pp_rank) * cp_size + cp_rank) * tp_size + tp_rank``).

    :raises ConfigError: when the group's size is not ``tp_size x cp_size x pp_size x dp_size``, naming the keys.
    """
    p = cfg.parallel
    expected = p.tp_size * p.cp_size * p.pp_size * p.dp_size
    if world_size != expected:
        cp = f" x parallel.cp_size={p.cp_size}" if p.cp_size > 1 else ""
        raise ConfigError(
            f"the process group has {world_size} ranks, but parallel.tp_size={p.tp_size}{cp} x parallel.pp_size="
            f"{p.pp_size} x parallel.dp_size={p.dp_size} = {expected}: set them so that their product is {world_size} "
            f"(e.g. parallel.tp_size={world_size // (p.cp_size * p.pp_size * p.dp_size) or 1}), or start {expected} "
            f"processes"
        )  # fmt: skip
    tp_rank = rank % p.tp_size
    cp_rank = (rank // p.tp_size) % p.cp_size
    pp_rank = (rank // (p.tp_size * p.cp_size)) % p.pp_size
    dp_rank = rank // (p.tp_size * p.cp_size * p.pp_size)
    return RankPlacement(rank, world_size, tp_rank, pp_rank, dp_rank, cp_rank, p.cp_size)


def context_parallel_ranks(cfg: EngineConfig, world_size: int) -> list[list[int]]:
    """The global ranks of every context-parallel group (ranks that differ in their cp rank alone), each in cp rank
    order: what a layer-sharded pool broadcasts its layers among."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank in range(world_size):
        where = placement(cfg, rank, world_size)
        groups.setdefault((where.tp_rank, where.pp_rank, where.dp_rank), []).append(rank)
    return list(groups.values())


_CONTEXT_PARALLEL_GROUP: list = [None]


def init_context_parallel(cfg: EngineConfig) -> None:
    """Create the context-parallel process groups (collective: every rank of the default group calls it, creating
    every group in the same order) and keep this rank's (:func:`context_parallel_group`).  Nothing to do with
    ``parallel.cp_size=1``."""
    if cfg.parallel.cp_size <= 1:
        return
    dist = torch.distributed
    mine = None
    for ranks in context_parallel_ranks(cfg, dist.get_world_size()):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    _CONTEXT_PARALLEL_GROUP[0] = mine


def context_parallel_group():
    """This rank's context-parallel process group (its group ranks are the cp ranks), made by
    :func:`init_context_parallel`; None before, or in a single process."""
    return _CONTEXT_PARALLEL_GROUP[0]


def rank_config(cfg: EngineConfig, group=None) -> tuple[EngineConfig, RankPlacement]:
    """``cfg`` for this process's rank of ``group`` (``parallel.pp_rank`` set from the rank).

    :raises ConfigError: for a group of the wrong size, or a ``parallel.pp_rank`` that contradicts the rank.
    """
    dist = torch.distributed
    where = placement(cfg, dist.get_rank(group), dist.get_world_size(group))
    for key, mine in (("pp_rank", where.pp_rank), ("cp_rank", where.cp_rank)):
        if getattr(cfg.parallel, key) not in (0, mine):
            raise ConfigError(
                f"parallel.{key}={getattr(cfg.parallel, key)} contradicts {where.describe()}: leave parallel.{key} unset "
                "under torch.distributed (each rank takes it from its rank)"
            )  # fmt: skip
    return attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel, pp_rank=where.pp_rank, cp_rank=where.cp_rank)), where


def _reduce_device(group) -> str:
    return "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"


def agree(plan: MemoryPlan, group=None) -> MemoryPlan:
    """``plan`` with every size group and ``max_running_requests`` lowered to the minimum over ``group``'s ranks
    (one all-reduce); a rank whose own plan was larger logs and records what it lowered.  Collective: every
    rank of the group must call it."""
    names = sorted(plan.sizes)
    local = [plan.sizes[name] for name in names] + [plan.max_running_requests]
    values = torch.tensor(local, dtype=torch.int64, device=_reduce_device(group))
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN, group=group)
    agreed = values.tolist()
    if agreed == local:
        return plan
    sizes = dict(zip(names, agreed[:-1]))
    requests = agreed[-1]
    lowered = [f"{name} {mine} -> {theirs}" for name, mine, theirs in zip([*names, "max_running_requests"], local, agreed)
               if mine != theirs]  # fmt: skip
    note = f"lowered to agree with the other ranks (all-reduce MIN): {', '.join(lowered)}"
    logger.info(note)
    return attrs.evolve(
        plan,
        sizes=sizes,
        max_total_num_tokens=sizes["tokens"],
        max_running_requests=requests,
        kv_cache_bytes=plan.layout.total_bytes({g: sizes[g] for g in plan.layout.groups}),
        req_to_token_bytes=req_to_token_bytes(requests + plan.pre_alloc_size, plan.request_context_len),
        warnings=(*plan.warnings, note),
    )


def init_from_env(device: str) -> bool:
    """Start the default process group from ``torchrun``'s environment (``WORLD_SIZE`` > 1) when none is running:
    gloo for CPU pools, NCCL (on the ``LOCAL_RANK`` GPU) for CUDA pools.  Returns whether this process is one
    rank of several."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return True
