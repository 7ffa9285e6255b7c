"""kvcore: KV-cache memory pools for LLM inference engines.

Public entry points::

    cfg = kvcore.load_config("model=llama-3-8b", "hardware=h200")
    plan = kvcore.plan_memory(cfg)        # sizes only, nothing allocated
    pools = kvcore.build_pools(cfg)       # req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator, plan

Plugins implement the hooks in :mod:`kvcore.hookspecs` with :data:`hookimpl`.  The allocators and the request
table (what engines call) are here too, imported on first use so that ``import kvcore`` loads no Triton kernel.
"""

import importlib

from kvcore.api import Pools, build_pools, load_config, make_request, plan_memory, select
from kvcore.backend import BackendSpec, PoolRequest
from kvcore.config import EngineConfig
from kvcore.errors import ConfigError, KVCoreError, PlanningError, PluginError, SelectionError
from kvcore.hookspecs import hookimpl
from kvcore.layout import BufferLayout, PoolLayout
from kvcore.planning.planner import MemoryPlan

__version__ = "0.1.0"

#: names imported on first use (their modules load Triton kernels)
_LAZY = {
    "ReqToTokenPool": "kvcore.pools",
    "KVCache": "kvcore.pools",
    "TokenToKVPoolAllocator": "kvcore.allocators",
    "PagedTokenToKVPoolAllocator": "kvcore.allocators",
    "BaseTokenToKVPoolAllocator": "kvcore.allocators",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BackendSpec",
    "BaseTokenToKVPoolAllocator",
    "KVCache",
    "PagedTokenToKVPoolAllocator",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
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
