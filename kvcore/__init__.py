"""kvcore: KV-cache memory pools for LLM inference engines.

Public entry points::

    cfg = kvcore.load_config("model=llama-3-8b", "hardware=h200")
    plan = kvcore.plan_memory(cfg)        # sizes only, nothing allocated
    pools = kvcore.build_pools(cfg)       # req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator, plan

Plugins implement the hooks in :mod:`kvcore.hookspecs` with :data:`hookimpl`.
"""

from kvcore.api import Pools, build_pools, make_request, plan_memory, select
from kvcore.backend import BackendSpec, PoolRequest
from kvcore.config import EngineConfig, load_config
from kvcore.errors import ConfigError, KVCoreError, PlanningError, PluginError, SelectionError
from kvcore.hookspecs import hookimpl
from kvcore.layout import BufferLayout, PoolLayout
from kvcore.planner import MemoryPlan

__version__ = "0.1.0"

__all__ = [
    "BackendSpec",
    "BufferLayout",
    "ConfigError",
    "EngineConfig",
    "KVCoreError",
    "MemoryPlan",
    "PlanningError",
    "PluginError",
    "PoolLayout",
    "PoolRequest",
    "Pools",
    "SelectionError",
    "build_pools",
    "hookimpl",
    "load_config",
    "make_request",
    "plan_memory",
    "select",
]
