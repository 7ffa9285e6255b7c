"""What the unified factories return (:class:`UnifiedPoolBundle`): SGLang's four fields, so an engine's
configurator takes kvcore's unified pools where it took SGLang's."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvcore_unified.memory import UnifiedMemory

__all__ = ["UnifiedPoolBundle"]


class UnifiedPoolBundle(NamedTuple):
    """The pools of one unified memory.

    :param unified_memory_pool: the shared bytes and their two-ended allocator.
    :param token_to_kv_pool: the KV pool the engine stores and reads through (its tokens are virtual ids).
    :param token_to_kv_pool_allocator: hands out those virtual token ids.
    :param req_to_token_pool: the request table (with the state slots of a hybrid linear-attention model).
    """

    unified_memory_pool: UnifiedMemory
    token_to_kv_pool: Any
    token_to_kv_pool_allocator: Any
    req_to_token_pool: Any
