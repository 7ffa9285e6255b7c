"""kvcore: KV-cache memory pools for LLM inference engines.

Public entry points::

    cfg = kvcore.load_config("model=llama-3-8b", "hardware=h200")
    plan = kvcore.plan_memory(cfg)        # sizes only, nothing allocated
    pools = kvcore.build_pools(cfg)       # req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator, plan

Plugins implement the hooks in :mod:`kvcore.hookspecs` with :data:`hookimpl`.  The allocators and the request
table (what engines call) are here too.  Every name is imported on first use: ``import kvcore`` imports neither
torch nor a Triton kernel (so ``kvcore --help`` answers at once, and a test kit can choose interpreted or compiled
kernels before any kernel module loads).
"""

from kvcore.plugins.lazy import lazy_getattr

__version__ = "0.1.0"

#: public name -> the module defining it, imported on first use
_PUBLIC = {
    **dict.fromkeys(("Pools", "build_pools", "load_config", "make_request", "plan_memory", "select"), "kvcore.api"),
    **dict.fromkeys(("BackendSpec", "EngineMode", "PoolRequest"), "kvcore.backend"),
    "EngineConfig": "kvcore.config.schema",
    **dict.fromkeys(("ConfigError", "KVCoreError", "PlanningError", "PluginError", "SelectionError"), "kvcore.errors"),
    "hookimpl": "kvcore.hookspecs",
    **dict.fromkeys(("BufferLayout", "PoolLayout"), "kvcore.layout"),
    "MemoryPlan": "kvcore.planning.planner",
    **dict.fromkeys(("KVCache", "ReqToTokenPool"), "kvcore.pools"),
    **dict.fromkeys(("BaseTokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator"),
                    "kvcore.allocators"),
}  # fmt: skip
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC, submodules=True)
