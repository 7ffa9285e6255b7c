"""One ``build_pools`` call selects the backend once: planning and building use that one selection."""

from __future__ import annotations

import pytest

import kvcore
import kvcore.api
import kvcore.plugins.selection
from kvcore.planning import distributed

CONFIG = ("model=qwen2.5-0.5b", "hardware=cpu", "hardware.kernels=native", "memory.max_total_tokens=256")


@pytest.fixture
def selections(monkeypatch) -> list:
    """Every backend selection made from here on (through :mod:`kvcore.api` or the selection module)."""
    made = []
    original = kvcore.plugins.selection.select_backend

    def counting(registry, request):
        made.append(request)
        return original(registry, request)

    monkeypatch.setattr(kvcore.api, "select_backend", counting)
    monkeypatch.setattr(kvcore.plugins.selection, "select_backend", counting)
    return made


@pytest.fixture
def cfg():
    return kvcore.load_config(*CONFIG)


def test_build_pools_selects_once(cfg, selections):
    pools = kvcore.build_pools(cfg)
    assert len(selections) == 1, f"build_pools selected the backend {len(selections)} times"
    assert pools.selection.backend.name == "mha" and pools.plan.max_total_num_tokens == 256


def test_build_pools_with_a_plan_selects_once(cfg, selections):
    plan = kvcore.plan_memory(cfg)
    assert len(selections) == 1  # plan_memory's own
    kvcore.build_pools(cfg, plan=plan)
    assert len(selections) == 2, f"build_pools given a plan selected the backend {len(selections) - 1} times"


def test_build_pools_in_a_process_group_selects_once(cfg, selections, monkeypatch):
    """The distributed path (each rank plans, the plans are agreed, then the rank builds) also selects once."""
    agreed = []
    monkeypatch.setattr(distributed, "active", lambda group=None: True)
    monkeypatch.setattr(distributed, "rank_config", lambda cfg, group=None: (cfg, None))
    monkeypatch.setattr(distributed, "agree", lambda plan, group=None: agreed.append(plan) or plan)
    pools = kvcore.build_pools(cfg)
    assert agreed == [pools.plan]
    assert len(selections) == 1, f"build_pools in a process group selected the backend {len(selections)} times"
