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

__all__ = ["RankPlacement", "active", "agree", "init_from_env", "placement", "rank_config"]


@attrs.frozen
class RankPlacement:
    """Where one global rank sits in the parallel layout."""

    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (tp rank {self.tp_rank}, pp rank {self.pp_rank}, dp rank {self.dp_rank})"


def active(group=None) -> bool:
    """True inside an initialised process group of more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def placement(cfg: EngineConfig, rank: int, world_size: int) -> RankPlacement:
    """This rank's tensor, pipeline and data-parallel ranks.

    :raises ConfigError: when the group's size is not ``tp_size x pp_size x dp_size``, naming the keys.
    """
    p = cfg.parallel
    expected = p.tp_size * p.pp_size * p.dp_size
    if world_size != expected:
        raise ConfigError(
            f"the process group has {world_size} ranks, but parallel.tp_size={p.tp_size} x parallel.pp_size={p.pp_size}"
            f" x parallel.dp_size={p.dp_size} = {expected}: set them so that their product is {world_size} (e.g. "
            f"parallel.tp_size={world_size // (p.pp_size * p.dp_size) or 1}), or start {expected} processes"
        )
    tp_rank = rank % p.tp_size
    pp_rank = (rank // p.tp_size) % p.pp_size
    dp_rank = rank // (p.tp_size * p.pp_size)
    return RankPlacement(rank, world_size, tp_rank, pp_rank, dp_rank)


def rank_config(cfg: EngineConfig, group=None) -> tuple[EngineConfig, RankPlacement]:
    """``cfg`` for this process's rank of ``group`` (``parallel.pp_rank`` set from the rank).

    :raises ConfigError: for a group of the wrong size, or a ``parallel.pp_rank`` that contradicts the rank.
    """
    dist = torch.distributed
    where = placement(cfg, dist.get_rank(group), dist.get_world_size(group))
    if cfg.parallel.pp_rank not in (0, where.pp_rank):
        raise ConfigError(
            f"parallel.pp_rank={cfg.parallel.pp_rank} contradicts {where.describe()}: leave parallel.pp_rank unset under "
            "torch.distributed (each rank takes its stage from its rank)"
        )
    return attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel, pp_rank=where.pp_rank)), where


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
